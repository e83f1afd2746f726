"""What ``FlexDispatcher`` adds for DeepEP 2.5: a combine that adds a bias inside its reduction,
a dispatch that returns before its rows (``PendingDispatch``), and ``warmup``.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · k top-k · M received rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flexdispatch._validate import check_tensor
from flexdispatch.backends.base import DispatchBackend
from flexdispatch.types import DispatchHandle, ExpandedDispatchResult

if TYPE_CHECKING:
    from flexdispatch.dispatcher import FlexDispatcher

__all__ = ["CombineBias", "PendingDispatch", "combine_with_bias", "warmup"]


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
) -> torch.Tensor:
    """``FlexDispatcher.combine(y, handle, bias=bias)``: inside the reduction where the backend
    supports it for y's dtype (``CombineBias``), else ``plain(backend, handle, y) + bias``."""
    check_tensor("bias", bias, ndim=2, floating=True)
    if tuple(bias.shape) != (handle.num_tokens, handle.hidden) or bias.dtype != y.dtype:
        raise ValueError(
            f"bias must be a [{handle.num_tokens}, {handle.hidden}] tensor of y's dtype {y.dtype} "
            f"(one row per dispatched token), got {tuple(bias.shape)} {bias.dtype}"
        )
    if backend.supports_combine_bias(y.dtype)[0]:
        return CombineBias.apply(backend, handle, y, bias.contiguous())
    return plain(backend, handle, y) + bias


class PendingDispatch:
    """An expanded dispatch in flight (``FlexDispatcher.dispatch_expanded_start``).

    ``wait()`` returns its ``ExpandedDispatchResult`` (once). Between the two, the caller may run
    work that does not need the received rows (a layer's shared experts): on DeepEP 2.5 the rows
    are still moving then (``defer_epilogue``); other backends finished at the start.
    """

    def __init__(self, finish: Callable[[], ExpandedDispatchResult]) -> None:
        self._finish: Callable[[], ExpandedDispatchResult] | None = finish

    def wait(self) -> ExpandedDispatchResult:
        """The dispatch's result (differentiable in ``x`` and ``topk_probs`` as ever)."""
        if self._finish is None:
            raise RuntimeError("PendingDispatch.wait() was already called")
        finish, self._finish = self._finish, None
        return finish()


def warmup(
    dispatcher: FlexDispatcher,
    hidden_size: int,
    topk: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    expanded: bool | None = None,
    backward: bool = True,
) -> None:
    """``FlexDispatcher.warmup``: one dispatch (expanded and / or not), combine with a bias and
    backward of zero tokens, every rank at once, so that every kernel they use has run."""
    for name, value in (("hidden_size", hidden_size), ("topk", topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"warmup: {name} must be a positive int, got {value!r}")
    device = dispatcher._comm_device
    modes = [False, True] if expanded is None else [expanded]
    if not dispatcher.backend.supports_expanded()[0]:
        if expanded:
            raise ValueError(f"warmup(expanded=True): {dispatcher.backend.supports_expanded()[1]}")
        modes = [False]
    for exp in modes:
        with torch.enable_grad():
            x = torch.zeros(0, hidden_size, dtype=dtype, device=device, requires_grad=backward)
            p = torch.zeros(0, topk, dtype=torch.float32, device=device, requires_grad=backward)
            idx = torch.zeros(0, topk, dtype=torch.int64, device=device)
            res: Any
            if exp:
                res = dispatcher.dispatch_expanded(x, idx, p)
                y = res.recv_x * res.recv_probs[:, None].to(dtype)
            else:
                res = dispatcher.dispatch(x, idx, p)
                y = res.recv_x * res.recv_topk_probs.sum(1, keepdim=True).to(dtype)
            bias = torch.zeros(0, hidden_size, dtype=dtype, device=device)
            out = dispatcher.combine(y, res.handle, bias=bias)
            if backward:
                out.float().sum().backward()
