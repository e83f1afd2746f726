"""Follow-ups: one DeepEP support rule for selection and the doctor, fp8 pass-through in the
dispatcher, the ``device`` test fixture, and DeepEP's tuned config tables in one place.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R local
experts · k top-k · L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

The rule is checked against a plain-Python restatement written here; fp8 dispatch runs through
``FlexDispatcher`` on the DeepEP emulator in a 2-rank gloo group and is compared with per-token
loops.
"""

from __future__ import annotations

import importlib
import inspect
import os
import types
from typing import Any

import pytest
import torch

from flexdispatch.backends.deepep.support import (
    deepep_support,
    deepep_support_checks,
    deepep_support_for,
    group_is_nccl_on_cuda,
)
from flexdispatch.doctor import HostFacts, deepep_checks, would_select
from flexdispatch.planner.deepep import (
    COMBINE_CONFIGS,
    DISPATCH_CONFIGS,
    combine_config,
    dispatch_config,
)
from tests.conftest import TEST_DEVICE_ENV, resolve_test_device
from tests.dist.harness import run_group

support = importlib.import_module("flexdispatch.backends.deepep.support")  # the module itself
LL_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)  # DeepEP v1.2.1 SWITCH_HIDDEN


# --------------------------------------------------------------------- 1. one support rule
def rule_reference(
    R: int,
    L: int,
    *,
    imported: bool = True,
    nccl: bool = True,
    E: int | None = None,
    W: int = 0,
    mode: str = "normal",
    H: int | None = None,
    peers: int = 8,
) -> list[str]:
    """Names of the failing conditions, in order, from DeepEP v1.2.1's rules spelled out."""
    failed = []
    if not imported:
        failed.append("import")
    if not nccl:
        failed.append("nccl_on_cuda")
    if E is not None and E % R:
        failed.append("experts")
    if R < 2 or L < 1 or R % L or peers < L:
        topo = False
    elif L == R:
        topo = R in (2, 4, 8)
    else:  # several nodes: node = rank // peers, so L must be the whole NVLink domain
        topo = peers < R and peers == L
        # NOTE: the node-count list and W are the normal kernels' (low-latency: any node count)
        topo = topo and (mode == "low_latency" or (R // L in (2, 4, 8, 16) and W == 0))
    if not topo:
        failed.append("topology")
    if mode == "low_latency" and H is not None and H not in LL_HIDDEN:
        failed.append("low_latency_hidden")
    return failed


def _fake_deep_ep() -> types.ModuleType:
    """A stand-in for the real ``deep_ep``: has ``Buffer``, is not the emulator."""
    module = types.ModuleType("deep_ep")
    module.Buffer = object  # type: ignore[attr-defined]
    return module


TOPOLOGIES = [(R, L) for R in range(1, 41) for L in range(1, R + 1) if R % L == 0]


@pytest.mark.parametrize("imported", [True, False])
@pytest.mark.parametrize("nccl", [True, False])
def test_support_checks_follow_the_rules(imported: bool, nccl: bool) -> None:
    seen = set()
    for R, L in TOPOLOGIES:
        for E in (None, 2 * R, 2 * R + 1):
            for W in (0, 5):
                for mode, H in (("normal", 3000), ("low_latency", 7168), ("low_latency", 3000)):
                    checks = deepep_support_checks(
                        R,
                        L,
                        imported=(imported, "imported?"),
                        nccl_on_cuda=(nccl, "nccl?"),
                        num_experts=E,
                        num_worst_tokens=W,
                        mode=mode,
                        hidden_size=H,
                    )
                    want = rule_reference(
                        R, L, imported=imported, nccl=nccl, E=E, W=W, mode=mode, H=H
                    )
                    got = [name for name, ok, _ in checks if not ok]
                    assert got == want, (R, L, E, W, mode, H)
                    names = [name for name, _, _ in checks]
                    assert names[:2] == ["import", "nccl_on_cuda"] and "topology" in names
                    assert ("experts" in names) == (E is not None)
                    assert ("low_latency_hidden" in names) == (mode == "low_latency")
                    seen.add(not want)
    assert seen == ({True, False} if imported and nccl else {False})


def test_support_for_returns_the_first_failure() -> None:
    fake = _fake_deep_ep()
    for R, L in TOPOLOGIES:
        for nccl in (True, False):
            for E, W in ((3 * R, 0), (3 * R + 1, 0), (2 * R, 4)):
                got = deepep_support_for(
                    R,
                    L,
                    nccl_on_cuda=(nccl, "the group is gloo"),
                    num_experts=E,
                    num_worst_tokens=W,
                    deep_ep=fake,
                )
                want = rule_reference(R, L, nccl=nccl, E=E, W=W)
                assert got[0] == (not want), (R, L, E, W, nccl, got)
                if not nccl:
                    assert got == (False, "the group is gloo")
                elif want and want[0] == "experts":
                    assert got[1] == f"num_experts={E} is not divisible by R={R}"
                elif not want:
                    assert got[1].startswith("deep_ep usable (")


def test_support_for_imports_waives_for_the_emulator_and_reads_its_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.deepep_emu.load import emulator_or_skip, load_deep_ep

    emu = emulator_or_skip()
    monkeypatch.setattr(
        support, "load_deep_ep", lambda: (None, "import deep_ep failed: OSError: no libnvshmem")
    )
    assert deepep_support_for(8, 8, nccl_on_cuda=(True, "ok")) == (
        False,
        "import deep_ep failed: OSError: no libnvshmem",
    )
    fake = _fake_deep_ep()
    monkeypatch.setattr(support, "load_deep_ep", lambda: (fake, "deep_ep imports"))
    assert deepep_support_for(8, 8, nccl_on_cuda=(True, "ok"))[0] is True
    assert deepep_support_for(8, 8, nccl_on_cuda=(False, "gloo")) == (False, "gloo")
    # the emulator lifts the NCCL requirement and fakes smaller nodes
    ok, why = deepep_support_for(2, 2, nccl_on_cuda=(False, "gloo"), deep_ep=emu)
    assert ok and "intranode" in why
    assert deepep_support_for(4, 2, nccl_on_cuda=(True, "ok"), deep_ep=emu)[0] is False
    small = load_deep_ep(nvl_peers=2)
    ok, why = deepep_support_for(4, 2, nccl_on_cuda=(False, "gloo"), deep_ep=small)
    assert ok and "2 nodes x 2 ranks" in why


def test_group_version_is_the_group_free_rule_with_the_groups_answers() -> None:
    # no process group here: R = 1 and the NCCL answer is "not NCCL on CUDA"
    fake = _fake_deep_ep()
    from tests.deepep_emu.load import emulator_or_skip

    emu = emulator_or_skip()
    for module in (fake, emu):
        for ranks_per_node in (1, 8):
            got = deepep_support(
                group=None, num_experts=8, ranks_per_node=ranks_per_node, deep_ep=module
            )
            want = deepep_support_for(
                1,
                ranks_per_node,
                nccl_on_cuda=group_is_nccl_on_cuda(None),
                num_experts=8,
                deep_ep=module,
            )
            assert got == want and got[0] is False
    assert deepep_support(group=None, num_experts=8, ranks_per_node=1, deep_ep=fake) == (
        group_is_nccl_on_cuda(None)
    )
    assert (
        "at least 2 ranks"
        in deepep_support(group=None, num_experts=8, ranks_per_node=1, deep_ep=emu)[1]
    )


def _facts(cuda: bool = True, nccl: bool = True, gpus: int = 8, deepep: bool = True) -> HostFacts:
    return HostFacts(
        cuda_available=cuda,
        nccl_available=nccl,
        gloo_available=True,
        num_gpus=gpus,
        deepep=(deepep, "deep_ep imports" if deepep else "import deep_ep failed: boom"),
    )


@pytest.mark.parametrize(
    "facts",
    [
        _facts(),
        _facts(cuda=False, gpus=0),
        _facts(nccl=False),
        _facts(deepep=False),
        _facts(gpus=4),
    ],
)
def test_doctor_uses_the_selection_rule(facts: HostFacts) -> None:
    fake = _fake_deep_ep()
    nccl_on_cuda = (facts.cuda_available and facts.nccl_available, "not NCCL on CUDA")
    for R, L in TOPOLOGIES:
        checks = {c.name: c for c in deepep_checks(R, L, facts)}
        rule = dict(
            (name, (ok, why))
            for name, ok, why in deepep_support_checks(
                R, L, imported=facts.deepep, nccl_on_cuda=nccl_on_cuda
            )
        )
        assert (checks["topology"].ok, checks["topology"].detail) == rule["topology"]
        assert (checks["import"].ok, checks["import"].detail) == facts.deepep
        choice = would_select("deepep", world_size=R, ranks_per_node=L, facts=facts)
        selection = deepep_support_for(R, L, nccl_on_cuda=nccl_on_cuda, deep_ep=fake)
        usable = facts.deepep[0] and selection[0] and facts.num_gpus >= L
        assert choice.ok == usable, (R, L, choice.reason, selection)
    # the doctor no longer carries its own copy of DeepEP's topology rule
    source = inspect.getsource(deepep_checks)
    assert "check_topology" not in source and "deepep_support_checks" in source


# --------------------------------------------------------------------- 2. fp8 pass-through
H_FP8, K_FP8 = 256, 3  # two scale columns per row


def _fp8_inputs(rank: int, R: int, E: int, H: int = H_FP8) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s fp8 rows, power-of-two scales (dequantised values are exact in bf16)."""
    g = torch.Generator().manual_seed(100 + rank)
    T = 5 + rank
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K_FP8]
    idx = idx.masked_fill(torch.rand(T, K_FP8, generator=g) < 0.25, -1)
    probs = torch.rand(T, K_FP8, generator=g).masked_fill(idx < 0, 0.0)
    q = (torch.randn(T, H, generator=g) * 4).to(torch.float8_e4m3fn)
    s = 2.0 ** torch.randint(-2, 3, (T, -(-H // 128)), generator=g).float()
    return {"q": q, "s": s, "idx": idx, "probs": probs}


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    H = q.shape[1]
    return (q.float() * s.repeat_interleave(128, dim=1)[:, :H]).to(torch.bfloat16)


def _message(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def fp8_worker(rank: int, R: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.load import emulator_or_skip

    emu = emulator_or_skip()
    E = 3 * R
    e = E // R
    d = FlexDispatcher(
        DispatchConfig(backend="deepep", ranks_per_node=R), num_experts=E, _deep_ep=emu
    )
    inputs = [_fp8_inputs(r, R, E) for r in range(R)]
    mine = inputs[rank]
    probs = mine["probs"].clone().requires_grad_(True)
    out: dict[str, Any] = {"backend": d.backend_name}

    # errors, raised before any collective (so every rank stays in step)
    q, s, idx = mine["q"], mine["s"], mine["idx"]
    out["needs_grad"] = _message(
        lambda: d.dispatch((q, s.clone().requires_grad_(True)), idx, probs)
    )
    out["scale_cols"] = _message(lambda: d.dispatch((q, s[:, :1]), idx, probs))
    out["scale_dtype"] = _message(lambda: d.dispatch((q, s.half()), idx, probs))
    out["row_dtype"] = _message(lambda: d.dispatch((q.to(torch.bfloat16), s), idx, probs))
    out["odd_hidden"] = _message(lambda: d.dispatch((q[:, :24], s[:, :1]), idx, probs))
    out["three"] = _message(lambda: d.dispatch((q, s, s), idx, probs))  # type: ignore[arg-type]

    res = d.dispatch((q, s), idx, probs)
    # per-token reference: rows by source rank, then token, for tokens with an expert here
    want_q, want_s, want_idx, want_p, src = [], [], [], [], []
    for r, inp in enumerate(inputs):
        for t, row in enumerate(inp["idx"].tolist()):
            if not any(i >= 0 and i // e == rank for i in row):
                continue
            want_q.append(inp["q"][t].view(torch.uint8))
            want_s.append(inp["s"][t])
            local = [i - rank * e if i >= 0 and i // e == rank else -1 for i in row]
            want_idx.append(torch.tensor(local))
            want_p.append(torch.where(torch.tensor(local) >= 0, inp["probs"][t], 0.0))
            src.append((r, t))
    state = res.handle.state
    out["recv_dtype"] = str(res.recv_x.dtype)
    out["rows_equal"] = bool(torch.equal(res.recv_x.view(torch.uint8), torch.stack(want_q)))
    out["scales_equal"] = bool(torch.equal(state.recv_scales, torch.stack(want_s)))
    out["idx_equal"] = bool(torch.equal(res.recv_topk_idx, torch.stack(want_idx)))
    out["probs_equal"] = bool(torch.equal(res.recv_topk_probs.detach(), torch.stack(want_p)))
    out["recv_x_grad"] = res.recv_x.requires_grad
    out["recv_probs_grad"] = res.recv_topk_probs.requires_grad

    # combine of the dequantised bf16 rows: each token gets its own row once per destination
    y = _dequant(res.recv_x, state.recv_scales)
    got = d.combine(y, res.handle)
    n_dest = torch.tensor(
        [[len({i // e for i in row if i >= 0})] for row in mine["idx"].tolist()],
        dtype=torch.float32,
    )
    want = (_dequant(mine["q"], mine["s"]).float() * n_dest).to(torch.bfloat16)
    out["combine_equal"] = bool(torch.equal(got, want))

    # the probs stay differentiable: weight each received slot by its source token
    c = torch.tensor([[float(r * 100 + t + 1)] for r, t in src]).expand(-1, K_FP8)
    (res.recv_topk_probs * c).sum().backward()
    want_grad = torch.where(
        mine["idx"] >= 0,
        torch.arange(1, mine["idx"].shape[0] + 1, dtype=torch.float32)[:, None] + rank * 100,
        0.0,
    )
    out["grad_equal"] = bool(torch.equal(probs.grad, want_grad))
    d.close()
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_fp8_tuple_through_the_dispatcher_on_the_emulator() -> None:
    for out in run_group(fp8_worker, 2, timeout=100):
        assert out["backend"] == "deepep"
        assert out["recv_dtype"] == "torch.float8_e4m3fn"
        for key in ("rows_equal", "scales_equal", "idx_equal", "probs_equal"):
            assert out[key], key
        assert out["combine_equal"] and out["grad_equal"]
        assert out["recv_x_grad"] is False and out["recv_probs_grad"] is True
        assert out["needs_grad"].startswith("ValueError") and "forward-only" in out["needs_grad"]
        assert "x[1] (fp8 scales) must have shape [" in out["scale_cols"]
        assert ", 2]" in out["scale_cols"] and "ceil(H / 128)" in out["scale_cols"]
        assert out["scale_dtype"].startswith("TypeError") and "float32" in out["scale_dtype"]
        assert out["row_dtype"].startswith("TypeError") and "float8_e4m3fn" in out["row_dtype"]
        assert out["odd_hidden"].startswith("ValueError") and "multiple of 16" in out["odd_hidden"]
        assert out["three"].startswith("TypeError") and "got 3 items" in out["three"]


def test_fp8_tuple_is_refused_by_the_torch_backend() -> None:
    from flexdispatch import DispatchConfig, FlexDispatcher

    d = FlexDispatcher(DispatchConfig(), num_experts=4)
    inp = _fp8_inputs(0, 1, 4)
    with pytest.raises(TypeError, match=r"x is an \(fp8 rows, scales\) tuple.*'torch' backend"):
        d.dispatch((inp["q"], inp["s"]), inp["idx"], inp["probs"])
    with pytest.raises(TypeError, match=r"backend='deepep'"):
        d.dispatch((inp["q"], inp["s"]), inp["idx"], inp["probs"])
    with pytest.raises(TypeError, match="fp8 rows, scales"):  # a bare fp8 tensor: the hint
        d.dispatch(inp["q"], inp["idx"], inp["probs"])


# --------------------------------------------------------------------- 3. the device fixture
def test_resolve_test_device() -> None:
    assert resolve_test_device(None, False)[0] == "cpu"
    assert resolve_test_device("", True)[0] == "cpu"
    assert resolve_test_device(" CPU ", True)[0] == "cpu"
    assert resolve_test_device("cuda", True)[0] == "cuda"
    name, why = resolve_test_device("cuda", False)
    assert name is None and "torch.cuda.is_available() is False" in why
    with pytest.raises(ValueError, match=r"FLEXDISPATCH_TEST_DEVICE='gpu'.*cpu or cuda"):
        resolve_test_device("gpu", True)


def test_device_fixture_follows_the_environment(device: torch.device) -> None:
    requested = os.environ.get(TEST_DEVICE_ENV)
    want, _ = resolve_test_device(requested, torch.cuda.is_available() if requested else False)
    assert device.type == want
    assert torch.ones(2, device=device).sum().item() == 2.0


# --------------------------------------------------------------------- 4. DeepEP config tables
def test_deepep_v1_2_1_config_tables_are_pinned() -> None:
    # DeepEP release tag v1.2.1 (commit 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee, 2025-09-15),
    # deep_ep/buffer.py, Buffer.get_dispatch_config / Buffer.get_combine_config: the entries are
    # Config(Buffer.num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv).
    assert DISPATCH_CONFIGS[2] == (24, 256, 6, 128)
    assert DISPATCH_CONFIGS[16] == (36, 288, 20, 128)
    assert DISPATCH_CONFIGS[24] == (8, 288, 32, 128)
    assert DISPATCH_CONFIGS[32] == (32, 288, 32, 128)
    assert DISPATCH_CONFIGS[160] == (28, 720, 12, 128)
    assert COMBINE_CONFIGS[8] == (4, 256, 6, 128)
    assert COMBINE_CONFIGS[16] == (4, 288, 12, 128)
    assert COMBINE_CONFIGS[32] == (1, 288, 8, 128)
    assert COMBINE_CONFIGS[64] == (1, 288, 20, 128)
    assert sorted(DISPATCH_CONFIGS) == sorted(COMBINE_CONFIGS)
    assert sorted(DISPATCH_CONFIGS) == [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
    with pytest.raises(TypeError):  # read-only: nobody can drift them at run time
        DISPATCH_CONFIGS[16] = (16, 288, 20, 128)  # type: ignore[index]


def test_package_tables_size_buffers_like_deepeps_config() -> None:
    # the planner's copy of the v1.2.1 tables sizes the NVLink buffer exactly as DeepEP's
    # Config::get_nvl_buffer_size_hint does (the emulated runtime's Config follows config.hpp)
    from tests.deepep_emu.load import emulator_or_skip

    Config = emulator_or_skip().Config
    sms = 20
    for R in DISPATCH_CONFIGS:
        for table, ours in ((DISPATCH_CONFIGS, dispatch_config), (COMBINE_CONFIGS, combine_config)):
            cfg = Config(sms, *table[R])
            assert cfg.get_nvl_buffer_size_hint(14336, R) == ours(R, sms).nvl_buffer_size_hint(
                14336, R
            ), R
