"""Emulated low-latency (decode) kernels of ``deep_ep.Buffer``. TEST-ONLY.

Shape letters: T tokens (at most ``num_max`` per rank) · H hidden · E experts · R ranks ·
e = E / R · k top-k · cap = R * num_max rows per local expert.

Dispatch sends one row per ``(token, expert)`` pair (not per rank) and lays the rows out
expert-major, ``[e, cap, H]``, with ``recv_count [e]`` real rows per expert and garbage after.
Combine sends them back and reduces ``sum_j w[t, j] * row(t, idx[t, j])`` at the source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import _config as C
from ._config import ep_assert, low_latency_layout_bytes
from ._transport import exchange, garbage, pack, unpack
from .utils import EventHandle, EventOverlap

__all__ = ["LowLatencyMixin"]

_FP8_MAX = 448.0


def _quantize(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel fp8 e4m3 cast: ``([n, H] fp8, [n, H / 128] fp32 scales)``."""
    n, H = x.shape
    groups = x.float().reshape(n, H // 128, 128)
    amax = groups.abs().amax(-1).clamp(min=1e-4)
    scale = amax / _FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (groups / scale[..., None]).reshape(n, H).to(torch.float8_e4m3fn)
    return q, scale


class LowLatencyMixin:
    """The low-latency half of the emulated ``Buffer`` (uses its group and byte counts)."""

    group: dist.ProcessGroup
    rank: int
    group_size: int
    num_rdma_bytes: int
    low_latency_mode: bool
    _ll_dirty: bool
    _ll_launches: int

    def _live(self) -> None:  # provided by Buffer
        raise NotImplementedError

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Zero the low-latency buffer (collective); needed after normal kernels used it."""
        self._live()
        ep_assert(self.low_latency_mode, "low_latency_mode")
        dist.barrier(self.group)
        self._ll_dirty = False

    def _ll_checks(self, num_max: int, hidden: int, num_experts: int) -> None:
        self._live()
        ep_assert(self.low_latency_mode, "low_latency_mode")
        ep_assert(
            not self._ll_dirty,
            "(emulator) low-latency buffer is dirty after normal kernels: call "
            "clean_low_latency_buffer first (real DeepEP would hang or corrupt data)",
        )
        ep_assert(hidden in C.LOW_LATENCY_HIDDEN_SIZES, f"Unsupported hidden ({hidden})")
        ep_assert(num_experts % self.group_size == 0, "num_experts % num_ranks == 0")
        need = low_latency_layout_bytes(num_max, hidden, self.group_size, num_experts)
        ep_assert(need <= self.num_rdma_bytes, f"{need} RDMA bytes <= {self.num_rdma_bytes}")

    def _launch(self) -> int:
        # NOTE: DeepEP alternates two buffers; launch n + 2 reuses launch n's buffer.
        self._ll_launches += 1
        return self._ll_launches

    def _deferred(
        self, fill: Callable[[bool], None], return_recv_hook: bool
    ) -> Callable[[], None] | None:
        launch = self._ll_launches
        if not return_recv_hook:
            fill(True)
            return None

        def hook() -> None:
            fill(self._ll_launches < launch + 2)

        return hook

    # ----------------------------------------------------------------- dispatch
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, tuple, EventOverlap, Callable[[], None] | None]:
        """``(recv_x, recv_count [e] int32, handle, event, hook)``; ``recv_x`` is
        ``[e, cap, H]`` bf16, or ``([e, cap, H] fp8, [e, cap, H / 128] fp32)`` with fp8."""
        num_max, R = num_max_dispatch_tokens_per_rank, self.group_size
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        ep_assert(x.dtype == torch.bfloat16, "x.scalar_type() == torch::kBFloat16")
        T, H = x.shape
        self._ll_checks(num_max, H, num_experts)
        ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D contiguous")
        ep_assert(topk_idx.dtype == torch.int64, "topk_idx is int64")
        ep_assert(topk_idx.size(0) == T, "topk_idx has T rows")
        ep_assert(x.size(0) <= num_max, f"num_tokens ({T}) <= num_max_dispatch_tokens_per_rank")
        k = topk_idx.size(1)
        ep_assert(k <= C.LOW_LATENCY_MAX_TOPK, f"num_topk <= {C.LOW_LATENCY_MAX_TOPK}")
        ep_assert(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
        if use_ue8m0:
            assert round_scale, "UE8M0 SF requires `round_scale=True`"
            raise NotImplementedError("the DeepEP emulator does not pack UE8M0 scales")
        del dispatch_wait_recv_cost_stats
        e, cap = num_experts // R, R * num_max
        self._launch()
        # one row per (token, slot) with an expert, ordered by token then slot
        t_idx, s_idx = (topk_idx >= 0).nonzero(as_tuple=True)
        gid = topk_idx[t_idx, s_idx]
        dest = gid // e
        order = torch.argsort(dest, stable=True)
        t_idx, gid, dest = t_idx[order], gid[order], dest[order]
        send_counts = torch.bincount(dest, minlength=R).tolist()
        fields = [(gid % e).to(torch.int32), t_idx.to(torch.int32), x[t_idx]]
        recv, recv_counts = exchange(pack(fields), send_counts, self.group)
        loc, tok, rows = unpack(recv, [(torch.int32, ()), (torch.int32, ()), (x.dtype, (H,))])
        src = torch.repeat_interleave(torch.arange(R), torch.tensor(recv_counts))

        counts = torch.zeros(e, dtype=torch.int32)
        layout_range = torch.zeros(e, R, dtype=torch.int64)
        src_info = garbage((e, cap), torch.int32, x.device)
        pos = torch.zeros(len(loc), dtype=torch.int64)
        for j in range(e):  # expert-major; inside an expert by source rank, then token
            for s in range(R):
                mine = ((loc == j) & (src == s)).nonzero().flatten()
                begin = int(counts[j])
                pos[mine] = begin + torch.arange(mine.numel())
                layout_range[j, s] = (begin << 32) | mine.numel()
                counts[j] += mine.numel()
        src_info[loc.long(), pos] = tok
        if cumulative_local_expert_recv_stats is not None:
            ep_assert(
                cumulative_local_expert_recv_stats.dtype == torch.int32
                and cumulative_local_expert_recv_stats.numel() == e,
                "cumulative_local_expert_recv_stats is [e] int32",
            )
            cumulative_local_expert_recv_stats += counts

        if use_fp8:
            recv_x: Any = (
                garbage((e, cap, H), torch.float8_e4m3fn, x.device),
                garbage((e, H // 128, cap), torch.float32, x.device).transpose(1, 2),
            )
        else:
            recv_x = garbage((e, cap, H), torch.bfloat16, x.device)

        def fill(intact: bool) -> None:
            data = rows if intact else torch.full_like(rows, float("nan"))
            if use_fp8:
                q, scale = _quantize(data, round_scale)
                recv_x[0][loc.long(), pos] = q
                recv_x[1][loc.long(), pos] = scale
            else:
                recv_x[loc.long(), pos] = data

        hook = self._deferred(fill, return_recv_hook)
        handle = (src_info, layout_range, num_max, H, num_experts)
        event = EventOverlap(EventHandle() if async_finish else None)
        return recv_x, counts, handle, event, hook

    # ----------------------------------------------------------------- combine
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """``(combined_x [T, H] bf16, event, hook)``: ``sum_j w[t, j] * row(t, idx[t, j])``."""
        ep_assert(isinstance(handle, tuple) and len(handle) == 5, "a low-latency handle")
        src_info, layout_range, num_max, H, num_experts = handle
        R, e = self.group_size, num_experts // self.group_size
        self._ll_checks(num_max, H, num_experts)
        if use_logfmt or zero_copy:
            raise NotImplementedError("the DeepEP emulator has no LogFMT / zero-copy combine")
        del combine_wait_recv_cost_stats
        ep_assert(x.dtype == torch.bfloat16, "x.scalar_type() == torch::kBFloat16")
        ep_assert(x.is_contiguous() and tuple(x.shape) == (e, R * num_max, H), "x [e, cap, H]")
        ep_assert(topk_idx.dim() == 2 and topk_idx.dtype == torch.int64, "topk_idx [T, k] int64")
        ep_assert(topk_weights.dtype == torch.float32, "topk_weights is float32")
        ep_assert(topk_weights.shape == topk_idx.shape, "topk_weights is [T, k]")
        T = topk_idx.size(0)
        ep_assert(
            topk_idx.size(0) <= num_max, "num_combined_tokens <= num_max_dispatch_tokens_per_rank"
        )
        ep_assert(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
        self._launch()
        # rows go back to their source rank, tagged with (token, global expert)
        send_rows, send_meta, send_counts = [], [], []
        for s in range(R):
            for j in range(e):
                packed = int(layout_range[j, s])
                begin, n = packed >> 32, packed & 0xFFFFFFFF
                send_rows.append(x[j, begin : begin + n])
                ids = torch.full((n,), self.rank * e + j, dtype=torch.int64)
                send_meta.append(torch.stack([src_info[j, begin : begin + n].long(), ids], 1))
            send_counts.append(sum(r.shape[0] for r in send_rows[s * e : (s + 1) * e]))
        fields = [torch.cat(send_meta), torch.cat(send_rows)]
        recv, _ = exchange(pack(fields), send_counts, self.group)
        meta, rows = unpack(recv, [(torch.int64, (2,)), (torch.bfloat16, (H,))])
        result = out if out is not None else torch.empty(T, H, dtype=torch.bfloat16)
        ep_assert(tuple(result.shape) == (T, H) and result.dtype == torch.bfloat16, "out [T, H]")

        def fill(intact: bool) -> None:
            acc = torch.zeros(T, H, dtype=torch.float32)
            for (t, g), row in zip(meta.tolist(), rows, strict=True):
                for j in range(topk_idx.size(1)):
                    if int(topk_idx[t, j]) == g:
                        acc[t] += float(topk_weights[t, j]) * row.float()
            result.copy_(acc if intact else torch.full_like(acc, float("nan")))

        hook = self._deferred(fill, return_recv_hook)
        event = EventOverlap(EventHandle() if async_finish else None)
        return result, event, hook
