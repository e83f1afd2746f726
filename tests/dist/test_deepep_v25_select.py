"""DeepEP 2.5 (``deepep_api="v25"``) beside V1 / V2: selection, refusals, JIT buckets, warm-up
before capture, overlap (``defer_epilogue``), expert alignment, fp8 — one 2-rank gloo group.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · W worst-case rows · M = ``num_max_tokens_per_rank``.

``auto`` gets both emulated packages through the test hook (``{"deep_ep": 2.1.0,
"deep_ep_v25": 2.5.0}``), or one of them, or a different one per rank. A CUDA-graph capture is
emulated: the adapter's ``is_capturing`` answers True and the emulated runtime's
``emu_capture()`` makes a first-use compile an error, as on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import all_inputs, ref_dispatch
from tests.dist.test_contract import E_PER_RANK, H, K


def _raises(fn: Any, kind: type = ValueError) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    return ""


def _emus(L: int) -> tuple[Any, Any, Any]:
    from tests.deepep_emu.load import load_deep_ep

    return (
        load_deep_ep(nvl_peers=L, release="2.5.0"),
        load_deep_ep(nvl_peers=L, release="2.1.0"),
        load_deep_ep(nvl_peers=L, release="1.2.1"),
    )


def selection(rank: int, R: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    E = E_PER_RANK * R
    v25, v2, v1 = _emus(R)
    both = {"deep_ep": v2, "deep_ep_v25": v25}
    out: dict[str, Any] = {}

    def pick(cfg: DispatchConfig, hook: Any, E: int = E) -> tuple[str, str, str]:
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=hook)
        api = getattr(d.backend, "api", "legacy") if d.backend_name == "deepep" else "torch"
        d.close()
        return api, d.backend_reason, d.backend_name

    worst = {"num_worst_tokens": 4 * R}
    out["auto_worst"] = pick(DispatchConfig(**worst), both)
    out["deepep_worst"] = pick(DispatchConfig(backend="deepep", **worst), both)
    out["auto_bound"] = pick(DispatchConfig(num_max_dispatch_tokens_per_rank=64), both)
    out["auto_unbound"] = pick(DispatchConfig(), both)
    out["auto_ll"] = pick(DispatchConfig(mode="low_latency"), both)
    out["auto_v2_only"] = pick(DispatchConfig(**worst), v2)
    out["auto_v25_only"] = pick(DispatchConfig(), v25)
    # rank 1 has no DeepEP 2.5: every rank runs V2
    out["auto_split"] = pick(DispatchConfig(**worst), both if rank == 0 else {"deep_ep": v2})
    out["ep"] = pick(DispatchConfig(backend="deepep", deepep_api="v25"), v25)
    out["ep_missing"] = _raises(
        lambda: pick(DispatchConfig(backend="deepep", deepep_api="v25"), v1)
    )
    out["ep_auto_missing"] = pick(DispatchConfig(deepep_api="v25"), v1)
    # rank 1 has no DeepEP 2.5 / no V2: backend='deepep' raises on every rank, not on rank 1
    # alone (rank 0 built V2 and waited in its first collective)
    out["ep_split"] = _raises(
        lambda: pick(DispatchConfig(backend="deepep", deepep_api="v25"), v25 if rank == 0 else v1)
    )
    out["v2_split"] = _raises(
        lambda: pick(DispatchConfig(backend="deepep", deepep_api="v2"), v1 if rank else v2)
    )
    out["ep_ll"] = _raises(
        lambda: pick(DispatchConfig(backend="deepep", deepep_api="v25", mode="low_latency"), v25)
    )
    out["ep_odd_w"] = _raises(
        lambda: pick(DispatchConfig(backend="deepep", deepep_api="v25", num_worst_tokens=5), v25)
    )
    out["ep_experts"] = _raises(
        lambda: pick(DispatchConfig(backend="deepep", deepep_api="v25"), v25, E=E + 1)
    )
    # two emulated nodes of one rank: hybrid mode needs L + e <= 128 notify threads
    v25_nodes = _emus(1)[0]
    big = 2 * 128
    out["hybrid_on"] = _raises(
        lambda: pick(
            DispatchConfig(backend="deepep", deepep_api="v25", deepep_hybrid=True), v25_nodes, big
        )
    )
    out["hybrid_auto"] = pick(DispatchConfig(backend="deepep", deepep_api="v25"), v25_nodes, big)
    out["hybrid_small"] = pick(DispatchConfig(backend="deepep", deepep_api="v25"), v25_nodes)
    return out


def refusals(rank: int, R: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    E = E_PER_RANK * R
    v25 = _emus(R)[0]
    inputs = all_inputs(5, R=R, E=E, k=K, H=H)
    mine = inputs[rank]
    out: dict[str, Any] = {"T": mine.x.shape[0], "last_T": inputs[-1].x.shape[0]}

    def make(**kw: Any) -> Any:
        cfg = DispatchConfig(backend="deepep", deepep_api="v25", **kw)
        return FlexDispatcher(cfg, num_experts=E, _deep_ep=v25)

    # worst-case, over W / R = 2 tokens with checks off: a rank sends its first 2 tokens
    # (raising alone would leave its peers inside DeepEP's collective, audit-3 N7), its other
    # tokens combine to zero (plus the bias), the backward gives them zero gradients, and
    # check_overflow raises (a dropless bound grows instead: beyond_the_bound)

    def over(d: Any, name: str) -> None:
        x = mine.x.clone().requires_grad_()
        p = mine.probs.clone().requires_grad_()
        res = d.dispatch(x, mine.idx, p)
        n = min(2, x.shape[0])
        sent = [dataclasses.replace(i, x=i.x[:2], idx=i.idx[:2], probs=i.probs[:2]) for i in inputs]
        want = ref_dispatch(sent, rank, E).x
        got = res.recv_x[: want.shape[0]]
        back = d.combine(res.recv_x, res.handle)
        bias = torch.ones_like(mine.x)
        with_bias = d.backend.combine_bias(res.recv_x.detach(), res.handle, bias)
        (back.float().sum() + (res.recv_topk_probs * 1.0).sum()).backward()
        out[name + "_rows"] = bool(torch.equal(got, want))
        out[name + "_tail"] = (
            list(back.shape) == list(mine.x.shape)
            and bool(back[n:].eq(0).all())
            and bool(with_bias[n:].eq(1).all())
            and bool(x.grad[n:].eq(0).all())
            and bool(p.grad[n:].eq(0).all())
            and bool(x.grad[:n].ne(0).any())
        )
        out[name] = _raises(d.check_overflow)
        d.close()

    over(make(num_worst_tokens=2 * R), "over_w")
    # checks on: only the last rank is over W / R, and every rank raises naming it
    d = make(num_worst_tokens=R * inputs[0].x.shape[0], checks=True)
    out["over_w_checks"] = _raises(lambda: d.dispatch(mine.x, mine.idx, mine.probs))
    d.close()
    d = make()
    dup = mine.idx.clone()
    dup[0, 1] = dup[0, 0] = 0  # one expert named twice in token 0 (a device trap in DeepEP)
    out["duplicate"] = _raises(lambda: d.dispatch(mine.x, dup, mine.probs))
    res = d.dispatch(mine.x, mine.idx, mine.probs)  # the group still works
    out["after"] = bool(torch.equal(res.recv_x, ref_dispatch(inputs, rank, E).x))
    d.close()
    return out


def jit_and_capture(rank: int, R: int) -> dict[str, Any]:
    """Buckets: dispatchers for 14 sizes W / R = 1, 4, .., 40 compile 3 kernel sets (16, 32,
    64), not 14; a first use inside a capture raises with the fix, after ``warmup`` nothing
    compiles."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.backends.deepep.v25 import buffer as v25_buffer

    E = E_PER_RANK * R
    v25 = _emus(R)[0]
    jit = v25.runtime.emu_jit_compiles
    out: dict[str, Any] = {}

    def make(W: int) -> Any:
        cfg = DispatchConfig(backend="deepep", deepep_api="v25", num_worst_tokens=W)
        return FlexDispatcher(cfg, num_experts=E, _deep_ep=v25)

    g = torch.Generator().manual_seed(rank)
    before = dict(jit)
    for per_rank in range(1, 41, 3):  # a serving run: one dispatcher per captured batch size
        d = make(R * per_rank)
        T = 1 + (per_rank * 7 + rank) % per_rank
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        res = d.dispatch(torch.randn(T, H, generator=g), idx, torch.rand(T, K, generator=g))
        d.combine(res.recv_x, res.handle)
        d.close()
    out["buckets"] = {k: jit[k] - before.get(k, 0) for k in jit}
    # a first use inside a capture: the adapter refuses before DeepEP would compile
    real = v25_buffer.is_capturing
    v25_buffer.is_capturing = lambda: True
    d = make(R * 100)  # bucket 128: nothing compiled for it yet
    with v25.runtime.emu_capture():
        out["capture_cold"] = _raises(lambda: d.dispatch_expanded(*_tiny(E, rank)), RuntimeError)
    v25_buffer.is_capturing = real
    d.warmup(H, K, dtype=torch.float32)
    before = dict(jit)
    v25_buffer.is_capturing = lambda: True
    with v25.runtime.emu_capture():
        x, idx, p = _tiny(E, rank)
        x.requires_grad_()
        res = d.dispatch_expanded(x, idx, p)
        d.combine(res.recv_x * res.recv_topk_probs[:, None], res.handle).sum().backward()
        res = d.dispatch(x, idx, p)
        d.combine(res.recv_x, res.handle).sum().backward()
    v25_buffer.is_capturing = real
    out["capture_warm"] = sum(jit.values()) - sum(before.values())
    # the emulated runtime itself: a first use inside a capture is DeepJIT's error
    buf = d.backend._shared.buffer
    x, idx, _ = _tiny(E, rank)
    with v25.runtime.emu_capture():
        out["emu_capture"] = _raises(
            lambda: buf.dispatch(
                x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=8, num_sms=8
            ),
            RuntimeError,
        )
    d.close()
    return out


