"""The autograd Functions of ``FlexDispatcher``'s eager path.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · k top-k · M received rows.

``_Dispatch`` / ``_Combine`` wrap the backend's no-grad primitives where autograd records the call
(the rules are in ``flexdispatch.dispatch.dispatcher``'s docstring); ``flexdispatch.dispatch.ops``
registers the same rules on its custom ops, which ``torch.compile`` traces instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flexdispatch.backends.base import DispatchBackend
from flexdispatch.types import DispatchHandle, DispatchResult

__all__ = [
    "ROW_DTYPES",
    "CombineBiasFunction",
    "CombineFunction",
    "DispatchExpandedFunction",
    "DispatchFunction",
    "Rows",
    "backend_combine",
    "records_grad",
]

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""``x`` of ``dispatch``: ``[T, H]`` rows, or (deepep only) an ``(fp8 rows, scales)`` tuple."""


def records_grad(*tensors: Rows) -> bool:
    """Whether autograd would record a call on ``tensors``: grad mode on and one of them
    requiring grad (an fp8 tuple never does)."""
    grads = [t.requires_grad for t in tensors if isinstance(t, torch.Tensor)]
    return torch.is_grad_enabled() and any(grads)


class DispatchFunction(torch.autograd.Function):
    """Differentiable in ``x`` and ``topk_probs``; ``topk_idx`` and the counts are integer.
    ``run`` is the backend call that dispatches them (or finishes a launched dispatch of them)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        backend: DispatchBackend,
        run: Callable[[], DispatchResult],
        x: Rows,
        topk_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle, int | None]:
        res = run()
        ctx.backend = backend
        ctx.handle = res.handle
        ctx.x_dtype = x[0].dtype if isinstance(x, tuple) else x.dtype
        ctx.save_for_backward(res.recv_topk_idx)
        frozen = [res.recv_topk_idx, res.num_recv_tokens_per_expert]
        if isinstance(x, tuple):  # fp8 pass-through: forward-only rows
            frozen.append(res.recv_x)
        ctx.mark_non_differentiable(*frozen)  # NOTE: one call; a second replaces the first
        return (
            res.recv_x,
            res.recv_topk_idx,
            res.recv_topk_probs,
            res.num_recv_tokens_per_expert,
            res.handle,
            res.num_recv_pairs,
        )

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        grad_x: torch.Tensor | None,
        _grad_idx: Any,
        grad_probs: torch.Tensor | None,
        _grad_counts: Any,
        _grad_handle: Any,
        _grad_pairs: Any,
    ) -> tuple[None, None, torch.Tensor | None, torch.Tensor | None]:
        (recv_idx,) = ctx.saved_tensors
        backend: DispatchBackend = ctx.backend
        handle: DispatchHandle = ctx.handle
        dx = dp = None
        want_x = ctx.needs_input_grad[2]
        # NOTE: every rank must run the same collectives; a missing gradient becomes zeros.
        if want_x:
            if grad_x is None:
                grad_x = torch.zeros(
                    recv_idx.shape[0], handle.hidden, dtype=ctx.x_dtype, device=recv_idx.device
                )
            grad_x = grad_x.contiguous()
        if ctx.needs_input_grad[3]:
            if grad_probs is None:
                grad_probs = torch.zeros(
                    recv_idx.shape, dtype=torch.float32, device=recv_idx.device
                )
            masked = torch.where(recv_idx >= 0, grad_probs.to(torch.float32), 0.0)
            # NOTE: one call: DeepEP carries both in one combine
            dx, dp = backend.combine_with_probs(grad_x if want_x else None, masked, handle)
        elif want_x:
            dx = backend.combine(grad_x, handle)
        return None, None, dx, dp


class CombineFunction(torch.autograd.Function):
    """Differentiable in ``y``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, backend: DispatchBackend, handle: DispatchHandle, y: torch.Tensor
    ) -> torch.Tensor:
        ctx.backend = backend
        ctx.handle = handle
        return backend.combine(y, handle)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[None, None, torch.Tensor]:
        return None, None, ctx.backend.cached_dispatch(grad_out.contiguous(), ctx.handle)


def backend_combine(
    backend: DispatchBackend, handle: DispatchHandle, y: torch.Tensor
) -> torch.Tensor:
    """``CombineFunction.apply`` without the autograd Function (inside the
    ``flexdispatch::combine`` op)."""
    return backend.combine(y, handle)


class DispatchExpandedFunction(torch.autograd.Function):
    """``dispatch_expanded``, differentiable in ``x`` and ``topk_probs``; with ``pending`` (a
    ``launch_expanded`` in flight) the forward only finishes it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        backend: DispatchBackend,
        pending: Any,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
        if pending is not None:
            res = backend.finish_expanded(pending)
        else:
            res = backend.dispatch_expanded(x, topk_idx, topk_probs)
        ctx.backend = backend
        ctx.handle = res.handle
        ctx.x_dtype = x[0].dtype if isinstance(x, tuple) else x.dtype
        ctx.device = res.recv_x.device
        frozen = [res.num_recv_tokens_per_expert]
        if isinstance(x, tuple):  # fp8 pass-through: forward-only rows
            frozen.append(res.recv_x)
        ctx.mark_non_differentiable(*frozen)
        return res.recv_x, res.recv_topk_probs, res.num_recv_tokens_per_expert, res.handle

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        grad_x: torch.Tensor | None,
        grad_probs: torch.Tensor | None,
        _grad_counts: Any,
        _grad_handle: Any,
    ) -> tuple[None, None, torch.Tensor | None, None, torch.Tensor | None]:
        backend: DispatchBackend = ctx.backend
        handle: DispatchHandle = ctx.handle
        N = handle.num_recv_rows
        dx = dp = None
        want_x, want_p = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        device = ctx.device
        # NOTE: every rank must run the same collectives; a missing gradient becomes zeros.
        if want_x and grad_x is None:
            grad_x = torch.zeros(N, handle.hidden, dtype=ctx.x_dtype, device=device)
        if want_p:
            if grad_probs is None:
                grad_probs = torch.zeros(N, dtype=torch.float32, device=device)
            dx, dp = backend.combine_slot_weights(
                grad_x.contiguous() if want_x and grad_x is not None else None,
                grad_probs.to(torch.float32),
                handle,
            )
        elif want_x and grad_x is not None:
            dx = backend.combine(grad_x.contiguous(), handle)
        return None, None, dx, None, dp


class CombineBiasFunction(torch.autograd.Function):
    """``combine(y) + bias`` with the bias inside the backend's reduction; differentiable in
    ``y`` (the backward is a cached dispatch) and ``bias`` (the output's gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        backend: DispatchBackend,
        handle: DispatchHandle,
        y: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        ctx.backend = backend
        ctx.handle = handle
        return backend.combine_bias(y, handle, bias)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[None, None, torch.Tensor, torch.Tensor]:
        g = grad_out.contiguous()
        return None, None, ctx.backend.cached_dispatch(g, ctx.handle), g
