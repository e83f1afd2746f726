"""Triton sources of the permutation kernels; launched by ``permute.py``.

Shape letters: T tokens · H hidden · E experts · k top-k · N rows · P = T*k pairs. Imported only
when ``triton`` imports. One program per output row (``permute_rows``, ``gather_rows``) or per
token (``sum_rows``), looping over H in ``BLOCK_H`` chunks. No atomics: every output element is
written by one program, and sums run in a fixed order, so the results are deterministic. H is a
constexpr (one compiled kernel per hidden size, which a model fixes): the loop over it then has
known bounds, and Triton 3.6's interpreter cannot loop over a runtime scalar under NumPy 2.

Rounding to bfloat16 (OUT_BF16) is done by hand, round-to-nearest-even on the fp32 bits: the
compiled ``.to(tl.bfloat16)`` rounds so, but Triton's interpreter truncates, and the tests
compare interpreted results with torch's.
"""

# NOTE: no ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr``
# annotations of the kernels' parameters as objects.
import triton.language as tl


def permute_rows(
    x_ptr,
    out_ptr,
    row_token_ptr,
    row_slot_ptr,
    pair_rows_ptr,
    probs_ptr,
    probs_out_ptr,
    order_ptr,
    bounds_ptr,
    counts_ptr,
    pad_end_ptr,
    K,
    E,
    ALIGN1: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    STEPS: tl.constexpr,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Row ``r`` of the permutation: find its (token, slot) pair, write the maps, copy the row.

    ``order`` ``[P]``: the pairs sorted by expert (stable); ``bounds`` ``[E + 1]``: where each
    expert's pairs start in ``order`` (``bounds[E]`` = valid pairs); ``counts`` ``[E]``.
    ALIGN1: row ``r`` is sorted pair ``r``. Otherwise ``pad_end`` ``[E]`` holds the cumulative
    padded segment ends and the row's expert is found by a binary search of STEPS steps. Rows
    that hold no pair (padding, the static tail) get token/slot ``-1``, prob 0 and a zero row.
    Writes ``pair_rows[pair] = r`` for real rows (the caller fills it with ``-1`` first).
    """
    r = tl.program_id(0).to(tl.int64)
    if ALIGN1:
        valid = r < tl.load(bounds_ptr + E)
        i = r
    else:
        # the first expert whose padded segment ends past r (E: the static tail)
        lo = r * 0
        hi = lo + E
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            end = tl.load(pad_end_ptr + mid, mask=mid < E, other=0)
            past = (mid >= E) | (end > r)
            hi = tl.where(past, mid, hi)
            lo = tl.where(past, lo, mid + 1)
        e = lo
        in_seg = e < E
        start = tl.load(pad_end_ptr + e - 1, mask=in_seg & (e > 0), other=0)
        rank = r - start
        valid = in_seg & (rank < tl.load(counts_ptr + e, mask=in_seg, other=0))
        i = tl.load(bounds_ptr + e, mask=in_seg, other=0) + rank
    pair = tl.load(order_ptr + i, mask=valid, other=0)
    tok = tl.where(valid, pair // K, -1)
    tl.store(row_token_ptr + r, tok)
    tl.store(row_slot_ptr + r, tl.where(valid, pair % K, -1))
    tl.store(pair_rows_ptr + pair, r, mask=valid)
    if HAS_PROBS:
        p = tl.load(probs_ptr + pair, mask=valid, other=0.0)
        tl.store(probs_out_ptr + r, p.to(probs_out_ptr.dtype.element_ty))
    src = x_ptr + tl.where(valid, tok, 0) * H
    dst = out_ptr + r * H
    offs = tl.arange(0, BLOCK_H)
    # NOTE: a row that holds no pair reads nothing: its load limit is 0 (a scalar folded into
    # the bound rather than and-ed with the vector mask, which Triton's interpreter mistypes).
    lim = tl.where(valid, H, 0)
    for h0 in range(0, H, BLOCK_H):
        v = tl.load(src + h0 + offs, mask=(h0 + offs) < lim, other=0.0)
        tl.store(dst + h0 + offs, v, mask=(h0 + offs) < H)


def gather_rows(
    src_ptr,
    row_token_ptr,
    out_ptr,
    w_ptr,
    y_ptr,
    dot_ptr,
    WEIGHTED: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[r] = w[r] * src[row_token[r]]`` (``w = 1`` unless WEIGHTED), 0 where the token is
    ``-1``; with DOT also ``dot[r] = <src[row_token[r]], y[r]>`` (0 where ``-1``), in ACC.

    The backward of ``unpermute``: ``src`` is the gradient of its ``[T, H]`` output.
    """
    r = tl.program_id(0).to(tl.int64)
    tok = tl.load(row_token_ptr + r)
    valid = tok >= 0
    src = src_ptr + tl.where(valid, tok, 0) * H
    dst = out_ptr + r * H
    offs = tl.arange(0, BLOCK_H)
    if WEIGHTED:
        w = tl.load(w_ptr + r).to(ACC)
    if DOT:
        acc = tl.zeros([BLOCK_H], dtype=ACC)
    lim = tl.where(valid, H, 0)
    for h0 in range(0, H, BLOCK_H):
        hm = (h0 + offs) < H
        g = tl.load(src + h0 + offs, mask=(h0 + offs) < lim, other=0.0)
        if WEIGHTED:
            gw = g.to(ACC) * w
            if OUT_BF16:
                u = gw.to(tl.int32, bitcast=True)
                u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
                u = tl.where(gw != gw, 0x7FC0, u)
                tl.store(dst + h0 + offs, u.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=hm)
            else:
                tl.store(dst + h0 + offs, gw.to(out_ptr.dtype.element_ty), mask=hm)
        else:
            tl.store(dst + h0 + offs, g, mask=hm)
        if DOT:
            yv = tl.load(y_ptr + r * H + h0 + offs, mask=hm, other=0.0)
            acc += g.to(ACC) * yv.to(ACC)
    if DOT:
        dot = tl.where(valid, tl.sum(acc, axis=0), 0.0)
        tl.store(dot_ptr + r, dot.to(dot_ptr.dtype.element_ty))


def sum_rows(
    src_ptr,
    pair_rows_ptr,
    w_ptr,
    out_ptr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ACC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum of w[r] * src[r]`` over the rows ``r`` of token ``t`` (``pair_rows[t]``,
    ``-1`` = none), added in ascending row order in ACC, stored in ``out``'s dtype; 0 if none.

    The forward of ``unpermute`` (WEIGHTED with the probs) and the backward of ``permute``.
    """
    t = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, K_PAD)
    big = 9223372036854775807
    rows = tl.load(pair_rows_ptr + t * K + kk, mask=kk < K, other=-1)
    rows = tl.where(rows < 0, big, rows)
    offs = tl.arange(0, BLOCK_H)
    dst = out_ptr + t * H
    for h0 in range(0, H, BLOCK_H):
        hm = (h0 + offs) < H
        acc = tl.zeros([BLOCK_H], dtype=ACC)
        left = rows
        for _ in tl.static_range(K):
            r = tl.min(left, axis=0)
            ok = r < big
            lim = tl.where(ok, H, 0)
            row = src_ptr + tl.where(ok, r, 0) * H
            v = tl.load(row + h0 + offs, mask=(h0 + offs) < lim, other=0.0)
            if WEIGHTED:
                v = v.to(ACC) * tl.load(w_ptr + tl.where(ok, r, 0), mask=ok, other=0.0).to(ACC)
            acc += v.to(ACC)
            left = tl.where(left == r, big, left)
        if OUT_BF16:
            a32 = acc.to(tl.float32)
            u = a32.to(tl.int32, bitcast=True)
            u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            u = tl.where(a32 != a32, 0x7FC0, u)
            tl.store(dst + h0 + offs, u.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=hm)
        else:
            tl.store(dst + h0 + offs, acc.to(out_ptr.dtype.element_ty), mask=hm)
