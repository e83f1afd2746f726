"""Hierarchical dispatch for the ``torch`` backend: cross each node boundary once, then forward.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · M1 rows a forwarder receives in the first hop.

Rank ``g = n * L + l`` is local rank ``l`` of node ``n``. A token of source rank ``(n_s, l_s)``
goes, in hop 1, once to every node ``n`` that holds one of its experts — to the *forwarder*
``(n, l_s)``, the rank with the same local index — carrying its global expert ids (only those on
node ``n``; others ``-1``) and probs. In hop 2 each forwarder sends every row to the ranks of its
node that hold one of the row's experts, with local ids, like flat mode. Rows from forwarder ``l``
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

from flexdispatch.backends.torch_hops import A2AHost, Hop, PendingCounts, finish
from flexdispatch.backends.torch_rows import (
    compaction,
    gather_rows,
    localize,
    overflow_message,
    pack_meta,
    round_up,
    slot_positions,
    split_owner,
    unpack_meta,
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


def _required_w(be: A2AHost, G: torch.Tensor) -> torch.Tensor:
    """Device-side smallest W (a multiple of R) that no hop would overflow."""
    R, L, N = be.num_ranks, be.ranks_per_node, be.num_nodes
    need1 = G[:, R : R + N].max() * N
    # NOTE: forwarded rows (n_f, l) -> g: sum over source nodes n of C[(n, l), g].
    fwd_LR = G[:, :R].reshape(N, L, R).sum(0)
    need2 = fwd_LR.max() * L
    return round_up(torch.maximum(need1, need2), R)


def dispatch_hier(
    be: A2AHost,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    mask_TR: torch.Tensor,
    G: torch.Tensor,
    pending: PendingCounts | None,
) -> DispatchResult:
    """Two-hop dispatch (see the module docstring); same result as ``dispatch_flat``."""
    T, H = x.shape
    k = topk_idx.shape[1]
    R, L, N, e = be.num_ranks, be.ranks_per_node, be.num_nodes, be.num_local_experts
    me, W, device = be.rank, be.num_worst_tokens, x.device
    n_me, l_me = divmod(me, L)
    node_ranks = list(range(n_me * L, (n_me + 1) * L))

    # ---- hop 1: one row per destination node, to the forwarder with my local index
    mask_TN = mask_TR.reshape(T, N, L).any(-1)
    cap1 = W // N if be.worst_case else None
    send_index1, send_valid1 = slot_positions(mask_TN, cap1)
    Gh = pending.wait() if pending is not None else None
    send1, recv1 = [0] * R, [0] * R
    if cap1 is not None:
        if Gh is not None:
            _check_overflow_host(be, Gh)
        else:
            be.record_overflow(_required_w(be, G))
        for n in range(N):
            send1[n * L + l_me] = recv1[n * L + l_me] = cap1
        node_S = torch.arange(N * cap1, device=device) // cap1
    else:
        if Gh is None:
            raise RuntimeError("internal error: dropless dispatch without host counts")
        for n in range(N):
            send1[n * L + l_me] = Gh[me][R + n]
            recv1[n * L + l_me] = Gh[n * L + l_me][R + n_me]
        send_index1 = send_index1[: sum(send1)]
        node_S = split_owner(mask_TN.sum(0), sum(send1))

    def make_meta1() -> torch.Tensor:
        ids1, probs1 = localize(
            gather_rows(topk_idx, send_index1, send_valid1),
            gather_rows(topk_probs, send_index1, send_valid1),
            node_S * (e * L),
            e * L,
            send_valid1,
            keep_global=True,
        )
        return pack_meta(ids1, probs1)

    hop1 = Hop(
        send_index=send_index1,
        send_valid=send_valid1,
        send_splits=tuple(send1),
        recv_splits=tuple(recv1),
        num_in=T,
        reduce_groups=tuple((n * L + l_me,) for n in range(N)),
    )
    rows1, meta1 = be.run_hop(hop1, x, make_meta1, scratch_key="recv0")
    ids_M1, probs_M1 = unpack_meta(meta1, k)
    M1 = rows1.shape[0]

    # ---- hop 2: forward inside the node to the ranks that hold the experts
    local_M1K = torch.where(ids_M1 >= 0, ids_M1 // e - n_me * L, L)
    mask_M1L = torch.zeros(M1, L + 1, dtype=torch.bool, device=device)
    mask_M1L.scatter_(1, local_M1K, True)
    mask_M1L = mask_M1L[:, :L]
    cap2 = W // L if be.worst_case else None
    send_index2, send_valid2 = slot_positions(mask_M1L, cap2)
    send2, recv2 = [0] * R, [0] * R
    if cap2 is not None:
        for g in node_ranks:
            send2[g] = recv2[g] = cap2
        dest_S = n_me * L + torch.arange(L * cap2, device=device) // cap2
    else:
        for j, g in enumerate(node_ranks):
            send2[g] = sum(Gh[n * L + l_me][g] for n in range(N))
            recv2[g] = sum(Gh[n * L + j][me] for n in range(N))
        send_index2 = send_index2[: sum(send2)]
        dest_S = n_me * L + split_owner(mask_M1L.sum(0), sum(send2))

    def make_meta2() -> torch.Tensor:
        ids2, probs2 = localize(
            gather_rows(ids_M1, send_index2, send_valid2),
            gather_rows(probs_M1, send_index2, send_valid2),
            dest_S * e,
            e,
            send_valid2,
        )
        return pack_meta(ids2, probs2)

    hop2 = Hop(
        send_index=send_index2,
        send_valid=send_valid2,
        send_splits=tuple(send2),
        recv_splits=tuple(recv2),
        num_in=M1,
        reduce_groups=(tuple(node_ranks),),
    )
    be.stats.rows_sent += hop1.num_send + hop2.num_send
    recv_x, recv_meta = be.run_hop(hop2, rows1, make_meta2, spare_row=True, scratch_key="recv1")

    # ---- reorder blocks [forwarder l][source node n] into source-rank order (n, l)
    B = recv_x.shape[0] - 1  # without the spare row
    C_NL = G[:, me].reshape(N, L).to(device)
    end_NL = C_NL.cumsum(0)
    start_NL = end_NL - C_NL
    if cap2 is not None:
        # NOTE: clamped only matters after an overflow (recorded, rows dropped, never OOB).
        end_NL, start_NL = end_NL.clamp(max=cap2), start_NL.clamp(max=cap2)
        slab_L = torch.arange(L, device=device, dtype=torch.int64) * cap2
        num_out = W
    else:
        sizes_L = C_NL.sum(0)  # rows from forwarder (n_me, l), the order of the buffer
        slab_L = sizes_L.cumsum(0) - sizes_L
        num_out = B
    sizes_NL = end_NL - start_NL
    maps = compaction(sizes_NL.reshape(-1), (slab_L[None, :] + start_NL).reshape(-1), num_out, B)
    return finish(
        be,
        hop_list=(hop1, hop2),
        recv_x=recv_x,
        recv_meta=recv_meta,
        maps=maps,
        T=T,
        H=H,
        k=k,
    )
