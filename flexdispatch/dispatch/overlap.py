"""What ``FlexDispatcher`` adds for DeepEP 2.5: a combine that adds a bias inside its reduction,
a dispatch that returns before its rows (``PendingDispatch``; also DeepEP V1 with
``deepep_async_finish``, ``start_dispatch``), and ``warmup``.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · k top-k · M received rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flexdispatch._checks.tensors import check_tensor
from flexdispatch.backends.base import DispatchBackend
from flexdispatch.dispatch import ops as _ops
from flexdispatch.types import DispatchHandle, DispatchLayout, ExpandedDispatchResult

__all__ = [
    "CombineBias",
    "DispatchExpanded",
    "PendingDispatch",
    "combine_with_bias",
    "start_dispatch",
    "warmup",
]


class CombineBias(torch.autograd.Function):
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


def combine_with_bias(
    backend: DispatchBackend,
    handle: DispatchHandle,
    y: torch.Tensor,
    bias: torch.Tensor,
    plain: Callable[[DispatchBackend, DispatchHandle, torch.Tensor], torch.Tensor],
    *,
    grad: bool = True,
) -> torch.Tensor:
    """``FlexDispatcher.combine(y, handle, bias=bias)``: inside the reduction where the backend
    supports it for y's dtype (``CombineBias``; ``grad`` False: the backend alone, as inside the
    ``flexdispatch::combine`` op), else ``plain(backend, handle, y) + bias``."""
    check_tensor("bias", bias, ndim=2, floating=True)
    if tuple(bias.shape) != (handle.num_tokens, handle.hidden) or bias.dtype != y.dtype:
        raise ValueError(
            f"bias must be a [{handle.num_tokens}, {handle.hidden}] tensor of y's dtype {y.dtype} "
            f"(one row per dispatched token), got {tuple(bias.shape)} {bias.dtype}"
        )
    if backend.supports_combine_bias(y.dtype)[0]:
        if not grad:
            return backend.combine_bias(y, handle, bias.contiguous())
        return CombineBias.apply(backend, handle, y, bias.contiguous())
    return plain(backend, handle, y) + bias


class DispatchExpanded(torch.autograd.Function):
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
            res = backend.finish_expanded(pending)  # type: ignore[attr-defined]
        else:
            res = backend.dispatch_expanded(x, topk_idx, topk_probs)
        ctx.backend = backend
        ctx.handle = res.handle
        ctx.x_dtype = x[0].dtype if isinstance(x, tuple) else x.dtype
        ctx.device = res.recv_x.device
        frozen = [res.tokens_per_expert]
        if isinstance(x, tuple):  # fp8 pass-through: forward-only rows
            frozen.append(res.recv_x)
        ctx.mark_non_differentiable(*frozen)
        return res.recv_x, res.recv_probs, res.tokens_per_expert, res.handle

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


class PendingDispatch:
    """An expanded dispatch in flight (``FlexDispatcher.dispatch_expanded_start``).

    ``wait()`` returns its ``ExpandedDispatchResult`` (``DispatchResult`` from
    ``dispatch_start``) (once). Between the two, the caller may run
    work that does not need the received rows (a layer's shared experts): on DeepEP 2.5 the rows
    are still moving then (``defer_epilogue``); other backends finished at the start. ``ready``,
    when given, runs first and may refuse the wait now (DeepEP 2.5: inside a CUDA-graph capture
    the dispatch was not launched in); a refused wait can be called again later.
    """

    def __init__(
        self,
        finish: Callable[[], ExpandedDispatchResult],
        ready: Callable[[], None] | None = None,
    ) -> None:
        self._finish: Callable[[], ExpandedDispatchResult] | None = finish
        self._ready = ready

    def wait(self) -> ExpandedDispatchResult:
        """The dispatch's result (differentiable in ``x`` and ``topk_probs`` as ever)."""
        if self._finish is None:
            raise RuntimeError("PendingDispatch.wait() was already called")
        if self._ready is not None:
            self._ready()
        finish, self._finish = self._finish, None
        return finish()


def start_dispatch(
    dispatcher: Any,  # a FlexDispatcher (not imported: dispatcher.py imports this module)
    x: Any,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    layout: DispatchLayout | None,
) -> PendingDispatch:
    """``FlexDispatcher.dispatch_start``: where the backend can (``supports_dispatch_overlap``:
    DeepEP V1 with ``deepep_async_finish``), launch the dispatch now and finish it, through the
    usual autograd path, at ``.wait()``; elsewhere dispatch at once (audit N13)."""
    backend = dispatcher.backend
    overlap = getattr(backend, "supports_dispatch_overlap", None)
    # NOTE: through the custom ops (torch.compile) a launched dispatch cannot cross the op: at once
    if overlap is None or not overlap()[0] or _ops.use_ops():
        res = dispatcher.dispatch(x, topk_idx, topk_probs, layout=layout)
        return PendingDispatch(lambda: res)  # type: ignore[arg-type,return-value]
    dispatcher._deferred_parts = None
    topk_idx = dispatcher._check_inputs(x, topk_idx, topk_probs, layout)
    rows = (x[0].contiguous(), x[1].contiguous()) if isinstance(x, tuple) else x.contiguous()
    idx, probs = topk_idx.contiguous(), topk_probs.contiguous()
    with torch.no_grad():
        pending = backend.launch_dispatch(rows, idx, probs, layout)  # type: ignore[attr-defined]
    return PendingDispatch(
        lambda: dispatcher.dispatch(rows, idx, probs, layout=layout, _pending=pending)  # type: ignore[arg-type,return-value]
    )


def warmup(
    dispatcher: Any,  # a FlexDispatcher (not imported: dispatcher.py imports this module)
    hidden_size: int,
    topk: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    expanded: bool | None = None,
    backward: bool = True,
) -> None:
    """``FlexDispatcher.warmup``: one dispatch (expanded and / or not), combine with a bias and
    backward of zero tokens, every rank at once, so that every kernel they use has run.

    ``dtype=torch.float8_e4m3fn`` warms the fp8 dispatch (DeepEP's ``(x, scales)`` tuple, the
    ``ceil(H / 128)`` float32 scale columns the dispatcher takes; the scale width is a template
    argument of DeepEP 2.5's kernels) and, with ``backward``, the cached dispatch of its combine's
    backward."""
    for name, value in (("hidden_size", hidden_size), ("topk", topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"warmup: {name} must be a positive int, got {value!r}")
    fp8 = dtype == torch.float8_e4m3fn
    device = dispatcher._comm_device
    modes = [False, True] if expanded is None else [expanded]
    if not dispatcher.backend.supports_expanded()[0]:
        if expanded:
            raise ValueError(f"warmup(expanded=True): {dispatcher.backend.supports_expanded()[1]}")
        modes = [False]
    for exp in modes:
        with torch.enable_grad():
            p = torch.zeros(0, topk, dtype=torch.float32, device=device, requires_grad=backward)
            idx = torch.zeros(0, topk, dtype=torch.int64, device=device)
            x: Any
            if fp8:
                cols = -(-hidden_size // 128)
                x = (
                    torch.zeros(0, hidden_size, dtype=dtype, device=device),
                    torch.zeros(0, cols, dtype=torch.float32, device=device),
                )
                row = torch.bfloat16
            else:
                x = torch.zeros(0, hidden_size, dtype=dtype, device=device, requires_grad=backward)
                row = dtype
            res: Any
            if exp:
                res = dispatcher.dispatch_expanded(x, idx, p)
                y = res.recv_x.to(row) * res.recv_probs[:, None].to(row)
            else:
                res = dispatcher.dispatch(x, idx, p)
                y = res.recv_x.to(row) * res.recv_topk_probs.sum(1, keepdim=True).to(row)
            bias = torch.zeros(0, hidden_size, dtype=row, device=device)
            out = dispatcher.combine(y, res.handle, bias=bias)
            if backward:
                out.float().sum().backward()
