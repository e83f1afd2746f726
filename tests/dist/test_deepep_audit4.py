"""The fourth DeepEP audit's findings (issue 39, ``deepep-audit-4.md``) on 4 gloo ranks: nothing
asserts after work has started, on DeepEP's own Python layers over the emulated runtimes.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node (the emulated NVLink domain) · W worst-case rows.

One group runs every check (one spawn): the fp8 dispatch's backward in hybrid mode (P4), failed
bandwidth probes (P5, EV2), DeepEP 2.5's NVLink domain and NCCL's GIN report in selection (P15,
P6, EV3), the GPU timeout a cold JIT needs (P12), PCIe GPUs (EV9), fp8 templates in ``warmup``
(P11), V1 across nodes with too few SMs (P14), the low-latency decode path's id guard (P7, EV7),
the hosts the group's ranks run on (P9) and a hybrid combine wider than its dispatch (EV5).
``expect(name, outputs)`` holds each check's assertions, so one check can be run alone (e.g. on
the code before its fix).
"""

from __future__ import annotations

import os
import types
from typing import Any

import pytest
import torch

from tests.dist.harness import run_group


def _raises(fn: Any, kind: type = ValueError) -> str:
    try:
        fn()
    except kind as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _emu(L: int, release: str = "2.5.0") -> Any:
    from tests.deepep_emu.load import load_deep_ep

    return load_deep_ep(nvl_peers=L, release=release)


def _ep(E: int, emu: Any, **kw: Any) -> Any:
    from flexdispatch import DispatchConfig, FlexDispatcher

    cfg = DispatchConfig(backend="deepep", deepep_api="v25", **kw)
    return FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)


def fp8_backward(rank: int, out: dict[str, Any]) -> None:
    """P4: DeepSeek-V3's shape on 2 nodes of 2 (hybrid): the fp8 dispatch's backward (a cached
    dispatch of the bf16 gradient along the fp8 handle) runs and moves the rows bit for bit."""
    H, k, E, T = 7168, 8, 256, 2
    v25 = _emu(2)
    v25.emu_probes.update(nvlink_gbs=450.0, rdma_gbs=50.0)  # working probes: P4 alone
    try:
        d = _ep(E, v25, ranks_per_node=2, num_worst_tokens=8)
        _fp8_step(rank, d, H, k, E, T, out)
    finally:
        v25.emu_probes.update(nvlink_gbs=0.0, rdma_gbs=0.0)


