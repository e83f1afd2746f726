"""The flat plan of the ``torch`` backend: one hop straight to every expert's rank.

Worst-case mode with short rows (``packs_meta``) and checks off carries its counts *in band*
(``inband_shape``): every peer already gets ``cap = W / R`` rows from every rank, so the
receiver reads which rows are real from their ids (a padding row is this rank's spare row
``T``, whose ids are all dropped) and every rank's largest send count from one int32 column
beside the ids (``count * R + destination``, the same in every row a rank sends). Dispatch +
combine is then two collectives, not three: the count exchange is skipped. Its agreement check
(H, k, dtype the same on every rank) runs at the first dispatch of each row shape on CPU
(``TorchA2ABackend.agreed_shapes``) and, with checks on, at every dispatch; a rank that
changes its row shape alone after that breaks the collective (gloo aborts the process on a size
mismatch), as with DeepEP, which checks nothing.
"""

from __future__ import annotations

import torch

from flexdispatch import _pool
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
    valid_compaction,
)
from flexdispatch.kernels import inband as _inband
from flexdispatch.types import DispatchResult

__all__ = ["dispatch_flat", "PACK_MAX_ROW_BYTES", "packs_meta", "inband_shape"]

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


def inband_shape(be: A2AHost, x: torch.Tensor, k: int) -> tuple[int, int, torch.dtype] | None:
    """``(H, k, dtype)`` when a dispatch of ``x`` may carry its counts in band (module docstring):
    flat worst-case mode across ranks, short rows, checks off, ``(T + 1) * R`` within int32;
    else None (the count exchange runs). Not in a world of one (no group, or a group of one
    rank), which runs no collective: there the count exchange is local."""
    R = be.num_ranks
    if not be.worst_case or be.hierarchical or not be.distributed:
        return None
    T, H = x.shape
    if not packs_meta(H * x.element_size()) or (T + 1) * R >= 2**31:
        return None
    if be.checks_now(x.device):
        return None
    return (H, k, x.dtype)


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
        # NOTE: the CUDA and in-band paths never read send_valid (``Hop.padded``,
        # ``gather_index``)
        need_valid = G is not None and not (cuda_code_path(device) and T)
        send_index, send_valid = slot_positions(mask_TR, cap, valid=need_valid)
    row_bytes = H * x.element_size()
    # NOTE: worst-case mode on CUDA with triton: the send rows in one launch (``pack_blocks``)
    # and the receive side in one (``unpack_blocks``, which reads no spare row); a world of one
    # (no group, or a group of one rank) receives its send rows in send order, so there the
    # unpack kernel reads them where they are, in either mode: no send rows, no receive
    # buffer, no collective
    kernels = row_bytes % 4 == 0 and _inband.pack_on_device(device)
    kernels = kernels and (cap is not None or not be.distributed)
    direct = kernels and not be.distributed
    xp = None
    if G is None:  # NOTE: counts in band (module docstring); the caller checked ``inband_shape``
        assert cap is not None
        return _dispatch_inband(be, x, key_TK, topk_probs, mask_TR, send_index, cap)
    if packs_meta(row_bytes) and not kernels:
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
    if kernels:
        x = x if x.is_contiguous() else x.contiguous()
        if direct:  # NOTE: the ids and probs read where they lie too (no metadata packed)
            rows, meta, row_map, probs = x, key_TK, send_index, topk_probs
            meta, probs = meta if meta.stride(1) == 1 else meta.contiguous(), probs.float()
            probs = probs if probs.stride(1) == 1 else probs.contiguous()
        else:
            rows, meta = _send_blocks(be, hop, x, key_TK, topk_probs)
            row_map = probs = None
        got = _inband.unpack_blocks(
            rows,
            meta,
            G[:, me],  # NOTE: the kernel reads the counts past ``cap`` as ``cap``
            cap=cap if cap is not None else hop.num_send,
            k=k,
            lo=me * e,
            num_local=e,
            row_map=row_map,
            probs=probs,
        )
        if cap is None:  # NOTE: dropless: the rows sent, all real (no compaction maps)
            got = (*got[:4], None, None)
        return dispatch_result(be, (hop,), T, H, *got)
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


