"""Permute token rows expert-major (one row per ``(token, slot)`` pair) and sum them back.

T tokens · H hidden · E experts (``num_experts``; the local experts ``e`` when called after a
dispatch) · k top-k · N rows of a permutation (real rows, their alignment padding and, in
static mode, a zero tail).

Both directions are built on one primitive, a bag sum (``F.embedding_bag`` in ``"sum"`` mode):
every output row is the sum of a contiguous run of gathered input rows, accumulated in fp32 (the
argument's dtype when wider) by one thread per bag, so the result is deterministic on CPU and
CUDA, padding needs no separate zeroing pass, and the forward makes no ``[N, H]`` temporary,
with or without probs (they are per-entry weights of the bag sum). Gradients are the adjoint
operations, written out (a bag sum per token for ``permute``, a row gather for ``unpermute``)
rather than left to atomic scatter-adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from flexdispatch._validate import check_ids_in_range, check_tensor, checks_enabled
from flexdispatch.types import Permutation

__all__ = ["permute", "unpermute"]

# Elements (rows x H) per chunk of unpermute's weighted backward: cache-sized on CPU; on CUDA
# large, as the caching allocator makes temporaries cheap and every chunk costs kernel launches.
_BACKWARD_CHUNK_ELEMENTS = 1 << 20
_BACKWARD_CHUNK_ELEMENTS_CUDA = 1 << 28


def _bag_sum(
    src: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum runs of gathered (optionally weighted) rows.

    Args:
        src: ``[S, D]`` float rows.
        indices: ``[I]`` int64 row ids into ``src``.
        offsets: ``[B + 1]`` int64 non-decreasing starts; bag ``b < B`` is
            ``indices[offsets[b]:offsets[b + 1]]`` and the last bag runs to the end of ``indices``.
        weights: ``[I]`` per-entry weights in ``src``'s dtype, or None.

    Returns:
        ``[B + 1, D]`` in ``src``'s dtype; an empty bag gives a zero row. Callers drop the last
        bag, which soaks up the entries that belong to no output row.
    """
    # NOTE: the spare last bag keeps us off include_last_offset, whose CUDA kernel read up to
    # the end of ``indices`` instead of the last offset in older torch releases.
    # NOTE: detached so that torch picks its forward-only kernel (no offset2bag bookkeeping);
    # the callers are autograd Functions that write the backward themselves.
    return F.embedding_bag(indices, src.detach(), offsets, mode="sum", per_sample_weights=weights)


