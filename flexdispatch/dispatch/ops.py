"""``torch.library`` custom ops for dispatch and combine (namespace ``flexdispatch``).

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · k top-k · e local experts ·
M received rows · W worst-case rows.

``FlexDispatcher.dispatch`` / ``combine`` go through these ops while ``torch.compile`` traces them
(and in eager mode after ``set_eager_ops(True)``), so that dynamo and AOTAutograd see one opaque
op per call with a fake (meta) implementation and a registered backward, and selective activation
checkpointing can name them. Elsewhere the dispatcher keeps its cheaper eager path (its autograd
Functions, or the backend directly without grad): both run the same backend calls, bit for bit.

Ops (docs/compile.md): ``flexdispatch::dispatch``, ``flexdispatch::combine`` (differentiable),
and their backward halves ``flexdispatch::combine_with_probs`` and
``flexdispatch::cached_dispatch``.

Python objects cannot cross an op boundary, so two int ids stand for them:

- the dispatcher: its issuer serial (``DispatchHandle.issuer``) in a ``[1]`` int64 CPU tensor
  (``FlexDispatcher._op_id``), looked up in a weak registry (a dispatcher that is gone has no
  entry). A tensor, not an int: dynamo guards on an int it reads (one compiled graph per layer,
  and ``fullgraph=True`` fails past the recompile limit), while a tensor is a graph input, so
  identical layers share one graph;
- the handle: the dispatch op returns a ``[2]`` int64 CPU tensor ``(handle id, num_recv_pairs or
  -1)``; the ``DispatchHandle`` it names stays in a registry exactly as long as that tensor lives
  (a weak reference to its storage drops the entry), which is as long as the ``DispatchResult``
  (whose ``handle.state`` it is), an autograd graph that saved it, or an alias of it lives.
  Nothing about a call is kept on the dispatcher.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from flexdispatch.types import DispatchHandle, DispatchLayout, DispatchResult, check_handle

__all__ = [
    "eager_ops",
    "live_handles",
    "register_dispatcher",
    "set_eager_ops",
    "use_ops",
]

_EAGER = [False]  # set_eager_ops; a list so the flag is switched in place
_DISPATCHERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HANDLES: dict[int, tuple[DispatchHandle, weakref.ref]] = {}
_IDS = itertools.count(1)


def set_eager_ops(enabled: bool) -> bool:
    """Route eager ``dispatch`` / ``combine`` calls through the custom ops too (default off: only
    under ``torch.compile``). Needed where something must see the ops in eager mode: selective
    activation checkpointing's policy, a dispatch mode that saves or types them. Costs about
    15 us of host time per op. Returns the previous setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    before, _EAGER[0] = _EAGER[0], enabled
    return before


def eager_ops() -> bool:
    """Whether eager calls go through the custom ops (``set_eager_ops``)."""
    return _EAGER[0]


def use_ops() -> bool:
    """Whether a ``dispatch`` / ``combine`` call now goes through the custom ops: while
    ``torch.compile`` traces it, or in eager mode after ``set_eager_ops(True)``."""
    return torch.compiler.is_compiling() or _EAGER[0]


def register_dispatcher(issuer: int, dispatcher: Any) -> None:
    """Let the ops find ``dispatcher`` by its issuer serial (held weakly)."""
    _DISPATCHERS[issuer] = dispatcher


def live_handles() -> int:
    """How many handles the registry holds now (tests: it must not leak)."""
    return len(_HANDLES)


def _id_tensor(t: object, name: str, n: int, what: str) -> None:
    """Refuse an id tensor that is not ``[n]`` int64 on the CPU (an op called directly: an empty
    tensor raised ``IndexError``, a float one was truncated to an id). Metadata only."""
    if not (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.int64
        and t.device.type == "cpu"
        and t.shape == (n,)
    ):
        got = (
            f"{t.dtype} {tuple(t.shape)} on {t.device}"
            if isinstance(t, torch.Tensor)
            else type(t).__name__
        )
        raise ValueError(
            f"flexdispatch ops: {name} must be {what}, a [{n}] int64 CPU tensor; got {got}"
        )


