"""Overflow, drops and conservation: nothing is lost, duplicated or corrupted without a report.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

- Capacity dropping: ``RoutingResult.num_dropped``, ``tokens_per_expert`` and exactly which
  ``(token, slot)`` pairs became ``-1`` match a per-expert loop (both drop policies; random,
  skewed and all-to-one-expert logits, including exact ties).
- Worst-case overflow: with W one step too small the error names the hop, the ranks and the
  numbers, which are recomputed here per token; with the smallest W that fits nothing is
  dropped. The sync-free path (CUDA without checks) is driven on CPU by skipping the host copy:
  it drops only the rows past each cap and ``check_overflow`` names the W that was needed.
- Conservation: every ``(token, expert)`` pair sent with an id in ``[0, E)`` arrives exactly
  once, at the rank holding that expert, beside its own token's row — summed over all ranks, for
  every routing family of ``tests.hardening.make_routing``, flat and hierarchical, dropless and
  worst-case (smallest W). Rows carry their identity (``x = source * 1000 + token``) and probs
  carry the pair's (``source * 1000 + token * 10 + slot``), both exact in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from flexdispatch import RouterConfig, TopKRouter, topk_routing
from tests.dist.harness import run_group
from tests.dist.reference import Inputs, node_counts, pair_counts, worst_needed
from tests.hardening import ROUTING_KINDS, make_routing

R, L, K, H, E = 4, 2, 3, 2, 8
N = R // L
T = 9
MODES = [(False, False), (False, True), (True, False), (True, True)]  # (hierarchical, worst)


# --------------------------------------------------------------------------- capacity


def _capacity_reference(
    idx: torch.Tensor, probs: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> list[list[bool]]:
    """Per expert: rank its pairs (prob high first, then position; or position) and keep the
    first ``capacity``. Returns ``keep[t][s]``."""
    Tn, k = idx.shape
    keep = [[False] * k for _ in range(Tn)]
    for ex in range(num_experts):
        pairs = [(t, s) for t in range(Tn) for s in range(k) if int(idx[t, s]) == ex]
        if policy == "probs":
            pairs.sort(key=lambda p: (-float(probs[p[0], p[1]]), p[0] * k + p[1]))
        for t, s in pairs[:capacity]:
            keep[t][s] = True
    return keep


def _logits(kind: str, Tn: int, num_experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(Tn, num_experts, generator=g)
    if kind == "skewed":
        logits = logits - 1.5 * torch.arange(num_experts, dtype=torch.float32).sqrt()
    if kind == "one-expert":
        logits[:, 0] += 60.0  # every token's top choice; post-softmax probs tie at 1.0
    return logits


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "one-expert"])
@pytest.mark.parametrize(("k", "factor"), [(1, 1.0), (2, 1.0), (2, 0.5), (4, 1.3)])
def test_capacity_drops_are_counted_exactly(kind: str, policy: str, k: int, factor: float) -> None:
    Tn, num_experts = 40, 8
    logits = _logits(kind, Tn, num_experts, seed=k * 10 + int(factor * 10))
    full = topk_routing(logits, topk=k)
    res = topk_routing(logits, topk=k, capacity_factor=factor, drop_policy=policy)
    capacity = math.ceil(Tn * k / num_experts * factor)
    keep = _capacity_reference(full.topk_idx, full.topk_probs, num_experts, capacity, policy)
    dropped = sum(not v for row in keep for v in row)
    assert int(res.num_dropped) == dropped
    assert res.topk_idx.tolist() == [
        [int(full.topk_idx[t, s]) if keep[t][s] else -1 for s in range(k)] for t in range(Tn)
    ]
    assert bool((res.topk_probs[res.topk_idx < 0] == 0).all())
    kept_probs = res.topk_probs[res.topk_idx >= 0]
    assert torch.equal(kept_probs, full.topk_probs[res.topk_idx >= 0])
    want_counts = [0] * num_experts
    for t in range(Tn):
        for s in range(k):
            if keep[t][s]:
                want_counts[int(full.topk_idx[t, s])] += 1
    assert res.tokens_per_expert.tolist() == want_counts
    # conservation: kept + dropped = every pair
    assert sum(want_counts) + int(res.num_dropped) == Tn * k
    if kind == "one-expert":
        assert dropped >= Tn - capacity > 0  # the hot expert really overflowed


def test_router_reports_the_same_drops() -> None:
    cfg = RouterConfig(num_experts=8, topk=2, capacity_factor=0.5)
    router = TopKRouter(cfg, 4)
    x = torch.randn(30, 4)
    res = router(x)
    assert int(res.num_dropped) == int((res.topk_idx < 0).sum())
    assert int(res.tokens_per_expert.sum()) + int(res.num_dropped) == 30 * 2
    capacity = cfg.capacity(30)
    assert int(res.tokens_per_expert.max()) <= capacity


# --------------------------------------------------------------------------- spawned group


def _all_inputs(kind: str, seed: int) -> list[Inputs]:
    """Every rank's identity-carrying inputs for one routing family."""
    out = []
    for r in range(R):
        idx, _ = make_routing(kind, seed, r, T=T, E=E, k=K)
        Tr = idx.shape[0]
        t = torch.arange(Tr, dtype=torch.float32)[:, None]
        x = (r * 1000 + t).expand(Tr, H).contiguous()
        code = r * 1000 + t * 10 + torch.arange(K, dtype=torch.float32)[None, :]
        valid = (idx >= 0) & (idx < E)
        out.append(Inputs(x=x, idx=idx, probs=torch.where(valid, code, 0.0)))
    return out


