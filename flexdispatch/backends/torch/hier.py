"""Hierarchical dispatch for the ``torch`` backend: cross each node boundary once, then forward.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · M1 rows a forwarder receives in the first hop.

Rank ``g = n * L + l`` is local rank ``l`` of node ``n``. A token of source rank ``(n_s, l_s)``
goes, in hop 1, once to every node ``n`` that holds one of its experts — to the *forwarder*
``(n, l_s)``, the rank with the same local index — carrying all its expert ids (``clamp_ids``,
global) and probs; a forwarder reads only the ids on its node. In hop 2 each forwarder sends every
row to the ranks of its node that hold one of the row's experts, the metadata unchanged; each
receiver keeps its own ids, like flat mode. Rows from forwarder ``l``
arrive grouped by source node; the receiver reorders the blocks to (source rank, token) order, so
the result equals flat mode bit for bit. Combine reverses this: each forwarder sums the rows of its
node's ranks (in rank order) and sends one row per token back across the node boundary; the source
adds the nodes in order — the same order of additions as flat combine.

Both hops are ``all_to_all_single`` calls on the dispatcher's group with zero splits for ranks
outside the hop (no sub-groups are created). Worst-case mode pads hop 1 to ``W / N`` rows per
(source, node) and hop 2 to ``W / L`` rows per (forwarder, receiver): both buffers hold ``W`` rows.
"""

from __future__ import annotations

import torch

from flexdispatch import _pool
from flexdispatch.backends.torch.hops import A2AHost, Hop, PendingCounts, finish
from flexdispatch.backends.torch.rows import (
    gather_rows,
    overflow_message,
    pack_key_meta,
    send_rows,
    slot_positions,
)
from flexdispatch.types import DispatchResult

__all__ = ["dispatch_hier"]


def _check_overflow_host(be: A2AHost, Gh: list[list[int]]) -> None:
    """Raise (on every rank: all hold ``Gh``) when a hop's cap would be exceeded."""
    R, L, N, W = be.num_ranks, be.ranks_per_node, be.num_nodes, be.num_worst_tokens
    cap1, cap2 = W // N, W // L
    worst1 = max((Gh[s][R + n], s, n) for s in range(R) for n in range(N))
    if worst1[0] > cap1:
        need, s, n = worst1
        what = f"rank {s} sending to node {n} (forwarder rank {n * L + s % L})"
        raise ValueError(overflow_message(what, need, cap1, W, N, R))
    worst2 = (0, 0, 0)
    for f in range(R):
        n_f, l_f = divmod(f, L)
        for j in range(L):
            g = n_f * L + j
            rows = sum(Gh[n * L + l_f][g] for n in range(N))
            worst2 = max(worst2, (rows, f, g))
    if worst2[0] > cap2:
        need, f, g = worst2
        what = f"forwarder rank {f} forwarding to rank {g}"
        raise ValueError(overflow_message(what, need, cap2, W, L, R))


def _ceil_div(value: torch.Tensor, d: int) -> torch.Tensor:
    """Device-side ``ceil(value / d)`` (int64; no op for ``d = 1``)."""
    return value if d == 1 else torch.div(value + (d - 1), d, rounding_mode="floor")


def _required_w(be: A2AHost, G: torch.Tensor) -> torch.Tensor:
    """Device-side smallest ``W / R`` (``W`` a multiple of R) that no hop would overflow
    (``record_overflow`` multiplies by R when it checks).

    Hop 1 needs ``W / N >= need1`` and hop 2 ``W / L >= need2``; with ``R = N * L`` that is
    ``W / R >= ceil(need1 / L)`` and ``ceil(need2 / N)`` (the same W as rounding
    ``max(N * need1, L * need2)`` up to a multiple of R, in fewer ops).
    """
    R, L, N = be.num_ranks, be.ranks_per_node, be.num_nodes
    need1 = G[:, R : R + N].max()
    # NOTE: forwarded rows (n_f, l) -> g: sum over source nodes n of C[(n, l), g].
    need2 = G[:, :R].reshape(N, L, R).sum(0).max()
    return torch.maximum(_ceil_div(need1, L), _ceil_div(need2, N))


def _node_lut(n: int, L: int, e: int, E: int, device: torch.device) -> torch.Tensor:
    """``[E + 3]`` int64 table from ``clamp_ids`` ids (negative ones wrap) to the local index
    ``j`` of the rank of node ``n`` that holds the expert, ``L`` for every other id (another
    node's expert, dropped or bad)."""
    lo = n * L * e
    # NOTE: built in place (no [L * e] temporary: the table alone is its peak)
    lut = torch.arange(-lo, E + 3 - lo, dtype=torch.int64, device=device)
    lut.div_(e, rounding_mode="floor")
    lut[:lo] = L
    lut[lo + L * e :] = L
    return lut


