"""Fused top-k routing: one Triton launch from ``logits [T, E]`` to ``[T, k]`` ids and probs.

Shape letters: T tokens · E experts · k top-k · G expert groups.

The kernel (``_routing_src.route_fwd``) computes the scores (softmax pre or post, sigmoid,
sqrtsoftplus) in fp32, adds the expert bias for selection only, applies the group-limited top-k
(Megatron's sum of the top ``k / group_topk`` scores, or DeepSeek-V2's max), the top-k, the
renormalisation and the scaling, and writes ``[T, k]`` int64 ids and fp32 probs. A second kernel
(``route_bwd``) gives the gradient of the logits. The semantics are ``topk_routing``'s torch path,
including its tie rule (equal selection scores: the lower expert id first; NaN above everything)
— see ``flexdispatch.routing.topk``. Callers (``topk_routing``) validate the arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from flexdispatch.kernels._triton import Kernel, next_pow2

__all__ = ["RoutePlan", "route_plan", "route"]

_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
# Elements of one program's [BLOCK_T, E] tile (registers): 16 rows of 256 experts, as measured.
_TILE = 4096


@dataclass(frozen=True)
class RoutePlan:
    """Everything the kernels need that depends only on the configuration and E (cached)."""

    E: int
    k: int
    fwd: dict
    bwd: dict
    block_t: int
    has_scaling: bool
    scaling: float


@functools.lru_cache(maxsize=256)
def route_plan(
    E: int,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    group_score: str,
    normalize_topk: bool | None,
    scaling_factor: float | None,
    has_bias: bool,
) -> RoutePlan:
    """The constexprs and block sizes of one routing configuration (arguments already valid)."""
    score = _SCORES[score_function]
    if score == 0:
        pre = bool(use_pre_softmax)
        full = pre or normalize_topk is False
        normalize = bool(normalize_topk) if pre else False
    else:
        pre = full = False
        normalize = topk > 1 if normalize_topk is None else bool(normalize_topk)
    G = num_groups if num_groups is not None and group_topk is not None else 1
    X = E // G
    g_top = group_topk if G > 1 else 1
    nsum = (topk // g_top if group_score == "sum_topk" else 1) if G > 1 else 1
    G_PAD, X_PAD = next_pow2(G), next_pow2(X)
    block_t = max(1, min(128, _TILE // (G_PAD * X_PAD)))
    has_scaling = scaling_factor is not None
    common = {
        "K": topk,
        "K_PAD": next_pow2(topk),
        "SCORE": score,
        "PRE": pre,
        "FULL_SOFTMAX": full,
        "NORMALIZE": normalize,
        "HAS_SCALING": has_scaling,
        "BLOCK_T": block_t,
    }
    fwd = dict(
        common,
        G=G,
        X=X,
        G_PAD=G_PAD,
        X_PAD=X_PAD,
        GROUP_TOPK=g_top,
        NSUM=nsum,
        HAS_BIAS=has_bias,
        # the probs' source is the selection score itself (no bias, no separate full softmax)
        VALUE_FROM_KEY=(pre or not full) if score == 0 else not has_bias,
    )
    bwd_block = max(1, min(128, _TILE // next_pow2(E)))
    bwd = dict(common, E=E, E_PAD=next_pow2(E), BLOCK_T=bwd_block)
    return RoutePlan(
        E=E,
        k=topk,
        fwd=fwd,
        bwd=bwd,
        block_t=block_t,
        has_scaling=has_scaling,
        scaling=float(scaling_factor) if has_scaling else 1.0,
    )


_FWD: Kernel | None = None
_BWD: Kernel | None = None


def _kernels() -> tuple[Kernel, Kernel]:
    global _FWD, _BWD
    if _FWD is None or _BWD is None:
        from flexdispatch.kernels import _routing_src

        _FWD, _BWD = Kernel(_routing_src.route_fwd), Kernel(_routing_src.route_bwd)
    return _FWD, _BWD


def _forward(
    logits_TE: torch.Tensor, bias_E: torch.Tensor | None, plan: RoutePlan
) -> tuple[torch.Tensor, torch.Tensor]:
    T = logits_TE.shape[0]
    idx_TK = torch.empty((T, plan.k), dtype=torch.int64, device=logits_TE.device)
    probs_TK = torch.empty((T, plan.k), dtype=torch.float32, device=logits_TE.device)
    if T:
        fwd, _ = _kernels()
        grid = (-(-T // plan.block_t),)
        fwd.get()[grid](
            logits_TE,
            logits_TE if bias_E is None else bias_E,
            idx_TK,
            probs_TK,
            T,
            logits_TE.stride(0),
            plan.scaling,
            **plan.fwd,
        )
    return idx_TK, probs_TK


def _backward(
    logits_TE: torch.Tensor, idx_TK: torch.Tensor, grad_TK: torch.Tensor, plan: RoutePlan
) -> torch.Tensor:
    T, E = logits_TE.shape
    dx_TE = torch.empty((T, E), dtype=torch.float32, device=logits_TE.device)
    if T:
        _, bwd = _kernels()
        block = plan.bwd["BLOCK_T"]
        bwd.get()[(-(-T // block),)](
            logits_TE,
            idx_TK,
            grad_TK.contiguous(),
            dx_TE,
            T,
            logits_TE.stride(0),
            plan.scaling,
            **plan.bwd,
        )
    # NOTE: the torch path's gradient also comes back through a cast of the fp32 scores.
    return dx_TE if logits_TE.dtype == torch.float32 else dx_TE.to(logits_TE.dtype)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, logits_TE: torch.Tensor, bias_E: torch.Tensor | None, plan: RoutePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx_TK, probs_TK = _forward(logits_TE, bias_E, plan)
        ctx.save_for_backward(logits_TE, idx_TK)
        ctx.plan = plan  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(idx_TK)
        return idx_TK, probs_TK

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, _grad_idx: torch.Tensor | None, grad_TK: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None]:
        logits_TE, idx_TK = ctx.saved_tensors  # type: ignore[attr-defined]
        return _backward(logits_TE, idx_TK, grad_TK, ctx.plan), None, None  # type: ignore[attr-defined]


def route(
    logits_TE: torch.Tensor, bias_E: torch.Tensor | None, plan: RoutePlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, k] int64, topk_probs [T, k] fp32)``; differentiable w.r.t. ``logits``.

    ``logits_TE``: fp32/bf16/fp16 ``[T, E]`` with unit stride along E (the caller makes it so);
    ``bias_E``: ``[E]`` float selection bias or None.
    """
    if logits_TE.requires_grad and torch.is_grad_enabled():
        return _Route.apply(logits_TE, bias_E, plan)
    return _forward(logits_TE, bias_E, plan)
