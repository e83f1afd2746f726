"""The combine side of DeepEP V2's ``ElasticBuffer`` adapter (``elastic.py``): combine, the
dispatch backward's one combine carrying the probs (audit-3 N10), the per-slot weights channel and
the exact fp32 sum of narrow rows. Split out of ``elastic.py`` to keep each file under 700 lines;
``DeepEPV2Backend`` mixes it in and provides ``_buffer``, ``_account``, ``num_sms`` and the
byte counters used here. ``V2DispatchState`` (the handle's state both sides read) lives here
so that the import runs one way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flexdispatch.backends.deepep import refusals, sizing
from flexdispatch.types import DispatchHandle

__all__ = ["ElasticCombineMixin", "V2DispatchState"]

_COMBINE_COL_MULTIPLE = 256  # combine hidden % 256 (impls/combine.cuh:109)
_NARROW_FP32_COLUMNS = sizing.MAX_TOPK  # fp32 rows this narrow are summed exactly


@dataclass(frozen=True, kw_only=True)
class V2DispatchState:
    """The V2 path's part of a ``DispatchHandle``.

    Attributes:
        handle: DeepEP's ``EPHandle``.
        wire: the wire format of the dispatched rows.
        topk: k.
        local: ``[rows, k]`` bool, the received slots holding a local expert (None expanded).
        valid: ``[rows]`` bool real rows in worst-case mode, else None.
        recv_scales: ``[rows, H / 128]`` float32 scales of an fp8 dispatch, else None.
        order: ``[rows]`` int64, DeepEP's row of each returned row (non-expand), else None.
    """

    handle: Any
    wire: sizing.WireFormat
    topk: int
    local: torch.Tensor | None
    valid: torch.Tensor | None
    recv_scales: torch.Tensor | None
    order: torch.Tensor | None = None

    def to_deepep(self, y: torch.Tensor) -> torch.Tensor:
        """Rows in the contract's order back to DeepEP's receive order (``y[i]`` was DeepEP's
        row ``order[i]``)."""
        if self.order is None:
            return y
        return torch.empty_like(y).index_copy_(0, self.order, y)


class ElasticCombineMixin:
    """Combine methods of ``DeepEPV2Backend`` (see the module docstring)."""

    num_sms: int

    def combine_slot_weights(
        self, y: torch.Tensor | None, w: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Combine ``y`` (or a dummy) with ``w`` ``[N]`` in combine's fp32 weights channel, which
        returns ``[T, k]``: each slot the weight of the row it was expanded into."""
        state: V2DispatchState = handle.state
        h = state.handle
        w = w.float().contiguous()
        wide = y is not None and not self._narrow(y)
        if wide:
            assert y is not None
            part = sizing.pad_cols(
                y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16), _COMBINE_COL_MULTIPLE
            )
        else:
            part = torch.zeros(
                w.shape[0], _COMBINE_COL_MULTIPLE, dtype=torch.bfloat16, device=w.device
            )
        buffer = self._buffer(part.shape[1], state.topk)
        self._first_combine(h, part.shape[1], state.topk, weights=True)
        out, out_w, _ = buffer.combine(part, h, topk_weights=w, num_sms=self.num_sms)
        self._account("combine", h, self._combine_row_bytes(part.shape[1], state.topk))
        out_w = sizing.pad_tokens(out_w, handle.num_tokens)
        if y is None:
            return None, out_w
        if not wide:
            return self.combine(y, handle), out_w
        out = sizing.pad_tokens(out[:, : y.shape[1]], handle.num_tokens)
        return (out if out.dtype == y.dtype else out.to(y.dtype)), out_w

    def combine_with_probs(
        self, y: torch.Tensor | None, probs: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The backward of ``dispatch`` in one combine: ``probs`` ``[M, k]`` (0 where the slot
        is not local) rides in the ``topk_weights`` channel, which returns per slot the owner
        rank's value (I/combine_reduce_epilogue.cuh:127-141), i.e. the gradient. Narrow fp32 /
        fp16 rows still take ``_combine_fp32`` (one combine per column), the probs one more.
        """
        state: V2DispatchState = handle.state
        if state.local is None:
            return super().combine_with_probs(y, probs, handle)
        h, k = state.handle, state.topk
        w = state.to_deepep(probs.float()).contiguous()
        if y is not None and self._narrow(y):
            return self.combine(y, handle), self.combine_with_probs(None, probs, handle)[1]
        if y is None:
            part = torch.zeros(
                w.shape[0], _COMBINE_COL_MULTIPLE, dtype=torch.bfloat16, device=w.device
            )
        else:
            part = self._to_deepep_rows(y, state)
        buffer = self._buffer(part.shape[1], k)
        self._first_combine(h, part.shape[1], k, weights=True)
        out, out_w, _ = buffer.combine(part, h, topk_weights=w, num_sms=self.num_sms)
        self._account("combine", h, self._combine_row_bytes(part.shape[1], k))
        out_w = sizing.pad_tokens(out_w, handle.num_tokens)
        if y is None:
            return None, out_w
        out = sizing.pad_tokens(out[:, : y.shape[1]], handle.num_tokens)
        return (out if out.dtype == y.dtype else out.to(y.dtype)), out_w

    # ----------------------------------------------------------------- combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Unweighted sum over the receiving ranks (see the module docstring for precision)."""
        state: V2DispatchState = handle.state
        h = state.handle
        X = y.shape[1]
        k = state.topk
        if self._narrow(y):
            return sizing.pad_tokens(
                self._combine_fp32(state.to_deepep(y), state), handle.num_tokens
            )
        part = self._to_deepep_rows(y, state)
        buffer = self._buffer(part.shape[1], k)
        self._first_combine(h, part.shape[1], k, weights=False)
        out, _, _ = buffer.combine(part, h, num_sms=self.num_sms)
        self._account("combine", h, self._combine_row_bytes(part.shape[1], k))
        out = sizing.pad_tokens(out[:, :X], handle.num_tokens)
        return out if out.dtype == y.dtype else out.to(y.dtype)

    def _first_combine(self, h: Any, columns: int, k: int, *, weights: bool) -> None:
        """A combine's JIT template arguments (refused inside a capture when new: N18)."""
        key = ("combine", columns, k, h.num_max_tokens_per_rank, self.num_sms, weights)
        refusals.first_use(self.deep_ep, (*key, bool(h.do_expand)), "combine")

    @staticmethod
    def _to_deepep_rows(y: torch.Tensor, state: V2DispatchState) -> torch.Tensor:
        """``y`` as DeepEP's combine input: bf16, DeepEP's row order, columns padded to 256.

        One pass over the rows (N11): the un-sort scatters straight into the padded buffer
        instead of an un-sorted copy followed by a padded copy.
        """
        yb = y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)
        if state.order is None:
            return sizing.pad_cols(yb, _COMBINE_COL_MULTIPLE)
        rows, X = yb.shape
        padded = -(-X // _COMBINE_COL_MULTIPLE) * _COMBINE_COL_MULTIPLE
        part = torch.empty(rows, padded, dtype=torch.bfloat16, device=yb.device)
        if padded > X:
            part[:, X:].zero_()
        part[:, :X].index_copy_(0, state.order, yb)
        return part

    @staticmethod
    def _narrow(y: torch.Tensor) -> bool:
        return y.dtype in (torch.float32, torch.float16) and y.shape[1] <= _NARROW_FP32_COLUMNS

    def _combine_fp32(self, y: torch.Tensor, state: V2DispatchState) -> torch.Tensor:
        """Exact fp32 sum of narrow rows through combine's fp32 ``topk_weights`` channel.

        That channel returns, in each top-k slot of a source token, the value sent by the rank
        holding the slot's expert (0 for ``-1`` slots). Each receiving rank puts column ``c`` of
        its row in its first local slot and 0 elsewhere (expanded: each row is one slot), so the
        slots of a token sum (in fp32) to the unweighted sum over the receiving ranks. One
        combine per column.
        """
        h, k = state.handle, state.topk
        local = None if state.local is None else state.to_deepep(state.local)
        rows, X = y.shape
        buffer = self._buffer(_COMBINE_COL_MULTIPLE, k)
        first = None if local is None else F.one_hot(local.to(torch.int8).argmax(1), k).bool()
        if first is not None and local is not None:
            first &= local
        dummy = torch.zeros(rows, _COMBINE_COL_MULTIPLE, dtype=torch.bfloat16, device=y.device)
        self._first_combine(h, _COMBINE_COL_MULTIPLE, k, weights=True)
        yf = y.float()
        cols = []
        for c in range(X):
            if first is None:
                weights = yf[:, c].contiguous()
            else:
                weights = torch.where(first, yf[:, c : c + 1], 0.0).contiguous()
            _, out_w, _ = buffer.combine(dummy, h, topk_weights=weights, num_sms=self.num_sms)
            self._account("combine", h, self._combine_row_bytes(dummy.shape[1], k))
            cols.append(out_w.sum(1))
        T = self._num_tokens(h)
        out = torch.stack(cols, 1) if cols else torch.zeros(T, 0, device=y.device)
        return out.to(y.dtype)
