"""Audit-3 (docs/deepep.md "Refused first"): worlds that look like the users', no host read on the
hot path, and the refusals, over DeepEP's own Python layer on the emulated runtime.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · L ranks per node ·
k top-k · W worst-case rows · M tokens per rank (V2).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.cuda_path import force_cuda_path
from tests.dist.harness import run_group


def _emu(L: int, R: int, release: str) -> Any:
    from tests.deepep_emu.load import load_deep_ep

    return load_deep_ep(nvl_peers=L if L < R else 8, release=release)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# --------------------------------------------------------------------- 16 ranks, 2 nodes of 8
def layer16(rank: int, R: int) -> dict[str, Any]:
    """``MoELayer`` (H = 256 bf16, 32 experts, top-4, a shared expert) on 2 emulated nodes of 8:
    V1 internode (dropless; built through ``MoELayer``, which raised at construction before
    audit-3 N1) and V2 worst-case across nodes, forward and backward against torch."""
    from flexdispatch.config import load_config
    from flexdispatch.moe import MoELayer

    T, L, H = 3, 8, 256
    cfg = load_config("tiny_cpu")
    cfg = cfg.model_copy(
        update={
            "hidden_size": H,
            "ffn_hidden_size": 16,
            "num_shared_experts": 1,
            "router": cfg.router.model_copy(update={"num_experts": 32, "topk": 4}),
        }
    )
    got = {}
    runs = (("torch", "auto", 0), ("legacy", "legacy", 0), ("elastic", "elastic", R * T))
    for name, api, W in runs:
        dispatch = cfg.dispatch.model_copy(
            update={
                "backend": "torch" if name == "torch" else "deepep",
                "deepep_api": api,
                "ranks_per_node": L,
                "num_worst_tokens": W,
            }
        )
        c = cfg.model_copy(update={"dispatch": dispatch})
        kw = {} if name == "torch" else {"_deep_ep": _emu(L, R, "2.1.0")}
        layer = MoELayer(c, seed=7, dtype=torch.bfloat16, **kw)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_(True)
        out = layer(x).output
        (out.float() * torch.randn(T, H, generator=g)).sum().backward()
        b = layer.dispatcher.backend
        got[name] = (
            out.detach().float(),
            x.grad.float(),
            layer.router.weight.grad.float(),
            getattr(b, "api", b.name),
            layer.dispatcher.num_nodes,
        )
        layer.dispatcher.check_overflow()
        layer.dispatcher.close()
    t = got["torch"]
    res = {}
    for name in ("legacy", "elastic"):
        d = got[name]
        res[name] = {
            "rel": [_rel(a, b) for a, b in zip(d[:3], t[:3], strict=True)],
            "api": d[3],
            "nodes": d[4],
        }
    return res


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_v1_and_v2_layers_on_16_ranks_as_two_nodes_of_8() -> None:
    for out in run_group(layer16, 16, timeout=560):
        assert out["legacy"]["api"] == "v1" and out["elastic"]["api"] == "v2", out
        for name in ("legacy", "elastic"):
            assert out[name]["nodes"] == 2, out
            # bf16 rows: DeepEP's combine rounds (twice across nodes), torch's does not
            assert max(out[name]["rel"]) < 3e-2, (name, out)


# --------------------------------------------------------------------- a token on 10 of 16 nodes
def past_eight_nodes(rank: int, R: int) -> dict[str, str]:
    """V1 internode on 16 emulated nodes of one rank, k = 10: rank 3 has a token with experts on
    10 nodes, past DeepEP's 8 (N4). Nothing may be lost silently (audit-4, P3's class): every
    rank raises before any token moves, on the CPU path and on the CUDA path with checks off
    (where the ids past the eighth node used to be dropped and only ``check_overflow`` told)."""
    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, T, H = 2 * R, 10, 2, 8
    emu = _emu(1, R, "2.1.0")
    idx = torch.stack([(torch.arange(k) + t + rank) % E for t in range(T)])  # 5 nodes
    if rank == 3:
        idx[1] = torch.arange(k) * 2  # experts 0, 2, .., 18: nodes 0..9
    x, p = torch.ones(T, H), torch.full((T, k), 0.1)
    out = {}
    for path in ("cpu", "cuda"):
        if path == "cuda":
            force_cuda_path()
        cfg = DispatchConfig(backend="deepep", deepep_api="v1", ranks_per_node=1)
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)
        try:
            d.dispatch(x, idx, p)
            out[path] = ""
        except ValueError as exc:
            out[path] = str(exc)
        d.close()
    return out


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_v1_token_past_eight_nodes_raises_on_every_rank() -> None:
    for rank, out in enumerate(run_group(past_eight_nodes, 16, timeout=560)):
        for path, msg in out.items():
            assert "on 10 nodes" in msg and "at most 8 nodes" in msg, (rank, path, msg)
            assert ("token 1 has experts on 10 nodes" if rank == 3 else "rank 3 has") in msg, msg


# --------------------------------------------------------------------- no host read in 300 calls
class _HostReads:
    """Counts host reads of tensor values issued by flexdispatch or DeepEP's Python layer (not by
    the emulated runtime, which stands in for DeepEP's C++/CUDA): ``aten._local_scalar_dense``
    (``.item()``, ``int()``, ``bool()``), copies to the CPU from another device, ``tolist``,
    ``cpu``, ``numpy``; and host-to-device copies (audit-4 EV4): copies from the CPU to another
    device, and tensors made from host data (``torch.tensor`` / ``as_tensor`` / ``from_numpy``:
    ``aten.lift_fresh``), which on CUDA are a pageable copy and a stream sync, and cannot be
    captured in a CUDA graph (pytorch#168991). On the CUDA code path forced on CPU no copy crosses
    a device, so the host data made into a tensor is what shows the copy a GPU would make."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.copies: list[str] = []

    @staticmethod
    def _who() -> str | None:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename.replace("\\", "/")
            if "/tests/deepep_emu/runtime/" in name:
                return None  # the emulated C++ runtime
            if "/flexdispatch/" in name or "/deep_ep/" in name or "/deep_ep_v25/" in name:
                return f"{name.rsplit('/', 2)[-1]}:{f.f_lineno}"
            f = f.f_back
        return None

    def note(self, into: list[str] | None = None) -> None:
        who = self._who()
        if who is not None:
            (self.reads if into is None else into).append(who)

    def __enter__(self) -> _HostReads:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                if func is torch.ops.aten._local_scalar_dense.default:
                    outer.note()
                elif func is torch.ops.aten.lift_fresh.default:
                    outer.note(outer.copies)  # host data made a tensor: an H2D copy on CUDA
                elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                    dst = kwargs.get("device") if func is torch.ops.aten._to_copy.default else None
                    src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
                    if func is torch.ops.aten.copy_.default:
                        dst = args[0].device
                    if dst is not None and torch.device(dst).type != src.device.type:
                        outer.note(outer.copies if src.device.type == "cpu" else None)
                return func(*args, **kwargs)

        self._mode = Mode()
        self._saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "cpu", "numpy")}
        for n, orig in self._saved.items():

            def wrapped(t: torch.Tensor, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
                outer.note()
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, n, wrapped)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for n, orig in self._saved.items():
            setattr(torch.Tensor, n, orig)


