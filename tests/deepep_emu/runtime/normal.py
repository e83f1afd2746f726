"""The emulated ``deep_ep._C.Buffer``: layout, intranode and internode normal kernels. TEST-ONLY.

Shape letters: T tokens · H hidden · E experts · R ranks · e = E / R · k top-k · L ranks of one
emulated NVLink domain (``nvl_peers``) · N = R / L nodes · C channels (``num_sms / 2``) ·
M received rows · W worst-case rows.

Positional signatures and return tuples are those ``deep_ep/buffers/legacy.py`` (DeepEP 2.1.0)
calls. Every host assert and device trap goes through ``limits`` (each cites its source line per
release). What the kernels do, as DeepEP does it:

- ``get_dispatch_layout``: ``num_tokens_per_rank [R]``, ``num_tokens_per_rdma_rank [N]`` (None
  intranode), ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [T, R]`` bool.
- Intranode dispatch: a notify exchange (per-rank, per-channel and per-expert counts), then the
  rows. Received rows are grouped by source rank, in token order. Handle tensors have DeepEP's
  shapes and meanings: ``rank_prefix_matrix [R, R]`` int32 (``[i, j]`` = tokens ranks ``0..i``
  send to ``j``), ``channel_prefix_matrix [R, C]`` (inclusive per-channel prefix of what this rank
  sends), ``recv_channel_prefix_matrix [R, C]`` (start offset of each source's channel),
  ``recv_src_idx [M]`` int32, ``send_head [T, R]`` int32 (slot in the channel queue, -1 = not
  sent). Received top-k ids are local, -1 elsewhere, with weight 0 there; the per-expert count
  list is aligned to ``expert_alignment``. With ``num_worst_tokens = W``: W rows, uninitialised
  tails (``transport.garbage``) except ``recv_topk_idx`` (-1), an empty count list; more than W
  rows would make the kernel write past its outputs: ``DeviceTrap`` (``worst.overflow``).
- Internode: rows travel as DeepEP moves them — RDMA from rank ``(n, l)`` to its peer ``(m, l)``
  on every destination node, then NVLink from that forwarder to the destination ranks — with
  the ten-tensor handle (``send_rdma_head [T, N]``, ``send_nvl_head [rdma rows, L]``,
  ``recv_src_meta [M, 8]`` uint8 = source node and NVLink bitmask, prefix sums ...).
  Internode combine reduces in two stages, as DeepEP does: the forwarder sums its peers' rows in
  fp32 and rounds to bf16 for the RDMA hop, the source sums the nodes' partial sums in fp32 and
  rounds again (two bf16 roundings); weights stay fp32.
- Combine is unweighted: ``sum`` over the ranks each token went to, plus the optional biases.

Not emulated: streams (events are no-ops, kernels finish before returning), NVSHMEM, the
busy-wait of the CPU for the receive counts (the runtime reads counts on the host freely).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import limits, memory, strict, transport
from .config import SOURCE_META_BYTES, EventHandle, shapes_for
from .low_latency import LowLatencyKernels

__all__ = ["Runtime"]

_SWITCH_TYPES_COMBINE = (torch.bfloat16,)


def _channels(T: int, C: int, device: torch.device) -> torch.Tensor:
    """``[T]`` channel of each token: ``get_channel_task_range`` splits tokens into contiguous
    ranges of ``ceil(T / C)``."""
    per = max(-(-T // C), 1)
    return torch.arange(T, device=device) // per


def _prefix_per_channel(mask: torch.Tensor, chan: torch.Tensor, C: int) -> torch.Tensor:
    """``[D, C]`` int32 inclusive per-channel prefix of ``mask [T, D]``."""
    D = mask.shape[1]
    counts = torch.zeros(D, C, dtype=torch.int64, device=mask.device)
    if mask.numel():
        counts.index_add_(1, chan, mask.t().to(torch.int64))
    return counts.cumsum(1).to(torch.int32)


def _slots(mask: torch.Tensor, chan: torch.Tensor, C: int) -> torch.Tensor:
    """``[T, D]`` int32 slot of each sent token in its (channel, destination) queue, or -1."""
    T, D = mask.shape
    out = torch.full((T, D), -1, dtype=torch.int32, device=mask.device)
    for c in range(C):
        rows = (chan == c).nonzero().flatten()
        if rows.numel() == 0:
            continue
        m = mask[rows].to(torch.int32)
        pos = (m.cumsum(0) - 1).to(torch.int32)
        out[rows] = torch.where(m.bool(), pos, torch.full_like(pos, -1))
    return out


def _order_by_dest(mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Token ids grouped by destination (column of ``mask [T, D]``), token order inside."""
    sel = [mask[:, d].nonzero().flatten() for d in range(mask.shape[1])]
    counts = [int(s.numel()) for s in sel]
    return (torch.cat(sel) if sel else torch.zeros(0, dtype=torch.int64)), counts