def _tiny(E: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank + 50)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3)])
    return torch.randn(3, H, generator=g), idx, torch.rand(3, K, generator=g)


def features(rank: int, R: int) -> dict[str, Any]:
    """Overlap (defer_epilogue), expert alignment with DeepEP's zero padding, fp8, SMs."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.runtime import ep as emu_ep

    E, width = E_PER_RANK * R, 256
    v25 = _emus(R)[0]
    inputs = all_inputs(9, R=R, E=E, k=K, H=width, dtype=torch.bfloat16, exact=False)
    mine = inputs[rank]
    out: dict[str, Any] = {}
    deferred: list[bool] = []
    real = emu_ep.EPRuntime.dispatch

    def spy(self: Any, *args: Any) -> Any:
        deferred.append(bool(args[-1]))
        return real(self, *args)

    emu_ep.EPRuntime.dispatch = spy  # type: ignore[method-assign]
    cfg = DispatchConfig(backend="deepep", deepep_api="v25", expert_alignment=8)
    d = FlexDispatcher(cfg, num_experts=E, _deep_ep=v25)
    a = d.dispatch_expanded(mine.x, mine.idx, mine.probs)
    pending = d.dispatch_expanded_start(mine.x, mine.idx, mine.probs)
    b = pending.wait()
    emu_ep.EPRuntime.dispatch = real  # type: ignore[method-assign]
    out["deferred"] = deferred
    ya = d.combine(a.recv_x * a.recv_topk_probs[:, None].to(torch.bfloat16), a.handle)
    yb = d.combine(b.recv_x * b.recv_topk_probs[:, None].to(torch.bfloat16), b.handle)
    out["overlap_equal"] = bool(torch.equal(ya, yb)) and torch.equal(
        a.num_recv_tokens_per_expert, b.num_recv_tokens_per_expert
    )
    counts = a.num_recv_tokens_per_expert
    starts = torch.cumsum(counts, 0) - counts
    e = E // R
    real_rows = torch.tensor(
        [
            int(((mine_idx := inp.idx) // e == rank).logical_and(mine_idx >= 0).any(1).sum())
            for inp in inputs
        ]
    )
    pad_ok = True
    got = torch.zeros(e, dtype=torch.int64)
    for j in range(e):
        seg_p = a.recv_topk_probs[starts[j] : starts[j] + counts[j]]
        n = int((seg_p != 0).sum())
        got[j] = n
        pad_ok &= bool((a.recv_x[starts[j] + n : starts[j] + counts[j]] == 0).all())
    want = torch.zeros(e, dtype=torch.int64)
    for inp in inputs:
        for row, pr in zip(inp.idx.tolist(), inp.probs.tolist(), strict=True):
            for i, p in zip(row, pr, strict=True):
                if i >= 0 and i // e == rank and p != 0:
                    want[i - rank * e] += 1
    out["aligned"] = bool((counts % 8 == 0).all()) and bool(torch.equal(got, want)) and pad_ok
    out["real_rows"] = int(real_rows.sum())
    # fp8 rows and scales pass through (expanded: each row lands once per local expert)
    x8 = mine.x.float().clamp(-400, 400).to(torch.float8_e4m3fn)
    sf = torch.rand(x8.shape[0], width // 128, generator=torch.Generator().manual_seed(rank))
    r8 = d.dispatch((x8, sf), mine.idx, mine.probs)
    ref = ref_dispatch(inputs, rank, E)
    ref8 = ref.x.float().clamp(-400, 400).to(torch.float8_e4m3fn)
    out["fp8"] = bool(torch.equal(r8.recv_x.view(torch.uint8), ref8.view(torch.uint8)))
    # the analytic SM count, agreed by every rank, is what DeepEP's handle carries
    out["sms"] = (d.backend._shared.sms.get((E, K)), a.handle.state.handle.num_sms)
    d.close()
    return out


def overlap_hazards(rank: int, R: int) -> dict[str, str]:
    """Audit-4 P2, EV1, EV8: DeepEP 2.5's deferred epilogue reads the buffer's shared receive
    slots at ``wait()`` (the emulator models the region), so any call on the buffer between
    ``dispatch_expanded_start`` and ``wait()`` — a second micro-batch, another layer's combine,
    a growth, the last user's ``close()`` — must not change what ``wait()`` returns. Each case
    returns "" when the rows equal an eager ``dispatch_expanded`` of the same inputs, dropless
    and worst-case, else what differed (or raised)."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.runtime import ep as emu_ep

    E = E_PER_RANK * R
    v25 = _emus(R)[0]
    mb = [all_inputs(seed, R=R, E=E, k=K, H=H) for seed in (21, 22)]
    T = max(i.x.shape[0] for inputs in mb for i in inputs)
    out: dict[str, str] = {}
    emu_ep.ATOMIC_ORDER = False  # NOTE: rows in arrival order, so eager and overlapped compare

    def run(name: str, d: Any, fn: Any, want: Any) -> None:
        try:
            got = fn()
        except Exception as exc:  # the emulated GPU's trap is the result
            out[name] = f"{type(exc).__name__}: {exc}"[:300]
            return
        same = (
            torch.equal(got.num_recv_tokens_per_expert, want.num_recv_tokens_per_expert)
            and torch.equal(got.recv_x, want.recv_x)
            and torch.equal(got.recv_topk_probs, want.recv_topk_probs)
        )
        out[name] = "" if same else "rows differ from the eager dispatch"

    try:
        for W in (0, R * T):
            cfg = DispatchConfig(backend="deepep", deepep_api="v25", num_worst_tokens=W)
            d, other = (FlexDispatcher(cfg, num_experts=E, _deep_ep=v25) for _ in range(2))
            a, b = mb[0][rank], mb[1][rank]
            eager = [d.dispatch_expanded(m.x, m.idx, m.probs) for m in (a, b)]
            # two micro-batches in flight on one buffer
            p0 = d.dispatch_expanded_start(a.x, a.idx, a.probs)
            p1 = d.dispatch_expanded_start(b.x, b.idx, b.probs)
            run(f"second_start_W{W}", d, p0.wait, eager[0])
            run(f"second_wait_W{W}", d, p1.wait, eager[1])
            # another layer's combine on the same buffer before the wait
            res = other.dispatch_expanded(b.x, b.idx, b.probs)
            p0 = d.dispatch_expanded_start(a.x, a.idx, a.probs)
            other.combine(res.recv_x, res.handle)
            run(f"combine_W{W}", d, p0.wait, eager[0])
            # a wider layer grows (rebuilds) the shared buffer before the wait (EV8)
            wide = torch.zeros(b.x.shape[0], 1 << 15, dtype=b.x.dtype)  # > the 2 MiB step
            p0 = d.dispatch_expanded_start(a.x, a.idx, a.probs)
            built = d.backend._shared.allocations
            other.dispatch_expanded(wide, b.idx, b.probs)
            grew = d.backend._shared.allocations > built
            out[f"grew_W{W}"] = "" if grew else "the wide layer did not rebuild the buffer"
            run(f"growth_W{W}", d, p0.wait, eager[0])
            # the last users close (the buffer is destroyed) before the wait (EV8)
            p0 = d.dispatch_expanded_start(a.x, a.idx, a.probs)
            other.close()
            d.close()
            run(f"close_W{W}", d, p0.wait, eager[0])
    finally:
        emu_ep.ATOMIC_ORDER = True
    return out


