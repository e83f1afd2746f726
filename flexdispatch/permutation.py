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

``impl="triton"`` (and ``"auto"`` on CUDA tensors when ``triton`` imports) moves the rows with
the kernels of ``flexdispatch.kernels.permute`` instead: the same stable expert sort (a torch
op), then one kernel that writes every row with its maps and prob, and one that sums each
token's rows in fp32 in the same (ascending row) order; same rows, maps and probs bit for bit,
sums to fp32 rounding (docs/determinism.md).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from flexdispatch import _pool
from flexdispatch._checks import fits
from flexdispatch._checks.tensors import (
    check_ids_in_range,
    check_routing,
    check_same_device,
    check_tensor,
    checks_enabled,
)
from flexdispatch._checks.values import check_int
from flexdispatch.kernels import resolve_impl
from flexdispatch.types import Permutation

__all__ = ["permute", "unpermute"]

# Elements (rows x H) per chunk of unpermute's weighted backward: cache-sized on CPU; on CUDA
# large, as the caching allocator makes temporaries cheap and every chunk costs kernel launches.
_BACKWARD_CHUNK_ELEMENTS = 1 << 20
_BACKWARD_CHUNK_ELEMENTS_CUDA = 1 << 28


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)`` for a float dtype, without a dispatcher call
    (under a ``TorchDispatchMode`` ``promote_types`` is an op of its own)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _token_bags(
    row_token: torch.Tensor, num_tokens: int, *, dense: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by source token: ``(rows [N] int64, offsets [T + 1] int64)`` for ``_bag_sum``.

    Rows of one token keep their permutation (expert-major) order; padding rows (token ``-1``) go
    to the spare last bag and are redirected to row 0 so that summing them costs no bandwidth.
    ``dense``: every row is real (no ``-1``), which saves the redirect.
    """
    # NOTE: ``-1 mod (T + 1) == T``: padding rows sort last, behind every real token.
    key = row_token if dense else row_token.remainder(num_tokens + 1)
    sorted_key, rows = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, _pool.arange(num_tokens + 1, row_token.device))
    if not dense:
        rows.masked_fill_(sorted_key == num_tokens, 0)
    return rows, offsets


def _sum_by_token(
    rows_NH: torch.Tensor,
    row_token: torch.Tensor,
    num_tokens: int,
    probs_N: torch.Tensor | None = None,
    *,
    dense: bool = False,
) -> torch.Tensor:
    """``out[t] = sum of probs_N[r] * rows_NH[r] over r with row_token[r] == t``: ``[T, H]``.

    Accumulates in fp32 (or wider) and returns the rows' dtype. ``probs_N`` (``[N]``, any float
    dtype; None = all ones) is applied inside the bag sum, so no ``[N, H]`` temporary is made.
    ``dense``: ``row_token`` holds no ``-1`` (an exact permutation with ``align == 1``).
    """
    rows, offsets = _token_bags(row_token, num_tokens, dense=dense)
    if probs_N is None:
        return _bag_sum(rows_NH, rows, offsets)[:num_tokens]
    dtype = rows_NH.dtype
    w = probs_N.to(_acc_dtype(probs_N.dtype)).index_select(0, rows)
    if dtype.itemsize >= 4:
        return _bag_sum(rows_NH, rows, offsets, w.to(dtype))[:num_tokens]
    # NOTE: a 16-bit weight would round probs to 8 (bf16) or 11 (fp16) bits. Each row enters its
    # bag twice instead, weighted by the high and the low part of the prob: the fp32 products
    # are exact and the pair carries ~16 bits, while the second read of a row hits the cache.
    # ``w - w.to(dtype)`` promotes to w's dtype: the same value as ``w - hi.to(w.dtype)``.
    lo = w - w.to(dtype)
    w2 = torch.stack([w, lo], dim=1).to(dtype).reshape(-1)  # (hi, lo) per entry
    rows2 = torch.stack([rows, rows], dim=1).reshape(-1)
    return _bag_sum(rows_NH, rows2, offsets * 2, w2)[:num_tokens]


def _gather_by_token(
    src_TH: torch.Tensor,
    row_token: torch.Tensor,
    *,
    dense: bool = False,
    padded: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = src_TH[row_token[r]]``, zero where ``row_token[r] == -1``: ``[N, H]``.

    ``dense``: ``row_token`` holds no ``-1`` (one gather, nothing to zero). ``padded``:
    ``src_TH`` is ``[T + 1, H]`` with a zero last row already (callers that gather in chunks).
    ``out``: an ``[N, H]`` buffer of ``src_TH``'s dtype to write into, or None for a new tensor.
    """
    if out is None:
        out = torch.empty(
            (row_token.shape[0], src_TH.shape[1]), dtype=src_TH.dtype, device=src_TH.device
        )
    if dense:
        return torch.index_select(src_TH, 0, row_token, out=out)
    # NOTE: a zero row appended to the source (T rows more to copy) serves the padding rows
    # (``-1 mod (T + 1) == T``), instead of a masking pass over all N output rows.
    T = src_TH.shape[0] - int(padded)
    src = src_TH if padded else torch.cat([src_TH, src_TH.new_zeros(1, src_TH.shape[1])])
    return torch.index_select(src, 0, row_token.remainder(T + 1), out=out)


