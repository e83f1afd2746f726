"""The flat plan of the ``torch`` backend: one hop straight to every expert's rank."""

from __future__ import annotations

import torch

from flexdispatch._validate import cuda_code_path
from flexdispatch.backends.torch.hops import (
    A2AHost,
    Hop,
    PendingCounts,
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
from flexdispatch.types import DispatchResult

__all__ = ["dispatch_flat", "PACK_MAX_ROW_BYTES", "packs_meta"]

PACK_MAX_ROW_BYTES = 2048
"""Rows of at most this many bytes travel with their metadata in one collective (``packs_meta``)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[T, C]`` viewed as bytes. A contiguous tensor may still have a stride other than 1
    in a last dimension of size 1 (an expanded column), which ``view`` refuses: copied then."""
    if t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def packs_meta(row_bytes: int) -> bool:
    """Whether a flat hop sends each row's ``[2k]`` int32 metadata in the same collective as
    the row (one ``all_to_all_single`` of ``[S, row_bytes + 8k]`` bytes instead of two).

    For short rows the collective's fixed cost is what matters, and the packing's copies (the
    ``[T]`` rows beside their metadata before the send gather, the received rows out of the
    packed buffer in dropless mode; in worst-case mode the compaction gathers them anyway)
    cost about what the metadata collective moved. Long rows keep two collectives: there the
    copies would cost a pass over the rows. Depends on H and the dtype only, which every rank
    agrees on before the rows move, so every rank issues the same collectives.
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
    """One hop straight to the ranks that hold the experts (see the module docstring).

    ``key_TK``: ``[T, k]`` ``torch_rows.expert_key`` ids (``E`` = dropped).
    """
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
    xp = None
    if packs_meta(row_bytes):
        # NOTE: one collective for rows and metadata (see ``packs_meta``); built while the
        # count exchange may still run (CPU)
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
            # NOTE: W = R times the largest count (a multiple of R already: no round_up)
            be.record_overflow(G[:, :R].max(), scale=R)
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
