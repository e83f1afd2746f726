"""Row helpers of the ``torch`` backend: device-side index maps, gathers and metadata packing.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · S rows one rank sends in one hop · P peers one hop sends to · B rows of a
receive buffer · X any row width.

Nothing here reads a value on the host (no ``.item()``, no ``bincount``, no boolean indexing), so
worst-case mode stays free of host syncs and capturable.
"""

from __future__ import annotations

import math

import torch

from flexdispatch import _pool
from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch.kernels import inband as _inband

__all__ = [
    "gather_rows",
    "slot_positions",
    "slot_tables",
    "send_rows",
    "flat_compaction",
    "pack_meta",
    "pack_token_meta",
    "pack_key_meta",
    "expert_key",
    "clamp_ids",
    "rank_lut",
    "local_lut",
    "unpack_local",
    "overflow_message",
]


def gather_rows(
    src: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    zero_invalid: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``src[index]``, where ``index`` may hold the dummy ``n`` on rows that ``valid`` rules out.

    Args:
        src: ``[n, X]``.
        index: ``[S]`` int64 in ``[0, n]`` (``n`` allowed only where ``valid`` is False).
        valid: ``[S]`` bool, or None when every index is real.
        zero_invalid: zero the rows ruled out; False leaves arbitrary rows of ``src`` there (for
            padding that no receiver ever reads back, which saves a pass over the rows).
        out: ``[S, X]`` buffer to write into (same dtype and device as ``src``), or None.

    Returns:
        ``[S, X]`` with ``src``'s dtype (``out`` when given).
    """
    n = src.shape[0]
    if valid is None:
        return (
            src.index_select(0, index)
            if out is None
            else torch.index_select(src, 0, index, out=out)
        )
    if n == 0:
        if out is None:
            return src.new_zeros(index.shape[0], *src.shape[1:])
        return out.zero_()
    index = index.clamp(max=n - 1)
    rows = src.index_select(0, index) if out is None else torch.index_select(src, 0, index, out=out)
    if not zero_invalid:
        return rows
    return rows.masked_fill_(~valid.view(-1, *([1] * (src.dim() - 1))), 0)


def slot_positions(
    mask_NP: torch.Tensor, cap: int | None, *, valid: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send rows of one hop, destination-major then input-row order, without a host sync.

    Args:
        mask_NP: ``[n, P]`` bool, input row ``i`` goes to participant ``p`` (P in peer order).
        cap: rows per participant (worst-case padding; rows past it are dropped), or None for
            dropless (participants packed back to back).
        valid: build ``send_valid`` (worst-case); False returns None there (a caller that
            never reads it saves the compare).

    Returns:
        ``(send_index, send_valid)``. Worst-case: ``send_index`` ``[P * cap]`` int64 with the dummy
        ``n`` on padding rows and ``send_valid`` ``[P * cap]`` bool. Dropless: ``send_index``
        ``[P * n]`` (an upper bound; the caller keeps the first S rows once S is on the host) and
        ``send_valid`` None.
    """
    n, P = mask_NP.shape
    device = mask_NP.device
    if cap is not None:
        send_index = _capped_slots(mask_NP, cap)
        return send_index, (send_index < n) if valid else None
    m_PN = mask_NP.t().to(torch.int64)
    pos_PN = m_PN.cumsum(1) - 1
    counts_P = m_PN.sum(1)
    offs_P = counts_P.cumsum(0) - counts_P
    keep_PN = mask_NP.t()
    size = P * n
    # NOTE: rows that are not sent scatter into unique spare slots past ``size``, so every scatter
    # index is unique (deterministic) and nothing is written out of bounds.
    spare_PN = size + torch.arange(P * n, device=device, dtype=torch.int64).view(P, n)
    slot_PN = torch.where(keep_PN, offs_P[:, None] + pos_PN, spare_PN)
    buf = torch.full((size + P * n,), n, dtype=torch.int64, device=device)
    rows_PN = torch.arange(n, device=device, dtype=torch.int64).expand(P, n)
    buf.scatter_(0, slot_PN.reshape(-1), rows_PN.reshape(-1))
    return buf[:size], None


def _capped_slots(mask_NP: torch.Tensor, cap: int) -> torch.Tensor:
    """``slot_positions``'s send index with ``cap`` rows per participant, in 6 ops (index tables
    cached), or one Triton launch where the flat worst-case kernels run
    (``inband.capped_slots``)."""
    n, P = mask_NP.shape
    device = mask_NP.device
    if _inband.pack_on_device(device):  # NOTE: CUDA with triton: one launch
        return _inband.capped_slots(mask_NP, cap)
    base_1P, spare_NP, rows_NP = _pool.cached(
        ("slot_tables", n, P, cap), device, lambda: slot_tables(n, P, cap, device)
    )
    count_NP = mask_NP.cumsum(0, dtype=torch.int64)
    keep_NP = mask_NP & (count_NP <= cap)
    slot_NP = torch.where(keep_NP, count_NP + base_1P, spare_NP)
    buf = torch.full((P * cap + P * n,), n, dtype=torch.int64, device=device)
    buf.scatter_(0, slot_NP.reshape(-1), rows_NP)  # NOTE: no copy unless a transposed mask
    return buf[: P * cap]


def slot_tables(
    n: int, P: int, cap: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index tables of ``_capped_slots`` for an ``[n, P]`` mask: ``[1, P]`` the slot before
    each participant's first (``p * cap - 1``), ``[n, P]`` unique spare slots past ``P * cap``
    (rows that are not sent scatter there: every scatter index is unique, so the scatter is
    deterministic and writes nothing out of bounds), and ``[n * P]`` the input row of each mask
    entry. The slot of the j-th row (1-based running count c) for participant p is then
    ``p * cap + c - 1``, all in the ``[n, P]`` layout of the mask."""
    size = P * cap
    i64 = torch.int64
    base_1P = (torch.arange(P, device=device, dtype=i64) * cap - 1)[None]
    spare_NP = torch.arange(size, size + P * n, device=device, dtype=i64).view(n, P)
    rows_NP = torch.arange(n, device=device, dtype=i64).repeat_interleave(P)
    return base_1P, spare_NP, rows_NP


def flat_compaction(sizes_R: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_index, in_index)``: the compaction of a flat worst-case receive buffer, ``R`` blocks
    of ``cap`` rows whose first ``sizes_R[r]`` rows are real, into ``W = R * cap`` output rows
    (one ``nonzero_static``, no host sync; the tail reads the spare row, which holds the dropped
    id and needs no mask). ``in_index`` points every row that is not returned at some returned
    row (or 0)."""
    R = sizes_R.numel()
    W = R * cap
    device = sizes_R.device
    col = _pool.cached(("cap_cols", cap), device, lambda: torch.arange(cap, device=device))
    return _compaction((col < sizes_R[:, None]).view(-1), W)


def _compaction(real_W: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_index, in_index)`` of ``[W]`` bool ``real_W`` (see ``flat_compaction``)."""
    out_index = torch.nonzero_static(real_W, size=W, fill_value=W)[:, 0]
    in_index = real_W.cumsum(0, dtype=torch.int64).sub_(1).clamp_(min=0)
    return out_index, in_index


def send_rows(mask_NP: torch.Tensor, num_send: int) -> torch.Tensor:
    """Dropless send rows of one hop: ``[S]`` int64 input row of each send row, destination-major
    then input-row order (``slot_positions(mask_NP, None)[0][:S]``), with ``S = num_send`` known
    on the host. One ``nonzero_static`` (no host sync on CUDA either)."""
    return torch.nonzero_static(mask_NP.t(), size=num_send)[:, 1].contiguous()


def pack_meta(ids_SK: torch.Tensor, probs_SK: torch.Tensor) -> torch.Tensor:
    """``[S, 2k]`` int32: ids (int32) beside the fp32 bits of the probs."""
    return torch.cat([ids_SK.to(torch.int32), probs_SK.to(torch.float32).view(torch.int32)], 1)


def expert_key(ids_TK: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``[T, k]`` int64: the id where it lies in ``[0, num_ids)``, else ``num_ids`` (dropped).

    Two ops: ids are clamped to ``[-1, num_ids]`` and ``-1 mod (num_ids + 1) == num_ids``.
    """
    return ids_TK.clamp(-1, num_ids).remainder_(num_ids + 1)


def pack_key_meta(key_TK: torch.Tensor, probs_TK: torch.Tensor) -> torch.Tensor:
    """``[T, 2k]`` int32 metadata of every input row from ``expert_key`` ids (``pack_meta``
    layout, ``num_ids`` meaning dropped). The rows are gathered into send order with one
    index_select and localized by the receiver (``unpack_local``), which needs only its own
    first id, not one per row."""
    return pack_meta(key_TK, probs_TK)


def pack_token_meta(ids_TK: torch.Tensor, probs_TK: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``pack_key_meta(expert_key(ids_TK, num_ids), probs_TK)``: ids outside ``[0, num_ids)``
    become ``num_ids`` first (never a valid id after the int32 cast)."""
    return pack_key_meta(expert_key(ids_TK, num_ids), probs_TK)


def clamp_ids(ids_TK: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``[T, k]`` int64 ids clamped to ``[-2, num_ids]`` (one op): ``-1`` stays (dropped),
    every id outside ``[-1, num_ids)`` becomes ``-2`` or ``num_ids`` (bad, dropped too). The
    tables below read them with negative indices wrapping (``rank_lut``, ``local_lut``)."""
    return ids_TK.clamp(-2, num_ids)


def rank_lut(width: int, num_ids: int, device: torch.device) -> torch.Tensor:
    """``[num_ids + 3]`` int64 table from ``clamp_ids`` ids (negative ones wrap) to a rank:
    ``id // width`` for ids in ``[0, num_ids)``, ``R = num_ids // width`` for the bad ids
    (``num_ids`` and ``-2``), ``R + 1`` for ``-1``. Counting the ranks then counts the bad ids
    too (bin ``R``), at no cost."""
    R = num_ids // width
    # NOTE: built in place (no [num_ids] temporaries: the table alone is its peak)
    lut = torch.arange(num_ids + 3, dtype=torch.int64, device=device)
    lut.div_(width, rounding_mode="floor")
    lut[num_ids : num_ids + 2] = R
    lut[num_ids + 2] = R + 1
    return lut


def local_lut(lo: int, width: int, num_ids: int, device: torch.device) -> torch.Tensor:
    """``[num_ids + 3]`` int64: ``id - lo + 1`` for ids in ``[lo, lo + width)``, else 0 (also
    for the dropped id ``num_ids`` and, wrapping, for ``clamp_ids``'s ``-1`` and ``-2``). Built
    once per backend (``unpack_local``'s table)."""
    # NOTE: built in place (no [width] temporary: the table alone is its peak)
    lut = torch.arange(1 - lo, num_ids + 4 - lo, dtype=torch.int64, device=device)
    lut[:lo] = 0
    lut[lo + width :] = 0
    return lut


def unpack_local(
    meta: torch.Tensor,
    k: int,
    lo: int,
    width: int,
    num_ids: int,
    *,
    lut: torch.Tensor | None = None,
    counts: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Receiver side of ``pack_key_meta``: keep the slots whose id lies in ``[lo, lo + width)``.

    The ids (all in ``[0, num_ids]`` after ``expert_key``, or ``[-2, num_ids]`` after
    ``clamp_ids``) are mapped through the
    ``local_lut`` table (pass it to build it once): one gather instead of compares and masks.

    Returns:
        ``(ids [B, k] int64 as id - lo or -1, probs [B, k] float32, 0 where the id is -1)``,
        and with ``counts`` also ``[width]`` int64 pairs per local id.
    """
    if lut is None:
        lut = local_lut(lo, width, num_ids, meta.device)
    shifted = lut[meta[:, :k]]  # id - lo + 1, 0 = not mine
    ids = shifted - 1
    zero = _pool.scalar(0.0, torch.float32, meta.device)
    probs = torch.where(shifted > 0, meta[:, k:].view(torch.float32), zero)
    if not counts:
        return ids, probs
    return ids, probs, _bin_counts(shifted.view(-1), width + 1)[1:]


def _bin_counts(values: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` int64 occurrences of each value of ``values`` (all in ``[0, n)``)."""
    if not cuda_code_path(values.device):
        return torch.bincount(values, minlength=n)  # 3x faster than scatter_add_ on CPU
    # NOTE: not torch.bincount, which reads the maximum on the host on CUDA.
    out = torch.zeros(n, dtype=torch.int64, device=values.device)
    return out.scatter_add_(0, values, _pool.ones(values.numel(), torch.int64, values.device))


def overflow_message(what: str, needed: int, cap: int, W: int, divisor: int, R: int) -> str:
    """Error text for a worst-case overflow, naming the numbers and the fix."""
    need_w = math.ceil(needed * divisor / R) * R
    return (
        f"worst-case dispatch overflow: {what} needs {needed} rows but num_worst_tokens W={W} "
        f"allows W/{divisor} = {cap} per peer: raise DispatchConfig.num_worst_tokens to at least "
        f"{need_w} ({divisor} x {needed}, rounded up to a multiple of R={R})"
    )