def beyond_the_bound(rank: int, R: int) -> dict[str, Any]:
    """Audit-4 P3: dropless V2 (``elastic``) and V2.5 (``ep``, and ``auto`` where only DeepEP 2.5
    imports), the default bound (128), rank 0 under it (T = 50) and rank 1 over it (T = 140):
    every rank grows to rank 1's bucket (256; a rank grown alone to its own T would leave the
    ranks on different bounds, which DeepEP's kernels trap on), and every token comes back,
    forward and gradient, with nothing to report. Rank 0 runs with FLEXDISPATCH_CHECKS=1 and
    rank 1 without (a per-process setting: both gather the same five ints on the group itself;
    issue 44: no side group is built).

    Identities that need no reference: combine of ``recv_x * recv_topk_probs.sum(1)`` (expanded:
    ``recv_x * recv_probs``) is ``x[t] * probs[t].sum()``; with ``g`` the output's gradient,
    ``x.grad[t] = g[t] * probs[t].sum()`` and ``probs.grad[t, j] = (g[t] * x[t]).sum()``."""
    import os

    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, H = 4 * R, 2, 2  # NOTE: fp32 rows this narrow are combined exactly, one per column
    v25, v2, _ = _emus(R)
    T = 50 if rank == 0 else 140  # rank 0 under the default bound 128, rank 1 over it
    if rank == 0:
        os.environ["FLEXDISPATCH_CHECKS"] = "1"
    g = torch.Generator().manual_seed(rank + 7)
    x0 = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    p0 = torch.rand(T, k, generator=g) + 0.5
    gout = torch.randn(T, H, generator=g)
    want_out = x0 * p0.sum(1, keepdim=True)
    want_gx = gout * p0.sum(1, keepdim=True)
    want_gp = (gout * x0).sum(1, keepdim=True).expand(T, k)
    runs = {
        "ep": (DispatchConfig(backend="deepep", deepep_api="v25", checks=False), v25),
        "elastic": (DispatchConfig(backend="deepep", deepep_api="v2", checks=False), v2),
        "auto_v25_only": (DispatchConfig(checks=False), v25),
    }
    out: dict[str, Any] = {}
    for name, (cfg, hook) in runs.items():
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=hook)
        errs = []
        for expanded in (False, True):
            x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
            if expanded:
                res = d.dispatch_expanded(x, idx, p)
                y = res.recv_x * res.recv_topk_probs[:, None]
            else:
                res = d.dispatch(x, idx, p)
                y = res.recv_x * res.recv_topk_probs.sum(1, keepdim=True)
            back = d.combine(y, res.handle)
            back.backward(gout)
            assert x.grad is not None and p.grad is not None
            errs.append(
                max(
                    float((back - want_out).abs().max()),
                    float((x.grad - want_gx).abs().max()),
                    float((p.grad - want_gp).abs().max()),
                )
            )
        out[name] = {
            "api": getattr(d.backend, "api", d.backend_name),
            "reason": d.backend_reason,
            "err": max(errs),
            "bound": d.backend.num_max_tokens_per_rank,
            "overflow": _raises(d.check_overflow),
        }
        d.close()
    os.environ.pop("FLEXDISPATCH_CHECKS", None)
    return out