def _token_bags(row_token: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by source token: ``(rows [N] int64, offsets [T + 1] int64)`` for ``_bag_sum``.

    Rows of one token keep their permutation (expert-major) order; padding rows (token ``-1``) go
    to the spare last bag and are redirected to row 0 so that summing them costs no bandwidth.
    """
    key = torch.where(row_token >= 0, row_token, num_tokens)
    sorted_key, rows = torch.sort(key, stable=True)
    bounds = torch.arange(num_tokens + 1, dtype=torch.int64, device=row_token.device)
    offsets = torch.searchsorted(sorted_key, bounds)
    rows = torch.where(sorted_key < num_tokens, rows, 0)
    return rows, offsets


def _sum_by_token(
    rows_NH: torch.Tensor,
    row_token: torch.Tensor,
    num_tokens: int,
    probs_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum of probs_N[r] * rows_NH[r] over r with row_token[r] == t``: ``[T, H]``.

    Accumulates in fp32 (or wider) and returns the rows' dtype. ``probs_N`` (``[N]``, any float
    dtype; None = all ones) is applied inside the bag sum, so no ``[N, H]`` temporary is made.
    """
    rows, offsets = _token_bags(row_token, num_tokens)
    if probs_N is None:
        return _bag_sum(rows_NH, rows, offsets)[:num_tokens]
    dtype = rows_NH.dtype
    w = probs_N.to(torch.promote_types(probs_N.dtype, torch.float32)).index_select(0, rows)
    if dtype.itemsize >= 4:
        return _bag_sum(rows_NH, rows, offsets, w.to(dtype))[:num_tokens]
    # NOTE: a 16-bit weight would round probs to 8 (bf16) or 11 (fp16) bits. Each row enters its
    # bag twice instead, weighted by the high and the low part of the prob: the fp32 products
    # are exact and the pair carries ~16 bits, while the second read of a row hits the cache.
    hi = w.to(dtype)
    lo = (w - hi.to(w.dtype)).to(dtype)
    rows2 = rows.repeat_interleave(2)
    w2 = torch.stack([hi, lo], dim=1).reshape(-1)
    return _bag_sum(rows_NH, rows2, offsets * 2, w2)[:num_tokens]


def _gather_by_token(src_TH: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
    """``out[r] = src_TH[row_token[r]]``, zero where ``row_token[r] == -1``: ``[N, H]``."""
    if src_TH.shape[0] == 0:
        return src_TH.new_zeros(row_token.shape[0], src_TH.shape[1])
    out = src_TH.index_select(0, row_token.clamp(min=0))
    return out.masked_fill_((row_token < 0).unsqueeze(1), 0)


class _PermuteRows(torch.autograd.Function):
    """``x [T, H] -> rows [N, H]`` through precomputed bags of 0 or 1 token each."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        bag_tokens: torch.Tensor,
        bag_offsets: torch.Tensor,
        row_token: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(row_token)
        ctx.num_tokens = x.shape[0]
        return _bag_sum(x, bag_tokens, bag_offsets)[: row_token.shape[0]]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_NH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (row_token,) = ctx.saved_tensors
        grad_TH = _sum_by_token(grad_NH.contiguous(), row_token, ctx.num_tokens)
        return grad_TH, None, None, None


class _UnpermuteRows(torch.autograd.Function):
    """``rows [N, H] (, probs [N]) -> out [T, H]``: weighted sum of each token's rows; padding
    rows are skipped."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        y: torch.Tensor,
        probs: torch.Tensor | None,
        row_token: torch.Tensor,
        num_tokens: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(y if probs is not None else None, probs, row_token)
        return _sum_by_token(y, row_token, num_tokens, probs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_TH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, probs, row_token = ctx.saved_tensors
        grad_TH = grad_TH.contiguous()
        if probs is None:
            return _gather_by_token(grad_TH, row_token), None, None, None
        need_y, need_probs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(torch.promote_types(y.dtype, probs.dtype), torch.float32)
        N, H = y.shape
        grad_y = torch.empty_like(y) if need_y else None
        grad_probs = torch.empty(N, dtype=acc, device=y.device) if need_probs else None
        # NOTE: chunks of rows keep the fp32 temporaries small (and in cache) instead of [N, H].
        elements = _BACKWARD_CHUNK_ELEMENTS_CUDA if y.is_cuda else _BACKWARD_CHUNK_ELEMENTS
        chunk = max(1, elements // max(H, 1))
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            grad_CH = _gather_by_token(grad_TH, row_token[rows]).to(acc)  # 0 on padding rows
            if grad_y is not None:
                grad_y[rows] = grad_CH * probs[rows].to(acc).unsqueeze(1)
            if grad_probs is not None:
                dot_C = torch.linalg.vecdot(grad_CH, y[rows].to(acc))
                grad_probs[rows] = torch.where(row_token[rows] >= 0, dot_C, 0)
        if grad_probs is not None:
            grad_probs = grad_probs.to(probs.dtype)
        return grad_y, grad_probs, None, None


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_same_device(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if value.device != ref.device:
        raise ValueError(
            f"{name} is on {value.device} but {ref_name} is on {ref.device}: move both to the "
            f"same device"
        )


def permute(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    *,
    topk_probs: torch.Tensor | None = None,
    align: int = 1,
    num_out_rows: int | None = None,
    num_rows: int | None = None,
    checks: bool | None = None,
) -> Permutation:
    """Copy each token once per valid top-k slot into rows grouped expert-major.

    Rows are ordered by expert, then by token, then by slot. With ``align > 1`` each expert's
    segment is followed by zero rows up to a multiple of ``align`` (``row_token = row_slot = -1``,
    prob 0).

    Output size: by default ``N = sum(padded_tokens_per_expert)`` exactly, which needs that sum on
    the host: **one** device-to-host sync (``.item()``). With ``num_out_rows=R_out`` the output has
    exactly ``R_out`` rows (the exact result first, then zero rows with ``row_token = -1``) and
    nothing syncs, so the call can be captured in a CUDA graph; ``R_out`` must be at least the
    static bound ``T*k + num_experts*(align - 1)``, which no routing can exceed.

    Args:
        x: ``[T, H]`` rows, any floating dtype.
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)``; ``-1`` = no expert. With
            value checks off, other out-of-range ids are treated like ``-1``.
        num_experts: number of experts (segments), > 0.
        topk_probs: ``[T, k]`` float routing weights, or None.
        align: pad each expert segment to a multiple of this (>= 1).
        num_out_rows: static output size ``R_out`` (no host sync), or None for the exact size.
        num_rows: the exact size ``N`` when the caller already holds it on the host (e.g.
            ``DispatchResult.num_recv_pairs`` with ``align == 1``): no host sync. Trusted; with
            value checks on it is compared with the device count. Exclusive with ``num_out_rows``.
        checks: run the host-syncing id-range check (default: ``FLEXDISPATCH_CHECKS``).

    Returns:
        ``Permutation`` with ``x`` ``[N, H]`` in ``x``'s dtype, ``probs`` ``[N]`` float32 (float64
        for float64 ``topk_probs``) or None, ``tokens_per_expert`` and
        ``padded_tokens_per_expert`` ``[num_experts]`` int64, ``row_token`` / ``row_slot`` ``[N]``
        int64 (``-1`` on padding) and ``num_tokens = T``. Differentiable w.r.t. ``x`` and
        ``topk_probs``; bit-for-bit deterministic.

    Raises:
        TypeError, ValueError: on a malformed argument (the message names it).
    """
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    _check_same_device("topk_idx", topk_idx, "x", x)
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]}: both must be [T, ...] "
            f"for the same T tokens"
        )
    if topk_probs is not None:
        check_tensor("topk_probs", topk_probs, ndim=2, floating=True)
        _check_same_device("topk_probs", topk_probs, "x", x)
        if topk_probs.shape != topk_idx.shape:
            raise ValueError(
                f"topk_probs has shape {tuple(topk_probs.shape)} but topk_idx has "
                f"{tuple(topk_idx.shape)}: pass the [T, k] probs that belong to topk_idx"
            )
    num_experts = _check_int("num_experts", num_experts, 1)
    align = _check_int("align", align, 1)
    T, k = topk_idx.shape
    bound = T * k + num_experts * (align - 1)
    if num_out_rows is not None:
        _check_int("num_out_rows", num_out_rows, 0)
        if num_out_rows < bound:
            raise ValueError(
                f"num_out_rows={num_out_rows} is below the static bound T*k + num_experts*(align-1)"
                f" = {T}*{k} + {num_experts}*{align - 1} = {bound}: pass at least {bound} (or None "
                f"for the exact size, which costs one host sync)"
            )
    if num_rows is not None:
        if num_out_rows is not None:
            raise ValueError("pass num_rows (exact size) or num_out_rows (static size), not both")
        _check_int("num_rows", num_rows, 0)
    do_checks = checks_enabled(checks)
    if do_checks:
        check_ids_in_range("topk_idx", topk_idx, num_experts)

    device = x.device
    num_pairs = T * k
    # Pairs (token, slot) in flat token-major order p = t*k + s; a stable sort by expert makes
    # the order expert-major, then token, then slot. Invalid pairs sort last under key E.
    idx_P = topk_idx.reshape(-1)
    key_P = torch.where((idx_P >= 0) & (idx_P < num_experts), idx_P, num_experts)
    sorted_key_P, order_P = torch.sort(key_P, stable=True)
    experts = torch.arange(num_experts + 1, dtype=torch.int64, device=device)
    bounds_E1 = torch.searchsorted(sorted_key_P, experts)  # segment starts; [E] = valid pairs
    counts_E = bounds_E1[1:] - bounds_E1[:-1]
    padded_E = (counts_E + (align - 1)) // align * align
    pad_end_E = torch.cumsum(padded_E, 0)
    pad_start_E1 = torch.cat([pad_end_E.new_zeros(1), pad_end_E])

    if num_out_rows is not None:
        num_rows = num_out_rows
    elif num_rows is None:
        num_rows = int(pad_start_E1[-1].item())  # NOTE: exact mode's one host sync.
    elif do_checks and num_rows != int(pad_start_E1[-1].item()):
        raise ValueError(
            f"num_rows={num_rows} but the routing holds {int(pad_start_E1[-1].item())} rows: pass "
            f"the exact count (or None to count on the device, one host sync)"
        )

    rows_N = torch.arange(num_rows, dtype=torch.int64, device=device)
    seg_N = torch.searchsorted(pad_end_E, rows_N, right=True)  # expert of each row; E = tail
    counts_E1 = torch.cat([counts_E, counts_E.new_zeros(1)])
    rank_N = rows_N - pad_start_E1[seg_N]
    real_N = rank_N < counts_E1[seg_N]
    # Bag of row r = the valid sorted pairs before it and its own pair if it is real.
    offsets_N = bounds_E1[seg_N] + torch.minimum(rank_N, counts_E1[seg_N])
    offsets_N1 = torch.cat([offsets_N, bounds_E1[-1:]])
    pos_N = torch.where(real_N, bounds_E1[seg_N] + rank_N, num_pairs)
    order_P1 = torch.cat([order_P, order_P.new_full((1,), -1)])
    pair_N = order_P1[pos_N]  # -1 on padding
    k_safe = max(k, 1)
    row_token = torch.where(real_N, torch.div(pair_N, k_safe, rounding_mode="floor"), -1)
    row_slot = torch.where(real_N, pair_N % k_safe, -1)

    valid_sorted_P = sorted_key_P < num_experts
    bag_tokens_P = torch.where(valid_sorted_P, torch.div(order_P, k_safe, rounding_mode="floor"), 0)
    x_N = _PermuteRows.apply(x.contiguous(), bag_tokens_P, offsets_N1, row_token)

    probs_N = None
    if topk_probs is not None:
        acc = torch.promote_types(topk_probs.dtype, torch.float32)
        probs_P = topk_probs.reshape(-1).to(acc).index_select(0, order_P)
        probs_P1 = torch.cat([probs_P, probs_P.new_zeros(1)])
        probs_N = probs_P1.index_select(0, pos_N)

    return Permutation(
        x=x_N,
        probs=probs_N,
        tokens_per_expert=counts_E,
        padded_tokens_per_expert=padded_E,
        row_token=row_token,
        row_slot=row_slot,
        num_tokens=T,
    )


def unpermute(
    y: torch.Tensor, perm: Permutation, *, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum each source token's rows back into place (the adjoint of ``permute``).

    ``out[t] = sum over rows r of token t of probs[r] * y[r]`` (``probs[r] = 1`` when None);
    padding rows contribute nothing, whatever they hold. No host sync.

    Args:
        y: ``[N, H]`` float rows in ``perm``'s row order (e.g. expert outputs of ``perm.x``).
        perm: the ``Permutation`` that ``permute`` returned.
        probs: ``[N]`` float weight per row (typically ``perm.probs``), or None for a plain sum.

    Returns:
        ``[T, H]`` in ``y``'s dtype. Accumulated in fp32 (float64 for float64 inputs);
        differentiable w.r.t. ``y`` and ``probs``; bit-for-bit deterministic.

    Raises:
        TypeError, ValueError: on a malformed argument (the message names it).
    """
    if not isinstance(perm, Permutation):
        raise TypeError(f"perm must be the Permutation returned by permute, got {type(perm)}")
    check_tensor("y", y, ndim=2, floating=True)
    row_token = perm.row_token
    _check_same_device("y", y, "perm.row_token", row_token)
    if y.shape[0] != row_token.shape[0]:
        raise ValueError(
            f"y has {y.shape[0]} rows but perm has {row_token.shape[0]}: y must be [N, H] with "
            f"one row per row of perm.x"
        )
    if y.shape[1] != perm.x.shape[1]:
        raise ValueError(
            f"y has hidden size {y.shape[1]} but perm.x has {perm.x.shape[1]}: unpermute sums "
            f"rows of the permuted hidden size"
        )
    if probs is not None:
        check_tensor("probs", probs, ndim=1, floating=True)
        _check_same_device("probs", probs, "y", y)
        if probs.shape[0] != y.shape[0]:
            raise ValueError(
                f"probs has shape {tuple(probs.shape)} but y has {y.shape[0]} rows: pass one "
                f"weight per row, e.g. perm.probs"
            )
    return _UnpermuteRows.apply(y.contiguous(), probs, row_token, perm.num_tokens)
