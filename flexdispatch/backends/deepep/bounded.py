"""What DeepEP V2 (``ElasticBuffer``) and DeepEP 2.5 (``EPBuffer``) have in common: a per-rank
token bound, a receive order to restore, and a bf16 combine with an fp32 weights channel.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · W worst-case rows · M = ``max_tokens``, the tokens a rank may
send in one call · n rows DeepEP returns (``R * num_max_tokens_per_rank`` in worst-case mode) · X
any row width · N expanded rows.

Both releases size their buffer, and compile or lay out their kernels, for a static bound on the
tokens each rank sends (``num_max_tokens_per_rank``), so ``BoundedBackend`` keeps it:

- **Dropless**: every token is sent, under one bound M on every rank (DeepEP's receive slots are
  ``rank * M + token``). The ranks agree with one all-gather of five ints on the group itself,
  started before the dispatch and read after DeepEP's own CPU wait (``agreement.Agreement``: no
  host sync of its own, no side group). A rank over M sends its first M tokens, so DeepEP's
  collective completes everywhere; then every rank sees the largest T, raises M at this same call
  (``_grow_bound``; the shared buffer grows with it, once every rank agreed it fits) and
  dispatches again with every token (``stats.extra["deepep_bound_retries"]``): nothing lost, no
  rank waiting alone. The first dispatch of each row shape reads the same all-gather before the
  dispatch instead (agreed once per shape: a row refusal can hold on one rank's device only, and
  that rank must not leave its peers inside DeepEP), and M grows first; with checks on every
  dispatch reads it before (its errors raised before any row moves, every rank's values named:
  ``counts.check_token_rows``). One host sync otherwise: DeepEP's CPU wait for the receive counts.
  Not capturable.
- **Worst-case** (``W``, a multiple of R): a rank may send at most ``M = W / R`` tokens (its receive
  slots on every rank). With checks on, the same agreement makes every rank raise for the worst
  rank; with checks off a rank over M sends its first M tokens (the others combine to zero) and
  ``check_overflow`` raises: raising on that rank alone would leave its peers inside DeepEP's
  collective until its GPU timeout.
- **Order**: DeepEP fills a sender's receive slots in ``atomicAdd`` order, not token order;
  ``token_order`` sorts them back (``recv_src_metadata[:, 0] = src_rank * M + token``, the sort
  DeepEP's own ``deterministic=True`` does, without its host-syncing boolean indexing); rows past
  the real ones (worst-case tails, uninitialised) sort last and are masked (zero / -1 / 0) on the
  device.
- **Combine**: DeepEP sums unweighted in bf16 (rows padded to ``COMBINE_COLS`` columns). Narrow
  fp32 / fp16 rows (at most 32 columns: the probs gradient) are summed exactly in fp32 through
  combine's ``topk_weights`` channel, which returns, in each slot of a source token, the value
  the rank owning the slot's expert sent: each rank puts column ``c`` in its first local slot
  (expanded: each row is one slot), one combine per column. The dispatch's backward carries the
  probs in that channel beside the rows (one combine); ``dispatch_expanded``'s backward the rows'
  weights.

A subclass provides its buffer (``_shared``), its launch (``dispatch`` / ``dispatch_expanded`` hand
what DeepEP returned to ``_received`` / ``_received_expanded``), its cached dispatch, its messages
and its combine call: ``_combine_call(part, state, weights=None, bias=None) -> (out, out_weights)``,
one DeepEP combine of ``part`` (bf16, DeepEP's rows, a ``COMBINE_COLS`` multiple of columns) with
the fp32 ``weights`` channel and a ``[T', X']`` bias, for the T' tokens the dispatch sent
(``out_weights`` ``[T', k]``, None without weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import checks_flag, is_capturing
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import check_token_rows
from flexdispatch.backends.deepep import sizing
from flexdispatch.backends.deepep.agreement import Agreement, pinned_buffers
from flexdispatch.backends.deepep.buffer import BoundedSize
from flexdispatch.backends.deepep.counters import TrafficCounters
from flexdispatch.distributed import collective_device, group_size, is_distributed
from flexdispatch.types import (
    DispatchHandle,
    DispatchResult,
    ExpandedDispatchResult,
)

__all__ = [
    "COMBINE_COLS",
    "BoundedBackend",
    "BoundedState",
    "Launch",
    "sent_tokens",
    "token_order",
]

COMBINE_COLS = 256  # combine hidden % 256 (V2 impls/combine.cuh:109, V2.5 ep/combine.cuh:110)
_NARROW = sizing.MAX_TOPK  # fp32 / fp16 rows this narrow are summed exactly


def token_order(handle: Any, rows: int, used: torch.Tensor | None, keep: int) -> torch.Tensor:
    """``[keep]`` DeepEP rows in (source rank, source token) order: DeepEP's receive order sorted
    by ``recv_src_metadata[:, 0]``; rows past ``used`` (worst-case tails, uninitialised) sort last,
    so the first ``keep >= used`` rows are the real ones in order, then tails."""
    key = handle.recv_src_metadata[:rows, 0]
    if used is not None:
        live = torch.arange(rows, device=key.device) < used
        key = torch.where(live, key, torch.iinfo(key.dtype).max)
    return torch.argsort(key)[:keep]


@dataclass(frozen=True, kw_only=True)
class BoundedState:
    """The V2 / V2.5 part of a ``DispatchHandle``.

    Attributes:
        handle: DeepEP's ``EPHandle``.
        wire: the wire format of the dispatched rows.
        topk: k.
        sms: the SM count of the dispatch (its combine and cached dispatch reuse it).
        rows: n, the rows DeepEP returned.
        order: ``[W or n]`` int64, DeepEP's row of each returned row (``dispatch``), else None.
        local: ``[W or n, k]`` bool, the slots holding a local expert (``dispatch``), else None.
        valid: ``[rows returned]`` bool, the real rows (worst-case), else None.
        recv_scales: ``[rows, H / 128]`` float32 scales of an fp8 dispatch, else None.
        traffic: what the backend needs to count a combine's bytes (V2.5: ``[3]`` int64 rows of
            the dispatch on the device), or None.
    """

    handle: Any
    wire: sizing.WireFormat
    topk: int
    sms: int
    rows: int
    order: torch.Tensor | None
    local: torch.Tensor | None
    valid: torch.Tensor | None
    recv_scales: torch.Tensor | None
    traffic: Any = None

    def to_deepep(self, y: torch.Tensor) -> torch.Tensor:
        """Rows in the contract's order back to DeepEP's rows (``y[i]`` was its row
        ``order[i]``; DeepEP's rows past the returned ones are zero)."""
        if self.order is None:
            return y
        shape = (self.rows, *y.shape[1:])
        make = torch.empty if self.order.numel() == self.rows else torch.zeros
        return make(shape, dtype=y.dtype, device=y.device).index_copy_(0, self.order, y)


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What one V2 / V2.5 dispatch launched, for building its result.

    Attributes:
        wire: the wire format of its rows; ``fp8``: an ``(x, scales)`` tuple was sent.
        T: tokens of the caller (more than the dispatch sent when a rank was over M); X: width.
        k: top-k; sms: the SM count it ran on.
        traffic: what the backend counts its combines' bytes with (V2.5), or None.
        agreement: a deferred dropless dispatch's agreement, read when it is finished
            (``BoundedBackend._agreed``), and ``again`` its inputs, dispatched again when a rank
            was over the bound; else None.
    """

    wire: sizing.WireFormat
    fp8: bool
    T: int
    X: int
    k: int
    sms: int
    traffic: Any = None
    agreement: Any = None
    again: Any = None

    def handle(self, rows: int, state: BoundedState) -> DispatchHandle:
        return DispatchHandle(
            backend="deepep", num_tokens=self.T, hidden=self.X, num_recv_rows=rows, state=state
        )


def sent_tokens(state: BoundedState) -> int:
    """Tokens the dispatch behind ``state`` sent (fewer than T when a rank was over its bound)."""
    return int(state.handle.topk_idx.shape[0])


class BoundedBackend(DispatchBackend):
    """The part of ``DeepEPV2Backend`` and ``DeepEPV25Backend`` that is the same (module
    docstring): the token bound, the shared buffer's growth, the receive order, the combine
    family and the statistics.

    Attributes:
        max_tokens: M, the tokens a rank may send in one call (``W / R``, or the dropless bound).
        num_max_tokens_per_rank: the bound DeepEP is given (V2.5: M as a compiled bucket).
    """

    name = "deepep"
    config_fields = {  # noqa: RUF012
        "num_sms": "deepep_num_sms",
        "num_max_tokens_per_rank": "num_max_dispatch_tokens_per_rank",
    }
    release = ""  # NOTE: the subclass's name in messages ("DeepEP V2", "DeepEP 2.5")
    max_tokens: int
    num_max_tokens_per_rank: int
    expert_alignment: int = 1

    def _setup(self, module: Any, *, max_tokens: int) -> None:
        """The fields every bounded backend has (``DispatchBackend``'s set, its own checks
        run)."""
        self.group = self.group if self.group is not None else dist.group.WORLD
        self.deep_ep = module
        self.topk_idx_dtype: torch.dtype = getattr(module, "topk_idx_t", torch.int64)
        self.max_tokens = max_tokens
        self.num_max_tokens_per_rank = self._compiled_bound(max_tokens)
        self._counters = TrafficCounters(collective_device(self.group))  # no host read in calls
        self._need_tokens = 0  # most tokens a rank had to dispatch, when over M (checks off)
        self._peak_tokens = 0  # dropless: the largest T the ranks agreed on so far
        self._grown_from: tuple[int, int] | None = None  # the bound before a growth not yet built
        self._pinned = pinned_buffers(collective_device(self.group))  # the agreement's, on CUDA
        self._agreed_shapes: set[tuple] = set()  # dropless row shapes whose refusals were agreed
        self._closed = False
        # NOTE: the decode path's per-call constants (issue 46): the environment's checks flag
        # read once (as the dispatcher does), the mode, e, and the buffer sizes that the shared
        # buffer's current build covers (``_buffer``)
        self._checks_flag = checks_flag(self.checks)
        self._worst = self.num_worst_tokens > 0
        self._local_experts = self.num_local_experts
        self._sized: dict[tuple[int, int, int], int] = {}
        self._device = collective_device(self.group)  # NOTE: the agreement's group facts
        self._group_size = group_size(self.group) if is_distributed(self.group) else 1

    # ----------------------------------------------------------------- what a subclass gives
    def _compiled_bound(self, tokens: int) -> int:
        """``num_max_tokens_per_rank`` for a bound of ``tokens``."""
        return tokens

    def _grown(self, need: int) -> tuple[int, int]:
        """``(max_tokens, num_max_tokens_per_rank)`` once the agreed largest T is ``need``."""
        raise NotImplementedError

    def _tokens_message(self, rank: int | str, T: int) -> str:
        """Why rank ``rank`` may not dispatch ``T`` tokens (over M)."""
        raise NotImplementedError

    def _combine_rows(self, y: torch.Tensor, state: BoundedState) -> torch.Tensor:
        """``y`` as DeepEP's combine input: bf16, DeepEP's row order, columns padded."""
        yd = state.to_deepep(y)
        yb = yd if yd.dtype == torch.bfloat16 else yd.to(torch.bfloat16)
        return sizing.pad_cols(yb, COMBINE_COLS)

    # ----------------------------------------------------------------- capabilities
    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    def supports_cuda_graph(self) -> Capability:
        if not self.worst_case:
            return False, (
                f"{self.release}'s dropless dispatch waits on the CPU for the receive counts: set "
                f"num_worst_tokens for a capturable dispatch"
            )
        return True, f"deepep {self.api} worst-case dispatch: static shapes, no host sync"

    def supports_expanded(self) -> Capability:
        return True, f"deepep {self.api}: do_expand=True, rows grouped by local expert"

    def flush_stats(self) -> None:
        """Add the traffic counted so far to ``stats`` (the safe point: one host read on CUDA)."""
        self._counters.drain(self._stats)

    # ----------------------------------------------------------------- the token bound
    def _buffer(self, hidden: int, topk: int) -> Any:
        """The shared buffer, grown (collectively) for M tokens of ``hidden`` bf16 columns."""
        shared = self._shared
        key = (self.num_max_tokens_per_rank, hidden, topk)
        if (
            self._sized.get(key) == shared.allocations
            and shared.buffer is not None
            and not self._closed
        ):
            # NOTE: this build of the shared buffer covered this size already (sizes only grow
            # while it lives): what ``ensure`` would answer, without rebuilding the size
            shared.settle()
            self._grown_from = None
            return shared.buffer
        if self._closed:
            raise RuntimeError("this deepep backend was closed")
        before = self._shared.allocations
        size = BoundedSize(self.num_max_tokens_per_rank, hidden, max(topk, 1))
        try:
            buffer = self._shared.ensure(
                size, tokens=self._peak_tokens, worst=self.num_worst_tokens
            )
        except ValueError:  # NOTE: it does not fit on some rank: every rank keeps its old bound
            if self._grown_from is not None:
                self.max_tokens, self.num_max_tokens_per_rank = self._grown_from
            self._grown_from = None
            raise
        self._grown_from = None
        if self._shared.allocations != before:
            extra = self._stats.extra
            extra["deepep_buffer_allocations"] = extra.get("deepep_buffer_allocations", 0) + 1
        if len(self._sized) >= 64:
            self._sized.clear()
        self._sized[key] = self._shared.allocations
        return buffer

    def _check_tokens(
        self, T: int, shape: tuple, refusal: str | None = None
    ) -> tuple[int, Agreement | None]:
        """The tokens this rank sends now (module docstring), and the dropless agreement to read
        after the dispatch (``_agreed``), or None: ``shape`` = ``(X, k, dtype)``, ``refusal``
        why the release cannot run them here (or None).

        Every rank issues the same all-gather at the same point whatever its ``checks``
        setting; it is read before the dispatch with checks on, in worst-case mode with checks
        on, and at the first dropless dispatch of a row shape (agreed once per shape: a refusal
        can hold on one rank's device only, which must not leave its peers inside DeepEP); M
        grows before a dispatch only then, else after it, alike on every rank."""
        M, R = self.max_tokens, self.num_ranks
        checks = self._checks_flag and not is_capturing()  # NOTE: checks_enabled(self.checks)
        if self._worst and not checks:  # NOTE: no collective: the refusal is a function
            if refusal is not None:  # of the shape the ranks must agree on
                raise ValueError(refusal)
            if T > M:
                self._need_tokens = max(self._need_tokens, T)
                return M, None
            return T, None
        device = self._device
        agreement = Agreement(self.group, device, self._pinned, self._group_size)
        name = f"all_gather ({self.api} token count)"
        agreement.start(Agreement.values(T, shape, refusal is not None), name)
        extra = self._stats.extra
        extra["deepep_agreements"] = extra.get("deepep_agreements", 0) + 1
        first = not self.worst_case and shape not in self._agreed_shapes
        if checks or first:
            counts = check_token_rows(agreement.rows(), refusal)
            if device.type == "cuda":
                self._stats.host_syncs += 1  # NOTE: read before the dispatch
            if self.worst_case:
                worst = max(range(R), key=counts.__getitem__)
                if counts[worst] > M:
                    raise ValueError(self._tokens_message(worst, counts[worst]))
                return T, None
            if first:
                self._agreed_shapes.add(shape)
                self._grow_bound(max(counts))
                return T, None
        if refusal is not None:  # NOTE: agreed for this shape before: alike on every rank
            raise ValueError(refusal)
        return min(T, M), agreement  # NOTE: over M: the first M now, every token again after

    def _agreed(self, agreement: Agreement | None) -> bool:
        """Read a dropless dispatch's agreement (after DeepEP's CPU wait): True when the largest
        T was over M, M was raised on every rank and the call must dispatch again; raises on
        every rank when the ranks' rows disagree."""
        if agreement is None:
            return False
        need = max(check_token_rows(agreement.rows()))
        self._peak_tokens = max(self._peak_tokens, need)
        if need <= self.max_tokens:
            return False
        self._grow_bound(need)
        extra = self._stats.extra
        extra["deepep_bound_retries"] = extra.get("deepep_bound_retries", 0) + 1
        return True

    def _grow_bound(self, need: int) -> None:
        """Dropless: raise the bound for ``need`` tokens (every rank at the same call: ``need``
        is the agreed maximum); the shared buffer is rebuilt for it at this call's ``_buffer``,
        once every rank agreed it fits (else every rank raises and keeps its old bound)."""
        self._peak_tokens = max(self._peak_tokens, need)
        if need <= self.max_tokens:
            return
        if self._grown_from is None:
            self._grown_from = (self.max_tokens, self.num_max_tokens_per_rank)
        self.max_tokens, self.num_max_tokens_per_rank = self._grown(need)
        self._stats.extra["deepep_token_bound"] = self.num_max_tokens_per_rank

    def check_overflow(self) -> None:
        """Raise if a rank was over M = W / R with checks off in worst-case mode (it sent its
        first M tokens; a dropless bound grows instead)."""
        self.flush_stats()
        if self._need_tokens:
            raise ValueError(
                f"{self._tokens_message('this', self._need_tokens)}; tokens past the first "
                f"{self.max_tokens} were not dispatched"
            )

    def close(self) -> None:
        """Leave the shared buffer (the traffic counted on the device is folded into ``stats``)."""
        if not self._closed:
            self.flush_stats()
            self._closed = True
            self._shared.leave(id(self))

    # ----------------------------------------------------------------- receive
    def _received(
        self,
        recv: torch.Tensor,
        recv_idx: torch.Tensor,
        recv_w: torch.Tensor,
        recv_scales: torch.Tensor | None,
        handle: Any,
        launch: Launch,
        *,
        cols: int,
    ) -> DispatchResult:
        """DeepEP's non-expanded receive as the contract's result: (source rank, token) order,
        local ids or -1, weights 0 where the id is not local, worst-case tails masked; the rows
        cut to ``cols`` wire columns in the same gather."""
        rows, e = recv.shape[0], self._local_experts
        valid = pairs = None
        if self._worst:
            W = self.num_worst_tokens
            n = handle.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
            order = token_order(handle, rows, n, W)
            valid = torch.arange(W, device=recv.device) < n
        else:
            order = token_order(handle, rows, None, rows)
        # NOTE: one gather of only the columns the caller gets (no wire padding copied)
        recv = recv[:, :cols].index_select(0, order)
        recv_idx, recv_w = recv_idx[order].to(torch.int64), recv_w[order]
        if recv_scales is not None:
            recv_scales = recv_scales[order]
        local = recv_idx >= 0
        if valid is not None:
            # NOTE: the real rows sort first, so ``valid`` also marks them after the sort;
            # DeepEP's tails are uninitialised (ids and weights too)
            local &= valid[:, None]
            recv_idx = torch.where(local, recv_idx, -1)
            recv = sizing.zero_invalid_rows_(recv, valid)  # the gather's own copy
            counts = sizing.count_valid(recv_idx.reshape(-1), local.reshape(-1), e)
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales, valid)
        else:
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            pairs = int(sum(handle.num_recv_tokens_per_expert_list))
            # NOTE: counted on the device (issue 44, Q8: the host list made a tensor is a
            # pageable copy with a stream synchronisation)
            counts = sizing.count_valid(recv_idx.reshape(-1), local.reshape(-1), e)
        state = BoundedState(
            handle=handle,
            wire=launch.wire,
            topk=launch.k,
            sms=launch.sms,
            rows=rows,
            order=order,
            local=local,
            valid=valid,
            recv_scales=recv_scales,
            traffic=launch.traffic,
        )
        return DispatchResult(
            recv_x=recv if launch.fp8 else launch.wire.recv(recv),
            recv_topk_idx=recv_idx,
            recv_topk_probs=torch.where(local, recv_w.float(), 0.0),
            num_recv_tokens_per_expert=counts,
            handle=DispatchHandle(
                backend="deepep",
                num_tokens=launch.T,
                hidden=launch.X,
                num_recv_rows=recv.shape[0],
                state=state,
            ),
            num_recv_pairs=pairs,
        )

    def _received_expanded(
        self,
        recv: torch.Tensor,
        recv_w: torch.Tensor,
        recv_scales: torch.Tensor | None,
        handle: Any,
        launch: Launch,
    ) -> ExpandedDispatchResult:
        """DeepEP's expanded receive as ``ExpandedDispatchResult``.

        Dropless: DeepEP's exact rows and segment sizes (its one CPU wait; alignment gaps are
        zero already: ``do_zero_padding``). Worst-case: the static ``align(R * M * min(k, e) +
        (a - 1) * e, a)`` rows (``a = expert_alignment``), zero past the segments (DeepEP leaves
        them uninitialised), without a host sync.
        """
        valid = None
        if self.worst_case:
            a, e = self.expert_alignment, self.num_local_experts
            N = -(-(self.num_ranks * self.max_tokens * min(launch.k, e) + (a - 1) * e) // a) * a
            recv, recv_w = recv[:N], recv_w[:N]
            counts = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64)
            counts = (counts + a - 1) // a * a
            valid = torch.arange(N, device=recv.device) < counts.sum()
            recv = sizing.zero_invalid_rows_(recv, valid)  # DeepEP's fresh output
            recv_w = torch.where(valid, recv_w, 0.0)
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales[:N], valid)
        else:
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            # NOTE: DeepEP's own device counts, aligned as its host list is (issue 44, Q8: no
            # pageable host-to-device copy)
            a = self.expert_alignment
            counts = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64)
            counts = (counts + a - 1) // a * a
        state = BoundedState(
            handle=handle,
            wire=launch.wire,
            topk=launch.k,
            sms=launch.sms,
            rows=recv.shape[0],
            order=None,
            local=None,
            valid=valid,
            recv_scales=recv_scales,
            traffic=launch.traffic,
        )
        return ExpandedDispatchResult(
            recv_x=recv if launch.fp8 else launch.wire.recv(recv),
            recv_topk_probs=recv_w.float(),
            num_recv_tokens_per_expert=counts,
            handle=launch.handle(recv.shape[0], state),
        )

    # ----------------------------------------------------------------- combine
    @staticmethod
    def _narrow(y: torch.Tensor) -> bool:
        return y.dtype in (torch.float32, torch.float16) and y.shape[1] <= _NARROW

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Unweighted sum over the receiving ranks (module docstring for precision)."""
        X = y.shape[1]
        if y.dtype == torch.bfloat16 or X > _NARROW:
            # NOTE: ``combine_bias(y, handle, None)`` of rows DeepEP sums, straight-line (the
            # decode path)
            state: BoundedState = handle.state
            out, _ = self._combine_call(self._combine_rows(y, state), state)
            out = out[:, :X]
            out = out if out.dtype == y.dtype else out.to(y.dtype)
            sent = state.handle.topk_idx.shape[0]  # NOTE: sent_tokens(state)
            if sent < handle.num_tokens:  # NOTE: tokens not sent (over M): zero rows
                out = torch.cat([out, out.new_zeros(handle.num_tokens - sent, X)])
            return out
        return self.combine_bias(y, handle, None)

    def combine_bias(
        self, y: torch.Tensor, handle: DispatchHandle, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``combine(y) + bias``, the bias added inside DeepEP's reduction where the release
        supports it for ``y``'s dtype (``supports_combine_bias``: one rounding of the sum).

        Args:
            y: ``[rows, X]`` rows as dispatched.
            bias: ``[T, X]`` rows of ``y``'s dtype, or None.
        """
        state: BoundedState = handle.state
        X = y.shape[1]
        if bias is not None and not self.supports_combine_bias(y.dtype)[0]:
            return self.combine_bias(y, handle, None) + bias
        if self._narrow(y):
            out = self._combine_fp32(state.to_deepep(y), state)
            out = sizing.pad_tokens(out, handle.num_tokens)
            return out if bias is None else out + bias
        sent = sent_tokens(state)
        b = None if bias is None else sizing.pad_cols(bias[:sent], COMBINE_COLS)
        out, _ = self._combine_call(self._combine_rows(y, state), state, bias=b)
        out = out[:, :X]
        out = out if out.dtype == y.dtype else out.to(y.dtype)
        if sent < handle.num_tokens:  # NOTE: tokens not sent (over M): zero rows, plus the bias
            tail = out.new_zeros(handle.num_tokens - sent, X) if bias is None else bias[sent:]
            out = torch.cat([out, tail.to(out.dtype)])
        return out

    def _combine_fp32(self, y: torch.Tensor, state: BoundedState) -> torch.Tensor:
        """Exact fp32 sum of narrow rows (DeepEP's order) through the weights channel, one
        combine per column (module docstring)."""
        rows, X = y.shape
        k = state.topk
        first = None
        if state.local is not None:
            local = state.to_deepep(state.local)
            first = torch.nn.functional.one_hot(local.to(torch.int8).argmax(1), k).bool() & local
        dummy = torch.zeros(rows, COMBINE_COLS, dtype=torch.bfloat16, device=y.device)
        yf = y.float()
        cols = []
        for c in range(X):
            if first is None:
                weights = yf[:, c].contiguous()
            else:
                weights = torch.where(first, yf[:, c : c + 1], 0.0).contiguous()
            _, out_w = self._combine_call(dummy, state, weights=weights)
            assert out_w is not None
            cols.append(out_w.sum(1))
        out = torch.stack(cols, 1) if cols else torch.zeros(sent_tokens(state), 0, device=y.device)
        return out.to(y.dtype)

    def _combine_weighted(
        self,
        y: torch.Tensor | None,
        weights: torch.Tensor,
        handle: DispatchHandle,
        part: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One combine of ``part`` (DeepEP's rows of ``y``, or None: a zero dummy) with
        ``weights`` in the fp32 channel: ``(combine(y) or None, [T, k] float32)``."""
        state: BoundedState = handle.state
        if part is None:
            rows = weights.shape[0]
            part = torch.zeros(rows, COMBINE_COLS, dtype=torch.bfloat16, device=weights.device)
        out, out_w = self._combine_call(part, state, weights=weights)
        assert out_w is not None
        out_w = sizing.pad_tokens(out_w, handle.num_tokens)
        if y is None:
            return None, out_w
        out = sizing.pad_tokens(out[:, : y.shape[1]], handle.num_tokens)
        return (out if out.dtype == y.dtype else out.to(y.dtype)), out_w

    def combine_with_probs(
        self, y: torch.Tensor | None, probs: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The backward of ``dispatch`` in one combine: ``probs`` ``[M, k]`` (0 where the slot
        is not local) rides in the weights channel, which returns per slot the owner rank's
        value, i.e. the gradient. Narrow fp32 / fp16 rows are summed on their own
        (``_combine_fp32``), the probs then take one combine more."""
        state: BoundedState = handle.state
        if state.local is None:
            return super().combine_with_probs(y, probs, handle)
        w = state.to_deepep(probs.float()).contiguous()
        if y is not None and self._narrow(y):
            return self.combine(y, handle), self._combine_weighted(None, w, handle, None)[1]
        part = None if y is None else self._combine_rows(y, state)
        return self._combine_weighted(y, w, handle, part)

    def combine_slot_weights(
        self, y: torch.Tensor | None, w: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The backward of ``dispatch_expanded``: ``y`` (or a dummy) combined with ``w`` ``[N]``
        in the weights channel, which returns ``[T, k]``: each slot the weight of the row it was
        expanded into."""
        w = w.float().contiguous()
        if y is not None and self._narrow(y):
            out_w = self._combine_weighted(None, w, handle, None)[1]
            return self.combine(y, handle), out_w
        part = None
        if y is not None:
            yb = y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)
            part = sizing.pad_cols(yb, COMBINE_COLS)
        return self._combine_weighted(y, w, handle, part)
