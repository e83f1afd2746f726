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
- **Dropless**: ``do_cpu_sync=True``. Every token is sent (audit-4 P3): every rank's T is agreed
  on the host first (five ints gathered over gloo, ``distributed.host_gather_int64``: no device
  collective, no host sync), and when a rank has more than the bound every rank raises it to
  that T's bucket (the buffer grows with it). One host sync: DeepEP's CPU wait. Not capturable
  (refused inside a CUDA graph). **Worst-case**: ``do_cpu_sync=False``, no host sync, inside a
  node and across nodes; rows past the real ones are masked on the device.
- **JIT**: each kernel template compiles at first use; ``ep_buffer.KernelRegistry`` knows which
  ran, and a first use inside a CUDA-graph capture raises with the fix
  (``FlexDispatcher.warmup``).
- **Combine**: V2.5's unweighted bf16 sum (rows padded to 256 columns), optionally plus a
  ``bias`` added before its one rounding (the shared experts' output: ``combine_bias``); narrow
  fp32/fp16 rows (<= 32 columns, the probs gradient) are summed exactly in fp32 through combine's
  ``topk_weights`` channel, one combine per column.
- **Overlap**: ``launch_expanded`` issues the dispatch with ``defer_epilogue`` (the receive
  epilogue and, dropless, the CPU wait run at ``finish_expanded``), so the layer can compute its
  shared experts while the rows are in flight. The epilogue reads the buffer's shared receive
  slots, so any other call on the buffer runs it first (``ep_buffer.SharedEPBuffer.settle``,
  audit-4 P2).
- **SMs / QPs**: DeepEP 2.5's bandwidth model picks both (``get_theoretical_num_sms``, agreed
  across ranks once; ``get_theoretical_num_qps``) unless ``deepep_num_sms`` is set.
- **Ids**: ids >= E and repeated ids never reach a kernel (``ep_rows.guard_ids``).
- **Statistics**: rows and bytes per link class are computed on the device (``ep_rows.
  traffic_rows``) and summed by ``counters.TrafficCounters`` (as on V1 / V2): no host read and
  no host-to-device copy on the hot path, in place inside a CUDA-graph capture (audit-4 P1).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import checks_enabled, cuda_code_path
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import agree_tokens
from flexdispatch.backends.deepep import refusals, sizing
from flexdispatch.backends.deepep.counters import TrafficCounters
from flexdispatch.backends.deepep.v25.buffer import (
    EPSize,
    acquire_ep,
    check_epilogue,
    kernel_key,
    kernels_of,
)
from flexdispatch.backends.deepep.v25.combine import EPCombineMixin, sent_tokens
from flexdispatch.backends.deepep.v25.layout import (
    COMBINE_COLS,
    cached_pieces,
    cached_refusal,
    dispatch_cols,
    pad,
    row_refusal,
)
from flexdispatch.backends.deepep.v25.rows import (
    EPTraffic,
    PendingExpanded,
    V25DispatchState,
    dispatch_row_bytes,
    guard_ids,
    token_order,
    traffic_rows,
)
from flexdispatch.backends.deepep.v25.support import (
    load_deep_ep_v25,
    token_bucket,
    tokens_message,
    v25_available,
    v25_rules,
)
from flexdispatch.distributed import collective_device, group_rank, group_size
from flexdispatch.types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    DispatchStats,
    ExpandedDispatchResult,
)

if TYPE_CHECKING:
    from flexdispatch.config import DispatchConfig

__all__ = ["DeepEPV25Backend", "V25DispatchState", "PendingExpanded"]