def _clean(inputs: list[Inputs]) -> list[Inputs]:
    """Ids outside [0, E) become -1 (what dispatch does with checks off)."""
    out = []
    for inp in inputs:
        bad = (inp.idx < 0) | (inp.idx >= E)
        out.append(Inputs(x=inp.x, idx=inp.idx.masked_fill(bad, -1), probs=inp.probs))
    return out


def _flat_overflow(inputs: list[Inputs], W: int) -> str:
    C = pair_counts(inputs, E)
    n, s, g = max((C[s][g], s, g) for s in range(R) for g in range(R))
    cap = W // R
    assert n > cap
    return (
        f"worst-case dispatch overflow: rank {s} sending to rank {g} needs {n} rows but "
        f"num_worst_tokens W={W} allows W/{R} = {cap} per peer: raise "
        f"DispatchConfig.num_worst_tokens to at least {R * n} ({R} x {n}, "
        f"rounded up to a multiple of R={R})"
    )


def _hier_overflow(inputs: list[Inputs], W: int) -> str:
    C, NC = pair_counts(inputs, E), node_counts(inputs, E, L)
    n1, s, node = max((NC[s][n], s, n) for s in range(R) for n in range(N))
    if n1 > W // N:
        need = math.ceil(n1 * N / R) * R
        return (
            f"worst-case dispatch overflow: rank {s} sending to node {node} (forwarder rank "
            f"{node * L + s % L}) needs {n1} rows but num_worst_tokens W={W} allows W/{N} = "
            f"{W // N} per peer: raise DispatchConfig.num_worst_tokens to at least {need} "
            f"({N} x {n1}, rounded up to a multiple of R={R})"
        )
    fwd = []
    for f in range(R):
        for j in range(L):
            g = (f // L) * L + j
            fwd.append((sum(C[m * L + f % L][g] for m in range(N)), f, g))
    n2, f, g = max(fwd)
    assert n2 > W // L
    need = math.ceil(n2 * L / R) * R
    return (
        f"worst-case dispatch overflow: forwarder rank {f} forwarding to rank {g} needs {n2} rows "
        f"but num_worst_tokens W={W} allows W/{L} = {W // L} per peer: raise "
        f"DispatchConfig.num_worst_tokens to at least {need} ({L} x {n2}, rounded up to a "
        f"multiple of R={R})"
    )


def _received_pairs(res: Any, rank: int) -> list[tuple[int, int, int]]:
    """(global expert, pair code, row code) of every received (row, slot) with a local id."""
    e = E // R
    out = []
    ids, probs, rows = res.recv_topk_idx, res.recv_topk_probs, res.recv_x
    for m in range(ids.shape[0]):
        for s in range(K):
            j = int(ids[m, s])
            if j >= 0:
                out.append((rank * e + j, int(probs[m, s]), int(rows[m, 0])))
    return out


def conservation_worker(rank: int, world: int, seed: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch._checks import tensors

    # NOTE: the sync-free (CUDA) path of the value checks: bad ids are counted, dispatch drops
    # them, and the safe-point check reports them (on CPU they would raise inside dispatch).
    tensors.defer_value_checks = lambda device: True
    report: dict[str, Any] = {"pairs": {}, "rows": {}, "combine": {}, "overflow": {}, "check": {}}
    for kind in ROUTING_KINDS:
        inputs = _all_inputs(kind, seed)
        clean = _clean(inputs)
        mine = inputs[rank]
        for hier, worst in MODES:
            W = max(worst_needed(clean, E, L, hier), R) if worst else 0
            cfg = DispatchConfig(
                backend="torch", hierarchical=hier, ranks_per_node=L, num_worst_tokens=W
            )
            d = FlexDispatcher(cfg, num_experts=E)
            res = d.dispatch(mine.x, mine.idx, mine.probs)
            key = (kind, hier, worst)
            report["pairs"][key] = _received_pairs(res, rank)
            real = (res.recv_topk_idx >= 0).any(1)
            M = int(real.sum())
            assert bool(real[:M].all()) and not bool(real[M:].any()), "real rows come first"
            assert torch.equal(res.num_recv_tokens_per_expert.sum(), (res.recv_topk_idx >= 0).sum())
            report["rows"][key] = (M, res.recv_x.shape[0])
            ones = torch.ones(res.recv_x.shape[0], H)
            report["combine"][key] = d.combine(ones, res.handle)[:, 0].tolist()
            try:
                d.check_overflow()
                report["check"][key] = None
            except ValueError as exc:
                report["check"][key] = str(exc)
            if worst and W > R:
                # one step below the smallest W that fits must be refused, on every rank
                small = cfg.model_copy(update={"num_worst_tokens": W - R})
                try:
                    FlexDispatcher(small, num_experts=E).dispatch(mine.x, mine.idx, mine.probs)
                    report["overflow"][key] = None
                except ValueError as exc:
                    report["overflow"][key] = (W - R, str(exc))
    return report


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_every_valid_pair_arrives_exactly_once() -> None:
    seed = 5
    results = run_group(conservation_worker, R, seed, timeout=150, env={"LOCAL_WORLD_SIZE": str(L)})
    e = E // R
    checked = 0
    for kind in ROUTING_KINDS:
        inputs = _all_inputs(kind, seed)
        clean = _clean(inputs)
        sent = []
        dest_count: list[list[int]] = []  # per rank, per token: destination ranks
        for s, inp in enumerate(inputs):
            counts = []
            for t in range(inp.idx.shape[0]):
                ranks = set()
                for j in range(K):
                    g = int(inp.idx[t, j])
                    if 0 <= g < E:
                        sent.append((g, s * 1000 + t * 10 + j, s * 1000 + t))
                        ranks.add(g // e)
                counts.append(float(len(ranks)))
            dest_count.append(counts)
        want_rows = sum(int(c) for counts in dest_count for c in counts)
        for hier, worst in MODES:
            key = (kind, hier, worst)
            got = sorted(p for r in range(R) for p in results[r]["pairs"][key])
            assert got == sorted(sent), f"{key}: pairs lost, duplicated or corrupted"
            for r in range(R):
                assert all(g // e == r for g, _, _ in results[r]["pairs"][key]), key
                assert results[r]["combine"][key] == dest_count[r], key
            assert sum(results[r]["rows"][key][0] for r in range(R)) == want_rows, key
            for r, inp in enumerate(inputs):
                bad = int(((inp.idx < -1) | (inp.idx >= E)).sum())
                msg = results[r]["check"][key]
                if bad:
                    assert msg is not None and f"held {bad} id(s) outside [-1, {E})" in msg, msg
                else:
                    assert msg is None, (key, r, msg)
            if worst:
                W = max(worst_needed(clean, E, L, hier), R)
                assert all(results[r]["rows"][key][1] == W for r in range(R)), key
                over = results[0]["overflow"].get(key)
                if W > R:
                    want = (_hier_overflow if hier else _flat_overflow)(clean, W - R)
                    assert over == (W - R, want), f"{key}: {over!r}\nwant {want!r}"
                    assert all(results[r]["overflow"][key] == over for r in range(R))
            checked += 1
    assert checked == len(ROUTING_KINDS) * len(MODES)


# --------------------------------------------------------------------------- sync-free path


def _no_host_counts(G: torch.Tensor, work: Any = None) -> None:
    """The torch backend's CUDA-without-checks branch of ``start_host_counts``: no host copy.
    (On CPU flat the count exchange is async; on CUDA it is not, so G is complete here.)"""
    if work is not None:
        work.wait()


def sync_free_worker(rank: int, world: int, seed: int) -> dict[str, Any]:
    """Worst-case dispatch as on CUDA without checks: no host copy of the counts at all."""
    from flexdispatch import DispatchConfig, FlexDispatcher

    out: dict[str, Any] = {}
    inputs = _all_inputs("one-expert", seed)
    mine = inputs[rank]
    for hier in (False, True):
        need = worst_needed(inputs, E, L, hier)
        for W in (need, need - 2 * R):
            cfg = DispatchConfig(
                backend="torch", hierarchical=hier, ranks_per_node=L, num_worst_tokens=W
            )
            d = FlexDispatcher(cfg, num_experts=E)
            d.backend.start_host_counts = _no_host_counts  # the CUDA-without-checks branch
            res = d.dispatch(mine.x, mine.idx, mine.probs)
            try:
                d.check_overflow()
                error = None
            except ValueError as exc:
                error = str(exc)
            out[(hier, W)] = {
                "need": need,
                "rows": res.recv_x.shape[0],
                "pairs": _received_pairs(res, rank),
                "error": error,
                "host_syncs": d.stats.host_syncs,
            }
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_sync_free_overflow_drops_only_past_the_cap_and_is_reported() -> None:
    seed = 9
    results = run_group(sync_free_worker, R, seed, timeout=100, env={"LOCAL_WORLD_SIZE": str(L)})
    inputs = _all_inputs("one-expert", seed)
    e = E // R
    sent = sorted(
        (int(inp.idx[t, j]), s * 1000 + t * 10 + j, s * 1000 + t)
        for s, inp in enumerate(inputs)
        for t in range(inp.idx.shape[0])
        for j in range(K)
        if int(inp.idx[t, j]) >= 0
    )
    C = pair_counts(inputs, E)
    for hier in (False, True):
        need = worst_needed(inputs, E, L, hier)
        ok = [results[r][(hier, need)] for r in range(R)]
        assert all(o["error"] is None and o["rows"] == need and o["host_syncs"] == 0 for o in ok)
        assert sorted(p for o in ok for p in o["pairs"]) == sent
        W = need - 2 * R
        small = [results[r][(hier, W)] for r in range(R)]
        want = (
            f"a worst-case dispatch overflowed: it needed num_worst_tokens >= {need} but W={W} "
            f"(R={R}); rows past the cap were dropped: raise DispatchConfig.num_worst_tokens to "
            f"at least {need}"
        )
        assert [o["error"] for o in small] == [want] * R
        got = [p for o in small for p in o["pairs"]]
        assert len(got) == len(set(got)) and set(got) <= set(sent), "only real pairs, once each"
        assert all(o["rows"] == W for o in small)
        assert all(g // e == r for r in range(R) for g, _, _ in small[r]["pairs"])
        if not hier:
            # flat: each sender keeps its first W/R rows to each peer, in token order
            cap = W // R
            keep = []
            for s, inp in enumerate(inputs):
                for g in range(R):
                    tokens = [t for t in range(inp.idx.shape[0]) if g in {
                        int(i) // e for i in inp.idx[t] if int(i) >= 0}][:cap]  # fmt: skip
                    keep += [
                        (int(inp.idx[t, j]), s * 1000 + t * 10 + j, s * 1000 + t)
                        for t in tokens
                        for j in range(K)
                        if int(inp.idx[t, j]) >= 0 and int(inp.idx[t, j]) // e == g
                    ]
            assert sorted(got) == sorted(keep)
            assert max(max(row) for row in C) > cap  # it really overflowed
