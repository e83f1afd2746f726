"""The ``deepep`` backend over DeepEP 2.5 (``deep_ep_v25.EPBuffer``), behind the dispatch contract.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per NVLink domain · N = R / L nodes · W worst-case
rows · M = ``num_max_tokens_per_rank`` as compiled (a ``token_bucket``) · X any row width.

Selected with ``DispatchConfig.deepep_api="v25"``, and by ``"auto"`` where every rank has DeepEP 2.5
(``dispatch.select.auto_deepep_api``). How the contract maps onto ``EPBuffer``:

- **Modes**: one NVLink domain, or across nodes in hybrid mode (``allow_hybrid_mode``: one RDMA
  row per destination node, forwarded over NVLink; ``DispatchConfig.deepep_hybrid``) or direct
  mode (every rank one hop away). ``dispatch``: one row per (token, destination rank), sorted
  back to (source rank, token) order by ``recv_src_metadata[:, 0]`` (DeepEP fills slots in
  ``atomicAdd`` order); ids local or -1; weights zeroed where the id is not local.
- **Expanded** (``dispatch_expanded``, what ``MoELayer`` runs): ``do_expand=True``, one row per
  (token, local expert) grouped by expert, each segment padded to ``expert_alignment`` rows that
  DeepEP zeroes itself (``do_zero_padding``); combine sums a token's rows on each rank (one bf16
  rounding, ``allow_multiple_reduction``) and across ranks.
- **Static shapes**: ``num_max_tokens_per_rank`` is a JIT template argument, so it is bucketed
  (``token_bucket``): dropless ``M = bucket(num_max_dispatch_tokens_per_rank)``, worst-case
  ``M = bucket(W / R)``. In worst-case mode a rank may send at most ``W / R`` tokens, which
  keeps every receive within the contract's W rows; DeepEP's ``R * M`` rows are cut back to W
  after the sort (expanded: ``R * (W / R) * min(k, e)`` rows, aligned).
- **Dropless**: ``do_cpu_sync=True``, every token sent, the bound agreed and grown on every rank
  (``bounded``). **Worst-case**: ``do_cpu_sync=False``, no host sync, inside a node and across
  nodes; rows past the real ones are masked on the device.
- **JIT**: each kernel template compiles at first use; ``buffer.KernelRegistry`` knows which
  ran, and a first use inside a CUDA-graph capture raises with the fix
  (``FlexDispatcher.warmup``).
- **Combine**: V2.5's unweighted bf16 sum (rows padded to 256 columns), optionally plus a
  ``bias`` added before its one rounding (the shared experts' output: ``combine_bias``); narrow
  fp32/fp16 rows (<= 32 columns, the probs gradient) are summed exactly in fp32 through combine's
  ``topk_weights`` channel, one combine per column.
- **Overlap**: ``launch_expanded`` issues the dispatch with ``defer_epilogue`` (the receive
  epilogue and, dropless, the CPU wait run at ``finish_expanded``), so the layer can compute its
  shared experts while the rows are in flight. The epilogue reads the buffer's shared receive
  slots, so any other call on the buffer runs it first (``buffer.SharedV25Buffer.settle``).
- **SMs / QPs**: DeepEP 2.5's bandwidth model picks both (``get_theoretical_num_sms``, agreed
  across ranks once; ``get_theoretical_num_qps``) unless ``deepep_num_sms`` is set.
- **Ids**: ids >= E and repeated ids never reach a kernel (``rows.guard_ids``).
- **Statistics**: rows and bytes per link class are computed on the device (``rows.
  traffic_rows``) and summed by ``counters.TrafficCounters`` (as on V1 / V2): no host read and
  no host-to-device copy on the hot path, in place inside a CUDA-graph capture.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import checks_enabled, cuda_code_path
from flexdispatch.backends.base import Capability
from flexdispatch.backends.deepep import refusals, sizing
from flexdispatch.backends.deepep.bounded import (
    COMBINE_COLS,
    BoundedBackend,
    BoundedState,
    Launch,
    sent_tokens,
)
from flexdispatch.backends.deepep.v25 import rows
from flexdispatch.backends.deepep.v25.buffer import (
    acquire_v25,
    check_epilogue,
    kernel_key,
    kernels_of,
)
from flexdispatch.backends.deepep.v25.layout import (
    cached_pieces,
    cached_refusal,
    dispatch_cols,
    pad,
    row_refusal,
)
from flexdispatch.backends.deepep.v25.rows import (
    PendingExpanded,
    V25Traffic,
    combine_row_bytes,
    dispatch_row_bytes,
    guard_ids,
    traffic_rows,
)
from flexdispatch.backends.deepep.v25.support import (
    load_deep_ep_v25,
    token_bucket,
    tokens_message,
    v25_available,
    v25_rules,
)
from flexdispatch.types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    ExpandedDispatchResult,
)

__all__ = ["DeepEPV25Backend", "PendingExpanded"]


class _Plan:
    """What a (not deferred) dispatch of one ``(T, X, dtype, k, expand, M)`` key fixes, kept by
    its first call: the wire format, the column multiple and padded width, the row bytes, the
    SM count, the kernel key (run: compiled), the id policy (``raise_now``), the expert
    alignment and the buffer width (these rows and their combine)."""

    __slots__ = ("align", "buffer_cols", "hidden", "key", "mult", "raise_now", "row", "sms", "wire")

    def __init__(
        self,
        wire: sizing.WireFormat,
        mult: int,
        hidden: int,
        row: int,
        sms: int,
        key: tuple,
        raise_now: bool,
        align: int,
    ) -> None:
        self.wire, self.mult, self.hidden, self.row = wire, mult, hidden, row
        self.sms, self.key, self.raise_now, self.align = sms, key, raise_now, align
        self.buffer_cols = max(hidden, -(-wire.width // COMBINE_COLS) * COMBINE_COLS)


class DeepEPV25Backend(BoundedBackend):
    """Dispatch/combine over ``deep_ep_v25.EPBuffer`` (DeepEP 2.5).

    Args:
        group: the process group (None = WORLD); NCCL on CUDA.
        num_experts: E, divisible by R.
        ranks_per_node: L as launched (the emulator's NVLink domain in tests).
        num_worst_tokens: W (0 = dropless), a multiple of R.
        hierarchical: accepted; DeepEP routes across nodes itself (hybrid mode).
        checks: in worst-case mode, every rank's token count and row shape agreed on the host
            before the dispatch, so that any rank over ``W / R`` (or a shape mismatch) raises
            everywhere (dropless mode always agrees them).
        stats: counters to add to.
        num_sms: SMs per kernel (None: DeepEP 2.5's bandwidth model, agreed across ranks).
        num_max_tokens_per_rank: the dropless per-rank token bound (bucketed for the JIT), the
            first one: it grows to the largest T the ranks dispatch.
        hybrid: True hybrid mode across nodes, False direct mode, None hybrid where it fits.
        expert_alignment: each expert's rows in ``dispatch_expanded`` padded to a multiple.
        _deep_ep: a ``deep_ep_v25`` module to use instead of importing it (tests: the emulator).

    Raises:
        ValueError: no DeepEP 2.5, or a world / W / E its rules refuse (the reason named).
    """

    api = "v25"
    release = "DeepEP 2.5"

    config_fields = {  # noqa: RUF012
        **BoundedBackend.config_fields,
        "hybrid": "deepep_hybrid",
        "expert_alignment": "expert_alignment",
    }

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_sms: int | None = None,
        num_max_tokens_per_rank: int = 128,
        hybrid: bool | None = None,
        expert_alignment: int = 1,
        _deep_ep: ModuleType | None = None,
        **common: Any,
    ) -> None:
        module, why = (_deep_ep, "given") if _deep_ep is not None else load_deep_ep_v25()
        ok, why = v25_available(module, why)
        if not ok or module is None:
            raise ValueError(f"deepep_api='v25' cannot run: {why}")
        super().__init__(group, **common)
        R, num_worst_tokens = self.num_ranks, self.num_worst_tokens
        world = group if group is not None else dist.group.WORLD
        _, nvl = (1, R) if R == 1 else module.get_physical_domain_size(world)
        ok, why, self.hybrid = v25_rules(
            R, nvl, self.num_experts, hybrid=hybrid, num_worst_tokens=num_worst_tokens
        )
        if not ok:
            raise ValueError(f"deepep_api='v25' cannot run: {why}")
        if num_max_tokens_per_rank <= 0 or expert_alignment <= 0:
            raise ValueError(
                f"num_max_tokens_per_rank ({num_max_tokens_per_rank}) and expert_alignment "
                f"({expert_alignment}) must be positive"
            )
        if num_sms is not None and num_sms <= 0:
            raise ValueError(f"deepep num_sms must be positive, got {num_sms}")
        self.topology = why
        self.nvl = nvl
        self.num_sms = num_sms
        self.expert_alignment = expert_alignment
        bound = num_worst_tokens // R if num_worst_tokens else num_max_tokens_per_rank
        self._setup(module, max_tokens=bound)
        self._shared = acquire_v25(module, self.group, self.hybrid, id(self), rdma=nvl < R)
        self._kernels = kernels_of(module)
        self._traffic: V25Traffic | None = None
        # NOTE: the decode path's per-shape plans (issue 46): (T, X, dtype, k, expand, M) ->
        # _Plan; combine's kernel key and row bytes per (width, k, M, expand, SMs)
        self._plans: dict[tuple, _Plan] = {}
        self._combines: dict[tuple, tuple[tuple, int]] = {}

    # ----------------------------------------------------------------- capabilities
    def supports_worst_case(self) -> Capability:
        return True, (
            "deepep v25 (DeepEP 2.5): num_worst_tokens = W -> do_cpu_sync=False with "
            "num_max_tokens_per_rank = bucket(W / R), intranode and across nodes"
        )

    def supports_cuda_graph(self) -> Capability:
        ok, why = super().supports_cuda_graph()
        return ok, f"{why} (warmup() first)" if ok else why

    def supports_hierarchical(self) -> Capability:
        return True, f"deepep v25: {self.topology}"

    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        ok, why, _ = v25_rules(num_ranks, self.nvl, self.num_experts)
        return ok, why

    def supports_combine_bias(self, dtype: torch.dtype) -> Capability:
        if dtype != torch.bfloat16:
            return False, f"DeepEP 2.5 adds a bias to bf16 rows only, not {dtype}"
        return True, "DeepEP 2.5 combine adds the bias before its one bf16 rounding"

    def supports_overlap(self, *, expanded: bool) -> Capability:
        if not expanded:
            return False, "DeepEP 2.5 overlaps dispatch_expanded only (defer_epilogue)"
        return True, "DeepEP 2.5 defer_epilogue: the receive epilogue runs at finish_expanded"

    # ----------------------------------------------------------------- statistics
    def _count(self, vals: list[torch.Tensor | int]) -> None:
        """Count one call: ``[rows sent, rows received, NVLink bytes, RDMA bytes]`` (0-d device
        tensors or ints; an int is a fill on the device, never a host-to-device copy)."""
        sent, received, intra, inter = vals
        self._counters.record(lambda: (intra, inter, sent, received))

    def _traffic_rows(self, idx: torch.Tensor) -> torch.Tensor:
        if self._traffic is None or self._traffic.intra.device != idx.device:
            self._traffic = V25Traffic.of(
                self.rank, self.num_ranks, min(self.nvl, self.num_ranks), self.hybrid, idx.device
            )
        return traffic_rows(idx, self.num_local_experts, self._traffic)

    # ----------------------------------------------------------------- the token bound
    def _compiled_bound(self, tokens: int) -> int:
        return token_bucket(tokens)  # NOTE: a JIT template argument: a handful of buckets

    def _grown(self, need: int) -> tuple[int, int]:
        return need, max(self.num_max_tokens_per_rank, token_bucket(need))

    def _tokens_message(self, rank: int | str, T: int) -> str:
        W = self.num_worst_tokens
        return tokens_message(rank, T, M=self.max_tokens, R=self.num_ranks, W=W)

    # ----------------------------------------------------------------- helpers
    def _sms(self, k: int) -> int:
        if self.num_sms is not None:
            return self.num_sms
        return self._shared.num_sms(self.num_experts, k)

    def _dispatch_cols(self, cols: int, k: int, device: torch.device) -> int:
        return dispatch_cols(self.hybrid, self.num_ranks, self.num_experts, cols, k, device)

    def _run(self, key: tuple, what: str, fn: Any) -> Any:
        """Run one DeepEP call whose kernels are ``key``: refused inside a capture when new."""
        self._kernels.check(key, what)
        out = fn()
        self._kernels.add(key)
        return out

    # ----------------------------------------------------------------- dispatch
    def _launch(
        self,
        x: Any,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        *,
        expand: bool,
        defer: bool = False,
        plan: bool = True,
    ) -> tuple[Any, Launch, int]:
        """Checks, padding and the one ``EPBuffer.dispatch`` call of both layouts: ``(what
        DeepEP returned, Launch, dispatched row bytes)``. Dropless over the bound: dispatched
        again, every rank, once the bound grew (``bounded``; deferred: at ``finish_expanded``,
        ``Launch.again``)."""
        if plan and not defer and not isinstance(x, tuple):
            # NOTE: a planned row shape (the decode path): what it fixes comes from its first
            # call (every check and refusal ran there)
            key = (x.shape[0], x.shape[1], x.dtype, topk_idx.shape[1], expand)
            planned = self._plans.get((*key, self.num_max_tokens_per_rank))
            if planned is not None:
                return self._planned_launch(planned, x, topk_idx, topk_probs, expand)
        given = (x, topk_idx, topk_probs)
        x, scales, wire = sizing.split_rows(x, fp8_multiple=32)
        T, X = x.shape
        k = topk_idx.shape[1]
        sizing.check_topk(k, "DeepEP 2.5 kernels")
        packs = 0 if scales is None else scales.shape[1]
        if scales is not None:  # NOTE: X fp8 bytes; the backward's gradient is bf16
            hidden, elem, grad_elem = X, 1, 2
        else:
            mult = self._dispatch_cols(wire.wire_width, k, x.device)
            hidden = pad(wire.wire_width, mult)
            elem, grad_elem = 2, max(x.element_size(), 2)
        # NOTE: rows DeepEP 2.5's kernels cannot take (thread counts, hybrid channels) are
        # refused before any kernel, alike on every rank
        why = row_refusal(
            self.hybrid,
            self.num_ranks,
            self.num_experts,
            X=X,
            hidden=hidden,
            elem=elem,
            packs=packs,
            k=k,
            grad_elem=grad_elem,
            device=x.device,
        )
        if not self.worst_case:
            refusals.check_dropless_capture("DeepEP 2.5")
        sent, agreement = self._check_tokens(T, (X, k, x.dtype), why)
        if sent < T:  # NOTE: checks off, over the bound: the first ones (_check_tokens)
            x, topk_idx, topk_probs = x[:sent], topk_idx[:sent], topk_probs[:sent]
            scales = None if scales is None else scales[:sent]
        raise_now = checks_enabled(self.checks) or not cuda_code_path(x.device)
        idx = guard_ids(topk_idx.to(torch.int64), self.num_experts, raise_now=raise_now)
        if scales is not None:
            send: Any = (x.contiguous(), scales.contiguous())
            row = dispatch_row_bytes(X, packs, k)
        else:
            send = sizing.pad_cols(wire.send(x), mult)
            row = dispatch_row_bytes(2 * hidden, 0, k)
        # NOTE: sized for the combine of these rows too (bf16, padded to 256 columns)
        buffer = self._buffer(max(hidden, -(-X // COMBINE_COLS) * COMBINE_COLS), k)
        sms = self._sms(k)
        if self.topk_idx_dtype != torch.int64:
            idx = idx.to(self.topk_idx_dtype)
        probs = topk_probs if topk_probs.dtype == torch.float32 else topk_probs.float()
        align = self.expert_alignment if expand else 1
        key = kernel_key(
            "dispatch",
            M=self.num_max_tokens_per_rank,
            hidden=hidden,
            fp8=scales is not None,
            scales=0 if scales is None else scales.shape[1],
            k=k,
            E=self.num_experts,
            sync=not self.worst_case,
            expand=expand,
            align=align,
            sms=sms,
            hybrid=self.hybrid,
        )
        traffic = self._traffic_rows(idx)
        out = self._run(
            key,
            "dispatch",
            lambda: self._kernel(buffer, send, idx, probs, align, sms, expand, defer),
        )
        if defer:  # NOTE: read at finish_expanded, after DeepEP's CPU wait
            launch = Launch(
                wire=wire, fp8=scales is not None, T=T, X=X, k=k, sms=sms, traffic=traffic,
                agreement=agreement, again=given,
            )  # fmt: skip
            return out, launch, row
        if self._agreed(agreement):  # NOTE: a rank was over the bound: it grew everywhere, again
            self._account_dispatch(out[3], traffic, row)
            return self._launch(*given, expand=expand)
        launch = Launch(wire=wire, fp8=scales is not None, T=T, X=X, k=k, sms=sms, traffic=traffic)
        if scales is None and sent == T and not self._checks_flag:  # NOTE: plan this shape
            plans = self._plans  # (checks on: raise_now depends on a capture, not planned)
            if len(plans) >= 16:
                del plans[next(iter(plans))]
            M = self.num_max_tokens_per_rank
            plans[(T, X, x.dtype, k, expand, M)] = _Plan(
                wire, mult, hidden, row, sms, key, raise_now, align
            )
        return out, launch, row

    def _kernel(
        self,
        buffer: Any,
        send: torch.Tensor,
        idx: torch.Tensor,
        probs: torch.Tensor,
        align: int,
        sms: int,
        expand: bool,
        defer: bool,
    ) -> Any:
        """``EPBuffer.dispatch`` of a launch, planned or not (``defer``: DeepEP 2.5's deferred
        epilogue on the compute stream)."""
        return buffer.dispatch(
            send,
            topk_idx=idx.contiguous(),
            topk_weights=probs.contiguous(),
            num_experts=self.num_experts,
            num_max_tokens_per_rank=self.num_max_tokens_per_rank,
            expert_alignment=align,
            num_sms=sms,
            do_cpu_sync=not self._worst,
            do_expand=expand,
            do_zero_padding=expand and align > 1,
            async_with_compute_stream=defer,
            defer_epilogue=defer,
        )

    def _planned_launch(
        self,
        p: _Plan,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        expand: bool,
    ) -> tuple[Any, Launch, int]:
        """``_launch`` (not deferred) of a row shape planned by its first call: the wire
        format, padding, refusal, row bytes, SM count, kernel key (run once: no compile, nothing
        to refuse inside a capture) and the id policy are the plan's; the token bound, the ids'
        guard, the buffer, the traffic rows and DeepEP's dispatch run as in ``_launch``."""
        T, X = x.shape
        k = topk_idx.shape[1]
        if self._worst and not self._checks_flag and self.max_tokens >= T:
            agreement = None  # NOTE: what _check_tokens answers here, without a call
        else:
            if not self._worst:
                refusals.check_dropless_capture("DeepEP 2.5")
            sent, agreement = self._check_tokens(T, (X, k, x.dtype), None)
            if sent < T:  # NOTE: over the bound (checks off): the unplanned path cuts the rows
                return self._launch(x, topk_idx, topk_probs, expand=expand, plan=False)
        idx = guard_ids(topk_idx.to(torch.int64), self.num_experts, raise_now=p.raise_now)
        send = sizing.pad_cols(p.wire.send(x), p.mult)
        buffer = self._buffer(p.buffer_cols, k)
        if self.topk_idx_dtype != torch.int64:
            idx = idx.to(self.topk_idx_dtype)
        probs = topk_probs if topk_probs.dtype == torch.float32 else topk_probs.float()
        traffic = self._traffic_rows(idx)
        sms = p.sms
        out = self._kernel(buffer, send, idx, probs, p.align, sms, expand, False)
        if agreement is not None and self._agreed(agreement):  # NOTE: it grew everywhere: again
            self._account_dispatch(out[3], traffic, p.row)
            return self._launch(x, topk_idx, topk_probs, expand=expand)
        launch = Launch(wire=p.wire, fp8=False, T=T, X=X, k=k, sms=sms, traffic=traffic)
        return out, launch, p.row

    def _account_dispatch(self, handle: Any, traffic: torch.Tensor, row: int) -> None:
        received = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
        self._count([traffic[0], received, traffic[1] * row, traffic[2] * row])

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """``EPBuffer.dispatch`` mapped to the contract (module docstring); ``layout`` is
        ignored (V2.5 computes its layout inside the dispatch kernel)."""
        out, launch, row = self._launch(x, topk_idx, topk_probs, expand=False)
        recv, recv_idx, recv_w, handle, _ = out
        recv_scales = None
        if launch.fp8:
            recv, recv_scales = recv
        self._account_dispatch(handle, launch.traffic, row)
        return self._received(
            recv, recv_idx, recv_w, recv_scales, handle, launch, cols=recv.shape[1]
        )

    # ----------------------------------------------------------------- expanded
    def launch_expanded(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> PendingExpanded:
        """Issue ``dispatch_expanded`` with DeepEP's ``defer_epilogue``: the kernel runs (on
        DeepEP's stream), the receive epilogue (and, dropless, the CPU wait) at ``finish``."""
        out, launch, row = self._launch(x, topk_idx, topk_probs, expand=True, defer=True)
        pending = PendingExpanded(out, launch, row)
        self._shared.hold(pending)  # NOTE: the next call on the buffer settles it first
        return pending

    def check_finish(self, p: PendingExpanded) -> None:
        """Raise RuntimeError when ``p`` cannot be finished now (``buffer.check_epilogue``:
        inside a CUDA-graph capture it was not launched in)."""
        check_epilogue(p)

    def finish_expanded(self, p: PendingExpanded) -> ExpandedDispatchResult:
        """Wait for a ``launch_expanded`` and build its result (its epilogue may have run
        already, when another call on the buffer came first)."""
        check_epilogue(p)
        if self._shared.pending is p:
            self._shared.pending = None
        p.settle()
        p.join()  # NOTE: an epilogue run early on another stream: this stream waits for it
        rows.STREAMS.used(rows.tensors_of(p.result))
        recv, _, recv_w, handle = p.result
        if self._agreed(p.launch.agreement):  # NOTE: a rank was over the bound: it grew, again
            self._account_dispatch(handle, p.launch.traffic, p.row_bytes)
            return self.dispatch_expanded(*p.launch.again)
        return self._expanded(recv, recv_w, handle, p.launch, p.row_bytes)

    def dispatch_expanded(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> ExpandedDispatchResult:
        """``EPBuffer.dispatch(do_expand=True)``: one row per (token, local expert), expert
        ``j``'s segment (padded to ``expert_alignment`` with zero rows) after expert ``j - 1``'s
        (``BoundedBackend._received_expanded``)."""
        out, launch, row = self._launch(x, topk_idx, topk_probs, expand=True)
        recv, _, recv_w, handle, _ = out
        return self._expanded(recv, recv_w, handle, launch, row)

    def _expanded(
        self, recv: Any, recv_w: torch.Tensor, handle: Any, launch: Launch, row: int
    ) -> ExpandedDispatchResult:
        recv_scales = None
        if launch.fp8:
            recv, recv_scales = recv
        self._account_dispatch(handle, launch.traffic, row)
        return self._received_expanded(recv, recv_w, recv_scales, handle, launch)

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Re-send ``[T, X]`` rows along a dispatch's ``EPHandle`` (no host sync).

        Hybrid mode picks its channels per SM from the call's token layout, and a cached dispatch
        must have the handle's (csrc/buffers/ep.hpp:437-456, 482-486). So there the rows travel
        in the dispatch's own layout: along an fp8 handle ``X`` bytes per row as fp8 beside its
        scale packs (zero), along a bf16 handle rows of its width, in as many calls as the bytes
        need (``layout.cached_pieces``), bit for bit (an fp8 dispatch's backward too).
        """
        state: BoundedState = handle.state
        h = state.handle
        x = x[: sent_tokens(state)]  # NOTE: the tokens the dispatch sent
        if x.numel() == 0:  # NOTE: an empty gradient may have stride 0 (no bit view of it)
            x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        w = wire.send(x)
        w = sizing.pad_cols(w, self._dispatch_cols(w.shape[1], state.topk, x.device))
        if not self.hybrid:  # NOTE: a gradient wider than the dispatch foresaw
            R, E, k = self.num_ranks, self.num_experts, state.topk
            why = cached_refusal(R, E, row_bytes=2 * w.shape[1], k=k, device=x.device)
            if why is not None:
                raise ValueError(why)
        buffer = self._buffer(max(w.shape[1], COMBINE_COLS), state.topk)
        fp8 = state.recv_scales is not None
        packs = state.recv_scales.shape[1] if state.recv_scales is not None else 0
        # the dispatch's row: X fp8 bytes and its scales, or its padded bf16 columns
        if fp8:
            unit = handle.hidden
        else:
            cols = state.wire.wire_width
            unit = 2 * pad(cols, self._dispatch_cols(cols, state.topk, x.device))
        split = self.hybrid and (fp8 or unit != 2 * w.shape[1])
        key = kernel_key(
            "cached",
            M=h.num_max_tokens_per_rank,  # the handle's (a dropless bound may have grown)
            hidden=(unit if fp8 else unit // 2) if split else w.shape[1],
            fp8=split and fp8,
            scales=packs if split else 0,
            k=state.topk,
            E=self.num_experts,
            expand=bool(h.do_expand),
            align=h.expert_alignment,
            sms=state.sms,
            hybrid=self.hybrid,
        )

        def send(rows: Any) -> torch.Tensor:
            got, *_ = self._run(
                key,
                "cached dispatch",
                lambda: buffer.dispatch(
                    rows,
                    handle=h,
                    do_expand=h.do_expand,
                    num_sms=state.sms,
                    do_zero_padding=bool(h.do_expand) and h.expert_alignment > 1,
                ),
            )
            return got[0] if isinstance(got, tuple) else got

        if split:
            got = cached_pieces(w, unit, packs if fp8 else -1, send)
            row = dispatch_row_bytes(unit, packs, state.topk) * -(-2 * w.shape[1] // unit)
        else:
            got = send(w)
            row = dispatch_row_bytes(2 * w.shape[1], 0, state.topk)
        t = state.traffic
        self._count([0, 0, t[1] * row, t[2] * row])
        got = got[state.order] if state.order is not None else got[: handle.num_recv_rows]
        if state.valid is not None:
            got = sizing.zero_invalid_rows_(got, state.valid)  # a gather, or DeepEP's output
        return wire.recv(got)

    # ----------------------------------------------------------------- combine
    def _combine_call(
        self,
        part: torch.Tensor,
        state: BoundedState,
        weights: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ``EPBuffer.combine``, its kernel template refused inside a capture when new."""
        h, k = state.handle, state.topk
        buffer = self._buffer(part.shape[1], k)
        known = self._combines.get((part.shape[1], k, h.num_max_tokens_per_rank, h.do_expand))
        if known is not None and known[0][0] == state.sms:  # NOTE: run before: no compile
            out, out_w, _ = buffer.combine(
                part, h, topk_weights=weights, bias=bias, num_sms=state.sms
            )
            t, row = state.traffic, known[1]
            self._count([0, 0, t[1] * row, t[2] * row])
            return out, out_w
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
        self._count([0, 0, t[1] * row, t[2] * row])
        if len(self._combines) >= 64:
            self._combines.clear()
        self._combines[(part.shape[1], k, h.num_max_tokens_per_rank, h.do_expand)] = (
            (state.sms, key),
            row,
        )
        return out, out_w