def _same_int(op: str, name: str, given: int, held: int, whose: str) -> None:
    """Refuse an int argument of op ``op`` that disagrees with the dispatcher's or the handle's
    (the fake rule sizes the traced outputs from it: a disagreement would be a wrong shape)."""
    if given != held:
        raise ValueError(
            f"flexdispatch::{op}: {name}={given} but {whose} has {held}: pass {whose}'s value "
            f"(as FlexDispatcher.dispatch / combine do)"
        )


def _dispatcher(op_id: torch.Tensor) -> Any:
    _id_tensor(op_id, "dispatcher", 1, "the dispatcher's id (FlexDispatcher._op_id)")
    issuer = int(op_id[0])  # NOTE: a CPU tensor: no device sync
    d = _DISPATCHERS.get(issuer)
    if d is None:
        raise RuntimeError(
            f"flexdispatch: no live FlexDispatcher #{issuer} in this process (the op was called "
            f"with the serial of a dispatcher that is gone or was built in another process)"
        )
    return d


def _forget(hid: int, _ref: weakref.ref) -> None:
    _HANDLES.pop(hid, None)


def _register(handle: DispatchHandle, pairs: int | None) -> torch.Tensor:
    """The ``[2]`` int64 CPU tensor ``(id, pairs or -1)`` naming ``handle`` while it lives."""
    hid = next(_IDS)
    t = torch.tensor([hid, -1 if pairs is None else pairs], dtype=torch.int64, device="cpu")
    # NOTE: a weak reference to the storage, not to the tensor: an alias (``detach()``, as
    # selective checkpointing caches outputs) keeps the entry alive as the storage does
    _HANDLES[hid] = (handle, weakref.ref(t.untyped_storage(), functools.partial(_forget, hid)))
    return t


def _handle(handle_t: torch.Tensor) -> DispatchHandle:
    _id_tensor(handle_t, "handle", 2, "the handle tensor flexdispatch::dispatch returned")
    hid = int(handle_t[0])
    entry = _HANDLES.get(hid)
    if entry is None:
        raise RuntimeError(
            f"flexdispatch: dispatch handle #{hid} is not registered: combine with the handle "
            f"tensor its dispatch returned, while that dispatch's result is alive"
        )
    return entry[0]


def _fresh(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor | None]) -> list:
    """``outs`` as a custom op must return them: new tensors (none sharing memory with an input
    or an earlier output: a world of one may hand back its input), contiguous from offset 0 as
    the fake implementations describe them (a backend may return views into a larger buffer);
    cloned where they are not."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    fresh = []
    for t in outs:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.storage_offset() or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        fresh.append(t)
    return fresh


# --------------------------------------------------------------------------- flexdispatch::dispatch
@torch.library.custom_op("flexdispatch::dispatch", mutates_args=())
def _dispatch_op(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    dispatcher: torch.Tensor,
    num_worst_tokens: int,
    num_local_experts: int,
    num_tokens_per_rank: torch.Tensor | None = None,
    num_tokens_per_rdma_rank: torch.Tensor | None = None,
    num_tokens_per_expert: torch.Tensor | None = None,
    is_token_in_rank: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``FlexDispatcher.dispatch`` as an op: ``(recv_x [M, H], recv_topk_idx [M, k] int64,
    recv_topk_probs [M, k] float32, num_recv_tokens_per_expert [e] int64, handle [2] int64 CPU)``.
    ``num_worst_tokens`` (W, 0 dropless) and ``num_local_experts`` (e) are the dispatcher's, for
    the fake rule (equal across identical layers: no per-layer guard). The four optional tensors
    are a ``DispatchLayout`` (all None: none given)."""
    d = _dispatcher(dispatcher)
    _same_int(
        "dispatch",
        "num_worst_tokens",
        num_worst_tokens,
        d.config.num_worst_tokens,
        "the dispatcher",
    )
    _same_int(
        "dispatch", "num_local_experts", num_local_experts, d.num_local_experts, "the dispatcher"
    )
    layout = None
    if is_token_in_rank is not None:
        layout = DispatchLayout(
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            is_token_in_rank=is_token_in_rank,
        )
    res = d._dispatch(x, topk_idx, topk_probs, layout=layout, grad=False)
    outs = _fresh(
        (res.recv_x, res.recv_topk_idx, res.recv_topk_probs, res.num_recv_tokens_per_expert),
        (x, topk_idx, topk_probs),
    )
    return (*outs, _register(res.handle, res.num_recv_pairs))


