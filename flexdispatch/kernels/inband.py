"""The in-band path of a flat worst-case dispatch in two Triton launches, for the CUDA branch of
``backends/torch/flat.py``: the send rows (``_inband_src.pack_inband``) and the receive side
(``_inband_src.unpack_inband``).

In torch ops the send rows take a packed ``[T + 1, row + metadata]`` buffer (an allocation,
four copies and a fill) and a gather of it into send order; the pack kernel writes every send
row straight from ``x``, the ids and the probs. The receive side takes a compaction
(``nonzero_static``, a running count), two gathers, the local ids, the probs and a count per
expert (about a dozen launches); the unpack kernel writes all of it from the receive buffer and
each block's count of real rows, in one pass over the rows it returns.
"""

from __future__ import annotations

import torch

from flexdispatch.kernels._triton import Kernel, dispatch_kernels, next_pow2

__all__ = ["pack_inband", "pack_on_device", "unpack_inband"]

_KERNELS: dict[str, Kernel] = {}
_BLOCK_WORDS = 512  # int32 words of a row chunk per program iteration (2 KiB)


def _kernel(name: str) -> Kernel:
    k = _KERNELS.get(name)
    if k is None:
        from flexdispatch.kernels import _inband_src

        k = _KERNELS[name] = Kernel(getattr(_inband_src, name))
    return k


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
    T, k = key_TK.shape
    S = send_index.shape[0]
    words = x.reshape(T, -1).view(torch.int32) if T else x.new_empty((0, 0), dtype=torch.int32)
    XW = x.shape[1] * x.element_size() // 4
    out = torch.empty((S, XW + 2 * k + 1), dtype=torch.int32, device=x.device)
    if S:
        _kernel("pack_inband").get()[(S,)](
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


def unpack_inband(
    recv: torch.Tensor,
    n_R: torch.Tensor,
    *,
    cap: int,
    k: int,
    hidden: int,
    dtype: torch.dtype,
    lo: int,
    num_local: int,
) -> tuple[torch.Tensor, ...]:
    """The compacted output of an in-band receive buffer in one launch: what
    ``rows.valid_compaction`` + ``hops.finish`` compute in torch ops.

    Args:
        recv: ``[W + 1, rb + 4 (2k + 1)]`` uint8 receive rows (``pack_inband``'s layout; row W,
            the spare row, is not read), ``R`` blocks of ``cap``. n_R: ``[R]`` int64 real rows
            per block (the first ones of each block). hidden, dtype: the rows' H and dtype.
            lo, num_local: this rank's first expert id and its count.

    Returns:
        ``(recv_x [W, H], ids [W, k] int64 local or -1, probs [W, k] float32 (0 where -1),
        counts [num_local] int64, out_index [W] int64 (W on the tail), in_index [W] int64)``.
    """
    W = recv.shape[0] - 1
    R = n_R.shape[0]
    dev = recv.device
    XW = hidden * dtype.itemsize // 4
    words = recv.view(torch.int32)
    recv_x = torch.empty((W, hidden), dtype=dtype, device=dev)
    ids = torch.empty((W, k), dtype=torch.int64, device=dev)
    probs = torch.empty((W, k), dtype=torch.float32, device=dev)
    counts = torch.zeros(num_local, dtype=torch.int64, device=dev)
    out_index = torch.empty(W, dtype=torch.int64, device=dev)
    in_index = torch.empty(W, dtype=torch.int64, device=dev)
    if W:
        _kernel("unpack_inband").get()[(W,)](
            words,
            words.view(torch.float32),
            n_R,
            recv_x.view(torch.int32),
            ids,
            probs,
            counts,
            out_index,
            in_index,
            lo,
            num_local,
            W,
            cap,
            R=R,
            R_PAD=next_pow2(R),
            K=k,
            K_PAD=next_pow2(k),
            XW=XW,
            BLOCK_W=max(16, min(next_pow2(XW), _BLOCK_WORDS)),
        )
    return recv_x, ids, probs, counts, out_index, in_index
