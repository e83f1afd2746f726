"""The flat dispatch of the ``torch`` backend in a world of one (no group, or a group of one
rank): one "hop" that moves no byte (the rank receives its own send rows, in send order), with
the count exchange local. Across ranks the flat dispatch is planned per shape (``plan.py``).

Short rows (``packs_meta``) are gathered with their metadata in one pass; on CUDA with Triton the
receive side is one launch (``inband.unpack_blocks``) that reads the rows where they lie.
"""

from __future__ import annotations

import torch

from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch.backends.torch.hops import (
    A2AHost,
    Hop,
    PendingCounts,
    dispatch_result,
    finish,
)
from flexdispatch.backends.torch.rows import (
    flat_compaction,
    gather_rows,
    overflow_message,
    pack_key_meta,
    send_rows,
    slot_positions,
)
from flexdispatch.kernels import inband as _inband
from flexdispatch.types import DispatchResult

__all__ = ["dispatch_flat", "PACK_MAX_ROW_BYTES", "packs_meta"]

PACK_MAX_ROW_BYTES = 2048
"""Rows of at most this many bytes are gathered with their metadata (``packs_meta``)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[T, C]`` viewed as bytes. A contiguous tensor may still have a stride other than 1
    in a last dimension of size 1 (an expanded column), which ``view`` refuses: copied then."""
    if t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def packs_meta(row_bytes: int) -> bool:
    """Whether a world of one's dispatch gathers each row's ``[2k]`` int32 metadata beside the
    row (one gather of ``[S, row_bytes + 8k]`` bytes instead of two): for short rows the
    copy of the ``[T]`` rows beside their metadata costs less than a second gather; long rows
    gather apart. (Across ranks ``plan.py`` decides on the call's bytes.)
    """
    return row_bytes % 4 == 0 and row_bytes <= PACK_MAX_ROW_BYTES


def dispatch_flat(
    be: A2AHost,
    x: torch.Tensor,
    key_TK: torch.Tensor,
    topk_probs: torch.Tensor,
    mask_TR: torch.Tensor,
    G: torch.Tensor,
    pending: PendingCounts | None,
) -> DispatchResult:
    """One hop to this rank's own experts (see the module docstring).

    ``key_TK``: ``[T, k]`` ``torch_rows.expert_key`` ids (``E`` = dropped).
    """
    assert not be.distributed  # NOTE: across ranks, ``plan.FlatPlan``
    T, H = x.shape
    k = key_TK.shape[1]
    R, e, me, W = be.num_ranks, be.num_local_experts, be.rank, be.num_worst_tokens
    device = x.device
    cap = W // R if be.worst_case else None
    send_valid = None
    if cap is not None:
        # NOTE: the CUDA path never reads send_valid (``Hop.padded``, ``gather_index``)
        need_valid = not (cuda_code_path(device) and T)
        send_index, send_valid = slot_positions(mask_TR, cap, valid=need_valid)
    row_bytes = H * x.element_size()
    # NOTE: on CUDA with triton a world of one receives its send rows in send order, so the
    # unpack kernel (``unpack_blocks``) reads them where they are, in either mode: no send rows,
    # no receive buffer
    kernels = row_bytes % 4 == 0 and _inband.pack_on_device(device)
    xp = None
    if packs_meta(row_bytes) and not kernels:
        # NOTE: rows and metadata gathered together (see ``packs_meta``)
        meta_TK = pack_key_meta(key_TK, topk_probs)
        xp = torch.cat([_bytes(x), _bytes(meta_TK)], 1)
    Gh = pending.wait() if pending is not None else None
    if cap is not None:
        if Gh is not None:
            worst = max((Gh[s][g], s, g) for s in range(R) for g in range(R))
            if worst[0] > cap:
                what = f"rank {worst[1]} sending to rank {worst[2]}"
                raise ValueError(overflow_message(what, worst[0], cap, W, R, R))
        else:
            # NOTE: W = R times the largest count (a multiple of R already: no round_up); a
            # world of one has one count (a view, no launch)
            be.record_overflow(G[0, 0] if R == 1 else G[:, :R].max(), scale=R)
        send_splits = recv_splits = (cap,) * R
    else:
        if Gh is None:
            raise RuntimeError("internal error: dropless dispatch without host counts")
        send_splits = tuple(Gh[me][:R])
        recv_splits = tuple(Gh[s][me] for s in range(R))
        send_index = send_rows(mask_TR, sum(send_splits))
    hop = Hop(
        send_index=send_index,
        send_valid=send_valid,
        send_splits=send_splits,
        recv_splits=recv_splits,
        num_in=T,
        reduce_groups=be.node_groups(),
        # NOTE: one clamp for every gather of the dispatch (padding rows -> some real row)
        gather_index=send_index.clamp(max=T - 1) if cap is not None and T else None,
        padded=cap is not None,
    )
    be.stats.rows_sent += hop.num_send
    if kernels:  # NOTE: the rows, ids and probs read where they lie (no metadata packed)
        rows = x if x.is_contiguous() else x.contiguous()
        meta = key_TK if key_TK.stride(1) == 1 else key_TK.contiguous()
        probs = topk_probs.float()
        probs = probs if probs.stride(1) == 1 else probs.contiguous()
        got = _inband.unpack_blocks(
            rows,
            meta,
            G[:, me],  # NOTE: the kernel reads the counts past ``cap`` as ``cap``
            cap=cap if cap is not None else hop.num_send,
            k=k,
            lo=me * e,
            num_local=e,
            row_map=send_index,
            probs=probs,
        )
        if cap is None:  # NOTE: dropless: the rows sent, all real (no compaction maps)
            got = (*got[:4], None, None)
        return dispatch_result(be, (hop,), T, H, got)
    spare = cap is not None
    if xp is not None:
        recv = be.run_hop_rows(hop, xp, spare_row=spare, scratch_key="recv0")
        B = hop.num_recv
        if spare:  # the compaction's dummy row holds the dropped id (no pair)
            recv[B, row_bytes : row_bytes + 4 * k].view(torch.int32).fill_(be.num_experts)
        recv_x = recv[:, :row_bytes].view(x.dtype)
        recv_meta = recv[:, row_bytes:].view(torch.int32)
        if not spare:  # NOTE: dropless returns the rows as they came: unpacked once
            recv_x = be.output((B, H), x.dtype, device).copy_(recv_x)
    else:
        recv_x, recv_meta = _rows_then_meta(be, hop, x, key_TK, topk_probs, spare)
    maps = None
    if cap is not None:
        maps = flat_compaction(G[:, me].clamp(max=cap).to(device), cap)
    return finish(
        be,
        hop_list=(hop,),
        recv_x=recv_x,
        recv_meta=recv_meta,
        maps=maps,
        T=T,
        H=H,
        k=k,
        local_lo=me * e,
    )


def _rows_then_meta(
    be: A2AHost,
    hop: Hop,
    x: torch.Tensor,
    key_TK: torch.Tensor,
    topk_probs: torch.Tensor,
    spare: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and then their metadata, two collectives (long rows, ``packs_meta`` False)."""

    def make_meta() -> torch.Tensor:
        # NOTE: global ids travel; each receiver keeps its own (``finish``). Padding rows carry
        # arbitrary rows: the compaction never returns them.
        meta_TK = pack_key_meta(key_TK, topk_probs)
        return gather_rows(meta_TK, *hop.gather_args(), zero_invalid=False)

    return be.run_hop(
        hop,
        x,
        make_meta,
        spare_row=spare,
        scratch_key="recv0" if spare else None,
        meta_spare=be.num_experts,  # the dropped id: the compaction's dummy row is no pair
    )