class _PermuteRows(torch.autograd.Function):
    """``x [T, H] -> rows [N, H]``: row ``r`` is ``x[row_token[r]]``, zero where it is ``-1``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        row_token: torch.Tensor,
        dense: bool,
        out: list[torch.Tensor],
    ) -> torch.Tensor:
        ctx.save_for_backward(row_token)
        ctx.num_tokens = x.shape[0]
        ctx.dense = dense
        # NOTE: ``out`` travels in a list so that autograd does not take it for an input.
        return _gather_by_token(x.detach(), row_token, dense=dense, out=out[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_NH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (row_token,) = ctx.saved_tensors
        grad_TH = _sum_by_token(grad_NH.contiguous(), row_token, ctx.num_tokens, dense=ctx.dense)
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
        dense: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(y if probs is not None else None, probs, row_token)
        ctx.dense = dense
        return _sum_by_token(y, row_token, num_tokens, probs, dense=dense)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_TH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, probs, row_token = ctx.saved_tensors
        grad_TH = grad_TH.contiguous()
        if probs is None:
            return _gather_by_token(grad_TH, row_token, dense=ctx.dense), None, None, None, None
        need_y, need_probs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _acc_dtype(torch.promote_types(y.dtype, probs.dtype))
        N, H = y.shape
        grad_y = torch.empty_like(y) if need_y else None
        grad_probs = torch.empty(N, dtype=acc, device=y.device) if need_probs else None
        # NOTE: chunks of rows keep the fp32 temporaries small (and in cache) instead of [N, H].
        elements = _BACKWARD_CHUNK_ELEMENTS_CUDA if y.is_cuda else _BACKWARD_CHUNK_ELEMENTS
        chunk = max(1, elements // max(H, 1))
        if not ctx.dense:
            grad_TH = torch.cat([grad_TH, grad_TH.new_zeros(1, H)])  # the padding rows' zero row
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            grad_CH = _gather_by_token(
                grad_TH, row_token[rows], dense=ctx.dense, padded=not ctx.dense
            ).to(acc)  # 0 on padding rows
            if grad_y is not None:
                grad_y[rows] = grad_CH * probs[rows].to(acc).unsqueeze(1)
            if grad_probs is not None:
                dot_C = torch.linalg.vecdot(grad_CH, y[rows].to(acc))
                grad_probs[rows] = torch.where(row_token[rows] >= 0, dot_C, 0)
        if grad_probs is not None:
            grad_probs = grad_probs.to(probs.dtype)
        return grad_y, grad_probs, None, None, None


def _check_permute_fits(
    x: torch.Tensor, E: int, align: int, static_rows: int | None, rows: int, row_bytes: int
) -> None:
    """Refuse a ``permute`` whose output cannot fit (``flexdispatch._checks.fits``)."""
    where = x.device
    detail = "[E] int64 counts and segment bounds"
    fits.check_fits("permute", "num_experts", E, 32 * E, where, detail=detail)
    detail = f"rows of H={x.shape[1]} {x.dtype} plus int64 row indices"
    if static_rows is not None:
        name, value, fix = "static_rows", static_rows, "pass the static bound T*k + E*(align-1)"
    elif align > 1:
        name, value = "align", align
        fix = "pass the alignment the grouped GEMM needs (e.g. 8, 16 or 128)"
    else:
        name, value, fix = "T*k", rows, "permute fewer tokens per call"
    fits.check_fits("permute", name, value, rows * row_bytes, where, detail=detail, fix=fix)


def permute(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    *,
    topk_probs: torch.Tensor | None = None,
    align: int = 1,
    static_rows: int | None = None,
    num_rows: int | None = None,
    checks: bool | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    num_out_rows: int | None = None,
) -> Permutation:
    """Copy each token once per valid top-k slot into rows grouped expert-major.

    Rows are ordered by expert, then by token, then by slot. With ``align > 1`` each expert's
    segment is followed by zero rows up to a multiple of ``align`` (``row_token = row_slot = -1``,
    prob 0).

    Output size: by default ``N = sum(padded_tokens_per_expert)`` exactly, which needs that sum on
    the host: **one** device-to-host sync (``.item()``). With ``static_rows=S`` the output has
    exactly ``S`` rows (the exact result first, then zero rows with ``row_token = -1``) and
    nothing syncs, so the call can be captured in a CUDA graph; ``S`` must be at least the
    static bound ``T*k + num_experts*(align - 1)``, which no routing can exceed.

    Args:
        x: ``[T, H]`` rows, any floating dtype.
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)``; ``-1`` = no expert. With
            value checks off, other out-of-range ids are treated like ``-1``.
        num_experts: number of experts (segments), > 0.
        topk_probs: ``[T, k]`` float routing weights, or None.
        align: pad each expert segment to a multiple of this (>= 1).
        static_rows: static output size ``S`` (no host sync), or None for the exact size.
        num_rows: the exact size ``N`` when the caller already holds it on the host (e.g.
            ``DispatchResult.num_recv_pairs`` with ``align == 1``): no host sync. Trusted up to
            the most rows any routing holds (``T*k + min(T*k, num_experts)*(align-1)``, more is
            a ``ValueError``); with value checks on it is compared with the device count.
            Exclusive with ``static_rows``.
        checks: run the host-syncing id-range check (default: ``FLEXDISPATCH_CHECKS``).
        out: an ``[N, H]`` contiguous buffer of ``x``'s dtype and device to write the rows into
            (``perm.x`` is then ``out``), e.g. one kept across steps; must not require grad. None:
            a new tensor, on CPU from the process's output pool (``flexdispatch._pool``), which
            lends the memory of an earlier output again once nothing refers to it, sparing the
            page faults of a fresh allocation.
        impl: ``"auto"`` (Triton kernels on CUDA tensors when ``triton`` imports, else torch),
            ``"torch"`` or ``"triton"`` (also on CPU tensors under ``TRITON_INTERPRET=1``). The
            Triton permutation also carries ``pair_rows``, which its ``unpermute`` needs.
        num_out_rows: the name of ``static_rows`` before 0.1 (deprecated).

    Returns:
        ``Permutation`` with ``x`` ``[N, H]`` in ``x``'s dtype, ``probs`` ``[N]`` float32 (float64
        for float64 ``topk_probs``) or None, ``tokens_per_expert`` and
        ``padded_tokens_per_expert`` ``[num_experts]`` int64, ``row_token`` / ``row_slot`` ``[N]``
        int64 (``-1`` on padding) and ``num_tokens = T``. Differentiable w.r.t. ``x`` and
        ``topk_probs``; bit-for-bit deterministic.

    Raises:
        TypeError, ValueError: on a malformed argument (the message names it).
    """
    if num_out_rows is not None:
        warnings.warn(
            "permute(num_out_rows=...) is now permute(static_rows=...); the old name goes in "
            "the next release",
            DeprecationWarning,
            2,
        )
        if static_rows is not None:
            raise TypeError("pass static_rows (num_out_rows is its old name), not both")
        static_rows = num_out_rows
    check_routing(x, topk_idx, topk_probs, any_float_probs=True)
    num_experts = check_int("num_experts", num_experts, at_least=1, error=TypeError)
    align = check_int("align", align, at_least=1, error=TypeError)
    T, k = topk_idx.shape
    bound = T * k + num_experts * (align - 1)
    if static_rows is not None:
        check_int("static_rows", static_rows, at_least=0, error=TypeError)
        if static_rows < bound:
            raise ValueError(
                f"static_rows={static_rows} is below the static bound T*k + num_experts*(align-1)"
                f" = {T}*{k} + {num_experts}*{align - 1} = {bound}: pass at least {bound} (or None "
                f"for the exact size, which costs one host sync)"
            )
    if num_rows is not None:
        if static_rows is not None:
            raise ValueError("pass num_rows (exact size) or static_rows (static size), not both")
        check_int("num_rows", num_rows, at_least=0, error=TypeError)
        most = T * k + min(T * k, num_experts) * (align - 1)
        if num_rows > most:
            raise ValueError(
                f"num_rows={num_rows} is more rows than any routing of these T={T} tokens can "
                f"hold (T*k + min(T*k, num_experts)*(align-1) = {most}): pass the exact count "
                f"(e.g. DispatchResult.num_recv_pairs), or None to count it on the device"
            )
    row_bytes = x.shape[1] * x.element_size() + 24
    rows = static_rows if static_rows is not None else T * k + min(T * k, num_experts) * (align - 1)
    if rows * row_bytes + 32 * num_experts >= fits.SMALL_BYTES:  # NOTE: host ints only
        _check_permute_fits(x, num_experts, align, static_rows, rows, row_bytes)
    do_checks = checks_enabled(checks)
    if do_checks:
        check_ids_in_range("topk_idx", topk_idx, num_experts)
    return _permute(
        x,
        topk_idx,
        num_experts,
        topk_probs,
        static_rows=static_rows,
        num_rows=num_rows,
        impl=impl,
        align=align,
        verify=do_checks,
        out=out,
    )


def _row_count(
    total: torch.Tensor, static_rows: int | None, num_rows: int | None, verify: bool
) -> int:
    """The rows of a permutation: ``static_rows``, else ``num_rows`` (compared with the device
    count ``total`` when ``verify``), else ``total`` read on the host (exact mode's one sync)."""
    if static_rows is not None:
        return static_rows
    if num_rows is None:
        return int(total.item())  # NOTE: exact mode's one host sync
    if verify and num_rows != int(total.item()):
        raise ValueError(
            f"num_rows={num_rows} but the routing holds {int(total.item())} rows: pass the exact "
            f"count (or None to count on the device, one host sync)"
        )
    return num_rows


def _permute(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    topk_probs: torch.Tensor | None,
    *,
    static_rows: int | None,
    num_rows: int | None,
    impl: str,
    align: int = 1,
    verify: bool = False,
    out: torch.Tensor | None = None,
) -> Permutation:
    """``permute`` without its argument checks, for the package's own callers whose inputs a
    dispatch made (``MoELayer``, the torchtitan plug-in): shapes, dtypes and id ranges are the
    dispatcher's, checked once on the way in. ``verify``: compare ``num_rows`` with the device
    count (``permute`` with value checks on)."""
    triton = impl != "torch" and resolve_impl(impl, x.device, what="permute")
    T, k = topk_idx.shape
    device = x.device
    num_pairs = T * k
    k_safe = max(k, 1)
    # Pairs (token, slot) in flat token-major order p = t*k + s; a stable sort by expert makes
    # the order expert-major, then token, then slot. Invalid pairs sort last under key E: ids
    # are clamped to [-1, E] and ``-1 mod (E + 1) == E``.
    key_P = topk_idx.reshape(-1).clamp(-1, num_experts).remainder_(num_experts + 1)
    sorted_key_P, order_P = torch.sort(key_P, stable=True)
    # segment starts; [E] = valid pairs
    bounds_E1 = torch.searchsorted(sorted_key_P, _pool.arange(num_experts + 1, device))
    counts_E = bounds_E1.diff()

    probs_N = pair_rows = None
    acc = None if topk_probs is None else _acc_dtype(topk_probs.dtype)
    if triton:
        # NOTE: one kernel writes every row with its maps and prob (kernels.permute)
        from flexdispatch.kernels.permute import permute_rows

        if align == 1:
            padded_E, pad_end_E, total = counts_E, None, bounds_E1[-1]
        else:
            padded_E = (counts_E + (align - 1)) // align * align
            pad_end_E = torch.cumsum(padded_E, 0)
            total = pad_end_E[-1]
        num_rows = _row_count(total, static_rows, num_rows, verify)
        x_N, row_token, row_slot, pair_rows, probs_N = permute_rows(
            x.contiguous(),
            None if topk_probs is None else topk_probs.contiguous(),
            order_P=order_P,
            bounds_E1=bounds_E1,
            counts_E=counts_E,
            pad_end_E=pad_end_E,
            k=k,
            num_rows=num_rows,
            out_NH=_rows_out(out, x, num_rows),
        )
        dense = static_rows is None and align == 1
    elif align == 1:
        # Rows are the sorted pairs themselves: row r is sorted pair r (real while r < valid).
        padded_E = counts_E
        num_rows = _row_count(bounds_E1[-1], static_rows, num_rows, verify)
        dense = static_rows is None
        if dense:
            order_N = order_P[:num_rows]
            row_token = torch.div(order_N, k_safe, rounding_mode="floor")
            row_slot = order_N.remainder(k_safe)
            if topk_probs is not None:
                probs_N = topk_probs.reshape(-1).index_select(0, order_N).to(acc)
        else:
            # static: the sorted pairs, invalid ones and a tail past T*k as -1
            pad_P = sorted_key_P == num_experts
            row_token = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
            row_slot = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
            torch.div(order_P, k_safe, rounding_mode="floor", out=row_token[:num_pairs])
            torch.remainder(order_P, k_safe, out=row_slot[:num_pairs])
            row_token[:num_pairs].masked_fill_(pad_P, -1)
            row_slot[:num_pairs].masked_fill_(pad_P, -1)
            if topk_probs is not None:
                probs_P = topk_probs.reshape(-1).index_select(0, order_P).to(acc)
                probs_P = probs_P.masked_fill_(pad_P, 0)
                tail = probs_P.new_zeros(num_rows - num_pairs)
                probs_N = torch.cat([probs_P, tail]) if num_rows > num_pairs else probs_P
    else:
        dense = False
        padded_E = (counts_E + (align - 1)) // align * align
        pad_end_E = torch.cumsum(padded_E, 0)
        pad_start_E1 = torch.cat([pad_end_E.new_zeros(1), pad_end_E])
        num_rows = _row_count(pad_start_E1[-1], static_rows, num_rows, verify)
        rows_N = torch.arange(num_rows, dtype=torch.int64, device=device)
        seg_N = torch.searchsorted(pad_end_E, rows_N, right=True)  # expert of each row; E = tail
        counts_E1 = torch.cat([counts_E, counts_E.new_zeros(1)])
        rank_N = rows_N - pad_start_E1[seg_N]
        real_N = rank_N < counts_E1[seg_N]
        pos_N = torch.where(real_N, bounds_E1[seg_N] + rank_N, num_pairs)
        order_P1 = torch.cat([order_P, order_P.new_full((1,), -1)])
        pair_N = order_P1[pos_N]  # -1 on padding
        row_token = torch.where(real_N, torch.div(pair_N, k_safe, rounding_mode="floor"), -1)
        row_slot = torch.where(real_N, pair_N % k_safe, -1)
        if topk_probs is not None:
            probs_P = topk_probs.reshape(-1).to(acc).index_select(0, order_P)
            probs_P1 = torch.cat([probs_P, probs_P.new_zeros(1)])
            probs_N = probs_P1.index_select(0, pos_N)
    if not triton:
        x_N = _PermuteRows.apply(x.contiguous(), row_token, dense, [_rows_out(out, x, num_rows)])
    return Permutation(
        x=x_N,
        probs=probs_N,
        tokens_per_expert=counts_E,
        padded_tokens_per_expert=padded_E,
        row_token=row_token,
        row_slot=row_slot,
        num_tokens=T,
        dense=dense,
        pair_rows=pair_rows,
    )


def _rows_out(out: torch.Tensor | None, x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The ``[N, H]`` buffer ``permute`` writes: ``out`` (checked) or a new one (CPU: pooled)."""
    shape = (num_rows, x.shape[1])
    if out is None:
        return _pool.output_empty(shape, x.dtype, x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be a {list(shape)} {str(x.dtype).replace('torch.', '')} tensor on "
            f"{x.device} (N rows of the permutation, x's hidden size and dtype), got "
            f"{list(out.shape)} {str(out.dtype).replace('torch.', '')} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.requires_grad:
        raise ValueError("out must not require grad (permute writes into it)")
    return out


def unpermute(
    y: torch.Tensor,
    perm: Permutation,
    *,
    probs: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Sum each source token's rows back into place (the adjoint of ``permute``).

    ``out[t] = sum over rows r of token t of probs[r] * y[r]`` (``probs[r] = 1`` when None);
    padding rows contribute nothing, whatever they hold. No host sync.

    Args:
        y: ``[N, H]`` float rows in ``perm``'s row order (e.g. expert outputs of ``perm.x``).
        perm: the ``Permutation`` that ``permute`` returned.
        probs: ``[N]`` float weight per row (typically ``perm.probs``), or None for a plain sum.
        impl: ``"auto"`` (the Triton kernel on CUDA tensors when ``triton`` imports and ``perm``
            came from the Triton ``permute``, else torch), ``"torch"`` or ``"triton"`` (needs a
            ``perm`` from ``permute(impl="triton")``; on CPU tensors under ``TRITON_INTERPRET=1``).

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
    check_same_device("y", y, "perm.row_token", row_token)
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
        check_same_device("probs", probs, "y", y)
        if probs.shape[0] != y.shape[0]:
            raise ValueError(
                f"probs has shape {tuple(probs.shape)} but y has {y.shape[0]} rows: pass one "
                f"weight per row, e.g. perm.probs"
            )
    out_bytes = perm.num_tokens * y.shape[1] * 8  # [T, H] fp32 sums and the output
    if out_bytes >= fits.SMALL_BYTES:
        fits.check_fits(
            "unpermute",
            "perm.num_tokens",
            perm.num_tokens,
            out_bytes,
            y.device,
            detail=f"[T, H={y.shape[1]}] float32 sums and the result",
        )
    if impl != "torch" and resolve_impl(impl, y.device, what="unpermute"):
        if perm.pair_rows is not None:
            from flexdispatch.kernels.permute import unpermute_rows

            return unpermute_rows(y.contiguous(), probs, row_token, perm.pair_rows)
        if impl == "triton":
            raise ValueError(
                "unpermute: impl='triton' sums by perm.pair_rows, which only permute(impl="
                "'triton') records: permute with impl='triton' too, or unpermute with impl='torch'"
            )
    return _UnpermuteRows.apply(y.contiguous(), probs, row_token, perm.num_tokens, perm.dense)
