"""The ``torch`` backend: dispatch and combine over ``torch.distributed.all_to_all_single``.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · S rows one rank sends in one hop · P peers one hop sends to · X any row width.

How a dispatch runs (works on gloo and NCCL):

- Flat across ranks (the decode path): planned once per call shape (``plan.py``, issue 46):
  worst-case one ``all_to_all_single`` each way, the counts in band (the count exchange only at
  the first call of a row shape, for the agreement); dropless the count exchange plus one each
  way, rows and metadata in one collective while the call is small. No value check with checks
  off; one error boundary per call.
- Hierarchical mode, and a world of one (no group, or a group of one rank), dispatch in *hops*:

1. Count exchange: one ``all_gather_into_tensor`` of a ``[2R + N + 4]`` int64 vector per rank
   (rows for every rank, rows for every node (hierarchical mode; zeros in flat mode), H, k, dtype
   code, T, pairs for every rank). Every rank then holds the ``[R, 2R + N + 4]`` matrix ``G``
   and can raise the same error on every rank: mismatching H / k / dtype, or a worst-case
   overflow. A world of one counts locally.
2. Dropless mode copies ``G`` to the host once (``stats.host_syncs += 1``); on CUDA that copy is
   issued on a side stream into pinned memory right after the exchange and waited on just before
   the rows move. Worst-case mode never reads it on CUDA (only with checks enabled; counted in
   ``stats.extra["check_syncs"]``); on CPU it is read directly (no device to sync with).
3. One *hop* = one ``all_to_all_single`` of the rows plus one of an int32 ``[S, 2k]`` metadata
   block (``topk_idx`` as int32 beside the fp32 bits of the probs). Rows keep their dtype.
   Hierarchical mode is two hops (see ``hier.py``), on the dispatcher's own group: ranks outside
   a hop get zero-sized splits, so no sub-groups exist.
4. Worst-case mode pads every hop to ``cap`` rows per peer on the device (``W / N`` and ``W / L``)
   and compacts the received rows on the device so the real rows come first, in (source rank,
   source token) order; the tail is zero / ``-1`` / 0.

Combine sends the rows back along the same hops and sums them per token. The sum runs in a fixed
order — first over the ranks of each node (in rank order), then over nodes — so flat and
hierarchical combine give bit-identical results, and every ``index_add_`` has unique indices
(deterministic on CUDA too). Every node's sum starts from zeros, on every device (``0 + a == a``
up to the sign of a zero, the same in every mode); on CPU this rank's own rows are added while
the peers' rows are still travelling. The first two terms may swap (``a + b == b + a`` exactly),
so that this rank's own rows are added straight from where they lie.

In a hop, rows a rank sends to itself skip the collective (split 0 to itself) whenever they sit
at one end of both buffers: on CPU dispatch gathers them straight into the receive buffer while
the peers' rows travel (``async_op``; on CUDA, where the collective is issued synchronously and
nothing would overlap, they go through it: one gather instead of two), and combine reads them
from the rows it was given. This changes no byte on the wire. The metadata carries global expert
ids and each receiver keeps its own (one offset, ``rank * e``).

On CPU, buffers that never leave a call (send buffers, padded receive buffers, returning rows)
are kept per backend (``buffers.RowBuffers.scratch``) or per plan and reused: fresh buffers over
32 MiB are page-faulted on every call. Tensors handed to the caller come from
``_pool.OUTPUT_POOL``, which lends an earlier output's memory again only once nothing refers to
it any more.

The code is split by concern: this module holds the backend class (counts, combine, stats);
``hop_io.py`` the hop collectives (rows and metadata out and back, bytes accounted); ``plan.py``
the flat dispatch across ranks; ``flat.py`` the flat dispatch of a world of one; ``hier.py`` the
hierarchical one; ``buffers.py`` the reusable row buffers; ``hops.py`` what the hop dispatches
share (``Hop``, the dispatch state, the host count copy and the row plumbing that finishes a
dispatch); ``rows.py`` the row and metadata kernels.

A peer that fails, exits or times out turns into a ``flexdispatch.distributed.CollectiveError``
on this rank, naming the collective: a planned call names the one in flight (``in_flight``) at
its one error boundary, a hop runs each collective inside ``collective_guard``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch import _pool
from flexdispatch._checks.tensors import checks_flag, cuda_code_path, is_capturing
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import (
    DTYPE_CODES,
    check_agreement,
    exchange_counts,
    recv_pairs,
)
from flexdispatch.backends.torch import hier as torch_hier
from flexdispatch.backends.torch.buffers import RowBuffers
from flexdispatch.backends.torch.flat import dispatch_flat
from flexdispatch.backends.torch.hop_io import HopCollectives
from flexdispatch.backends.torch.hops import Hop, PendingCounts, TorchDispatchState
from flexdispatch.backends.torch.plan import FlatPlan, FlatState
from flexdispatch.backends.torch.reduce import reduce_compacted
from flexdispatch.backends.torch.rows import (
    _bin_counts,
    clamp_ids,
    local_lut,
    overflow_message,
    rank_lut,
)
from flexdispatch.distributed import CollectiveError, collective_error
from flexdispatch.types import DispatchHandle, DispatchLayout, DispatchResult

__all__ = ["TorchA2ABackend", "TorchDispatchState", "Hop", "DTYPE_CODES"]


class TorchA2ABackend(DispatchBackend, RowBuffers, HopCollectives):
    """Dispatch/combine over ``all_to_all_single`` (flat or hierarchical, dropless or worst-case).

    Args:
        group: the process group (None = WORLD, or a world of one without torch.distributed).
        num_experts: E, divisible by R.
        ranks_per_node: L, dividing R.
        num_worst_tokens: W (0 = dropless); must be a multiple of R.
        hierarchical: two hops (across nodes, then inside the node) instead of one.
        checks: value checks (host syncs on CUDA; None: ``FLEXDISPATCH_CHECKS``, read once here).
        stats: counters to add to (shared with the dispatcher).
    """

    name = "torch"
    counts_bad_ids = True
    """``dispatch`` sends the ids outside ``[-1, E)`` nowhere (``rows.clamp_ids`` and the rank
    table's spare rank) and, with checks off, counts them into ``bad_ids`` (from the pair counts,
    plus one ``aminmax`` for the lowest and highest id)."""

    def __init__(self, group: dist.ProcessGroup | None, **common: Any) -> None:
        super().__init__(group, **common)
        self.pinned_counts: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.checks_flag = checks_flag(self.checks)  # NOTE: the environment, read once
        self.bad_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # NOTE: whether rows go through collectives; a group of one rank moves them as no group
        # does (it receives what it sends). Fixed with R, read once (hot path). Set True on a
        # group of one, it runs the collective paths of R ranks with R = 1 (the GPU tests do, to
        # put NCCL's collectives under a CUDA graph on one GPU).
        self.distributed = self.num_ranks > 1
        self._required_w: torch.Tensor | None = None
        self._overflow_scale = 1  # ``record_overflow``
        RowBuffers.__init__(self)  # NOTE: reusable CPU buffers (``scratch``, ``output``)
        self._luts: dict[torch.device, torch.Tensor] = {}
        # NOTE: row shapes (H, k, dtype) the count exchange found equal on every rank (plan.py)
        self.agreed_shapes: set[tuple[int, int, torch.dtype]] = set()
        # NOTE: the flat plans across ranks, by (T, H, k, dtype, device, checks) (plan.py)
        self._plans: dict[tuple, FlatPlan] = {}
        self._inband_acc: torch.Tensor | None = None  # ``inband_worst``
        self.in_flight: str | None = None  # the collective a planned call is in (``_failed``)
        ok, reason = self.supports_world(self.num_ranks, self.ranks_per_node)
        if not ok:
            raise ValueError(reason)
        R, W, num_experts = self.num_ranks, self.num_worst_tokens, self.num_experts
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
    def checks_now(self, device: torch.device) -> bool:
        """Whether this dispatch checks values (``checks`` resolved once; never while a CUDA
        graph is being captured)."""
        return self.checks_flag and not (device.type == "cuda" and is_capturing())

    def count_bad_ids(
        self, count: torch.Tensor, topk_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``bad_ids`` of a dispatch: ``count`` (the pair counts' spare-rank bin) with the
        lowest and highest id (one ``aminmax``; ``count`` itself, 0, when there is none)."""
        if not topk_idx.numel():
            return count, count, count
        lowest, highest = torch.aminmax(topk_idx)
        return count, lowest, highest

    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_groups(self) -> tuple[tuple[int, ...], ...]:
        L = self.ranks_per_node
        return tuple(tuple(range(n * L, (n + 1) * L)) for n in range(self.num_nodes))

    def exchange_counts(
        self,
        mask_TR: torch.Tensor,
        hidden: int,
        topk: int,
        dtype: torch.dtype,
        pairs_R: torch.Tensor,
    ) -> torch.Tensor:
        """The count exchange (``counts.exchange_counts``) over this backend's group."""
        return exchange_counts(
            mask_TR,
            hidden=hidden,
            topk=topk,
            dtype=dtype,
            ranks_per_node=self.ranks_per_node,
            group=self.group,
            pairs_R=pairs_R,
            per_node=self.hierarchical,  # NOTE: only the hierarchical plan reads them
        )

    def check_agreement(self, Gh: list[list[int]]) -> None:
        """Raise on every rank when H, k or the dtype differ across ranks."""
        check_agreement(Gh, num_ranks=self.num_ranks, num_nodes=self.num_nodes)

    def rank_lut(self, device: torch.device) -> torch.Tensor:
        """``torch_rows.rank_lut`` of this group, built once per device (read-only)."""
        e, E = self.num_local_experts, self.num_experts
        return _pool.cached(("rank_lut", e, E), device, lambda: rank_lut(e, E, device))

    def local_lut(self, device: torch.device) -> torch.Tensor:
        """``torch_rows.local_lut`` of this rank's experts, built once per device (read-only)."""
        lut = self._luts.get(device)
        if lut is None:
            lut = local_lut(
                self.rank * self.num_local_experts, self.num_local_experts, self.num_experts, device
            )
            if not is_capturing():  # NOTE: made inside a capture it holds values only on replay
                self._luts[device] = lut
        return lut

    def record_overflow(self, required_w: torch.Tensor, scale: int = 1) -> None:
        """Remember (on the device) the largest W a worst-case dispatch needed: ``scale *
        required_w`` (the multiplication waits for the check; one backend always passes the same
        ``scale``)."""
        self._overflow_scale = scale
        if self._required_w is None:
            self._required_w = torch.zeros((), dtype=torch.int64, device=required_w.device)
        self._required_w = torch.maximum(self._required_w, required_w)

    def inband_worst(self, device: torch.device) -> torch.Tensor:
        """The ``[R]`` int32 device record of the largest worst count each rank sent in band
        (``count * R + destination``; ``FlatPlan``, checks off), made once."""
        acc = self._inband_acc
        if acc is None:
            with torch.inference_mode(False):  # NOTE: written in place by later calls
                acc = torch.zeros(self.num_ranks, dtype=torch.int32, device=device)
            self._inband_acc = acc
        return acc

    def raise_inband_overflow(self, worst_R: list[int]) -> None:
        """Raise the overflow that the worst counts of every rank (``count * R + destination``,
        host ints) show, naming the sender, the destination and the fix; the same on every
        rank."""
        R, W = self.num_ranks, self.num_worst_tokens
        cap = W // R
        n, s, g = max((v // R, s, v % R) for s, v in enumerate(worst_R))
        if n > cap:
            raise ValueError(overflow_message(f"rank {s} sending to rank {g}", n, cap, W, R, R))

    def check_overflow(self) -> None:
        if self._required_w is not None:
            need = int(self._required_w.item()) * self._overflow_scale
            W, R = self.num_worst_tokens, self.num_ranks
            if need > W:
                raise ValueError(
                    f"a worst-case dispatch overflowed: it needed num_worst_tokens >= {need} but "
                    f"W={W} (R={R}); rows past the cap were dropped: raise "
                    f"DispatchConfig.num_worst_tokens to at least {need}"
                )
        if self._inband_acc is not None:  # NOTE: one read: every rank holds every rank's
            self.raise_inband_overflow(self._inband_acc.tolist())

    # ----------------------------------------------------------------- primitives
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        if self.distributed and not self.hierarchical:  # NOTE: the plan of this shape (plan.py)
            plans = self._plans
            checks = self.checks_flag and not (x.is_cuda and is_capturing())
            key = (x.shape[0], x.shape[1], topk_idx.shape[1], x.dtype, x.device, checks)
            plan = plans.get(key)
            if plan is None:
                plan = self._new_plan(key)
            mask_TR = None if layout is None else layout.is_token_in_rank
            try:
                return plan.dispatch(x, topk_idx, topk_probs, mask_TR)
            except RuntimeError as exc:
                raise self._failed(exc)  # noqa: B904 - chained there
        return self._dispatch_hops(x, topk_idx, topk_probs, layout)

    def _new_plan(self, key: tuple) -> FlatPlan:
        """Plan the calls of ``key`` (kept, at most 16 keys, unless a CUDA graph is being
        captured: tables made there hold values only on replay)."""
        with torch.inference_mode(False):  # NOTE: its buffers are written in place later
            plan = FlatPlan(self, *key)
        plans = self._plans
        if not is_capturing():
            if len(plans) >= 16:
                del plans[next(iter(plans))]
            plans[key] = plan
        return plan

    def _planned(
        self,
        run: Callable[[torch.Tensor, FlatState], torch.Tensor],
        rows: torch.Tensor,
        state: FlatState,
    ) -> torch.Tensor:
        """``run(rows, state)`` (a plan's combine or cached dispatch) inside the call's one error
        boundary (``_failed``)."""
        try:
            return run(rows, state)
        except RuntimeError as exc:
            raise self._failed(exc)  # noqa: B904 - chained there

    def _failed(self, exc: RuntimeError) -> RuntimeError:
        """The error to raise for ``exc`` in a planned call (one error boundary per call): a
        ``CollectiveError`` naming the collective in flight when it raised, chained to ``exc``;
        else ``exc`` itself (an op's error, or a ``CollectiveError`` already)."""
        what, self.in_flight = self.in_flight, None
        if what is None or isinstance(exc, CollectiveError):
            return exc
        err = collective_error(what, self.group, exc)
        if err is None:
            return exc
        err.__cause__ = exc
        return err

    def _dispatch_hops(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None,
    ) -> DispatchResult:
        """A dispatch in hops: hierarchical, or in a world of one."""
        T, H = x.shape
        k = topk_idx.shape[1]
        R = self.num_ranks
        # NOTE: ids outside [-1, E) count as -1, as in get_dispatch_layout (never an OOB index):
        # clamped to -2 or E, they land on the spare rank R (-1 on R + 1), so the pair counts
        # count them too (``bad_ids``, checks off). With checks on the dispatcher raised for
        # them: nothing to clamp or count.
        dev = x.device
        unchecked = not self.checks_now(dev)
        count_bad = unchecked and self.counts_bad_ids
        key_TK = clamp_ids(topk_idx, self.num_experts) if unchecked else topk_idx
        rank_TK = self.rank_lut(x.device)[key_TK]
        if layout is not None:
            mask_TR = layout.is_token_in_rank
        else:
            mask_TR = torch.zeros(T, R + 2, dtype=torch.bool, device=x.device)
            mask_TR.scatter_(1, rank_TK, True)
            mask_TR = mask_TR[:, :R]
        # NOTE: the pair counts serve the bad ids and a dropless receiver only (``recv_pairs``);
        # a worst-case exchange sends zeros in their place (no launch)
        pairs_R2 = None
        if count_bad or not self.worst_case:
            pairs_R2 = _bin_counts(rank_TK.view(-1), R + 2)
        self.bad_ids = self.count_bad_ids(pairs_R2[R], topk_idx) if count_bad else None
        zeros_R = None if pairs_R2 is not None else _pool.scalar(0, torch.int64, dev).expand(R)
        pairs_R = pairs_R2[:R] if pairs_R2 is not None else zeros_R
        G = self.exchange_counts(mask_TR, H, k, x.dtype, pairs_R)
        pending = self.start_host_counts(G)
        plan = torch_hier.dispatch_hier if self.hierarchical else dispatch_flat
        result = plan(self, x, key_TK, topk_probs, mask_TR, G, pending)
        self.stats.rows_received += result.recv_x.shape[0]
        if not self.worst_case and pending is not None:
            Gh = pending.wait()  # NOTE: already on the host (the dispatch's one sync)
            pairs = recv_pairs(Gh, rank=self.rank, num_ranks=R, num_nodes=self.num_nodes)
            result = dataclasses.replace(result, num_recv_pairs=pairs)
        return result

    def start_host_counts(self, G: torch.Tensor) -> PendingCounts | None:
        """Start the host copy of ``G`` that this mode needs, or return None (no copy at all).

        Dropless: the one host sync of the dispatch. Worst-case on CPU: read directly (no device
        to wait for, not a sync). Worst-case on CUDA: only with checks enabled and not capturing
        (counted in ``stats.extra["check_syncs"]``, never in ``host_syncs``).
        """
        if not self.worst_case:
            return PendingCounts(self, G, counter="host_syncs")
        if not cuda_code_path(G.device):
            return PendingCounts(self, G, counter=None)
        if self.checks_now(G.device):
            return PendingCounts(self, G, counter="check_syncs")
        return None

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        state = handle.state
        if type(state) is FlatState:
            return self._planned(state.plan.combine, y, state)
        rows = y
        one = not self.distributed and not self.hierarchical and len(state.hops) == 1
        one = one and state.out_index is not None
        if one and cuda_code_path(y.device):  # NOTE: no inverse gather (``reduce_compacted``)
            return reduce_compacted(self, state.hops[0], y, state.out_index)
        if state.in_index is not None:
            # NOTE: buffer rows that were never returned (padding) get arbitrary rows of y; they
            # travel back into the senders' dummy rows, which are cut off.
            if cuda_code_path(y.device):  # NOTE: scratch is torch.empty there
                rows = y.index_select(0, state.in_index)
            else:
                rows = self.scratch(
                    "combine", (state.in_index.shape[0], *y.shape[1:]), y.dtype, y.device
                )
                torch.index_select(y, 0, state.in_index, out=rows)
        for hop in reversed(state.hops):
            rows = self.reduce_hop(hop, rows)
        return rows

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        state = handle.state
        if type(state) is FlatState:
            return self._planned(state.plan.cached_dispatch, x, state)
        rows = x
        last = len(state.hops) - 1
        for i, hop in enumerate(state.hops):
            spare = i == last and state.out_index is not None
            internal = i < last or spare
            key = f"recv{i}" if internal else None
            rows = self.run_hop_rows(hop, rows, spare_row=spare, scratch_key=key)
        if state.out_index is not None:
            out = self.output((state.out_index.shape[0], *rows.shape[1:]), rows.dtype, rows.device)
            rows = torch.index_select(rows, 0, state.out_index, out=out)
        return rows
