"""Emulated ``deep_ep.Buffer``: layout, normal/cached/worst-case dispatch, combine. TEST-ONLY.

Shape letters: T tokens · H hidden · E experts · R ranks · e = E / R · k top-k · M received rows ·
W worst-case rows.

Internode (``R > NUM_MAX_NVL_PEERS``) and intranode calls move rows the same way here; they
differ only in the checks DeepEP applies to each. The low-latency kernels are in
``_low_latency.py``. The tuned ``get_dispatch_config`` / ``get_combine_config`` tables are
DeepEP v1.2.1's, read from ``flexdispatch.planner.deepep`` (their one copy in the project).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flexdispatch.planner.deepep import COMBINE_CONFIGS, DISPATCH_CONFIGS

from . import _config as C
from ._config import Config, ep_assert, get_low_latency_rdma_size_hint
from ._low_latency import LowLatencyMixin
from ._transport import exchange, garbage, pack, unpack
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer"]

_INTRANODE_RANKS = (2, 4, 8)
_INTERNODE_NODES = (2, 4, 8, 16)
_MAX_TOPK = 32


def _topk_idx_dtype_ok(t: torch.Tensor) -> None:
    # NOTE: DeepEP reads the ids through data_ptr<int64_t>(), which raises on any other dtype.
    ep_assert(t.dtype == torch.int64, f"topk_idx dtype int64 (deep_ep.topk_idx_t), got {t.dtype}")


class Buffer(LowLatencyMixin):
    """Communication buffer of one expert-parallel group (emulated on ``torch.distributed``).

    Args:
        group: the process group (required; construction is collective over it).
        num_nvl_bytes: NVLink buffer bytes (multiple of 128).
        num_rdma_bytes: RDMA buffer bytes (multiple of 128; needs R > 8 or low-latency mode).
        low_latency_mode: enable the low-latency kernels.
        num_qps_per_rank: RDMA queue pairs (must be positive when RDMA is used).
        allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, enable_shrink: accepted and
            ignored (no NVSHMEM here).
        explicitly_destroy: ``destroy()`` must be called to release the buffer.
        comm: an mpi4py communicator (not supported by the emulator).
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        num_ranks, peers = self.group_size, C.NUM_MAX_NVL_PEERS
        ep_assert(
            num_nvl_bytes % C.NUM_BUFFER_ALIGNMENT_BYTES == 0,
            "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0",
        )
        ep_assert(
            num_rdma_bytes % C.NUM_BUFFER_ALIGNMENT_BYTES == 0,
            "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0",
        )
        ep_assert(
            num_ranks <= peers * C.NUM_MAX_RDMA_PEERS or low_latency_mode,
            "num_ranks <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode",
        )
        ep_assert(
            num_ranks < peers or num_ranks % peers == 0, "num_ranks < 8 or num_ranks % 8 == 0"
        )
        if num_rdma_bytes > 0:
            ep_assert(num_ranks > peers or low_latency_mode, "num_ranks > 8 or low_latency_mode")
        if self.num_rdma_ranks > 1 or low_latency_mode:
            assert num_qps_per_rank > 0
        # NOTE: DeepEP all-gathers device ids and IPC handles here; keep the collective.
        ids: list[Any] = [None] * num_ranks
        dist.all_gather_object(ids, self.rank, group)
        self._available = True
        self._ll_dirty = False
        self._ll_launches = 0

    # ----------------------------------------------------------------- static API
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs of the normal kernels (process-wide, like DeepEP)."""
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """RDMA bytes the low-latency kernels need."""
        return get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch config (DeepEP v1.2.1's table, kept in the package)."""
        assert num_ranks in DISPATCH_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *DISPATCH_CONFIGS[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine config (DeepEP v1.2.1's table, kept in the package)."""
        assert num_ranks in COMBINE_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *COMBINE_CONFIGS[num_ranks])

    # ----------------------------------------------------------------- helpers
    @property
    def num_rdma_ranks(self) -> int:
        return max(1, self.group_size // C.NUM_MAX_NVL_PEERS)

    def destroy(self) -> None:
        """Release the buffer (only with ``explicitly_destroy=True``)."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        ep_assert(self._available, "not destroyed")
        self._available = False

    def _live(self) -> None:
        ep_assert(self._available, "buffer is available (not destroyed)")

    def _event(
        self, previous_event: EventOverlap | None, async_finish: bool, on_comm_stream: bool
    ) -> EventOverlap:
        if on_comm_stream:
            ep_assert(previous_event is not None and async_finish, "previous_event and async")
        return EventOverlap(EventHandle() if async_finish else None)

    def _check_kernel_ranks(self) -> None:
        R, peers = self.group_size, C.NUM_MAX_NVL_PEERS
        if self.num_rdma_ranks > 1:
            ep_assert(R // peers in _INTERNODE_NODES, f"Unsupported RDMA ranks ({R // peers})")
            ep_assert(self.num_rdma_bytes > 0, "num_rdma_bytes > 0 for internode kernels")
        else:
            ep_assert(R in _INTRANODE_RANKS, f"Unsupported ranks ({R})")

    def _check_x(self, x: torch.Tensor, x_scales: torch.Tensor | None) -> None:
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        ep_assert((x.size(1) * x.element_size()) % 16 == 0, "(hidden * elem_size) % 16 == 0")
        if x_scales is None:
            ep_assert(x.dtype == torch.bfloat16, f"x is bf16 or an (fp8, scales) tuple: {x.dtype}")
            return
        ep_assert(x.element_size() == 1, "fp8 x with scales")
        ep_assert(x_scales.dtype in (torch.float32, torch.int32), "scales are fp32")
        ep_assert(x_scales.dim() == 2 and x_scales.size(0) == x.size(0), "scales [T, H / 128]")

    def _check_nvl_bytes(self, config: Config, row_bytes: int, k: int, scales: int) -> None:
        R = min(self.group_size, C.NUM_MAX_NVL_PEERS)
        ch, recv = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        need = R * R * 4 + ch * R * 4 * 4
        need += ch * R * recv * (row_bytes + 4 + k * 8 + k * 4 + scales * 4)
        ep_assert(need <= self.num_nvl_bytes, f"{need} NVL bytes needed <= {self.num_nvl_bytes}")

    def _check_rdma_bytes(self, config: Config, row_bytes: int) -> None:
        if self.num_rdma_ranks > 1:
            need = config.get_rdma_buffer_size_hint(row_bytes, self.group_size) - (1 << 20)
            ep_assert(need <= self.num_rdma_bytes, f"{need} RDMA bytes <= {self.num_rdma_bytes}")

    def _after_normal_kernel(self) -> None:
        if self.low_latency_mode:
            self._ll_dirty = True

    # ----------------------------------------------------------------- layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R/8] int32 | None,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``."""
        self._live()
        ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D contiguous")
        ep_assert(num_experts > 0 and num_experts % self.group_size == 0, "E % R == 0")
        _topk_idx_dtype_ok(topk_idx)
        event = self._event(previous_event, async_finish, allocate_on_comm_stream)
        R, e, T = self.group_size, num_experts // self.group_size, topk_idx.size(0)
        valid = topk_idx >= 0
        experts = torch.arange(num_experts, device=topk_idx.device)
        per_expert = ((topk_idx[..., None] == experts) & valid[..., None]).sum((0, 1))
        rank_of = torch.where(valid, topk_idx // e, torch.full_like(topk_idx, -1))
        in_rank = (rank_of[..., None] == torch.arange(R, device=topk_idx.device)).any(1)
        per_rdma = None
        if self.num_rdma_ranks > 1:
            per_rdma = in_rank.view(T, self.num_rdma_ranks, -1).any(-1).sum(0).to(torch.int32)
        return (
            in_rank.sum(0).to(torch.int32),
            per_rdma,
            per_expert.to(torch.int32),
            in_rank.contiguous(),
            event,
        )

    # ----------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: tuple | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, tuple | None, Any]:
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; in cached mode (``handle`` given) everything but ``recv_x`` is None."""
        self._live()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:
            assert num_worst_tokens == 0, (
                "Internode dispatch does not support `num_worst_tokens > 0`"
            )
        xs, x_scales = x if isinstance(x, tuple) else (x, None)
        self._check_kernel_ranks()
        ep_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        self._check_x(xs, x_scales)
        event = self._event(previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            recv_x, recv_scales = self._cached_dispatch(xs, x_scales, handle)
            self._after_normal_kernel()
            out_x = (recv_x, recv_scales) if x_scales is not None else recv_x
            return out_x, None, None, None, None, event
        assert (
            num_tokens_per_rank is not None
            and is_token_in_rank is not None
            and num_tokens_per_expert is not None
        )
        if self.num_rdma_ranks > 1:
            ep_assert(num_tokens_per_rdma_rank is not None, "num_tokens_per_rdma_rank given")
        out = self._fresh_dispatch(
            xs,
            x_scales,
            num_tokens_per_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
            config,
        )
        self._after_normal_kernel()
        recv_x, recv_scales, recv_idx, recv_w, counts, new_handle = out
        out_x = (recv_x, recv_scales) if x_scales is not None else recv_x
        return out_x, recv_idx, recv_w, counts, new_handle, event

    def _fresh_dispatch(
        self,
        x: torch.Tensor,
        x_scales: torch.Tensor | None,
        num_tokens_per_rank: torch.Tensor,
        is_token_in_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Config,
    ) -> tuple[Any, ...]:
        R, T, dev = self.group_size, x.size(0), x.device
        ep_assert(is_token_in_rank.dtype == torch.bool, "is_token_in_rank is bool")
        ep_assert(tuple(is_token_in_rank.shape) == (T, R), "is_token_in_rank is [T, R]")
        ep_assert(num_tokens_per_rank.dtype == torch.int32, "num_tokens_per_rank is int32")
        ep_assert(num_tokens_per_expert.dtype == torch.int32, "num_tokens_per_expert is int32")
        ep_assert(tuple(num_tokens_per_rank.shape) == (R,), "num_tokens_per_rank is [R]")
        E = num_tokens_per_expert.numel()
        ep_assert(num_tokens_per_expert.dim() == 1 and E % R == 0, "num_tokens_per_expert [E]")
        e = E // R
        ep_assert(e <= C.NUM_MAX_LOCAL_EXPERTS, "num_local_experts <= NUM_MAX_LOCAL_EXPERTS")
        ep_assert((topk_idx is None) == (topk_weights is None), "topk_idx and topk_weights")
        ep_assert(expert_alignment >= 1, "expert_alignment >= 1")
        k = 0
        if topk_idx is not None and topk_weights is not None:
            _topk_idx_dtype_ok(topk_idx)
            k = topk_idx.size(1)
            ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D")
            ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "weights 2-D")
            ep_assert(topk_idx.size(0) == T and topk_weights.shape == topk_idx.shape, "top-k T")
            ep_assert(topk_weights.dtype == torch.float32, "topk_weights is float32")
            ep_assert(k <= _MAX_TOPK, f"num_topk <= {_MAX_TOPK}")
        if num_worst_tokens > 0:
            ep_assert(topk_idx is not None, "num_worst_tokens needs the top-k tensors")
        scales = 0 if x_scales is None else x_scales.size(1)
        self._check_nvl_bytes(config, x.size(1) * x.element_size(), k, scales)
        self._check_rdma_bytes(config, x.size(1) * x.element_size())
        # NOTE: emulator-only consistency check; DeepEP would silently corrupt memory.
        sent = is_token_in_rank.sum(0).to(torch.int32)
        ep_assert(torch.equal(sent, num_tokens_per_rank), "num_tokens_per_rank matches mask")

        # per-expert receive counts travel separately, as in DeepEP's notify kernel
        expert_counts, _ = exchange(
            pack([num_tokens_per_expert.reshape(R, e)]), [1] * R, self.group
        )
        (per_src,) = unpack(expert_counts, [(torch.int32, (e,))])
        per_local = per_src.to(torch.int64).sum(0)
        aligned = (per_local + expert_alignment - 1) // expert_alignment * expert_alignment

        send_head = torch.full((T, R), -1, dtype=torch.int32, device=dev)
        order, send_counts = [], []
        for r in range(R):
            tokens = is_token_in_rank[:, r].nonzero().flatten()
            send_head[tokens, r] = torch.arange(tokens.numel(), dtype=torch.int32, device=dev)
            order.append(tokens)
            send_counts.append(tokens.numel())
        sel = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
        fields = [x[sel], sel.to(torch.int32)]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [
            (x.dtype, (x.size(1),)),
            (torch.int32, ()),
        ]
        if x_scales is not None:
            fields.append(x_scales[sel])
            specs.append((x_scales.dtype, (scales,)))
        if topk_idx is not None and topk_weights is not None:
            fields += [topk_idx[sel], topk_weights[sel]]
            specs += [(torch.int64, (k,)), (torch.float32, (k,))]
        recv, recv_counts = exchange(pack(fields), send_counts, self.group)
        got = unpack(recv, specs)
        M = recv.shape[0]
        rows = M
        if num_worst_tokens > 0:
            if num_worst_tokens < M:
                raise RuntimeError(
                    f"DeepEP emulator: rank {self.rank} received {M} rows but num_worst_tokens="
                    f"{num_worst_tokens}; real DeepEP would write past the end of its outputs"
                )
            rows = num_worst_tokens

        def placed(t: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
            out = garbage((rows, *t.shape[1:]), t.dtype, dev) if fill is None else fill
            out[:M] = t
            return out

        recv_x = placed(got[0])
        recv_src_idx = placed(got[1])
        recv_scales = placed(got[2]) if x_scales is not None else None
        recv_idx = recv_w = None
        if topk_idx is not None:
            gid, w = got[-2], got[-1]
            lo = self.rank * e
            mine = (gid >= lo) & (gid < lo + e)
            loc = torch.where(mine, gid - lo, torch.full_like(gid, -1))
            recv_idx = placed(loc, torch.full((rows, k), -1, dtype=torch.int64, device=dev))
            recv_w = placed(torch.where(mine, w, torch.zeros_like(w)))
        counts = [] if num_worst_tokens > 0 else [int(c) for c in aligned.tolist()]
        handle = (
            torch.tensor(recv_counts, dtype=torch.int32),
            torch.tensor(send_counts, dtype=torch.int32),
            torch.repeat_interleave(torch.arange(R, dtype=torch.int32), torch.tensor(recv_counts)),
            recv_src_idx,
            is_token_in_rank,
            send_head,
        )
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def _unpack_handle(self, handle: tuple) -> tuple[list[int], list[int], int, torch.Tensor]:
        ep_assert(isinstance(handle, tuple) and len(handle) == 6, "a dispatch handle")
        recv_counts = [int(c) for c in handle[0].tolist()]
        send_counts = [int(c) for c in handle[1].tolist()]
        return recv_counts, send_counts, int(handle[3].size(0)), handle[5]

    def _cached_dispatch(
        self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, send_counts, rows, send_head = self._unpack_handle(handle)
        ep_assert(send_head.size(0) == x.size(0), "x has the handle's T rows")
        order = [send_head[:, r].ge(0).nonzero().flatten() for r in range(self.group_size)]
        sel = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
        fields, specs = [x[sel]], [(x.dtype, (x.size(1),))]
        if x_scales is not None:
            fields.append(x_scales[sel])
            specs.append((x_scales.dtype, (x_scales.size(1),)))
        recv, _ = exchange(pack(fields), send_counts, self.group)
        got = unpack(recv, specs)
        M = recv.shape[0]
        out = []
        for t in got:
            full = garbage((rows, *t.shape[1:]), t.dtype, x.device)
            full[:M] = t
            out.append(full)
        return out[0], (out[1] if x_scales is not None else None)

    # ----------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """``(combined_x [T, H] bf16, combined_topk_weights [T, k] fp32 | None, event)``: the
        unweighted sum over the ranks each token went to (fp32 accumulation, bf16 out)."""
        self._live()
        config = self.get_combine_config(self.group_size) if config is None else config
        self._check_kernel_ranks()
        ep_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        recv_counts, send_counts, rows, send_head = self._unpack_handle(handle)
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        ep_assert(x.dtype == torch.bfloat16, f"Unsupported type {x.dtype} (combine is bf16)")
        ep_assert(x.size(0) == rows, f"src_idx.size(0) == num_tokens ({rows} != {x.size(0)})")
        ep_assert((x.size(1) * x.element_size()) % 16 == 0, "(hidden * elem_size) % 16 == 0")
        self._check_nvl_bytes(config, x.size(1) * 2, 0, 0)
        self._check_rdma_bytes(config, x.size(1) * 2)
        event = self._event(previous_event, async_finish, allocate_on_comm_stream)
        M = sum(recv_counts)
        fields = [x[:M]]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [(x.dtype, (x.size(1),))]
        if topk_weights is not None:
            ep_assert(topk_weights.dtype == torch.float32, "topk_weights is float32")
            ep_assert(topk_weights.dim() == 2 and topk_weights.size(0) == rows, "weights rows")
            fields.append(topk_weights[:M])
            specs.append((torch.float32, (topk_weights.size(1),)))
        recv, got_counts = exchange(pack(fields), recv_counts, self.group)
        ep_assert(got_counts == send_counts, "rows come back along the handle")
        got = unpack(recv, specs)
        T = send_head.size(0)
        out = torch.zeros(T, x.size(1), dtype=torch.float32, device=x.device)
        out_w = None
        if topk_weights is not None:
            out_w = torch.zeros(T, topk_weights.size(1), dtype=torch.float32, device=x.device)
        start = 0
        for r in range(self.group_size):  # NOTE: sums in rank order, in fp32
            tokens = send_head[:, r].ge(0).nonzero().flatten()
            seg = slice(start, start + tokens.numel())
            out[tokens] += got[0][seg].float()
            if out_w is not None:
                out_w[tokens] += got[1][seg]
            start += tokens.numel()
        for b in bias if isinstance(bias, tuple) else (bias,):
            if b is not None:
                ep_assert(tuple(b.shape) == (T, x.size(1)), "bias is [T, H]")
                out += b.float()
        self._after_normal_kernel()
        return out.to(torch.bfloat16), out_w, event