@_dispatch_op.register_fake
def _dispatch_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    dispatcher: torch.Tensor,
    num_worst_tokens: int,
    num_local_experts: int,
    num_tokens_per_rank: torch.Tensor | None = None,
    num_tokens_per_rdma_rank: torch.Tensor | None = None,
    num_tokens_per_expert: torch.Tensor | None = None,
    is_token_in_rank: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # NOTE: shapes only: the dispatcher's checks run in the op itself, before any collective
    # (a fake rule cannot look the dispatcher up: its id tensor has no data here)
    _outside_graph("pairs"), _outside_graph("register")  # NOTE: made before traced code needs them
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_probs.shape != topk_idx.shape:
        raise ValueError(
            f"flexdispatch::dispatch takes x [T, H], topk_idx [T, k] and topk_probs [T, k], got "
            f"{tuple(x.shape)}, {tuple(topk_idx.shape)} and {tuple(topk_probs.shape)}"
        )
    W = num_worst_tokens
    # NOTE: worst-case mode has W rows whatever the routing; dropless has a data-dependent M
    M = W if W else torch.library.get_ctx().new_dynamic_size()
    k = topk_idx.shape[1]
    return (
        x.new_empty(M, x.shape[1]),
        topk_idx.new_empty(M, k),
        topk_probs.new_empty(M, k),
        torch.empty(num_local_experts, dtype=torch.int64, device=x.device),
        torch.empty(2, dtype=torch.int64, device="cpu"),
    )


def _dispatch_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, dispatcher = inputs[0], inputs[3]
    ctx.save_for_backward(output[1], output[4], dispatcher)
    ctx.num_tokens, ctx.hidden, ctx.x_dtype = x.shape[0], x.shape[1], x.dtype


