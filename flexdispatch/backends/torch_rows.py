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

__all__ = [
    "gather_rows",
    "slot_positions",
    "compaction",
    "pack_meta",
    "unpack_meta",
    "pack_token_meta",
    "unpack_local",
    "localize",
    "count_local",
    "split_owner",
    "round_up",
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
    mask_NP: torch.Tensor, cap: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send rows of one hop, destination-major then input-row order, without a host sync.

    Args:
        mask_NP: ``[n, P]`` bool, input row ``i`` goes to participant ``p`` (P in peer order).
        cap: rows per participant (worst-case padding; rows past it are dropped), or None for
            dropless (participants packed back to back).

    Returns:
        ``(send_index, send_valid)``. Worst-case: ``send_index`` ``[P * cap]`` int64 with the dummy
        ``n`` on padding rows and ``send_valid`` ``[P * cap]`` bool. Dropless: ``send_index``
        ``[P * n]`` (an upper bound; the caller keeps the first S rows once S is on the host) and
        ``send_valid`` None.
    """
    n, P = mask_NP.shape
    device = mask_NP.device
    m_PN = mask_NP.t().to(torch.int64)
    pos_PN = m_PN.cumsum(1) - 1
    if cap is None:
        counts_P = m_PN.sum(1)
        offs_P = counts_P.cumsum(0) - counts_P
        keep_PN = mask_NP.t()
        size = P * n
    else:
        offs_P = torch.arange(P, device=device, dtype=torch.int64) * cap
        keep_PN = mask_NP.t() & (pos_PN < cap)
        size = P * cap
    # NOTE: rows that are not sent scatter into unique spare slots past ``size``, so every scatter
    # index is unique (deterministic) and nothing is written out of bounds.
    spare_PN = size + torch.arange(P * n, device=device, dtype=torch.int64).view(P, n)
    slot_PN = torch.where(keep_PN, offs_P[:, None] + pos_PN, spare_PN)
    buf = torch.full((size + P * n,), n, dtype=torch.int64, device=device)
    rows_PN = torch.arange(n, device=device, dtype=torch.int64).expand(P, n)
    buf.scatter_(0, slot_PN.reshape(-1), rows_PN.reshape(-1))
    send_index = buf[:size]
    if cap is None:
        return send_index, None
    return send_index, send_index < n


def compaction(
    sizes_B: torch.Tensor, starts_B: torch.Tensor, num_out: int, num_buf: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side gather maps that concatenate blocks of a receive buffer in a chosen order.

    Args:
        sizes_B: ``[B]`` int64 rows of each block, in output order.
        starts_B: ``[B]`` int64 first buffer row of each block.
        num_out: rows of the output (M, or W with a zero tail).
        num_buf: rows of the receive buffer.

    Returns:
        ``(out_index [num_out], out_valid [num_out], in_index [num_buf], in_valid [num_buf])``:
        buffer row of each output row (dummy ``num_buf`` on the tail) and its inverse (dummy
        ``num_out`` on buffer rows that are not returned).
    """
    device = sizes_B.device
    ends_B = sizes_B.cumsum(0)
    first_B = ends_B - sizes_B
    m = torch.arange(num_out, device=device, dtype=torch.int64)
    b = torch.searchsorted(ends_B, m, right=True).clamp_(max=sizes_B.numel() - 1)
    out_valid = m < ends_B[-1]
    out_index = torch.where(out_valid, starts_B[b] + m - first_B[b], num_buf)
    spare = num_buf + m
    tmp = torch.full((num_buf + num_out,), num_out, dtype=torch.int64, device=device)
    tmp.scatter_(0, torch.where(out_valid, out_index, spare), m)
    in_index = tmp[:num_buf]
    return out_index, out_valid, in_index, in_index < num_out


def pack_meta(ids_SK: torch.Tensor, probs_SK: torch.Tensor) -> torch.Tensor:
    """``[S, 2k]`` int32: ids (int32) beside the fp32 bits of the probs."""
    return torch.cat([ids_SK.to(torch.int32), probs_SK.to(torch.float32).view(torch.int32)], 1)


def unpack_meta(meta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_meta``: ``(ids [S, k] int64, probs [S, k] float32)``."""
    return meta[:, :k].to(torch.int64), meta[:, k:].view(torch.float32).contiguous()


def pack_token_meta(ids_TK: torch.Tensor, probs_TK: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``[T, 2k]`` int32 metadata of every input row, global ids (``pack_meta`` layout).

    Ids outside ``[0, num_ids)`` become -1 first (never a valid id after the int32 cast). The
    rows are gathered into send order with one index_select and localized by the receiver
    (``unpack_local``), which needs only its own first id, not one per row.
    """
    ok = (ids_TK >= 0) & (ids_TK < num_ids)
    return pack_meta(torch.where(ok, ids_TK, -1), probs_TK)


def unpack_local(
    meta: torch.Tensor, k: int, lo: int, width: int, num_ids: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receiver side of ``pack_token_meta``: keep the slots whose id lies in ``[lo, lo + width)``.

    The ids (all in ``[-1, num_ids)`` after ``pack_token_meta``) are mapped through a
    ``[num_ids + 1]`` lookup table: one gather instead of compares, masks and a cast.

    Returns:
        ``(ids [B, k] int64 as id - lo or -1, probs [B, k] float32, 0 where the id is -1)``.
    """
    B = meta.shape[0]
    lut = torch.full((num_ids + 1,), -1, dtype=torch.int64, device=meta.device)
    lut[1 + lo : 1 + lo + width] = torch.arange(width, dtype=torch.int64, device=meta.device)
    ids = lut.index_select(0, (meta[:, :k] + 1).reshape(-1)).view(B, k)
    return ids, torch.where(ids >= 0, meta[:, k:].view(torch.float32), 0.0)


def localize(
    ids_SK: torch.Tensor,
    probs_SK: torch.Tensor,
    lo_S: torch.Tensor,
    width: int,
    valid_S: torch.Tensor | None,
    *,
    keep_global: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the slots whose id lies in ``[lo, lo + width)`` of each row; the rest become -1 / 0.

    Args:
        ids_SK: ``[S, k]`` int64 global ids (-1 = none).
        probs_SK: ``[S, k]`` float32.
        lo_S: ``[S]`` int64 first id owned by each row's destination.
        width: ids owned by a destination (e for a rank, e * L for a node).
        valid_S: ``[S]`` bool (False on padding rows) or None.
        keep_global: keep global ids instead of ``id - lo``.

    Returns:
        ``(ids [S, k] int64, probs [S, k] float32)``.
    """
    rel = ids_SK - lo_S[:, None]
    keep = (ids_SK >= 0) & (rel >= 0) & (rel < width)
    if valid_S is not None:
        keep &= valid_S[:, None]
    out_ids = torch.where(keep, ids_SK if keep_global else rel, -1)
    return out_ids, torch.where(keep, probs_SK, 0.0)


def count_local(ids_MK: torch.Tensor, num_local: int) -> torch.Tensor:
    """``[e]`` int64 number of ``(row, slot)`` pairs per local expert id (-1 ignored)."""
    if ids_MK.device.type == "cpu":
        # ids are in [-1, num_local): shifted by one they index the bins directly (3x faster)
        return torch.bincount(ids_MK.reshape(-1) + 1, minlength=num_local + 1)[1 : num_local + 1]
    safe = torch.where(ids_MK >= 0, ids_MK, num_local).reshape(-1)
    # NOTE: not torch.bincount, which reads the maximum on the host on CUDA.
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=ids_MK.device)
    counts.scatter_add_(0, safe, torch.ones_like(safe))
    return counts[:num_local]


def round_up(value: torch.Tensor, multiple: int) -> torch.Tensor:
    """Device-side ``ceil(value / multiple) * multiple`` (int64)."""
    return torch.div(value + multiple - 1, multiple, rounding_mode="floor") * multiple


def split_owner(counts_P: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64 participant index of each row of a buffer packed by ``counts_P``.

    Args:
        counts_P: ``[P]`` int64 device tensor, rows per participant (summing to ``total``).
        total: S, host-known.
    """
    P = counts_P.numel()
    arange = torch.arange(P, device=counts_P.device)
    return torch.repeat_interleave(arange, counts_P, output_size=total)


def overflow_message(what: str, needed: int, cap: int, W: int, divisor: int, R: int) -> str:
    """Error text for a worst-case overflow, naming the numbers and the fix."""
    need_w = math.ceil(needed * divisor / R) * R
    return (
        f"worst-case dispatch overflow: {what} needs {needed} rows but num_worst_tokens W={W} "
        f"allows W/{divisor} = {cap} per peer: raise DispatchConfig.num_worst_tokens to at least "
        f"{need_w} ({divisor} x {needed}, rounded up to a multiple of R={R})"
    )
