"""DeepEP 2.5's token layouts as the adapter must respect them before any kernel runs.

R ranks · E experts · k top-k · X columns of the rows (fp8: bytes) · T tokens · n rows received.

DeepEP 2.5 sizes its kernels from the rows of each call (``TokenLayout``: row bytes, scale packs,
k) and the device's shared memory, and some of those sizes must agree between calls:

- direct mode: the dispatch kernel needs a thread per rank, forward and cached (the backward)
  (``support.direct_thread_rule``);
- hybrid mode: a dispatch picks its channels per SM from its rows, the combine's rows must fit
  those channels (``support.hybrid_row_rule``), and a cached dispatch must
  have the handle's channel count (csrc/buffers/ep.hpp:437-456, 485): along an fp8 handle (or a
  bf16 one of another width) the backward's rows travel in the handle's own layout, in pieces
  (``cached_pieces``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from flexdispatch.backends.deepep.bounded import COMBINE_COLS
from flexdispatch.backends.deepep.v25.support import (
    EP_DEVICE_SMEM,
    direct_thread_rule,
    direct_threads,
    hybrid_row_rule,
)

__all__ = [
    "COMBINE_COLS",
    "DISPATCH_COLS",
    "cached_pieces",
    "cached_refusal",
    "dispatch_cols",
    "pad",
    "row_refusal",
]

DISPATCH_COLS = 16  # 32-byte token rows (layout/ep/token.cuh:29)


def pad(n: int, b: int) -> int:
    return -(-n // b) * b


def device_smem(device: torch.device) -> int:
    """The opt-in shared memory per block DeepEP's JIT sizes its kernels by."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)
    return EP_DEVICE_SMEM


def dispatch_cols(hybrid: bool, R: int, E: int, cols: int, k: int, device: torch.device) -> int:
    """The column multiple bf16 dispatch rows of ``cols`` columns are padded to: 16, or in hybrid
    mode 256 where the combine's 256-column rows would not fit the channels 16-padded rows
    choose (so dispatch and combine rows are the same width there)."""
    if not hybrid:
        return DISPATCH_COLS
    w16 = pad(cols, DISPATCH_COLS)
    why = hybrid_row_rule(
        R,
        E,
        row_bytes=2 * w16,
        scale_packs=0,
        topk=k,
        dispatch_cols=w16,
        combine_cols=pad(cols, COMBINE_COLS),
        smem=device_smem(device),
    )
    return DISPATCH_COLS if why is None else COMBINE_COLS


def row_refusal(
    hybrid: bool,
    R: int,
    E: int,
    *,
    X: int,
    hidden: int,
    elem: int,
    packs: int,
    k: int,
    grad_elem: int,
    device: torch.device,
) -> str | None:
    """Why DeepEP 2.5 would fail to build or assert on these dispatch rows (``hidden`` columns
    of ``elem`` bytes, ``packs`` scale packs, k) or on their backward / combine (X columns of the
    caller's rows; the backward's gradient of ``grad_elem`` bytes per element travels as its
    bf16 bit view, an fp32 one twice as wide as bf16), or None. Direct mode: its kernel's thread
    rule at any R (rows too wide for one dispatch warp leave it no threads); hybrid mode: the
    channel and combine rules. A pure function of the shapes and the device's shared memory, so
    ranks that agree on the shape agree on it (the caller agrees it across ranks)."""
    return _row_refusal(hybrid, R, E, X, hidden, elem, packs, k, grad_elem, device_smem(device))


@functools.lru_cache(maxsize=256)
def _row_refusal(
    hybrid: bool,
    R: int,
    E: int,
    X: int,
    hidden: int,
    elem: int,
    packs: int,
    k: int,
    grad_elem: int,
    smem: int,
) -> str | None:
    if not hybrid:
        grad_cols = -(-X * grad_elem // 2)  # NOTE: the gradient's bf16 view (WireFormat)
        return direct_thread_rule(
            R,
            E,
            row_bytes=hidden * elem,
            scale_packs=packs,
            topk=k,
            backward_row_bytes=2 * pad(grad_cols, DISPATCH_COLS),
            smem=smem,
        )
    return hybrid_row_rule(
        R,
        E,
        row_bytes=hidden * elem,
        scale_packs=packs,
        topk=k,
        dispatch_cols=hidden,
        combine_cols=pad(X, COMBINE_COLS),
        smem=smem,
    )


def cached_refusal(R: int, E: int, *, row_bytes: int, k: int, device: torch.device) -> str | None:
    """Why DeepEP 2.5's direct-mode cached dispatch (the backward) cannot send ``row_bytes``-byte
    rows to R ranks (its kernel needs a thread per rank, dispatch.cuh:402), or None: checked on
    the gradient as it is, in case it is wider than the dispatch foresaw (an fp32 gradient of
    bf16 rows)."""
    _, threads = direct_threads(R, E, row_bytes, 0, k, device_smem(device))
    if threads >= R:
        return None
    return (
        f"DeepEP 2.5's direct-mode cached dispatch (the backward) gives {row_bytes}-byte gradient "
        f"rows {threads} threads, fewer than R={R} (dispatch.cuh:402): pass a narrower gradient "
        f"(bf16 rather than fp32 combine outputs), use hybrid mode or fewer ranks"
    )


def cached_pieces(
    w: torch.Tensor, unit: int, packs: int, send: Callable[[Any], torch.Tensor]
) -> torch.Tensor:
    """``[T, C]`` bf16 rows through ``send`` (one cached dispatch each) in pieces of ``unit``
    bytes per row: fp8 bytes beside ``[T, packs]`` zero scales (``packs >= 0``: an fp8 handle's
    layout), else bf16 columns; the received bytes are joined back into ``[n, C]`` bf16."""
    T, C = w.shape
    n = -(-2 * C // unit)
    b = w.view(torch.uint8)
    if n * unit != 2 * C:
        b = torch.nn.functional.pad(b, (0, n * unit - 2 * C))
    sf = torch.zeros(T, packs, dtype=torch.float32, device=w.device) if packs >= 0 else None
    parts = []
    for j in range(n):
        piece = b[:, j * unit : (j + 1) * unit].contiguous()
        if sf is not None:
            got = send((piece.view(torch.float8_e4m3fn), sf))
        else:
            got = send(piece.view(torch.bfloat16))
        parts.append(got.view(torch.uint8))
    return torch.cat(parts, dim=1)[:, : 2 * C].contiguous().view(torch.bfloat16)
