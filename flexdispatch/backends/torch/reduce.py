"""The combine direction of one hop of the torch backend: rows back along a ``Hop``, summed.

Shape letters (ARCHITECTURE.md): R ranks · X row width · S rows a hop sends · B rows it receives.

Kept apart from ``a2a.py`` (the backend) so that each module stays one concern: this is
the reduction's order of arithmetic (docs/determinism.md), the CPU and CUDA branches side by side.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch.backends.torch.hops import Hop, first_rows, row_of_input

__all__ = ["reduce_compacted", "reduce_hop"]


def reduce_hop(host: Any, hop: Hop, back_in: torch.Tensor) -> torch.Tensor:
    """Send ``[num_recv, X]`` rows back along ``hop`` and sum them into ``[num_in, X]``.

    ``host`` is the ``TorchA2ABackend`` (its collectives, scratch and output memory, accounting).
    """
    width = back_in.shape[1:]
    host.account(hop.recv_splits, math.prod(width) * back_in.element_size())
    own = host.self_block(hop.send_splits, hop.recv_splits)
    work: dist.Work | None = None
    mine: torch.Tensor | None = None  # my own returning rows, read from ``back_in``
    if not host.distributed:
        # NOTE: a world of one gets back what it returns: summed straight from ``back_in`` as
        # the CUDA branch sums (no spare row read), on every device: no copy, no collective
        back = back_in
        spare_zeroed = True
    elif own is None:
        # NOTE: the zero spare row is read only by the CPU branch's gather below
        spare_row = not cuda_code_path(back_in.device)
        back = host.all_to_all(
            back_in, hop.recv_splits, hop.send_splits, spare_row=spare_row, scratch_key="back"
        )
        spare_zeroed = True
    else:
        # my own rows skip the collective: read straight from ``back_in``
        lo, hi, rlo, rhi = own
        S, B = hop.num_send, hop.num_recv
        back = host.scratch("back", (S + 1, *width), back_in.dtype, back_in.device)
        spare_zeroed = False  # NOTE: zeroed only if a gather below reads it
        peers_in = back_in[rhi:B] if rlo == 0 else back_in[:rlo]
        peers_out = back[hi:S] if lo == 0 else back[:lo]
        work = host.start_all_to_all(peers_out, peers_in, hop.recv_splits, hop.send_splits)
        mine = back_in[rlo:rhi]
    offsets = [0]
    for n in hop.send_splits:
        offsets.append(offsets[-1] + n)
    out: torch.Tensor | None = None
    width = back.shape[1:]
    spare = back.shape[0] - 1  # the zero row
    # NOTE: dropless hops have no padding, hence no dummy row.
    padded = hop.is_padded
    rows_out = hop.num_in + padded
    me = host.rank
    from_zeros = cuda_code_path(back.device) or not host.distributed
    for members in hop.reduce_groups:
        present = [r for r in members if offsets[r + 1] > offsets[r]]
        if not present:
            continue
        if from_zeros:
            # CUDA and a world of one: every group's sum starts from zeros (one ``zeros`` + one
            # ``index_add_`` per peer): no inverse map (``full`` + ``scatter_``) and no zero
            # spare row to write.
            # ``0 + a == a`` up to the sign of a zero, as on CPU; my rows may swap with the
            # first peer's (``a + b == b + a`` exactly), later terms keep their order.
            if mine is not None and me in present[:2]:
                present.remove(me)
                present.insert(0, me)
            part = torch.zeros((rows_out, *width), dtype=back.dtype, device=back.device)
            for r in present:
                lo, hi = offsets[r], offsets[r + 1]
                src = mine if r == me and mine is not None else back[lo:hi]
                part.index_add_(0, hop.send_index[lo:hi], src)
            out = part if out is None else out.add_(part)
            continue
        if work is not None and me in present[:2]:
            # CPU, peers' rows still travelling: start the sum from my own rows meanwhile
            # (``a + b == b + a`` exactly, so my rows may come first of the first two terms)
            present.remove(me)
            # NOTE: a sum from zeros (2 ops) rather than a gather that must zero the tokens
            # I did not receive (7 ops); it runs while the peers' rows travel.
            part = host.output((rows_out, *width), back.dtype, back.device).zero_()
            part.index_add_(0, hop.send_index[offsets[me] : offsets[me + 1]], mine)
            host.wait_all_to_all(work)
            work = None
            for r in present:
                lo, hi = offsets[r], offsets[r + 1]
                part.index_add_(0, hop.send_index[lo:hi], back[lo:hi])
            out = part if out is None else out.add_(part)
            continue
        if mine is not None and len(present) > 1 and present[0] == me:
            # NOTE: ``a + b == b + a`` exactly: the first two terms may swap, so that my rows
            # are added from ``back_in`` and only a peer's rows are gathered (from ``back``,
            # which has the zero row). Later terms keep their order.
            present[0], present[1] = present[1], me
        if mine is not None and present[0] == me:
            # alone in its group: my rows need the zero row of ``back``
            back[offsets[me] : offsets[me + 1]].copy_(mine)
        # the first peer of the group is gathered (zero row where it sent nothing) instead of
        # added to zeros: ``0 + a == a``, so the sums are the same and one pass is saved
        lo, hi = offsets[present[0]], offsets[present[0] + 1]
        first = row_of_input(hop, lo, hi, rows_out, base=lo, missing=spare)
        if not spare_zeroed:
            back[spare].zero_()
            spare_zeroed = True
        if work is not None:
            host.wait_all_to_all(work)
            work = None
        part = host.output((rows_out, *width), back.dtype, back.device)
        torch.index_select(back, 0, first, out=part)
        for r in present[1:]:
            lo, hi = offsets[r], offsets[r + 1]
            src = mine if r == me and mine is not None else back[lo:hi]
            # NOTE: one index_add_ per peer: indices are unique (except the dummy row), so the
            # order of the additions is fixed on every device.
            part.index_add_(0, hop.send_index[lo:hi], src)
        out = part if out is None else out.add_(part)
    if work is not None:
        host.wait_all_to_all(work)
    if out is None:
        return host.output((hop.num_in, *width), back.dtype, back.device).zero_()
    return first_rows(out, hop.num_in)


def reduce_compacted(host: Any, hop: Hop, y: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
    """Combine of a worst-case dispatch in a world of one (no group, or a group of one rank),
    CUDA branch: ``[W, X]`` compacted rows summed straight into ``[num_in, X]``, no collective.

    A world of one receives its send rows in send order, so compacted row ``i`` is send row
    ``out_index[i]`` and goes to input row ``send_index[out_index[i]]``; the tail
    (``out_index == W``) and the padding rows go to the dummy row ``num_in``, which is cut off.
    This skips the inverse gather into receive order (a pass over all ``W`` rows, read and
    written) that a collective needs. The sum is the CUDA branch's of ``reduce_hop``: zeros plus
    one ``index_add_`` whose real indices are unique (deterministic).
    """
    T = hop.num_in
    width = y.shape[1:]
    host.account(hop.recv_splits, math.prod(width) * y.element_size())
    dest = torch.nn.functional.pad(hop.send_index, (0, 1), value=T)[out_index]
    out = torch.zeros((T + 1, *width), dtype=y.dtype, device=y.device)
    out.index_add_(0, dest, y)
    return first_rows(out, T)
