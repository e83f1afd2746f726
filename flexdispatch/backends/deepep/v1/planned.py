"""The ``deepep`` V1 backend's dispatch entry: planned per row shape.

What a ``(T, X, dtype, k, id dtype, device)`` dispatch fixes is worked out by its first call
(``launch_dispatch`` + ``finish_dispatch``, every refusal and check included) and kept as a
``_Plan``; later calls of that shape run straight-line from it while the shared buffer is the one
that call sized. A combine of ``[M, X]`` rows keeps a ``_CombinePlan`` the same way
(``combine.CombineMixin``). A mixin of ``backend.DeepEPV1Backend``: the attributes below are the
backend's.

Shape letters (ARCHITECTURE.md): T tokens on this rank · X any row width · k top-k · R ranks ·
W worst-case rows · M received rows.
"""

from __future__ import annotations

from typing import Any

import torch

from flexdispatch.backends.deepep import refusals
from flexdispatch.backends.deepep.v1.combine import Launched
from flexdispatch.types import DispatchLayout, DispatchResult

__all__ = ["PlannedDispatch"]

_MAX_PLANS = 16  # row shapes planned per backend (decode T varies with the batch)


class _Plan:
    """What one ``(T, X, dtype, k, id dtype, device)`` dispatch fixes, worked out by its first
    call (every refusal and check of ``launch_dispatch`` ran there) and reused while the shared
    buffer is the one that call sized (``allocations``): the wire format, the column chunks,
    DeepEP's ``Config`` pair, the worst-case cap decision and the bytes a call adds to the
    statistics. Python values only (nothing a result or a handle holds)."""

    __slots__ = (
        "allocations",
        "cap",
        "cast_idx",
        "chunks",
        "config",
        "dropless",
        "row_bytes",
        "wire",
    )

    def __init__(self, backend: Any, launched: Launched, idx_dtype: torch.dtype):
        self.wire = launched.wire
        self.chunks = launched.chunks
        self.dropless = not backend.worst_case
        self.cap = backend.worst_case and backend.num_worst_tokens // backend.num_ranks < launched.T
        self.cast_idx = idx_dtype != backend.topk_idx_dtype
        self.config = backend._configs[0]
        self.row_bytes = backend._dispatch_row_bytes(launched.chunks, 0, launched.k)
        self.allocations = backend._shared.allocations


class _CombinePlan:
    """What a combine of ``[M, X]`` wide rows fixes (``_Plan``'s rules): the column chunks,
    DeepEP's combine ``Config`` and the bytes it adds to the statistics."""

    __slots__ = ("allocations", "back_bytes", "chunks", "config")

    def __init__(self, backend: Any, X: int) -> None:
        self.chunks = backend._combine_chunks(max(-(-X // 8) * 8, 8))
        self.config = backend._configs[1]
        self.back_bytes = sum(backend._row_bytes(2 * c.padded) for c in self.chunks)
        self.allocations = backend._shared.allocations


class PlannedDispatch:
    """The V1 backend's ``dispatch``, planned per row shape (a mixin)."""

    _plannable: bool
    _plans: dict
    _shared: Any
    _closed: bool
    _internode: bool
    topk_idx_dtype: torch.dtype
    num_experts: int
    num_worst_tokens: int
    launch_dispatch: Any
    finish_dispatch: Any
    _cap_worst_case: Any
    _chunk: Any
    _dispatch_result: Any

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """DeepEP dispatch mapped to the contract (see the module docstring):
        ``finish_dispatch(launch_dispatch(...))``.

        Args:
            x: ``[T, H]`` bf16/fp16/fp32 rows, or a ``(float8_e4m3fn [T, H], float32 scales
                [T, H / 128])`` tuple, passed to DeepEP as is: ``recv_x`` is then the fp8 rows
                and the received scales are ``result.handle.state.recv_scales``.
            topk_idx: ``[T, k]`` global expert ids, ``-1`` = none.
            topk_probs: ``[T, k]`` float32, 0 where ``topk_idx`` is ``-1``.
            layout: optional ``get_dispatch_layout`` result (DeepEP's layout kernel otherwise).

        Raises:
            ValueError: with checks on, ranks disagree on shapes or a worst-case overflow (on
                every rank); a row DeepEP cannot take.
        """
        if layout is None and self._plannable and isinstance(x, torch.Tensor):
            key = (x.shape, x.dtype, x.device, topk_idx.shape[1], topk_idx.dtype)
            plan = self._plans.get(key)
            if plan is not None and self._plan_current(plan.allocations):
                return self._planned_dispatch(plan, x, topk_idx, topk_probs)
            launched = self.launch_dispatch(x, topk_idx, topk_probs, None)
            result = self.finish_dispatch(launched)
            if len(self._plans) >= _MAX_PLANS:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = _Plan(self, launched, topk_idx.dtype)
            return result
        return self.finish_dispatch(self.launch_dispatch(x, topk_idx, topk_probs, layout))

    def _combine_plan(self, X: int) -> _CombinePlan:
        return _CombinePlan(self, X)

    def _plan_current(self, allocations: int) -> bool:
        """Whether a plan made on the shared buffer's ``allocations``-th build still holds: the
        same buffer (nothing grew it since), this backend open, and no low-latency capture that
        refuses normal internode kernels (``_buffer_for_rows``' refusals)."""
        shared = self._shared
        return (
            shared.allocations == allocations
            and shared.buffer is not None
            and not self._closed
            and not (self._internode and shared.low_latency_captured)
        )

    def _planned_dispatch(
        self, p: _Plan, x: torch.Tensor, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> DispatchResult:
        """``finish_dispatch(launch_dispatch(...))`` of a planned shape, straight-line: what the
        shape fixes comes from ``p``; the ops and DeepEP calls are those of the first call."""
        if p.dropless:
            refusals.check_dropless_capture("DeepEP V1")
        buffer = self._shared.buffer
        idx = (topk_idx.to(self.topk_idx_dtype) if p.cast_idx else topk_idx).contiguous()
        probs = topk_probs if topk_probs.dtype == torch.float32 else topk_probs.float()
        probs = probs.contiguous()
        w = p.wire.send(x)
        chunks = p.chunks
        ntr, ntrr, nte, itr, _ = buffer.get_dispatch_layout(idx, self.num_experts)
        if p.cap:
            itr, ntr = self._cap_worst_case(itr, ntr)
        W = self.num_worst_tokens
        recv_w, recv_idx, recv_probs, count_list, handle, _ = buffer.dispatch(
            self._chunk(w, chunks[0]),
            num_tokens_per_rank=ntr,
            num_tokens_per_rdma_rank=ntrr,
            is_token_in_rank=itr,
            num_tokens_per_expert=nte,
            topk_idx=idx,
            topk_weights=probs,
            num_worst_tokens=W,
            config=p.config,
        )
        if len(chunks) > 1:
            parts = [recv_w[:, : chunks[0].width]]
            for c in chunks[1:]:
                got, *_ = buffer.dispatch(
                    self._chunk(w, c), handle=handle, num_worst_tokens=W, config=p.config
                )
                parts.append(got[:, : c.width])
            recv_w = torch.cat(parts, dim=1)
        T, X = x.shape
        return self._dispatch_result(
            T, X, p.wire, chunks, recv_w, None, recv_idx, recv_probs, count_list, handle, ntr,
            ntrr, p.row_bytes,
        )  # fmt: skip
