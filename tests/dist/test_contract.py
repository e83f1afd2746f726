"""The seven-point dispatch contract (ARCHITECTURE.md), on real gloo groups, for every backend.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

One spawned group per (backend, topology) runs every mode (flat / hierarchical × dropless /
worst-case) and every case inside the worker; each rank knows the answer without communication
(``reference.py``). ``BACKENDS_UNDER_TEST`` is the list to extend.

``deepep-emulated`` is the real ``deepep`` adapter (``flexdispatch/backends/deepep/v1/backend.py``)
on top of the DeepEP emulator in ``tests/deepep_emu`` (passed through ``FlexDispatcher``'s private
``_deep_ep`` hook). It runs where DeepEP runs: one node of 2 or 4 ranks, and two emulated nodes of
2 ranks (the emulator's NVLink domain shrunk to 2), where worst-case mode must be refused. Its
byte counts follow DeepEP's traffic pattern (flat in a node; across nodes one RDMA row per
destination node, forwarded over NVLink) and its row layouts, computed here per token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import (
    CASES,
    all_inputs,
    expert_fn,
    pair_counts,
    ref_combine,
    ref_dispatch,
    worst_needed,
)

BACKENDS_UNDER_TEST = ["torch", "deepep-emulated"]
# NOTE: DeepEP V2 and V2.5 (their contract cases are in test_deepep_v2.py / _ep.py); the
# autograd contract below runs over every backend
BOUNDED = ["deepep-v2-emulated", "deepep-v25-emulated"]
TOPOLOGIES = [(2, 1), (2, 2), (4, 2)]  # (R, L): 2 nodes x 1, 1 node x 2, 2 nodes x 2
# DeepEP: one node of 2 or 4 ranks; two (emulated) nodes of 2 ranks
DEEPEP_TOPOLOGIES = [(2, 2), (4, 4), (4, 2)]
MODES = [(False, False), (False, True), (True, False), (True, True)]  # (hierarchical, worst)
K, H, E_PER_RANK = 3, 8, 3


def _cases(topologies: dict[str, list[tuple[int, int]]]) -> list[Any]:
    return [
        pytest.param(b, R, L, id=f"{b}-R{R}-L{L}")
        for b in BACKENDS_UNDER_TEST
        for R, L in topologies[b]
    ]


def _supported(backend: str, R: int, L: int, worst: bool) -> bool:
    """DeepEP refuses worst-case (CUDA-graph) mode across nodes."""
    return not (backend == "deepep-emulated" and worst and L < R)


def _mode_name(hier: bool, worst: bool) -> str:
    return f"{'hier' if hier else 'flat'}-{'worst' if worst else 'dropless'}"


def _make(backend: str, E: int, **cfg_kw: Any) -> Any:
    """A FlexDispatcher for ``backend`` (``deepep-emulated``: deepep on the emulator)."""
    import torch.distributed as dist

    from flexdispatch import DispatchConfig, FlexDispatcher

    if backend == "torch":
        return FlexDispatcher(DispatchConfig(backend=backend, **cfg_kw), num_experts=E)
    from tests.deepep_emu.load import load_deep_ep

    R, L = dist.get_world_size(), cfg_kw.get("ranks_per_node") or dist.get_world_size()
    if backend == "deepep-v2-emulated":
        emu = load_deep_ep(nvl_peers=L if L < R else 8, release="2.1.0")
        cfg = DispatchConfig(backend="deepep", deepep_api="v2", **cfg_kw)
        return FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)
    if backend == "deepep-v25-emulated":
        emu = load_deep_ep(nvl_peers=L, release="2.5.0")
        cfg = DispatchConfig(backend="deepep", deepep_api="v25", **cfg_kw)
        return FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)
    emu = load_deep_ep(nvl_peers=L if L < R else 8)
    # NOTE: the V1 Buffer path here; the V2 (ElasticBuffer) contract is test_deepep_v2.py
    cfg = DispatchConfig(backend="deepep", deepep_api="v1", **cfg_kw)
    return FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)


def _dispatcher(backend: str, E: int, L: int, hier: bool, W: int) -> Any:
    return _make(backend, E, hierarchical=hier, ranks_per_node=L, num_worst_tokens=W)


def _check_dispatch(res: Any, ref: Any, W: int, where: str) -> None:
    """Points 1-4 and 6 (worst-case shape, prefix and tail) against the reference."""
    M = ref.x.shape[0]
    rows = W if W else M
    assert res.recv_x.shape == (rows, H), f"{where}: recv_x shape {tuple(res.recv_x.shape)}"
    assert res.recv_topk_idx.shape == (rows, K) and res.recv_topk_idx.dtype == torch.int64
    assert res.recv_topk_probs.shape == (rows, K) and res.recv_topk_probs.dtype == torch.float32
    assert res.recv_x.dtype == ref.x.dtype, f"{where}: dtype {res.recv_x.dtype}"
    # points 1 + 2: one row per (token, destination rank), in (source rank, token) order
    assert torch.equal(res.recv_x[:M], ref.x), f"{where}: received rows differ"
    # point 3: local ids, -1 elsewhere, probs 0 there
    assert torch.equal(res.recv_topk_idx[:M], ref.idx), f"{where}: recv_topk_idx differs"
    assert torch.equal(res.recv_topk_probs[:M], ref.probs), f"{where}: recv_topk_probs differs"
    assert bool((res.recv_topk_probs[res.recv_topk_idx < 0] == 0).all())
    # point 4: per-expert counts, as a device tensor
    counts = res.num_recv_tokens_per_expert
    assert isinstance(counts, torch.Tensor) and counts.dtype == torch.int64
    assert counts.device == res.recv_x.device
    assert torch.equal(counts, ref.counts), f"{where}: counts {counts} != {ref.counts}"
    # dropless: the (row, slot) pairs as a host int, so permute needs no second host sync
    want_pairs = None if W else int(ref.counts.sum())
    assert res.num_recv_pairs == want_pairs, f"{where}: num_recv_pairs {res.num_recv_pairs}"
    # point 6: the tail of a worst-case result
    if W:
        assert bool((res.recv_x[M:] == 0).all()), f"{where}: recv_x tail not zero"
        assert bool((res.recv_topk_idx[M:] == -1).all()), f"{where}: idx tail not -1"
        assert bool((res.recv_topk_probs[M:] == 0).all()), f"{where}: probs tail not 0"


def _expected_flat_bytes(
    C: list[list[int]], me: int, L: int, row_bytes: int, meta_bytes: int, W: int
) -> tuple[int, int]:
    """(intra, inter) bytes a flat dispatch + combine of ``row_bytes`` rows puts on the wire."""
    R = len(C)
    intra = inter = 0
    for r in range(R):
        if r == me:
            continue
        out_rows = W // R if W else C[me][r]
        back_rows = W // R if W else C[r][me]
        n = out_rows * (row_bytes + meta_bytes) + back_rows * row_bytes
        if r // L == me // L:
            intra += n
        else:
            inter += n
    return intra, inter


def _expected_deepep_bytes(
    inputs: list[Any], me: int, L: int, dtype: torch.dtype, narrow_combine: bool
) -> tuple[int, int]:
    """(intra, inter) bytes rank ``me`` puts on the wire in one deepep dispatch + combine.

    Per token, per destination node ``n``: the source sends one row to the forwarder ``(n,
    source's local index)`` (RDMA unless ``n`` is its own node, where it forwards itself), which
    sends it over NVLink to each destination rank of ``n`` but itself; combine mirrors it. Row
    sizes: rows travel as bf16 views padded to the column multiple DeepEP takes (dispatch: 16
    intranode, 8 internode; combine: the release's combine multiple, 256 internode); intranode
    rows carry an int32 source index, int64 ids and fp32 weights; internode rows an 8-byte
    SourceMeta, int32 ids and fp32 weights, aligned to 16 bytes. Narrow fp32 combines ride the
    fp32 weights channel beside a dummy row of one combine multiple.
    """
    from flexdispatch.backends.deepep.rules import rules_for

    R = len(inputs)
    e = E_PER_RANK
    internode = L < R
    rules = rules_for("2.1.0")  # the release load_deep_ep emulates by default
    cols = H * torch.empty(0, dtype=dtype).element_size() // 2
    d_mult = rules.dispatch_col_multiple(internode)
    c_mult = rules.combine_col_multiple(internode)
    wire = -(-cols // d_mult) * d_mult * 2
    comb_wire = -(-max(H, 8) // c_mult) * c_mult * 2

    def row(payload: int, ids: int, weights: int) -> int:
        if not internode:
            return payload + 4 + 8 * ids + 4 * weights
        return -(-(payload + 8 + 4 * ids + 4 * weights) // 16) * 16

    disp = row(wire, K, K)
    comb = row(2 * c_mult, 0, H) if narrow_combine else row(comb_wire, 0, 0)
    intra = inter = 0
    for s, inp in enumerate(inputs):
        for t in range(inp.idx.shape[0]):
            ranks = sorted({i // e for i in inp.idx[t].tolist() if i >= 0})
            for n in sorted({g // L for g in ranks}):
                fwd = n * L + s % L
                if s == me and n != s // L:
                    inter += disp
                if fwd == me and n != s // L:
                    inter += comb
                for g in ranks:
                    if g // L == n and g != fwd:
                        intra += disp if fwd == me else 0
                        intra += comb if g == me else 0
    return intra, inter


def contract_worker(rank: int, R: int, backend: str, L: int, seed: int) -> dict[str, Any]:
    """Every mode x case on one group; returns per-mode stats for the parent's comparisons."""
    E = E_PER_RANK * R
    kw = {"R": R, "E": E, "k": K, "H": H}
    report: dict[str, Any] = {"checked": 0, "refused": 0, "stats": {}}
    for case in CASES:
        inputs = all_inputs(seed, case=case, **kw)
        mine = inputs[rank]
        ref = ref_dispatch(inputs, rank, E)
        ref_out = ref_combine(mine, E, R)
        C = pair_counts(inputs, E)
        W = max(worst_needed(inputs, E, L, h) for h in (False, True)) + R
        # NOTE: non-exact random rows for the bit-equality comparisons between modes.
        noisy = all_inputs(seed + 1, case=case, exact=False, **kw)
        seen: dict[str, tuple[torch.Tensor, ...]] = {}
        for hier, worst in MODES:
            name = _mode_name(hier, worst)
            where = f"rank {rank} {case} {name}"
            if not _supported(backend, R, L, worst):
                msg = _raises(lambda: _dispatcher(backend, E, L, hier, W))  # noqa: B023
                assert "intranode only" in msg, f"{where}: {msg!r}"
                report["refused"] += 1
                continue
            d = _dispatcher(backend, E, L, hier, W if worst else 0)
            res = d.dispatch(mine.x, mine.idx, mine.probs)
            _check_dispatch(res, ref, W if worst else 0, where)
            out = d.combine(expert_fn(res.recv_x, res.recv_topk_probs, rank), res.handle)
            # point 5: unweighted sum over the receiving ranks, zero for tokens sent nowhere
            assert out.shape == mine.x.shape and out.dtype == mine.x.dtype
            torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=0, msg=where)
            assert d.stats.host_syncs == (0 if worst else 1), f"{where}: {d.stats}"
            assert d.stats.dispatch_calls == 1 and d.stats.combine_calls == 1
            got = (d.stats.bytes_sent_intra_node, d.stats.bytes_sent_inter_node)
            if backend == "deepep-emulated":
                want = _expected_deepep_bytes(inputs, rank, L, torch.float32, True)
                assert got == want, f"{where}: bytes {got} != {want}"
            elif not hier:
                want = _expected_flat_bytes(C, rank, L, H * 4, 8 * K, W if worst else 0)
                assert got == want, f"{where}: bytes {got} != {want}"
            if not worst:
                assert d.stats.rows_received == ref.x.shape[0]
            report["stats"][(case, name)] = d.stats.as_dict()
            # modes must agree bit for bit on non-exact data (flat vs hier, worst prefix)
            nx = noisy[rank]
            r2 = d.dispatch(nx.x, nx.idx, nx.probs)
            y2 = torch.sin(r2.recv_x) * 1.37 + r2.recv_x * r2.recv_topk_probs.sum(1, keepdim=True)
            o2 = d.combine(y2, r2.handle)
            M2 = ref_dispatch(noisy, rank, E).x.shape[0]
            seen[name] = (r2.recv_x[:M2], r2.recv_topk_idx[:M2], r2.recv_topk_probs[:M2], o2)
            assert d.stats.host_syncs == (0 if worst else 2)
            d.close()
            report["checked"] += 1
        base = seen["flat-dropless"]
        for name, got in seen.items():
            for a, b in zip(base, got, strict=True):
                assert torch.equal(a, b), f"rank {rank} {case}: {name} differs from flat-dropless"
    return report


def autograd_worker(rank: int, R: int, backend: str, L: int, seed: int) -> int:
    """Grads of x and probs through dispatch -> experts -> combine equal the local reference, on
    every backend (DeepEP V2 / V2.5: one mode each, flat, with one host sync dropless)."""
    E = E_PER_RANK * R
    kw = {"R": R, "E": E, "k": K, "H": H}
    bounded = backend in BOUNDED
    checked = 0
    for case in ("random", "empty_rank"):
        inputs = all_inputs(seed, case=case, exact=False, **kw)
        mine = inputs[rank]
        W = max(worst_needed(inputs, E, L, h) for h in (False, True)) + R
        if bounded:  # NOTE: W / R bounds every rank's tokens there
            W = R * max(max(inp.x.shape[0] for inp in inputs), 1)
        w_out = torch.randn(mine.x.shape, generator=torch.Generator().manual_seed(rank))
        xr = mine.x.clone().requires_grad_()
        pr = mine.probs.clone().requires_grad_()
        ref_loss = (ref_combine(mine, E, R, x=xr, probs=pr) * w_out).sum()
        if ref_loss.requires_grad:  # T = 0: nothing to differentiate
            ref_loss.backward()
        ref_gx = xr.grad if xr.grad is not None else torch.zeros_like(xr)
        ref_gp = pr.grad if pr.grad is not None else torch.zeros_like(pr)
        for hier, worst in MODES:
            where = f"rank {rank} {case} {_mode_name(hier, worst)}"
            if not _supported(backend, R, L, worst) or (bounded and hier):
                continue
            d = _dispatcher(backend, E, L, hier, W if worst else 0)
            x = mine.x.clone().requires_grad_()
            p = mine.probs.clone().requires_grad_()
            res = d.dispatch(x, mine.idx, p)
            out = d.combine(expert_fn(res.recv_x, res.recv_topk_probs, rank), res.handle)
            (out * w_out).sum().backward()
            assert x.grad is not None and p.grad is not None, where
            torch.testing.assert_close(x.grad, ref_gx, rtol=1e-5, atol=1e-5, msg=where)
            torch.testing.assert_close(p.grad, ref_gp, rtol=1e-5, atol=1e-5, msg=where)
            assert bool((p.grad[mine.idx < 0] == 0).all()), f"{where}: grad at -1 slots"
            if bounded:
                assert d.stats.host_syncs == (0 if worst else 1), f"{where}: {d.stats}"
                d.close()
            checked += 1
    return checked


def bf16_worker(rank: int, R: int, backend: str, L: int, seed: int) -> int:
    """bf16 rows stay bf16 (in the result and on the wire) and move bit for bit."""
    E = E_PER_RANK * R
    kw = {"R": R, "E": E, "k": K, "H": H}
    inputs = all_inputs(seed, exact=False, dtype=torch.bfloat16, **kw)
    mine = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    C = pair_counts(inputs, E)
    W = max(worst_needed(inputs, E, L, h) for h in (False, True)) + R
    checked = 0
    for hier, worst in MODES:
        where = f"rank {rank} bf16 {_mode_name(hier, worst)}"
        if not _supported(backend, R, L, worst):
            continue
        d = _dispatcher(backend, E, L, hier, W if worst else 0)
        res = d.dispatch(mine.x, mine.idx, mine.probs)
        _check_dispatch(res, ref, W if worst else 0, where)
        out = d.combine(res.recv_x, res.handle)
        assert out.dtype == torch.bfloat16, where
        n_dest = torch.tensor(
            [len({i // E_PER_RANK for i in row if i >= 0}) for row in mine.idx.tolist()],
            dtype=torch.float32,
        )
        want = mine.x.float() * n_dest[:, None]
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=1e-2, msg=where)
        got = (d.stats.bytes_sent_intra_node, d.stats.bytes_sent_inter_node)
        if backend == "deepep-emulated":
            assert got == _expected_deepep_bytes(inputs, rank, L, torch.bfloat16, False), where
        elif not hier:
            assert got == _expected_flat_bytes(C, rank, L, H * 2, 8 * K, W if worst else 0)
        checked += 1
    return checked


def grads_and_bf16_worker(rank: int, R: int, backend: str, L: int, seed: int) -> tuple[int, int]:
    """Both workers in one group (spawning costs seconds)."""
    return autograd_worker(rank, R, backend, L, seed), bf16_worker(rank, R, backend, L, seed)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("backend", "R", "L"),
    _cases({"torch": TOPOLOGIES, "deepep-emulated": DEEPEP_TOPOLOGIES}),
)
def test_contract(backend: str, R: int, L: int) -> None:
    reports = run_group(contract_worker, R, backend, L, 1234, timeout=200)
    refused = sum(not _supported(backend, R, L, w) for _, w in MODES) * len(CASES)
    assert all(r["checked"] == len(CASES) * len(MODES) - refused for r in reports)
    assert all(r["refused"] == refused for r in reports)

    def inter(name: str) -> int:
        return sum(r["stats"][("random", name)]["bytes_sent_inter_node"] for r in reports)

    if backend == "deepep-emulated":
        # DeepEP's kernels are node-aware in every mode: one RDMA row per destination node
        assert inter("hier-dropless") == inter("flat-dropless")
        assert (inter("flat-dropless") > 0) == (L < R)
    elif R // L > 1 and L > 1:
        # hierarchical sends fewer bytes across nodes than flat on the same inputs
        assert 0 < inter("hier-dropless") < inter("flat-dropless")
    elif L == 1:
        # one rank per node: the forwarder is the destination, nothing to save
        assert inter("hier-dropless") == inter("flat-dropless") > 0


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("backend", "R", "L"), _cases({"torch": [(2, 1), (4, 2)], "deepep-emulated": [(2, 2), (4, 2)]})
)
def test_autograd_and_bf16(backend: str, R: int, L: int) -> None:
    results = run_group(grads_and_bf16_worker, R, backend, L, 99, timeout=200)
    modes = sum(_supported(backend, R, L, w) for _, w in MODES)
    assert results == [(2 * modes, modes)] * R


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("backend", "R", "L"),
    [pytest.param(b, R, L, id=f"{b}-R{R}-L{L}") for b in BOUNDED for R, L in [(2, 2), (4, 2)]],
)
def test_autograd_deepep_v2_and_v25(backend: str, R: int, L: int) -> None:
    # the autograd contract of test_autograd_and_bf16 on DeepEP V2 / V2.5: 2 cases x 2 modes
    assert run_group(autograd_worker, R, backend, L, 1234, timeout=280) == [4] * R


