"""Triton sources of the in-band kernels (``inband.py``).

Shape letters: T tokens · k top-k · S send rows · W receive rows · R ranks · XW int32 words of a
row of ``x``. One program per send row (pack) or per receive / output row (unpack); rows are
copied in ``BLOCK_W``-word chunks (XW is a constexpr: one compiled kernel per row width, which a
model fixes). Every output word is written by one program; the only atomics are the integer
counts per expert, whose sums do not depend on the order: deterministic.
"""

# NOTE: no ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr``
# annotations of the kernels' parameters as objects.
import triton.language as tl


def pack_inband(
    x_ptr,
    key_ptr,
    probs_ptr,
    index_ptr,
    need_ptr,
    out_ptr,
    T,
    E,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    XW: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Send row ``s`` of the in-band layout (``backends/torch/plan.py``): the int32 words of row
    ``t = index[s]`` of ``x``, then its ids as int32, its probs' fp32 bits and the worst count
    ``need``; a padding row (``t == T``) carries zeros, the dropped id ``E`` in every slot and
    ``need``."""
    s = tl.program_id(0).to(tl.int64)
    t = tl.load(index_ptr + s)
    real = t < T
    src = tl.where(real, t, 0)
    RW: tl.constexpr = XW + 2 * K + 1
    dst = out_ptr + s * RW
    offs = tl.arange(0, BLOCK_W)
    lim = tl.where(real, XW, 0)
    for w0 in range(0, XW, BLOCK_W):
        v = tl.load(x_ptr + src * XW + w0 + offs, mask=(w0 + offs) < lim, other=0)
        tl.store(dst + w0 + offs, v, mask=(w0 + offs) < XW)
    kk = tl.arange(0, K_PAD)
    km = kk < K
    kr = kk < tl.where(real, K, 0)  # NOTE: the slots to read (none on a padding row)
    ids = tl.load(key_ptr + src * K + kk, mask=kr, other=E)
    tl.store(dst + XW + kk, ids.to(tl.int32), mask=km)
    p = tl.load(probs_ptr + src * K + kk, mask=kr, other=0)
    tl.store(dst + XW + K + kk, p, mask=km)
    tl.store(dst + XW + 2 * K, tl.load(need_ptr).to(tl.int32))


def unpack_blocks(
    rows_ptr,
    meta_ptr,
    meta_f_ptr,
    map_ptr,
    n_ptr,
    x_out_ptr,
    ids_out_ptr,
    probs_out_ptr,
    counts_ptr,
    out_index_ptr,
    in_index_ptr,
    ROW_STRIDE,
    META_STRIDE,
    PROBS_STRIDE,
    PROBS_OFF,
    N_STRIDE,
    LO,
    NUM_LOCAL,
    W,
    CAP,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    XW: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """Row ``j`` of the compacted output of a flat worst-case receive buffer, and entry ``j`` of
    its inverse map. The buffer: ``R`` blocks of ``CAP`` rows, the first ``n[s]`` rows of block
    ``s`` real (``min(n[s * N_STRIDE], CAP)``); row ``i``'s ``XW`` int32 words at ``rows + i *
    ROW_STRIDE``, its ``K`` ids (int32 or int64) at ``meta + i * META_STRIDE`` and its ``K`` fp32
    probs at ``meta_f + i * PROBS_STRIDE + PROBS_OFF`` (packed metadata: ``meta_f`` is the same
    memory as float32, ``PROBS_OFF = K``). Rows and metadata may share one buffer (the in-band
    layout) or not. With ``HAS_MAP``, receive row ``i`` is row ``map[i]`` of ``rows``, ``meta``
    and ``meta_f`` (a world of one reads its send rows, ids and probs where they are).

    As an output row: the ``j``-th real row in (block, row) order, or the zero tail past them:
    its bytes, its ids made local (``id - LO`` for ids in ``[LO, LO + NUM_LOCAL)``, else -1), its
    probs (0 where -1), one count per local id (integer atomics: any order, the same sums), and
    ``out_index[j]`` (its receive row, ``W`` on the tail). As receive row ``j``:
    ``in_index[j]``, its output row, or for a padding row the last real row before it (0 if
    none), as a running count would give.
    """
    j = tl.program_id(0).to(tl.int64)
    rr = tl.arange(0, R_PAD)
    n = tl.minimum(tl.load(n_ptr + rr * N_STRIDE, mask=rr < R, other=0).to(tl.int64), CAP)
    incl = tl.cumsum(n, axis=0)
    excl = incl - n
    total = tl.sum(n, axis=0)
    real = j < total
    s = tl.sum((incl <= j).to(tl.int64), axis=0)  # blocks wholly before row j
    start = tl.sum(tl.where(rr == s, excl, 0), axis=0)
    src = tl.where(real, s * CAP + j - start, W)
    tl.store(out_index_ptr + j, src)
    at = tl.where(real, src, 0)
    if HAS_MAP:
        at = tl.load(map_ptr + at, mask=real, other=0).to(tl.int64)
    row = rows_ptr + at * ROW_STRIDE
    offs = tl.arange(0, BLOCK_W)
    lim = tl.where(real, XW, 0)
    for w0 in range(0, XW, BLOCK_W):
        v = tl.load(row + w0 + offs, mask=(w0 + offs) < lim, other=0)
        tl.store(x_out_ptr + j * XW + w0 + offs, v, mask=(w0 + offs) < XW)
    kk = tl.arange(0, K_PAD)
    km = kk < K
    kr = kk < tl.where(real, K, 0)
    ids = tl.load(meta_ptr + at * META_STRIDE + kk, mask=kr, other=-1).to(tl.int64)
    mine = kr & (ids >= LO) & (ids < LO + NUM_LOCAL)
    tl.store(ids_out_ptr + j * K + kk, tl.where(mine, ids - LO, -1), mask=km)
    p = tl.load(meta_f_ptr + at * PROBS_STRIDE + PROBS_OFF + kk, mask=kr, other=0.0)
    tl.store(probs_out_ptr + j * K + kk, tl.where(mine, p, 0.0), mask=km)
    tl.atomic_add(
        counts_ptr + tl.where(mine, ids - LO, 0), tl.full([K_PAD], 1, tl.int64), mask=mine
    )
    # receive row j: block sj, row ij
    sj = j // CAP
    ij = j - sj * CAP
    nj = tl.sum(tl.where(rr == sj, n, 0), axis=0)
    ej = tl.sum(tl.where(rr == sj, excl, 0), axis=0)
    last = tl.maximum(ej + nj - 1, 0)
    tl.store(in_index_ptr + j, tl.where(ij < nj, ej + ij, last))


def capped_slots(
    mask_ptr,
    out_ptr,
    N,
    STRIDE_T,
    STRIDE_P,
    CAP,
    BLOCK: tl.constexpr,
):
    """Send slots of participant ``p`` (this program) in a flat worst-case hop: slot
    ``p * CAP + c - 1`` holds the row ``t`` that is the ``c``-th (``c <= CAP``) of the rows
    ``t < N`` with ``mask[t * STRIDE_T + p * STRIDE_P]`` set; the slots past them hold ``N``
    (padding). One pass over the mask column with a running count; every slot written once."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    count = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    # NOTE: ``while`` loops, not ``range(0, N, BLOCK)``: Triton 3.6's interpreter (the GPU
    # machine's) cannot take a runtime bound as a range index under numpy 2
    t0 = 0
    while t0 < N:
        t = (t0 + offs).to(tl.int64)
        m = tl.load(mask_ptr + t * STRIDE_T + p * STRIDE_P, mask=t < N, other=0) != 0
        c = tl.cumsum(m.to(tl.int64), axis=0) + count  # the 1-based count of each row
        tl.store(out_ptr + p * CAP + c - 1, t, mask=m & (c <= CAP))
        count += tl.sum(m.to(tl.int64), axis=0)
        t0 += BLOCK
    filled = tl.minimum(count, CAP)
    s0 = 0
    while s0 < CAP:
        s = (s0 + offs).to(tl.int64)
        tl.store(
            out_ptr + p * CAP + s, tl.full([BLOCK], 0, tl.int64) + N, mask=(s >= filled) & (s < CAP)
        )
        s0 += BLOCK