def _dispatch_backward(ctx: Any, grad_x: Any, _gi: Any, grad_probs: Any, _gc: Any, _gh: Any):
    """``grad x = combine(grad recv_x)``; ``grad topk_probs = combine(grad recv_topk_probs)``
    with the gradient zeroed where ``recv_topk_idx == -1`` (the rule of ``_Dispatch``)."""
    recv_idx, handle_t, d = ctx.saved_tensors
    want_x, want_p = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    T = ctx.num_tokens
    dx = dp = None
    # NOTE: every rank must run the same collectives; a missing gradient becomes zeros.
    if want_x and grad_x is None:
        grad_x = recv_idx.new_zeros(recv_idx.shape[0], ctx.hidden, dtype=ctx.x_dtype)
    if want_p:
        if grad_probs is None:
            grad_probs = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
        masked = torch.where(recv_idx >= 0, grad_probs.to(torch.float32), 0.0)
        gx = grad_x.contiguous() if want_x else None
        dx, dp = torch.ops.flexdispatch.combine_with_probs(gx, masked, handle_t, d, T)
        dx = dx if want_x else None
    elif want_x:  # NOTE: the non-differentiable backward op, as ``_Dispatch.backward`` calls
        dx, _ = torch.ops.flexdispatch.combine_with_probs(grad_x.contiguous(), None, handle_t, d, T)
    # NOTE: one gradient per argument the op was called with (trailing defaults may be absent)
    return (dx, None, dp, *[None] * (len(ctx.needs_input_grad) - 3))


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# --------------------------------------------------------------------------- flexdispatch::combine
@torch.library.custom_op("flexdispatch::combine", mutates_args=())
def _combine_op(
    y: torch.Tensor,
    handle: torch.Tensor,
    dispatcher: torch.Tensor,
    num_tokens: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``FlexDispatcher.combine(y, handle, bias=bias)`` as an op: ``[T, H]``."""
    d, h = _dispatcher(dispatcher), _handle(handle)
    check_handle(h, d.backend_name, d._issuer)  # NOTE: the serial a trace could not check
    _same_int("combine", "num_tokens", num_tokens, h.num_tokens, "the handle")
    out = d._combine(y, h, bias, grad=False)
    return _fresh((out,), (y, bias))[0]


@_combine_op.register_fake
def _combine_fake(
    y: torch.Tensor,
    handle: torch.Tensor,
    dispatcher: torch.Tensor,
    num_tokens: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    _outside_graph("register")  # NOTE: made for the next trace (see _outside_graph)
    return y.new_empty(num_tokens, y.shape[1])


def _combine_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    y, handle_t, dispatcher = inputs[0], inputs[1], inputs[2]
    ctx.save_for_backward(handle_t, dispatcher)
    ctx.num_rows = y.shape[0]


def _combine_backward(ctx: Any, grad: torch.Tensor):
    """``grad y = cached_dispatch(grad out)`` along the same handle; ``grad bias = grad out``."""
    handle_t, d = ctx.saved_tensors
    g = grad.contiguous()
    gy = None
    if ctx.needs_input_grad[0]:
        gy = torch.ops.flexdispatch.cached_dispatch(g, handle_t, d, ctx.num_rows)
    want_bias = len(ctx.needs_input_grad) > 4 and ctx.needs_input_grad[4]
    return (gy, None, None, None, g if want_bias else None)[: len(ctx.needs_input_grad)]


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ------------------------------------------------------------------ the backward halves (no grad)
@torch.library.custom_op("flexdispatch::combine_with_probs", mutates_args=())
def _combine_with_probs_op(
    y: torch.Tensor | None,
    probs: torch.Tensor | None,
    handle: torch.Tensor,
    dispatcher: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of dispatch: ``(combine(y) [T, H], combine(probs) [T, k] float32)`` in one
    backend call (DeepEP: one combine); ``[0]`` for the one that is None (not both)."""
    d, h = _dispatcher(dispatcher), _handle(handle)
    check_handle(h, d.backend_name, d._issuer)
    _same_int("combine_with_probs", "num_tokens", num_tokens, h.num_tokens, "the handle")
    backend = d._backend
    if probs is None:
        if y is None:
            raise ValueError("flexdispatch::combine_with_probs needs y or probs")
        dx, dp = backend.combine(y, h), y.new_empty(0, dtype=torch.float32)
    else:
        dx, dp = backend.combine_with_probs(y, probs, h)
        dx = probs.new_empty(0) if dx is None else dx
    return tuple(_fresh((dx, dp), (y, probs)))  # type: ignore[return-value]


@_combine_with_probs_op.register_fake
def _combine_with_probs_fake(
    y: torch.Tensor | None,
    probs: torch.Tensor | None,
    handle: torch.Tensor,
    dispatcher: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if probs is None:
        if y is None:
            raise ValueError("flexdispatch::combine_with_probs needs y or probs")
        return y.new_empty(num_tokens, y.shape[1]), y.new_empty(0, dtype=torch.float32)
    dx = probs.new_empty(0) if y is None else y.new_empty(num_tokens, y.shape[1])
    return dx, probs.new_empty(num_tokens, probs.shape[1])


@torch.library.custom_op("flexdispatch::cached_dispatch", mutates_args=())
def _cached_dispatch_op(
    x: torch.Tensor, handle: torch.Tensor, dispatcher: torch.Tensor, num_recv_rows: int
) -> torch.Tensor:
    """The backward of combine: ``x [T, X]`` sent along the handle's layout, ``[M, X]``."""
    d, h = _dispatcher(dispatcher), _handle(handle)
    check_handle(h, d.backend_name, d._issuer)
    _same_int("cached_dispatch", "num_recv_rows", num_recv_rows, h.num_recv_rows, "the handle")
    out = d._backend.cached_dispatch(x, h)
    return _fresh((out,), (x,))[0]


@_cached_dispatch_op.register_fake
def _cached_dispatch_fake(
    x: torch.Tensor, handle: torch.Tensor, dispatcher: torch.Tensor, num_recv_rows: int
) -> torch.Tensor:
    return x.new_empty(num_recv_rows, x.shape[1])


# --------------------------------------------------------------------------- callers
def _pairs(handle_t: torch.Tensor) -> int | None:
    """``num_recv_pairs`` from the handle tensor (a CPU tensor: no device sync), None if -1."""
    pairs = int(handle_t[1])
    return None if pairs < 0 else pairs


# NOTE: traced, ``int()`` either breaks the graph or (``capture_scalar_outputs``, as torchtitan
# sets) becomes an unbacked symbol that ``< 0`` cannot guard on: always a graph break, with a
# message naming the fix where ``fullgraph=True`` refuses it
_PAIRS_REASON = (
    "flexdispatch: a dropless dispatch (DispatchConfig.num_worst_tokens=0) has a "
    "data-dependent row count and reads it on the host, so it cannot be compiled with "
    "fullgraph=True: set num_worst_tokens > 0 (worst-case mode, static shapes) or compile "
    "without fullgraph"
)
_REGISTER_REASON = (
    "flexdispatch: combine of a handle from the eager path (dispatch_expanded, or a "
    "dispatch outside the compiled region) registers it when it runs, outside the graph; "
    "with fullgraph=True, call dispatch (not dispatch_expanded) inside the compiled region too, "
    "or compile without fullgraph"
)
_OUTSIDE_GRAPH: dict[str, Any] = {}  # name -> its torch.compiler.disable'd helper


def _outside_graph(name: str) -> Any:
    """The helper ``name`` (``"pairs"``, ``"register"``) behind ``torch.compiler.disable``,
    made at its first use. It is used only while compiling, when torch._dynamo is imported
    anyway: made when this module is imported, it imported torch._dynamo and with it triton
    (about 2 s more to import the dispatcher, and triton before a CPU user sets
    TRITON_INTERPRET). The fake rules make both (they run while dynamo traces, before the
    helpers are reached), so a fullgraph refusal names the fix."""
    wrapped = _OUTSIDE_GRAPH.get(name)
    if wrapped is None:
        fn, reason = {
            "pairs": (_pairs, _PAIRS_REASON),
            "register": (_register_now, _REGISTER_REASON),
        }[name]
        wrapped = _OUTSIDE_GRAPH[name] = torch.compiler.disable(fn, reason=reason)
    return wrapped


def dispatch(
    d: Any,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    layout: DispatchLayout | None,
) -> DispatchResult:
    """``FlexDispatcher.dispatch`` through ``flexdispatch::dispatch`` (``d`` the dispatcher):
    the result's ``handle.state`` is the op's handle tensor."""
    lay: tuple[torch.Tensor | None, ...] = ()
    if layout is not None:
        lay = (
            layout.num_tokens_per_rank,
            layout.num_tokens_per_rdma_rank,
            layout.num_tokens_per_expert,
            layout.is_token_in_rank,
        )
    recv_x, recv_idx, recv_probs, counts, handle_t = torch.ops.flexdispatch.dispatch(
        x, topk_idx, topk_probs, d._op_id, d.config.num_worst_tokens, d.num_local_experts, *lay
    )
    pairs = None
    if not torch.compiler.is_compiling():
        pairs = _pairs(handle_t)
    elif not d.config.num_worst_tokens:
        # NOTE: dropless under torch.compile: a graph break here (data-dependent), and permute
        # gets the row count without a sync of its own
        pairs = _outside_graph("pairs")(handle_t)
    handle = DispatchHandle(
        backend=d.backend_name,
        num_tokens=x.shape[0],
        hidden=x.shape[1],
        num_recv_rows=recv_x.shape[0],
        state=handle_t,
        # NOTE: traced, no serial (dynamo would guard on it): the op checks it when it runs
        issuer=-1 if torch.compiler.is_compiling() else d._issuer,
    )
    return DispatchResult(
        recv_x=recv_x,
        recv_topk_idx=recv_idx,
        recv_topk_probs=recv_probs,
        num_recv_tokens_per_expert=counts,
        handle=handle,
        num_recv_pairs=pairs,
    )


def _register_now(handle: DispatchHandle) -> torch.Tensor:
    """``_register(handle, None)`` when the code runs, never while dynamo traces it (behind
    ``_outside_graph``: a graph break, the tensor then an input of the next graph). Traced, the
    id would be baked into the graph as a constant and its entry dropped with the trace's
    tensor."""
    return _register(handle, None)


def combine(
    d: Any, y: torch.Tensor, handle: DispatchHandle, bias: torch.Tensor | None
) -> torch.Tensor:
    """``FlexDispatcher.combine`` through ``flexdispatch::combine`` (inputs already checked). A
    handle of the eager path (dispatched before the ops were switched on, or by
    ``dispatch_expanded``) is registered now, at run time (``_register_now``)."""
    handle_t = handle.state
    if not isinstance(handle_t, torch.Tensor):
        compiling = torch.compiler.is_compiling()
        handle_t = _outside_graph("register")(handle) if compiling else _register(handle, None)
    return torch.ops.flexdispatch.combine(y, handle_t, d._op_id, handle.num_tokens, bias)
