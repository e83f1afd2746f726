"""Top-k routing as a pure function: scores, (group-limited) top-k, normalisation, capacity.

Shape letters: T tokens on this rank · H hidden · E experts in total · R ranks · e = E/R local
experts · k top-k · L ranks per node · N nodes · M received rows · W worst-case rows. Also used
here: G expert groups, P = T*k (token, slot) pairs.

The semantics are Megatron-Core's ``topk_routing_with_score_function`` (REFERENCE_FACTS.md,
"Routing"), extended by two switches that published models need: the group score rule
(``group_score``) and an override of the renormalisation (``normalize_topk``). The output is
``[T, k]`` from the start (never a ``[T, E]`` routing map), and nothing here synchronises with
a device: every branch on a GPU is decided from shapes and arguments, never from tensor values
(on CPU, where there is no device to wait for, rows with tied scores take a slower exact path).

Tie rule (every top-k here: the experts, the groups, on every device, and the Triton kernel of
``flexdispatch.kernels.routing``): the chosen experts come in descending order of their
selection score; equal scores are ordered (and cut at the k-th place) by the lower expert id
first; ``-0.0`` equals ``+0.0``; NaN ranks above every number (torch.topk's rule) and NaNs are
equal among themselves. ``torch.topk`` promises nothing about ties, so the torch path enforces
the rule: the top-k runs over integer keys that order like the scores and then by id; on CPU
only the rows where a top-(k+1) shows a tie in the first k places take that path.
"""

from __future__ import annotations

import math

import torch

from flexdispatch._checks.tensors import check_finite, check_tensor, checks_enabled
from flexdispatch._checks.values import check_int
from flexdispatch.kernels import resolve_impl
from flexdispatch.types import RoutingResult

__all__ = ["topk_routing", "expert_capacity", "SCORE_FUNCTIONS", "DROP_POLICIES", "GROUP_SCORES"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
DROP_POLICIES = ("probs", "position")
GROUP_SCORES = ("sum_topk", "max")

# Megatron's guard against a zero denominator when renormalising the k selected scores.
_NORM_EPS = 1e-20


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Per-expert capacity ``ceil(T * k / E * capacity_factor)`` (Megatron's ``get_capacity``)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def _validate(
    logits: object,
    *,
    topk: object,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    group_score: str,
    scaling_factor: float | None,
    expert_bias: torch.Tensor | None,
    capacity_factor: float | None,
    drop_policy: str,
) -> None:
    logits_TE = check_tensor("logits", logits, ndim=2, floating=True)
    E = logits_TE.shape[1]
    rule = f"an int in [1, num_experts={E}] (logits has {E} columns)"
    check_int("topk", topk, at_least=1, at_most=E, rule=rule)
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be one of {', '.join(SCORE_FUNCTIONS)}, got {score_function!r}"
        )
    if use_pre_softmax and score_function != "softmax":
        raise ValueError(
            f"use_pre_softmax applies to score_function='softmax' only, got "
            f"score_function={score_function!r}: unset use_pre_softmax"
        )
    if group_score not in GROUP_SCORES:
        raise ValueError(
            f"group_score must be one of {', '.join(GROUP_SCORES)}, got {group_score!r}"
        )
    if (num_groups is None) != (group_topk is None):
        raise ValueError(
            "num_groups and group_topk go together: set both (group-limited routing) or neither"
        )
    if num_groups is not None and group_topk is not None:
        if num_groups < 1 or E % num_groups:
            raise ValueError(
                f"num_groups={num_groups} must be a positive divisor of num_experts={E}"
            )
        if not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk={group_topk} must be in [1, num_groups={num_groups}]")
        if group_score == "sum_topk" and topk % group_topk:
            raise ValueError(
                f"topk={topk} is not divisible by group_topk={group_topk}: the group score sums "
                f"the top topk//group_topk scores of each group, so pick group_topk dividing topk "
                f"(or group_score='max')"
            )
        if group_topk * (E // num_groups) < topk:
            raise ValueError(
                f"group_topk={group_topk} groups of {E // num_groups} experts hold fewer than "
                f"topk={topk} experts: raise group_topk"
            )
    if scaling_factor is not None and not (
        isinstance(scaling_factor, (int, float)) and math.isfinite(scaling_factor)
    ):
        raise ValueError(f"scaling_factor must be a finite number or None, got {scaling_factor!r}")
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, ndim=1, floating=True)
        if expert_bias.device != logits_TE.device:
            raise ValueError(
                f"expert_bias is on {expert_bias.device} but logits is on {logits_TE.device}: "
                f"move both to the same device"
            )
        if expert_bias.shape[0] != E:
            raise ValueError(
                f"expert_bias must have shape [num_experts={E}], got {tuple(expert_bias.shape)}"
            )
        if score_function == "softmax":
            raise ValueError(
                "expert_bias is not applied with score_function='softmax' (Megatron ignores it "
                "there): use 'sigmoid' or 'sqrtsoftplus', or pass expert_bias=None"
            )
    if capacity_factor is not None and not (
        isinstance(capacity_factor, (int, float))
        and not isinstance(capacity_factor, bool)
        and 0 < capacity_factor < math.inf
    ):
        raise ValueError(
            f"capacity_factor must be a positive finite number or None, got {capacity_factor!r}"
        )
    if drop_policy not in DROP_POLICIES:
        raise ValueError(
            f"drop_policy must be one of {', '.join(DROP_POLICIES)}, got {drop_policy!r}"
        )


