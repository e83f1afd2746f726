"""``DeepEPV1Backend``'s combine side (``CombineMixin``) and the record of a launched dispatch.

Shape letters (ARCHITECTURE.md): T tokens · M received rows · k top-k · X any row width.

- ``combine``: bf16 rows through DeepEP's reduce (padded and chunked to the widths its kernels
  take); fp32 / fp16 rows of at most ``NARROW_FP32_COLUMNS`` columns exactly, in fp32, through
  combine's ``topk_weights`` channel.
- ``combine_with_probs``: the backward of ``dispatch`` in ONE DeepEP combine, the probs gradient
  in the ``topk_weights`` channel beside the rows.
- ``cached_dispatch``: new rows along a dispatch's handle (no host sync).
- ``Launched``: what ``launch_dispatch`` hands to ``finish_dispatch`` (``deepep_async_finish``
  overlap).

Every call passes DeepEP's ``Config`` built once (``sizing.normal_configs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flexdispatch.backends.base import DispatchBackend
from flexdispatch.backends.deepep import rules, sizing
from flexdispatch.types import DispatchHandle

__all__ = ["NARROW_FP32_COLUMNS", "CombineMixin", "Launched"]

NARROW_FP32_COLUMNS = sizing.MAX_TOPK  # combine's fp32 topk_weights channel width


def _narrow(y: torch.Tensor) -> bool:
    """fp32 / fp16 rows narrow enough to sum exactly in combine's fp32 weights channel."""
    return y.dtype in (torch.float32, torch.float16) and y.shape[1] <= NARROW_FP32_COLUMNS


@dataclass(frozen=True, kw_only=True)
class Launched:
    """A dispatch issued by ``launch_dispatch``: what ``finish_dispatch`` needs. ``parts``: the
    DeepEP output of each row chunk (an ``(x, scales)`` pair for fp8); ``event``: the last DeepEP
    event (None when synchronous)."""

    T: int
    X: int
    k: int
    wire: sizing.WireFormat
    chunks: tuple
    num_scales: int
    parts: list
    recv_idx: torch.Tensor
    recv_probs: torch.Tensor
    count_list: Any
    handle: tuple
    event: Any
    ntr: torch.Tensor
    ntrr: torch.Tensor | None