def capture_epilogue(rank: int, R: int) -> dict[str, str]:
    """A worst-case ``dispatch_expanded_start`` launched eagerly, then a CUDA-graph capture
    (emulated) begins before its ``wait()``: a dispatch on the same buffer, or the ``wait()``,
    inside the capture raises (its epilogue would only be recorded into the graph, never run);
    after the capture the ``wait()`` gives the eager rows."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.backends.deepep.v25 import buffer as v25_buffer
    from tests.deepep_emu.runtime import ep as emu_ep

    E = E_PER_RANK * R
    v25 = _emus(R)[0]
    mine = all_inputs(23, R=R, E=E, k=K, H=H)[rank]
    T = 9  # NOTE: more than any rank's tokens (5 + 2 * rank)
    cfg = DispatchConfig(backend="deepep", deepep_api="v25", num_worst_tokens=R * T)
    d = FlexDispatcher(cfg, num_experts=E, _deep_ep=v25)
    emu_ep.ATOMIC_ORDER = False  # NOTE: rows in arrival order, so eager and overlapped compare
    out: dict[str, str] = {}
    real = v25_buffer.is_capturing
    try:
        d.warmup(H, K, dtype=mine.x.dtype, expanded=True)
        want = d.dispatch_expanded(mine.x, mine.idx, mine.probs)
        p = d.dispatch_expanded_start(mine.x, mine.idx, mine.probs)
        v25_buffer.is_capturing = lambda: True
        with v25.runtime.emu_capture():
            out["dispatch"] = _raises(
                lambda: d.dispatch_expanded(mine.x, mine.idx, mine.probs), RuntimeError
            )
            out["wait"] = _raises(p.wait, RuntimeError)
        v25_buffer.is_capturing = real
        got = p.wait()
        out["after"] = "" if torch.equal(got.recv_x, want.recv_x) else "rows differ"
    finally:
        v25_buffer.is_capturing = real
        emu_ep.ATOMIC_ORDER = True
        d.close()
    return out


def agreed_rows(rank: int, R: int) -> dict[str, str]:
    """A row refusal that holds on one rank only (rank 1's device has too little shared memory
    for one dispatch warp): every rank raises before any kernel, rank 1 with DeepEP's limit, rank
    0 naming rank 1, dropless and worst-case with checks (before: rank 1 alone, its peer left in
    the dispatch)."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.backends.deepep.v25 import layout as v25_layout

    E = E_PER_RANK * R
    v25 = _emus(R)[0]
    mine = all_inputs(24, R=R, E=E, k=K, H=H)[rank]
    real = v25_layout.device_smem
    # NOTE: restored by the pool
    v25_layout.device_smem = lambda device: 64 if rank == 1 else real(device)
    out: dict[str, str] = {}
    for name, W, checks in (("dropless", 0, False), ("worst", 16 * R, True)):
        cfg = DispatchConfig(backend="deepep", deepep_api="v25", num_worst_tokens=W, checks=checks)
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=v25)
        out[name] = _raises(lambda d=d: d.dispatch(mine.x, mine.idx, mine.probs))
        d.close()
    return out