def _send_blocks(
    be: A2AHost,
    hop: Hop,
    x: torch.Tensor,
    key_TK: torch.Tensor,
    topk_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worst-case rows and metadata after the count exchange, CUDA with triton: the send rows in
    one launch (``inband.pack_blocks``, padding rows not written), then one collective of both
    (short rows, ``packs_meta``) or two. Returns the received ``[W, H]`` rows and ``[W, 2k]``
    int32 metadata (no spare row: ``unpack_blocks`` reads none)."""
    H = x.shape[1]
    k = key_TK.shape[1]
    rb = H * x.element_size()
    S = hop.num_send
    if packs_meta(rb):
        send = torch.empty((S, rb + 8 * k), dtype=torch.uint8, device=x.device)
        rows, meta = send[:, :rb].view(x.dtype), send[:, rb:].view(torch.int32)
        _inband.pack_blocks(x, key_TK, topk_probs, hop.send_index, rows, meta)
        be.account(hop.send_splits, send.shape[1])
        recv = be.all_to_all(send, hop.send_splits, hop.recv_splits, scratch_key="recv0")
        return recv[:, :rb].view(x.dtype), recv[:, rb:].view(torch.int32)
    rows = torch.empty((S, H), dtype=x.dtype, device=x.device)
    meta = torch.empty((S, 2 * k), dtype=torch.int32, device=x.device)
    _inband.pack_blocks(x, key_TK, topk_probs, hop.send_index, rows, meta)
    be.account(hop.send_splits, rb)
    recv_x = be.all_to_all(rows, hop.send_splits, hop.recv_splits, scratch_key="recv0")
    be.account(hop.send_splits, 8 * k)
    return recv_x, be.all_to_all(meta, hop.send_splits, hop.recv_splits)


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


def _dispatch_inband(
    be: A2AHost,
    x: torch.Tensor,
    key_TK: torch.Tensor,
    topk_probs: torch.Tensor,
    mask_TR: torch.Tensor,
    send_index: torch.Tensor,
    cap: int,
) -> DispatchResult:
    """Worst-case flat dispatch without the count exchange (module docstring): one collective of
    ``W`` rows of ``row_bytes + 4 (2k + 1)`` bytes. On CUDA with triton both sides are kernels
    (``kernels.inband``); else the send rows are gathered from a packed ``[T + 1]`` buffer whose
    row ``T`` is the spare row that padding reads (``_pack_and_send``), and the receive side is
    ``valid_compaction`` + ``finish``."""
    T, H = x.shape
    k = key_TK.shape[1]
    R, me, W, E = be.num_ranks, be.rank, be.num_worst_tokens, be.num_experts
    device = x.device
    rb = H * x.element_size()
    # this rank's worst send, as count * R + destination (ties: the highest destination)
    need = torch.add(_pool.arange(R, device), mask_TR.sum(0), alpha=R).max()
    hop = Hop(
        send_index=send_index,
        send_valid=None,
        send_splits=(cap,) * R,
        recv_splits=(cap,) * R,
        num_in=T,
        reduce_groups=be.node_groups(),
        padded=True,
    )
    be.stats.rows_sent += hop.num_send
    kernels = _inband.pack_on_device(device)  # NOTE: the send rows and the receive side
    if kernels:
        # NOTE: one launch writes the send rows straight from x, the ids and the probs
        send = _inband.pack_inband(x, key_TK, topk_probs, send_index, need, E)
        be.account(hop.send_splits, send.shape[1])
        recv = be.all_to_all(
            send, hop.send_splits, hop.recv_splits, spare_row=True, scratch_key="recv0"
        )
    else:
        recv = _pack_and_send(be, x, key_TK, topk_probs, need, hop)
    recv_x, recv_meta, spare_in, worst_R, ids_WK = be.parts(
        ("recv", rb, k, x.dtype, cap), recv, lambda b: _recv_parts(b, rb, k, x.dtype, R, cap)
    )
    if cuda_code_path(device):
        be.record_overflow(worst_R.max().div(R, rounding_mode="floor"), scale=R)
    else:  # NOTE: CPU: the same error on every rank now (every rank got every rank's worst)
        worst = max((v // R, s, v % R) for s, v in enumerate(worst_R.tolist()))
        if worst[0] > cap:
            what = f"rank {worst[1]} sending to rank {worst[2]}"
            raise ValueError(overflow_message(what, worst[0], cap, W, R, R))
    mine_W = be.local_lut(device)[ids_WK].any(1)  # the real rows: the first of each block
    if kernels:
        # NOTE: one launch for the compaction, the local ids, the probs and the counts
        got = _inband.unpack_blocks(
            recv_x,
            recv_meta,
            mine_W.view(R, cap).sum(1),
            cap=cap,
            k=k,
            lo=me * be.num_local_experts,
            num_local=be.num_local_experts,
        )
        return dispatch_result(be, (hop,), T, H, *got)
    spare_in.fill_(E)  # the compaction's dummy row holds the dropped id (no pair)
    maps = valid_compaction(mine_W, W)
    return finish(
        be,
        hop_list=(hop,),
        recv_x=recv_x,
        recv_meta=recv_meta,
        maps=maps,
        T=T,
        H=H,
        k=k,
        local_lo=me * be.num_local_experts,
    )


def _pack_and_send(
    be: A2AHost,
    x: torch.Tensor,
    key_TK: torch.Tensor,
    topk_probs: torch.Tensor,
    need: torch.Tensor,
    hop: Hop,
) -> torch.Tensor:
    """The in-band send rows in torch ops: every row packed once into ``[T + 1, row +
    metadata]`` bytes (row ``T`` the spare row that padding reads), then gathered and sent."""
    T, H = x.shape
    k = key_TK.shape[1]
    rb = H * x.element_size()
    xp = be.scratch("pack", (T + 1, rb + 4 * (2 * k + 1)), torch.uint8, x.device)
    rows_x, ids, probs_bits, spare_ids, need_col = be.parts(
        ("pack", rb, k), xp, lambda b: _pack_parts(b, rb, k)
    )
    rows_x.copy_(_bytes(x))
    ids.copy_(key_TK)
    probs_bits.copy_(topk_probs.view(torch.int32))
    spare_ids.fill_(be.num_experts)  # NOTE: padding rows read this row: every id dropped
    need_col.copy_(need)
    # NOTE: the send gathers from ``xp``, whose row T exists: the unclamped index
    send_hop = Hop(
        send_index=hop.send_index,
        send_valid=None,
        send_splits=hop.send_splits,
        recv_splits=hop.recv_splits,
        num_in=T + 1,
        reduce_groups=hop.reduce_groups,
        gather_index=hop.send_index,
    )
    return be.run_hop_rows(send_hop, xp, spare_row=True, scratch_key="recv0")


def _pack_parts(xp: torch.Tensor, rb: int, k: int) -> tuple[torch.Tensor, ...]:
    """Views of the in-band send buffer ``[T + 1, rb + 4 (2k + 1)]`` bytes: the rows, the ids,
    the probs' bits, the spare row's ids and the worst-count column."""
    T = xp.shape[0] - 1
    meta = xp[:, rb:].view(torch.int32)
    return xp[:T, :rb], meta[:T, :k], meta[:T, k : 2 * k], meta[T, :k], meta[:, 2 * k]


def _recv_parts(
    recv: torch.Tensor, rb: int, k: int, dtype: torch.dtype, R: int, cap: int
) -> tuple[torch.Tensor, ...]:
    """Views of the in-band receive buffer ``[W + 1, rb + 4 (2k + 1)]`` bytes: the rows (as
    ``dtype``), the ``[W + 1, 2k]`` int32 metadata, the spare row's ids, each sender's worst
    count (``[R]``) and the ``[W, k]`` ids."""
    W = R * cap
    meta = recv[:, rb:].view(torch.int32)
    worst_R = meta[:W].view(R, cap, 2 * k + 1)[:, 0, 2 * k]
    return recv[:, :rb].view(dtype), meta[:, : 2 * k], meta[W, :k], worst_R, meta[:W, :k]