def _wide_allocations(fn: Any, numel: int) -> list[str]:
    """The ops issued by flexdispatch while ``fn()`` runs that allocate a tensor of at least
    ``numel`` elements (views and in-place results excluded): where a ``[W, H]`` mask or a second
    ``[W, H]`` copy would show (audit-4 P13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found: list[str] = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() >= numel:
                ins = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
                ptr = out.untyped_storage().data_ptr()
                if all(a.untyped_storage().data_ptr() != ptr for a in ins):
                    who = _HostReads._who()
                    if who is not None:
                        found.append(f"{who} {func}")
            return out

    with Mode():
        fn()
    return found


def many_calls(rank: int, R: int, api: str, calls: int) -> dict[str, Any]:
    """``calls`` worst-case dispatch + combine pairs on the CUDA code path (forced on CPU), the
    worst case being: every token to every rank, and token 0 naming one expert twice."""
    force_cuda_path()
    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, H, T = 4 * R, 4, 16, 6
    W = R * T
    cfg = DispatchConfig(backend="deepep", deepep_api=api, ranks_per_node=R, num_worst_tokens=W)
    emu = _emu(R, R, "2.5.0" if api == "ep" else "2.1.0")
    d = FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.arange(k) * (E // k) + (t % (E // k)) for t in range(T)])
    idx[0, 1] = idx[0, 0]  # a repeated expert: dropped to -1 on the device, counted
    probs = torch.rand(T, k, generator=g)
    # warm-up (buffer built, caches filled), then one call measured for the statistics
    res = d.dispatch(x, idx, probs)
    d.combine(res.recv_x, res.handle)
    before = d.stats.rows_sent
    res = d.dispatch(x, idx, probs)
    d.combine(res.recv_x, res.handle)
    one = d.stats.rows_sent - before
    backend = d.backend
    with _HostReads() as reads:
        for _ in range(calls):
            res = d.dispatch(x, idx, probs)
            y = d.combine(res.recv_x, res.handle)
    kept = backend._counters.kept
    sent = d.stats.rows_sent - before - one  # the safe point: one read
    err = ""
    try:
        d.check_overflow()
    except ValueError as exc:
        err = str(exc)
    wide = _wide_allocations(lambda: d.dispatch(x, idx, probs), W * H)
    if api != "legacy":
        wide += _wide_allocations(lambda: d.dispatch_expanded(x, idx, probs), W * H)
    d.close()
    return {
        "reads": reads.reads[:5],
        "n_reads": len(reads.reads),
        "copies": reads.copies[:5],
        "n_copies": len(reads.copies),
        "wide": wide,
        "kept": kept,
        "sent": sent,
        "one": one,
        "err": err,
        "y_finite": bool(torch.isfinite(y.float()).all()),
    }


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("api", ["legacy", "elastic", "ep"])
def test_300_worst_case_calls_read_nothing_on_the_host(api: str) -> None:
    calls = 300
    for out in run_group(many_calls, 2, api, calls, timeout=560):
        assert out["n_reads"] == 0, out["reads"]
        assert out["n_copies"] == 0, out["copies"]  # audit-4 P1, EV4: no H2D copy either
        assert len(out["wide"]) <= 1, out["wide"]  # P13: one [W, H] gather, no mask beside it
        assert out["kept"] < 64, out  # handles released every 64 calls (audit-3 N2)
        assert out["one"] > 0 and out["sent"] == calls * out["one"], out
        assert f"twice in a token {calls + 2} time(s)" in out["err"], out["err"]
        assert out["y_finite"]


# --------------------------------------------------------------------- capture-time rules, fp8
def capture_rules(rank: int, R: int) -> dict[str, Any]:
    """V2: a buffer build and a first-use compile inside a (patched) capture are refused by the
    adapter; after ``warmup`` the captured step compiles nothing (the emulator, which raises
    ``elastic.jit_capture`` for a new template, agrees); V1: fp8 rows with H % 32 == 16
    intranode are refused before DeepEP's receive path would trap (N5)."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch._checks import tensors
    from tests.deepep_emu.runtime import limits, strict

    E, k, H, T = 4 * R, 2, 64, 3
    emu = _emu(R, R, "2.1.0")
    cfg = DispatchConfig(backend="deepep", deepep_api="v2", num_worst_tokens=R * T)
    d = FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    p = torch.rand(T, k, generator=g)
    out: dict[str, Any] = {}
    real = tensors.is_capturing

    def captured(fn: Any) -> str:
        tensors.is_capturing = lambda: True
        try:
            with strict.emu_capture(emu._C):
                fn()
            return ""
        except (RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            tensors.is_capturing = real

    out["cold"] = captured(lambda: d.dispatch(x, idx, p))
    d.warmup(H, k, expanded=False, backward=False)

    def step() -> None:
        res = d.dispatch(x, idx, p)
        d.combine(res.recv_x, res.handle)

    out["warm"] = captured(step)
    wide = torch.randn(T, 2 * H, generator=g).to(torch.bfloat16)
    out["new_shape"] = captured(lambda: d.dispatch(wide, idx, p))
    buf = d.backend._shared.buffer

    def raw() -> None:
        buf.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=T + 1, num_sms=2)

    try:
        with strict.emu_capture(emu._C):
            raw()
        out["emu"] = ""
    except limits.DeepEPHostAssert as exc:
        out["emu"] = str(exc)
    d.close()
    # a dropless dispatch (DeepEP waits on the CPU for its counts) is refused inside a capture,
    # after a warm eager one (so nothing else would be refused): V1, V2, V2.5
    for api, rel in (("legacy", "2.1.0"), ("elastic", "2.1.0"), ("ep", "2.5.0")):
        cfg = DispatchConfig(backend="deepep", deepep_api=api)
        dl = FlexDispatcher(cfg, num_experts=E, _deep_ep=_emu(R, R, rel))
        dl.dispatch(x, idx, p)
        out[f"dropless_{api}"] = captured(lambda dl=dl: dl.dispatch(x, idx, p))
        dl.close()
    v1 = FlexDispatcher(DispatchConfig(backend="deepep", deepep_api="v1"), num_experts=E,
                        _deep_ep=_emu(R, R, "2.1.0"))  # fmt: skip
    rows = torch.zeros(T, 48).to(torch.float8_e4m3fn)
    try:
        v1.dispatch((rows, torch.ones(T, 1)), idx, p)
        out["fp8"] = ""
    except ValueError as exc:
        out["fp8"] = str(exc)
    v1.close()
    return out


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_capture_rules_and_fp8_rows() -> None:
    for out in run_group(capture_rules, 2, timeout=280):
        assert "ElasticBuffer would be created" in out["cold"] and "warmup" in out["cold"], out
        assert out["warm"] == "", out["warm"]
        assert "compile its dispatch kernel" in out["new_shape"], out["new_shape"]
        assert "elastic.jit_capture" in out["emu"], out["emu"]
        assert "multiple of 32" in out["fp8"] and "H=48" in out["fp8"], out["fp8"]
        for api in ("legacy", "elastic", "ep"):
            msg = out[f"dropless_{api}"]
            assert msg.startswith("RuntimeError") and "dropless dispatch waits" in msg, msg
