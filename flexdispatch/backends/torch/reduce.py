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
from flexdispatch.backends.torch.hops import Hop, first_rows

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
    elif own is None:
        back = host.all_to_all(back_in, hop.recv_splits, hop.send_splits, scratch_key="back")
    else:
        # my own rows skip the collective: read straight from ``back_in``
        lo, hi, rlo, rhi = own
        S, B = hop.num_send, hop.num_recv
        back = host.scratch("back", (S, *width), back_in.dtype, back_in.device)
        peers_in = back_in[rhi:B] if rlo == 0 else back_in[:rlo]
        peers_out = back[hi:S] if lo == 0 else back[:lo]
        work = host.start_all_to_all(peers_out, peers_in, hop.recv_splits, hop.send_splits)
        mine = back_in[rlo:rhi]
    offsets = [0]
    for n in hop.send_splits:
        offsets.append(offsets[-1] + n)
    out: torch.Tensor | None = None
    width = back.shape[1:]
    # NOTE: dropless hops have no padding, hence no dummy row.
    rows_out = hop.num_in + hop.is_padded
    me = host.rank
    for members in hop.reduce_groups:
        present = [r for r in members if offsets[r + 1] > offsets[r]]
        if not present:
            continue
        # Every group's sum starts from zeros (one ``zeros`` + one ``index_add_`` per peer), on
        # every device: ``0 + a == a`` up to the sign of a zero, the same in every mode. My rows
        # may swap with the first peer's (``a + b == b + a`` exactly), so that they are added
        # while the peers' rows still travel (CPU); later terms keep their order.
        if mine is not None and me in present[:2]:
            present.remove(me)
            present.insert(0, me)
        if cuda_code_path(back.device):
            part = torch.zeros((rows_out, *width), dtype=back.dtype, device=back.device)
        else:
            part = host.output((rows_out, *width), back.dtype, back.device).zero_()
        for r in present:
            lo, hi = offsets[r], offsets[r + 1]
            if r == me and mine is not None:
                src = mine
            else:
                if work is not None:
                    host.wait_all_to_all(work)
                    work = None
                src = back[lo:hi]
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
