"""The combine side of the DeepEP 2.5 (``EPBuffer``) adapter (``ep.py``): combine, combine with
the shared experts' bias, the dispatch backward's one combine carrying the probs (audit-3 N10), the
per-slot weights channel and the exact fp32 sum of narrow rows. Split out of ``ep.py`` to keep each
file under 700 lines; ``DeepEPV25Backend`` mixes it in and provides ``_buffer``, ``_run``,
``_count``, ``num_max_tokens_per_rank``, ``num_experts``, ``hybrid`` and ``supports_combine_bias``.

A rank that was over ``W / R`` in worst-case mode with checks off sent only its first tokens
(``ep.py``, ``_check_tokens``; a dropless bound grows instead): every combine here returns
``[T, ...]`` rows, zero (plus the bias) for the tokens it did not send.
"""

from __future__ import annotations

from typing import Any

import torch

from flexdispatch.backends.deepep import sizing
from flexdispatch.backends.deepep.v25.buffer import kernel_key
from flexdispatch.backends.deepep.v25.layout import COMBINE_COLS
from flexdispatch.backends.deepep.v25.rows import V25DispatchState, combine_row_bytes
from flexdispatch.types import DispatchHandle

__all__ = ["EPCombineMixin", "sent_tokens"]

_NARROW = sizing.MAX_TOPK  # fp32 rows this narrow are summed exactly


class EPCombineMixin:
    """Combine methods of ``DeepEPV25Backend`` (see the module docstring)."""

    num_max_tokens_per_rank: int
    num_experts: int
    hybrid: bool
    _buffer: Any
    _run: Any
    _count: Any
    supports_combine_bias: Any  # (dtype) -> Capability

    def _combine_call(
        self,
        part: torch.Tensor,
        state: V25DispatchState,
        weights: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, k = state.handle, state.topk
        buffer = self._buffer(part.shape[1], k)
        key = kernel_key(
            "combine",
            M=h.num_max_tokens_per_rank,  # the handle's (a dropless bound may have grown)
            hidden=part.shape[1],
            k=k,
            E=self.num_experts,
            expand=bool(h.do_expand),
            sms=state.sms,
            hybrid=self.hybrid,
        )
        out, out_w, _ = self._run(
            key,
            "combine",
            lambda: buffer.combine(part, h, topk_weights=weights, bias=bias, num_sms=state.sms),
        )
        row = combine_row_bytes(part.shape[1], k)
        t = state.traffic
        self._count(t.device, [0, 0, t[1] * row, t[2] * row])
        return out, out_w

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Unweighted sum over the receiving ranks (module docstring for precision)."""
        return self.combine_bias(y, handle, None)

    def combine_bias(
        self, y: torch.Tensor, handle: DispatchHandle, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``combine(y) + bias`` with the bias added inside DeepEP's reduction (bf16 rows; one
        rounding of the sum, where a separate add rounds twice).

        Args:
            y: ``[rows, X]`` rows as dispatched.
            bias: ``[T, X]`` rows of ``y``'s dtype (bf16 to be fused), or None.
        """
        state: V25DispatchState = handle.state
        X = y.shape[1]
        yd = state.to_deepep(y)
        if bias is not None and not self.supports_combine_bias(y.dtype)[0]:
            return self.combine_bias(y, handle, None) + bias
        if self._narrow(y):
            out = sizing.pad_tokens(self._combine_fp32(yd, state), handle.num_tokens)
            return out if bias is None else out + bias
        yb = yd if yd.dtype == torch.bfloat16 else yd.to(torch.bfloat16)
        part = sizing.pad_cols(yb, COMBINE_COLS)
        sent = sent_tokens(state)
        b = None if bias is None else sizing.pad_cols(bias[:sent], COMBINE_COLS)
        out, _ = self._combine_call(part, state, bias=b)
        out = out[:, :X]
        out = out if out.dtype == y.dtype else out.to(y.dtype)
        if sent < handle.num_tokens:  # NOTE: tokens not sent (N7): zero rows, plus the bias
            tail = out.new_zeros(handle.num_tokens - sent, X) if bias is None else bias[sent:]
            out = torch.cat([out, tail.to(out.dtype)])
        return out

    @staticmethod
    def _narrow(y: torch.Tensor) -> bool:
        return y.dtype in (torch.float32, torch.float16) and y.shape[1] <= _NARROW

    def _combine_fp32(self, y: torch.Tensor, state: V25DispatchState) -> torch.Tensor:
        """Exact fp32 sum of narrow rows (DeepEP's order) through combine's fp32
        ``topk_weights`` channel: each slot returns the value the rank owning it sent, so each
        rank puts column ``c`` in its first local slot (expanded: each row is one slot). One
        combine per column."""
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
        T = int(state.handle.topk_idx.shape[0])
        out = torch.stack(cols, 1) if cols else torch.zeros(T, 0, device=y.device)
        return out.to(y.dtype)

    def combine_with_probs(
        self, y: torch.Tensor | None, probs: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``dispatch``'s backward in one combine, probs in the weights channel (audit N10)."""
        state: V25DispatchState = handle.state
        if state.local is None or (y is not None and self._narrow(y)):
            return super().combine_with_probs(y, probs, handle)
        w = state.to_deepep(probs.float()).contiguous()
        part = torch.zeros(w.shape[0], COMBINE_COLS, dtype=torch.bfloat16, device=w.device)
        if y is not None:
            yd = state.to_deepep(y)
            part = sizing.pad_cols(
                yd if yd.dtype == torch.bfloat16 else yd.to(torch.bfloat16), COMBINE_COLS
            )
        out, out_w = self._combine_call(part, state, weights=w)  # out_w: owner rank's value
        assert out_w is not None
        out_w = sizing.pad_tokens(out_w, handle.num_tokens)
        if y is None:
            return None, out_w
        out = sizing.pad_tokens(out[:, : y.shape[1]], handle.num_tokens)
        return (out if out.dtype == y.dtype else out.to(y.dtype)), out_w

    def combine_slot_weights(
        self, y: torch.Tensor | None, w: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The backward of ``dispatch_expanded``: ``y`` (or a dummy) combined with ``w`` ``[N]``
        in the fp32 weights channel, which returns ``[T, k]``: each slot the weight of the row it
        was expanded into."""
        state: V25DispatchState = handle.state
        w = w.float().contiguous()
        wide = y is not None and not self._narrow(y)
        if wide:
            assert y is not None
            part = sizing.pad_cols(
                y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16), COMBINE_COLS
            )
        else:
            part = torch.zeros(w.shape[0], COMBINE_COLS, dtype=torch.bfloat16, device=w.device)
        out, out_w = self._combine_call(part, state, weights=w)
        assert out_w is not None
        out_w = sizing.pad_tokens(out_w, handle.num_tokens)
        if y is None:
            return None, out_w
        if not wide:
            return self.combine(y, handle), out_w
        out = sizing.pad_tokens(out[:, : y.shape[1]], handle.num_tokens)
        return (out if out.dtype == y.dtype else out.to(y.dtype)), out_w


def sent_tokens(state: V25DispatchState) -> int:
    """Tokens the dispatch behind ``state`` sent (fewer than T when a rank was over its bound)."""
    return int(state.handle.topk_idx.shape[0])
