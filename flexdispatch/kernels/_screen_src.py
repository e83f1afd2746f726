"""Triton source of the screen kernel (``screen.py``): the deferred value checks of a dispatch
in one pass.

Shape letters: T tokens · k top-k · V values per row (``x``'s hidden size, or the fp8 scales').
``BLOCK_T`` tokens per program; the rows of ``vals`` are read in ``BLOCK_V`` chunks (V is a
constexpr: one compiled kernel per width, which a model fixes, and a loop with known bounds for
Triton's interpreter). The counts meet in six int64 slots with integer atomics, which give the
same sums in any order: deterministic.
"""

# NOTE: no ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr``
# annotations of the kernels' parameters as objects.
import triton.language as tl


def screen_inputs(
    idx_ptr,
    probs_ptr,
    vals_ptr,
    out_ptr,
    acc_ptr,
    T,
    E,
    idx_stride,
    probs_stride,
    vals_stride,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """``out = ids`` with every id no backend may see as -1 (the repeats of an id within one
    token after its first slot, ids outside ``[-1, E)``), and into ``acc`` (``[6]`` int64):
    += ids outside ``[-1, E)``, += NaN/inf values of ``vals``, += NaN/inf probs, += repeats of ids
    in ``[0, E)``, max= the largest id, min= the smallest id."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    kk = tl.arange(0, K_PAD)
    real = live[:, None] & (kk < K)[None, :]
    ids = tl.load(idx_ptr + rows[:, None] * idx_stride + kk[None, :], mask=real, other=-1)
    # slot j repeats when a lower real slot i < j of its token holds the same id
    lower = (kk[:, None] < kk[None, :]) & (kk < K)[:, None]
    same = (ids[:, :, None] == ids[:, None, :]) & lower[None, :, :]
    rep = (tl.max(same.to(tl.int32), axis=1) > 0) & real
    oob = real & ((ids < -1) | (ids >= E))
    tl.store(out_ptr + rows[:, None] * K + kk[None, :], tl.where(rep | oob, -1, ids), mask=real)
    n_oob = tl.sum(tl.sum(oob.to(tl.int64), axis=1), axis=0)
    n_rep = tl.sum(tl.sum((rep & (ids >= 0) & (ids < E)).to(tl.int64), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(real, ids, -9223372036854775807 - 1), axis=1), axis=0)
    lo = tl.min(tl.min(tl.where(real, ids, 9223372036854775807), axis=1), axis=0)
    p = tl.load(probs_ptr + rows[:, None] * probs_stride + kk[None, :], mask=real, other=0.0)
    dp = p - p  # NaN exactly where p is NaN or inf
    n_p = tl.sum(tl.sum((dp != dp).to(tl.int64), axis=1), axis=0)
    cols = tl.arange(0, BLOCK_V)
    bad_v = tl.zeros([BLOCK_T], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        vm = live[:, None] & ((v0 + cols) < V)[None, :]
        v = tl.load(
            vals_ptr + rows[:, None] * vals_stride + (v0 + cols)[None, :], mask=vm, other=0.0
        )
        dv = v.to(tl.float32) - v.to(tl.float32)
        bad_v += tl.sum((dv != dv).to(tl.int64), axis=1)
    n_v = tl.sum(bad_v, axis=0)
    tl.atomic_add(acc_ptr, n_oob, mask=n_oob > 0)
    tl.atomic_add(acc_ptr + 1, n_v, mask=n_v > 0)
    tl.atomic_add(acc_ptr + 2, n_p, mask=n_p > 0)
    tl.atomic_add(acc_ptr + 3, n_rep, mask=n_rep > 0)
    tl.atomic_max(acc_ptr + 4, hi)
    tl.atomic_min(acc_ptr + 5, lo)
