"""Hops of the ``torch`` backend: what one ``all_to_all_single`` moved (``Hop``), what a
dispatch keeps for its combine (``TorchDispatchState``), the host copy of the count matrix
(``PendingCounts``), and the row plumbing shared by the flat and hierarchical plans (``finish``,
``first_rows``). ``a2a.py`` holds the backend class; ``flat.py`` and
``hier.py`` the two dispatch plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch.backends.torch.rows import unpack_local
from flexdispatch.types import DispatchHandle, DispatchResult

__all__ = [
    "A2AHost",
    "Hop",
    "TorchDispatchState",
    "PendingCounts",
    "finish",
    "first_rows",
    "make_result",
]


class A2AHost(Protocol):
    """What the flat plan and the flat / hierarchical / hop helpers use of the torch backend
    (``TorchA2ABackend`` satisfies it); a protocol, so that the modules below the backend never
    import it."""

    num_ranks: int
    rank: int
    ranks_per_node: int
    num_experts: int
    num_worst_tokens: int
    hierarchical: bool
    distributed: bool
    checks: bool | None
    stats: Any
    pinned_counts: Any  # (pinned host buffer, event of the last copy into it) or None

    @property
    def num_nodes(self) -> int: ...
    @property
    def num_local_experts(self) -> int: ...
    @property
    def worst_case(self) -> bool: ...
    def checks_now(self, device: Any) -> bool: ...
    def node_groups(self) -> tuple[tuple[int, ...], ...]: ...
    def local_lut(self, device: Any) -> Any: ...
    def record_overflow(self, required_w: Any, scale: int = 1) -> None: ...
    def output(self, *args: Any, **kwargs: Any) -> Any: ...
    def scratch(self, *args: Any, **kwargs: Any) -> Any: ...
    def parts(self, *args: Any, **kwargs: Any) -> Any: ...
    def account(self, splits: tuple[int, ...], row_bytes: int) -> None: ...
    def all_to_all(self, *args: Any, **kwargs: Any) -> Any: ...
    def run_hop(self, *args: Any, **kwargs: Any) -> Any: ...
    def run_hop_rows(self, *args: Any, **kwargs: Any) -> Any: ...

    # NOTE: what the flat plan (plan.py) uses besides
    group: Any
    in_flight: str | None
    agreed_shapes: Any
    bad_ids: Any
    counts_bad_ids: bool
    issuer: Any
    _stats: Any

    def rank_lut(self, device: Any) -> Any: ...
    def exchange_counts(self, *args: Any, **kwargs: Any) -> Any: ...
    def start_host_counts(self, G: Any) -> Any: ...
    def inband_worst(self, device: Any) -> Any: ...
    def raise_inband_overflow(self, worst_R: list[int]) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Hop:
    """One ``all_to_all_single`` over the group, recorded so that combine can run it backwards.

    Attributes:
        send_index: ``[S]`` int64, row of the hop's input for each send row; ``num_in`` marks a
            padding row (worst-case mode).
        send_valid: ``[S]`` bool, False on padding rows; None when every row is real.
        send_splits: ``[R]`` rows sent to each rank (host ints).
        recv_splits: ``[R]`` rows received from each rank (host ints).
        num_in: rows of the hop's input (T for the first hop).
        reduce_groups: peers whose returning rows are summed together first (the ranks of one
            node, in rank order); the groups are then added in order.
        gather_index: ``[S]`` int64 ``send_index`` with padding rows pointing at row 0..num_in-1
            (arbitrary real rows: no receiver returns them), or None: gathers then need no
            clamp of their own.
        padded: the hop has padding rows even though ``send_valid`` is None (the flat CUDA
            path, which never reads it: ``send_index < num_in`` where needed).
    """

    send_index: torch.Tensor
    send_valid: torch.Tensor | None
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_in: int
    reduce_groups: tuple[tuple[int, ...], ...]
    gather_index: torch.Tensor | None = None
    padded: bool = False

    def gather_args(self, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, ...]:
        """``(index, valid)`` for ``gather_rows`` of send rows ``[lo, hi)``: ``gather_index``
        (every entry a real row, so nothing to clamp) when set, else ``send_index`` with
        ``send_valid``."""
        sl = slice(lo, hi)
        if self.gather_index is not None:
            return self.gather_index[sl], None
        if self.send_valid is None and self.padded:
            # NOTE: a padded hop without either (in band, empty input): the gather clamps
            return self.send_index[sl], self.send_index[sl] < self.num_in
        valid = None if self.send_valid is None else self.send_valid[sl]
        return self.send_index[sl], valid

    @property
    def is_padded(self) -> bool:
        """Whether some send rows are padding (``send_index == num_in`` there)."""
        return self.padded or self.send_valid is not None

    def valid(self, lo: int, hi: int) -> torch.Tensor | None:
        """``[hi - lo]`` bool, False on the padding rows among send rows ``[lo, hi)``, or None."""
        if self.send_valid is not None:
            return self.send_valid[lo:hi]
        return self.send_index[lo:hi] < self.num_in if self.padded else None

    @property
    def num_send(self) -> int:
        return sum(self.send_splits)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)


@dataclass(frozen=True, kw_only=True)
class TorchDispatchState:
    """The torch backend's part of a ``DispatchHandle``.

    Attributes:
        hops: the hops of the dispatch, in order.
        out_index: ``[M]`` int64 row of the last hop's output for each returned row (dummy =
            that output's row count: the zero spare row), or None when the last hop's output is
            returned as is.
        in_index: ``[B]`` int64 returned row for each row of the last hop's output, the inverse
            of ``out_index`` used by combine; rows that are not returned point at an arbitrary
            returned row (their values end in the senders' dummy rows).
        worst_case: whether the handle came from worst-case mode.
    """

    hops: tuple[Hop, ...]
    out_index: torch.Tensor | None
    in_index: torch.Tensor | None
    worst_case: bool


class PendingCounts:
    """The gathered counts ``G`` on their way to the host.

    On CUDA the copy goes into pinned memory (one buffer per backend, reused) on a side stream
    as soon as ``G`` exists, and
    ``wait()`` blocks on its event only when the host values are needed (just before the rows
    move). ``wait()`` also checks that the ranks agree on H, k and dtype, and raises the same
    error on every rank when they do not.

    Args:
        backend: the backend whose stats count the copy.
        G: ``[R, 2R + N + 4]`` int64 gathered counts.
        counter: ``"host_syncs"``, ``"check_syncs"`` (``stats.extra``) or None (not counted).
    """

    def __init__(self, backend: A2AHost, G: torch.Tensor, *, counter: str | None) -> None:
        self._backend = backend
        self._counter = counter
        self._values: list[list[int]] | None = None
        self._event: torch.cuda.Event | None = None
        self._host = G
        if G.is_cuda and torch.cuda.is_available():
            # NOTE: the pinned buffer is the backend's, reused by every dispatch of that shape
            # (one launch fewer): the last copy into it was waited on before that dispatch
            # returned, unless the dispatch raised in between (then it is waited on here).
            kept = backend.pinned_counts
            if kept is not None and kept[0].shape == G.shape:
                self._host, last = kept
                if last is not None:
                    last.synchronize()
            else:
                self._host = torch.empty(G.shape, dtype=G.dtype, pin_memory=True)
            side = torch.cuda.Stream(device=G.device)
            side.wait_stream(torch.cuda.current_stream(G.device))
            with torch.cuda.stream(side):
                self._host.copy_(G, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(side)
            G.record_stream(side)
            backend.pinned_counts = (self._host, self._event)

    def wait(self) -> list[list[int]]:
        """Host values of ``G`` (``[R][2R + N + 4]`` ints), after the cross-rank agreement check."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
            stats = self._backend.stats
            if self._counter == "host_syncs":
                stats.host_syncs += 1
            elif self._counter is not None:
                stats.extra[self._counter] = stats.extra.get(self._counter, 0) + 1
            self._backend.check_agreement(self._values)
        return self._values


def finish(
    be: A2AHost,
    *,
    hop_list: tuple[Hop, ...],
    recv_x: torch.Tensor,
    recv_meta: torch.Tensor,
    maps: tuple[torch.Tensor, torch.Tensor] | None,
    T: int,
    H: int,
    k: int,
    local_lo: int,
) -> DispatchResult:
    """Apply the output compaction (if any) and build the result and its handle.

    ``maps``: ``(out_index, in_index)`` of the compaction, or None (the last hop's output is
    returned as is); with it, ``recv_x`` / ``recv_meta`` carry the zero spare row
    (``spare_row=True``). The metadata holds ``expert_key`` ids (``pack_key_meta``; its spare row
    holds the dropped id E) and this rank's experts start at ``local_lo``.
    """
    out_index = in_index = None
    if maps is not None:
        out_index, in_index = maps
        if cuda_code_path(recv_x.device):  # NOTE: ``output`` is torch.empty there
            recv_x = recv_x.index_select(0, out_index)
        else:
            rows = be.output((out_index.shape[0], *recv_x.shape[1:]), recv_x.dtype, recv_x.device)
            recv_x = torch.index_select(recv_x, 0, out_index, out=rows)
        recv_meta = recv_meta.index_select(0, out_index)
    # NOTE: the compaction's tail reads the spare row, which holds the dropped id: no mask.
    ids, probs, counts = unpack_local(
        recv_meta,
        k,
        local_lo,
        be.num_local_experts,
        be.num_experts,
        lut=be.local_lut(recv_meta.device),
        counts=True,
    )
    return dispatch_result(be, hop_list, T, H, (recv_x, ids, probs, counts, out_index, in_index))


def dispatch_result(
    be: A2AHost, hop_list: tuple[Hop, ...], T: int, H: int, got: tuple[Any, ...]
) -> DispatchResult:
    """The ``DispatchResult`` of a finished dispatch and its handle (``finish``'s last step):
    ``got`` is ``(recv_x, ids, probs, counts, out_index, in_index)``."""
    recv_x, ids, probs, counts, out_index, in_index = got
    state = TorchDispatchState(
        hops=hop_list,
        out_index=out_index,
        in_index=in_index,
        worst_case=be.worst_case,
    )
    return make_result(state, T, H, recv_x, ids, probs, counts)


def make_result(
    state: Any,
    T: int,
    H: int,
    recv_x: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    counts: torch.Tensor,
    pairs: int | None = None,
    issuer: int = 0,
) -> DispatchResult:
    """The torch backend's ``DispatchResult`` of ``T`` tokens of width ``H`` and its handle
    holding ``state`` (``issuer``: the dispatcher's serial, when the backend knows it)."""
    handle = DispatchHandle(
        backend="torch",
        num_tokens=T,
        hidden=H,
        num_recv_rows=recv_x.shape[0],
        state=state,
        issuer=issuer,
    )
    return DispatchResult(
        recv_x=recv_x,
        recv_topk_idx=ids,
        recv_topk_probs=probs,
        num_recv_tokens_per_expert=counts,
        handle=handle,
        num_recv_pairs=pairs,
    )


def first_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of contiguous ``t``, as a tensor that is not a view when ``n`` is short.

    A custom autograd Function may not return a view of a tensor it created (in-place ops on it
    would then fail), so the rows are re-wrapped over the same storage with ``Tensor.set_``.
    """
    if t.shape[0] == n:
        return t
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), (n, *t.shape[1:]))
