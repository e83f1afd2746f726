"""Cluster planning: simulate a preset's routing at cluster scale and price every transport.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows. Also used here: S source ranks routed together in one block.

What ``plan_cluster`` does, in one process and without a GPU:

1. Synthetic router logits for every rank: ``N(0, 1) + skew * popularity[x]``, where
   ``popularity = log(1 / (1 + rank_x))`` (a Zipf-like profile, centred) over a seeded random
   ranking of the experts: ``skew = 0`` is uniform routing, larger values concentrate the load.
   Every rank draws from its own generator (seed, rank), so the result does not depend on how
   the work is chunked.
2. Routing with ``flexdispatch.topk_routing`` and the preset's router config (expert bias 0,
   capacity per rank batch), once per *variant* of the grouping: ``preset`` (its own
   ``num_groups``/``group_topk``), ``ungrouped`` (grouping removed) and ``node_limited``
   (``num_groups = N`` with ``group_topk`` = the preset's, else ``min(4, N)``, lowered to a valid
   value). Variants with the same grouping are computed once (``same_as``). Hash routers
   (``router_type='hash'``) route random token ids (Zipf-skewed ids when ``skew > 0``).
3. Counting per block of source ranks (``accounting.count_rows_batched``): only ``[R, R]``,
   ``[R, N]`` and ``[E]`` counts are kept, never a ``[T_total, R]`` mask.
4. Pricing: ``flat`` and ``hierarchical`` with the torch backend's row format and
   ``deepep`` with DeepEP's (FP8 dispatch, BF16 combine); DeepEP buffer hints (V1 ``Buffer``
   and the V2 ``ElasticBuffer`` that flexdispatch's ``deepep_api='v2'`` path would build);
   worst-case W.

Time model (per direction): a link class moves ``max(bytes sent, bytes received)`` of a rank at
its bandwidth (defaults from DeepEP's published H800 numbers: NVLink 155 GB/s, RDMA 50 GB/s per
rank). ``flat`` and ``deepep`` overlap NVLink and RDMA, so the estimate is
``max over ranks of max(nvl_time, rdma_time)``; the torch ``hierarchical`` mode runs its two hops
one after the other, so it is ``max over ranks of rdma_time + max over ranks of nvl_time``. It
ignores latency, kernel launch and compute: a lower bound on communication time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.values import check_int
from flexdispatch.config import MoEConfig, RouterConfig
from flexdispatch.planner.deepep import (
    DEEPEP_DEFAULT_NUM_SMS,
    deepep_elastic_hints,
    deepep_hints,
)
from flexdispatch.planner.results import (
    ClusterPlan,
    DirectionTraffic,
    ModeTraffic,
    VariantPlan,
    WorstCase,
)
from flexdispatch.routing import hash_routing, topk_routing
from flexdispatch.traffic import (
    LinkRows,
    RowFormat,
    count_rows_batched,
    deepep_row_format,
    link_rows,
    torch_row_format,
)

__all__ = [
    "plan_cluster",
    "node_limited_group_topk",
    "popularity_offsets",
    "VARIANTS",
    "DEFAULT_NVLINK_GBPS",
    "DEFAULT_RDMA_GBPS",
    "MAX_LOGITS",
    "EXACT_MAX_LOGITS",
]

VARIANTS = ("preset", "ungrouped", "node_limited")
# DeepEP README, H800: intranode NVLink 153/158 GB/s, internode RDMA 43-58 GB/s per rank.
DEFAULT_NVLINK_GBPS = 155.0
DEFAULT_RDMA_GBPS = 50.0
_BLOCK_ELEMS = 1 << 22  # logits elements routed at once (16 MiB of fp32)
_HASH_VOCAB = 1 << 15
MAX_LOGITS = 1 << 24
"""Default budget of ``plan_cluster``: router logits simulated in all (R x T x E per variant).
Above it, each rank routes a sample of T_s = T / f tokens and the counts are scaled by f (a few
seconds on 2 CPU cores)."""
EXACT_MAX_LOGITS = 1 << 31
"""The most router logits ``plan_cluster(max_logits=None)`` (``plan --exact``) routes: about
7 minutes on 2 CPU cores; more is refused with its estimate."""
EXACT_LOGITS_PER_S = 5e6
"""Router logits per second the planner routes on 2 CPU cores (measured with tiny_cpu, 2 x 2
ranks, 2^18 tokens per rank: 3.4e7 logits in about 6 CPU-seconds); for the refusal's
estimate."""


def _sample_tokens(R: int, T: int, E: int, variants: int, max_logits: int | None) -> int:
    """T_s, the tokens per rank to simulate: T within the budget, else the largest T / f
    (f an integer, so that counts scale exactly when f divides T) that fits. Without a budget
    (``--exact``) every token is routed, up to ``EXACT_MAX_LOGITS``."""
    if max_logits is None:
        n = R * T * E * variants
        if n > EXACT_MAX_LOGITS:
            minutes = n / EXACT_LOGITS_PER_S / 60
            raise InputError(
                f"plan --exact: routing every token means R x T x E x variants = {R} x {T} x "
                f"{E} x {variants} = {n} router logits, about {_duration(minutes)} at the "
                f"{EXACT_LOGITS_PER_S / 1e6:g} M logits/s the planner routes on 2 CPU cores, "
                f"more than its exact limit of {EXACT_MAX_LOGITS} logits: drop --exact (each "
                f"rank routes a sample of its tokens and the counts are scaled, within seconds) "
                f"or plan fewer tokens (--tokens)",
                problem=f"--exact routes {n:.3g} logits, about {_duration(minutes)} (the limit "
                f"is {EXACT_MAX_LOGITS:.3g})",
                fix="drop --exact (a scaled sample), or plan fewer tokens",
            )
        return T
    if R * T * E * variants <= max_logits:
        return T
    per_token = R * E * variants
    if per_token > max_logits:
        err = InputError(
            f"plan: one token per rank already routes R x E x variants = {R} x {E} x {variants} = "
            f"{per_token} logits, more than the planner's budget of {max_logits} "
            f"(plan_cluster's max_logits): plan fewer ranks or experts, or fewer variants",
            problem=f"one token per rank routes R x E x variants = {per_token:.3g} logits, more "
            f"than the budget of {max_logits:.3g}",
            fix="plan fewer ranks or experts",
            arg="num_experts",
        )
        raise err
    f = math.ceil(T / (max_logits // per_token))
    # NOTE: a divisor of T close above f scales the counts exactly (bounded search).
    exact = next((d for d in range(f, min(T, 2 * f, f + 4096) + 1) if T % d == 0), None)
    return T // exact if exact is not None else max(1, T // f)


def _duration(minutes: float) -> str:
    if minutes < 90:
        n = max(1, round(minutes))
        return f"{n} minute{'s' if n > 1 else ''}"
    hours = minutes / 60
    if hours < 48:
        return f"{hours:.0f} hours"
    return f"{hours / 24:.0f} days" if hours < 24 * 730 else f"{hours / 24 / 365:.0f} years"


def _check_plan_memory(R: int, N: int, E: int, variants: int) -> None:
    """Refuse a plan whose count matrices cannot fit (``flexdispatch._checks.fits``): per variant
    ``[R, R]`` and ``[R, N]`` int64 counts (and their priced copies), ``[E]`` counts and the
    per-expert tuple of the result."""
    from flexdispatch._checks import fits

    fits.check_fits(
        "plan",
        "num_experts",
        E,
        variants * E * 48,
        "cpu",
        detail="[E] counts and the result's list",
    )
    fits.check_fits(
        "plan",
        "nodes x ranks_per_node",
        R,
        variants * (R * R + R * N) * 8 * 6,
        "cpu",
        detail="[R, R] and [R, N] int64 counts and their priced copies",
        fix="plan fewer ranks",
    )


def popularity_offsets(num_experts: int, seed: int) -> torch.Tensor:
    """``[E]`` float32 centred Zipf-like log-popularity over a seeded random expert ranking."""
    g = torch.Generator().manual_seed(seed)
    order_E = torch.randperm(num_experts, generator=g)
    offsets_E = -torch.log1p(order_E.double())
    return (offsets_E - offsets_E.mean()).float()


def node_limited_group_topk(router: RouterConfig, nodes: int) -> tuple[int | None, str]:
    """``group_topk`` for node-limited routing over ``nodes`` groups, and a note.

    Target: the preset's ``group_topk``, else ``min(4, N)``, capped at N; then the nearest value
    (first downwards, then upwards) that the router accepts (``k % g == 0`` for the ``sum_topk``
    group score, and ``g`` groups holding at least k experts). None when no value works.
    """
    E, k = router.num_experts, router.topk
    per_group = E // nodes
    target = min(router.group_topk if router.group_topk is not None else min(4, nodes), nodes)

    def ok(g: int) -> bool:
        return g * per_group >= k and (router.group_score == "max" or k % g == 0)

    for g in [*range(target, 0, -1), *range(target + 1, nodes + 1)]:
        if ok(g):
            note = "" if g == target else f"group_topk {target} is invalid here, using {g}"
            return g, note
    return None, f"no group_topk is valid for {nodes} groups of {per_group} experts with k={k}"


@dataclass(frozen=True, kw_only=True)
class _Grouping:
    name: str
    num_groups: int | None
    group_topk: int | None
    note: str
    skip: bool = False

    @property
    def key(self) -> tuple[int | None, int | None]:
        return (self.num_groups, self.group_topk)


def _groupings(router: RouterConfig, nodes: int, names: tuple[str, ...]) -> list[_Grouping]:
    """The grouping of every requested variant (one group counts as no grouping)."""
    out = []
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"unknown routing variant {name!r}: choose from {', '.join(VARIANTS)}")
        G, g, note = None, None, ""
        if router.router_type == "hash":
            if name != "preset":
                continue
            note = "hash router: experts from a hash of random token ids, no groups"
        elif name == "preset":
            G, g = router.num_groups, router.group_topk
        elif name == "node_limited":
            if nodes == 1:
                note = "one node: node-limited routing is a no-op"
            else:
                g, note = node_limited_group_topk(router, nodes)
                if g is None:
                    out.append(
                        _Grouping(
                            name=name,
                            num_groups=None,
                            group_topk=None,
                            note=f"{note}; node_limited skipped",
                            skip=True,
                        )
                    )
                    continue
                G = nodes
        if G is not None and g == G:
            # NOTE: keeping every group (including a single group) restricts nothing.
            G, g = None, None
            note = note or "every group is kept: same as no grouping"
        out.append(_Grouping(name=name, num_groups=G, group_topk=g, note=note))
    return out


def _num_blocks(R: int, T: int, E: int, whole_ranks: bool) -> int:
    """How many blocks ``_blocks`` yields (without making them)."""
    if whole_ranks or T * E >= _BLOCK_ELEMS:
        step = T if whole_ranks else max(1, _BLOCK_ELEMS // E)
        return R * -(-T // step)
    return -(-R // max(1, _BLOCK_ELEMS // (T * E)))


def _blocks(R: int, T: int, E: int, whole_ranks: bool) -> Iterator[tuple[range, int, int]]:
    """``(source ranks, token start, token end)`` blocks of at most ``_BLOCK_ELEMS`` logits."""
    per_rank = T * E
    if whole_ranks or per_rank >= _BLOCK_ELEMS:
        step = T if whole_ranks else max(1, _BLOCK_ELEMS // E)
        for s in range(R):
            for t0 in range(0, T, step):
                yield range(s, s + 1), t0, min(T, t0 + step)
        return
    n = max(1, _BLOCK_ELEMS // per_rank)
    for s0 in range(0, R, n):
        yield range(s0, min(R, s0 + n)), 0, T


def _route(
    router: RouterConfig, logits: torch.Tensor, G: int | None, g: int | None
) -> torch.Tensor:
    bias = None
    if router.enable_expert_bias:
        bias = torch.zeros(router.num_experts, dtype=logits.dtype)
    return topk_routing(
        logits,
        topk=router.topk,
        score_function=router.score_function,
        use_pre_softmax=router.use_pre_softmax,
        num_groups=G,
        group_topk=g,
        group_score=router.group_score,
        normalize_topk=router.normalize_topk,
        scaling_factor=router.scaling_factor,
        expert_bias=bias,
        capacity_factor=router.capacity_factor,
        drop_policy=router.drop_policy,
    ).topk_idx


def _hash_ids(
    n: int, skew: float, vocab_p: torch.Tensor | None, g: torch.Generator
) -> torch.Tensor:
    if vocab_p is None:
        return torch.randint(0, _HASH_VOCAB, (n,), generator=g)
    return torch.multinomial(vocab_p, n, replacement=True, generator=g)


def _direction(
    send_nvl: torch.Tensor,
    send_rdma: torch.Tensor,
    recv_nvl: torch.Tensor,
    recv_rdma: torch.Tensor,
    nvlink_gbps: float,
    rdma_gbps: float,
    overlap: str,
) -> DirectionTraffic:
    # GB/s = 1e3 bytes per microsecond.
    nvl_us = torch.maximum(send_nvl, recv_nvl).double() / (nvlink_gbps * 1e3)
    rdma_us = torch.maximum(send_rdma, recv_rdma).double() / (rdma_gbps * 1e3)
    if overlap == "max":
        t = float(torch.maximum(nvl_us, rdma_us).max())
    else:
        t = float(nvl_us.max() + rdma_us.max())
    return DirectionTraffic(
        nvlink_bytes=tuple(send_nvl.tolist()),
        rdma_bytes=tuple(send_rdma.tolist()),
        nvlink_recv_bytes=tuple(recv_nvl.tolist()),
        rdma_recv_bytes=tuple(recv_rdma.tolist()),
        time_us=t,
    )


def _price(
    rows: LinkRows, fmt: RowFormat, mode: str, overlap: str, nvlink_gbps: float, rdma_gbps: float
) -> ModeTraffic:
    d, c = fmt.dispatch_bytes, fmt.combine_bytes
    # NOTE: a rank's dispatch receives are its combine sends (and the reverse).
    dispatch = _direction(
        rows.dispatch_intra * d,
        rows.dispatch_inter * d,
        rows.combine_intra * d,
        rows.combine_inter * d,
        nvlink_gbps,
        rdma_gbps,
        overlap,
    )
    combine = _direction(
        rows.combine_intra * c,
        rows.combine_inter * c,
        rows.dispatch_intra * c,
        rows.dispatch_inter * c,
        nvlink_gbps,
        rdma_gbps,
        overlap,
    )
    return ModeTraffic(
        mode=mode, row_format=fmt, overlap=overlap, rows=rows, dispatch=dispatch, combine=combine
    )


def _worst_case(C: torch.Tensor, D: torch.Tensor, T: int, L: int) -> WorstCase:
    R, N = C.shape[0], D.shape[1]
    max_recv = int(C.sum(0).max()) if R else 0
    flat = R * int(C.max())
    fwd_LR = C.view(N, L, R).sum(0)
    hier = max(N * int(D.max()), L * int(fwd_LR.max()))
    return WorstCase(
        observed_max_recv_rows=max_recv,
        deepep_w=math.ceil(max_recv / R) * R,
        deepep_test_w=T * R,
        torch_flat_w=flat,
        torch_hier_w=math.ceil(hier / R) * R,
        deepep_v2_w=T * R,
    )


def _scale(c: torch.Tensor, T_sim: int, T: int) -> torch.Tensor:
    """Counts of ``T_sim`` sampled tokens per rank scaled to ``T`` (exact when T_sim divides T)."""
    if T % T_sim == 0:
        return c * (T // T_sim)
    return (c.double() * (T / T_sim)).round().to(torch.int64)


def _check_inputs(
    cfg: MoEConfig,
    nodes: int,
    ranks_per_node: int,
    tokens: int,
    skew: float,
    elem_size: int,
    nvlink_gbps: float,
    rdma_gbps: float,
) -> None:
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig (see load_config), got {type(cfg).__name__}")
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node), ("tokens", tokens)):
        check_int(name, value, at_least=1, rule="an int >= 1")
    E, R = cfg.router.num_experts, nodes * ranks_per_node
    if E % R:
        raise ValueError(
            f"num_experts={E} is not divisible by R = nodes x ranks_per_node = {nodes} x "
            f"{ranks_per_node} = {R}: experts are sharded contiguously (e = E / R per rank), so "
            f"pick a cluster whose rank count divides {E}"
        )
    if not math.isfinite(skew) or skew < 0:
        raise ValueError(f"skew must be a finite number >= 0, got {skew!r}")
    if elem_size not in (1, 2, 4):
        raise ValueError(f"elem_size must be 1, 2 or 4 bytes, got {elem_size!r}")
    for name, bw in (("nvlink_gbps", nvlink_gbps), ("rdma_gbps", rdma_gbps)):
        if not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
            raise ValueError(f"{name} must be a positive number of GB/s, got {bw!r}")


def plan_cluster(
    cfg: MoEConfig,
    *,
    nodes: int,
    ranks_per_node: int,
    tokens: int = 4096,
    skew: float = 0.0,
    seed: int = 0,
    elem_size: int = 2,
    nvlink_gbps: float = DEFAULT_NVLINK_GBPS,
    rdma_gbps: float = DEFAULT_RDMA_GBPS,
    num_sms: int = DEEPEP_DEFAULT_NUM_SMS,
    ll_max_tokens: int = 128,
    variants: tuple[str, ...] = VARIANTS,
    max_logits: int | None = MAX_LOGITS,
    progress: Callable[[int, int], None] | None = None,
) -> ClusterPlan:
    """Simulate ``cfg``'s routing on ``nodes x ranks_per_node`` ranks and price the traffic.

    Args:
        cfg: the MoE layer (``load_config(preset)``).
        nodes: N >= 1.
        ranks_per_node: L >= 1; ``E`` must be divisible by ``R = N * L``.
        tokens: T, tokens per rank.
        skew: >= 0, strength of the expert-popularity offset added to the logits.
        seed: seeds the popularity ranking and every rank's logits.
        elem_size: bytes per element of the dispatched rows in the torch backend (bf16: 2) and
            on DeepEP's V2 path (bf16 bit views; 1 = fp8 ``(x, scales)`` tuples there).
        nvlink_gbps / rdma_gbps: per-rank link bandwidths of the time model.
        num_sms: DeepEP ``Buffer.num_sms`` for the buffer hints.
        ll_max_tokens: low-latency ``num_max_dispatch_tokens_per_rank`` for its hint.
        variants: which of ``VARIANTS`` to route.
        max_logits: budget of simulated router logits (``MAX_LOGITS``); above it every rank
            routes a sample of its tokens and the counts are scaled (a note says so); None
            simulates every token. A cluster where even one token per rank exceeds it is
            refused.
        progress: called as ``progress(blocks done, blocks in all)`` after every routed block.

    Returns:
        ClusterPlan (frozen; ``as_dict()`` gives the JSON document).

    Raises:
        ValueError: a bad argument, naming it (E not divisible by R, nodes < 1, ...).
    """
    _check_inputs(cfg, nodes, ranks_per_node, tokens, skew, elem_size, nvlink_gbps, rdma_gbps)
    start = time.perf_counter()
    router = cfg.router
    E, k, H = router.num_experts, router.topk, cfg.hidden_size
    L, N, T = ranks_per_node, nodes, tokens
    R = N * L
    groupings = _groupings(router, N, variants)
    todo: dict[tuple[int | None, int | None], str] = {}
    for gr in groupings:
        if not gr.skip:
            todo.setdefault(gr.key, gr.name)
    T_all = T
    T = T_sim = _sample_tokens(
        R, T_all, 1 if router.router_type == "hash" else E, len(todo), max_logits
    )
    _check_plan_memory(R, N, E, len(todo))
    acc = {
        key: (
            torch.zeros(R, R, dtype=torch.int64),
            torch.zeros(R, N, dtype=torch.int64),
            torch.zeros(R, dtype=torch.int64),
            torch.zeros(E, dtype=torch.int64),
        )
        for key in todo
    }
    is_hash = router.router_type == "hash"
    offsets_E = popularity_offsets(E, seed)
    vocab_p = None
    if is_hash and skew > 0:
        vocab_p = popularity_offsets(_HASH_VOCAB, seed + 1).double().mul(skew).exp()
    whole_ranks = router.capacity_factor is not None
    if whole_ranks:
        # NOTE: the capacity drop ranks a whole rank's batch at once: [T_sim, E] logits, scores
        # and their sort (about 32 bytes per logit)
        from flexdispatch._checks import fits

        fits.check_fits(
            "plan",
            "tokens",
            T_all,
            32 * T * (1 if is_hash else E),
            "cpu",
            detail=f"one rank's {T} routed tokens x E={E} logits at once (capacity_factor ranks a "
            f"whole batch)",
            fix="plan fewer tokens, or drop --exact",
        )
    gens: dict[int, torch.Generator] = {}
    num_blocks = _num_blocks(R, T, E, whole_ranks)
    for done, (srcs, t0, t1) in enumerate(_blocks(R, T, E, whole_ranks), 1):
        n_t = t1 - t0
        parts = []
        for s in srcs:
            if t0 == 0:
                gens[s] = torch.Generator().manual_seed((seed * 1_000_003 + s) % (1 << 62))
            gen = gens[s]
            if is_hash:
                parts.append(_hash_ids(n_t, skew, vocab_p, gen))
            else:
                parts.append(torch.randn(n_t, E, generator=gen))
            if t1 == T:
                del gens[s]
        block = torch.cat(parts)
        if not is_hash:
            block = block + skew * offsets_E
        for key, (C, D, P, X) in acc.items():
            if is_hash:
                idx = hash_routing(block, num_experts=E, topk=k, seed=router.hash_seed).topk_idx
            else:
                idx = _route(router, block, *key)
            rows_SR, rows_SN, pairs_SR, per_expert = count_rows_batched(
                idx.view(len(srcs), n_t, k), num_experts=E, num_ranks=R, ranks_per_node=L
            )
            C[srcs.start : srcs.stop] += rows_SR
            D[srcs.start : srcs.stop] += rows_SN
            P += pairs_SR.sum(0)
            X += per_expert
        if progress is not None:
            progress(done, num_blocks + len(groupings))
    if T_sim != T_all:
        for key, parts in acc.items():
            acc[key] = tuple(_scale(c, T, T_all) for c in parts)  # type: ignore[assignment]
        T = T_all

    torch_fmt = torch_row_format(hidden=H, topk=k, elem_size=elem_size)
    deepep_fmt = deepep_row_format(hidden=H, topk=k, internode=N > 1)
    plans = []
    for i, gr in enumerate(groupings, num_blocks + 1):
        if progress is not None:
            progress(i, num_blocks + len(groupings))
        if gr.skip:
            continue
        C, D, P, X = acc[gr.key]
        first = todo[gr.key]
        flat = link_rows(C, D, ranks_per_node=L, mode="flat")
        hier = link_rows(C, D, ranks_per_node=L, mode="hierarchical")
        recv = C.sum(0)
        node_R = torch.arange(R) // L
        rdma_in = (D * (node_R[:, None] != torch.arange(N)[None, :])).sum(0)
        plans.append(
            VariantPlan(
                name=gr.name,
                num_groups=gr.num_groups,
                group_topk=gr.group_topk,
                same_as=None if first == gr.name else first,
                note=gr.note,
                rows_SR=C,
                rows_SN=D,
                recv_rows=tuple(recv.tolist()),
                recv_pairs=tuple(P.tolist()),
                tokens_per_expert=tuple(X.tolist()),
                node_recv_rows=tuple(recv.view(N, L).sum(1).tolist()),
                node_rdma_rows_in=tuple(rdma_in.tolist()),
                avg_ranks_per_token=float(C.sum()) / (T * R),
                avg_nodes_per_token=float(D.sum()) / (T * R),
                traffic=(
                    _price(flat, torch_fmt, "flat", "max", nvlink_gbps, rdma_gbps),
                    _price(hier, torch_fmt, "hierarchical", "sum", nvlink_gbps, rdma_gbps),
                    _price(
                        hier if N > 1 else flat, deepep_fmt, "deepep", "max", nvlink_gbps, rdma_gbps
                    ),
                ),
                worst_case=_worst_case(C, D, T, L),
            )
        )
    notes = [f"{gr.name}: {gr.note}" for gr in groupings if gr.note]
    if T_sim != T:
        notes.append(
            f"sampled: each rank routed {T_sim} of its {T} tokens (R x T x E beyond the "
            f"planner's budget of {max_logits} logits); counts scaled by T / {T_sim}"
        )
    if k > 8 and N > 8:
        notes.append(f"DeepEP internode sends a token to at most 8 nodes; k={k} may exceed it")
    hints = deepep_hints(
        hidden=H,
        num_experts=E,
        num_ranks=R,
        ranks_per_node=L,
        elem_size=elem_size,
        num_sms=num_sms,
        ll_max_tokens=ll_max_tokens,
    )
    elastic = deepep_elastic_hints(
        hidden=H,
        num_experts=E,
        num_ranks=R,
        ranks_per_node=L,
        topk=k,
        tokens=T,
        elem_size=elem_size,
    )
    return ClusterPlan(
        preset=cfg.name,
        num_experts=E,
        topk=k,
        hidden_size=H,
        nodes=N,
        ranks_per_node=L,
        tokens_per_rank=T,
        skew=float(skew),
        seed=seed,
        elem_size=elem_size,
        nvlink_gbps=float(nvlink_gbps),
        rdma_gbps=float(rdma_gbps),
        variants=tuple(plans),
        deepep=hints,
        deepep_elastic=elastic,
        wall_s=time.perf_counter() - start,
        notes=tuple(notes),
    )
