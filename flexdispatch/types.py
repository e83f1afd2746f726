"""Result types that cross module boundaries.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks in
the expert-parallel group · e = E / R local experts · k top-k · L ranks per node · N = R / L nodes ·
M rows received by this rank · W worst-case rows.

Results and handles are frozen, keyword-only dataclasses; nothing here is a bare tuple.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

__all__ = [
    "RoutingResult",
    "DispatchLayout",
    "Permutation",
    "DispatchResult",
    "DispatchHandle",
    "DispatchStats",
    "ExpertMajorHandle",
    "ExpertMajorResult",
    "ExpandedDispatchResult",
    "PendingDispatch",
    "check_handle",
    "next_issuer",
]

_ISSUERS = itertools.count(1)


def next_issuer() -> int:
    """A new serial number for a ``FlexDispatcher`` (``DispatchHandle.issuer``)."""
    return next(_ISSUERS)


def check_handle(handle: object, backend: str, issuer: int | None) -> None:
    """Raise unless ``handle`` is a ``DispatchHandle`` issued by dispatcher ``issuer`` (None: of
    ``backend``, whoever issued it; ``flexdispatch::combine`` checks the issuer when it runs).

    Host ints only: no device value is read.

    Raises:
        TypeError: not a ``DispatchHandle`` of ``backend``.
        ValueError: the handle of another dispatcher (even one of the same backend).
    """
    if not isinstance(handle, DispatchHandle) or handle.backend != backend:
        raise TypeError(
            "handle must be the DispatchHandle of this dispatcher's dispatch (result.handle)"
        )
    if issuer is not None and handle.issuer != issuer:
        raise ValueError(
            f"handle was issued by another FlexDispatcher (#{handle.issuer}), not this one "
            f"(#{issuer}): combine with the dispatcher whose dispatch returned it"
        )


@dataclass(frozen=True, kw_only=True)
class RoutingResult:
    """What a router hands to the dispatcher.

    Attributes:
        topk_idx: ``[T, k]`` int64 global expert ids; ``-1`` marks a dropped slot.
        topk_probs: ``[T, k]`` float32 routing weights; exactly ``0`` wherever ``topk_idx == -1``.
        tokens_per_expert: ``[E]`` int64 number of ``(token, slot)`` pairs per expert after
            capacity dropping.
        num_dropped: 0-d int64 device tensor, pairs removed by capacity dropping (0 without a
            capacity factor). A tensor, not an int, so that reading it is the caller's host sync.
        aux_loss: 0-d float32 load-balancing loss (already scaled by its coefficient), or None.
        z_loss: 0-d float32 router z-loss (already scaled), or None.
    """

    topk_idx: torch.Tensor
    topk_probs: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_dropped: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]

    @property
    def topk(self) -> int:
        return self.topk_idx.shape[1]


@dataclass(frozen=True, kw_only=True)
class DispatchLayout:
    """DeepEP's dispatch layout (values and dtypes of ``Buffer.get_dispatch_layout``).

    Attributes:
        num_tokens_per_rank: ``[R]`` int32, tokens with at least one expert on each rank.
        num_tokens_per_rdma_rank: ``[N]`` int32, tokens with at least one expert on each node, or
            None when ``R <= ranks_per_node``.
        num_tokens_per_expert: ``[E]`` int32, ``(token, slot)`` pairs per expert.
        is_token_in_rank: ``[T, R]`` bool, token ``t`` has an expert on rank ``r``.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class Permutation:
    """Rows grouped expert-major, and the maps back.

    Attributes:
        x: ``[N, H]`` rows, expert-major, stable by token inside an expert; padding rows are 0.
        probs: ``[N]`` float32 prob of each row (0 on padding), or None when no probs were given.
        tokens_per_expert: ``[num_experts]`` int64 real rows per expert (padding excluded).
        padded_tokens_per_expert: ``[num_experts]`` int64 rows per expert segment including the
            padding to a multiple of ``align`` (the same tensor as ``tokens_per_expert`` when
            ``align == 1``).
        row_token: ``[N]`` int64 source token of each row, ``-1`` on padding rows.
        row_slot: ``[N]`` int64 source top-k slot of each row, ``-1`` on padding rows.
        num_tokens: T, the number of source tokens (rows of ``unpermute``'s output).
        dense: True when every row is real (exact size with ``align == 1``: no padding row, no
            ``-1`` in ``row_token``), which lets ``unpermute`` skip the padding bookkeeping.
        pair_rows: ``[T, k]`` int64 row of each ``(token, slot)`` pair, ``-1`` where the pair
            has no row; set by ``permute(impl="triton")`` (its ``unpermute`` sums by it), None
            from the torch path.
    """

    x: torch.Tensor
    probs: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    padded_tokens_per_expert: torch.Tensor
    row_token: torch.Tensor
    row_slot: torch.Tensor
    num_tokens: int
    dense: bool = False
    pair_rows: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """Everything ``combine`` needs to send rows back; owned by the caller, never cached.

    Backends put their own state in ``state`` (a frozen dataclass of their own).

    Attributes:
        backend: name of the backend that made it.
        num_tokens: T of the dispatching rank.
        hidden: H of the dispatched rows.
        num_recv_rows: M (W in worst-case mode).
        state: backend-specific, opaque to callers; through the custom ops
            (``flexdispatch.dispatch.ops``, docs/compile.md) the ``[2]`` int64 CPU handle tensor
            that names the backend's handle in a registry.
        issuer: the serial number of the ``FlexDispatcher`` that issued it (0: none); its
            ``combine`` refuses a handle of another dispatcher, comparing this int on the host.
    """

    backend: str
    num_tokens: int
    hidden: int
    num_recv_rows: int
    state: Any
    issuer: int = field(default=0, compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class DispatchResult:
    """What ``FlexDispatcher.dispatch`` returns.

    Attributes:
        recv_x: ``[M, H]`` received rows (``[W, H]`` in worst-case mode, zero past the real rows),
            ordered by source rank, then source token.
        recv_topk_idx: ``[M, k]`` int64 local expert ids (``x - rank * e``), ``-1`` elsewhere.
        recv_topk_probs: ``[M, k]`` float32, ``0`` wherever ``recv_topk_idx == -1``.
        num_recv_tokens_per_expert: ``[e]`` int64 device tensor, ``(row, slot)`` pairs per local
            expert.
        handle: what ``combine`` needs.
        num_recv_pairs: the number of ``(row, slot)`` pairs with a local expert as a host int,
            when the backend knows it without a sync (dropless mode), else None. Lets
            ``permute(..., num_rows=...)`` size its output without a second host sync.
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_probs: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: DispatchHandle
    num_recv_pairs: int | None = None


def _renamed(old: str, new: str) -> property:
    """A read-only alias ``old`` of field ``new``, for one release (a ``DeprecationWarning``)."""

    def get(self: Any) -> Any:
        warnings.warn(
            f"{type(self).__name__}.{old} is now .{new}; the old name goes in the next release",
            DeprecationWarning,
            2,
        )
        return getattr(self, new)

    return property(get, doc=f"Deprecated alias of ``{new}``.")


@dataclass(frozen=True, kw_only=True)
class ExpandedDispatchResult:
    """What ``FlexDispatcher.dispatch_expanded`` returns: one row per (token, local expert),
    grouped by local expert — what ``GroupedExperts`` consumes, with no ``permute``. The names are
    ``DispatchResult``'s: each row is one ``(token, slot)`` pair.

    Attributes:
        recv_x: ``[N, H]`` rows; local expert ``j`` owns rows ``[sum(c[:j]), sum(c[:j+1]))`` with
            ``c = num_recv_tokens_per_expert``; inside a segment the order is the backend's
            (DeepEP: not token order). In worst-case mode N is static and rows past ``sum(c)``
            are zero.
        recv_topk_probs: ``[N]`` float32 routing weight (top-k prob) of each row's pair (0 past
            ``sum(c)``).
        num_recv_tokens_per_expert: ``[e]`` int64 device tensor, the segment sizes.
        handle: what ``combine`` needs (``combine`` takes ``[N, H]`` rows and sums, per source
            token, every row of it on every rank).

    ``recv_probs`` and ``tokens_per_expert`` are the names before 0.1 (deprecated aliases).
    """

    recv_x: torch.Tensor
    recv_topk_probs: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: DispatchHandle

    recv_probs = _renamed("recv_probs", "recv_topk_probs")
    tokens_per_expert = _renamed("tokens_per_expert", "num_recv_tokens_per_expert")


@dataclass(kw_only=True)
class DispatchStats:
    """Cumulative counters of one dispatcher since construction (host-side integers).

    Attributes:
        host_syncs: device-to-host synchronisations issued by dispatch/combine.
        bytes_sent_intra_node: payload bytes this rank sent to ranks on its own node (itself
            excluded), dispatch and combine together.
        bytes_sent_inter_node: payload bytes this rank sent to ranks on other nodes.
        rows_sent: rows this rank sent to other ranks or kept for itself, dispatch direction.
        rows_received: rows this rank received (real rows, padding excluded), dispatch direction.
        dispatch_calls, combine_calls: number of calls.
        extra: further counters by name. Bad inputs, once a safe-point check
            (``check_overflow``) has read a non-zero device count of them:
            ``invalid_expert_ids`` (with ``invalid_expert_id_highest`` / ``_lowest``, the worst
            ids seen), ``nonfinite_x``, ``nonfinite_topk_probs``, ``repeated_expert_ids``. Host
            syncs that value checks cost (checks on): ``check_syncs``. DeepEP:
            ``deepep_buffer_allocations`` (shared buffers built), ``deepep_token_bound`` (the
            per-rank token bound a dropless V2 / V2.5 dispatch grew to), ``low_latency_calls``.
        pending_bad_values: device-side ``[6]`` int64 counters of bad dispatch inputs not yet
            read (CUDA without checks): ids outside ``[-1, E)``, NaN/inf in ``x``, NaN/inf in
            ``topk_probs``, repeated ids in one token, then the largest and the smallest id; None
            before the first such count. It may lag: after the first dispatch the counts are kept
            unsummed (``dispatch.values.BadValueLog``, no launch per dispatch) and folded into
            this tensor every 64 dispatches and at ``check_overflow()``, so read the counts there,
            not here. Not part of ``as_dict`` (reading it syncs); ``check_overflow`` folds it into
            ``extra``.
    """

    host_syncs: int = 0
    bytes_sent_intra_node: int = 0
    bytes_sent_inter_node: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    dispatch_calls: int = 0
    combine_calls: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    pending_bad_values: torch.Tensor | None = None

    def as_dict(self) -> dict[str, int]:
        out = {
            "host_syncs": self.host_syncs,
            "bytes_sent_intra_node": self.bytes_sent_intra_node,
            "bytes_sent_inter_node": self.bytes_sent_inter_node,
            "rows_sent": self.rows_sent,
            "rows_received": self.rows_received,
            "dispatch_calls": self.dispatch_calls,
            "combine_calls": self.combine_calls,
        }
        out.update(self.extra)
        return out


@dataclass(frozen=True, kw_only=True)
class ExpertMajorHandle:
    """What the decode combine needs; owned by the caller.

    Attributes:
        backend: ``"deepep"`` (low-latency kernels) or the name of the backend whose worst-case
            dispatch was used.
        num_tokens: T of the dispatching rank.
        hidden: H.
        capacity: C, rows per local expert.
        topk_idx: ``[T, k]`` global expert ids of the source tokens (the combine's weights go with
            them).
        topk_probs: ``[T, k]`` float32 routing weights of the source tokens.
        generation: DeepEP low-latency kernel count when the result was made (-1 elsewhere).
        state: backend-specific (DeepEP's handle tuple, or ``(DispatchHandle, ExpertMajorMaps)``).
    """

    backend: str
    num_tokens: int
    hidden: int
    capacity: int
    topk_idx: torch.Tensor
    topk_probs: torch.Tensor
    generation: int
    state: Any


@dataclass(frozen=True, kw_only=True)
class ExpertMajorResult:
    """Rows received for decode, expert-major.

    Attributes:
        recv_x: ``[e, C, H]`` rows (bf16 on DeepEP, else x's dtype; ``float8_e4m3fn`` with
            ``use_fp8``). Rows past ``num_recv_tokens_per_expert[j]`` are zero (torch) or
            undefined (DeepEP).
        recv_scales: ``[e, C, H / 128]`` float32 fp8 scales (column-major in the last two dims,
            as DeepEP returns them), or None without fp8.
        num_recv_tokens_per_expert: ``[e]`` int64 device tensor, real rows per local expert.
        handle: what ``combine`` needs.

    ``recv_count`` is the name before 0.1 (a deprecated alias).
    """

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    num_recv_tokens_per_expert: torch.Tensor
    handle: ExpertMajorHandle

    recv_count = _renamed("recv_count", "num_recv_tokens_per_expert")


_ResultT = TypeVar("_ResultT")


class PendingDispatch(Generic[_ResultT]):
    """A dispatch in flight: ``FlexDispatcher.dispatch_start`` (a ``DispatchResult``) or
    ``dispatch_expanded_start`` (an ``ExpandedDispatchResult``).

    ``wait()`` returns its result, once, and must be called on every rank. Between the start and
    the wait the caller may run work that does not need the received rows (a layer's shared
    experts): on DeepEP V1 with ``deepep_async_finish`` and on DeepEP 2.5 (``defer_epilogue``)
    the rows are still moving then; other backends finished at the start. ``ready``, when given,
    runs first and may refuse the wait now (DeepEP 2.5: inside a CUDA-graph capture the dispatch
    was not launched in); a refused wait can be called again later.
    """

    def __init__(
        self, finish: Callable[[], _ResultT], ready: Callable[[], None] | None = None
    ) -> None:
        self._finish: Callable[[], _ResultT] | None = finish
        self._ready = ready

    def wait(self) -> _ResultT:
        """The dispatch's result (differentiable in ``x`` and ``topk_probs`` as ever)."""
        if self._finish is None:
            raise RuntimeError("PendingDispatch.wait() was already called")
        if self._ready is not None:
            self._ready()
        finish, self._finish = self._finish, None
        return finish()
