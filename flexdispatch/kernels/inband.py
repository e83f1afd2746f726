"""The flat worst-case dispatch in Triton launches, for the CUDA branch of
``backends/torch/plan.py`` (and ``flat.py`` in a world of one): the in-band send rows
(``_inband_src.pack_inband``) and the receive side of every flat worst-case dispatch
(``_inband_src.unpack_blocks``).

In torch ops the send rows take a packed ``[T + 1, row + metadata]`` buffer (an allocation,
four copies and a fill) and a gather of it into send order; the pack kernel writes every send
row straight from ``x``, the ids and the probs. The receive side takes a compaction
(``nonzero_static``, a running count), two gathers over all ``W`` rows, the local ids, the
probs and a count per expert (about a dozen launches); the unpack kernel writes all of it from
the receive buffer and each block's count of real rows, reading the real rows only.
"""

from __future__ import annotations

import torch

from flexdispatch.kernels._triton import Kernel, dispatch_kernels, next_pow2

__all__ = ["capped_slots", "pack_inband", "pack_on_device", "unpack_blocks"]

_KERNELS: dict[str, Kernel] = {}
_BLOCK_WORDS = 512  # int32 words of a row chunk per program iteration (2 KiB)


def _kernel(name: str) -> Kernel:
    k = _KERNELS.get(name)
    if k is None:
        from flexdispatch.kernels import _inband_src

        k = _KERNELS[name] = Kernel(getattr(_inband_src, name))
    return k


def pack_on_device(device: torch.device) -> bool:
    """Whether a flat worst-case dispatch on ``device`` runs these kernels: on CUDA when
    ``triton`` imports, unless ``FLEXDISPATCH_DISPATCH_KERNELS=0``
    (``_triton.dispatch_kernels``)."""
    return device.type == "cuda" and dispatch_kernels()


def _sources(
    x: torch.Tensor, key_TK: torch.Tensor, probs_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What the pack kernels read: ``x``'s rows as int32 words, the ids, the probs' fp32 bits,
    and the words per row ``XW``."""
    T = x.shape[0]
    words = x.reshape(T, -1).view(torch.int32) if T else x.new_empty((0, 0), dtype=torch.int32)
    XW = x.shape[1] * x.element_size() // 4
    return words, key_TK.contiguous(), probs_TK.contiguous().view(torch.int32), XW


def _block_words(XW: int) -> int:
    """``BLOCK_W``: the words of a row one step of a kernel copies."""
    return max(16, min(next_pow2(XW), _BLOCK_WORDS))


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
    words, key, probs_bits, XW = _sources(x, key_TK, probs_TK)
    out = torch.empty((S, XW + 2 * k + 1), dtype=torch.int32, device=x.device)
    if S:
        _kernel("pack_inband").get()[(S,)](
            words,
            key,
            probs_bits,
            send_index,
            need,
            out,
            T,
            num_ids,
            K=k,
            K_PAD=next_pow2(k),
            XW=XW,
            BLOCK_W=_block_words(XW),
        )
    return out.view(torch.uint8)


def unpack_blocks(
    rows: torch.Tensor,
    meta: torch.Tensor,
    n_R: torch.Tensor,
    *,
    cap: int,
    k: int,
    lo: int,
    num_local: int,
    row_map: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The compacted output of a flat worst-case receive buffer in one launch: what
    ``rows.flat_compaction`` (or ``valid_compaction``) + ``hops.finish`` compute in torch ops.
    Reads the real rows only (the tail's bytes are written as zeros, not read).

    Args:
        rows: ``[>= W, H]`` received rows, ``R`` blocks of ``cap`` (a spare row past ``W`` is
            not read; with ``row_map``, any number of rows); rows of a multiple of 4 bytes,
            each row contiguous (rows may be a strided view of a packed buffer). meta:
            ``[>= W, >= 2k]`` int32 view beside them:
            the ``pack_key_meta`` ids, then the probs' fp32 bits; with ``probs``, the ids only
            (``[>= W, k]``, int32 or int64, ``clamp_ids`` values). n_R: ``[R]`` int64 real rows
            per block (the first ones of each block; any stride; counts past ``cap`` read as
            ``cap``). lo, num_local: this rank's first expert id and its count. row_map:
            ``[W]`` int64 or None: receive row ``i`` is row ``row_map[i]`` of ``rows``,
            ``meta`` and ``probs`` (read for the real rows only); a world of one passes its
            send rows (``x``), ids, probs and their send order. probs: ``[>= W, k]`` float32
            beside ``meta``'s ids, or None (packed in ``meta``).

    Returns:
        ``(recv_x [W, H] rows.dtype, ids [W, k] int64 local or -1, probs [W, k] float32 (0
        where -1), counts [num_local] int64, out_index [W] int64 (W on the tail), in_index [W]
        int64)``.
    """
    R = n_R.shape[0]
    W = R * cap
    H = rows.shape[1]
    dev = rows.device
    XW = H * rows.element_size() // 4
    words = rows.view(torch.int32)
    meta_f = meta.view(torch.float32) if probs is None else probs
    assert words.stride(1) == 1 and meta.stride(1) == 1 and meta_f.stride(1) == 1
    assert meta.dtype in (torch.int32, torch.int64) and meta_f.dtype == torch.float32
    recv_x = torch.empty((W, H), dtype=rows.dtype, device=dev)
    ids = torch.empty((W, k), dtype=torch.int64, device=dev)
    probs_out = torch.empty((W, k), dtype=torch.float32, device=dev)
    counts = torch.zeros(num_local, dtype=torch.int64, device=dev)
    out_index = torch.empty(W, dtype=torch.int64, device=dev)
    in_index = torch.empty(W, dtype=torch.int64, device=dev)
    if W:
        _kernel("unpack_blocks").get()[(W,)](
            words,
            meta,
            meta_f,
            n_R if row_map is None else row_map,
            n_R,
            recv_x.view(torch.int32),
            ids,
            probs_out,
            counts,
            out_index,
            in_index,
            words.stride(0),
            meta.stride(0),
            meta_f.stride(0),
            k if probs is None else 0,
            n_R.stride(0),
            lo,
            num_local,
            W,
            cap,
            R=R,
            R_PAD=next_pow2(R),
            K=k,
            K_PAD=next_pow2(k),
            XW=XW,
            BLOCK_W=_block_words(XW),
            HAS_MAP=row_map is not None,
        )
    return recv_x, ids, probs_out, counts, out_index, in_index


def capped_slots(mask_NP: torch.Tensor, cap: int) -> torch.Tensor:
    """``rows.slot_positions``'s worst-case send index in one launch (the torch ops: a running
    count, three element-wise ops, a fill and a scatter).

    Args:
        mask_NP: ``[n, P]`` bool, row ``t`` goes to participant ``p`` (any strides).
        cap: rows per participant.

    Returns:
        ``[P * cap]`` int64: per participant its first ``cap`` rows in row order, then ``n``.
    """
    n, P = mask_NP.shape
    out = torch.empty(P * cap, dtype=torch.int64, device=mask_NP.device)
    if P and cap:
        m = mask_NP.view(torch.uint8)
        _kernel("capped_slots").get()[(P,)](
            m,
            out,
            n,
            m.stride(0),
            m.stride(1),
            cap,
            # NOTE: one program walks its whole column: wide chunks keep the walk short (4
            # steps at T = 16,384)
            BLOCK=max(16, min(next_pow2(max(n, cap)), 4096)),
        )
    return out