class Runtime(LowLatencyKernels):
    """``deep_ep._C.Buffer(rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
    explicitly_destroy, enable_shrink, allow_mnnvl)`` over a gloo group.

    The group is the one ``Buffer.__init__`` handed to ``check_nvlink_connections`` just before
    (the loader's documented patch records it in ``module.pending_group``).
    """

    def __init__(
        self,
        module: Any,
        rank: int,
        num_ranks: int,
        num_nvl_bytes: int,
        num_rdma_bytes: int,
        low_latency_mode: bool,
        explicitly_destroy: bool,
        enable_shrink: bool = False,
        allow_mnnvl: bool = False,
    ) -> None:
        self.release: str = module.EMULATED_RELEASE
        self.L: int = module.NUM_MAX_NVL_PEERS
        self.shapes = shapes_for(self.release)
        group = module.pending_group
        module.pending_group = None
        if group is None:
            raise RuntimeError(
                "emulated deep_ep._C.Buffer built outside deep_ep.Buffer (no process group)"
            )
        self.group = group
        self.rank, self.num_ranks = rank, num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        rel, L = self.release, self.L
        limits.host_assert(num_nvl_bytes % 128 == 0, "buffer.bytes_aligned", rel)
        limits.host_assert(num_rdma_bytes % 128 == 0, "buffer.rdma_bytes_aligned", rel)
        limits.host_assert(num_ranks < L or num_ranks % L == 0, "buffer.num_ranks", rel)
        strict.check_buffer(module, rel, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        memory.allocate(module, num_nvl_bytes + num_rdma_bytes, "cudaMalloc")
        self.module = module
        if num_rdma_bytes > 0:
            limits.host_assert(num_ranks > L or low_latency_mode, "buffer.rdma_needs_nodes", rel)
        self.num_rdma_ranks = max(1, num_ranks // L)
        self.nvl_rank, self.rdma_rank = rank % L, rank // L
        self.available = False
        self.destroyed = False
        self.num_rc_per_pe = 0
        self.normal_dirty = False  # a normal kernel used the buffer since the last clean
        self.ll_launches = 0

    # ----------------------------------------------------------------- set-up
    def get_local_device_id(self) -> int:
        return self.nvl_rank

    def get_local_ipc_handle(self) -> bytes:
        return f"ipc-{self.rank}".encode()

    def get_num_rdma_ranks(self) -> int:
        return self.num_rdma_ranks

    def get_rdma_rank(self) -> int:
        return self.rdma_rank

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self.nvl_rank if global_ else 0

    def get_local_nvshmem_unique_id(self) -> bytes:
        return b"nvshmem-root"

    def sync(self, device_ids: list, ipc_handles: list, root_unique_id: Any) -> None:
        limits.host_assert(not self.available, "buffer.sync_once", self.release)
        # NVSHMEM reads its QP count from the environment DeepEP's Python layer just set.
        self.num_rc_per_pe = int(os.environ.get("NVSHMEM_IBGDA_NUM_RC_PER_PE", "0"))
        self.available = True

    def is_available(self) -> bool:
        return self.available

    def destroy(self) -> None:
        limits.host_assert(not self.destroyed, "buffer.destroy_once", self.release)
        memory.release(self.module, self.num_nvl_bytes + self.num_rdma_bytes)
        self.destroyed = True
        self.available = False

    def get_comm_stream(self) -> Any:
        raise NotImplementedError("the emulated runtime has no CUDA streams")

    def get_local_buffer_tensor(self, *_: Any) -> Any:
        raise NotImplementedError("the emulated runtime has no raw buffer memory")

    # ----------------------------------------------------------------- helpers
    def _live(self) -> None:
        if not self.available:
            raise limits.DeepEPHostAssert("Failed: Assertion error is_available()")

    def _event(self, previous_event: Any, async_: bool, on_comm: bool) -> EventHandle | None:
        if on_comm:
            limits.host_assert(
                previous_event is not None and async_, "event.previous_needs_async", self.release
            )
        return EventHandle() if async_ else None

    def _config(self, config: Any) -> int:
        limits.host_assert(config.num_sms % 2 == 0, "config.num_sms_even", self.release)
        return config.num_sms // 2

    def _check_launch(self) -> None:
        rel = self.release
        if self.num_rdma_ranks > 1:
            N = self.num_rdma_ranks
            limits.host_assert(0 < N <= self.shapes.max_rdma_peers, "internode.rdma_ranks", rel)
            limits.host_assert(N in self.shapes.rdma_ranks, "launch.rdma_ranks", rel, f"N={N}")
        else:
            R = self.num_ranks
            limits.host_assert(R in self.shapes.intranode_ranks, "launch.ranks", rel, f"R={R}")

    def _after_normal(self) -> None:
        self.normal_dirty = True

    def _exchange_counts(self, rows: torch.Tensor) -> torch.Tensor:
        return transport.exchange_counts(rows.to(torch.int64).cpu(), self.group)

    # ----------------------------------------------------------------- layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any,
        async_: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple:
        self._live()
        rel = self.release
        limits.host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "layout.topk_idx", rel)
        limits.host_assert(num_experts > 0, "layout.num_experts", rel)
        if topk_idx.dtype != torch.int64:
            raise RuntimeError(f"expected scalar type Long but found {topk_idx.dtype}")
        event = self._event(previous_event, async_, allocate_on_comm_stream)
        with transport.kernel("get_dispatch_layout"):
            R, T = self.num_ranks, topk_idx.size(0)
            e = num_experts // R
            valid = topk_idx >= 0
            flat = topk_idx[valid]
            per_expert = torch.bincount(flat, minlength=num_experts)[:num_experts]
            in_rank = torch.zeros(T, R, dtype=torch.bool, device=topk_idx.device)
            rows = valid.nonzero()[:, 0]
            in_rank[rows, flat // e] = True
            per_rdma = None
            if self.num_rdma_ranks > 1:
                per_rdma = in_rank.view(T, self.num_rdma_ranks, self.L).any(-1).sum(0)
                per_rdma = per_rdma.to(torch.int32)
        return (
            in_rank.sum(0).to(torch.int32),
            per_rdma,
            per_expert.to(torch.int32),
            in_rank,
            event,
        )

    # ----------------------------------------------------------------- row checks
    def _check_x(self, x: torch.Tensor, x_scales: torch.Tensor | None, T: int) -> int:
        rel = self.release
        limits.host_assert(x.dim() == 2 and x.is_contiguous(), "dispatch.x_2d", rel)
        limits.host_assert((x.size(1) * x.element_size()) % 16 == 0, "dispatch.row_int4", rel)
        if x_scales is None:
            return 0
        limits.host_assert(x.element_size() == 1, "dispatch.scales_fp8", rel)
        limits.host_assert(
            x_scales.dtype in (torch.float32, torch.int32) and x_scales.dim() in (1, 2),
            "dispatch.scales_dtype",
            rel,
        )
        limits.host_assert(x_scales.size(0) == T, "dispatch.scales_rows", rel)
        limits.host_assert(x_scales.dim() == 2, "dispatch.scales_2d", rel)
        return 1 if x_scales.dim() == 1 else int(x_scales.size(1))

    def _check_topk(
        self, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, T: int
    ) -> int:
        rel = self.release
        limits.host_assert((topk_idx is None) == (topk_weights is None), "dispatch.topk_pair", rel)
        if topk_idx is None or topk_weights is None:
            return 0
        k = topk_idx.size(1) if topk_idx.dim() == 2 else -1
        limits.host_assert(
            topk_idx.dim() == 2
            and topk_idx.is_contiguous()
            and topk_weights.dim() == 2
            and topk_weights.is_contiguous()
            and topk_idx.size(0) == T
            and tuple(topk_weights.shape) == tuple(topk_idx.shape),
            "dispatch.topk_shape",
            rel,
        )
        limits.host_assert(topk_weights.dtype == torch.float32, "dispatch.weights_fp32", rel)
        if topk_idx.dtype != torch.int64:
            raise RuntimeError(f"expected scalar type Long but found {topk_idx.dtype}")
        return k

    def _check_layout_args(
        self,
        T: int,
        num_tokens_per_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor | None,
    ) -> int:
        rel, R = self.release, self.num_ranks
        limits.host_assert(
            num_tokens_per_rank is not None and num_tokens_per_expert is not None,
            "dispatch.layout_given",
            rel,
        )
        assert num_tokens_per_rank is not None and num_tokens_per_expert is not None
        limits.host_assert(is_token_in_rank.dtype == torch.bool, "dispatch.itr_bool", rel)
        limits.host_assert(
            num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32,
            "dispatch.counts_int32",
            rel,
        )
        limits.host_assert(
            is_token_in_rank.dim() == 2 and tuple(is_token_in_rank.shape) == (T, R),
            "dispatch.itr_shape",
            rel,
        )
        E = num_tokens_per_expert.numel()
        limits.host_assert(
            num_tokens_per_expert.dim() == 1 and E % R == 0, "dispatch.nte_shape", rel
        )
        limits.host_assert(E // R <= 1024, "dispatch.max_local_experts", rel)
        limits.host_assert(
            num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.numel() == R,
            "dispatch.ntr_shape",
            rel,
        )
        return E

    # ----------------------------------------------------------------- intranode
    def intranode_dispatch(
        self,
        x: torch.Tensor,
        x_scales: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_tokens_per_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor | None,
        cached_num_recv_tokens: int,
        cached_rank_prefix_matrix: torch.Tensor | None,
        cached_channel_prefix_matrix: torch.Tensor | None,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Any,
        previous_event: Any,
        async_: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple:
        self._live()
        rel, R, me = self.release, self.num_ranks, self.rank
        cached = cached_rank_prefix_matrix is not None
        C = self._config(config)
        T = x.size(0)
        if cached:
            limits.host_assert(
                cached_channel_prefix_matrix is not None, "dispatch.cached_needs_matrices", rel
            )
            E, k = 0, 0
        else:
            E = self._check_layout_args(
                T, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
            )
            k = self._check_topk(topk_idx, topk_weights, T)
        num_scales = self._check_x(x, x_scales, T)
        self._check_launch()
        e = E // R if E else 0
        if not cached:
            limits.host_assert(e <= 128 and R <= 128, "notify.local_experts", rel, f"e={e}")
            limits.host_assert(
                R * (R + e) * 4 <= self.num_nvl_bytes, "dispatch.nvl_bytes_notify", rel
            )
        recv_tokens = config.num_max_nvl_chunked_recv_tokens
        row = x.size(1) * x.element_size()
        need = C * R * 4 * 4 + C * R * recv_tokens * (row + 4 + k * 8 + k * 4 + 4 * num_scales)
        limits.host_assert(need <= self.num_nvl_bytes, "dispatch.nvl_bytes", rel, f"{need} bytes")
        limits.device_trap(k <= 32, "dispatch.topk_max", rel, f"k={k}")
        hidden_int4 = row // 16
        limits.device_trap(
            hidden_int4 % 2 == 0 and row // 2 + 8 <= 8192,
            "dispatch.tma_row",
            rel,
            f"a row of {row} bytes",
        )
        event = self._event(previous_event, async_, allocate_on_comm_stream)
        dev = x.device
        chan = _channels(T, C, dev)
        sel, send_counts = _order_by_dest(is_token_in_rank)
        with transport.kernel("intranode_dispatch"):
            if cached:
                assert cached_rank_prefix_matrix is not None
                col = cached_rank_prefix_matrix[:, me].to(torch.int64)
                recv_counts = torch.diff(col, prepend=col.new_zeros(1)).tolist()
                per_expert_counts = None
                src_channel = None
                all_counts = None
            else:
                assert num_tokens_per_expert is not None
                # notify: tokens per destination, per channel, and per destination expert
                chan_counts = _prefix_per_channel(is_token_in_rank, chan, C).to(torch.int64)
                chan_counts = torch.diff(chan_counts, dim=1, prepend=chan_counts.new_zeros(R, 1))
                # every rank's whole count row travels too: DeepEP's notify shares them through
                # the NVLink buffer to build rank_prefix_matrix
                sent_row = torch.tensor(send_counts, dtype=torch.int64)
                rows = torch.cat(
                    [
                        sent_row.view(R, 1),
                        sent_row.view(1, R).expand(R, R),
                        chan_counts.cpu(),
                        num_tokens_per_expert.view(R, e).to(torch.int64).cpu(),
                    ],
                    1,
                )
                got = self._exchange_counts(rows)
                recv_counts = got[:, 0].tolist()
                all_counts = got[:, 1 : 1 + R]  # [s, j]: tokens s sends to j
                src_channel = got[:, 1 + R : 1 + R + C]
                per_expert_counts = got[:, 1 + R + C :].sum(0)
            fields: list[torch.Tensor] = [x[sel], sel.to(torch.int32).view(-1, 1)]
            specs: list[tuple[torch.dtype, tuple[int, ...]]] = [
                (x.dtype, (x.size(1),)),
                (torch.int32, (1,)),
            ]
            if x_scales is not None:
                sc = x_scales if x_scales.dim() == 2 else x_scales.view(-1, 1)
                fields.append(sc[sel])
                specs.append((sc.dtype, (sc.size(1),)))
            if k:
                assert topk_idx is not None and topk_weights is not None
                fields += [topk_idx[sel], topk_weights[sel]]
                specs += [(torch.int64, (k,)), (torch.float32, (k,))]
            recv = transport.exchange_known(
                transport.pack(fields), send_counts, recv_counts, self.group
            )
        got_fields = transport.unpack(recv, specs)
        M = recv.shape[0]
        rows_out = M
        if cached:
            limits.host_assert(
                cached_num_recv_tokens == M or num_worst_tokens > 0,
                "dispatch.cached_needs_matrices",
                rel,
                f"the handle says {cached_num_recv_tokens} rows, {M} arrived",
            )
            rows_out = cached_num_recv_tokens
        elif num_worst_tokens > 0:
            limits.device_trap(
                num_worst_tokens >= M,
                "worst.overflow",
                rel,
                f"rank {me} receives {M} rows but num_worst_tokens={num_worst_tokens}",
            )
            rows_out = num_worst_tokens

        def placed(t: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
            out = (
                transport.garbage((rows_out, *t.shape[1:]), t.dtype, dev) if fill is None else fill
            )
            out[:M] = t.to(dev)
            return out

        recv_x = placed(got_fields[0])
        recv_src_idx = placed(got_fields[1].view(-1))
        recv_scales = None
        if x_scales is not None:
            recv_scales = placed(got_fields[2])
            if x_scales.dim() == 1:
                recv_scales = recv_scales.view(-1)
        self._after_normal()
        if cached:
            return (recv_x, recv_scales, None, None, [], None, None, None, None, None, event)

        assert topk_idx is not None or k == 0
        recv_idx = recv_w = None
        if k:
            gid, w = got_fields[-2].to(dev), got_fields[-1].to(dev)
            lo = me * e
            mine = (gid >= lo) & (gid < lo + e)
            loc = torch.where(mine, gid - lo, torch.full_like(gid, -1))
            recv_idx = placed(loc, torch.full((rows_out, k), -1, dtype=torch.int64, device=dev))
            recv_w = placed(torch.where(mine, w, torch.zeros_like(w)))
        assert per_expert_counts is not None and src_channel is not None
        if num_worst_tokens > 0:
            count_list: list[int] = []
        else:
            a = max(expert_alignment, 1)
            count_list = [int(-(-c // a) * a) for c in per_expert_counts.tolist()]
        # rank_prefix_matrix[i, j]: tokens ranks 0..i send to j (DeepEP's notify writes it)
        assert all_counts is not None
        rpm = all_counts.cumsum(0).to(torch.int32).contiguous().to(dev)
        recv_col = torch.tensor(recv_counts, dtype=torch.int64)
        channel_prefix = _prefix_per_channel(is_token_in_rank, chan, C)
        starts = torch.cumsum(recv_col, 0) - recv_col
        recv_channel_prefix = (
            (starts.view(R, 1) + torch.cumsum(src_channel, 1) - src_channel).to(torch.int32).to(dev)
        )
        send_head = _slots(is_token_in_rank, chan, C)
        return (
            recv_x,
            recv_scales,
            recv_idx,
            recv_w,
            count_list,
            rpm,
            channel_prefix,
            recv_channel_prefix,
            recv_src_idx,
            send_head,
            event,
        )

    def _check_combine_rows(
        self,
        x: torch.Tensor,
        rows: int,
        topk_weights: torch.Tensor | None,
        biases: tuple[torch.Tensor | None, ...],
        T: int,
    ) -> int:
        """Combine's row, weight and bias asserts (both kernels); returns the weights' width."""
        rel, H = self.release, x.size(1)
        limits.host_assert(rows == x.size(0), "combine.rows", rel)
        limits.host_assert((H * x.element_size()) % 16 == 0, "combine.row_int4", rel)
        limits.host_assert(x.dtype in _SWITCH_TYPES_COMBINE, "combine.dtype", rel, f"{x.dtype}")
        k = 0
        if topk_weights is not None:
            limits.host_assert(
                topk_weights.dim() == 2
                and topk_weights.is_contiguous()
                and topk_weights.size(0) == x.size(0)
                and topk_weights.dtype == torch.float32,
                "combine.weights",
                rel,
            )
            k = topk_weights.size(1)
        for b in biases:
            if b is not None:
                limits.host_assert(
                    tuple(b.shape) == (T, H) and b.dtype == x.dtype and b.is_contiguous(),
                    "combine.bias",
                    rel,
                )
        return k

    def intranode_combine(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        bias_0: torch.Tensor | None,
        bias_1: torch.Tensor | None,
        src_idx: torch.Tensor,
        rank_prefix_matrix: torch.Tensor,
        channel_prefix_matrix: torch.Tensor,
        send_head: torch.Tensor,
        config: Any,
        previous_event: Any,
        async_: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple:
        self._live()
        rel, R, me = self.release, self.num_ranks, self.rank
        C = self._config(config)
        limits.host_assert(x.dim() == 2 and x.is_contiguous(), "combine.x_2d", rel)
        limits.host_assert(
            src_idx.dim() == 1
            and src_idx.dtype == torch.int32
            and send_head.dim() == 2
            and send_head.dtype == torch.int32
            and tuple(rank_prefix_matrix.shape) == (R, R)
            and rank_prefix_matrix.dtype == torch.int32
            and tuple(channel_prefix_matrix.shape) == (R, C)
            and send_head.size(1) == R,
            "combine.handle",
            rel,
        )
        T, H = send_head.size(0), x.size(1)
        k = self._check_combine_rows(x, src_idx.size(0), topk_weights, (bias_0, bias_1), T)
        limits.host_assert(self.num_nvl_bytes >= C * R * 4 * 2, "combine.nvl_bytes", rel)
        self._check_launch()
        limits.device_trap(
            H % 256 == 0, "combine.v121_divergence", rel, f"a combine row of {H} bf16 columns"
        )
        event = self._event(previous_event, async_, allocate_on_comm_stream)
        col = rank_prefix_matrix[:, me].to(torch.int64).cpu()
        back_counts = torch.diff(col, prepend=col.new_zeros(1)).tolist()
        M = int(col[-1])
        mask = send_head >= 0
        sel, from_counts = _order_by_dest(mask.cpu())
        fields = [x[:M]]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [(x.dtype, (H,))]
        if topk_weights is not None:
            fields.append(topk_weights[:M])
            specs.append((torch.float32, (k,)))
        with transport.kernel("intranode_combine"):
            recv = transport.exchange_known(
                transport.pack(fields), back_counts, from_counts, self.group
            )
        got = transport.unpack(recv, specs)
        dev = x.device
        acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
        acc.index_add_(0, sel.to(dev), got[0].to(dev).float())
        out_w = None
        if topk_weights is not None:
            out_w = torch.zeros(T, k, dtype=torch.float32, device=dev)
            out_w.index_add_(0, sel.to(dev), got[1].to(dev))
        for b in (bias_0, bias_1):
            if b is not None:
                acc += b.float()
        self._after_normal()
        return acc.to(x.dtype), out_w, event

    # ----------------------------------------------------------------- internode
    def _check_internode(self, config: Any, *, combine: bool, cached: bool = False) -> None:
        rel, N = self.release, self.num_rdma_ranks
        C = config.num_sms // 2
        strict.check_internode_bytes(self, cached=combine or cached)
        if combine or cached:
            limits.host_assert(C * 2 > 3, "internode.num_channels", rel, f"num_channels={C}")
        limits.device_trap(
            self.num_rc_per_pe == C or self.num_rc_per_pe >= config.num_sms,
            "internode.qps",
            rel,
            f"num_rc_per_pe={self.num_rc_per_pe}, num_channels={C}, num_sms={config.num_sms}",
        )
        if combine:
            limits.host_assert(
                config.num_max_nvl_chunked_recv_tokens % N == 0, "internode.combine_nvl_chunks", rel
            )
            limits.host_assert(
                config.num_max_nvl_chunked_send_tokens
                <= config.num_max_nvl_chunked_recv_tokens // N,
                "internode.combine_nvl_send",
                rel,
            )

    def _token_bytes(self, row: int, num_scales: int, k: int) -> int:
        """``get_num_bytes_per_token``: row + SourceMeta + scales + ids + weights, 16-aligned."""
        n = row + SOURCE_META_BYTES + 4 * num_scales + 4 * k + 4 * k
        return -(-n // 16) * 16

    def internode_dispatch(
        self,
        x: torch.Tensor,
        x_scales: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_tokens_per_rank: torch.Tensor | None,
        num_tokens_per_rdma_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor | None,
        cached_num_recv_tokens: int,
        cached_num_rdma_recv_tokens: int,
        cached_rdma_channel_prefix_matrix: torch.Tensor | None,
        cached_recv_rdma_rank_prefix_sum: torch.Tensor | None,
        cached_gbl_channel_prefix_matrix: torch.Tensor | None,
        cached_recv_gbl_rank_prefix_sum: torch.Tensor | None,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Any,
        previous_event: Any,
        async_: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple:
        self._live()
        rel, R, me, L, N = self.release, self.num_ranks, self.rank, self.L, self.num_rdma_ranks
        cached = cached_rdma_channel_prefix_matrix is not None
        C = self._config(config)
        T = x.size(0)
        if cached:
            limits.host_assert(
                cached_recv_rdma_rank_prefix_sum is not None
                and cached_gbl_channel_prefix_matrix is not None
                and cached_recv_gbl_rank_prefix_sum is not None,
                "dispatch.cached_needs_matrices",
                rel,
            )
            E, k = 0, 0
        else:
            E = self._check_layout_args(
                T, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
            )
            limits.host_assert(num_tokens_per_rdma_rank is not None, "dispatch.layout_given", rel)
            k = self._check_topk(topk_idx, topk_weights, T)
        num_scales = self._check_x(x, x_scales, T)
        self._check_launch()
        limits.host_assert(self.num_rdma_bytes > 0, "buffer.rdma_needs_nodes", rel)
        self._check_internode(config, combine=False, cached=cached)
        e = E // R if E else 0
        if not cached:
            strict.check_node_span(self, is_token_in_rank)
            limits.device_trap(E // N <= 512, "internode.notify_rdma_experts", rel, f"E/N={E // N}")
            limits.device_trap(e <= 512, "internode.notify_nvl_experts", rel, f"e={e}")
        limits.device_trap(k <= 32, "internode.dispatch_topk_max", rel, f"k={k}")
        row = x.size(1) * x.element_size()
        tb = self._token_bytes(row, num_scales, k)
        limits.device_trap(
            tb + 8 <= 16384, "internode.dispatch_token_bytes", rel, f"{tb} bytes per token"
        )
        nvl_need = C * L * config.num_max_nvl_chunked_recv_tokens * tb
        limits.host_assert(nvl_need <= self.num_nvl_bytes, "dispatch.nvl_bytes", rel)
        event = self._event(previous_event, async_, allocate_on_comm_stream)
        dev = x.device
        itr = is_token_in_rank
        node_mask = itr.view(T, N, L).any(-1)
        shifts = torch.arange(L, dtype=torch.int64, device=dev)
        bits = (itr.view(T, N, L).to(torch.int64) << shifts).sum(-1).to(torch.int32)  # [T, N]
        chan = _channels(T, C, dev)
        my_node, my_local = me // L, me % L

        # stage 1 (RDMA): to the rank with this rank's local index on every destination node
        rsel, rdma_counts_by_node = _order_by_dest(node_mask.cpu())
        rdma_send = [0] * R
        for m in range(N):
            rdma_send[m * L + my_local] = rdma_counts_by_node[m]
        node_of_sel = torch.repeat_interleave(
            torch.arange(N), torch.tensor(rdma_counts_by_node, dtype=torch.int64)
        )
        fields: list[torch.Tensor] = [
            x[rsel],
            rsel.to(torch.int32).view(-1, 1),
            bits.cpu()[rsel, node_of_sel].view(-1, 1),
            chan.cpu()[rsel].to(torch.int32).view(-1, 1),
        ]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [
            (x.dtype, (x.size(1),)),
            (torch.int32, (1,)),
            (torch.int32, (1,)),
            (torch.int32, (1,)),
        ]
        sc = None
        if x_scales is not None:
            sc = x_scales if x_scales.dim() == 2 else x_scales.view(-1, 1)
            fields.append(sc[rsel])
            specs.append((sc.dtype, (sc.size(1),)))
        if k:
            assert topk_idx is not None and topk_weights is not None
            fields += [topk_idx[rsel], topk_weights[rsel]]
            specs += [(torch.int64, (k,)), (torch.float32, (k,))]
        with transport.kernel("internode_dispatch"):
            if cached:
                assert cached_recv_rdma_rank_prefix_sum is not None
                assert cached_recv_gbl_rank_prefix_sum is not None
                rsum = cached_recv_rdma_rank_prefix_sum.to(torch.int64).cpu()
                rdma_from_node = torch.diff(rsum, prepend=rsum.new_zeros(1)).tolist()
                gsum = cached_recv_gbl_rank_prefix_sum.to(torch.int64).cpu()
                recv_from = torch.diff(gsum, prepend=gsum.new_zeros(1)).tolist()
                per_expert = None
                src_chan = None
            else:
                assert num_tokens_per_expert is not None
                chan_p = _prefix_per_channel(itr, chan, C).to(torch.int64).cpu()
                chan_c = torch.diff(chan_p, dim=1, prepend=chan_p.new_zeros(R, 1))
                ntr_row = itr.sum(0).to(torch.int64).cpu().view(R, 1)
                rdma_row = torch.tensor(rdma_send, dtype=torch.int64).view(R, 1)
                nte = num_tokens_per_expert.view(R, e).to(torch.int64).cpu()
                got = self._exchange_counts(torch.cat([ntr_row, rdma_row, chan_c, nte], 1))
                recv_from = got[:, 0].tolist()
                rdma_from_node = [int(got[n * L + my_local, 1]) for n in range(N)]
                src_chan = got[:, 2 : 2 + C]
                per_expert = got[:, 2 + C :].sum(0)
            rdma_recv_counts = [0] * R
            for n in range(N):
                rdma_recv_counts[n * L + my_local] = rdma_from_node[n]
            rrecv = transport.exchange_known(
                transport.pack(fields), rdma_send, rdma_recv_counts, self.group
            )
            rgot = transport.unpack(rrecv, specs)
            # stage 2 (NVLink): the forwarder sends each row to the ranks of its bitmask
            n_rdma = rrecv.shape[0]
            rbits = rgot[2].view(-1).to(torch.int64)
            src_node = torch.repeat_interleave(
                torch.arange(N), torch.tensor(rdma_from_node, dtype=torch.int64)
            )
            peer_mask = ((rbits.view(-1, 1) >> torch.arange(L)) & 1).bool()  # [n_rdma, L]
            nsel, nvl_counts_local = _order_by_dest(peer_mask)
            nvl_send = [0] * R
            for j in range(L):
                nvl_send[my_node * L + j] = nvl_counts_local[j]
            nvl_recv = [0] * R
            for l in range(L):
                nvl_recv[my_node * L + l] = sum(recv_from[n * L + l] for n in range(N))
            src_global = (src_node * L + my_local).to(torch.int32).view(-1, 1)
            f2 = [rg[nsel] for rg in rgot] + [src_global[nsel]]
            specs2 = [*specs, (torch.int32, (1,))]
            nrecv = transport.exchange_known(transport.pack(f2), nvl_send, nvl_recv, self.group)
        g2 = transport.unpack(nrecv, specs2)
        src_of = g2[-1].view(-1).to(torch.int64)
        order = torch.argsort(src_of, stable=True)  # group by source global rank
        g2 = [t[order] for t in g2]
        M = nrecv.shape[0]
        if cached:
            limits.host_assert(
                cached_num_recv_tokens == M and cached_num_rdma_recv_tokens == n_rdma,
                "dispatch.cached_needs_matrices",
                rel,
                f"the handle says {cached_num_recv_tokens} rows, {M} arrived",
            )
        recv_x = g2[0].to(dev).contiguous()
        recv_scales = None
        if x_scales is not None:
            recv_scales = g2[4].to(dev)
            if x_scales.dim() == 1:
                recv_scales = recv_scales.view(-1)
        self._after_normal()
        if cached:
            empty = (None,) * 10
            return (recv_x, recv_scales, None, None, [], *empty[:9], event)

        recv_idx = recv_w = None
        if k:
            gid, w = g2[-3].to(dev), g2[-2].to(dev)
            lo = me * e
            mine = (gid >= lo) & (gid < lo + e)
            recv_idx = torch.where(mine, gid - lo, torch.full_like(gid, -1))
            recv_w = torch.where(mine, w, torch.zeros_like(w))
        a = max(expert_alignment, 1)
        assert per_expert is not None and src_chan is not None
        count_list = [int(-(-c // a) * a) for c in per_expert.tolist()]
        recv_col = torch.tensor(recv_from, dtype=torch.int64)
        starts = torch.cumsum(recv_col, 0) - recv_col
        recv_gbl_channel = (starts.view(R, 1) + torch.cumsum(src_chan, 1) - src_chan).to(
            torch.int32
        )
        rdma_from = torch.tensor(rdma_from_node, dtype=torch.int64)
        # per-channel prefix of what this RDMA endpoint receives from each node
        recv_rdma_channel = torch.zeros(N, C, dtype=torch.int64)
        if n_rdma:
            recv_rdma_channel.index_put_(
                (src_node, rgot[3].view(-1).long()),
                torch.ones(n_rdma, dtype=torch.int64),
                accumulate=True,
            )
        recv_rdma_channel = recv_rdma_channel.cumsum(1).to(torch.int32)
        meta = torch.stack([src_of[order] // L, g2[2].view(-1).to(torch.int64)], 1)
        src_meta = meta.to(torch.int32).contiguous().view(torch.uint8).view(M, SOURCE_META_BYTES)
        send_nvl_head = torch.full((n_rdma, L), -1, dtype=torch.int32)
        for j in range(L):
            rows_j = peer_mask[:, j].nonzero().flatten()
            send_nvl_head[rows_j, j] = torch.arange(rows_j.numel(), dtype=torch.int32)
        return (
            recv_x,
            recv_scales,
            recv_idx,
            recv_w,
            count_list,
            _prefix_per_channel(node_mask, chan, C),
            _prefix_per_channel(itr, chan, C),
            recv_rdma_channel.to(dev),
            rdma_from.cumsum(0).to(torch.int32).to(dev),
            recv_gbl_channel.to(dev),
            recv_col.cumsum(0).to(torch.int32).to(dev),
            src_meta.to(dev),
            _slots(node_mask, chan, C),
            send_nvl_head.to(dev),
            event,
        )

    def internode_combine(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        bias_0: torch.Tensor | None,
        bias_1: torch.Tensor | None,
        src_meta: torch.Tensor,
        is_combined_token_in_rank: torch.Tensor,
        rdma_channel_prefix_matrix: torch.Tensor,
        rdma_rank_prefix_sum: torch.Tensor,
        gbl_channel_prefix_matrix: torch.Tensor,
        combined_rdma_head: torch.Tensor,
        combined_nvl_head: torch.Tensor,
        config: Any,
        previous_event: Any,
        async_: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple:
        self._live()
        rel, R, me, L, N = self.release, self.num_ranks, self.rank, self.L, self.num_rdma_ranks
        C = self._config(config)
        limits.host_assert(x.dim() == 2 and x.is_contiguous(), "combine.x_2d", rel)
        limits.host_assert(
            src_meta.dim() == 2
            and src_meta.dtype == torch.uint8
            and src_meta.size(1) == SOURCE_META_BYTES,
            "internode.src_meta",
            rel,
        )
        T, H = is_combined_token_in_rank.size(0), x.size(1)
        limits.host_assert(
            is_combined_token_in_rank.dtype == torch.bool
            and is_combined_token_in_rank.size(1) == R
            and tuple(rdma_channel_prefix_matrix.shape) == (N, C)
            and tuple(rdma_rank_prefix_sum.shape) == (N,)
            and tuple(gbl_channel_prefix_matrix.shape) == (R, C)
            and tuple(combined_rdma_head.shape) == (T, N)
            and combined_nvl_head.dim() == 2
            and combined_nvl_head.size(1) == L,
            "combine.handle",
            rel,
        )
        k = self._check_combine_rows(x, src_meta.size(0), topk_weights, (bias_0, bias_1), T)
        self._check_launch()
        self._check_internode(config, combine=True)
        hidden_int4 = H * x.element_size() // 16
        limits.device_trap(hidden_int4 % 32 == 0, "internode.combine_hidden", rel, f"H={H}")
        tb = -(-(H * x.element_size() + SOURCE_META_BYTES + 4 * k) // 16) * 16
        limits.device_trap(tb + 8 <= 16384, "internode.combine_token_bytes", rel, f"{tb} bytes")
        event = self._event(previous_event, async_, allocate_on_comm_stream)
        dev = x.device
        my_node, my_local = me // L, me % L
        M = x.size(0)
        starts = gbl_channel_prefix_matrix[:, 0].to(torch.int64).cpu()
        ends = torch.cat([starts[1:], torch.tensor([M])])
        from_src = (ends - starts).tolist()  # rows this rank received from each source
        # stage 1 (NVLink back): rows of source (n, l) go to the forwarder (my_node, l); the rows
        # are grouped by source global rank, so regroup by the source's local index
        src_of = torch.repeat_interleave(torch.arange(R), torch.tensor(from_src))
        by_local = torch.argsort(src_of % L, stable=True)
        send1 = [0] * R
        for l in range(L):
            send1[my_node * L + l] = sum(from_src[n * L + l] for n in range(N))
        heads = combined_nvl_head.cpu() >= 0  # [rdma rows, L]
        recv1 = [0] * R
        for j in range(L):
            recv1[my_node * L + j] = int(heads[:, j].sum())
        fields = [x[by_local]]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [(x.dtype, (H,))]
        if topk_weights is not None:
            fields.append(topk_weights[by_local])
            specs.append((torch.float32, (k,)))
        rsum = rdma_rank_prefix_sum.to(torch.int64).cpu()
        rdma_from_node = torch.diff(rsum, prepend=rsum.new_zeros(1)).tolist()
        n_rdma = int(rsum[-1]) if N else 0
        with transport.kernel("internode_combine"):
            got1 = transport.unpack(
                transport.exchange_known(transport.pack(fields), send1, recv1, self.group), specs
            )
            # the forwarder reduces its peers' rows per RDMA row: fp32 sum, bf16 on the RDMA hop
            part = torch.zeros(n_rdma, H, dtype=torch.float32)
            part_w = torch.zeros(n_rdma, k, dtype=torch.float32)
            start = 0
            for j in range(L):
                rows_j = heads[:, j].nonzero().flatten()
                seg = slice(start, start + rows_j.numel())
                part.index_add_(0, rows_j, got1[0][seg].float())
                if k:
                    part_w.index_add_(0, rows_j, got1[1][seg])
                start += rows_j.numel()
            part_b = part.to(torch.bfloat16)
            # stage 2 (RDMA back): each source node's rows return to the source rank
            send2 = [0] * R
            for n in range(N):
                send2[n * L + my_local] = rdma_from_node[n]
            node_mask = is_combined_token_in_rank.view(T, N, L).any(-1).cpu()
            rsel, per_node = _order_by_dest(node_mask)
            recv2 = [0] * R
            for m in range(N):
                recv2[m * L + my_local] = per_node[m]
            f2 = [part_b] + ([part_w] if k else [])
            s2 = [(torch.bfloat16, (H,))] + ([(torch.float32, (k,))] if k else [])
            got2 = transport.unpack(
                transport.exchange_known(transport.pack(f2), send2, recv2, self.group), s2
            )
        acc = torch.zeros(T, H, dtype=torch.float32)
        acc.index_add_(0, rsel, got2[0].float())
        out_w = None
        if k:
            out_w = torch.zeros(T, k, dtype=torch.float32)
            out_w.index_add_(0, rsel, got2[1])
            out_w = out_w.to(dev)
        for b in (bias_0, bias_1):
            if b is not None:
                acc += b.float().cpu()
        self._after_normal()
        return acc.to(x.dtype).to(dev), out_w, event
