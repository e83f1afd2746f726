"""Byte packing and the one exchange every emulated kernel uses. TEST-ONLY.

A "row" of a transfer is the concatenation of the raw bytes of several per-row fields (rows of
``x``, scales, top-k ids and weights, source indices), so one ``all_to_all_single`` of ``uint8``
moves everything, whatever the dtypes (gloo has no fp8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["pack", "unpack", "exchange", "garbage"]


def pack(fields: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n, B]`` uint8: the bytes of each field's rows side by side (fields are ``[n, ...]``)."""
    n = fields[0].shape[0]
    parts = [
        f.contiguous().reshape(n, f[0].numel() if n else math.prod(f.shape[1:])).view(torch.uint8)
        for f in fields
    ]
    return torch.cat(parts, dim=1) if parts else torch.zeros(n, 0, dtype=torch.uint8)


def unpack(
    data: torch.Tensor, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor]:
    """Inverse of ``pack``: ``specs`` gives each field's dtype and per-row shape."""
    n = data.shape[0]
    out, col = [], 0
    for dtype, shape in specs:
        width = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        # NOTE: a fresh copy: viewing bytes as a wider dtype needs an aligned storage offset.
        chunk = data[:, col : col + width].clone(memory_format=torch.contiguous_format)
        out.append(chunk.view(dtype).reshape(n, *shape))
        col += width
    return out


def exchange(
    send: torch.Tensor, send_counts: Sequence[int], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, list[int]]:
    """Send ``send_counts[r]`` consecutive rows of ``send`` (``[S, B]`` uint8) to rank ``r``.

    Returns:
        ``(recv [M, B], recv_counts)``: rows from every rank, in source-rank order.
    """
    R = dist.get_world_size(group)
    width = send.shape[1]
    counts = torch.tensor(list(send_counts), dtype=torch.int64)
    got = torch.empty(R, dtype=torch.int64)
    dist.all_to_all_single(got, counts, group=group)
    recv_counts = [int(c) for c in got.tolist()]
    recv = torch.empty(sum(recv_counts) * width, dtype=torch.uint8)
    dist.all_to_all_single(
        recv,
        send.contiguous().reshape(-1),
        [c * width for c in recv_counts],
        [c * width for c in send_counts],
        group=group,
    )
    return recv.reshape(-1, width), recv_counts


def garbage(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Stand-in for ``torch::empty``: NaN and huge values for floats, huge ints otherwise."""
    if dtype.is_floating_point:
        out = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
        big = torch.finfo(dtype).max
        out.view(-1)[1::2] = big
        return out
    return torch.full(tuple(shape), 2**30 + 7, dtype=dtype, device=device)
