"""The in-band send rows of a flat worst-case dispatch in one Triton launch
(``_inband_src.pack_inband``), for the CUDA branch of ``backends/torch/flat.py``.

In torch ops the send rows take a packed ``[T + 1, row + metadata]`` buffer (an allocation,
four copies and a fill) and a gather of it into send order; the kernel writes every send row
straight from ``x``, the ids and the probs (one allocation and one launch, and no pass over a
packed copy of the rows).
"""

from __future__ import annotations

import torch

from flexdispatch.kernels._triton import Kernel, dispatch_kernels, next_pow2

__all__ = ["pack_inband", "pack_on_device"]

_KERNEL: Kernel | None = None
_BLOCK_WORDS = 512  # int32 words of a row chunk per program iteration (2 KiB)


def pack_on_device(device: torch.device) -> bool:
    """Whether the in-band send rows on ``device`` are packed by this kernel: on CUDA when
    ``triton`` imports, unless ``FLEXDISPATCH_DISPATCH_KERNELS=0``
    (``_triton.dispatch_kernels``)."""
    return device.type == "cuda" and dispatch_kernels()


def pack_inband(
    x: torch.Tensor,
    key_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    send_index: torch.Tensor,
    need: torch.Tensor,
    num_ids: int,
) -> torch.Tensor:
    """``[S, rb + 4 (2k + 1)]`` uint8 send rows: for each ``t = send_index[s]`` the bytes of
    ``x[t]`` (``rb`` of them, a multiple of 4), ``key_TK[t]`` as int32, the fp32 bits of
    ``probs_TK[t]`` and the 0-dim int64 ``need``; ``t == T`` is a padding row (zero bytes, every
    id ``num_ids``, probs 0).

    Args:
        x: ``[T, H]`` contiguous rows. key_TK: ``[T, k]`` int64 ids. probs_TK: ``[T, k]``
            float32. send_index: ``[S]`` int64 in ``[0, T]``. need: 0-dim int64.
    """
    global _KERNEL
    T, k = key_TK.shape
    S = send_index.shape[0]
    words = x.reshape(T, -1).view(torch.int32) if T else x.new_empty((0, 0), dtype=torch.int32)
    XW = x.shape[1] * x.element_size() // 4
    out = torch.empty((S, XW + 2 * k + 1), dtype=torch.int32, device=x.device)
    if S:
        if _KERNEL is None:
            from flexdispatch.kernels import _inband_src

            _KERNEL = Kernel(_inband_src.pack_inband)
        _KERNEL.get()[(S,)](
            words,
            key_TK.contiguous(),
            probs_TK.contiguous().view(torch.int32),
            send_index,
            need,
            out,
            T,
            num_ids,
            K=k,
            K_PAD=next_pow2(k),
            XW=XW,
            BLOCK_W=max(16, min(next_pow2(XW), _BLOCK_WORDS)),
        )
    return out.view(torch.uint8)
