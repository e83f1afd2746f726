"""The ``torch`` backend: dispatch and combine over ``torch.distributed.all_to_all_single``.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · S rows one rank sends in one hop · P peers one hop sends to · X any row width.

How a dispatch runs (works on gloo and NCCL):

1. Count exchange: one ``all_gather_into_tensor`` of a ``[R + N + 4]`` int64 vector per rank
   (rows for every rank, rows for every node, H, k, dtype code, T). Every rank then holds the
   ``[R, R + N + 4]`` matrix ``G`` and can raise the same error on every rank: mismatching
   H / k / dtype, or a worst-case overflow.
2. Dropless mode copies ``G`` to the host once (``stats.host_syncs += 1``); on CUDA that copy is
   issued on a side stream into pinned memory right after the exchange and waited on just before
   the rows move. Worst-case mode never reads it on CUDA (only with checks enabled; counted in
   ``stats.extra["check_syncs"]``); on CPU it is read directly (no device to sync with).
3. One *hop* = one ``all_to_all_single`` of the rows plus one of an int32 ``[S, 2k]`` metadata
   block (``topk_idx`` as int32 beside the fp32 bits of the probs). Rows keep their dtype (bf16
   stays bf16). Flat mode is one hop; hierarchical mode is two (see ``torch_hier.py``). Both use
   the dispatcher's own group: ranks outside a hop get zero-sized splits, so no sub-groups exist.
4. Worst-case mode pads every hop to ``cap`` rows per peer on the device (``W / R`` flat) and
   compacts the received rows on the device so the real rows come first, in (source rank, source
   token) order; the tail is zero / ``-1`` / 0.

Combine sends the rows back along the same hops and sums them per token. The sum runs in a fixed
order — first over the ranks of each node (in rank order), then over nodes — so flat and
hierarchical combine give bit-identical results, and every ``index_add_`` has unique indices
(deterministic on CUDA too).

Every collective runs inside ``collective_guard``: a peer that fails, exits or times out turns
into a ``flexdispatch.distributed.CollectiveError`` on this rank, naming the collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flexdispatch._validate import checks_enabled, is_capturing
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import DTYPE_CODES, check_agreement, exchange_counts
from flexdispatch.backends.torch_rows import (
    compaction,
    count_local,
    gather_rows,
    localize,
    overflow_message,
    pack_meta,
    round_up,
    slot_positions,
    split_owner,
    unpack_meta,
)
from flexdispatch.distributed import (
    collective_guard,
    group_rank,
    group_size,
    is_distributed,
)
from flexdispatch.types import DispatchHandle, DispatchLayout, DispatchResult, DispatchStats

__all__ = ["TorchA2ABackend", "TorchDispatchState", "Hop", "DTYPE_CODES"]


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
    """

    send_index: torch.Tensor
    send_valid: torch.Tensor | None
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_in: int
    reduce_groups: tuple[tuple[int, ...], ...]

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
        out_valid: ``[M]`` bool, False on the worst-case tail; None with ``out_index``.
        in_index: ``[B]`` int64 returned row for each row of the last hop's output, the inverse
            of ``out_index`` used by combine; rows that are not returned point at an arbitrary
            returned row (their values end in the senders' dummy rows).
        worst_case: whether the handle came from worst-case mode.
    """

    hops: tuple[Hop, ...]
    out_index: torch.Tensor | None
    out_valid: torch.Tensor | None
    in_index: torch.Tensor | None
    worst_case: bool


class PendingCounts:
    """The gathered counts ``G`` on their way to the host.

    On CUDA the copy goes into pinned memory on a side stream as soon as ``G`` exists, and
    ``wait()`` blocks on its event only when the host values are needed (just before the rows
    move). ``wait()`` also checks that the ranks agree on H, k and dtype, and raises the same
    error on every rank when they do not.

    Args:
        backend: the backend whose stats count the copy.
        G: ``[R, R + N + 4]`` int64 gathered counts.
        counter: ``"host_syncs"``, ``"check_syncs"`` (``stats.extra``) or None (not counted).
    """

    def __init__(self, backend: TorchA2ABackend, G: torch.Tensor, *, counter: str | None) -> None:
        self._backend = backend
        self._counter = counter
        self._values: list[list[int]] | None = None
        self._event: torch.cuda.Event | None = None
        self._host = G
        if G.is_cuda and torch.cuda.is_available():
            self._host = torch.empty(G.shape, dtype=G.dtype, pin_memory=True)
            side = torch.cuda.Stream(device=G.device)
            side.wait_stream(torch.cuda.current_stream(G.device))
            with torch.cuda.stream(side):
                self._host.copy_(G, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(side)
            G.record_stream(side)

    def wait(self) -> list[list[int]]:
        """Host values of ``G`` (``[R][R + N + 4]`` ints), after the cross-rank agreement check."""
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


class TorchA2ABackend(DispatchBackend):
    """Dispatch/combine over ``all_to_all_single`` (flat or hierarchical, dropless or worst-case).

    Args:
        group: the process group (None = WORLD, or a world of one without torch.distributed).
        num_experts: E, divisible by R.
        ranks_per_node: L, dividing R.
        num_worst_tokens: W (0 = dropless); must be a multiple of R.
        hierarchical: two hops (across nodes, then inside the node) instead of one.
        checks: value checks on CUDA in worst-case mode (host syncs).
        stats: counters to add to (shared with the dispatcher).
    """

    name = "torch"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_experts: int,
        ranks_per_node: int,
        num_worst_tokens: int = 0,
        hierarchical: bool = False,
        checks: bool | None = None,
        stats: DispatchStats | None = None,
    ) -> None:
        self.group = group
        self.num_ranks = group_size(group)
        self.rank = group_rank(group)
        self.ranks_per_node = ranks_per_node
        self.num_experts = num_experts
        self.num_worst_tokens = num_worst_tokens
        self.hierarchical = hierarchical
        self.checks = checks
        self.stats = stats if stats is not None else DispatchStats()
        self._required_w: torch.Tensor | None = None
        ok, reason = self.supports_world(self.num_ranks, ranks_per_node)
        if not ok:
            raise ValueError(reason)
        R, W = self.num_ranks, num_worst_tokens
        if W % R:
            raise ValueError(
                f"num_worst_tokens={W} is not a multiple of the expert-parallel world size R={R}: "
                f"the torch backend pads W/R rows per peer, so round it up to "
                f"{math.ceil(W / R) * R}"
            )
        if num_experts % R:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the world size R={R}: experts are "
                f"sharded contiguously, pick a world size dividing {num_experts}"
            )

    # ----------------------------------------------------------------- capabilities
    def supports_worst_case(self) -> Capability:
        return True, "torch: equal W/R splits padded and compacted on the device, no host sync"

    def supports_cuda_graph(self) -> Capability:
        if self.num_worst_tokens <= 0:
            return False, (
                "torch dropless mode reads the split sizes on the host once per dispatch: set "
                "num_worst_tokens for a capturable dispatch"
            )
        return True, "torch worst-case mode has static shapes and no host sync (needs NCCL)"

    def supports_hierarchical(self) -> Capability:
        return True, "torch: two all_to_all_single hops over the same group (zero splits elsewhere)"

    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        if ranks_per_node <= 0 or num_ranks % ranks_per_node:
            return False, (
                f"world size {num_ranks} is not a multiple of ranks_per_node={ranks_per_node}: "
                f"set DispatchConfig.ranks_per_node to a divisor of {num_ranks}"
            )
        return True, "torch: any world size"

    # ----------------------------------------------------------------- helpers
    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_groups(self) -> tuple[tuple[int, ...], ...]:
        L = self.ranks_per_node
        return tuple(tuple(range(n * L, (n + 1) * L)) for n in range(self.num_nodes))

    def exchange_counts(
        self, mask_TR: torch.Tensor, hidden: int, topk: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The count exchange (``counts.exchange_counts``) over this backend's group."""
        return exchange_counts(
            mask_TR,
            hidden=hidden,
            topk=topk,
            dtype=dtype,
            ranks_per_node=self.ranks_per_node,
            group=self.group,
        )

    def check_agreement(self, Gh: list[list[int]]) -> None:
        """Raise on every rank when H, k or the dtype differ across ranks."""
        check_agreement(Gh, num_ranks=self.num_ranks, num_nodes=self.num_nodes)

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
        send_splits: tuple[int, ...],
        recv_splits: tuple[int, ...],
        *,
        spare_row: bool = False,
    ) -> torch.Tensor:
        """``all_to_all_single`` of rows; ``[sum(recv_splits), X]`` out, same dtype.

        ``spare_row`` appends one zero row to the output (``[sum(recv_splits) + 1, X]``), the
        target of the dummy index of a compaction, so that gathering needs no masking pass.
        """
        B = sum(recv_splits)
        out = send.new_empty(B + int(spare_row), *send.shape[1:])
        if spare_row:
            out[B].zero_()
        if not is_distributed(self.group):
            out[:B].copy_(send)
            return out
        with collective_guard("all_to_all_single (rows)", self.group):
            dist.all_to_all_single(
                out[:B], send, list(recv_splits), list(send_splits), group=self.group
            )
        return out

    def run_hop_rows(
        self, hop: Hop, rows: torch.Tensor, *, spare_row: bool = False
    ) -> torch.Tensor:
        """Send ``[num_in, X]`` rows along ``hop``; ``[num_recv (+1 spare), X]`` out.

        Padding rows carry arbitrary rows of ``rows``: no receiver returns them (the compaction
        skips them, forwarders see ids ``-1`` on them) and combine sends them into dummy rows.
        """
        send = gather_rows(rows, hop.send_index, hop.send_valid, zero_invalid=False)
        self.account(hop.send_splits, send.shape[1] * send.element_size())
        return self.all_to_all(send, hop.send_splits, hop.recv_splits, spare_row=spare_row)

    def run_hop_meta(
        self, hop: Hop, meta: torch.Tensor, *, spare_row: bool = False
    ) -> torch.Tensor:
        """Send ``[num_send, 2k]`` int32 metadata (already in send order) along ``hop``."""
        self.account(hop.send_splits, meta.shape[1] * meta.element_size())
        return self.all_to_all(meta, hop.send_splits, hop.recv_splits, spare_row=spare_row)

    def reduce_hop(self, hop: Hop, back_in: torch.Tensor) -> torch.Tensor:
        """Send ``[num_recv, X]`` rows back along ``hop`` and sum them into ``[num_in, X]``."""
        back = self.all_to_all(back_in, hop.recv_splits, hop.send_splits)
        self.account(hop.recv_splits, back_in.shape[1] * back_in.element_size())
        offsets = [0]
        for n in hop.send_splits:
            offsets.append(offsets[-1] + n)
        out: torch.Tensor | None = None
        width = back.shape[1:]
        # NOTE: dropless hops have no padding, hence no dummy row.
        rows_out = hop.num_in + (hop.send_valid is not None)
        for members in hop.reduce_groups:
            part: torch.Tensor | None = None
            for r in members:
                lo, hi = offsets[r], offsets[r + 1]
                if hi == lo:
                    continue
                if part is None and hop.send_valid is None and hi - lo == hop.num_in:
                    # every input row went to r, in order: its rows are the partial sum already
                    part = back[lo:hi]
                    continue
                if part is None:
                    part = back.new_zeros(rows_out, *width)
                # NOTE: one index_add_ per peer: indices are unique (except the dummy row), so the
                # order of the additions is fixed on every device.
                part.index_add_(0, hop.send_index[lo:hi], back[lo:hi])
            if part is None:
                continue
            out = part if out is None else out.add_(part)
        if out is None:
            return back.new_zeros(hop.num_in, *width)
        return out[: hop.num_in]

    def record_overflow(self, required_w: torch.Tensor) -> None:
        """Remember (on the device) the largest W a worst-case dispatch needed."""
        if self._required_w is None:
            self._required_w = torch.zeros((), dtype=torch.int64, device=required_w.device)
        self._required_w = torch.maximum(self._required_w, required_w)

    def check_overflow(self) -> None:
        if self._required_w is None:
            return
        need = int(self._required_w.item())
        W, R = self.num_worst_tokens, self.num_ranks
        if need > W:
            raise ValueError(
                f"a worst-case dispatch overflowed: it needed num_worst_tokens >= {need} but W={W} "
                f"(R={R}); rows past the cap were dropped: raise DispatchConfig.num_worst_tokens "
                f"to at least {need}"
            )

    # ----------------------------------------------------------------- primitives
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        from flexdispatch.backends import torch_hier  # local: torch_hier imports this module

        T, H = x.shape
        k = topk_idx.shape[1]
        R, e = self.num_ranks, self.num_local_experts
        if layout is not None:
            mask_TR = layout.is_token_in_rank
        else:
            # NOTE: ids outside [0, E) count as -1, as in get_dispatch_layout (never an OOB index).
            valid_TK = (topk_idx >= 0) & (topk_idx < self.num_experts)
            rank_TK = torch.where(valid_TK, topk_idx // e, R)
            mask_TR = torch.zeros(T, R + 1, dtype=torch.bool, device=x.device)
            mask_TR.scatter_(1, rank_TK, True)
            mask_TR = mask_TR[:, :R]
        G = self.exchange_counts(mask_TR, H, k, x.dtype)
        pending = self.start_host_counts(G)
        plan = torch_hier.dispatch_hier if self.hierarchical else dispatch_flat
        result = plan(self, x, topk_idx, topk_probs, mask_TR, G, pending)
        self.stats.rows_received += result.recv_x.shape[0]
        return result

    def start_host_counts(self, G: torch.Tensor) -> PendingCounts | None:
        """Start the host copy of ``G`` that this mode needs, or return None (no copy at all).

        Dropless: the one host sync of the dispatch. Worst-case on CPU: read directly (no device
        to wait for, not a sync). Worst-case on CUDA: only with checks enabled and not capturing
        (counted in ``stats.extra["check_syncs"]``, never in ``host_syncs``).
        """
        if not self.worst_case:
            return PendingCounts(self, G, counter="host_syncs")
        if not G.is_cuda:
            return PendingCounts(self, G, counter=None)
        if checks_enabled(self.checks) and not is_capturing():
            return PendingCounts(self, G, counter="check_syncs")
        return None

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        state: TorchDispatchState = handle.state
        rows = y
        if state.in_index is not None:
            # NOTE: buffer rows that were never returned (padding) get arbitrary rows of y; they
            # travel back into the senders' dummy rows, which are cut off.
            rows = y.index_select(0, state.in_index)
        for hop in reversed(state.hops):
            rows = self.reduce_hop(hop, rows)
        return rows

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        state: TorchDispatchState = handle.state
        rows = x
        last = len(state.hops) - 1
        for i, hop in enumerate(state.hops):
            spare = i == last and state.out_index is not None
            rows = self.run_hop_rows(hop, rows, spare_row=spare)
        if state.out_index is not None:
            rows = rows.index_select(0, state.out_index)
        return rows


def dispatch_flat(
    be: TorchA2ABackend,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    mask_TR: torch.Tensor,
    G: torch.Tensor,
    pending: PendingCounts | None,
) -> DispatchResult:
    """One hop straight to the ranks that hold the experts (see the module docstring)."""
    T, H = x.shape
    k = topk_idx.shape[1]
    R, e, me, W = be.num_ranks, be.num_local_experts, be.rank, be.num_worst_tokens
    device = x.device
    cap = W // R if be.worst_case else None
    send_index, send_valid = slot_positions(mask_TR, cap)
    Gh = pending.wait() if pending is not None else None
    if cap is not None:
        if Gh is not None:
            worst = max((Gh[s][g], s, g) for s in range(R) for g in range(R))
            if worst[0] > cap:
                what = f"rank {worst[1]} sending to rank {worst[2]}"
                raise ValueError(overflow_message(what, worst[0], cap, W, R, R))
        else:
            be.record_overflow(round_up(G[:, :R].max() * R, R))
        send_splits = recv_splits = (cap,) * R
        dest_S = torch.arange(cap * R, device=device) // cap
    else:
        if Gh is None:
            raise RuntimeError("internal error: dropless dispatch without host counts")
        send_splits = tuple(Gh[me][:R])
        recv_splits = tuple(Gh[s][me] for s in range(R))
        send_index = send_index[: sum(send_splits)]
        dest_S = split_owner(mask_TR.sum(0), sum(send_splits))
    ids_SK = gather_rows(topk_idx, send_index, send_valid)
    probs_SK = gather_rows(topk_probs, send_index, send_valid)
    ids_SK, probs_SK = localize(ids_SK, probs_SK, dest_S * e, e, send_valid)
    hop = Hop(
        send_index=send_index,
        send_valid=send_valid,
        send_splits=send_splits,
        recv_splits=recv_splits,
        num_in=T,
        reduce_groups=be.node_groups(),
    )
    be.stats.rows_sent += hop.num_send
    spare = cap is not None
    recv_x = be.run_hop_rows(hop, x, spare_row=spare)
    recv_meta = be.run_hop_meta(hop, pack_meta(ids_SK, probs_SK), spare_row=spare)
    maps = None
    if cap is not None:
        sizes = G[:, me].clamp(max=cap).to(device)
        starts = torch.arange(R, device=device, dtype=torch.int64) * cap
        maps = compaction(sizes, starts, W, W)
    return finish(be, hop_list=(hop,), recv_x=recv_x, recv_meta=recv_meta, maps=maps, T=T, H=H, k=k)


def finish(
    be: TorchA2ABackend,
    *,
    hop_list: tuple[Hop, ...],
    recv_x: torch.Tensor,
    recv_meta: torch.Tensor,
    maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    T: int,
    H: int,
    k: int,
) -> DispatchResult:
    """Apply the output compaction (if any) and build the result and its handle.

    With ``maps``, ``recv_x`` / ``recv_meta`` carry the zero spare row (``spare_row=True``).
    """
    out_index = out_valid = in_index = None
    if maps is not None:
        out_index, out_valid, in_index, _ = maps
        num_out = out_index.shape[0]
        in_index = in_index.clamp(max=max(num_out - 1, 0))
        recv_x = recv_x.index_select(0, out_index)
        recv_meta = recv_meta.index_select(0, out_index)
    ids, probs = unpack_meta(recv_meta, k)
    if out_valid is not None:
        ids.masked_fill_(~out_valid[:, None], -1)
    state = TorchDispatchState(
        hops=hop_list,
        out_index=out_index,
        out_valid=out_valid,
        in_index=in_index,
        worst_case=be.worst_case,
    )
    handle = DispatchHandle(
        backend="torch", num_tokens=T, hidden=H, num_recv_rows=recv_x.shape[0], state=state
    )
    return DispatchResult(
        recv_x=recv_x,
        recv_topk_idx=ids,
        recv_topk_probs=probs,
        num_recv_tokens_per_expert=count_local(ids, be.num_local_experts),
        handle=handle,
    )
