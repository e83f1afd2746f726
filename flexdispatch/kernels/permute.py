"""Permute / unpermute rows with Triton kernels, forward and backward (``permute.py``'s
``impl="triton"``).

Shape letters: T tokens · H hidden · E experts (segments) · k top-k · N rows · P = T*k pairs.

``permutation.permute`` sorts the pairs by expert (a stable torch sort: the order is the torch
path's) and calls :func:`permute_rows`, whose one kernel writes every row of the permutation (the
row copy or zeros), its token/slot maps, its prob and the inverse map ``pair_rows`` ``[T, k]``.
:func:`unpermute_rows` sums each token's rows (weighted by the probs, in fp32, in ascending row
order: the order of the torch path's bag sums) in one kernel. The gradients are the adjoint
kernels: a sum per token for ``permute``, a row gather (with the probs' dot products) for
``unpermute``. No atomics anywhere: deterministic.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from flexdispatch.kernels._triton import Kernel, next_pow2

__all__ = ["permute_rows", "unpermute_rows"]

_BLOCK_BYTES = 2048  # bytes of a row chunk per program iteration (1,024 bf16 values)

_K: dict[str, Kernel] = {}


def _kernel(name: str) -> Kernel:
    k = _K.get(name)
    if k is None:
        from flexdispatch.kernels import _permute_src

        k = _K[name] = Kernel(getattr(_permute_src, name))
    return k


def _block_h(H: int, dtype: torch.dtype) -> int:
    return max(16, min(next_pow2(H), _BLOCK_BYTES // dtype.itemsize))


def _acc(dtype: torch.dtype) -> object:
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _sum_rows(
    src_NH: torch.Tensor,
    pair_rows_TK: torch.Tensor,
    w_N: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    T, k = pair_rows_TK.shape
    H = src_NH.shape[1]
    out_TH = torch.empty((T, H), dtype=out_dtype, device=src_NH.device)
    if T and H:
        acc_dtype = src_NH.dtype if w_N is None else torch.promote_types(src_NH.dtype, w_N.dtype)
        _kernel("sum_rows").get()[(T,)](
            src_NH,
            pair_rows_TK,
            src_NH if w_N is None else w_N,
            out_TH,
            K=k,
            K_PAD=next_pow2(k),
            WEIGHTED=w_N is not None,
            ACC=_acc(acc_dtype),
            OUT_BF16=out_dtype == torch.bfloat16,
            H=H,
            BLOCK_H=_block_h(H, src_NH.dtype),
        )
    return out_TH


def _gather_rows(
    src_TH: torch.Tensor,
    row_token_N: torch.Tensor,
    w_N: torch.Tensor | None,
    y_NH: torch.Tensor | None,
    out_dtype: torch.dtype,
    dot_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    N = row_token_N.shape[0]
    H = src_TH.shape[1]
    out_NH = torch.empty((N, H), dtype=out_dtype, device=src_TH.device)
    dot_N = None if y_NH is None else torch.empty(N, dtype=dot_dtype, device=src_TH.device)
    if N:
        acc_dtype = src_TH.dtype if w_N is None else torch.promote_types(src_TH.dtype, w_N.dtype)
        if y_NH is not None:
            acc_dtype = torch.promote_types(acc_dtype, y_NH.dtype)
        _kernel("gather_rows").get()[(N,)](
            src_TH,
            row_token_N,
            out_NH,
            src_TH if w_N is None else w_N,
            src_TH if y_NH is None else y_NH,
            out_NH if dot_N is None else dot_N,
            WEIGHTED=w_N is not None,
            DOT=y_NH is not None,
            ACC=_acc(acc_dtype),
            OUT_BF16=out_dtype == torch.bfloat16,
            H=H,
            BLOCK_H=_block_h(H, src_TH.dtype),
        )
    return out_NH, dot_N


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        x_TH: torch.Tensor,
        probs_TK: torch.Tensor | None,
        meta: tuple,
        out: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        outs = _permute_forward(x_TH, probs_TK, meta, out[0])
        ctx.save_for_backward(outs[3])  # pair_rows
        ctx.x_dtype = x_TH.dtype  # type: ignore[attr-defined]
        ctx.probs_dtype = None if probs_TK is None else probs_TK.dtype  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(*outs[1:4])
        return outs

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx,
        grad_NH: torch.Tensor,
        _g_token: torch.Tensor | None,
        _g_slot: torch.Tensor | None,
        _g_pair_rows: torch.Tensor | None,
        grad_probs_N: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        (pair_rows_TK,) = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_x = None
        if ctx.needs_input_grad[0]:  # type: ignore[attr-defined]
            grad_x = _sum_rows(grad_NH.contiguous(), pair_rows_TK, None, ctx.x_dtype)  # type: ignore[attr-defined]
        grad_probs = None
        if ctx.needs_input_grad[1] and grad_probs_N is not None:  # type: ignore[attr-defined]
            got_TK = grad_probs_N.index_select(0, pair_rows_TK.clamp(min=0).reshape(-1))
            got_TK = got_TK.view(pair_rows_TK.shape)
            grad_probs = torch.where(pair_rows_TK >= 0, got_TK, 0).to(ctx.probs_dtype)  # type: ignore[attr-defined]
        return grad_x, grad_probs, None, None


def _permute_forward(
    x_TH: torch.Tensor,
    probs_TK: torch.Tensor | None,
    meta: tuple,
    out_NH: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    order_P, bounds_E1, counts_E, pad_end_E, k, num_rows, acc_dtype = meta
    T, H = x_TH.shape
    E = counts_E.shape[0]
    device = x_TH.device
    row_token_N = torch.empty(num_rows, dtype=torch.int64, device=device)
    row_slot_N = torch.empty(num_rows, dtype=torch.int64, device=device)
    pair_rows_TK = torch.full((T, k), -1, dtype=torch.int64, device=device)
    probs_N = None
    if probs_TK is not None:
        probs_N = torch.empty(num_rows, dtype=acc_dtype, device=device)
    if num_rows:
        _kernel("permute_rows").get()[(num_rows,)](
            x_TH,
            out_NH,
            row_token_N,
            row_slot_N,
            pair_rows_TK,
            x_TH if probs_TK is None else probs_TK,
            row_token_N if probs_N is None else probs_N,
            order_P,
            bounds_E1,
            counts_E,
            counts_E if pad_end_E is None else pad_end_E,
            max(k, 1),
            E,
            ALIGN1=pad_end_E is None,
            HAS_PROBS=probs_TK is not None,
            STEPS=max(1, (E + 1).bit_length()),
            H=H,
            BLOCK_H=_block_h(H, x_TH.dtype),
        )
    return out_NH, row_token_N, row_slot_N, pair_rows_TK, probs_N


def permute_rows(
    x_TH: torch.Tensor,
    probs_TK: torch.Tensor | None,
    *,
    order_P: torch.Tensor,
    bounds_E1: torch.Tensor,
    counts_E: torch.Tensor,
    pad_end_E: torch.Tensor | None,
    k: int,
    num_rows: int,
    out_NH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows of a permutation and its maps, from the expert order of the pairs.

    Args:
        x_TH: ``[T, H]`` contiguous rows.
        probs_TK: ``[T, k]`` contiguous float probs, or None.
        order_P: ``[P]`` int64 pairs ``t*k + s`` sorted by expert (stable), invalid ones last.
        bounds_E1: ``[E + 1]`` int64 start of each expert's pairs in ``order_P``; ``[E]`` = valid.
        counts_E: ``[E]`` int64 valid pairs per expert.
        pad_end_E: ``[E]`` int64 cumulative ends of the padded segments (``align > 1``), or None
            (``align == 1``: row ``r`` is sorted pair ``r``).
        k: top-k (columns of the routing).
        num_rows: N (rows past the real and padding rows are a zero tail).
        out_NH: ``[N, H]`` buffer of ``x``'s dtype to write the rows into.

    Returns:
        ``(x_N [N, H], row_token [N], row_slot [N], pair_rows [T, k], probs_N [N] or None)``;
        ``x_N`` and ``probs_N`` are differentiable w.r.t. ``x_TH`` and ``probs_TK``.
    """
    acc_dtype = None
    if probs_TK is not None:
        acc_dtype = torch.float64 if probs_TK.dtype == torch.float64 else torch.float32
    meta = (order_P, bounds_E1, counts_E, pad_end_E, k, num_rows, acc_dtype)
    grad = torch.is_grad_enabled() and (
        x_TH.requires_grad or (probs_TK is not None and probs_TK.requires_grad)
    )
    if grad:
        return _PermuteRows.apply(x_TH, probs_TK, meta, [out_NH])
    return _permute_forward(x_TH, probs_TK, meta, out_NH)


