"""The ``deepep`` backend: DeepEP's fused NVLink/RDMA kernels behind the dispatch contract.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · X any row width · Xw wire width (bf16 columns).

How the contract maps onto ``deep_ep.Buffer`` (the V1 API: v1.2.1, and ``deep_ep.Buffer`` of 2.1.0):

- ``deep_ep`` is imported lazily; every known import failure becomes a reason string
  (``load_deep_ep``), never a crash. The limits applied are those of the module's release
  (``rules``: v1.2.1 for a source build, 2.1.0 for the ``sgl-deep-ep`` wheel).
- **One buffer per process and group** (``buffer.SharedBuffer``), shared by every
  dispatcher and layer on that group, normal and low-latency kernels alike.
- **Layout from DeepEP's own kernel**: ``Buffer.get_dispatch_layout`` turns the ``[T, k]`` ids into
  DeepEP's layout tensors (one fused kernel on a GPU); a caller's ``layout`` is used as given.
- **Rows DeepEP accepts**: rows travel as bf16 bit views (fp32 as ``2H`` columns, fp16
  reinterpreted, exact for every dtype). A row wider than the kernels take (the SM90 TMA cap of
  16,352 bytes intranode, 16,368 bytes with metadata internode) is split into column chunks: the
  first chunk goes with the top-k ids, the others follow along DeepEP's handle (cached dispatch,
  no host sync). Combine rows are padded to the widths the reduce loops need (a multiple of 256
  bf16 columns internode and at v1.2.1 intranode) and chunked the same way. fp8 ``(x, scales)``
  tuples pass through as DeepEP takes them.
- Combine: DeepEP reduces bf16 only. bf16 rows use it directly; fp32/fp16 rows of at most 32
  columns (the probs gradient of the backward pass) go through combine's fp32 ``topk_weights``
  channel, which sums exactly in fp32; wider fp32/fp16 rows are reduced in bf16 (relative error
  ~2^-8) — use bf16 activations with this backend.
- **No collective beyond DeepEP's own** with checks off: statistics and ``num_recv_pairs`` come from
  what DeepEP exchanges anyway (the handle's prefix matrices, its per-expert count list). With
  checks on (or ``FLEXDISPATCH_CHECKS=1``) one small all-gather before DeepEP's kernels checks
  that every rank agrees on the row shape and catches worst-case overflows on every rank.
- Dropless dispatch: DeepEP's CPU waits for the receive counts (one host sync, counted).
- Worst-case dispatch (intranode, ``num_worst_tokens = W``): ``W`` is passed through. Like the torch
  backend, a sender may put at most ``W / R`` rows on each destination, which bounds what any rank
  receives by ``W`` (DeepEP itself would write past its outputs); a rank with ``T <= W / R`` tokens
  can never exceed it, so nothing is computed for it. A rank with more tokens keeps, per
  destination, its first ``W / R`` on the device and records the W that would have been needed
  (``check_overflow``). The garbage tails of ``recv_x`` / ``recv_topk_weights`` are zeroed and the
  per-expert counts rebuilt from ``recv_topk_idx`` on the device.
- Cached dispatch (the backward of combine) re-sends along DeepEP's handle: no host sync.
- Statistics (``counters.TrafficCounters``): computed from the handle's small tensors and summed
  on the device every 64 calls (handles released then), in place at once while a CUDA graph is
  captured; read on the host only when ``stats`` is read, ``check_overflow()`` runs or the
  backend closes (no host read inside dispatch or combine, ever).
- Low-latency decode (``mode="low_latency"``): ``low_latency.LowLatencyMixin``.
- ``dispatch`` itself, planned per row shape after its first call: ``planned.PlannedDispatch``.

Tests inject DeepEP's own Python layer over an emulated runtime (``tests/deepep_emu/load.py``)
through the private ``_deep_ep`` argument; only a module that marks itself ``IS_EMULATOR`` lifts the
NCCL/CUDA requirement.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import checks_enabled, checks_flag, is_capturing
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import check_agreement, exchange_counts
from flexdispatch.backends.deepep import buffer as deepep_buffer
from flexdispatch.backends.deepep import refusals, rules, sizing
from flexdispatch.backends.deepep.counters import DeviceMax, TrafficCounters
from flexdispatch.backends.deepep.support import deepep_support, nvl_peers, require_deep_ep
from flexdispatch.backends.deepep.v1.combine import CombineMixin, Launched
from flexdispatch.backends.deepep.v1.links import LazyLinks, handle_links
from flexdispatch.backends.deepep.v1.low_latency import LowLatencyMixin
from flexdispatch.backends.deepep.v1.planned import PlannedDispatch, _CombinePlan, _Plan
from flexdispatch.distributed import collective_device
from flexdispatch.types import DispatchHandle, DispatchLayout, DispatchResult

__all__ = ["DeepEPV1Backend", "DeepEPDispatchState"]


@dataclass(frozen=True, kw_only=True)
class DeepEPDispatchState:
    """The deepep backend's part of a ``DispatchHandle``.

    Attributes:
        handle: DeepEP's own handle (a tuple, opaque).
        wire: the wire format of the dispatched rows.
        chunks: the column chunks the rows travelled in (one DeepEP call each).
        valid: ``[W]`` bool real rows in worst-case mode, else None.
        links: ``LazyLinks`` of this dispatch (computed when statistics are summed).
        recv_scales: ``[M, H / 128]`` float32 scales of an fp8 dispatch, else None.
    """

    handle: tuple
    wire: sizing.WireFormat
    chunks: tuple[rules.Chunk, ...]
    valid: torch.Tensor | None
    links: LazyLinks
    recv_scales: torch.Tensor | None


class DeepEPV1Backend(LowLatencyMixin, CombineMixin, PlannedDispatch, DispatchBackend):
    """Dispatch/combine over ``deep_ep.Buffer`` (normal, worst-case and low-latency kernels).

    Args:
        group: the process group (None = WORLD); NCCL on CUDA.
        num_experts: E, divisible by R.
        ranks_per_node: L as launched (8 for internode DeepEP).
        num_worst_tokens: W (0 = dropless). Intranode only.
        hierarchical: accepted; DeepEP's internode kernels are node-aware by construction.
        checks: host-syncing value checks (shape agreement, overflow) with one extra all-gather.
        stats: counters to add to.
        async_finish: launch on DeepEP's communication stream (inputs fenced by an event, outputs
            allocated there); the current stream then waits for it on the GPU, not the host.
        num_sms: SMs of this backend's normal kernels (even; None: ``Buffer.num_sms`` as it is
            now). Passed in the ``Config`` of every call, never set on DeepEP's class (its
            ``set_num_sms`` is process-wide: issue 44, Q7).
        mode: ``"normal"`` or ``"low_latency"`` (allocates the low-latency buffers too).
        num_max_dispatch_tokens_per_rank: tokens per rank and low-latency call.
        use_fp8: low-latency dispatch casts to fp8 (per-128-channel scales).
        _deep_ep: a ``deep_ep`` module to use instead of importing one (tests pass DeepEP's Python
            layer over the emulated runtime; only a module marked ``IS_EMULATOR`` may run on a
            CPU/gloo group).

    Raises:
        ValueError: DeepEP cannot serve this group (the reason is in the message).
    """

    name = "deepep"
    api = "v1"

    config_fields = {  # noqa: RUF012
        "async_finish": "deepep_async_finish",
        "num_sms": "deepep_num_sms",
        "mode": "mode",
        "num_max_dispatch_tokens_per_rank": "num_max_dispatch_tokens_per_rank",
        "use_fp8": "use_fp8",
    }

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        async_finish: bool = False,
        num_sms: int | None = None,
        mode: Literal["normal", "low_latency"] = "normal",
        num_max_dispatch_tokens_per_rank: int = 128,
        use_fp8: bool = False,
        _deep_ep: ModuleType | None = None,
        **common: Any,
    ) -> None:
        module = require_deep_ep(_deep_ep)
        if mode not in ("normal", "low_latency"):
            raise ValueError(f"mode must be 'normal' or 'low_latency', got {mode!r}")
        super().__init__(group, **common)
        self.group = group if group is not None else dist.group.WORLD
        num_experts, ranks_per_node = self.num_experts, self.ranks_per_node
        num_worst_tokens = self.num_worst_tokens
        self.async_finish = async_finish
        self.mode = mode
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.use_fp8 = use_fp8
        self.release = rules.release_of(module)
        self.rules = rules.rules_for(self.release)
        ok, why = deepep_support(
            group=group,
            num_experts=num_experts,
            ranks_per_node=ranks_per_node,
            num_worst_tokens=num_worst_tokens,
            mode=mode,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            deep_ep=module,
        )
        if not ok:
            raise ValueError(f"deepep backend cannot serve this group: {why}")
        # NOTE: low-latency mode is checked against the low-latency kernels' rule (any node
        # count); the normal kernels on the same backend keep theirs
        self._normal_refusal = None
        if mode == "low_latency":
            ok, why = sizing.check_topology(
                self.num_ranks,
                ranks_per_node,
                num_worst_tokens=num_worst_tokens,
                internode_node_counts=self.rules.internode_node_counts,
                nvl_peers=nvl_peers(module),
            )
            if not ok:
                self._normal_refusal = (
                    f"this low-latency deepep backend cannot run DeepEP's normal dispatch / "
                    f"combine kernels here: {why} (low-latency decode runs; use another process "
                    f"group or backend='torch' for prefill / training)"
                )
        self.deep_ep = module
        if num_sms is not None:
            if num_sms <= 0 or num_sms % 2:
                raise ValueError(f"deepep num_sms must be a positive even number, got {num_sms}")
            if mode == "normal" and num_sms < 4 and self.num_ranks > nvl_peers(module):
                # NOTE: the combine's cached notify asserts num_channels * 2 > 3 with
                # num_channels = num_sms / 2 (v1.2.1 csrc/kernels/internode.cu:1209), after
                # the dispatch ran: refused here, before any kernel
                raise ValueError(
                    f"deepep num_sms={num_sms} across nodes: DeepEP's internode combine needs "
                    f"num_sms >= 4 (its cached notify asserts num_channels * 2 > 3, "
                    f"num_channels = num_sms / 2): set DispatchConfig.deepep_num_sms >= 4"
                )
        self.num_sms = int(module.Buffer.num_sms) if num_sms is None else num_sms
        self.topk_idx_dtype: torch.dtype = getattr(module, "topk_idx_t", torch.int64)
        self._shared = deepep_buffer.acquire(module, self.group, id(self))
        self._closed = False
        device = collective_device(self.group)
        self._need_w = DeviceMax(device)  # largest W a worst-case dispatch needed
        self._counters = TrafficCounters(device)  # statistics, no host read on the hot path
        # NOTE: the per-shape plans of the decode path (issue 46): synchronous, checks off
        # (the environment read once, as the dispatcher does), no caller layout, one node span
        self._checks_flag = checks_flag(self.checks)
        self._plannable = not async_finish and not self._checks_flag
        self._plannable &= not (
            self.num_nodes > refusals.MAX_TOPK_NODES or self._normal_refusal is not None
        )
        self._internode = self.num_nodes > 1
        self._local_experts = self.num_local_experts
        self._plans: dict[tuple, _Plan] = {}
        self._combine_plans: dict[tuple, _CombinePlan] = {}

    # ----------------------------------------------------------------- capabilities
    def supports_worst_case(self) -> Capability:
        if self.num_nodes > 1:
            return False, "DeepEP supports num_worst_tokens intranode only"
        return True, "deepep: num_worst_tokens passed through, tails masked on the device"

    def supports_cuda_graph(self) -> Capability:
        if self.mode == "low_latency":
            return True, "deepep low-latency kernels have static shapes"
        if self.num_worst_tokens <= 0:
            return False, (
                "DeepEP's normal dispatch waits on the CPU for the receive counts: set "
                "num_worst_tokens (intranode) or mode='low_latency' for a capturable dispatch"
            )
        return self.supports_worst_case()

    def supports_hierarchical(self) -> Capability:
        return True, "deepep: internode kernels cross each node boundary once (RDMA + NVLink)"

    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        return sizing.check_topology(
            num_ranks,
            ranks_per_node,
            num_worst_tokens=self.num_worst_tokens,
            internode_node_counts=self.rules.internode_node_counts,
            nvl_peers=nvl_peers(self.deep_ep),
        )

    # ----------------------------------------------------------------- statistics
    def flush_stats(self) -> None:
        """Add the statistics counted so far to ``stats`` (the safe point: one host read on
        CUDA, none inside dispatch or combine; ``counters.TrafficCounters``)."""
        self._counters.drain(self._stats)

    def _account(self, kind: str, links: LazyLinks, row_bytes: int) -> None:
        """Record a call's traffic, computed from DeepEP's handle later (or at once while a CUDA
        graph is captured), summed on the device: no host read on the hot path."""

        def values() -> tuple[Any, ...]:
            ln = links.get()
            if kind == "dispatch":
                return (
                    ln.dispatch_intra * row_bytes,
                    ln.dispatch_inter * row_bytes,
                    ln.sent,
                    ln.received,
                )
            if kind == "cached":
                return (ln.dispatch_intra * row_bytes, ln.dispatch_inter * row_bytes, 0, 0)
            return (ln.combine_intra * row_bytes, ln.combine_inter * row_bytes, 0, 0)

        self._counters.record(values)

    def _row_bytes(self, payload: int, *, ids: int = 0, weights: int = 0) -> int:
        """Bytes one row takes on the wire, beside ``payload`` (DeepEP's channel layouts).

        Intranode: an int32 source index, int64 top-k ids and fp32 weights. Internode: an 8-byte
        ``SourceMeta``, int32 ids and fp32 weights, the whole row aligned to 16 bytes.
        """
        if self.num_nodes == 1:
            return payload + 4 + 8 * ids + 4 * weights
        return -(-(payload + 8 + 4 * ids + 4 * weights) // 16) * 16

    def check_overflow(self) -> None:
        """Raise if a worst-case dispatch since construction overflowed (reads a device value)."""
        self.flush_stats()
        need = self._need_w.read()
        if need > self.num_worst_tokens:
            R = self.num_ranks
            raise ValueError(
                f"a worst-case dispatch overflowed: a rank had to send {need // R} rows to one "
                f"destination but num_worst_tokens W={self.num_worst_tokens} allows W/R = "
                f"{self.num_worst_tokens // R} per peer; rows past that were not sent: raise "
                f"DispatchConfig.num_worst_tokens to at least {need}"
            )

    # ----------------------------------------------------------------- buffer
    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    @property
    def internode(self) -> bool:
        return self.num_nodes > 1

    @property
    def num_qps_per_rank(self) -> int:
        """QPs that satisfy DeepEP's internode normal and low-latency kernels (``rules``)."""
        return max(24, self.num_sms, self.num_local_experts)

    def _required_size(self, row_bytes: int, hidden: int | None = None) -> sizing.BufferSize:
        need = sizing.normal_buffer_size(
            self.deep_ep, self.num_ranks, max(row_bytes, 16), self.num_sms
        )
        if self.mode == "low_latency" and hidden is not None:
            need = need.union(
                sizing.low_latency_buffer_size(
                    self.deep_ep,
                    num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
                    hidden=hidden,
                    num_ranks=self.num_ranks,
                    num_experts=self.num_experts,
                )
            )
        return need

    def _ensure_buffer(self, need: sizing.BufferSize) -> Any:
        """The shared buffer, (re)allocated collectively when ``need`` outgrows it."""
        if self._closed:
            raise RuntimeError("this deepep backend was closed")
        before = self._shared.allocations
        buffer = self._shared.ensure(
            need, low_latency=self.mode == "low_latency", num_qps_per_rank=self.num_qps_per_rank
        )
        if self._shared.allocations != before:
            extra = self._stats.extra
            extra["deepep_buffer_allocations"] = extra.get("deepep_buffer_allocations", 0) + 1
        return buffer

    @property
    def _ll_dirty(self) -> bool:
        return self._shared.normal_kernel_ran

    @_ll_dirty.setter
    def _ll_dirty(self, value: bool) -> None:
        self._shared.normal_kernel_ran = value

    @property
    def _buffer(self) -> Any:
        return self._shared.buffer

    def close(self) -> None:
        """Fold device-side statistics into ``stats`` and leave the shared DeepEP buffer."""
        self.flush_stats()
        if not self._closed:
            self._closed = True
            self._shared.leave(id(self))

    # ----------------------------------------------------------------- overlap helpers
    def _launch_kwargs(self, previous: Any = None) -> dict[str, Any]:
        """Async: after ``previous`` (a DeepEP event on the comm stream), else after everything
        issued so far on the current stream."""
        if not self.async_finish:
            return {}
        return {
            "previous_event": previous if previous is not None else self.deep_ep.Buffer.capture(),
            "async_finish": True,
            "allocate_on_comm_stream": True,
        }

    def _wait(self, event: Any) -> None:
        if self.async_finish and event is not None:
            event.current_stream_wait()

    def _after_normal_kernel(self) -> None:
        self._shared.normal_kernel_ran = True
        self._shared.normal_calls += 1

    # ----------------------------------------------------------------- row plans
    def _dispatch_chunks(self, wire_cols: int, *, num_scales: int, topk: int) -> tuple:
        cap = self.rules.dispatch_max_cols(self.internode, num_scales=num_scales, topk=topk)
        return rules.plan_chunks(wire_cols, cap, self.rules.dispatch_col_multiple(self.internode))

    def _buffer_for_rows(self, *cols: int) -> Any:
        """The shared buffer, sized for rows of up to ``max(cols)`` bf16 columns (normal kernels:
        refused where DeepEP's internode kernels would assert or hang)."""
        need = self._required_size(2 * max(cols))
        have = self._shared.size
        refusals.check_normal_buffer_bytes(
            need if have is None else have.union(need),
            internode=self.internode,
            low_latency_need=" (it also holds the low-latency buffers)" if have else "",
        )
        refusals.check_low_latency_graph(self._shared, internode=self.internode)
        if self._normal_refusal is not None:
            raise ValueError(self._normal_refusal)
        return self._ensure_buffer(need)

    # ----------------------------------------------------------------- dispatch
    def _layout(
        self, buffer: Any, idx: torch.Tensor, layout: DispatchLayout | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, Any]:
        """DeepEP's layout tensors (the caller's, or DeepEP's own layout kernel's) and the
        layout kernel's event (async: the tensors are ready on the comm stream after it)."""
        if layout is not None:
            return (
                layout.num_tokens_per_rank,
                layout.num_tokens_per_rdma_rank,
                layout.num_tokens_per_expert,
                layout.is_token_in_rank,
                None,
            )
        return buffer.get_dispatch_layout(idx, self.num_experts, **self._launch_kwargs())

    def _cap_worst_case(
        self, itr: torch.Tensor, ntr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep, per destination, this sender's first ``W / R`` tokens (see the module docstring).

        Returns ``(is_token_in_rank, num_tokens_per_rank)`` after the cap; records the W needed.
        """
        R = self.num_ranks
        cap = self.num_worst_tokens // R
        need = ntr.max().to(torch.int64) * R
        pos = itr.to(torch.int32).cumsum(0)
        itr = itr & (pos <= cap)
        self._need_w.update(need)
        return itr, itr.sum(0, dtype=torch.int32)

    def _check_on_every_rank(
        self, itr: torch.Tensor, nte: torch.Tensor, X: int, k: int, dtype: torch.dtype
    ) -> None:
        """Checks on: one all-gather, then the same error on every rank (shape or overflow)."""
        G = exchange_counts(
            itr,
            hidden=X,
            topk=k,
            dtype=dtype,
            ranks_per_node=self.ranks_per_node,
            group=self.group,
            pairs_R=nte.view(self.num_ranks, -1).sum(1, dtype=torch.int64),
        )
        Gh = G.tolist()
        if G.is_cuda:
            self._stats.extra["check_syncs"] = self._stats.extra.get("check_syncs", 0) + 1
        check_agreement(Gh, num_ranks=self.num_ranks, num_nodes=self.num_nodes)
        if self.worst_case:
            from flexdispatch.backends.torch.rows import overflow_message

            R, W = self.num_ranks, self.num_worst_tokens
            worst = max((Gh[s][g], s, g) for s in range(R) for g in range(R))
            if worst[0] > W // R:
                what = f"rank {worst[1]} sending to rank {worst[2]}"
                raise ValueError(overflow_message(what, worst[0], W // R, W, R, R))

    def supports_overlap(self, *, expanded: bool) -> Capability:
        if expanded:
            return False, "DeepEP V1 has no expanded layout: use permute"
        if not self.async_finish:
            return False, "set deepep_async_finish: without it DeepEP finishes before returning"
        return True, (
            "deepep_async_finish: DeepEP's layout and dispatch kernels run on its comm stream, "
            "chained by events; the current stream waits once, in finish_dispatch"
        )

    def launch_dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> Launched:
        """Issue the dispatch (``dispatch``'s arguments and errors). With ``async_finish`` the
        current stream does not wait for it: work issued before ``finish_dispatch`` overlaps
        it. Every input is prepared before the first DeepEP call, which fences them."""
        # NOTE: intranode, the SM90 receive path needs hidden_int4 % 2 == 0, i.e. fp8 H % 32
        # (intranode.cu:235); internode rows move in 16-byte units
        x, scales, wire = sizing.split_rows(x, fp8_multiple=16 if self.internode else 32)
        T, X = x.shape
        k = topk_idx.shape[1]
        sizing.check_topk(k, "normal kernels (num_topk <= 32 in intranode.cu / internode.cu)")
        if not self.worst_case:  # NOTE: so V1 across nodes (dropless only) is never captured
            refusals.check_dropless_capture("DeepEP V1")
        num_scales = 0 if scales is None else scales.shape[1]
        chunks = self._dispatch_chunks(wire.wire_width, num_scales=num_scales, topk=k)
        if scales is not None and len(chunks) > 1:
            cap = self.rules.dispatch_max_cols(self.internode, num_scales=num_scales, topk=k)
            raise ValueError(
                f"fp8 rows of {X} bytes exceed DeepEP's {2 * cap}-byte row limit "
                f"({'internode' if self.internode else 'intranode SM90 TMA'}): dispatch bf16 rows "
                f"instead (flexdispatch splits wide bf16 rows into several DeepEP calls)"
            )
        if checks_enabled(self.checks) and not is_capturing():
            # before the buffer: ranks that disagree on shapes would size (and reallocate,
            # collectively) different buffers; the pure-torch layout gives the same values
            from flexdispatch.layout import get_dispatch_layout

            lay = layout or get_dispatch_layout(
                topk_idx, self.num_experts, self.num_ranks, ranks_per_node=self.ranks_per_node
            )
            self._check_on_every_rank(
                lay.is_token_in_rank, lay.num_tokens_per_expert, X, k, x.dtype
            )
        widest = max(c.padded for c in chunks)
        comb = self._combine_chunks(max(-(-X // 8) * 8, 8))
        buffer = self._buffer_for_rows(widest, max(c.padded for c in comb))
        idx = topk_idx
        if self.num_nodes > refusals.MAX_TOPK_NODES and k > refusals.MAX_TOPK_NODES:
            # NOTE: every rank raises alike before any token moves; V1 across nodes is
            # dropless, so never inside a capture (refused above)
            self._stats.host_syncs += refusals.agree_node_span(
                idx, self.num_experts, self.num_nodes, group=self.group, rank=self.rank
            )
        if idx.dtype != self.topk_idx_dtype:
            idx = idx.to(self.topk_idx_dtype)
        idx = idx.contiguous()
        probs = topk_probs if topk_probs.dtype == torch.float32 else topk_probs.float()
        probs = probs.contiguous()
        if scales is not None:
            sends: list[Any] = [(x.contiguous(), scales.contiguous())]
        else:
            w = wire.send(x)
            sends = [self._chunk(w, c) for c in chunks]
        ntr, ntrr, nte, itr, event = self._layout(buffer, idx, layout)
        if self.worst_case and self.num_worst_tokens // self.num_ranks < T:
            self._wait(event)  # the cap runs on this stream
            event = None
            itr, ntr = self._cap_worst_case(itr, ntr)
        kw = self._launch_kwargs(event)
        recv0, recv_idx, recv_probs, count_list, handle, event = buffer.dispatch(
            sends[0],
            num_tokens_per_rank=ntr,
            num_tokens_per_rdma_rank=ntrr,
            is_token_in_rank=itr,
            num_tokens_per_expert=nte,
            topk_idx=idx,
            topk_weights=probs,
            num_worst_tokens=self.num_worst_tokens,
            config=self._configs[0],
            **kw,
        )
        parts = [recv0]
        for send in sends[1:]:  # chained on the comm stream: no wait in between
            got, *_, event = buffer.dispatch(
                send,
                handle=handle,
                num_worst_tokens=self.num_worst_tokens,
                config=self._configs[0],
                **self._launch_kwargs(event),
            )
            parts.append(got)
        return Launched(
            T=T,
            X=X,
            k=k,
            wire=wire,
            chunks=chunks,
            num_scales=num_scales,
            parts=parts,
            recv_idx=recv_idx,
            recv_probs=recv_probs,
            count_list=count_list,
            handle=handle,
            event=event,
            ntr=ntr,
            ntrr=ntrr,
        )

    def finish_dispatch(self, p: Launched) -> DispatchResult:
        """Wait for a ``launch_dispatch`` (the current stream, on the GPU) and build its
        result."""
        self._wait(p.event)
        T, X, k, wire, chunks, num_scales = p.T, p.X, p.k, p.wire, p.chunks, p.num_scales
        recv_idx, recv_probs, count_list, handle = p.recv_idx, p.recv_probs, p.count_list, p.handle
        recv_scales = None
        if isinstance(p.parts[0], tuple):  # fp8 (x, scales): one call
            recv_w, recv_scales = p.parts[0]
        elif len(chunks) == 1:
            recv_w = p.parts[0]
        else:
            recv_w = torch.cat(
                [got[:, : c.width] for got, c in zip(p.parts, chunks, strict=True)], dim=1
            )
        row_bytes = self._dispatch_row_bytes(chunks, num_scales, k)
        return self._dispatch_result(
            T, X, wire, chunks, recv_w, recv_scales, recv_idx, recv_probs, count_list, handle,
            p.ntr, p.ntrr, row_bytes,
        )  # fmt: skip

    def _dispatch_row_bytes(self, chunks: tuple, num_scales: int, k: int) -> int:
        """Bytes one dispatched row takes on the wire: its chunks, scales, ids and weights."""
        row_bytes = sum(self._row_bytes(2 * c.padded) for c in chunks)
        return row_bytes + self._row_bytes(num_scales * 4, ids=k, weights=k) - self._row_bytes(0)

    def _dispatch_result(
        self,
        T: int,
        X: int,
        wire: sizing.WireFormat,
        chunks: tuple,
        recv_w: torch.Tensor,
        recv_scales: torch.Tensor | None,
        recv_idx: torch.Tensor,
        recv_probs: torch.Tensor,
        count_list: Any,
        handle: tuple,
        ntr: torch.Tensor,
        ntrr: torch.Tensor | None,
        row_bytes: int,
    ) -> DispatchResult:
        """What DeepEP returned (chunks joined) as the contract's result; the call's traffic
        recorded (``row_bytes`` per row)."""
        shared = self._shared  # NOTE: _after_normal_kernel, inline
        shared.normal_kernel_ran = True
        shared.normal_calls += 1
        e = self._local_experts
        pairs = None
        valid = None
        if self.worst_case:
            masked = sizing.mask_worst_case(recv_w, recv_idx, recv_probs, e)
            recv_w, recv_idx, recv_probs, counts, valid = (
                masked.recv_x,
                masked.recv_topk_idx,
                masked.recv_topk_probs,
                masked.num_recv_tokens_per_expert,
                masked.valid,
            )
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales, valid)
        else:
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            # NOTE: DeepEP zeroes the weight of every slot whose id is not local (the sender
            # writes 0 beside -1), and its count list is exact for expert_alignment=1.
            pairs = int(sum(count_list))
            # NOTE: counted on the device from the received ids (issue 44, Q8): the host list
            # made a tensor is a pageable copy with a stream synchronisation
            ids = recv_idx.reshape(-1).to(torch.int64)
            counts = sizing.count_valid(ids, ids >= 0, e)
        if recv_idx.dtype != torch.int64:
            recv_idx = recv_idx.to(torch.int64)
        links = LazyLinks(
            lambda: handle_links(
                handle,
                ntr,
                ntrr,
                num_ranks=self.num_ranks,
                ranks_per_node=self.ranks_per_node,
                rank=self.rank,
            )
        )
        self._account("dispatch", links, row_bytes)
        state = DeepEPDispatchState(
            handle=handle,
            wire=wire,
            chunks=chunks,
            valid=valid,
            links=links,
            recv_scales=recv_scales,
        )
        return DispatchResult(
            recv_x=wire.recv(recv_w) if recv_scales is None else recv_w,
            recv_topk_idx=recv_idx,
            recv_topk_probs=recv_probs,
            num_recv_tokens_per_expert=counts,
            handle=DispatchHandle(
                backend=self.name,
                num_tokens=T,
                hidden=X,
                num_recv_rows=recv_w.shape[0],
                state=state,
            ),
            num_recv_pairs=pairs,
        )
