"""Triton source of the in-band pack kernel (``inband.py``).

Shape letters: T tokens · k top-k · S send rows · XW int32 words of a row of ``x``. One program
per send row; the row is copied in ``BLOCK_W``-word chunks (XW is a constexpr: one compiled
kernel per row width, which a model fixes). Every output word is written by one program: no
atomics, deterministic.
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
    """Send row ``s`` of the in-band layout (``flat._dispatch_inband``): the int32 words of row
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