def growth_fits(rank: int, R: int) -> dict[str, Any]:
    """A dropless bound that grows past what one rank's memory holds (rank 1's emulated device
    has 1.5 times the first buffer free: issue 44, Q3 counts what DeepEP's allocator can get, not
    PyTorch's cache): every rank raises at the same call, naming the rank, T, M, the bytes and the
    setting, instead of rank 1 failing its allocation inside the collective rebuild while its peer
    waits; afterwards the old bound serves a small batch again."""
    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, H = 4 * R, 2, 1024  # NOTE: wide enough that 1024 tokens outgrow the 2 MiB first build
    v25, v2, _ = _emus(R)
    out: dict[str, Any] = {}
    for api, hook in (("ep", v25), ("elastic", v2)):
        cfg = DispatchConfig(backend="deepep", deepep_api=api, checks=False)
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=hook)

        def step(T: int, d: Any = d) -> None:
            idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
            res = d.dispatch(torch.randn(T, H), idx, torch.rand(T, k))
            d.combine(res.recv_x, res.handle)

        step(50)  # built for the default bound (128)
        if rank == 1:
            free = int(1.5 * d.backend._shared.num_bytes)
            hook.emu_device_memory = {"free": free, "torch_reserved": 0, "torch_allocated": 0}
        T = 600 if rank == 1 else 50  # bucket 1024 on every rank: about 5 times the bytes
        try:
            out[api] = _raises(lambda T=T, step=step: step(T))
            out[f"{api}_after"] = (
                _raises(lambda step=step: step(50)) or d.backend.num_max_tokens_per_rank
            )
        finally:
            hook.emu_device_memory = None
        d.close()
    return out


