"""The torch backend's hop collectives: what one *hop* of a dispatch or combine sends and
receives (``a2a.py`` explains hops; ``hops.Hop`` describes one).

Shape letters (ARCHITECTURE.md): R ranks · S rows one rank sends in one hop · P peers one hop
sends to · k top-k · X any row width.

``HopCollectives`` is a mixin of ``a2a.TorchA2ABackend``: the rows' and the metadata's
``all_to_all_single`` (own rows skipping the wire where they sit at one end of both buffers), the
byte accounting of every hop, and the combine's way back (``reduce.reduce_hop``). It reads the
backend's group, rank, statistics and row buffers (``buffers.RowBuffers``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch.backends.torch.hops import Hop
from flexdispatch.backends.torch.reduce import reduce_hop
from flexdispatch.backends.torch.rows import gather_rows
from flexdispatch.distributed import collective_guard
from flexdispatch.types import DispatchStats

__all__ = ["HopCollectives"]


class HopCollectives:
    """Hop collectives of the torch backend (a mixin: the attributes below are the backend's)."""

    group: dist.ProcessGroup | None
    rank: int
    distributed: bool
    in_flight: str | None
    stats: DispatchStats
    node_of: Callable[[int], int]
    output: Callable[..., torch.Tensor]
    scratch: Callable[..., torch.Tensor]

    def account(self, splits: tuple[int, ...], row_bytes: int) -> None:
        """Add ``splits[r] * row_bytes`` for every peer ``r != rank`` to the byte counters."""
        me = self.node_of(self.rank)
        for r, n in enumerate(splits):
            if n and r != self.rank:
                if self.node_of(r) == me:
                    self.stats.bytes_sent_intra_node += n * row_bytes
                else:
                    self.stats.bytes_sent_inter_node += n * row_bytes

    def all_to_all(
        self,
        send: torch.Tensor,
        send_splits: tuple[int, ...] | list[int],
        recv_splits: tuple[int, ...] | list[int],
        *,
        spare_row: bool = False,
        scratch_key: str | None = None,
        out: torch.Tensor | None = None,
        what: str = "all_to_all_single (rows)",
    ) -> torch.Tensor:
        """``all_to_all_single`` of rows; ``[sum(recv_splits), X]`` out, same dtype.

        ``spare_row`` appends one zero row to the output (``[sum(recv_splits) + 1, X]``), the
        target of the dummy index of a compaction, so that gathering needs no masking pass.
        ``scratch_key`` receives into a reused buffer (``scratch``): only for internal rows.
        ``out``: receive into this ``[sum(recv_splits), X]`` tensor instead (a planned call,
        ``plan.py``: lists as splits, no guard of its own; ``in_flight`` names ``what`` while it
        runs, for the call's one error boundary).
        """
        if out is not None:
            self.in_flight = what
            dist.all_to_all_single(out, send, recv_splits, send_splits, group=self.group)
            self.in_flight = None
            return out
        got, _ = self._all_to_all(send, send_splits, recv_splits, spare_row, scratch_key)
        return got

    def _all_to_all(
        self,
        send: torch.Tensor,
        send_splits: tuple[int, ...],
        recv_splits: tuple[int, ...],
        spare_row: bool,
        scratch_key: str | None,
        *,
        async_op: bool = False,
        what: str = "all_to_all_single (rows)",
        spare_fill: int = 0,
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """``all_to_all``'s body; with ``async_op`` also the work to wait on (None when done).
        ``spare_fill``: the value of the spare row (0, or the dropped id of flat metadata)."""
        B = sum(recv_splits)
        shape = (B + int(spare_row), *send.shape[1:])
        if scratch_key is None:
            out = self.output(shape, send.dtype, send.device)
        else:
            out = self.scratch(scratch_key, shape, send.dtype, send.device)
        if spare_row:
            out[B].fill_(spare_fill) if spare_fill else out[B].zero_()
        if not self.distributed:
            out[:B].copy_(send)
            return out, None
        with collective_guard(what, self.group):
            work = dist.all_to_all_single(
                out[:B],
                send,
                list(recv_splits),
                list(send_splits),
                group=self.group,
                async_op=async_op,
            )
        return out, work if async_op else None

    def run_hop_rows(
        self,
        hop: Hop,
        rows: torch.Tensor,
        *,
        spare_row: bool = False,
        scratch_key: str | None = None,
        during: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Send ``[num_in, X]`` rows along ``hop``; ``[num_recv (+1 spare), X]`` out.

        Padding rows carry arbitrary rows of ``rows``: no receiver returns them (the compaction
        skips them, forwarders see ids ``-1`` on them) and combine sends them into dummy rows.
        ``scratch_key``: receive into a reused buffer (rows that the call consumes itself).
        ``during``: called once, while the rows travel where they travel asynchronously (after
        the rows collective was issued, before it is waited on), else after it.
        """
        width = rows.shape[1:]
        self.account(hop.send_splits, math.prod(width) * rows.element_size())
        if not self.distributed:
            # NOTE: a world of one receives what it sends: gathered straight into place (no copy)
            B = hop.num_recv
            shape = (B + int(spare_row), *width)
            if scratch_key is None:
                out = self.output(shape, rows.dtype, rows.device)
            else:
                out = self.scratch(scratch_key, shape, rows.dtype, rows.device)
            if spare_row:
                out[B].zero_()
            gather_rows(rows, *hop.gather_args(), zero_invalid=False, out=out[:B])
            if during is not None:
                during()
            return out
        # NOTE: on CUDA my own rows go through the collective too: issued synchronously, it
        # would not overlap with their gather anyway, and one gather is one launch fewer.
        own = (
            None
            if cuda_code_path(rows.device)
            else self.self_block(hop.send_splits, hop.recv_splits)
        )
        if own is None:
            if cuda_code_path(rows.device):  # NOTE: no scratch there: the gather allocates
                send = gather_rows(rows, *hop.gather_args(), zero_invalid=False)
            else:
                send = self.scratch("send", (hop.num_send, *width), rows.dtype, rows.device)
                gather_rows(rows, *hop.gather_args(), zero_invalid=False, out=send)
            out = self.all_to_all(
                send, hop.send_splits, hop.recv_splits, spare_row=spare_row, scratch_key=scratch_key
            )
            if during is not None:
                during()
            return out
        # my own rows skip the collective: gathered straight into the receive buffer while the
        # peers' rows travel
        lo, hi, rlo, rhi = own
        S, B = hop.num_send, hop.num_recv
        shape = (B + int(spare_row), *width)
        if scratch_key is None:
            out = self.output(shape, rows.dtype, rows.device)
        else:
            out = self.scratch(scratch_key, shape, rows.dtype, rows.device)
        if spare_row:
            out[B].zero_()
        keep = (hi, S) if lo == 0 else (0, lo)
        send = self.scratch("send", (S - (hi - lo), *width), rows.dtype, rows.device)
        gather_rows(rows, *hop.gather_args(*keep), zero_invalid=False, out=send)
        recv = out[rhi:B] if rlo == 0 else out[:rlo]
        work = self.start_all_to_all(recv, send, hop.send_splits, hop.recv_splits)
        if during is not None:
            during()
        gather_rows(rows, *hop.gather_args(lo, hi), zero_invalid=False, out=out[rlo:rhi])
        self.wait_all_to_all(work)
        return out

    def run_hop(
        self,
        hop: Hop,
        rows: torch.Tensor,
        make_meta: Callable[[], torch.Tensor],
        *,
        spare_row: bool = False,
        scratch_key: str | None = None,
        meta_spare: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (``run_hop_rows``) and then their metadata (``run_hop_meta``) along ``hop``.

        ``meta_spare``: the value of the metadata's spare row (``spare_row``).

        ``make_meta`` builds the ``[num_send, 2k]`` int32 metadata while the rows are still on
        their way (CPU) or right after them. On CPU the metadata then starts at once
        (``async_op``: gloo runs it beside the rows) and this rank's own rows are copied while
        both travel; on CUDA it follows the rows on the stream.

        NOTE: every rank issues the rows collective before the metadata one, whether or not its
        own rows skip the collective, so the order of collectives matches on every rank.

        Returns:
            ``(rows [num_recv (+1), X], meta [num_recv (+1), 2k] int32)``.
        """
        got: list[tuple[torch.Tensor, dist.Work | None]] = []

        def during() -> None:
            meta = make_meta()
            if cuda_code_path(meta.device) or not self.distributed:
                got.append((meta, None))
                return
            got.append(self.start_meta(hop, meta, spare_row=spare_row, spare_fill=meta_spare))

        out = self.run_hop_rows(
            hop, rows, spare_row=spare_row, scratch_key=scratch_key, during=during
        )
        meta, work = got[0]
        if work is None:
            return out, self.run_hop_meta(hop, meta, spare_row=spare_row, spare_fill=meta_spare)
        self.wait_all_to_all(work, what="all_to_all_single (metadata)")
        return out, meta

    def start_meta(
        self, hop: Hop, meta: torch.Tensor, *, spare_row: bool, spare_fill: int = 0
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """Start (``async_op``, CPU only) the metadata of ``hop``; ``(receive buffer, work)``.

        The buffer is ``[num_recv (+1 zero spare row), 2k]`` int32; wait on the work with
        ``wait_all_to_all`` before reading it.
        """
        self.account(hop.send_splits, meta.shape[1] * meta.element_size())
        return self._all_to_all(
            meta,
            hop.send_splits,
            hop.recv_splits,
            spare_row,
            None,
            async_op=True,
            what="all_to_all_single (metadata)",
            spare_fill=spare_fill,
        )

    def self_block(
        self, send_splits: tuple[int, ...], recv_splits: tuple[int, ...]
    ) -> tuple[int, int, int, int] | None:
        """Where this rank's rows to itself lie, when they can skip the collective.

        They can when they sit at one end of both the send buffer (send order) and the receive
        buffer (source-rank order), so that the rest of each buffer is one contiguous block.
        Always true for R = 2; otherwise true on the first and last ranks of the hop.

        Returns:
            ``(lo, hi, rlo, rhi)``: send rows ``[lo, hi)`` arrive as receive rows ``[rlo, rhi)``
            (in order), or None (no rows to myself, no group, or a block in the middle).
        """
        me = self.rank
        n = send_splits[me]
        if n == 0 or not self.distributed:
            return None
        lo, rlo = sum(send_splits[:me]), sum(recv_splits[:me])
        hi, rhi = lo + n, rlo + n
        ends = (lo == 0 or hi == sum(send_splits)) and (rlo == 0 or rhi == sum(recv_splits))
        return (lo, hi, rlo, rhi) if ends else None

    def start_all_to_all(
        self,
        out: torch.Tensor,
        send: torch.Tensor,
        send_splits: tuple[int, ...],
        recv_splits: tuple[int, ...],
    ) -> dist.Work | None:
        """Start an ``all_to_all_single`` that skips this rank's own rows (split 0 to itself).

        On CPU it runs asynchronously (the caller copies its own rows meanwhile) and the caller
        must pass the returned work to ``wait_all_to_all``. On CUDA it is issued synchronously
        (``async_op=False``: the stream order already overlaps it, and it stays capturable in a
        CUDA graph) and None is returned.

        Args:
            out: ``[sum(recv_splits) - recv_splits[rank], X]`` receive rows, peers only.
            send: ``[sum(send_splits) - send_splits[rank], X]`` send rows, peers only.
            send_splits, recv_splits: ``[R]`` with this rank's own entry still in.
        """
        send_l, recv_l = list(send_splits), list(recv_splits)
        send_l[self.rank] = recv_l[self.rank] = 0
        is_async = not cuda_code_path(out.device)
        with collective_guard("all_to_all_single (rows)", self.group):
            work = dist.all_to_all_single(
                out, send, recv_l, send_l, group=self.group, async_op=is_async
            )
        return work if is_async else None

    def wait_all_to_all(
        self, work: dist.Work | None, *, what: str = "all_to_all_single (rows)"
    ) -> None:
        """Wait for a ``start_all_to_all`` (failures become ``CollectiveError``)."""
        if work is None:
            return
        with collective_guard(what, self.group):
            work.wait()

    def run_hop_meta(
        self, hop: Hop, meta: torch.Tensor, *, spare_row: bool = False, spare_fill: int = 0
    ) -> torch.Tensor:
        """Send ``[num_send, 2k]`` int32 metadata (already in send order) along ``hop``."""
        self.account(hop.send_splits, meta.shape[1] * meta.element_size())
        if not self.distributed and not spare_row:
            return meta  # NOTE: a world of one receives its send order (the caller's own rows)
        out, _ = self._all_to_all(
            meta,
            hop.send_splits,
            hop.recv_splits,
            spare_row,
            None,
            what="all_to_all_single (metadata)",
            spare_fill=spare_fill,
        )
        return out

    def reduce_hop(self, hop: Hop, back_in: torch.Tensor) -> torch.Tensor:
        """Send ``[num_recv, X]`` rows back along ``hop`` and sum them into ``[num_in, X]``
        (``torch_reduce.reduce_hop``)."""
        return reduce_hop(self, hop, back_in)
