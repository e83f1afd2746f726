"""Slow references of the routing math for the property tests (``test_routing_properties.py``,
``test_router_properties.py``), written from the documented rules and sharing no code with
``flexdispatch.routing``.

Shape letters: T tokens · H hidden · E experts · k top-k · G expert groups of X = E / G experts ·
S sequence length and B sequences of a ``[S, B, H]`` input.

Selection (which experts, in which order) is decided per token in Python on the selection scores
rounded to the implementation's working dtype (fp32, or fp64 for fp64 logits): the routing is
defined on those scores, and exact ties (equal logits give equal scores) survive the rounding.
Group scores add the largest first, in that dtype, as the documented rule says. Everything that
carries a gradient (probs, aux loss, z-loss) is then computed densely in fp64 from an fp64 tensor
of logits, so ``backward()`` on it gives the reference gradient.

The tie rule (docs/kernels.md): descending score; equal scores by the lower id first, at the
k-th place too; ``-0.0`` equals ``+0.0``; NaN ranks above every number and NaNs are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_NORM_EPS = 1e-20


def tie_key(value: float, position: int) -> tuple[int, float, int]:
    """Sort key of the tie rule: NaN first, then descending value, then the lower position."""
    if value != value:
        return (0, 0.0, position)
    return (1, -value, position)


def ranked(values: list[float], candidates: list[int]) -> list[int]:
    """``candidates`` (positions into ``values``) in the order of the tie rule."""
    return sorted(candidates, key=lambda i: tie_key(values[i], i))


def _add(a: float, b: float, work: torch.dtype) -> float:
    """``a + b`` rounded to the working dtype (inf - inf is NaN, as in torch)."""
    if work == torch.float64:
        return a + b
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.float32(np.float32(a) + np.float32(b)))


@dataclass(frozen=True, kw_only=True)
class RoutingOptions:
    """One routing configuration (the keyword arguments of ``topk_routing``)."""

    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    groups: tuple[int, int, str] | None = None  # (num_groups, group_topk, group_score)
    normalize_topk: bool | None = None
    scaling_factor: float | None = None
    expert_bias: torch.Tensor | None = None
    capacity: tuple[float, str] | None = None  # (capacity_factor, drop_policy)

    def kwargs(self) -> dict:
        kw: dict = {
            "topk": self.topk,
            "score_function": self.score_function,
            "use_pre_softmax": self.use_pre_softmax,
            "normalize_topk": self.normalize_topk,
            "scaling_factor": self.scaling_factor,
            "expert_bias": self.expert_bias,
        }
        if self.groups is not None:
            kw.update(
                num_groups=self.groups[0], group_topk=self.groups[1], group_score=self.groups[2]
            )
        if self.capacity is not None:
            kw.update(capacity_factor=self.capacity[0], drop_policy=self.capacity[1])
        return kw


@dataclass(frozen=True, kw_only=True)
class RefRouting:
    """The reference result: ``idx`` ``[T, k]`` int64 (``-1`` dropped), ``probs`` ``[T, k]``
    fp64 in the graph of the logits it was given, ``tokens_per_expert`` ``[E]``,
    ``num_dropped``."""

    idx: torch.Tensor
    probs: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_dropped: int


def scores64(x64: torch.Tensor, fn: str) -> torch.Tensor:
    """fp64 scores of every expert: sigmoid or sqrt(softplus) (torch's threshold 20), or the
    softmax over the row."""
    if fn == "softmax":
        return torch.softmax(x64, dim=-1)
    if fn == "sigmoid":
        return torch.sigmoid(x64)
    softplus = torch.where(x64 > 20, x64, torch.log1p(torch.exp(x64.clamp(max=20))))
    return softplus.sqrt()


def select(
    sel_rows: list[list[float]], k: int, groups: tuple[int, int, str] | None, work: torch.dtype
) -> list[list[int]]:
    """Per token: the k chosen experts in order, optionally among the best groups only."""
    out = []
    for row in sel_rows:
        E = len(row)
        eligible = list(range(E))
        if groups is not None:
            G, kept_n, rule = groups
            X = E // G
            gscore = []
            for g in range(G):
                members = ranked(row, list(range(g * X, (g + 1) * X)))
                if rule == "max":
                    gscore.append(row[members[0]])
                else:
                    total = row[members[0]]
                    for e in members[1 : k // kept_n]:
                        total = _add(total, row[e], work)
                    gscore.append(total)
            kept = ranked(gscore, list(range(G)))[:kept_n]
            eligible = [e for e in range(E) if e // X in kept]
        out.append(ranked(row, eligible)[:k])
    return out


def ref_topk_routing(
    x64: torch.Tensor,
    opts: RoutingOptions,
    work: torch.dtype,
    *,
    rank_probs: torch.Tensor | None = None,
) -> RefRouting:
    """``topk_routing`` by the documented rules. ``x64``: ``[T, E]`` fp64 logits (may carry a
    graph); ``work``: the implementation's working dtype (fp32, or fp64 for fp64 logits).

    ``rank_probs``: ``[T, k]`` the values that ``drop_policy="probs"`` ranks (default: the
    reference's probs rounded to ``work``). Probs that are equal in exact arithmetic can differ
    in their last bit in fp32 (``s / sum(s)`` for two rows of different constant logits), and
    that bit decides the tie; pass the implementation's own dropless probs to test the drop
    rule itself."""
    T, E = x64.shape
    k, fn = opts.topk, opts.score_function
    x = x64.detach()
    if fn == "softmax":
        sel = scores64(x, fn) if opts.use_pre_softmax else x
        sel = sel.to(work)
    else:
        sel = scores64(x, fn).to(work)
        if opts.expert_bias is not None:
            sel = sel + opts.expert_bias.to(work)  # one IEEE add per element, as documented
    chosen = select(sel.tolist(), k, opts.groups, work)
    idx = torch.tensor(chosen, dtype=torch.int64).reshape(T, k)

    if fn == "softmax":
        full = scores64(x64, "softmax")
        if opts.use_pre_softmax:
            probs = full.gather(1, idx)
            normalize = bool(opts.normalize_topk)
        elif opts.normalize_topk is False:
            probs, normalize = full.gather(1, idx), False
        else:
            chosen_x = x64.gather(1, idx)
            ex = torch.exp(chosen_x - chosen_x.max(dim=-1, keepdim=True).values)
            probs, normalize = ex / ex.sum(dim=-1, keepdim=True), False
    else:
        probs = scores64(x64, fn).gather(1, idx)
        normalize = k > 1 if opts.normalize_topk is None else opts.normalize_topk
    if normalize:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + _NORM_EPS)
    if opts.scaling_factor is not None:
        probs = probs * opts.scaling_factor

    keep = torch.ones(T, k, dtype=torch.bool)
    if opts.capacity is not None:
        factor, policy = opts.capacity
        capacity = math.ceil(T * k / E * factor)
        if capacity < T:
            p = (probs.detach().to(work) if rank_probs is None else rank_probs).reshape(-1)
            p = p.tolist()
            by_expert: dict[int, list[int]] = {}
            for pos, e in enumerate(idx.reshape(-1).tolist()):
                by_expert.setdefault(e, []).append(pos)
            flat_keep = [True] * (T * k)
            for members in by_expert.values():
                order = ranked(p, members) if policy == "probs" else sorted(members)
                for pos in order[capacity:]:
                    flat_keep[pos] = False
            keep = torch.tensor(flat_keep, dtype=torch.bool).reshape(T, k)
    idx = torch.where(keep, idx, -1)
    probs = torch.where(keep, probs, torch.zeros((), dtype=probs.dtype))
    counts = torch.zeros(E, dtype=torch.int64)
    for e in idx[idx >= 0].tolist():
        counts[e] += 1
    return RefRouting(
        idx=idx, probs=probs, tokens_per_expert=counts, num_dropped=int((~keep).sum())
    )


def ref_aux_loss(
    x64: torch.Tensor,
    *,
    k: int,
    fn: str,
    loss_type: str,
    coeff: float,
    seq_length: int,
    batch_size: int,
    work: torch.dtype,
) -> torch.Tensor:
    """The switch load-balancing loss of REFERENCE_FACTS.md ("Aux loss"), fp64, from the logits:
    ``P_e`` over the full score distribution, ``n_e`` the counts of an unbiased, ungrouped top-k
    of it under the tie rule. ``seq_aux_loss``: per sequence (token ``t = s * B + b``), averaged;
    ``global_aux_loss`` with one process and one micro-batch equals ``aux_loss``."""
    T, E = x64.shape
    if fn == "softmax":
        full = torch.softmax(x64, dim=-1)
    else:
        s = scores64(x64, fn)
        full = s / (s.sum(dim=-1, keepdim=True) + _NORM_EPS)
    chosen = select(full.detach().to(work).tolist(), k, None, work)
    if loss_type in ("aux_loss", "global_aux_loss"):
        n = torch.zeros(E, dtype=torch.float64)
        for row in chosen:
            for e in row:
                n[e] += 1
        return coeff * E / (k * max(T, 1) ** 2) * (full.sum(dim=0) * n).sum()
    total = x64.new_zeros(())
    for b in range(batch_size):
        tokens = [s * batch_size + b for s in range(seq_length)]
        n = torch.zeros(E, dtype=torch.float64)
        for t in tokens:
            for e in chosen[t]:
                n[e] += 1
        P = full[tokens].sum(dim=0)
        total = total + coeff * E / (k * max(seq_length, 1) ** 2) * (P * n).sum()
    return total / max(batch_size, 1)


def ref_z_loss(x64: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t logsumexp(logits[t])^2`` (0 for no tokens), fp64."""
    if x64.shape[0] == 0:
        return x64.sum() * 0.0
    return coeff * (torch.logsumexp(x64, dim=-1) ** 2).mean()


# ----------------------------------------------------------------------------- hash routing

_M32 = 2**32


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) % _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) % _M32
    return x ^ (x >> 16)