class DeepEPV25Backend(EPCombineMixin, DispatchBackend):
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

    name = "deepep"
    api = "v25"

    @classmethod
    def config_options(cls, config: DispatchConfig) -> dict[str, Any]:
        return {
            "num_sms": config.deepep_num_sms,
            "num_max_tokens_per_rank": config.num_max_dispatch_tokens_per_rank,
            "hybrid": config.deepep_hybrid,
            "expert_alignment": config.expert_alignment,
        }

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_experts: int,
        ranks_per_node: int,
        num_worst_tokens: int = 0,
        hierarchical: bool = False,
        checks: bool | None = None,
        stats: DispatchStats | None = None,
        num_sms: int | None = None,
        num_max_tokens_per_rank: int = 128,
        hybrid: bool | None = None,
        expert_alignment: int = 1,
        _deep_ep: ModuleType | None = None,
    ) -> None:
        module, why = (_deep_ep, "given") if _deep_ep is not None else load_deep_ep_v25()
        ok, why = v25_available(module, why)
        if not ok or module is None:
            raise ValueError(f"deepep_api='v25' cannot run: {why}")
        self.group = group if group is not None else dist.group.WORLD
        self.num_ranks = R = group_size(group)
        self.rank = group_rank(group)
        self.ranks_per_node = ranks_per_node
        self.num_experts = num_experts
        _, nvl = (1, R) if R == 1 else module.get_physical_domain_size(self.group)
        ok, why, self.hybrid = v25_rules(
            R, nvl, num_experts, hybrid=hybrid, num_worst_tokens=num_worst_tokens
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
        self.mode = why
        self.nvl = nvl
        self.num_worst_tokens = num_worst_tokens
        self.hierarchical = hierarchical
        self.checks = checks
        self._stats = stats if stats is not None else DispatchStats()
        self.num_sms = num_sms
        self.max_tokens = num_worst_tokens // R if num_worst_tokens else num_max_tokens_per_rank
        self.num_max_tokens_per_rank = token_bucket(self.max_tokens)
        self.expert_alignment = expert_alignment
        self.deep_ep = module
        self.topk_idx_dtype: torch.dtype = getattr(module, "topk_idx_t", torch.int64)
        self._shared = acquire_ep(module, self.group, self.hybrid, id(self), rdma=nvl < R)
        self._kernels = kernels_of(module)
        self._traffic: EPTraffic | None = None
        self._counters = TrafficCounters(collective_device(self.group))  # no host read in calls
        self._need_tokens = 0  # most tokens a rank had to dispatch, when over the bound
        self._peak_tokens = 0  # dropless: the largest T the ranks agreed on so far
        self._grown_from: tuple[int, int] | None = None  # the bound before a growth not yet built
        self._closed = False

    # ----------------------------------------------------------------- capabilities
    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    def supports_worst_case(self) -> Capability:
        return True, (
            "deepep ep (DeepEP 2.5): num_worst_tokens = W -> do_cpu_sync=False with "
            "num_max_tokens_per_rank = bucket(W / R), intranode and across nodes"
        )

    def supports_cuda_graph(self) -> Capability:
        if not self.worst_case:
            return False, (
                "DeepEP 2.5's dropless dispatch waits on the CPU for the receive counts: set "
                "num_worst_tokens for a capturable dispatch"
            )
        return True, "deepep ep worst-case dispatch: static shapes, no host sync (warmup() first)"

    def supports_hierarchical(self) -> Capability:
        return True, f"deepep ep: {self.mode}"

    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        ok, why, _ = v25_rules(num_ranks, self.nvl, self.num_experts)
        return ok, why

    def supports_expanded(self) -> Capability:
        return True, "deepep ep: do_expand=True, rows grouped by local expert"

    def supports_combine_bias(self, dtype: torch.dtype) -> Capability:
        if dtype != torch.bfloat16:
            return False, f"DeepEP 2.5 adds a bias to bf16 rows only, not {dtype}"
        return True, "DeepEP 2.5 combine adds the bias before its one bf16 rounding"

    def supports_overlap(self, *, expanded: bool) -> Capability:
        if not expanded:
            return False, "DeepEP 2.5 overlaps dispatch_expanded only (defer_epilogue)"
        return True, "DeepEP 2.5 defer_epilogue: the receive epilogue runs at finish_expanded"

    @property
    def stats(self) -> DispatchStats:
        """Cumulative counters (the device counters read first)."""
        self.flush_stats()
        return self._stats

    @stats.setter
    def stats(self, value: DispatchStats) -> None:
        self._stats = value

    # ----------------------------------------------------------------- statistics
    def flush_stats(self) -> None:
        """Add the counted traffic to ``stats`` (the safe point: one host read on CUDA)."""
        self._counters.drain(self._stats)

    def _count(self, device: torch.device, vals: list[torch.Tensor | int]) -> None:
        """Count one call: ``[rows sent, rows received, NVLink bytes, RDMA bytes]`` (0-d device
        tensors or ints; an int is a fill on the device, never a host-to-device copy)."""
        sent, received, intra, inter = vals
        self._counters.record(lambda: (intra, inter, sent, received))

    def _traffic_rows(self, idx: torch.Tensor) -> torch.Tensor:
        if self._traffic is None or self._traffic.intra.device != idx.device:
            self._traffic = EPTraffic.of(
                self.rank, self.num_ranks, min(self.nvl, self.num_ranks), self.hybrid, idx.device
            )
        return traffic_rows(idx, self.num_local_experts, self._traffic)

    # ----------------------------------------------------------------- helpers
    def _buffer(self, hidden: int, topk: int) -> Any:
        if self._closed:
            raise RuntimeError("this deepep backend was closed")
        before = self._shared.allocations
        size = EPSize(self.num_max_tokens_per_rank, hidden, max(topk, 1))
        try:
            buffer = self._shared.ensure(
                size, tokens=self._peak_tokens, worst=self.num_worst_tokens
            )
        except ValueError:  # NOTE: it does not fit on some rank: every rank keeps its old bound
            if self._grown_from is not None:
                self.max_tokens, self.num_max_tokens_per_rank = self._grown_from
            self._grown_from = None
            raise
        self._grown_from = None
        if self._shared.allocations != before:
            extra = self._stats.extra
            extra["deepep_buffer_allocations"] = extra.get("deepep_buffer_allocations", 0) + 1
        return buffer

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

    def _check_tokens(self, T: int, shape: tuple, refusal: str | None) -> int:
        """The tokens this rank sends, after every rank agreed on the bound (audit-4 P3) and on
        its rows (``refusal``: why DeepEP 2.5 cannot run them here, or None).

        Dropless: nothing is dropped. Every rank's T, row shape and refusal are agreed on the
        host first (``counts.agree_tokens``: a gloo all-gather, no host sync; a refusal or a
        shape mismatch anywhere raises on every rank); when a rank has more than the bound,
        every rank raises it to that T's bucket at this same call (``_grow_bound``; the buffer
        grows with it), as V1's buffers grow.

        Worst-case: a rank may send at most ``W / R`` tokens. With checks on, the same agreement
        makes every rank raise alike; with checks off (no collective: the rows' refusal is a
        function of the shape the ranks must agree on) a rank over it sends its first ``W / R``
        tokens (its others combine to zero) and ``check_overflow`` raises: raising on that rank
        alone would leave its peers inside DeepEP's collective (audit-3 N7, as on V2)."""
        M, R = self.max_tokens, self.num_ranks
        if not self.worst_case or checks_enabled(self.checks):
            counts = agree_tokens(T, shape, self.group, refusal=refusal, name="ep token count")
            if not self.worst_case:
                self._grow_bound(max(counts))
                return T
            worst = max(range(R), key=counts.__getitem__)
            if counts[worst] > M:
                W = self.num_worst_tokens
                raise ValueError(tokens_message(worst, counts[worst], M=M, R=R, W=W))
            return T
        if refusal is not None:
            raise ValueError(refusal)
        if T > M:
            self._need_tokens = max(self._need_tokens, T)
            return M
        return T

    def _grow_bound(self, need: int) -> None:
        """Dropless: raise the per-rank token bound to ``need`` (every rank at the same call:
        ``need`` is the agreed maximum); DeepEP compiles ``bucket(need)`` and the shared buffer
        is rebuilt for it at this call's ``_buffer``, once every rank agreed it fits (else every
        rank raises and keeps its old bound)."""
        self._peak_tokens = max(self._peak_tokens, need)
        if need <= self.max_tokens:
            return
        if self._grown_from is None:
            self._grown_from = (self.max_tokens, self.num_max_tokens_per_rank)
        self.max_tokens = need
        self.num_max_tokens_per_rank = max(self.num_max_tokens_per_rank, token_bucket(need))
        extra = self._stats.extra
        extra["deepep_token_bound"] = self.num_max_tokens_per_rank

    def check_overflow(self) -> None:
        """Raise if a rank was over ``W / R`` with checks off in worst-case mode (it sent its
        first ones; a dropless bound grows instead)."""
        self.flush_stats()
        if self._need_tokens:
            M, W = self.max_tokens, self.num_worst_tokens
            msg = tokens_message("this", self._need_tokens, M=M, R=self.num_ranks, W=W)
            raise ValueError(f"{msg}; tokens past the first {M} were not dispatched")

    # ----------------------------------------------------------------- dispatch
    def _launch(
        self,
        x: Any,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        *,
        expand: bool,
        defer: bool = False,
    ) -> tuple:
        """Checks, padding and the one ``EPBuffer.dispatch`` call of both layouts."""
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
        # NOTE: audit-4 P10 / EV5 / EV6: refused before any kernel, alike on every rank
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
        sent = self._check_tokens(T, (X, k, x.dtype), why)
        if sent < T:  # NOTE: worst-case, checks off, over W / R: the first ones (_check_tokens)
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
            lambda: buffer.dispatch(
                send,
                topk_idx=idx.contiguous(),
                topk_weights=probs.contiguous(),
                num_experts=self.num_experts,
                num_max_tokens_per_rank=self.num_max_tokens_per_rank,
                expert_alignment=align,
                num_sms=sms,
                do_cpu_sync=not self.worst_case,
                do_expand=expand,
                do_zero_padding=expand and align > 1,
                async_with_compute_stream=defer,
                defer_epilogue=defer,
            ),
        )
        return out, wire, scales is not None, T, X, k, sms, traffic, row

    def _account_dispatch(self, handle: Any, traffic: torch.Tensor, row: int) -> None:
        received = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
        self._count(traffic.device, [traffic[0], received, traffic[1] * row, traffic[2] * row])

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """``EPBuffer.dispatch`` mapped to the contract (module docstring); ``layout`` is
        ignored (V2.5 computes its layout inside the dispatch kernel)."""
        out, wire, fp8, T, X, k, sms, traffic, row = self._launch(
            x, topk_idx, topk_probs, expand=False
        )
        recv, recv_idx, recv_w, handle, _ = out
        recv_scales = None
        if fp8:
            recv, recv_scales = recv
        self._account_dispatch(handle, traffic, row)
        rows, e = recv.shape[0], self.num_local_experts
        valid = pairs = None
        if self.worst_case:
            W = self.num_worst_tokens
            n = handle.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
            order = token_order(handle, rows, n, W)
            valid = torch.arange(W, device=recv.device) < n
        else:
            order = token_order(handle, rows, None, rows)
        recv, recv_idx, recv_w = recv[order], recv_idx[order].to(torch.int64), recv_w[order]
        if recv_scales is not None:
            recv_scales = recv_scales[order]
        local = recv_idx >= 0
        if valid is not None:
            local &= valid[:, None]
            recv_idx = torch.where(local, recv_idx, -1)
            recv = sizing.zero_invalid_rows_(recv, valid)  # the gather's own copy (P13)
            counts = sizing.count_valid(recv_idx.reshape(-1), local.reshape(-1), e)
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales, valid)
        else:
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            count_list = handle.num_recv_tokens_per_expert_list
            pairs = int(sum(count_list))
            counts = torch.tensor(count_list, dtype=torch.int64, device=recv_idx.device)
        recv_w = torch.where(local, recv_w.float(), 0.0)
        state = V25DispatchState(
            handle=handle,
            wire=wire,
            topk=k,
            sms=sms,
            rows=rows,
            order=order,
            local=local,
            valid=valid,
            recv_scales=recv_scales,
            traffic=traffic,
        )
        return DispatchResult(
            recv_x=recv if fp8 else wire.recv(recv),
            recv_topk_idx=recv_idx,
            recv_topk_probs=recv_w,
            num_recv_tokens_per_expert=counts,
            handle=DispatchHandle(
                backend=self.name, num_tokens=T, hidden=X, num_recv_rows=recv.shape[0], state=state
            ),
            num_recv_pairs=pairs,
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
        out, wire, fp8, T, X, k, sms, traffic, row = self._launch(
            x, topk_idx, topk_probs, expand=True, defer=True
        )
        pending = PendingExpanded(out, wire, fp8, T, X, k, sms, traffic, row)
        self._shared.hold(pending)  # NOTE: the next call on the buffer settles it first
        return pending

    def check_finish(self, p: PendingExpanded) -> None:
        """Raise RuntimeError when ``p`` cannot be finished now (``ep_buffer.check_epilogue``:
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
        recv, _, recv_w, handle = p.result
        return self._expanded(recv, recv_w, handle, p)

    def dispatch_expanded(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> ExpandedDispatchResult:
        """``EPBuffer.dispatch(do_expand=True)``: one row per (token, local expert), expert
        ``j``'s segment (padded to ``expert_alignment`` with zero rows) after expert ``j - 1``'s.

        Dropless: DeepEP's exact rows and segment sizes (its one CPU wait). Worst-case: the
        static ``align(R * (W / R) * min(k, e) + (a - 1) * e, a)`` rows, zero past the segments.
        """
        out, wire, fp8, T, X, k, sms, traffic, row = self._launch(
            x, topk_idx, topk_probs, expand=True
        )
        recv, _, recv_w, handle, _ = out
        pending = PendingExpanded(None, wire, fp8, T, X, k, sms, traffic, row)
        return self._expanded(recv, recv_w, handle, pending)

    def _expanded(
        self, recv: Any, recv_w: torch.Tensor, handle: Any, p: PendingExpanded
    ) -> ExpandedDispatchResult:
        recv_scales = None
        if p.fp8:
            recv, recv_scales = recv
        self._account_dispatch(handle, p.traffic, p.row_bytes)
        a, e = self.expert_alignment, self.num_local_experts
        valid = None
        if self.worst_case:
            M = self.max_tokens
            N = -(-(self.num_ranks * M * min(p.k, e) + (a - 1) * e) // a) * a
            recv, recv_w = recv[:N], recv_w[:N]
            counts = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64)
            counts = (counts + a - 1) // a * a
            valid = torch.arange(N, device=recv.device) < counts.sum()
            recv = sizing.zero_invalid_rows_(recv, valid)  # DeepEP's fresh output (P13)
            recv_w = torch.where(valid, recv_w, 0.0)
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales[:N], valid)
        else:
            # NOTE: exact rows; the alignment gaps are zero already (do_zero_padding)
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            counts = torch.tensor(
                handle.num_recv_tokens_per_expert_list, dtype=torch.int64, device=recv.device
            )
        state = V25DispatchState(
            handle=handle,
            wire=p.wire,
            topk=p.k,
            sms=p.sms,
            rows=recv.shape[0],
            order=None,
            local=None,
            valid=valid,
            recv_scales=recv_scales,
            traffic=p.traffic,
        )
        return ExpandedDispatchResult(
            recv_x=recv if p.fp8 else p.wire.recv(recv),
            recv_probs=recv_w.float(),
            tokens_per_expert=counts,
            handle=DispatchHandle(
                backend=self.name,
                num_tokens=p.T,
                hidden=p.X,
                num_recv_rows=recv.shape[0],
                state=state,
            ),
        )

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Re-send ``[T, X]`` rows along a dispatch's ``EPHandle`` (no host sync).

        Hybrid mode picks its channels per SM from the call's token layout, and a cached dispatch
        must have the handle's (csrc/buffers/ep.hpp:437-456, 482-486). So there the rows travel
        in the dispatch's own layout: along an fp8 handle ``X`` bytes per row as fp8 beside its
        scale packs (zero), along a bf16 handle rows of its width, in as many calls as the bytes
        need (``ep_layout.cached_pieces``), bit for bit (audit-4 P4: an fp8 dispatch's backward).
        """
        state: V25DispatchState = handle.state
        h = state.handle
        x = x[: sent_tokens(state)]  # NOTE: the tokens the dispatch sent (N7)
        if x.numel() == 0:  # NOTE: an empty gradient may have stride 0 (no bit view of it)
            x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        w = wire.send(x)
        w = sizing.pad_cols(w, self._dispatch_cols(w.shape[1], state.topk, x.device))
        if not self.hybrid:  # NOTE: a gradient wider than the dispatch foresaw (P10)
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
        self._count(t.device, [0, 0, t[1] * row, t[2] * row])
        got = got[state.order] if state.order is not None else got[: handle.num_recv_rows]
        if state.valid is not None:
            got = sizing.zero_invalid_rows_(got, state.valid)  # a gather, or DeepEP's output
        return wire.recv(got)

    def close(self) -> None:
        """Leave the shared ``EPBuffer`` (the device counters are folded into ``stats``)."""
        if not self._closed:
            self.flush_stats()
            self._closed = True
            self._shared.leave(id(self))
