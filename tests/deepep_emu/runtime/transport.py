"""Byte packing, the gloo exchanges the emulated kernels use, and the runtime's own accounting.

TEST-ONLY. A "row" of a transfer is the concatenation of the raw bytes of several per-row fields
(rows of ``x``, scales, top-k ids and weights, source indices), so one ``all_to_all_single`` of
``uint8`` moves everything whatever the dtypes (gloo has no fp8).

Accounting: ``kernel(name)`` marks the code of one emulated DeepEP kernel. While one runs,
``in_runtime()`` is true, so a test that spies on ``torch.distributed`` can tell DeepEP's own
communication from anything the adapter issues; ``counters()`` counts the kernels run and the
collectives they issued (``reset()`` clears them).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "pack",
    "unpack",
    "exchange",
    "exchange_known",
    "garbage",
    "barrier",
    "kernel",
    "in_runtime",
    "counters",
    "reset",
]

_DEPTH = 0
_COUNTERS: Counter[str] = Counter()


@contextlib.contextmanager
def kernel(name: str) -> Iterator[None]:
    """Run the body as the emulated DeepEP kernel ``name`` (counted; ``in_runtime()`` true)."""
    global _DEPTH
    _COUNTERS[name] += 1
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1


def in_runtime() -> bool:
    """Whether an emulated DeepEP kernel is running (its collectives are DeepEP's own)."""
    return _DEPTH > 0


def inside_deepep(depth: int = 2) -> bool:
    """Whether DeepEP's own code (its Python layer or this emulated runtime) is on the stack above
    the caller's caller (``depth`` frames up: a ``TorchDispatchMode`` asks for its op's caller)."""
    f: Any = sys._getframe(depth)
    while f is not None:
        name = f.f_code.co_filename
        if "deepep_emu" in name or f"{os.sep}deep_ep{os.sep}" in name:
            return True
        f = f.f_back
    return False


def counters() -> dict[str, int]:
    """Kernels run and ``collectives`` issued by the emulated runtime since ``reset()``."""
    return dict(_COUNTERS)


def reset() -> None:
    _COUNTERS.clear()


def _collective() -> None:
    _COUNTERS["collectives"] += 1


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
        width = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        # NOTE: a fresh copy: viewing bytes as a wider dtype needs an aligned storage offset.
        chunk = data[:, col : col + width].clone(memory_format=torch.contiguous_format)
        out.append(chunk.view(dtype).reshape(n, *shape))
        col += width
    return out


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[R, c]`` int64 rows, row ``r`` to rank ``r``; returns row ``s`` from rank ``s``."""
    assert in_runtime()
    got = torch.empty_like(send)
    _collective()
    dist.all_to_all_single(got, send.contiguous(), group=group)
    return got


def exchange_known(
    send: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Send ``send_counts[r]`` consecutive ``[S, B]`` uint8 rows to rank ``r``, receiving
    ``recv_counts[s]`` from each ``s`` (counts both sides know): one collective."""
    assert in_runtime()
    width = send.shape[1]
    recv = torch.empty(sum(recv_counts) * width, dtype=torch.uint8)
    _collective()
    dist.all_to_all_single(
        recv,
        send.contiguous().reshape(-1),
        [c * width for c in recv_counts],
        [c * width for c in send_counts],
        group=group,
    )
    return recv.reshape(-1, width)


def exchange(
    send: torch.Tensor, send_counts: Sequence[int], group: dist.ProcessGroup
) -> tuple[torch.Tensor, list[int]]:
    """``exchange_known`` after exchanging the counts (two collectives)."""
    R = dist.get_world_size(group)
    got = exchange_counts(torch.tensor(list(send_counts), dtype=torch.int64).view(R, 1), group)
    recv_counts = [int(c) for c in got.view(-1).tolist()]
    return exchange_known(send, send_counts, recv_counts, group), recv_counts


def barrier(group: dist.ProcessGroup) -> None:
    """A barrier of the emulated runtime (one collective)."""
    assert in_runtime()
    _collective()
    dist.barrier(group=group)


def garbage(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Stand-in for ``torch::empty``: NaN and huge values for floats, huge ints otherwise."""
    if dtype == torch.float8_e4m3fn:
        return torch.full(tuple(shape), 0x7F, dtype=torch.uint8, device=device).view(dtype)
    if dtype.is_floating_point:
        out = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
        out.view(-1)[1::2] = torch.finfo(dtype).max
        return out
    if dtype == torch.bool:
        return torch.ones(tuple(shape), dtype=dtype, device=device)
    return torch.full(
        tuple(shape), 2**30 + 7 if dtype != torch.uint8 else 0xAB, dtype=dtype, device=device
    )