class CombineMixin:
    """``combine`` / ``combine_with_probs`` / ``cached_dispatch`` of ``DeepEPV1Backend`` (which
    provides the buffer, chunk plans, launch helpers and accounting used here)."""

    # provided by DeepEPV1Backend
    deep_ep: Any
    num_ranks: int
    internode: bool
    num_worst_tokens: int
    rules: Any
    _buffer_for_rows: Any
    _dispatch_chunks: Any
    _launch_kwargs: Any
    _wait: Any
    _after_normal_kernel: Any
    num_sms: int
    _account: Any
    _row_bytes: Any
    _plannable: bool
    _combine_plans: dict
    _plan_current: Any
    _combine_plan: Any
    _shared: Any

    @property
    def _configs(self) -> tuple[Any, Any]:
        """DeepEP's dispatch and combine ``Config`` for R, built once (``sizing.normal_configs``)
        and passed to every call (DeepEP rebuilds its tables per call otherwise)."""
        return sizing.normal_configs(self.deep_ep, self.num_ranks, self.num_sms)

    def _combine_chunks(self, cols: int) -> tuple:
        multiple = self.rules.combine_col_multiple(self.internode)
        cap = self.rules.combine_max_cols(self.internode, topk=NARROW_FP32_COLUMNS)
        return rules.plan_chunks(cols, cap, multiple)

    @staticmethod
    def _chunk(w: torch.Tensor, c: rules.Chunk) -> torch.Tensor:
        part = w[:, c.start : c.start + c.width]
        pad = c.padded - c.width
        return F.pad(part, (0, pad)) if pad else part.contiguous()

    # ----------------------------------------------------------------- combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Unweighted sum over the receiving ranks (see the module docstring for precision)."""
        X = y.shape[1]
        if self._plannable and (y.dtype == torch.bfloat16 or X > NARROW_FP32_COLUMNS):
            # NOTE: wide rows on the decode path: the chunks, Config and bytes of this width
            # planned once (``backend._CombinePlan``), while the shared buffer is the same
            plans = self._combine_plans
            plan = plans.get(X)
            if plan is not None and self._plan_current(plan.allocations):
                return self._planned_combine(plan, y, handle.state)
            out = self._combine(y, handle, None)[0]
            if len(plans) >= 16:
                del plans[next(iter(plans))]
            plans[X] = self._combine_plan(X)
            return out
        return self._combine(y, handle, None)[0]

    def _planned_combine(self, plan: Any, y: torch.Tensor, state: Any) -> torch.Tensor:
        """``_combine(y, handle, None)`` of wide rows, straight-line from ``plan``."""
        X = y.shape[1]
        shared = self._shared
        buffer = shared.buffer
        yb = y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)
        parts = []
        for c in plan.chunks:
            width = min(c.width, X - c.start)
            part = yb[:, c.start : c.start + width]
            pad = c.padded - width
            part = F.pad(part, (0, pad)) if pad else part.contiguous()
            combined, _, _ = buffer.combine(part, state.handle, config=plan.config)
            parts.append(combined[:, :width])
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if out.dtype != y.dtype:
            out = out.to(y.dtype)
        shared.normal_kernel_ran = True  # NOTE: _after_normal_kernel, inline
        shared.normal_calls += 1
        self._account("combine", state.links, plan.back_bytes)
        return out

    def combine_with_probs(
        self, y: torch.Tensor | None, probs: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One DeepEP combine for the backward of ``dispatch``: ``probs`` ``[M, k]`` (0 where
        ``recv_topk_idx`` is ``-1``) rides in the ``topk_weights`` channel, which DeepEP sums per
        slot over the ranks (intranode.cu:865-871, internode.cu:1347-1353) beside the rows.
        Narrow fp32 / fp16 rows share that channel with the probs (two combines only when
        together they are wider than it)."""
        if y is None:
            return None, self._combine(probs, handle, None)[0]
        X, k = y.shape[1], probs.shape[1]
        if not _narrow(y):
            return self._combine(y, handle, probs.float().contiguous())
        if X + k > NARROW_FP32_COLUMNS:
            return DispatchBackend.combine_with_probs(self, y, probs, handle)  # type: ignore[arg-type]
        both = self._combine(torch.cat([y.float(), probs.float()], 1), handle, None)[0]
        return both[:, :X].to(y.dtype), both[:, X:]

    def _combine(
        self, y: torch.Tensor, handle: DispatchHandle, probs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(combine(y), combine of probs or None)``; ``probs`` only with wide rows."""
        state: Any = handle.state
        M, X = y.shape
        out_probs = None
        if _narrow(y):
            width = self.rules.combine_col_multiple(self.internode)
            buffer = self._buffer_for_rows(width)
            dummy = torch.zeros(M, width, dtype=torch.bfloat16, device=y.device)
            weights = y if y.dtype == torch.float32 else y.float()
            _, out_w, event = buffer.combine(
                dummy,
                state.handle,
                topk_weights=weights.contiguous(),
                config=self._configs[1],
                **self._launch_kwargs(),
            )
            self._wait(event)
            out = out_w if y.dtype == torch.float32 else out_w.to(y.dtype)
            back_bytes = self._row_bytes(2 * width, weights=X)
        else:
            cols = max(-(-X // 8) * 8, 8)
            chunks = self._combine_chunks(cols)
            buffer = self._buffer_for_rows(*(c.padded for c in chunks))
            yb = y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)
            parts = []
            for i, c in enumerate(chunks):
                width = min(c.width, X - c.start)
                part = yb[:, c.start : c.start + width]
                pad = c.padded - width
                part = F.pad(part, (0, pad)) if pad else part.contiguous()
                extra = {"topk_weights": probs} if i == 0 and probs is not None else {}
                combined, got_w, event = buffer.combine(
                    part, state.handle, config=self._configs[1], **extra, **self._launch_kwargs()
                )
                self._wait(event)
                parts.append(combined[:, :width])
                out_probs = got_w if extra else out_probs
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if out.dtype != y.dtype:
                out = out.to(y.dtype)
            back_bytes = sum(self._row_bytes(2 * c.padded) for c in chunks)
            if probs is not None:
                back_bytes += self._row_bytes(0, weights=probs.shape[1]) - self._row_bytes(0)
        self._after_normal_kernel()
        self._account("combine", state.links, back_bytes)
        return out, out_probs

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Re-send ``[T, X]`` rows along a dispatch's handle (no host sync)."""
        state: Any = handle.state
        wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        chunks = self._dispatch_chunks(wire.wire_width, num_scales=0, topk=0)
        buffer = self._buffer_for_rows(*(c.padded for c in chunks))
        w = wire.send(x)
        parts = []
        for c in chunks:
            got, *_, event = buffer.dispatch(
                self._chunk(w, c),
                handle=state.handle,
                num_worst_tokens=self.num_worst_tokens,
                config=self._configs[0],
                **self._launch_kwargs(),
            )
            self._wait(event)
            parts.append(got[:, : c.width])
        recv_w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        self._after_normal_kernel()
        if state.valid is not None:
            recv_w = sizing.zero_invalid_rows_(recv_w, state.valid)
        row_bytes = sum(self._row_bytes(2 * c.padded) for c in chunks)
        self._account("cached", state.links, row_bytes)
        return wire.recv(recv_w)