def sm_models_across_growth(rank: int, R: int) -> list[int]:
    """DeepEP 2.5's SM model (its bandwidth probes and an all-reduce with a host read) runs once
    per (E, k): a dropless bound that grows mid-run (rank 1 T = 8, then 600) rebuilds the buffer
    but keeps the agreed count. Returns the model's runs after each dispatch, then the bound and
    the buffers built."""
    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, H = 4 * R, 2, 1024  # NOTE: wide enough that 600 tokens outgrow the 2 MiB first build
    v25, _, _ = _emus(R)
    runs = [0]
    real = v25.EPBuffer.get_theoretical_num_sms

    def counted(self: Any, *args: Any, **kw: Any) -> int:
        runs[0] += 1
        return real(self, *args, **kw)

    v25.EPBuffer.get_theoretical_num_sms = counted
    cfg = DispatchConfig(backend="deepep", deepep_api="v25", checks=False)
    d = FlexDispatcher(cfg, num_experts=E, _deep_ep=v25)
    seen = []
    try:
        for T in (8, 600 if rank == 1 else 8, 8):
            idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
            d.dispatch(torch.randn(T, H), idx, torch.rand(T, k))
            seen.append(runs[0])
        seen += [d.backend.num_max_tokens_per_rank, d.backend._shared.allocations]
    finally:
        v25.EPBuffer.get_theoretical_num_sms = real
        d.close()
    return seen


