"""``FlexDispatcher``: differentiable dispatch/combine over a selected backend.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows.

The dispatcher validates inputs, picks the backend (the same on every rank), and wraps the
backend's no-grad primitives in autograd Functions where autograd records the call (grad mode on
and an input requiring grad; otherwise it calls the backend directly, which saves the Functions'
host time):

- backward of dispatch: ``grad x = combine(grad recv_x)``, and ``grad topk_probs =
  combine(grad recv_topk_probs)`` with the gradient zeroed wherever ``recv_topk_idx == -1``, so
  that each ``(token, slot)`` gets exactly the gradient of the one rank that owns its expert;
- backward of combine: ``grad y = cached_dispatch(grad out)`` along the same handle.

The handle travels in the ``DispatchResult``; nothing about a call is kept on ``self``.

fp8 pass-through (``deepep`` backend only): ``dispatch`` also takes DeepEP's ``(x_fp8 [T, H]
float8_e4m3fn, scales [T, ceil(H / 128)] float32)`` tuple and hands it to DeepEP unchanged. That
path is forward-only: ``recv_x`` (fp8) carries no gradient and an ``x`` that requires grad is
refused; ``topk_probs`` stays differentiable.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks import fits
from flexdispatch._checks.tensors import check_tensor, checks_flag
from flexdispatch._checks.threads import CallGuard, guarded
from flexdispatch._checks.values import check_int
from flexdispatch.backends.base import DispatchBackend
from flexdispatch.config import DispatchConfig
from flexdispatch.dispatch import ops as _ops
from flexdispatch.dispatch import values as bad_values
from flexdispatch.dispatch.autograd import (
    CombineBiasFunction,
    CombineFunction,
    DispatchExpandedFunction,
    DispatchFunction,
    Rows,
    backend_combine,
    records_grad,
)
from flexdispatch.dispatch.inputs import InputChecks
from flexdispatch.dispatch.select import select_backend
from flexdispatch.distributed import (
    check_fingerprint,
    collective_device,
    cut_to_hosts,
    group_size,
    host_id,
    resolve_ranks_per_node,
)
from flexdispatch.types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    DispatchStats,
    ExpandedDispatchResult,
    PendingDispatch,
    check_handle,
    next_issuer,
)

__all__ = ["FlexDispatcher", "PendingDispatch"]


def _contiguous(x: Rows) -> Rows:
    return (x[0].contiguous(), x[1].contiguous()) if isinstance(x, tuple) else x.contiguous()


class FlexDispatcher(InputChecks):
    """Expert-parallel dispatch/combine with one contract for every backend.

    Args:
        config: ``DispatchConfig`` (backend, worst-case rows W, hierarchical, ranks per node,
            checks).
        num_experts: E, divisible by the group size R.
        group: the expert-parallel process group; None = WORLD, or a world of one rank when
            ``torch.distributed`` is not initialised (no collectives at all).
        _deep_ep: private test hook: a ``deep_ep`` module to use instead of importing one (the
            emulator in ``tests/deepep_emu``; only it may run the deepep backend on CPU/gloo).

    Construction is collective: every rank of ``group`` must build its dispatcher at the same
    time, with the same config (checked: a fingerprint of every config field, ``num_experts`` and
    the resolved L is compared, and every rank raises ``ValueError`` naming the differing fields).

    Raises:
        ValueError: bad world size / ranks per node / W, configs differing across ranks, or
            ``backend="deepep"`` unavailable.
    """

    def __init__(
        self,
        config: DispatchConfig,
        *,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        _deep_ep: ModuleType | None = None,
    ) -> None:
        if not isinstance(config, DispatchConfig):
            raise TypeError(f"config must be a DispatchConfig, got {type(config).__name__}")
        check_int("num_experts", num_experts, at_least=1, rule="a positive int")
        self.config = config
        self.group = group
        self._comm_device = collective_device(group)
        R = group_size(group)
        L, self.ranks_per_node_source = resolve_ranks_per_node(config.ranks_per_node, R)
        fields: dict[str, object] = {**config.model_dump(), "num_experts": num_experts}
        fields["ranks_per_node (resolved)"] = L
        too_big = fits.dispatch_refusal(config, num_experts, R, self._comm_device)
        fields["fits in memory"] = too_big is None
        # NOTE: so a rank that cannot fit makes all raise; the hosts come with it
        hosts = check_fingerprint(fields, group, extra=host_id())
        fits.raise_refusal(too_big)
        L, self.ranks_per_node_source = cut_to_hosts(
            L, self.ranks_per_node_source, config.ranks_per_node, hosts
        )
        self._stats = DispatchStats()
        self._bad_log = bad_values.BadValueLog()  # device counts of bad inputs, not yet folded
        self._zero: torch.Tensor | None = None  # the unused slots of a backend's bad-id count
        self._checks = checks_flag(config.checks or None)  # NOTE: the environment, read once
        self._checked: set[tuple] = set()  # input metadata checked (``dispatch``)
        self._devices_ok: set[torch.device] = set()  # devices ``combine`` checked
        self._backend, self.backend_reason = select_backend(
            config,
            group,
            num_experts=num_experts,
            ranks_per_node=L,
            stats=self._stats,
            deep_ep=_deep_ep,
        )
        if config.hierarchical:
            ok, why = self._backend.supports_hierarchical()
            if not ok:
                raise ValueError(f"hierarchical dispatch not supported: {why}")
        if config.num_worst_tokens:
            ok, why = self._backend.supports_worst_case()
            if not ok:
                raise ValueError(f"num_worst_tokens not supported: {why}")
        if config.cuda_graph:
            ok, why = self._backend.supports_cuda_graph()
            if not ok:
                raise ValueError(f"cuda_graph=True not supported: {why}")
        self.num_experts = num_experts
        self._guard = CallGuard()  # one thread at a time in the public calls (_checks/threads.py)
        self._new_serial()

    def _new_serial(self) -> None:
        """A serial of its own (stamped on every handle, checked by combine) and its entry in the
        custom ops' registry, which name a dispatcher by ``_op_id``: the serial in a ``[1]``
        int64 CPU tensor (a graph input under ``torch.compile``, so that identical layers share
        one compiled graph)."""
        self._issuer = next_issuer()
        self._backend.issuer = self._issuer  # NOTE: a backend may stamp its handles itself
        self._op_id = torch.tensor([self._issuer], dtype=torch.int64, device="cpu")
        _ops.register_dispatcher(self._issuer, self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, pickle) is a dispatcher of its own: its own serial and
        registry entry (the original's handles are not its handles)."""
        self.__dict__.update(state)
        self._new_serial()

    # ----------------------------------------------------------------- properties
    @property
    def stats(self) -> DispatchStats:
        """Cumulative counters since construction (``DispatchStats``).

        A backend that keeps statistics on the device (deepep on CUDA) folds them in here, which
        reads a few small device tensors: read ``stats`` at a safe point, not inside a captured
        region.
        """
        self._backend.flush_stats()
        return self._stats

    @property
    def backend(self) -> DispatchBackend:
        """The backend object (for capability queries)."""
        return self._backend

    @property
    def backend_name(self) -> str:
        """``"torch"`` or ``"deepep"``."""
        return self._backend.name

    @property
    def num_ranks(self) -> int:
        """R."""
        return self._backend.num_ranks

    @property
    def rank(self) -> int:
        """This rank inside the group."""
        return self._backend.rank

    @property
    def ranks_per_node(self) -> int:
        """L (from the config, ``LOCAL_WORLD_SIZE`` or R, cut to the ranks that share a host;
        see ``ranks_per_node_source``)."""
        return self._backend.ranks_per_node

    @property
    def num_nodes(self) -> int:
        """N = R / L."""
        return self._backend.num_nodes

    @property
    def num_local_experts(self) -> int:
        """e = E / R."""
        return self._backend.num_local_experts

    # ----------------------------------------------------------------- public API
    def dispatch(
        self,
        x: Rows,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        *,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """Send each token once to every rank that holds one of its experts.

        Args:
            x: ``[T, H]`` bf16/fp16/fp32 rows (T may be 0). With the ``deepep`` backend only,
                also DeepEP's ``(x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H / 128)] float32)``
                tuple (H a multiple of 16), passed to DeepEP unchanged. fp8 dispatch is
                forward-only: neither tensor may require grad, and ``recv_x`` has no gradient
                (``topk_probs`` still gets one).
            topk_idx: ``[T, k]`` int64 global expert ids, ``-1`` = no expert.
            topk_probs: ``[T, k]`` float32 routing weights (0 where ``topk_idx`` is ``-1``).
            layout: optional ``get_dispatch_layout(topk_idx, E, R)`` result, reused if given.

        Returns:
            ``DispatchResult``: ``recv_x [M, H]`` (x's dtype), ``recv_topk_idx [M, k]`` int64 local
            ids or ``-1``, ``recv_topk_probs [M, k]`` float32 (0 where ``-1``),
            ``num_recv_tokens_per_expert [e]`` int64 device tensor, and the handle. Rows are
            ordered by source rank, then source token. In worst-case mode ``M = W`` and rows past
            the real ones are zero / ``-1`` / 0. For an fp8 tuple, ``recv_x`` is the
            ``[M, H]`` float8_e4m3fn rows and their ``[M, ceil(H / 128)]`` float32 scales are
            ``result.handle.state.recv_scales``; ``combine`` then takes bf16 (or fp16/fp32) rows.

        Raises:
            TypeError / ValueError: malformed inputs (raised before any collective); on every
            rank: ranks disagree on H, k or dtype, or a worst-case overflow with checks on (or,
            on CPU, at the first dispatch of a row shape; otherwise ``check_overflow`` raises
            it).
            flexdispatch.distributed.CollectiveError: a peer rank failed (raised, exited, was
            killed) or did not join within the process-group timeout (docs/errors.md).
        """
        # NOTE: one compile test per call (the hot path, issue 46): traced, no guard (a lock
        # cannot be traced: _checks/threads.py) and the custom op
        if torch.compiler.is_compiling():
            if isinstance(x, tuple):
                return self._dispatch(x, topk_idx, topk_probs, layout=layout)
            return _ops.dispatch(self, x, topk_idx, topk_probs, layout)
        guard = self._guard
        guard.enter("FlexDispatcher.dispatch")
        try:
            if _ops._EAGER[0] and not isinstance(x, tuple):  # NOTE: set_eager_ops
                return _ops.dispatch(self, x, topk_idx, topk_probs, layout)
            if (
                layout is not None
                or not isinstance(x, torch.Tensor)
                or not isinstance(topk_idx, torch.Tensor)
                or not isinstance(topk_probs, torch.Tensor)
                or x.is_nested
                or topk_idx.is_nested
                or topk_probs.is_nested
            ):
                return self._dispatch(x, topk_idx, topk_probs, layout=layout)
            # NOTE: the metadata checks run once per shape, dtype, device and layout (the
            # values, where they are checked, every time)
            key = (x.shape, x.dtype, x.device, x.layout, topk_idx.shape, topk_idx.dtype,
                   topk_idx.device, topk_idx.layout, topk_probs.shape, topk_probs.dtype,
                   topk_probs.device, topk_probs.layout)  # fmt: skip
            if key not in self._checked:
                topk_idx = self._check_inputs(x, topk_idx, topk_probs, None)
                if len(self._checked) >= 64:
                    self._checked.clear()
                self._checked.add(key)
                self._devices_ok.add(x.device)  # NOTE: what ``combine`` checks of its rows
            elif self._checks or not self._backend.counts_bad_ids:
                topk_idx = self._check_values(topk_idx, x, topk_probs)
            x, topk_idx, topk_probs = x.contiguous(), topk_idx.contiguous(), topk_probs.contiguous()
            if torch.is_grad_enabled() and (x.requires_grad or topk_probs.requires_grad):
                return self._finish(x, topk_idx, topk_probs, None)
            backend = self._backend
            res = backend.dispatch(x, topk_idx, topk_probs, None)
            if res.handle.issuer != self._issuer:  # NOTE: a backend that stamps none
                object.__setattr__(res.handle, "issuer", self._issuer)
            if backend.bad_ids is not None:
                self._log_bad_ids()
            self._stats.dispatch_calls += 1
            return res
        finally:
            guard.exit()

    def _dispatch(
        self,
        x: Rows,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        *,
        layout: DispatchLayout | None = None,
        grad: bool = True,
    ) -> DispatchResult:
        """``dispatch`` on the eager path (``grad`` False: never through ``DispatchFunction``, as
        inside the ``flexdispatch::dispatch`` op, whose registered backward differentiates it)."""
        ids = self._check_inputs(x, topk_idx, topk_probs, layout)
        rows, ids, probs = _contiguous(x), ids.contiguous(), topk_probs.contiguous()
        return self._finish(rows, ids, probs, layout, grad=grad)

    def _finish(
        self,
        rows: Rows,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None,
        *,
        pending: Any = None,
        grad: bool = True,
    ) -> DispatchResult:
        """Run (or, with ``pending``, finish) the backend's dispatch of checked, contiguous
        inputs, and count the bad ids it counted."""
        backend = self._backend
        if pending is not None:  # NOTE: a launch_dispatch in flight: finish it
            run = functools.partial(backend.finish_dispatch, pending)
        else:
            run = functools.partial(backend.dispatch, rows, topk_idx, topk_probs, layout)
        if grad and records_grad(rows, topk_probs):
            recv_x, recv_idx, recv_probs, counts, handle, pairs = DispatchFunction.apply(
                backend, run, rows, topk_probs
            )
        else:
            # NOTE: nothing to differentiate (inference, no_grad, detached inputs): the backend
            # directly, without an autograd Function (its bookkeeping is host time per call)
            res = run()
            recv_x, recv_idx, recv_probs = res.recv_x, res.recv_topk_idx, res.recv_topk_probs
            counts, handle, pairs = res.num_recv_tokens_per_expert, res.handle, res.num_recv_pairs
        object.__setattr__(handle, "issuer", self._issuer)
        self._log_bad_ids()
        self._stats.dispatch_calls += 1
        return DispatchResult(
            recv_x=recv_x,
            recv_topk_idx=recv_idx,
            recv_topk_probs=recv_probs,
            num_recv_tokens_per_expert=counts,
            handle=handle,
            num_recv_pairs=pairs,
        )

    @guarded("FlexDispatcher.dispatch_start")
    def dispatch_start(
        self,
        x: Rows,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        *,
        layout: DispatchLayout | None = None,
    ) -> PendingDispatch[DispatchResult]:
        """``dispatch`` in two halves: issued now, its ``DispatchResult`` at ``.wait()`` (called
        on every rank). With DeepEP V1 and ``deepep_async_finish`` the rows are in flight in
        between, so work issued there (``MoELayer``'s shared experts) overlaps the dispatch;
        elsewhere the dispatch finishes here. Inputs, errors and result as ``dispatch``."""
        # NOTE: through the custom ops (torch.compile) a launched dispatch cannot cross the op
        if not self._backend.supports_overlap(expanded=False)[0] or _ops.use_ops():
            res = self.dispatch(x, topk_idx, topk_probs, layout=layout)
            return PendingDispatch(lambda: res)
        ids = self._check_inputs(x, topk_idx, topk_probs, layout)
        rows, ids, probs = _contiguous(x), ids.contiguous(), topk_probs.contiguous()
        with torch.no_grad():
            pending = self._backend.launch_dispatch(rows, ids, probs, layout)
        return PendingDispatch(lambda: self._finish_launched(rows, ids, probs, layout, pending))

    @guarded("FlexDispatcher.dispatch")
    def _finish_launched(
        self,
        rows: Rows,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None,
        pending: Any,
    ) -> DispatchResult:
        """``PendingDispatch.wait`` of ``dispatch_start``: one thread at a time, as ``dispatch``."""
        return self._finish(rows, topk_idx, topk_probs, layout, pending=pending)

    @guarded("FlexDispatcher.dispatch_expanded")
    def dispatch_expanded(
        self, x: Rows, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> ExpandedDispatchResult:
        """Dispatch into one row per (token, local expert), grouped by local expert.

        What ``GroupedExperts`` consumes directly (``experts(res.recv_x,
        res.num_recv_tokens_per_expert, res.recv_topk_probs)``), with no ``permute`` /
        ``unpermute``: ``combine(y, res.handle)``
        sums every row of a token on every rank (so weight the rows first, as ``GroupedExperts``
        does with ``probs``). Only backends with ``supports_expanded()`` (DeepEP V2 / V2.5,
        ``deepep_api`` ``'v2'``, ``'v25'`` or ``'auto'``) run it; the others raise
        ``ValueError``.
        Inputs and errors as ``dispatch``.

        Returns:
            ``ExpandedDispatchResult``: ``recv_x [N, H]``, ``recv_topk_probs [N]`` float32,
            ``num_recv_tokens_per_expert [e]`` int64 device tensor, the handle. In worst-case mode
            N is static (DeepEP: ``R * (W / R) * min(k, e)``) and rows past the real ones are zero.
        """
        return self._start_expanded(x, topk_idx, topk_probs, overlap=False).wait()

    @guarded("FlexDispatcher.dispatch_expanded_start")
    def dispatch_expanded_start(
        self, x: Rows, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> PendingDispatch[ExpandedDispatchResult]:
        """``dispatch_expanded`` in two halves: issued now, its result at ``.wait()`` (called
        on every rank). On DeepEP 2.5 the rows are in flight in between (``defer_epilogue``),
        so work issued there (``MoELayer``'s shared experts) overlaps the dispatch; elsewhere the
        dispatch finishes here. Inputs, errors and result as ``dispatch_expanded``."""
        return self._start_expanded(x, topk_idx, topk_probs, overlap=True)

    def _start_expanded(
        self, x: Rows, topk_idx: torch.Tensor, topk_probs: torch.Tensor, *, overlap: bool
    ) -> PendingDispatch[ExpandedDispatchResult]:
        backend = self._backend
        ok, why = backend.supports_expanded()
        if not ok:
            raise ValueError(f"dispatch_expanded is not available: {why}")
        ids = self._check_inputs(x, topk_idx, topk_probs, None)
        args = (_contiguous(x), ids.contiguous(), topk_probs.contiguous())
        pending = None
        if overlap and backend.supports_overlap(expanded=True)[0]:
            with torch.no_grad():
                pending = backend.launch_expanded(*args)

        def finish() -> ExpandedDispatchResult:
            recv_x, recv_probs, counts, handle = DispatchExpandedFunction.apply(
                backend, pending, *args
            )
            object.__setattr__(handle, "issuer", self._issuer)
            self._log_bad_ids()
            self._stats.dispatch_calls += 1
            return ExpandedDispatchResult(
                recv_x=recv_x,
                recv_topk_probs=recv_probs,
                num_recv_tokens_per_expert=counts,
                handle=handle,
            )

        ready = None if pending is None else (lambda: backend.check_finish(pending))
        return PendingDispatch(finish, ready)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, *, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Send expert outputs back and sum them per source token (unweighted).

        Args:
            y: ``[M, H]`` floating rows in the order ``dispatch`` returned (``[W, H]`` in
                worst-case mode; the tail rows are ignored).
            handle: ``DispatchResult.handle`` of that dispatch.
            bias: optional ``[T, H]`` rows of y's dtype added to the result (a layer's shared
                experts). DeepEP 2.5 adds a bf16 bias inside its reduction, before the one
                rounding (``supports_combine_bias``); elsewhere it is added after the combine.
                Differentiable (its gradient is the output's).

        Returns:
            ``[T, H]`` with y's dtype: for each token the sum over the ranks that received it of
            their row (plus ``bias``); zero (``bias``) for tokens sent nowhere.

        Raises:
            TypeError / ValueError: a foreign handle or a malformed ``y`` (before any collective).
            flexdispatch.distributed.CollectiveError: a peer rank failed or timed out.
        """
        # NOTE: one compile test per call; traced, no guard (see ``dispatch``)
        if torch.compiler.is_compiling():
            return self._checked_combine(y, handle, bias, compiling=True)
        guard = self._guard
        guard.enter("FlexDispatcher.combine")
        try:
            # NOTE: the hot path: a handle of this dispatcher's eager dispatch (the serial
            # compared on the host) and rows of a shape, dtype kind and device checked before
            if (
                bias is None
                and not _ops._EAGER[0]
                and type(handle) is DispatchHandle
                and handle.issuer == self._issuer
                and not isinstance(handle.state, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and not y.is_nested
                and y.layout == torch.strided
                and y.dtype.is_floating_point
                and y.device in self._devices_ok
                and y.shape == (handle.num_recv_rows, handle.hidden)
            ):
                y = y.contiguous()
                if torch.is_grad_enabled() and y.requires_grad:
                    out = CombineFunction.apply(self._backend, handle, y)
                else:  # NOTE: nothing to differentiate: no autograd Function
                    out = self._backend.combine(y, handle)
                self._stats.combine_calls += 1
                return out
            return self._checked_combine(y, handle, bias, compiling=False)
        finally:
            guard.exit()

    def _checked_combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        bias: torch.Tensor | None,
        *,
        compiling: bool,
    ) -> torch.Tensor:
        """``combine`` with every check (the hot path's conditions not met, or traced)."""
        # NOTE: traced, the serial is not read (dynamo would guard on it), nor on an op handle
        # (a compiled dispatch stamps none): ``flexdispatch::combine`` checks it when it runs
        op_handle = isinstance(handle, DispatchHandle) and isinstance(handle.state, torch.Tensor)
        issuer = None if op_handle or compiling else self._issuer
        check_handle(handle, self.backend_name, issuer)
        check_tensor("y", y, ndim=2, floating=True)
        self._check_device("y", y)
        if tuple(y.shape) != (handle.num_recv_rows, handle.hidden):
            raise ValueError(
                f"y must have shape [{handle.num_recv_rows}, {handle.hidden}] (the rows dispatch "
                f"returned), got {tuple(y.shape)}"
            )
        if not compiling:
            self._devices_ok.add(y.device)
        if op_handle or compiling or _ops._EAGER[0]:  # NOTE: see ``dispatch``
            return _ops.combine(self, y, handle, bias)
        return self._combine(y, handle, bias)

    def _combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        bias: torch.Tensor | None,
        *,
        grad: bool = True,
    ) -> torch.Tensor:
        """``combine`` after its checks (``grad`` False: as inside ``flexdispatch::combine``)."""
        if bias is not None:
            out = self._combine_bias(y.contiguous(), handle, bias, grad=grad)
        elif grad and records_grad(y):
            out = CombineFunction.apply(self._backend, handle, y.contiguous())
        else:  # NOTE: nothing to differentiate: no autograd Function (as in ``dispatch``)
            out = self._backend.combine(y.contiguous(), handle)
        self._stats.combine_calls += 1
        return out

    def _combine_bias(
        self, y: torch.Tensor, handle: DispatchHandle, bias: torch.Tensor, *, grad: bool
    ) -> torch.Tensor:
        """``combine(y, handle, bias=bias)``: the bias inside the reduction where the backend
        supports it for y's dtype (``CombineBiasFunction``; ``grad`` False: the backend alone, as
        inside the ``flexdispatch::combine`` op), else added after the combine."""
        self._check_device("bias", bias)
        check_tensor("bias", bias, ndim=2, floating=True)
        if tuple(bias.shape) != (handle.num_tokens, handle.hidden) or bias.dtype != y.dtype:
            raise ValueError(
                f"bias must be a [{handle.num_tokens}, {handle.hidden}] tensor of y's dtype "
                f"{y.dtype} (one row per dispatched token), got {tuple(bias.shape)} {bias.dtype}"
            )
        backend = self._backend
        if backend.supports_combine_bias(y.dtype)[0]:
            if not grad:
                return backend.combine_bias(y, handle, bias.contiguous())
            return CombineBiasFunction.apply(backend, handle, y, bias.contiguous())
        plain = CombineFunction.apply if grad else backend_combine
        return plain(backend, handle, y) + bias

    @guarded("FlexDispatcher.warmup")
    def warmup(
        self,
        hidden_size: int,
        topk: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        expanded: bool | None = None,
        backward: bool = True,
    ) -> None:
        """Run every kernel a step of these shapes uses once, with no tokens (collective).

        DeepEP 2.5 compiles each kernel at its first use, and sizes its buffer and agrees on its
        SM count at the first dispatch: none of that can happen inside a CUDA-graph capture, so
        call this on every rank first (elsewhere it is a cheap empty step). ``expanded``:
        ``dispatch_expanded`` (True), ``dispatch`` (False) or both (None); ``backward`` also
        the backward kernels; ``dtype`` sets the row width on the wire
        (``torch.float8_e4m3fn``: the fp8 dispatch, DeepEP's ``(x, scales)`` tuple with its
        ``ceil(H / 128)`` float32 scale columns, a template argument of DeepEP 2.5's kernels;
        with ``backward``, also the cached dispatch of its combine's backward).
        """
        for name, value in (("hidden_size", hidden_size), ("topk", topk)):
            check_int(f"warmup: {name}", value, at_least=1, rule="a positive int")
        fp8 = dtype == torch.float8_e4m3fn
        device = self._comm_device
        modes = [False, True] if expanded is None else [expanded]
        if not self._backend.supports_expanded()[0]:
            if expanded:
                raise ValueError(f"warmup(expanded=True): {self._backend.supports_expanded()[1]}")
            modes = [False]
        for exp in modes:
            with torch.enable_grad():
                p = torch.zeros(0, topk, dtype=torch.float32, device=device, requires_grad=backward)
                idx = torch.zeros(0, topk, dtype=torch.int64, device=device)
                x: Rows
                if fp8:
                    cols = -(-hidden_size // 128)
                    x = (
                        torch.zeros(0, hidden_size, dtype=dtype, device=device),
                        torch.zeros(0, cols, dtype=torch.float32, device=device),
                    )
                    row = torch.bfloat16
                else:
                    x = torch.zeros(
                        0, hidden_size, dtype=dtype, device=device, requires_grad=backward
                    )
                    row = dtype
                if exp:
                    res_e = self.dispatch_expanded(x, idx, p)
                    y = res_e.recv_x.to(row) * res_e.recv_topk_probs[:, None].to(row)
                    handle = res_e.handle
                else:
                    res = self.dispatch(x, idx, p)
                    y = res.recv_x.to(row) * res.recv_topk_probs.sum(1, keepdim=True).to(row)
                    handle = res.handle
                bias = torch.zeros(0, hidden_size, dtype=row, device=device)
                out = self.combine(y, handle, bias=bias)
                if backward:
                    out.float().sum().backward()

    def check_overflow(self) -> None:
        """Raise ``ValueError`` if a dispatch since construction dropped something: bad inputs
        counted on the device (below), or a worst-case overflow.

        Bad inputs: with checks enabled, expert ids outside ``[-1, E)``, an expert named twice in
        one token, and NaN/inf in ``x`` or ``topk_probs`` raise inside ``dispatch``, on every
        device. With checks off no value is checked in ``dispatch`` (no host read, on CPU and CUDA
        alike): the torch backend sends the ids outside ``[-1, E)`` nowhere and counts them on
        the device; the DeepEP backends get them screened (raised on CPU; on CUDA the bad ids and
        the repeats after an id's first slot sent as -1 and counted with the NaN/inf values).
        This method reads those counts (one sync), adds them to ``stats.extra``
        (``invalid_expert_ids``, ``nonfinite_x``, ``nonfinite_topk_probs``,
        ``repeated_expert_ids``) and raises naming them, then and at every later call.

        Overflow: with checks enabled an overflow raises inside ``dispatch`` on every rank (and
        so it does on CPU at the first dispatch of a row shape, which runs the count exchange,
        and in hierarchical mode). Otherwise (checks off, e.g. under CUDA-graph capture, and the
        torch backend's flat dispatch on CPU too) the dispatch does not read the counts on the
        host: it records the largest count on the device and drops the rows past each cap (never
        writing out of bounds); call this method (it syncs) at a safe point, e.g. after a step,
        to turn that record into an error, the same on every rank.
        """
        self._fold_bad_values()
        problems = bad_values.bad_input_problems(self.stats.extra, self.num_experts)
        if problems:
            raise ValueError("; ".join(problems))
        self._backend.check_overflow()

    def _fold_bad_values(self) -> None:
        """Move the device counts of bad inputs into ``stats.extra`` (one host sync)."""
        self._bad_log.read(self._stats)

    def close(self) -> None:
        """Release the backend's resources; the dispatcher must not be used afterwards. Device
        counts of bad inputs not yet read are added to ``stats.extra`` (no error is raised)."""
        self._fold_bad_values()
        self._backend.close()

    def __repr__(self) -> str:
        return (
            f"FlexDispatcher(backend={self.backend_name!r}, R={self.num_ranks}, "
            f"rank={self.rank}, L={self.ranks_per_node}, E={self.num_experts}, "
            f"W={self.config.num_worst_tokens}, hierarchical={self.config.hierarchical})"
        )