class _UnpermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        y_NH: torch.Tensor,
        probs_N: torch.Tensor | None,
        row_token_N: torch.Tensor,
        pair_rows_TK: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(y_NH if probs_N is not None else None, probs_N, row_token_N)
        return _sum_rows(y_NH, pair_rows_TK, probs_N, y_NH.dtype)

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_TH: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        y_NH, probs_N, row_token_N = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_TH = grad_TH.contiguous()
        if probs_N is None:
            g, _ = _gather_rows(grad_TH, row_token_N, None, None, grad_TH.dtype, grad_TH.dtype)
            return g, None, None, None
        need_probs = ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        dot_dtype = torch.promote_types(y_NH.dtype, probs_N.dtype)
        dot_dtype = torch.promote_types(dot_dtype, torch.float32)
        g, dot = _gather_rows(
            grad_TH, row_token_N, probs_N, y_NH if need_probs else None, y_NH.dtype, dot_dtype
        )
        grad_probs = None if dot is None else dot.to(probs_N.dtype)
        return g, grad_probs, None, None


def unpermute_rows(
    y_NH: torch.Tensor,
    probs_N: torch.Tensor | None,
    row_token_N: torch.Tensor,
    pair_rows_TK: torch.Tensor,
) -> torch.Tensor:
    """``out [T, H]``: each token's rows summed (weighted by ``probs_N``), in ``y``'s dtype.

    Args:
        y_NH: ``[N, H]`` contiguous float rows in the permutation's order.
        probs_N: ``[N]`` float weights, or None.
        row_token_N: ``[N]`` int64 token of each row, ``-1`` on padding (for the backward).
        pair_rows_TK: ``[T, k]`` int64 row of each pair, ``-1`` where it has none.
    """
    grad = torch.is_grad_enabled() and (
        y_NH.requires_grad or (probs_N is not None and probs_N.requires_grad)
    )
    if grad:
        return _UnpermuteRows.apply(y_NH, probs_N, row_token_N, pair_rows_TK)
    return _sum_rows(y_NH, pair_rows_TK, probs_N, y_NH.dtype)