def _spare_slots(size: int, fill: int, base: int, device: torch.device) -> torch.Tensor:
    """``[size]`` int64 ``base + (i - fill) mod size``: unique values ``>= base``, ``base`` itself
    at index ``fill``."""
    i = torch.arange(size, device=device, dtype=torch.int64)
    return (i - fill).remainder_(size).add_(base)


def _dropless_maps(C: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_index, in_index)`` maps of a dropless hop-2 buffer of blocks
    ``[forwarder l][source node n]`` into source-rank order ``(n, l)``; ``C[n][l]`` rows per
    block, known on the host: one ``cat`` of slices of a cached ``arange`` per direction (every
    buffer row is returned)."""
    N, L = len(C), len(C[0])
    B = sum(map(sum, C))
    ar = _pool.arange(B, device)
    buf_start = [[0] * L for _ in range(N)]
    out_start = [[0] * L for _ in range(N)]
    pos = 0
    for l in range(L):
        for n in range(N):
            buf_start[n][l], pos = pos, pos + C[n][l]
    pos = 0
    for n in range(N):
        for l in range(L):
            out_start[n][l], pos = pos, pos + C[n][l]
    out_index = torch.cat(
        [ar[buf_start[n][l] : buf_start[n][l] + C[n][l]] for n in range(N) for l in range(L)]
    )
    in_index = torch.cat(
        [ar[out_start[n][l] : out_start[n][l] + C[n][l]] for l in range(L) for n in range(N)]
    )
    return out_index, in_index


def _worst_maps(C_NL: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_index, in_index)`` maps of a worst-case hop-2 buffer (``L`` blocks of ``cap``
    rows, block ``l`` holding the rows of source nodes ``n = 0..N-1`` back to back,
    ``C_NL[n, l]`` each) into ``W = L * cap`` rows in source-rank order ``(n, l)``, real rows
    first (tail: the spare row ``W``). No host sync: the output blocks are laid out as a
    ``[N * L, cap + 1]`` grid whose first ``size`` columns of each row are real, compacted by one
    ``nonzero_static``; the extra column is never real (the fill of that ``nonzero_static``).
    ``in_index`` points buffer rows that are not returned at output row 0 (their values end in
    the senders' dummy rows)."""
    N, L = C_NL.shape
    device = C_NL.device
    B = L * cap
    width = cap + 1
    size = N * L * width
    i64 = torch.int64
    zero_1L = _pool.cached(
        ("zeros_1L", L), device, lambda: torch.zeros(1, L, dtype=i64, device=device)
    )
    # NOTE: clamped only matters after an overflow (recorded, rows dropped, never OOB).
    ends = torch.cat([zero_1L, C_NL]).cumsum(0).clamp_(max=cap)  # [N + 1, L]
    starts = ends[:-1]
    sizes = ends[1:] - starts
    col = _pool.cached(("hier_cols", width), device, lambda: torch.arange(width, device=device))
    real = col < sizes.view(N * L, 1)
    # buffer row of grid slot (n, l, c): l * cap + start[n, l] + c
    slab_col = _pool.cached(
        ("hier_slab_col", L, cap),
        device,
        lambda: (torch.arange(L, device=device) * cap)[:, None] + col,
    )
    spare = _pool.cached(
        ("hier_spare", N, L, cap), device, lambda: _spare_slots(size, cap, B, device)
    )
    row = starts[:, :, None] + slab_col  # [N, L, width]
    vals = torch.where(real, row.view(N * L, width), spare.view(N * L, width)).view(-1)
    # grid slot ``cap`` (block 0's extra column) is never real and holds ``B``: the tail's row
    nz = torch.nonzero_static(real.view(-1), size=B, fill_value=cap)[:, 0]
    out_index = vals.index_select(0, nz)
    pos = real.view(-1).cumsum(0, dtype=i64)  # 1 + output row of each real slot
    tmp = torch.ones(B + size, dtype=i64, device=device)
    tmp.scatter_(0, vals, pos)  # NOTE: ``vals`` are unique (spare slots past B)
    in_index = tmp[:B] - 1
    return out_index, in_index