def ref_hash_experts(token_id: int, E: int, k: int, seed: int) -> list[int]:
    """The documented rendezvous hash (``flexdispatch.routing.hash``'s docstring), one id."""
    u = token_id % 2**64
    seed_word = _fmix32((seed % _M32) ^ _fmix32((seed >> 32) ^ 0x9E3779B9))
    t = _fmix32(_fmix32((u % _M32) ^ seed_word) ^ (u >> 32))
    keys = sorted(
        ((_fmix32((t + (x + 1) * 0x9E3779B9) % _M32) * E + x, x) for x in range(E)), reverse=True
    )
    return [x for _, x in keys[:k]]


def ref_hash_probs(
    x64: torch.Tensor | None,
    idx: torch.Tensor,
    *,
    fn: str,
    normalize_topk: bool | None,
    scaling_factor: float | None,
) -> torch.Tensor:
    """DeepSeek-V4's hash-layer weights, fp64: the scores of all E gathered at the hashed
    experts, renormalised (default: k > 1 and not softmax), scaled; ``1 / k`` without logits."""
    T, k = idx.shape
    if x64 is None:
        probs = torch.full((T, k), 1.0 / k, dtype=torch.float64)
    else:
        probs = scores64(x64, fn).gather(1, idx)
        normalize = (k > 1 and fn != "softmax") if normalize_topk is None else normalize_topk
        if normalize:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + _NORM_EPS)
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs
