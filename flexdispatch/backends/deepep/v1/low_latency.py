"""Low-latency (decode) half of the ``deepep`` backend: DeepEP's IBGDA/NVLink decode kernels.

Shape letters (ARCHITECTURE.md): T tokens on this rank (at most ``num_max`` per call) · H hidden ·
E experts · R ranks · e = E / R local experts · k top-k · C = R * num_max rows per local expert.

``low_latency_dispatch`` sends one row per ``(token, expert)`` pair and returns the expert-major
``[e, C, H]`` layout of ``flexdispatch.dispatch.decode`` (bf16, or fp8 with per-128-channel scales);
``low_latency_combine`` sends the expert outputs back and reduces them *weighted* by the routing
probs at the source. Shapes are static, so both can be captured in a CUDA graph.

DeepEP's rules the mixin enforces (``rules``, per release): bf16 rows, H in the compiled
list, k <= 11, at most ``num_max_dispatch_tokens_per_rank`` tokens, ``(R * num_max) % 4 == 0`` and
enough ``NVSHMEM_QP_DEPTH`` (checked when the backend is built); the shared buffer is cleaned
before a low-latency kernel whenever a normal kernel used it since the last clean; a result lives in
the shared buffer's memory, so combining it after a normal kernel ran on that buffer, after the
buffer was reallocated, or after two more low-latency kernels ran (DeepEP alternates two halves)
is an error, not silent garbage. Not exposed: ``return_recv_hook`` / ``async_finish`` overlap,
zero-copy and LogFMT combine.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from flexdispatch._checks.tensors import is_capturing
from flexdispatch.backends.deepep import sizing
from flexdispatch.types import DispatchStats, ExpertMajorHandle, ExpertMajorResult

__all__ = ["LowLatencyMixin"]


class LowLatencyMixin:
    """``low_latency_dispatch`` / ``low_latency_combine`` of ``DeepEPV1Backend``."""

    name: str
    mode: str
    num_ranks: int
    num_experts: int
    num_max_dispatch_tokens_per_rank: int
    use_fp8: bool
    topk_idx_dtype: torch.dtype
    deep_ep: ModuleType
    stats: DispatchStats
    rules: Any
    _shared: Any
    _ll_dirty: bool

    def _ensure_buffer(self, need: sizing.BufferSize) -> Any:  # provided by DeepEPV1Backend
        raise NotImplementedError

    def _required_size(self, row_bytes: int, hidden: int | None = None) -> sizing.BufferSize:
        raise NotImplementedError

    def low_latency_tokens(self) -> int | None:
        """``num_max_dispatch_tokens_per_rank`` in ``mode='low_latency'``, else None."""
        return self.num_max_dispatch_tokens_per_rank if self.mode == "low_latency" else None

    def _check_low_latency_mode(self) -> None:
        if self.mode != "low_latency":
            raise ValueError(
                "low-latency kernels need DispatchConfig(mode='low_latency') for the deepep backend"
            )

    def low_latency_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> ExpertMajorResult:
        """DeepEP ``low_latency_dispatch``: expert-major ``[e, R * num_max, H]`` rows.

        Args:
            x: ``[T, H]`` bf16, ``T <= num_max_dispatch_tokens_per_rank``, H in DeepEP's list.
            topk_idx: ``[T, k]`` global expert ids (``k <= 11``).
            topk_probs: ``[T, k]`` float32 weights, kept for the weighted combine.

        Raises:
            ValueError: wrong mode, dtype or shape (DeepEP's limits, named).
        """
        self._check_low_latency_mode()
        T, H = x.shape
        k = topk_idx.shape[1]
        n = self.num_max_dispatch_tokens_per_rank
        if x.dtype != torch.bfloat16:
            raise TypeError(
                f"low-latency dispatch takes bf16 rows, got {x.dtype}: use x.bfloat16()"
            )
        ok, why = sizing.check_low_latency(
            hidden=H,
            topk=k,
            num_experts=self.num_experts,
            num_ranks=self.num_ranks,
            num_max_dispatch_tokens_per_rank=n,
            hidden_sizes=self.rules.low_latency_hidden_sizes,
        )
        if not ok:
            raise ValueError(why)
        if n < T:
            raise ValueError(f"{T} tokens exceed num_max_dispatch_tokens_per_rank={n}")
        buffer = self._ensure_buffer(self._required_size(2 * H, hidden=H))
        self._clean_if_dirty(buffer, H)
        idx = topk_idx.to(self.topk_idx_dtype).contiguous()
        recv, count, handle, _event, _hook = buffer.low_latency_dispatch(
            x.contiguous(), idx, n, self.num_experts, use_fp8=self.use_fp8
        )
        shared = self._shared
        shared.low_latency_calls += 1
        shared.low_latency_captured |= is_capturing()
        generation = (shared.generation, shared.normal_calls, shared.low_latency_calls)
        self.stats.extra["low_latency_calls"] = self.stats.extra.get("low_latency_calls", 0) + 1
        recv_x, recv_scales = recv if self.use_fp8 else (recv, None)
        return ExpertMajorResult(
            recv_x=recv_x,
            recv_scales=recv_scales,
            num_recv_tokens_per_expert=count.to(torch.int64),
            handle=ExpertMajorHandle(
                backend=self.name,
                num_tokens=T,
                hidden=H,
                capacity=self.num_ranks * n,
                topk_idx=idx,
                topk_probs=topk_probs.to(torch.float32).contiguous(),
                generation=shared.low_latency_calls,
                state=(handle, generation),
            ),
        )

    def low_latency_combine(self, y: torch.Tensor, handle: ExpertMajorHandle) -> torch.Tensor:
        """DeepEP ``low_latency_combine``: ``[T, H]`` bf16 weighted sum at the source tokens.

        Raises:
            ValueError: the result is stale — DeepEP keeps only two low-latency results alive,
                and two more low-latency kernels ran since this one.
        """
        self._check_low_latency_mode()
        if handle.backend != self.name or handle.generation <= 0:
            raise TypeError("handle must come from this backend's low_latency_dispatch")
        inner, (buffers, normals, calls) = handle.state
        shared = self._shared
        if shared.generation != buffers or shared.buffer is None:
            raise ValueError(
                "stale low-latency result: the shared DeepEP buffer was reallocated since its "
                "dispatch (a dispatcher on this group needed a larger one), so its rows are gone: "
                "combine each low-latency dispatch before any call that grows the buffer"
            )
        if shared.normal_calls != normals:
            raise ValueError(
                "stale low-latency result: a normal DeepEP kernel ran on the shared buffer since "
                "its dispatch and overwrote the low-latency rows; combine each low-latency "
                "dispatch before running normal dispatch/combine on the same group"
            )
        age = shared.low_latency_calls - calls
        if age >= 2:
            raise ValueError(
                f"stale low-latency result: {age} low-latency kernels ran since its dispatch, but "
                f"DeepEP keeps only two results alive (its buffers are reused): combine each "
                f"dispatch before issuing a third low-latency kernel"
            )
        buffer = shared.buffer
        out, _event, _hook = buffer.low_latency_combine(
            y.to(torch.bfloat16).contiguous(), handle.topk_idx, handle.topk_probs, inner
        )
        shared.low_latency_calls += 1
        return out

    def _clean_if_dirty(self, buffer: Any, hidden: int) -> None:
        """DeepEP: after a normal kernel used the buffer, clean it before any low-latency kernel."""
        if self._ll_dirty:
            buffer.clean_low_latency_buffer(
                self.num_max_dispatch_tokens_per_rank, hidden, self.num_experts
            )
            self._ll_dirty = False
