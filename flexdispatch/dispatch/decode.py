"""Expert-major decode dispatch: ``[e, C, H]`` rows per local expert, on any backend.

Shape letters (ARCHITECTURE.md): T tokens on this rank (at most ``num_max`` per call) · H hidden ·
E experts · R ranks · e = E / R local experts · k top-k · W worst-case rows · C = R * num_max
rows per local expert (the capacity) · P = W * k (row, slot) pairs.

Decode steps are small and captured in CUDA graphs, so their layout is static: every local expert
owns ``C`` rows, of which ``num_recv_tokens_per_expert[j]`` are real (the rest are zero on the
torch path and undefined on DeepEP's). One row per ``(token, expert)`` pair — a token with two
experts on a rank arrives twice — and the combine is *weighted* by the routing probs:
``out[t] = sum_j probs[t, j] * y[expert(t, j), slot(t, j)]``.

- On the ``deepep`` backend in ``mode="low_latency"`` this is DeepEP's ``low_latency_dispatch`` /
  ``low_latency_combine`` (see ``backends/deepep/v1.py``).
- On any other backend it is the worst-case (``num_worst_tokens``) dispatch followed by
  ``to_expert_major`` and, on the way back, ``from_expert_major`` + the ordinary combine. Both are
  gathers/scatters with device-side indices (no host sync).

The decode path is for inference (no autograd). Row order inside an expert is (source rank,
source token) on the torch path; DeepEP fills rows in arrival order, so rely only on
``num_recv_tokens_per_expert`` and on the combine, never on positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flexdispatch._checks.tensors import check_routing, check_tensor
from flexdispatch._checks.values import check_int
from flexdispatch.types import DispatchResult, ExpertMajorHandle, ExpertMajorResult, _renamed

if TYPE_CHECKING:
    from flexdispatch.dispatch.dispatcher import FlexDispatcher

__all__ = [
    "ExpertMajorHandle",
    "ExpertMajorResult",
    "ExpertMajorMaps",
    "expert_major_maps",
    "to_expert_major",
    "from_expert_major",
    "DecodeDispatcher",
]


@dataclass(frozen=True, kw_only=True)
class ExpertMajorMaps:
    """Where each ``(row, slot)`` pair of a worst-case result sits in the ``[e * C]`` layout.

    Attributes:
        slot: ``[P]`` int64 flat position ``expert * C + i`` of each pair, or a unique spare index
            ``>= e * C`` for pairs without a local expert (and for pairs past the capacity).
        valid: ``[P]`` bool, the pair has a local expert and fits.
        num_recv_tokens_per_expert: ``[e]`` int64 pairs per local expert (capped at C).
        overflow: 0-d int64, pairs that did not fit (0 unless an expert got more than C rows).
        capacity: C, the rows of each expert (None: not recorded, maps made before 0.1).

    ``recv_count`` is the name before 0.1 (a deprecated alias).
    """

    slot: torch.Tensor
    valid: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    overflow: torch.Tensor
    capacity: int | None = None

    recv_count = _renamed("recv_count", "num_recv_tokens_per_expert")


def expert_major_maps(
    recv_topk_idx: torch.Tensor, num_local_experts: int, capacity: int
) -> ExpertMajorMaps:
    """Positions of the pairs of a dispatch result in the expert-major layout (no host sync).

    Pairs are numbered row-major (``p = m * k + j``) and, inside an expert, keep that order, so the
    layout is (source rank, source token) ordered.

    Args:
        recv_topk_idx: ``[W, k]`` int64 local expert ids, ``-1`` elsewhere.
        num_local_experts: e.
        capacity: C.

    Raises:
        TypeError: ids that are not int64 (float ids would be truncated), e or C not an int.
        ValueError: e or C not positive.
    """
    check_tensor("recv_topk_idx", recv_topk_idx, ndim=2, dtypes=(torch.int64,))
    check_int("num_local_experts", num_local_experts, at_least=1, error=TypeError)
    check_int("capacity", capacity, at_least=1, error=TypeError)
    return _expert_major_maps(recv_topk_idx, num_local_experts, capacity)


def _expert_major_maps(
    recv_topk_idx: torch.Tensor, num_local_experts: int, capacity: int
) -> ExpertMajorMaps:
    """``expert_major_maps`` without its argument checks (``DecodeDispatcher``'s own results)."""
    e, C = num_local_experts, capacity
    ids = recv_topk_idx.reshape(-1).to(torch.int64)
    P = ids.numel()
    device = ids.device
    has = (ids >= 0) & (ids < e)
    onehot_PE = (ids[:, None] == torch.arange(e, device=device)) & has[:, None]
    before_P = (onehot_PE.to(torch.int64).cumsum(0) - 1).gather(1, ids.clamp(0, e - 1)[:, None])
    before_P = before_P.squeeze(1)
    valid = has & (before_P < C)
    spare = e * C + torch.arange(P, device=device, dtype=torch.int64)
    slot = torch.where(valid, ids.clamp(0, e - 1) * C + before_P, spare)
    total = onehot_PE.sum(0, dtype=torch.int64)
    return ExpertMajorMaps(
        slot=slot,
        valid=valid,
        num_recv_tokens_per_expert=total.clamp(max=C),
        overflow=(total - C).clamp(min=0).sum(),
        capacity=C,
    )


def to_expert_major(recv_x: torch.Tensor, maps: ExpertMajorMaps, capacity: int) -> torch.Tensor:
    """``[W, H]`` rows of a dispatch result to ``[e, C, H]`` (zero where no pair sits).

    Args:
        recv_x: ``[W, H]`` received rows.
        maps: ``expert_major_maps`` of the same result.
        capacity: C, the maps' (``ExpertMajorMaps.capacity``).

    Raises:
        TypeError / ValueError: ``recv_x`` not ``[W, H]``, maps of another row count or another
            capacity (host-side shapes only).
    """
    check_tensor("recv_x", recv_x, ndim=2)
    _check_maps(maps, recv_x.shape[0], capacity, "recv_x")
    return _to_expert_major(recv_x, maps, capacity)


def _check_maps(maps: object, W: int, capacity: int | None, rows: str) -> None:
    """``maps`` are ``ExpertMajorMaps`` of ``W`` rows (``P = W * k`` pairs) and, when given,
    of ``capacity`` (metadata only)."""
    if not isinstance(maps, ExpertMajorMaps):
        raise TypeError(
            f"maps must be the ExpertMajorMaps of expert_major_maps, got {type(maps).__name__}"
        )
    if capacity is not None:
        check_int("capacity", capacity, at_least=1, error=TypeError)
        if maps.capacity is not None and capacity != maps.capacity:
            raise ValueError(
                f"capacity={capacity} but the maps were made for capacity {maps.capacity}: pass "
                f"the capacity given to expert_major_maps"
            )
    P = maps.slot.numel()
    if (P and not W) or (W and P % W):
        raise ValueError(
            f"{rows} has {W} rows but the maps hold {P} (row, slot) pairs: pass the maps of "
            f"the same dispatch result (W * k pairs)"
        )


def _to_expert_major(recv_x: torch.Tensor, maps: ExpertMajorMaps, capacity: int) -> torch.Tensor:
    """``to_expert_major`` without its argument checks (``DecodeDispatcher``'s own results)."""
    W, H = recv_x.shape
    k = maps.slot.numel() // max(W, 1) if W else 0
    e = maps.num_recv_tokens_per_expert.numel()
    rows_P = recv_x.repeat_interleave(k, dim=0) if W else recv_x.new_zeros(0, H)
    out = recv_x.new_zeros(e * capacity + maps.slot.numel(), H)
    # NOTE: every pair has its own index (spares included): the scatter is deterministic.
    out.index_copy_(0, maps.slot, rows_P)
    return out[: e * capacity].view(e, capacity, H)


def from_expert_major(
    y: torch.Tensor, maps: ExpertMajorMaps, recv_topk_probs: torch.Tensor
) -> torch.Tensor:
    """``[e, C, H]`` expert outputs back to ``[W, H]`` rows, weighted by the pairs' probs.

    ``row[m] = sum_j probs[m, j] * y[pair (m, j)]`` over the pairs with a local expert; rows
    without one are zero.

    Args:
        y: ``[e, C, X]`` expert outputs.
        maps: ``expert_major_maps`` of the dispatch result.
        recv_topk_probs: ``[W, k]`` float32, 0 where there is no local expert.

    Raises:
        TypeError / ValueError: shapes that disagree with the maps (host-side shapes only).
    """
    check_tensor("y", y, ndim=3, floating=True)
    check_tensor("recv_topk_probs", recv_topk_probs, ndim=2, floating=True)
    W, k = recv_topk_probs.shape
    _check_maps(maps, W, None, "recv_topk_probs")
    e = maps.num_recv_tokens_per_expert.numel()
    if maps.slot.numel() != W * k:
        raise ValueError(
            f"recv_topk_probs is {[W, k]} but the maps hold {maps.slot.numel()} (row, slot) "
            f"pairs: pass the recv_topk_probs of the same dispatch result"
        )
    if y.shape[0] != e or (maps.capacity is not None and y.shape[1] != maps.capacity):
        raise ValueError(
            f"y must be [{e}, {maps.capacity or 'C'}, X] (the maps' experts and capacity), got "
            f"{list(y.shape)}"
        )
    return _from_expert_major(y, maps, recv_topk_probs)


def _from_expert_major(
    y: torch.Tensor, maps: ExpertMajorMaps, recv_topk_probs: torch.Tensor
) -> torch.Tensor:
    """``from_expert_major`` without its argument checks (``DecodeDispatcher``'s own results)."""
    e, C, X = y.shape
    W, k = recv_topk_probs.shape
    flat = torch.cat([y.reshape(e * C, X), y.new_zeros(1, X)])
    pick = torch.where(maps.valid, maps.slot, e * C)
    pairs = flat.index_select(0, pick).view(W, k, X).float()
    weights = torch.where(maps.valid.view(W, k), recv_topk_probs.float(), 0.0)
    return (pairs * weights[..., None]).sum(1).to(y.dtype)


def _check_decoder_args(dispatcher: object, num_max: object) -> None:
    from flexdispatch.dispatch.dispatcher import FlexDispatcher

    if not isinstance(dispatcher, FlexDispatcher):
        raise TypeError(
            f"dispatcher must be a FlexDispatcher, got {type(dispatcher).__name__} (a MoELayer's "
            f"is layer.dispatcher)"
        )
    check_int(
        "num_max_dispatch_tokens_per_rank",
        num_max,
        at_least=1,
        rule="a positive int",
        error=TypeError,
    )


class DecodeDispatcher:
    """Expert-major decode dispatch/combine over a ``FlexDispatcher``'s backend.

    Args:
        dispatcher: a ``FlexDispatcher``. On ``deepep`` it must be built with
            ``mode="low_latency"``; elsewhere with ``num_worst_tokens >= R * num_max``.
        num_max_dispatch_tokens_per_rank: the most tokens any rank dispatches in one call (the
            same on every rank); C = R * this.

    Raises:
        ValueError: the dispatcher cannot serve this decode shape (the message says what to set).
    """

    def __init__(
        self, dispatcher: FlexDispatcher, *, num_max_dispatch_tokens_per_rank: int
    ) -> None:
        _check_decoder_args(dispatcher, num_max_dispatch_tokens_per_rank)
        self.dispatcher = dispatcher
        self.num_max = num_max_dispatch_tokens_per_rank
        self.capacity = dispatcher.num_ranks * num_max_dispatch_tokens_per_rank
        configured = dispatcher.backend.low_latency_tokens()
        self._low_latency = configured is not None
        if configured is not None:
            if configured != self.num_max:
                raise ValueError(
                    f"num_max_dispatch_tokens_per_rank={self.num_max} differs from the "
                    f"dispatcher's DispatchConfig.num_max_dispatch_tokens_per_rank={configured}"
                )
            return
        worst = dispatcher.config.num_worst_tokens
        if worst < self.capacity:
            raise ValueError(
                f"decode on the {dispatcher.backend_name} backend uses its worst-case mode: build "
                f"the dispatcher with num_worst_tokens >= R * num_max = {self.capacity} (got "
                f"W={worst}), or use backend='deepep' with mode='low_latency'"
            )

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> ExpertMajorResult:
        """Send each ``(token, expert)`` pair to its expert, expert-major.

        Args:
            x: ``[T, H]`` rows, ``T <= num_max`` (bf16 on DeepEP).
            topk_idx: ``[T, k]`` int64 global expert ids, ``-1`` = none.
            topk_probs: ``[T, k]`` float32 routing weights (used by ``combine``).

        Returns:
            ``ExpertMajorResult`` (``recv_x [e, C, H]``, ``num_recv_tokens_per_expert [e]``
            int64).
        """
        check_routing(x, topk_idx, topk_probs)
        if x.shape[0] > self.num_max:
            raise ValueError(
                f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank={self.num_max}"
            )
        with torch.no_grad():
            if self._low_latency:
                # NOTE: the id guard of every other path: an id >= E indexes DeepEP's
                # low-latency workspace past its counters and a repeated id overruns a sender's
                # num_max slots; raised (checks on, CPU) or masked to -1 and counted (DeepEP V1
                # counts no bad ids itself: nothing is deferred)
                idx = self.dispatcher._check_values(topk_idx, x, topk_probs)
                return self.dispatcher.backend.low_latency_dispatch(x, idx, topk_probs)
            res: DispatchResult = self.dispatcher.dispatch(x, topk_idx, topk_probs)
            e = self.dispatcher.num_local_experts
            maps = _expert_major_maps(res.recv_topk_idx, e, self.capacity)
            handle = ExpertMajorHandle(
                backend=self.dispatcher.backend_name,
                num_tokens=x.shape[0],
                hidden=x.shape[1],
                capacity=self.capacity,
                topk_idx=topk_idx,
                topk_probs=topk_probs,
                generation=-1,
                state=(res.handle, maps, res.recv_topk_probs),
            )
            return ExpertMajorResult(
                recv_x=_to_expert_major(res.recv_x, maps, self.capacity),
                recv_scales=None,
                num_recv_tokens_per_expert=maps.num_recv_tokens_per_expert,
                handle=handle,
            )

    def combine(self, y: torch.Tensor, handle: ExpertMajorHandle) -> torch.Tensor:
        """Weighted sum of the expert outputs of every pair, back at the source token.

        Args:
            y: ``[e, C, H]`` expert outputs (bf16 on DeepEP).
            handle: ``ExpertMajorResult.handle`` of the matching ``dispatch``.

        Returns:
            ``[T, H]``: ``sum_j probs[t, j] * y[pair (t, j)]`` (zero for tokens without experts).
        """
        if not isinstance(handle, ExpertMajorHandle):
            raise TypeError("handle must be the ExpertMajorResult.handle of this decoder")
        if handle.capacity != self.capacity:  # NOTE: another decoder's handle (silently wrong)
            raise ValueError(
                f"handle is of a decoder of capacity {handle.capacity}, this one's is "
                f"{self.capacity}: combine with the DecodeDispatcher whose dispatch returned it"
            )
        check_tensor("y", y, ndim=3, floating=True)
        e = self.dispatcher.num_local_experts
        if tuple(y.shape[:2]) != (e, self.capacity):
            raise ValueError(
                f"y must be [{e}, {self.capacity}, H] (expert-major, as dispatched), got "
                f"{tuple(y.shape)}"
            )
        with torch.no_grad():
            if self._low_latency:
                return self.dispatcher.backend.low_latency_combine(y, handle)
            inner, maps, probs = handle.state
            rows = _from_expert_major(y, maps, probs)
            return self.dispatcher.combine(rows, inner)