def _fp8_step(rank: int, d: Any, H: int, k: int, E: int, T: int, out: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(rank)
    x8 = torch.randn(T, H, generator=g).to(torch.float8_e4m3fn)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    p = torch.rand(T, k, generator=g)
    res = d.dispatch((x8, torch.ones(T, H // 128)), idx, p)
    w = torch.ones((), requires_grad=True)
    out["p4_err"] = _raises(
        lambda: d.combine(res.recv_x.to(torch.bfloat16) * w, res.handle).float().sum().backward(),
        RuntimeError,
    )
    grad = torch.randn(T, H, generator=g).to(torch.bfloat16)
    got = d.backend.cached_dispatch(grad, res.handle)
    out["p4_hybrid"] = d.backend.hybrid
    out["p4_exact"] = bool(torch.equal(got, d.dispatch(grad, idx, p).recv_x))
    d.close()


def probes(rank: int, out: dict[str, Any]) -> None:
    """P5 / EV2: the emulated probes fail as DeepEP's do without nvidia-smi / ibstat (0): the
    hybrid dispatch neither divides by zero nor takes 4 SMs; one rank's measurement wins over
    the others' failures; a node's SM count is the model's on the default NVLink bandwidth."""
    E, k, H = 16, 2, 256
    x = torch.randn(3, H).bfloat16()
    idx = torch.tensor([[0, 5], [9, 14], [3, 12]])
    p = torch.rand(3, k)
    v25 = _emu(2)
    d = _ep(E, v25, ranks_per_node=2)

    def step() -> None:
        res = d.dispatch(x, idx, p)
        d.combine(res.recv_x, res.handle)

    out["p5_hybrid"] = _raises(step, Exception)
    links = d.backend._shared.links
    out["p5_links"] = (links.nvlink_gbs, links.rdma_gbs, links.num_allocated_qps)
    # P12: the buffer's GPU timeout covers a peer's cold JIT compile
    out["p12_timeout"] = d.backend._shared.buffer.runtime.timeout
    d.close()
    one = _emu(4)
    one.emu_probes["nvlink_gbs"] = 300.0 if rank == 0 else 0.0  # only rank 0 measures
    d = _ep(E, one, ranks_per_node=4)
    d.dispatch(x, idx, p)
    links = d.backend._shared.links
    buf = d.backend._shared.buffer
    out["p5_agreed"] = (links.nvlink_gbs, links.nvlink_probed)
    out["p5_sms"] = d.backend._sms(k)
    out["p5_model"] = buf.get_theoretical_num_sms(E, k, nvlink_gbs=300.0)
    out["p5_failed_model"] = buf.get_theoretical_num_sms(E, k, nvlink_gbs=1e-9)
    one.emu_probes["nvlink_gbs"] = 0.0
    d.close()


def gin_selection(rank: int, out: dict[str, Any]) -> None:
    """P6 / EV3: no GIN on the (emulated) communicator: ``auto`` falls back past V2.5 and V2
    (both assert NCCL's GIN type, V2 for R > 1: main:csrc/kernels/backend/nccl.cu:86-90) to V1,
    naming it; ``deepep_api='v25'`` / ``'elastic'`` refuse before any buffer; ``EP_DISABLE_GIN``
    (read as DeepEP's ``sscanf``: "2abc" is 2) runs; the emulated ``EPBuffer`` and
    ``ElasticBuffer`` assert as DeepEP's do."""
    import torch.distributed as dist

    from flexdispatch import DispatchConfig, FlexDispatcher

    E = 16
    v25, v2 = _emu(4), _emu(4, "2.1.0")
    v25.runtime.emu_gin["ginType"] = v2.runtime.emu_gin["ginType"] = 0
    both = {"deep_ep": v2, "deep_ep_v25": v25}
    try:
        d = FlexDispatcher(DispatchConfig(num_worst_tokens=8), num_experts=E, _deep_ep=both)
        out["p6_auto"] = (getattr(d.backend, "api", "legacy"), d.backend_reason)
        d.close()
        out["p6_ep"] = _raises(lambda: _ep(E, v25))
        cfg = DispatchConfig(backend="deepep", deepep_api="v2", num_worst_tokens=8)
        out["p6_v2"] = _raises(lambda: FlexDispatcher(cfg, num_experts=E, _deep_ep=v2))
        out["ev3_emulator"] = _raises(
            lambda: v25.EPBuffer(
                dist.group.WORLD,
                num_bytes=2 << 20,
                allow_hybrid_mode=False,
                explicitly_destroy=True,
            ).destroy(),
            RuntimeError,
        )
        out["ev3_v2_emulator"] = _raises(
            lambda: v2.ElasticBuffer(
                dist.group.WORLD,
                num_bytes=2 << 20,
                allow_hybrid_mode=False,
                explicitly_destroy=True,
            ).destroy(),
            RuntimeError,
        )
        os.environ["EP_DISABLE_GIN"] = "2abc"
        try:
            d = _ep(E, v25)
            res = d.dispatch(torch.randn(2, 64), torch.tensor([[0, 5], [9, 14]]), torch.rand(2, 2))
            out["p6_disabled"] = (d.backend_name, res.recv_x.shape[1])
            d.close()
        finally:
            del os.environ["EP_DISABLE_GIN"]
    finally:
        v25.runtime.emu_gin["ginType"] = v2.runtime.emu_gin["ginType"] = 3


def domain(rank: int, out: dict[str, Any]) -> None:
    """P15: a DeepEP 2.5 that is not the emulator (so selection cannot read the emulator's
    domain) is judged on DeepEP's NVLink domain (NCCL LSA: 2), not ``ranks_per_node`` (4, one
    node as launched): hybrid mode's notify limit makes ``auto`` fall back instead of the
    constructor raising."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.backends.deepep import support

    real = types.ModuleType("deep_ep_v25")
    for name in ("EPBuffer", "get_physical_domain_size", "topk_idx_t", "__version__"):
        setattr(real, name, getattr(_emu(2), name))
    nccl = support.group_is_nccl_on_cuda
    support.group_is_nccl_on_cuda = lambda group: (True, "NCCL group on CUDA (test)")
    try:
        cfg = DispatchConfig(deepep_api="v25", ranks_per_node=4, deepep_hybrid=True)
        d = FlexDispatcher(cfg, num_experts=4 * 127, _deep_ep={"deep_ep_v25": real})
        out["p15_auto"] = (d.backend_name, d.backend_reason)
        d.close()
    finally:
        support.group_is_nccl_on_cuda = nccl


def pcie(rank: int, out: dict[str, Any]) -> None:
    """EV9: DeepEP 2.5's ``EPBuffer`` asserts at most 2 ranks on PCIe GPUs (modelled); the
    adapter refuses such a group at selection, before any buffer."""
    import torch.distributed as dist

    v25 = _emu(4)
    v25.emu_device_name = "NVIDIA A100-PCIE-40GB"
    try:
        out["ev9_ep"] = _raises(lambda: _ep(16, v25))
        out["ev9_emulator"] = _raises(
            lambda: v25.EPBuffer(dist.group.WORLD, num_bytes=2 << 20, explicitly_destroy=True),
            AssertionError,
        )
    finally:
        v25.emu_device_name = "NVIDIA H100 80GB HBM3"


def warmup_fp8(rank: int, out: dict[str, Any]) -> None:
    """P11: ``warmup(dtype=float8_e4m3fn)`` compiles the fp8 templates (dispatch, combine and the
    backward's cached dispatch in the fp8 layout), so a captured fp8 step compiles nothing."""
    from flexdispatch.backends.deepep.v25 import buffer as v25_buffer

    E, k, H = 16, 2, 256
    v25 = _emu(2)
    d = _ep(E, v25, ranks_per_node=2, num_worst_tokens=8)
    d.warmup(H, k, dtype=torch.float8_e4m3fn, expanded=False)
    jit = v25.runtime.emu_jit_compiles
    before = sum(jit.values())
    x8 = torch.randn(2, H).to(torch.float8_e4m3fn)
    idx = torch.tensor([[0, 5], [9, 14]])
    p = torch.rand(2, k, requires_grad=True)
    real = v25_buffer.is_capturing
    v25_buffer.is_capturing = lambda: True
    try:
        with v25.runtime.emu_capture():
            res = d.dispatch((x8, torch.ones(2, H // 128)), idx, p)
            y = res.recv_x.to(torch.bfloat16) * res.recv_topk_probs.sum(1, keepdim=True).bfloat16()
            d.combine(y, res.handle).float().sum().backward()
            out["p11_compiles"] = sum(jit.values()) - before
    finally:
        v25_buffer.is_capturing = real
    d.close()


def v1_sms(rank: int, out: dict[str, Any]) -> None:
    """P14: V1 across nodes with 2 SMs is refused at construction (DeepEP's combine would
    assert after the dispatch ran)."""
    from flexdispatch import DispatchConfig, FlexDispatcher

    cfg = DispatchConfig(backend="deepep", deepep_api="v1", ranks_per_node=2, deepep_num_sms=2)
    out["p14"] = _raises(lambda: FlexDispatcher(cfg, num_experts=8, _deep_ep=_emu(2, "1.2.1")))


def decode(rank: int, out: dict[str, Any]) -> None:
    """P7 / EV7: the low-latency decode path refuses an id >= E and a repeated id on CPU, as
    every other path does (the emulator models both as traps)."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.dispatch.decode import DecodeDispatcher

    E, H, n = 8, 2048, 4
    ll = FlexDispatcher(
        DispatchConfig(backend="deepep", mode="low_latency", num_max_dispatch_tokens_per_rank=n),
        num_experts=E,
        _deep_ep=_emu(8, "1.2.1"),
    )
    dec = DecodeDispatcher(ll, num_max_dispatch_tokens_per_rank=n)
    x = torch.randn(2, H).bfloat16()
    p = torch.rand(2, 2)
    out["p7_high"] = _raises(lambda: dec.dispatch(x, torch.tensor([[0, E], [1, 2]]), p), Exception)
    out["p7_repeat"] = _raises(
        lambda: dec.dispatch(x, torch.tensor([[3, 3], [1, 2]]), p), Exception
    )
    res = dec.dispatch(x, torch.tensor([[0, 7], [1, 2]]), p)  # the group still works
    out["p7_after"] = int(res.num_recv_tokens_per_expert.sum())
    # EV7: straight to the emulated kernel, a sender naming expert 0 more than num_max times
    buf = ll.backend._shared.buffer
    five = torch.zeros(n, 2, dtype=torch.int64)  # 4 tokens x [0, 0]: 8 pairs > num_max = 4
    out["ev7_region"] = _raises(
        lambda: buf.low_latency_dispatch(torch.randn(n, H).bfloat16(), five, n, E), RuntimeError
    )
    # ids < 0 are skipped by DeepEP's kernel (dst_expert_idx >= 0), not trapped: 2 pairs sent
    below = torch.tensor([[-2, 1], [-5, -1], [3, -7], [-1, -1]])
    _, count, *_ = buf.low_latency_dispatch(torch.randn(n, H).bfloat16(), below, n, E)
    out["ev7_below"] = int(count.sum())
    ll.close()


def hosts(rank: int, out: dict[str, Any]) -> None:
    """P9: the launcher says 4 ranks per node (LOCAL_WORLD_SIZE) but the group's ranks sit 2 per
    host (a strided EP group): L is 2; interleaved hosts give 1."""
    import socket

    from flexdispatch import DispatchConfig, FlexDispatcher

    real = socket.gethostname
    try:
        for name, host in (("p9_strided", rank // 2), ("p9_interleaved", rank % 2)):
            socket.gethostname = lambda h=host: f"node-{h}"  # type: ignore[assignment]
            d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8)
            out[name] = (d.ranks_per_node, d.ranks_per_node_source)
            d.close()
    finally:
        socket.gethostname = real  # type: ignore[assignment]


def wide_combine(rank: int, out: dict[str, Any]) -> None:
    """EV5: a hybrid combine wider than its dispatch (H = 7184 bf16: dispatch rows of 7184
    columns choose 8 channels per SM, the combine's 7424-column rows do not fit 16 warps) is a
    host assert in DeepEP (combine.hpp:56), modelled; the adapter pads such dispatch rows to the
    combine's width and the step runs."""
    E, k, H = 16, 2, 7184
    v25 = _emu(2)
    v25.emu_probes.update(nvlink_gbs=450.0, rdma_gbs=50.0)  # working probes: EV5 alone
    try:
        _wide_step(v25, E, k, H, out)
    finally:
        v25.emu_probes.update(nvlink_gbs=0.0, rdma_gbs=0.0)


def _wide_step(v25: Any, E: int, k: int, H: int, out: dict[str, Any]) -> None:
    d = _ep(E, v25, ranks_per_node=2)
    x = torch.randn(2, H).bfloat16()
    idx, p = torch.tensor([[0, 5], [9, 14]]), torch.rand(2, k)
    res = d.dispatch(x, idx, p)
    out["ev5_adapter"] = tuple(d.combine(res.recv_x, res.handle).shape)
    buf = d.backend._shared.buffer
    rx, _, _, h, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=p, num_experts=E, num_max_tokens_per_rank=16, num_sms=8
    )
    wide = torch.nn.functional.pad(rx, (0, 7424 - H))
    out["ev5_emulator"] = _raises(lambda: buf.combine(wide, h, num_sms=8), RuntimeError)
    d.close()


CHECKS = (
    fp8_backward,
    probes,
    gin_selection,
    domain,
    pcie,
    warmup_fp8,
    v1_sms,
    decode,
    hosts,
    wide_combine,
)


def worker(rank: int, R: int, names: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every check (or those ``names``, e.g. to see one fail on the code before its fix)."""
    out: dict[str, Any] = {}
    for check in CHECKS:
        if not names or check.__name__ in names:
            check(rank, out)
    return out


def expect(name: str, outs: list[dict[str, Any]]) -> None:
    """The assertions of check ``name`` over every rank's output."""
    for out in outs:
        if name == "fp8_backward":
            assert out["p4_hybrid"] and out["p4_err"] == "" and out["p4_exact"], out
        elif name == "probes":
            assert out["p5_hybrid"] == "" and out["p5_links"] == (430.0, 50.0, 129), out
            assert out["p12_timeout"] == 600, out
            assert out["p5_agreed"] == (300.0, 300.0), out  # rank 0's measurement wins
            assert out["p5_sms"] == out["p5_model"] > out["p5_failed_model"] == 4, out
        elif name == "gin_selection":
            api, why = out["p6_auto"]
            assert api == "v1" and "V2 cannot run: NCCL reports ginType = NONE" in why, why
            assert "DeepEP 2.5 not used: NCCL reports ginType = NONE" in why, why
            for key in ("p6_ep", "p6_v2"):
                assert "ginType = NONE" in out[key] and "ValueError" in out[key], out
                assert "EP_DISABLE_GIN=1" in out[key], out
            assert out["p6_disabled"] == ("deepep", 64), out
            assert "ep.gin_type" in out["ev3_emulator"], out
            assert "elastic.gin_type" in out["ev3_v2_emulator"], out
        elif name == "domain":
            backend, why = out["p15_auto"]
            assert backend == "torch" and "L + e = 2 + 127" in why, why
        elif name == "pcie":
            assert "ValueError" in out["ev9_ep"] and "PCIe" in out["ev9_ep"], out
            assert "pairwise NVLink" in out["ev9_emulator"], out
        elif name == "warmup_fp8":
            assert out["p11_compiles"] == 0, out
        elif name == "v1_sms":
            assert "ValueError" in out["p14"] and "num_sms >= 4" in out["p14"], out["p14"]
        elif name == "decode":
            assert out["p7_high"].startswith("ValueError") and "8" in out["p7_high"], out
            assert out["p7_repeat"].startswith("ValueError"), out
            assert "ll.source_region" in out["ev7_region"], out
        elif name == "hosts":
            assert out["p9_strided"] == (2, "hosts"), out
            assert out["p9_interleaved"] == (1, "hosts"), out
        elif name == "wide_combine":
            assert out["ev5_adapter"] == (2, 7184), out
            assert "ep.hybrid_combine_smem" in out["ev5_emulator"], out
    if name == "decode":  # the group still works: every (token, expert) pair arrived
        assert sum(out["p7_after"] for out in outs) == 4 * 2 * 2
        assert sum(out["ev7_below"] for out in outs) == 4 * 2


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_audit4_nothing_asserts_after_work_started() -> None:
    outs = run_group(worker, 4, timeout=280)
    for check in CHECKS:
        expect(check.__name__, outs)