def worker(rank: int, R: int) -> dict[str, Any]:
    return {
        "selection": selection(rank, R),
        # NOTE: jit first: its counts start from no compiled bucket (refusals compiles 16's)
        "jit": jit_and_capture(rank, R),
        "refusals": refusals(rank, R),
        "features": features(rank, R),
        "overlap": overlap_hazards(rank, R),
        "beyond": beyond_the_bound(rank, R),
        "fits": growth_fits(rank, R),
        "capture": capture_epilogue(rank, R),
        "sm_models": sm_models_across_growth(rank, R),
        "rows": agreed_rows(rank, R),
    }


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_ep_selection_refusals_jit_and_features() -> None:
    R = 2
    for rank, out in enumerate(run_group(worker, R, timeout=220)):
        s = out["selection"]
        for key in ("auto_worst", "deepep_worst", "auto_bound", "auto_v25_only", "ep"):
            api, reason, name = s[key]
            assert api == "v25" and name == "deepep", (key, s[key])
            assert "deep_ep_v25.EPBuffer" in reason, (key, reason)
        assert "worst-case mode: DeepEP 2.5" in s["auto_worst"][1], s["auto_worst"]
        assert "num_max_dispatch_tokens_per_rank=64 set" in s["auto_bound"][1], s["auto_bound"]
        assert s["auto_unbound"][0] == "v1", s["auto_unbound"]  # V1 takes any T
        assert "'v25' for V2 / V2.5" in s["auto_unbound"][1], s["auto_unbound"]
        assert s["auto_ll"][0] == "v1" and "low-latency" in s["auto_ll"][1], s["auto_ll"]
        assert s["auto_v2_only"][0] == "v2", s["auto_v2_only"]
        api, reason, _ = s["auto_split"]
        assert api == "v2", s["auto_split"]  # rank 0 has V2.5, rank 1 not
        assert rank == 1 or "DeepEP 2.5 is not the choice of every rank" in reason, reason
        # issue 44 (Q1): the hint names only generations that can run here (this 1.2.1 module
        # has no ElasticBuffer: V2 is not suggested)
        assert "deep_ep_v25" in s["ep_missing"] and "deepep_api='v1'," in s["ep_missing"]
        assert "'v2'" not in s["ep_missing"].split("; use ")[-1], s["ep_missing"]
        assert s["ep_auto_missing"][2] == "torch", s["ep_auto_missing"]
        for key, missing in (("ep_split", "deep_ep_v25"), ("v2_split", "no ElasticBuffer")):
            want = missing if rank == 1 else "but not on every rank"
            assert want in s[key], (key, s[key])
        assert "deepep_api='v25'" in s["ep_auto_missing"][1], s["ep_auto_missing"]
        assert "low-latency" in s["ep_ll"], s["ep_ll"]
        assert "not a multiple of R=2" in s["ep_odd_w"], s["ep_odd_w"]
        assert "not divisible by R=2" in s["ep_experts"], s["ep_experts"]
        assert "L + e = 1 + 128" in s["hybrid_on"] and "deepep_hybrid=False" in s["hybrid_on"]
        assert "direct mode over 2 nodes" in s["hybrid_auto"][1], s["hybrid_auto"]
        assert "hybrid mode over 2 nodes" in s["hybrid_small"][1], s["hybrid_small"]

        assert out["sm_models"] == [1, 1, 1, 1024, 2], out["sm_models"]  # rebuilt, not re-run
        for name, b in out["beyond"].items():  # P3: more tokens than the default bound
            assert b["api"] == ("v2" if name == "elastic" else "v25"), (name, b)
            assert b["err"] < 1e-4 and b["overflow"] == "", (name, b)
            assert b["bound"] == 256, (name, b)  # bucket(140), grown on every rank
        assert "grown to the largest T" in out["beyond"]["auto_v25_only"]["reason"], out
        for api in ("ep", "elastic"):  # every rank raises, naming rank 1, T, M and the bytes
            msg = out["fits"][api]
            assert "num_max_dispatch_tokens_per_rank=1024" in msg and "rank(s) 1" in msg, msg
            assert "largest T a rank dispatched 600" in msg, msg
            assert "10485760 bytes in all for M=1024" in msg, msg
            assert "DispatchConfig.num_max_dispatch_tokens_per_rank" in msg, msg
            assert out["fits"][f"{api}_after"] == 128, out["fits"]  # the old bound serves again
        for name, msg in out["rows"].items():  # one rank's row refusal, raised on every rank
            want = "no dispatch warp" if rank == 1 else "rank(s) 1 cannot send these rows"
            assert want in msg, (name, msg)
        c = out["capture"]  # a deferred epilogue never recorded into a capture (refused)
        for key in ("dispatch", "wait"):
            assert "outside this CUDA-graph capture" in c[key] and ".wait()" in c[key], c
        assert c["after"] == "", c
        bad = {case: why for case, why in out["overlap"].items() if why}
        assert len(out["overlap"]) == 12 and not bad, bad

        f = out["refusals"]
        T = f["T"]
        assert f"{T} tokens" in f["over_w"] and "W=4" in f["over_w"], f["over_w"]
        assert f"at least {T * R}" in f["over_w"], f["over_w"]
        assert "tokens past the first 2 were not dispatched" in f["over_w"], f["over_w"]
        assert f["over_w_rows"] and f["over_w_tail"], f
        assert f"rank {R - 1} dispatches {f['last_T']} tokens" in f["over_w_checks"], f
        assert "names one expert twice" in f["duplicate"], f["duplicate"]
        assert "ep.duplicate_experts" in f["duplicate"] and f["after"], f

        j = out["jit"]
        # 14 batch sizes, 3 buckets: each kernel compiled once per bucket, not per size
        assert j["buckets"]["dispatch"] == 3 and j["buckets"]["combine"] == 3, j
        assert "inside a CUDA-graph capture" in j["capture_cold"], j
        assert "warmup" in j["capture_cold"] and "M=128" in j["capture_cold"], j
        assert j["capture_warm"] == 0, j
        assert "ep.jit_capture" in j["emu_capture"], j

        g = out["features"]
        assert g["deferred"] == [False, True], g
        assert g["overlap_equal"] and g["aligned"] and g["fp8"], (rank, g)
        sms, handle_sms = g["sms"]
        assert sms is not None and sms == handle_sms and sms % 2 == 0 and sms >= 4, g