def dispatch_hier(
    be: A2AHost,
    x: torch.Tensor,
    key_TK: torch.Tensor,
    topk_probs: torch.Tensor,
    mask_TR: torch.Tensor,
    G: torch.Tensor,
    pending: PendingCounts | None,
) -> DispatchResult:
    """Two-hop dispatch (see the module docstring); same result as ``dispatch_flat``.

    ``key_TK``: ``[T, k]`` ``torch_rows.clamp_ids`` ids. They travel as they are (with the probs,
    one metadata block per hop); each forwarder finds its node's ranks with one cached table and
    each final receiver keeps its own ids (``finish``), as in flat mode.
    """
    T, H = x.shape
    k = key_TK.shape[1]
    R, L, N, e = be.num_ranks, be.ranks_per_node, be.num_nodes, be.num_local_experts
    E, me, W, device = be.num_experts, be.rank, be.num_worst_tokens, x.device
    n_me, l_me = divmod(me, L)
    node_ranks = list(range(n_me * L, (n_me + 1) * L))

    # ---- hop 1: one row per destination node, to the forwarder with my local index
    mask_TN = mask_TR if L == 1 else mask_TR.reshape(T, N, L).any(-1)
    cap1 = W // N if be.worst_case else None
    send_valid1 = gather1 = None
    if cap1 is not None:
        # NOTE: gathers read ``gather1`` (padding rows -> some real row); the valid mask is
        # needed only without a real row to point at (T = 0)
        send_index1, send_valid1 = slot_positions(mask_TN, cap1, valid=T == 0)
        gather1 = send_index1.clamp(max=T - 1) if T else None
    Gh = pending.wait() if pending is not None else None
    send1, recv1 = [0] * R, [0] * R
    if cap1 is not None:
        if Gh is not None:
            _check_overflow_host(be, Gh)
        else:
            be.record_overflow(_required_w(be, G), scale=R)
        for n in range(N):
            send1[n * L + l_me] = recv1[n * L + l_me] = cap1
    else:
        if Gh is None:
            raise RuntimeError("internal error: dropless dispatch without host counts")
        for n in range(N):
            send1[n * L + l_me] = Gh[me][R + n]
            recv1[n * L + l_me] = Gh[n * L + l_me][R + n_me]
        send_index1 = send_rows(mask_TN, sum(send1))

    def make_meta1() -> torch.Tensor:
        if cap1 is None:
            return pack_key_meta(key_TK, topk_probs).index_select(0, send_index1)
        # NOTE: padding rows read the spare row T, whose ids are the dropped id E: forwarders
        # never forward them (rows: arbitrary real rows, never returned)
        meta = torch.full((T + 1, 2 * k), E, dtype=torch.int32, device=device)
        meta[:T, :k].copy_(key_TK)
        meta[:T, k:].view(torch.float32).copy_(topk_probs)
        return meta.index_select(0, send_index1)

    hop1 = Hop(
        send_index=send_index1,
        send_valid=send_valid1,
        send_splits=tuple(send1),
        recv_splits=tuple(recv1),
        num_in=T,
        reduce_groups=tuple((n * L + l_me,) for n in range(N)),
        gather_index=gather1,
        padded=cap1 is not None,
    )
    rows1, meta1 = be.run_hop(hop1, x, make_meta1, scratch_key="recv0")
    M1 = rows1.shape[0]

    # ---- hop 2: forward inside the node to the ranks that hold the experts
    lut = _pool.cached(
        ("hier_node_lut", n_me, L, e, E), device, lambda: _node_lut(n_me, L, e, E, device)
    )
    mask_M1L = torch.zeros(M1, L + 1, dtype=torch.bool, device=device)
    mask_M1L.scatter_(1, lut[meta1[:, :k]], True)
    mask_M1L = mask_M1L[:, :L]
    cap2 = W // L if be.worst_case else None
    send_valid2 = gather2 = None
    send2, recv2 = [0] * R, [0] * R
    if cap2 is not None:
        send_index2, send_valid2 = slot_positions(mask_M1L, cap2, valid=M1 == 0)
        gather2 = send_index2.clamp(max=M1 - 1) if M1 else None
        for g in node_ranks:
            send2[g] = recv2[g] = cap2
    else:
        for j, g in enumerate(node_ranks):
            send2[g] = sum(Gh[n * L + l_me][g] for n in range(N))
            recv2[g] = sum(Gh[n * L + j][me] for n in range(N))
        send_index2 = send_rows(mask_M1L, sum(send2))

    hop2 = Hop(
        send_index=send_index2,
        send_valid=send_valid2,
        send_splits=tuple(send2),
        recv_splits=tuple(recv2),
        num_in=M1,
        reduce_groups=(tuple(node_ranks),),
        gather_index=gather2,
        padded=cap2 is not None,
    )

    def make_meta2() -> torch.Tensor:
        # NOTE: the received metadata travels on as it is (global ids)
        return gather_rows(meta1, *hop2.gather_args(), zero_invalid=False)

    be.stats.rows_sent += hop1.num_send + hop2.num_send
    # rows from forwarder l arrive grouped by source node: blocks [l][n], reordered to (n, l)
    reorder = cap2 is not None or (N > 1 and L > 1)
    recv_x, recv_meta = be.run_hop(
        hop2,
        rows1,
        make_meta2,
        spare_row=cap2 is not None,
        scratch_key="recv1" if reorder else None,
        meta_spare=E,  # the dropped id: the compaction's dummy row is no pair
    )
    maps = None
    if cap2 is not None:
        maps = _worst_maps(G[:, me].reshape(N, L).to(device), cap2)
    elif reorder:
        maps = _dropless_maps([[Gh[n * L + l][me] for l in range(L)] for n in range(N)], device)
    return finish(
        be,
        hop_list=(hop1, hop2),
        recv_x=recv_x,
        recv_meta=recv_meta,
        maps=maps,
        T=T,
        H=H,
        k=k,
        local_lo=me * e,
    )