_KEY32_NAN = 2**31 - 1
_KEY64_MASKED = -(2**63)


def _order_keys(sel_TE: torch.Tensor, mask_TE: torch.Tensor | None) -> torch.Tensor:
    """``[T, E]`` int64 keys that order like the fp32 ``sel_TE`` (the tie rule above), then by
    the lower id; experts outside ``mask_TE`` get the smallest key (below ``-inf``)."""
    E = sel_TE.shape[-1]
    bits = torch.where(sel_TE == 0, 0.0, sel_TE).view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = key.masked_fill(torch.isnan(sel_TE), _KEY32_NAN).to(torch.int64) * E
    key = key + torch.arange(E - 1, -1, -1, device=sel_TE.device)
    if mask_TE is not None:
        key = key.masked_fill(~mask_TE, _KEY64_MASKED)
    return key


def _topk(
    sel_TE: torch.Tensor, k: int, mask_TE: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(sel_TE, k)`` under the module's tie rule: ``(values [T, k], ids [T, k])``.

    ``mask_TE`` (non-CPU only): ``[T, E]`` bool, the eligible experts (the others are never
    chosen while an eligible one is left, even a ``-inf`` one).
    """
    if sel_TE.device.type == "cpu" and not torch.compiler.is_compiling():
        return _topk_cpu(sel_TE, k)
    # NOTE: also under torch.compile on CPU: the CPU path reads a value on the host (a graph
    # break); both give the same ids and values (the one tie rule)
    return _topk_keyed(sel_TE, k, mask_TE)


def _topk_cpu(sel_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU: a top-(k+1); rows where a tie touches the first k places are re-ranked by the
    top-k of integer keys that order by score, then by id (``_topk_keyed``; a stable sort for
    fp64). There is no device to wait for, so the check costs one small reduction.

    Nothing that autograd saved is written: ``torch.topk`` keeps its ids for its backward, so
    the re-ranked rows go into a new ids tensor and the values are gathered at the final ids.
    """
    n = sel_TE.shape[-1]
    kk = min(k + 1, n)
    vals_TK, idx_TK = torch.topk(sel_TE, kk, dim=-1)
    if kk > 1 and vals_TK.shape[0]:
        # NOTE: the first kk values must fall strictly: a tie gives a step of 0, a NaN (sorted
        # first) a NaN step, which max() propagates; only such rows are re-ranked. One diff and
        # one max: the cheapest check found (35 against 60 us for gt + min at T=4096, k=8).
        steps_TK = torch.diff(vals_TK.detach(), dim=-1)
        if not bool(steps_TK.max() < 0):
            rows_R = (~(steps_TK < 0)).any(dim=-1).nonzero().squeeze(1)
            # NOTE: the tied rows' top-k of integer keys costs less than a stable sort of them
            # (bf16-rounded logits, 1611 of 4096 rows of 256: 6.9 against 16.6 ms, 1 thread)
            order_RK = _topk_keyed(sel_TE.detach()[rows_R], k)[1]
            idx_TK = idx_TK[:, :k].index_put((rows_R,), order_RK)
            # the gradient of a gather goes to the experts it read, like topk's
            return sel_TE.gather(1, idx_TK), idx_TK
    if kk == k:
        return vals_TK, idx_TK
    # NOTE: the values stay a view (their users make new tensors); the ids are handed on.
    return vals_TK[:, :k], idx_TK[:, :k].contiguous()


def _topk_keyed(
    sel_TE: torch.Tensor, k: int, mask_TE: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any device, no value read on the host: the top-k of integer keys (fp32), or stable sorts
    (fp64, rare off the CPU)."""
    if sel_TE.dtype == torch.float32:
        idx_TK = torch.topk(_order_keys(sel_TE, mask_TE), k, dim=-1).indices
        return sel_TE.gather(1, idx_TK), idx_TK
    order_TE = torch.sort(sel_TE, dim=-1, descending=True, stable=True).indices
    if mask_TE is not None:
        # the ineligible experts moved last, keeping the order of the rest
        ok_TE = mask_TE.gather(1, order_TE).to(torch.int8)
        order_TE = order_TE.gather(1, torch.sort(ok_TE, dim=-1, descending=True, stable=True)[1])
    idx_TK = order_TE[:, :k].contiguous()
    return sel_TE.gather(1, idx_TK), idx_TK


def _select(
    sel_TE: torch.Tensor,
    topk: int,
    num_groups: int | None,
    group_topk: int | None,
    group_score: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``sel_TE`` per row, optionally restricted to the ``group_topk`` best groups.

    Returns ``(values [T, k], indices [T, k] int64)``.
    """
    if num_groups is None or group_topk is None:
        return _topk(sel_TE, topk)
    T, E = sel_TE.shape
    grouped_TGX = sel_TE.view(T, num_groups, E // num_groups)
    # Group scores only pick indices: no gradient flows through them.
    if group_score == "max":
        group_scores_TG = grouped_TGX.detach().amax(dim=-1)
    else:
        group_scores_TG = _top_sum(grouped_TGX.detach(), topk // group_topk)
    keep_groups_Tg = _topk(group_scores_TG, group_topk)[1]
    if sel_TE.device.type == "cpu":
        # CPU: the top-k runs over the kept groups' scores only (gathered group by group in
        # ascending group order, so a lower position is a lower id), which costs less than
        # masking the others to -inf and ranking all E (5.1 against 6.7 ms at DeepSeek-V3's
        # shape, 1 thread); the ids are rebuilt for the k chosen only. On CUDA the mask is
        # fewer launches.
        # NOTE: one row copy per kept group (index_select of [T*G, X] rows) moves the scores
        # 5x faster than a gather by expert column (161 against 786 us at that shape).
        X = E // num_groups
        kept_Tg = keep_groups_Tg.sort(dim=-1).values
        rows_P = torch.arange(T, device=sel_TE.device).unsqueeze(1) * num_groups + kept_Tg
        kept_TC = sel_TE.reshape(T * num_groups, X).index_select(0, rows_P.reshape(-1))
        vals_TK, at_TK = _topk(kept_TC.view(T, group_topk * X), topk)
        return vals_TK, kept_Tg.gather(1, at_TK // X) * X + at_TK % X
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    group_mask_TG.scatter_(1, keep_groups_Tg, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand_as(grouped_TGX).reshape(T, E)
    return _topk(sel_TE, topk, expert_mask_TE)


# The most values per group that ``_top_sum`` takes by repeated max on CPU (beyond it, topk).
_MAX_PASSES = 4


def _top_sum(grouped_TGX: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of the ``n`` largest values along the last dim, ``[T, G, X] -> [T, G]``.

    The same values as ``grouped_TGX.topk(n, dim=-1).values.sum(-1)``, added in descending order
    (a repeated maximum counts as often as it occurs); bit-equal for ``n <= 2``, and for larger
    ``n`` the sum's rounding could differ only if topk's reduction associated the terms
    differently, which could flip nothing but an exact tie between two groups.

    On CPU a topk over a short last dim pays a per-row setup that costs ~50x a max over the same
    bytes (DeepSeek-V3's shape, ``[4096, 8, 32]``, top-2: 9.5 ms against 2 ms for two max passes
    with 1 thread), so up to ``_MAX_PASSES`` values are taken by ``n`` passes of max, each masking
    the position it took. On CUDA the topk is one launch and stays.
    """
    if n == 1:
        return grouped_TGX.amax(dim=-1)
    if grouped_TGX.device.type != "cpu" or n > _MAX_PASSES:
        return grouped_TGX.topk(n, dim=-1).values.sum(dim=-1)
    total_TG1, at_TG1 = grouped_TGX.max(dim=-1, keepdim=True)
    rest_TGX = grouped_TGX.scatter(-1, at_TG1, float("-inf"))
    for _ in range(n - 2):
        value_TG1, at_TG1 = rest_TGX.max(dim=-1, keepdim=True)
        total_TG1 = total_TG1 + value_TG1
        rest_TGX.scatter_(-1, at_TG1, float("-inf"))
    return (total_TG1 + rest_TGX.amax(dim=-1, keepdim=True)).squeeze(-1)


def _capacity_keep(
    idx_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> torch.Tensor:
    """Which ``(token, slot)`` pairs survive the per-expert capacity; ``[T, k]`` bool.

    Pairs are ranked inside their expert (by prob, highest first, or by position ``t*k + j``), and
    the first ``capacity`` of each expert are kept. Ties in prob keep the earlier position. Done
    with two stable sorts of the ``P`` pairs, so nothing of size ``[T, E]`` is built.
    """
    T, k = idx_TK.shape
    flat_idx_P = idx_TK.reshape(-1)
    P = flat_idx_P.shape[0]
    if policy == "probs":
        order_P = torch.sort(probs_TK.reshape(-1).detach(), descending=True, stable=True).indices
        order_P = order_P[torch.sort(flat_idx_P[order_P], stable=True).indices]
    else:
        order_P = torch.sort(flat_idx_P, stable=True).indices
    expert_sorted_P = flat_idx_P[order_P]
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_TK.device)
    counts_E.scatter_add_(0, flat_idx_P, torch.ones_like(flat_idx_P))
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    rank_P = torch.arange(P, device=idx_TK.device) - starts_E[expert_sorted_P]
    keep_P = torch.empty(P, dtype=torch.bool, device=idx_TK.device)
    keep_P.scatter_(0, order_P, rank_P < capacity)
    return keep_P.view(T, k)


def topk_routing(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score: str = "sum_topk",
    normalize_topk: bool | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    checks: bool | None = None,
    impl: str = "auto",
) -> RoutingResult:
    """Route each token to its top-k experts (Megatron-Core semantics), without a host sync.

    Scores are computed in fp32 (fp64 when ``logits`` is fp64):

    - ``softmax`` + ``use_pre_softmax``: softmax over all E, top-k of it; not renormalised unless
      ``normalize_topk=True``.
    - ``softmax`` (post): top-k of the logits, softmax over the k (sums to 1).
      ``normalize_topk=False`` drops that renormalisation: the probs are then the softmax over
      all E at the chosen experts (equal to the pre-softmax probs; selection is unchanged).
    - ``sigmoid`` / ``sqrtsoftplus`` (``sqrt(softplus(x))``): top-k of ``scores + expert_bias``
      (bias for selection only), probs are the unbiased scores at the chosen experts,
      renormalised ``s / (sum(s) + 1e-20)`` when ``k > 1`` (``normalize_topk`` overrides).

    then ``probs *= scaling_factor``.

    Group-limited top-k (``num_groups``, ``group_topk``): experts form ``num_groups`` contiguous
    groups ranked by the sum of their top ``topk // group_topk`` selection scores
    (``group_score="sum_topk"``: Megatron, DeepSeek-V3) or their max (``"max"``: DeepSeek-V2);
    only the best ``group_topk`` groups stay eligible. The selection scores are the logits for
    softmax-post, the softmax for pre-softmax, and the biased scores for sigmoid/sqrtsoftplus.

    Capacity (``capacity_factor``): ``capacity = ceil(T * k / E * capacity_factor)`` pairs per
    expert; ``drop_policy="probs"`` keeps each expert's highest-prob pairs, ``"position"`` the
    first pairs in token order (slot order within a token). Dropped pairs get ``topk_idx = -1``
    and prob 0.

    Args:
        logits: ``[T, E]`` floating router logits (any float dtype).
        topk: k, experts per token, in ``[1, E]``.
        score_function: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"``.
        use_pre_softmax: softmax only; softmax over all E before the top-k.
        num_groups: G, number of contiguous expert groups (with ``group_topk``), or None.
        group_topk: groups kept per token (with ``num_groups``), or None.
        group_score: ``"sum_topk"`` or ``"max"``, how a group is ranked.
        normalize_topk: None keeps Megatron's rule above; True/False forces renormalisation of
            the k selected probs on/off (Hugging Face ``norm_topk_prob``).
        scaling_factor: multiplies the probs, or None.
        expert_bias: ``[E]`` float selection bias (sigmoid/sqrtsoftplus only), or None.
        capacity_factor: positive float, or None for dropless routing.
        drop_policy: ``"probs"`` or ``"position"``.
        checks: run value checks (NaN/inf logits), which sync with the host; None reads
            ``FLEXDISPATCH_CHECKS``.
        impl: ``"auto"`` (the fused Triton kernel on CUDA tensors when ``triton`` imports and
            the logits are not float64, else torch), ``"torch"`` or ``"triton"`` (also on CPU
            tensors under ``TRITON_INTERPRET=1``; fp32/bf16/fp16 logits). Both give the same
            experts in the same order (the tie rule above; scores that differ only by fp32
            rounding between the two can pick differently) and the same probs to fp32 rounding;
            capacity dropping runs in torch after either. See docs/kernels.md.

    Returns:
        RoutingResult with ``topk_idx`` ``[T, k]`` int64 (``-1`` = dropped), ``topk_probs``
        ``[T, k]`` float32 (float64 when ``logits`` is float64; ``0`` where ``-1``; differentiable
        w.r.t. ``logits``), ``tokens_per_expert`` ``[E]`` int64 after dropping and
        ``num_dropped`` 0-d int64.

    Raises:
        TypeError: ``logits`` / ``expert_bias`` is not a floating tensor.
        ValueError: a bad shape or argument (the message names it), NaN/inf logits when
            checks are enabled, or ``impl="triton"`` where it cannot run.
    """
    _validate(
        logits,
        topk=topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        group_score=group_score,
        scaling_factor=scaling_factor,
        expert_bias=expert_bias,
        capacity_factor=capacity_factor,
        drop_policy=drop_policy,
    )
    if checks_enabled(checks):
        check_finite("logits", logits)
        if expert_bias is not None:
            check_finite("expert_bias", expert_bias)

    E = logits.shape[1]
    if impl != "torch" and _use_triton(impl, logits):
        from flexdispatch.kernels.routing import route, route_plan

        plan = route_plan(
            E,
            topk,
            score_function,
            use_pre_softmax,
            num_groups,
            group_topk,
            group_score,
            normalize_topk,
            scaling_factor,
            expert_bias is not None,
        )
        logits_TE = logits if logits.stride(-1) == 1 else logits.contiguous()
        idx_TK, probs_TK = route(logits_TE, expert_bias, plan)
        return _finish(idx_TK, probs_TK, E, topk, capacity_factor, drop_policy)

    x_TE = logits if logits.dtype == torch.float64 else logits.float()

    if score_function == "softmax":
        if use_pre_softmax:
            scores_TE = torch.softmax(x_TE, dim=-1)
            probs_TK, idx_TK = _select(scores_TE, topk, num_groups, group_topk, group_score)
            normalize = bool(normalize_topk)
        else:
            vals_TK, idx_TK = _select(x_TE, topk, num_groups, group_topk, group_score)
            if normalize_topk is False:
                probs_TK = torch.softmax(x_TE, dim=-1).gather(1, idx_TK)
            else:
                probs_TK = _softmax_k(vals_TK)
            normalize = False  # already sums to 1, or explicitly not renormalised
    else:
        if score_function == "sigmoid":
            scores_TE = torch.sigmoid(x_TE)
        else:
            scores_TE = torch.nn.functional.softplus(x_TE).sqrt()
        if expert_bias is not None:
            sel_TE = scores_TE + expert_bias.to(x_TE.dtype)
            _, idx_TK = _select(sel_TE, topk, num_groups, group_topk, group_score)
            probs_TK = scores_TE.gather(1, idx_TK)
        else:
            probs_TK, idx_TK = _select(scores_TE, topk, num_groups, group_topk, group_score)
        normalize = topk > 1 if normalize_topk is None else normalize_topk

    if normalize:
        probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + _NORM_EPS)
    if scaling_factor is not None:
        probs_TK = probs_TK * scaling_factor
    if probs_TK.dtype != torch.float64:
        probs_TK = probs_TK.float()
    return _finish(idx_TK, probs_TK, E, topk, capacity_factor, drop_policy)


def _softmax_k(vals_TK: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(vals_TK, dim=-1)`` over the k chosen logits, ``[T, k]`` contiguous.

    On CPU torch's softmax over a last dim that is not a multiple of 8 runs a scalar loop per
    row (k = 2: 237 against 50 us at T = 4096, 1 thread, with the transposes), so there it runs
    over dim 0 of the transposed ``[k, T]``, which vectorises across the tokens. The same
    formula; the rounding may differ in the last bit.
    """
    if vals_TK.device.type == "cpu" and vals_TK.shape[-1] % 8:
        return torch.softmax(vals_TK.t().contiguous(), dim=0).t().contiguous()
    return torch.softmax(vals_TK, dim=-1)


def _use_triton(impl: str, logits: torch.Tensor) -> bool:
    """``impl`` resolved for these logits (``"auto"`` keeps float64 on the torch path)."""
    if impl == "auto" and logits.dtype == torch.float64:
        return False
    if impl == "triton" and logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"topk_routing: impl='triton' takes float32/bfloat16/float16 logits, got "
            f"{logits.dtype}: pass impl='torch' (or 'auto') for {logits.dtype}"
        )
    return resolve_impl(impl, logits.device, what="topk_routing")


def _finish(
    idx_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    E: int,
    topk: int,
    capacity_factor: float | None,
    drop_policy: str,
) -> RoutingResult:
    """Capacity dropping (when it can drop anything) and the per-expert counts."""
    probs_TK = probs_TK.contiguous()  # NOTE: the CPU top-k hands on a view of its values
    T = idx_TK.shape[0]
    device = idx_TK.device
    if capacity_factor is not None and expert_capacity(T, E, topk, capacity_factor) < T:
        capacity = expert_capacity(T, E, topk, capacity_factor)
        keep_TK = _capacity_keep(idx_TK, probs_TK, E, capacity, drop_policy)
        tokens_per_expert_E = torch.zeros(E, dtype=torch.int64, device=device)
        tokens_per_expert_E.scatter_add_(0, idx_TK.reshape(-1), keep_TK.reshape(-1).long())
        num_dropped = (~keep_TK).sum()
        idx_TK = torch.where(keep_TK, idx_TK, torch.full_like(idx_TK, -1))
        probs_TK = torch.where(keep_TK, probs_TK, torch.zeros_like(probs_TK))
    else:
        # capacity >= T can never be exceeded: each token holds an expert at most once.
        flat_idx_P = idx_TK.reshape(-1)
        if device.type == "cpu" and not torch.compiler.is_compiling():
            # NOTE: one op on CPU (on CUDA bincount reads its max on the host: not there, nor
            # under torch.compile, where its data-dependent size breaks the graph)
            tokens_per_expert_E = torch.bincount(flat_idx_P, minlength=E)
        else:
            tokens_per_expert_E = torch.zeros(E, dtype=torch.int64, device=device)
            tokens_per_expert_E.scatter_add_(0, flat_idx_P, torch.ones_like(flat_idx_P))
        num_dropped = torch.zeros((), dtype=torch.int64, device=device)

    return RoutingResult(
        topk_idx=idx_TK,
        topk_probs=probs_TK,
        tokens_per_expert=tokens_per_expert_E,
        num_dropped=num_dropped,
    )