def _raises(fn: Any) -> str:
    """Run ``fn``; return the ValueError's message ("" when nothing was raised)."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def errors_worker(rank: int, R: int, backend: str, L: int, seed: int) -> dict[str, str]:
    """Errors that must be raised on every rank, naming the numbers; the group stays usable."""
    E = E_PER_RANK * R
    kw = {"R": R, "E": E, "k": K, "H": H}
    inputs = all_inputs(seed, **kw)
    mine = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    C = pair_counts(inputs, E)
    need = max(max(row) for row in C)
    out: dict[str, str] = {}

    def run(hier: bool, W: int, x: torch.Tensor = mine.x) -> None:
        # NOTE: deepep checks agreement and overflow on every rank only with checks on (its
        # default path adds no collective beyond DeepEP's own)
        extra = {"checks": True} if backend == "deepep-emulated" else {}
        d = _make(backend, E, hierarchical=hier, ranks_per_node=L, num_worst_tokens=W, **extra)
        res = d.dispatch(x, mine.idx, mine.probs)
        _check_dispatch(res, ref, W, f"rank {rank} W={W} hier={hier}")

    # worst-case overflow: one row short fails, the exact size works
    if backend == "deepep-emulated":
        # deepep caps W / R rows per (sender, destination) like the torch backend; its
        # internode kernels are node-aware already, so hierarchical sizes like flat
        out["flat_overflow"] = _raises(lambda: run(False, R * (need - 1)))
        run(False, R * need)
        out["hier_overflow"] = _raises(lambda: run(True, R * (need - 1)))
        run(True, R * need)
        w_hier = R * need
    else:
        out["flat_overflow"] = _raises(lambda: run(False, R * (need - 1)))
        run(False, R * need)
        w_hier = worst_needed(inputs, E, L, True)
        out["hier_overflow"] = _raises(lambda: run(True, w_hier - R))
        run(True, w_hier)
    # ranks that disagree on H or on the dtype
    wide = torch.zeros(mine.x.shape[0], H + 1) if rank == R - 1 else mine.x
    for hier, worst in MODES:
        W = w_hier + R if worst else 0
        out[f"hidden_{_mode_name(hier, worst)}"] = _raises(lambda: run(hier, W, wide))  # noqa: B023
    half = mine.x.to(torch.bfloat16) if rank == 0 else mine.x
    out["dtype"] = _raises(lambda: run(False, 0, half))
    # configs that differ across ranks
    out["fingerprint_config"] = _raises(
        lambda: _make(backend, E, ranks_per_node=L, hierarchical=rank == 0)
    )
    out["fingerprint_experts"] = _raises(
        lambda: _make(backend, E + R * (rank == R - 1), ranks_per_node=L)
    )
    # the group still works after all of that
    run(False, 0)
    return out


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_errors_on_every_rank(backend: str) -> None:
    R, L = 4, (4 if backend == "deepep-emulated" else 2)
    results = run_group(errors_worker, R, backend, L, 5, timeout=200)
    E = E_PER_RANK * R
    inputs = all_inputs(5, R=R, E=E, k=K, H=H)
    C = pair_counts(inputs, E)
    need = max(max(row) for row in C)
    w_hier = worst_needed(inputs, E, L, True)
    for rank, msgs in enumerate(results):
        where = f"rank {rank}"
        if backend == "deepep-emulated":
            for key in ("flat_overflow", "hier_overflow"):
                m = msgs[key]
                assert f"needs {need} rows" in m and f"W={R * (need - 1)}" in m, (where, m)
                assert f"W/{R} = {need - 1}" in m and f"at least {R * need}" in m, (where, m)
        else:
            m = msgs["flat_overflow"]
            assert f"needs {need} rows" in m and f"W={R * (need - 1)}" in m, (where, m)
            assert f"W/{R} = {need - 1}" in m and f"at least {R * need}" in m, (where, m)
            m = msgs["hier_overflow"]
            assert f"W={w_hier - R}" in m and f"at least {w_hier}" in m, (where, m)
        for hier, worst in MODES:
            m = msgs[f"hidden_{_mode_name(hier, worst)}"]
            assert "hidden size" in m and f"rank {R - 1}={H + 1}" in m and f"rank 0={H}" in m
        m = msgs["dtype"]
        assert "dtype" in m and "rank 0=bfloat16" in m and "rank 1=float32" in m, (where, m)
        m = msgs["fingerprint_config"]
        assert "hierarchical" in m and "rank 0=True" in m and "rank 1=False" in m, (where, m)
        m = msgs["fingerprint_experts"]
        assert "num_experts" in m and f"rank {R - 1}={E + R}" in m and f"rank 0={E}" in m
