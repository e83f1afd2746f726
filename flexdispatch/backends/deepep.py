"""The ``deepep`` backend: DeepEP's fused NVLink/RDMA kernels behind the dispatch contract.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows · X any row width · Xw wire width (bf16 columns, a multiple of 8).

How the contract maps onto ``deep_ep.Buffer`` (the V1 API, release v1.2.1):

- ``deep_ep`` is imported lazily; ``ImportError``, ``OSError``, ``AssertionError`` and
  ``RuntimeError`` at import become a reason string (``load_deep_ep``), never a crash.
- Rows travel as bf16 *bit views* padded to 16 bytes (``deepep_sizing.WireFormat``): fp32 rows
  become ``2H`` bf16 columns, fp16 rows are reinterpreted, so dispatch moves every dtype bit for
  bit with the API DeepEP documents (bf16, or an ``(fp8, scales)`` tuple, passed through).
- Combine: DeepEP reduces bf16 only. bf16 rows use it directly; fp32/fp16 rows of at most 32
  columns (the probs gradient of the backward pass) go through combine's fp32 ``topk_weights``
  channel, which sums exactly in fp32 (Megatron does the same); wider fp32/fp16 rows are reduced
  in bf16 (relative error ~2^-8) — use bf16 activations with this backend.
- The layout (``num_tokens_per_rank`` ...) comes from ``flexdispatch.layout`` (DeepEP's values
  and dtypes, no host sync), then one ``[2R + N + 4]`` int64 all-gather of the per-rank and
  per-node row counts (and H, k, dtype, T) runs on the device, before any buffer is touched. It
  feeds the byte/row statistics (DeepEP's traffic pattern: ``traffic.link_rows``), the
  worst-case overflow guard (DeepEP writes past its outputs when a rank receives more than W rows;
  here each sender drops the rows past W on the device and the overflow is reported, never
  silent) and, with checks on or on CPU, the cross-rank shape agreement check.
- Dropless dispatch: DeepEP's CPU waits for the receive counts (one host sync, counted).
  The gathered counts are copied to pinned memory before that wait, so reading them afterwards
  costs nothing. Worst-case dispatch: ``num_worst_tokens`` is passed through (intranode only),
  the garbage tails of ``recv_x``/``recv_topk_weights`` are zeroed and the per-expert counts are
  rebuilt from ``recv_topk_idx`` on the device (``deepep_sizing.mask_worst_case``).
- Cached dispatch (the backward of combine) re-sends along DeepEP's handle: no host sync.
- The buffer is sized from DeepEP's own ``Config`` hints, reused, grown (collectively, at the
  same call on every rank) when rows get wider, and released by ``close()``.
- Low-latency decode (``mode="low_latency"``): ``deepep_ll.LowLatencyMixin``.

Tests inject the emulator in ``tests/deepep_emu`` through the private ``_deep_ep`` argument; only a
module that marks itself ``IS_EMULATOR`` lifts the NCCL/CUDA requirement.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist

from flexdispatch._validate import checks_enabled, is_capturing
from flexdispatch.backends import deepep_sizing as sizing
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import check_agreement, exchange_counts, recv_pairs
from flexdispatch.backends.deepep_ll import LowLatencyMixin
from flexdispatch.backends.deepep_support import deepep_support, load_deep_ep, nvl_peers
from flexdispatch.distributed import group_rank, group_size
from flexdispatch.layout import get_dispatch_layout
from flexdispatch.types import DispatchHandle, DispatchLayout, DispatchResult, DispatchStats

__all__ = ["DeepEPBackend", "DeepEPDispatchState"]

_NARROW_FP32_COLUMNS = sizing.MAX_TOPK  # combine's fp32 topk_weights channel width


@dataclass(frozen=True, kw_only=True)
class DeepEPDispatchState:
    """The deepep backend's part of a ``DispatchHandle``.

    Attributes:
        handle: DeepEP's own handle (a tuple, opaque).
        wire: the wire format of the dispatched rows.
        valid: ``[W]`` bool real rows in worst-case mode, else None.
        links: rows this rank sends per link class (host ints), or None when only the device
            knows them (worst-case mode on CUDA without checks).
        out_rows: ``[R]`` int64 device tensor, rows this rank sent to each rank.
        in_rows: ``[R]`` int64 device tensor, rows this rank received from each rank.
        recv_scales: ``[M, H / 128]`` float32 scales of an fp8 dispatch, else None.
    """

    handle: tuple
    wire: sizing.WireFormat
    valid: torch.Tensor | None
    links: _Links | None
    out_rows: torch.Tensor
    in_rows: torch.Tensor
    recv_scales: torch.Tensor | None


@dataclass(frozen=True, kw_only=True)
class _Links:
    """Rows one rank puts on NVLink (intra) and RDMA (inter) links, per direction."""

    dispatch_intra: int
    dispatch_inter: int
    combine_intra: int
    combine_inter: int


class DeepEPBackend(LowLatencyMixin, DispatchBackend):
    """Dispatch/combine over ``deep_ep.Buffer`` (normal, worst-case and low-latency kernels).

    Args:
        group: the process group (None = WORLD); NCCL on CUDA.
        num_experts: E, divisible by R.
        ranks_per_node: L as launched (8 for internode DeepEP).
        num_worst_tokens: W (0 = dropless). Intranode only.
        hierarchical: accepted; DeepEP's internode kernels are node-aware by construction.
        checks: host-syncing value checks (shape agreement, overflow) on CUDA.
        stats: counters to add to.
        async_finish: launch on DeepEP's communication stream (inputs fenced by an event, outputs
            allocated there); the current stream then waits for it on the GPU, not the host.
        num_sms: ``Buffer.set_num_sms`` (even; process-wide in DeepEP).
        mode: ``"normal"`` or ``"low_latency"`` (allocates the low-latency buffers too).
        num_max_dispatch_tokens_per_rank: tokens per rank and low-latency call.
        use_fp8: low-latency dispatch casts to fp8 (per-128-channel scales).
        _deep_ep: a ``deep_ep`` module to use instead of importing one (tests pass the
            emulator; only a module marked ``IS_EMULATOR`` may run on a CPU/gloo group).

    Raises:
        ValueError: DeepEP cannot serve this group (the reason is in the message).
    """

    name = "deepep"

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
        async_finish: bool = False,
        num_sms: int | None = None,
        mode: Literal["normal", "low_latency"] = "normal",
        num_max_dispatch_tokens_per_rank: int = 128,
        use_fp8: bool = False,
        _deep_ep: ModuleType | None = None,
    ) -> None:
        module = _deep_ep
        if module is None:
            module, why = load_deep_ep()
            if module is None:
                raise ValueError(f"deepep backend not available: {why}")
        self.group = group if group is not None else dist.group.WORLD
        self.num_ranks = group_size(group)
        self.rank = group_rank(group)
        self.ranks_per_node = ranks_per_node
        self.num_experts = num_experts
        self.num_worst_tokens = num_worst_tokens
        self.hierarchical = hierarchical
        self.checks = checks
        self.stats = stats if stats is not None else DispatchStats()
        self.async_finish = async_finish
        self.mode = mode
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.use_fp8 = use_fp8
        ok, why = deepep_support(
            group=group,
            num_experts=num_experts,
            ranks_per_node=ranks_per_node,
            num_worst_tokens=num_worst_tokens,
            mode=mode,
            deep_ep=module,
        )
        if not ok:
            raise ValueError(f"deepep backend cannot serve this group: {why}")
        if mode not in ("normal", "low_latency"):
            raise ValueError(f"mode must be 'normal' or 'low_latency', got {mode!r}")
        self.deep_ep = module
        if num_sms is not None:
            if num_sms <= 0 or num_sms % 2:
                raise ValueError(f"deepep num_sms must be a positive even number, got {num_sms}")
            module.Buffer.set_num_sms(num_sms)
        self.topk_idx_dtype: torch.dtype = getattr(module, "topk_idx_t", torch.int64)
        self._buffer: Any = None
        self._size: sizing.BufferSize | None = None
        self._required_w: torch.Tensor | None = None
        self._device_stats: torch.Tensor | None = None  # [intra, inter, rows_sent, rows_recv]
        self._ll_dirty = False
        self._ll_generation = 0

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
            nvl_peers=nvl_peers(self.deep_ep),
        )

    # ----------------------------------------------------------------- buffer
    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    def _required_size(self, row_bytes: int, hidden: int | None = None) -> sizing.BufferSize:
        need = sizing.normal_buffer_size(self.deep_ep, self.num_ranks, max(row_bytes, 16))
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
        """The live buffer, (re)allocated when ``need`` outgrows it (collective on growth)."""
        new = sizing.grow_buffer_size(self._size, need)
        if new is None:
            return self._buffer
        self._release()
        low_latency = self.mode == "low_latency"
        self._buffer = self.deep_ep.Buffer(
            self.group,
            num_nvl_bytes=new.num_nvl_bytes,
            num_rdma_bytes=new.num_rdma_bytes,
            low_latency_mode=low_latency,
            num_qps_per_rank=max(self.num_local_experts, 1) if low_latency else 24,
            explicitly_destroy=True,
        )
        self._size = new
        self._ll_dirty = False
        self.stats.extra["deepep_buffer_allocations"] = (
            self.stats.extra.get("deepep_buffer_allocations", 0) + 1
        )
        return self._buffer

    def _release(self) -> None:
        if self._buffer is not None:
            self._buffer.destroy()
            self._buffer = None
            self._size = None

    def close(self) -> None:
        """Fold device-side statistics into ``stats`` and destroy the DeepEP buffer."""
        self._flush_device_stats()
        self._release()

    # ----------------------------------------------------------------- overlap helpers
    def _launch_kwargs(self) -> dict[str, Any]:
        if not self.async_finish:
            return {}
        return {
            "previous_event": self.deep_ep.Buffer.capture(),
            "async_finish": True,
            "allocate_on_comm_stream": True,
        }

    def _wait(self, event: Any) -> None:
        if self.async_finish and event is not None:
            event.current_stream_wait()

    # ----------------------------------------------------------------- statistics
    def _row_bytes(self, payload: int, *, ids: int = 0, weights: int = 0) -> int:
        """Bytes one row takes on the wire, beside ``payload`` (DeepEP's channel layouts).

        Intranode: an int32 source index, int64 top-k ids and fp32 weights. Internode: an 8-byte
        ``SourceMeta``, int32 ids and fp32 weights, the whole row aligned to 16 bytes.
        """
        if self.num_nodes == 1:
            return payload + 4 + 8 * ids + 4 * weights
        return -(-(payload + 8 + 4 * ids + 4 * weights) // 16) * 16

    def _account(self, intra_rows: int, inter_rows: int, row_bytes: int) -> None:
        self.stats.bytes_sent_intra_node += intra_rows * row_bytes
        self.stats.bytes_sent_inter_node += inter_rows * row_bytes

    def _links(self, Gh: list[list[int]]) -> tuple[_Links, int, int]:
        """Rows per link class from the gathered counts: ``(links, rows_sent, rows_received)``.

        DeepEP's traffic pattern is flat inside a node and, across nodes, one RDMA row per
        destination node to the rank with the same local index, forwarded over NVLink there
        (``traffic.link_rows``).
        """
        from flexdispatch.traffic import link_rows

        R, N, me = self.num_ranks, self.num_nodes, self.rank
        C = [row[:R] for row in Gh]
        if self.worst_case:
            C = self._limited_host(C)
        D = [row[R : R + N] for row in Gh]
        mode = "flat" if N == 1 else "hierarchical"
        lr = link_rows(
            torch.tensor(C, dtype=torch.int64),
            torch.tensor(D, dtype=torch.int64),
            ranks_per_node=self.ranks_per_node,
            mode=mode,
        )
        links = _Links(
            dispatch_intra=int(lr.dispatch_intra[me]),
            dispatch_inter=int(lr.dispatch_inter[me]),
            combine_intra=int(lr.combine_intra[me]),
            combine_inter=int(lr.combine_inter[me]),
        )
        return links, sum(C[me]), sum(C[s][me] for s in range(R))

    def _account_on_device(
        self,
        rows: torch.Tensor,
        row_bytes: int,
        sent: torch.Tensor | None = None,
        received: torch.Tensor | None = None,
    ) -> None:
        """Device-side ``_account`` (worst-case mode on CUDA, where host reads are not allowed).

        Args:
            rows: ``[R]`` int64 rows sent to each rank.
            row_bytes: bytes per row.
            sent / received: 0-d row counts to add to ``rows_sent`` / ``rows_received``.
        """
        R, L = self.num_ranks, self.ranks_per_node
        peers = torch.arange(R, device=rows.device)
        same = (peers // L == self.rank // L) & (peers != self.rank)
        other = peers // L != self.rank // L
        n = rows * row_bytes
        zero = torch.zeros((), dtype=torch.int64, device=rows.device)
        vec = torch.stack(
            [
                (n * same).sum(),
                (n * other).sum(),
                zero if sent is None else sent.to(torch.int64),
                zero if received is None else received.to(torch.int64),
            ]
        )
        if self._device_stats is None:
            self._device_stats = vec
        else:
            self._device_stats = self._device_stats + vec

    def _flush_device_stats(self) -> None:
        if self._device_stats is None:
            return
        intra, inter, sent, recv = (int(v) for v in self._device_stats.tolist())
        self.stats.bytes_sent_intra_node += intra
        self.stats.bytes_sent_inter_node += inter
        self.stats.rows_sent += sent
        self.stats.rows_received += recv
        self._device_stats = None

    def _overflow_error(self, Gh: list[list[int]]) -> ValueError | None:
        R, W = self.num_ranks, self.num_worst_tokens
        incoming = [sum(Gh[s][g] for s in range(R)) for g in range(R)]
        worst = max(range(R), key=lambda g: incoming[g])
        if incoming[worst] <= W:
            return None
        return ValueError(
            f"worst-case dispatch overflow: rank {worst} would receive {incoming[worst]} rows but "
            f"num_worst_tokens W={W}: raise DispatchConfig.num_worst_tokens to at least "
            f"{incoming[worst]}"
        )

    def check_overflow(self) -> None:
        """Raise if a worst-case dispatch since construction overflowed (syncs the host)."""
        self._flush_device_stats()
        if self._required_w is None:
            return
        need = int(self._required_w.item())
        if need > self.num_worst_tokens:
            raise ValueError(
                f"a worst-case dispatch overflowed: a rank had to receive {need} rows but "
                f"num_worst_tokens W={self.num_worst_tokens}; rows past W were not sent: raise "
                f"DispatchConfig.num_worst_tokens to at least {need}"
            )

    # ----------------------------------------------------------------- dispatch
    def _layout(
        self, topk_idx: torch.Tensor, layout: DispatchLayout | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """DeepEP's layout tensors: the caller's, or ``flexdispatch.layout``'s (same values and
        dtypes as ``Buffer.get_dispatch_layout``, computed before any buffer is touched)."""
        if layout is None:
            layout = get_dispatch_layout(
                topk_idx, self.num_experts, self.num_ranks, ranks_per_node=self.ranks_per_node
            )
        return (
            layout.num_tokens_per_rank,
            layout.num_tokens_per_rdma_rank,
            layout.num_tokens_per_expert,
            layout.is_token_in_rank,
        )

    def _limit_worst_case(
        self, G: torch.Tensor, mask_TR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop, on the device, the rows that would not fit in W at their destination.

        Destinations fill up in source-rank order; a sender keeps, per destination, its first
        ``allowed`` tokens. Records the W that would have been needed.

        Returns:
            ``(mask [T, R] bool, rows received from each rank [R] int64)`` after the limit.
        """
        R, W, me = self.num_ranks, self.num_worst_tokens, self.rank
        C = G[:, :R]
        allowed = (W - (C.cumsum(0) - C)).clamp(min=0).minimum(C)  # [source, destination]
        pos = mask_TR.to(torch.int64).cumsum(0) - 1
        keep = mask_TR & (pos < allowed[me][None, :])
        need = C.sum(0).max()
        if self._required_w is None:
            self._required_w = torch.zeros((), dtype=torch.int64, device=G.device)
        self._required_w = torch.maximum(self._required_w, need)
        return keep, allowed[:, me]

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """DeepEP dispatch mapped to the contract (see the module docstring).

        Args:
            x: ``[T, H]`` bf16/fp16/fp32 rows, or a ``(float8_e4m3fn [T, H], float32 scales
                [T, H / 128])`` tuple, passed to DeepEP as is: ``recv_x`` is then the fp8 rows
                and the received scales are ``result.handle.state.recv_scales``.
            topk_idx: ``[T, k]`` global expert ids, ``-1`` = none.
            topk_probs: ``[T, k]`` float32, 0 where ``topk_idx`` is ``-1``.
            layout: optional ``get_dispatch_layout`` result (DeepEP's layout kernel otherwise).

        Raises:
            ValueError: ranks disagree on shapes (on CPU, or with checks on), or a worst-case
                overflow (likewise; otherwise recorded for ``check_overflow``).
        """
        scales = None
        if isinstance(x, tuple):
            x, scales = x
            if x.dtype != torch.float8_e4m3fn or x.shape[1] % 16:
                raise ValueError(
                    "an (x, scales) tuple must hold float8_e4m3fn rows whose hidden size is a "
                    f"multiple of 16, got {x.dtype} with H={x.shape[1]}"
                )
            wire = sizing.WireFormat(dtype=x.dtype, width=x.shape[1], wire_width=x.shape[1] // 2)
        else:
            wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        T, X = x.shape
        k = topk_idx.shape[1]
        e = self.num_local_experts
        idx = topk_idx.to(self.topk_idx_dtype).contiguous()
        probs = topk_probs.to(torch.float32).contiguous()
        ntr, ntrr, nte, itr = self._layout(topk_idx, layout)

        # one small all-gather: statistics, overflow guard, agreement check
        G = exchange_counts(
            itr,
            hidden=X,
            topk=k,
            dtype=x.dtype,
            ranks_per_node=self.ranks_per_node,
            group=self.group,
            pairs_R=nte.view(self.num_ranks, e).sum(1, dtype=torch.int64),
        )
        Gh: list[list[int]] | None = None
        if not G.is_cuda or (checks_enabled(self.checks) and not is_capturing()):
            Gh = G.tolist()
            if G.is_cuda:
                self.stats.extra["check_syncs"] = self.stats.extra.get("check_syncs", 0) + 1
            check_agreement(Gh, num_ranks=self.num_ranks, num_nodes=self.num_nodes)
            if self.worst_case and (err := self._overflow_error(Gh)) is not None:
                raise err
        pinned = None
        in_rows = G[:, self.rank]
        if self.worst_case:
            itr, in_rows = self._limit_worst_case(G, itr)
            ntr = itr.sum(0, dtype=torch.int32)
        elif Gh is None:
            # NOTE: DeepEP's CPU wait below happens after its comm stream waited for the current
            # stream, so this copy has landed once dispatch returns: no extra sync.
            pinned = torch.empty(G.shape, dtype=G.dtype, pin_memory=True)
            pinned.copy_(G, non_blocking=True)

        # NOTE: sized for the bf16 combine of the same rows as well (DeepEP's hint recipe); a
        # (re)allocation is collective, so it comes after the agreement check.
        buffer = self._ensure_buffer(self._required_size(max(wire.row_bytes, 2 * X)))
        send_x: Any = wire.send(x) if scales is None else (x.contiguous(), scales.contiguous())
        recv_w, recv_idx, recv_probs, _, handle, event = buffer.dispatch(
            send_x,
            num_tokens_per_rank=ntr,
            num_tokens_per_rdma_rank=ntrr,
            is_token_in_rank=itr,
            num_tokens_per_expert=nte,
            topk_idx=idx,
            topk_weights=probs,
            num_worst_tokens=self.num_worst_tokens,
            **self._launch_kwargs(),
        )
        self._wait(event)
        self._after_normal_kernel()
        recv_scales = None
        if scales is not None:
            recv_w, recv_scales = recv_w
        rows = recv_w.shape[0]
        recv_idx = recv_idx.to(torch.int64)
        valid = None
        if self.worst_case:
            masked = sizing.mask_worst_case(recv_w, recv_idx, recv_probs, e)
            recv_w, recv_idx = masked.recv_x, masked.recv_topk_idx
            recv_probs, counts, valid = (
                masked.recv_topk_probs,
                masked.num_recv_tokens_per_expert,
                masked.valid,
            )
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows(recv_scales, valid)
        else:
            self.stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            recv_probs = torch.where(recv_idx >= 0, recv_probs.to(torch.float32), 0.0)
            counts = sizing.count_local_experts(recv_idx, e)

        # statistics
        scale_bytes = scales.shape[1] * 4 if scales is not None else 0
        row_bytes = self._row_bytes(wire.row_bytes + scale_bytes, ids=k, weights=k)
        out_rows = itr.sum(0, dtype=torch.int64)
        links = None
        if pinned is not None:
            Gh = pinned.tolist()
        pairs = None
        if Gh is not None:
            if not self.worst_case:
                pairs = recv_pairs(
                    Gh, rank=self.rank, num_ranks=self.num_ranks, num_nodes=self.num_nodes
                )
            links, sent, received = self._links(Gh)
            self._account(links.dispatch_intra, links.dispatch_inter, row_bytes)
            self.stats.rows_sent += sent
            self.stats.rows_received += received
        else:
            self._account_on_device(
                out_rows, row_bytes, sent=out_rows.sum(), received=in_rows.sum()
            )
        state = DeepEPDispatchState(
            handle=handle,
            wire=wire,
            valid=valid,
            links=links,
            out_rows=out_rows,
            in_rows=in_rows,
            recv_scales=recv_scales,
        )
        return DispatchResult(
            recv_x=wire.recv(recv_w) if scales is None else recv_w,
            recv_topk_idx=recv_idx,
            recv_topk_probs=recv_probs,
            num_recv_tokens_per_expert=counts,
            handle=DispatchHandle(
                backend=self.name, num_tokens=T, hidden=X, num_recv_rows=rows, state=state
            ),
            num_recv_pairs=pairs,
        )

    def _limited_host(self, C: list[list[int]]) -> list[list[int]]:
        """Host mirror of ``_limit_worst_case`` (row counts after the W limit)."""
        R, W = self.num_ranks, self.num_worst_tokens
        out = [[0] * R for _ in range(R)]
        for g in range(R):
            left = W
            for s in range(R):
                out[s][g] = min(C[s][g], max(left, 0))
                left -= C[s][g]
        return out

    def _after_normal_kernel(self) -> None:
        if self.mode == "low_latency":
            self._ll_dirty = True

    # ----------------------------------------------------------------- combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Unweighted sum over the receiving ranks (see the module docstring for precision)."""
        state: DeepEPDispatchState = handle.state
        M, X = y.shape
        narrow = y.dtype in (torch.float32, torch.float16) and X <= _NARROW_FP32_COLUMNS
        if narrow:
            dummy = torch.zeros(M, 8, dtype=torch.bfloat16, device=y.device)
            buffer = self._ensure_buffer(self._required_size(16))
            _, out_w, event = buffer.combine(
                dummy,
                state.handle,
                topk_weights=y.to(torch.float32).contiguous(),
                **self._launch_kwargs(),
            )
            self._wait(event)
            out = out_w.to(y.dtype)
            back_bytes = self._row_bytes(16, weights=X)
        else:
            wire = sizing.WireFormat.of(torch.bfloat16, X)
            buffer = self._ensure_buffer(self._required_size(wire.row_bytes))
            yb = wire.send(y.to(torch.bfloat16))
            combined, _, event = buffer.combine(yb, state.handle, **self._launch_kwargs())
            self._wait(event)
            out = combined[:, :X].to(y.dtype)
            back_bytes = self._row_bytes(wire.row_bytes)
        self._after_normal_kernel()
        if state.links is not None:
            self._account(state.links.combine_intra, state.links.combine_inter, back_bytes)
        else:
            self._account_on_device(state.in_rows, back_bytes)
        return out

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Re-send ``[T, X]`` rows along a dispatch's handle (no host sync)."""
        state: DeepEPDispatchState = handle.state
        wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        buffer = self._ensure_buffer(self._required_size(wire.row_bytes))
        recv_w, *_, event = buffer.dispatch(
            wire.send(x), handle=state.handle, **self._launch_kwargs()
        )
        self._wait(event)
        self._after_normal_kernel()
        if state.valid is not None:
            recv_w = sizing.zero_invalid_rows(recv_w, state.valid)
        row_bytes = self._row_bytes(wire.row_bytes)
        if state.links is not None:
            self._account(state.links.dispatch_intra, state.links.dispatch_inter, row_bytes)
        else:
            self._account_on_device(state.out_rows, row_bytes)
        return wire.recv(recv_w)
