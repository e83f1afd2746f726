"""The low-latency (decode) kernels of the emulated ``deep_ep._C.Buffer``. TEST-ONLY.

Shape letters: T tokens (at most ``num_max`` per rank) · H hidden · E experts · R ranks ·
e = E / R · k top-k · cap = R * num_max rows per local expert.

Dispatch sends one row per ``(token, expert)`` pair and lays the rows out expert-major,
``[e, cap, H]``, with ``recv_count [e]`` real rows per expert and uninitialised rows after;
``src_info [e, cap]`` int32 holds each row's source token, ``layout_range [e, R]`` int64 packs
``(begin << 32) | count`` per source rank. Combine sends the rows back and reduces
``sum_j w[t, j] * row(t, idx[t, j])`` at the source (weighted, unlike the normal combine).

DeepEP's behaviours kept: the buffer must be cleaned after a normal kernel used it
(``ll.clean_after_normal``: otherwise the kernel reads stale signals — here a ``DeviceTrap``
saying the GPU would hang or read garbage); results live in one of two alternating buffers, so a
``return_recv_hook`` result is garbage once two more low-latency kernels ran (``ll.two_buffers``).
Ids are DeepEP's to trust: it indexes its per-expert send counters with them unchecked, and each
sender owns ``num_max`` receive slots per expert on the destination (``rank * num_max + slot``,
v1.2.1 internode_ll.cu:153-161), so an id >= E (an id < 0 is skipped, as DeepEP's
``dst_expert_idx >= 0``, :152) and a sender naming one expert more than ``num_max`` times (a
repeated id) are modelled as traps (``ll.expert_id_range``, ``ll.source_region``; on a GPU:
undefined behaviour and another source rank's rows overwritten).
The received rows are then packed per expert as DeepEP's receive warps pack them (the per-source
regions live in its RDMA buffer only).
Not emulated: UE8M0 / NVFP4 packing, LogFMT, zero-copy combine, overlap signals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import limits, transport
from .config import EventHandle, low_latency_layout_bytes

__all__ = ["LowLatencyKernels"]

_FP8_MAX = 448.0
_MAX_TOPK = 11  # internode_ll.cu: kNumMaxTopK


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


class LowLatencyKernels:
    """Low-latency half of the emulated runtime (uses ``Runtime``'s group and state)."""

    release: str
    group: Any
    rank: int
    num_ranks: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_rc_per_pe: int
    normal_dirty: bool
    ll_launches: int

    def _live(self) -> None:  # provided by Runtime
        raise NotImplementedError

    def clean_low_latency_buffer(self, num_max: int, hidden: int, num_experts: int) -> None:
        self._live()
        limits.host_assert(self.low_latency_mode, "ll.mode", self.release)
        with transport.kernel("clean_low_latency_buffer"):
            pass  # DeepEP zeroes its signal buffers and runs a barrier kernel
        self.normal_dirty = False

    def _ll_checks(self, num_max: int, hidden: int, num_experts: int, k: int) -> None:
        rel = self.release
        self._live()
        limits.host_assert(self.low_latency_mode, "ll.mode", rel)
        limits.host_assert(hidden % 128 == 0, "ll.hidden128", rel, f"H={hidden}")
        limits.host_assert(num_experts % self.num_ranks == 0, "ll.experts", rel)
        need = low_latency_layout_bytes(num_max, hidden, self.num_ranks, num_experts)
        limits.host_assert(need <= self.num_rdma_bytes, "ll.rdma_bytes", rel, f"{need} bytes")
        hidden_ok = hidden in self.shapes.low_latency_hidden  # type: ignore[attr-defined]
        limits.host_assert(hidden_ok, "launch.hidden", rel, f"H={hidden}")
        e = num_experts // self.num_ranks
        limits.device_trap(self.num_rc_per_pe >= e, "ll.qps", rel, f"{self.num_rc_per_pe} < {e}")
        limits.device_trap(k <= _MAX_TOPK, "ll.topk_max", rel, f"k={k}")
        limits.device_trap(
            not self.normal_dirty,
            "ll.clean_after_normal",
            rel,
            "a normal kernel used the buffer and clean_low_latency_buffer did not run",
        )

    def _deferred(self, fill: Callable[[bool], None], hook: bool) -> Callable[[], None] | None:
        launch = self.ll_launches
        if not hook:
            fill(True)
            return None

        def recv_hook() -> None:
            fill(self.ll_launches < launch + 2)

        return recv_hook

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        cumulative_local_expert_recv_stats: torch.Tensor | None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None,
        x_global_scale: torch.Tensor | None,
        num_max: int,
        num_experts: int,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        use_nvfp4: bool,
        async_: bool,
        return_recv_hook: bool,
    ) -> tuple:
        rel, R = self.release, self.num_ranks
        limits.host_assert(x.dim() == 2 and x.is_contiguous() and x.size(0) <= num_max, "ll.x", rel)
        limits.host_assert(x.dtype == torch.bfloat16, "ll.x_dtype", rel, f"{x.dtype}")
        limits.host_assert(topk_idx.dtype == torch.int64, "ll.topk_dtype", rel)
        limits.host_assert(not (async_ and return_recv_hook), "ll.async_hook", rel)
        limits.host_assert((R * num_max) % 4 == 0, "ll.tma_tokens", rel, f"R*num_max={R * num_max}")
        H = x.shape[1]
        k = topk_idx.size(1)
        self._ll_checks(num_max, H, num_experts, k)
        if use_ue8m0 or use_nvfp4 or x_global_scale is not None:
            raise NotImplementedError("the emulated runtime does not pack UE8M0 / NVFP4 scales")
        del dispatch_wait_recv_cost_stats
        e, cap = num_experts // R, R * num_max
        self.ll_launches += 1
        bad = topk_idx >= num_experts  # NOTE: ids < 0 are skipped (dst_expert_idx >= 0, :152)
        limits.device_trap(
            not bool(bad.any()),
            "ll.expert_id_range",
            rel,
            f"{int(bad.sum())} id(s) >= E={num_experts}, e.g. {int(topk_idx[bad][0])}"
            if bool(bad.any())
            else "",
        )
        t_idx, s_idx = (topk_idx >= 0).nonzero(as_tuple=True)
        gid = topk_idx[t_idx, s_idx]
        # per-source receive regions: this sender owns num_max slots of each expert's region on
        # its destination (rank * num_max + slot); the slot is its count of pairs so far
        per_expert = torch.bincount(gid, minlength=num_experts)
        over = per_expert > num_max
        limits.device_trap(
            not bool(over.any()),
            "ll.source_region",
            rel,
            f"rank {self.rank} sends {int(per_expert.max())} pairs to expert "
            f"{int(per_expert.argmax())}, past its num_max={num_max} slots"
            if bool(over.any())
            else "",
        )
        dest = gid // e
        order = torch.argsort(dest, stable=True)
        t_idx, gid, dest = t_idx[order], gid[order], dest[order]
        send_counts = torch.bincount(dest, minlength=R).tolist()
        fields = [
            (gid % e).to(torch.int32).view(-1, 1),
            t_idx.to(torch.int32).view(-1, 1),
            x[t_idx],
        ]
        specs = [(torch.int32, (1,)), (torch.int32, (1,)), (x.dtype, (H,))]
        with transport.kernel("low_latency_dispatch"):
            recv, recv_counts = transport.exchange(transport.pack(fields), send_counts, self.group)
        loc, tok, rows = transport.unpack(recv, specs)
        loc, tok = loc.view(-1), tok.view(-1)
        src = torch.repeat_interleave(torch.arange(R), torch.tensor(recv_counts))
        counts = torch.zeros(e, dtype=torch.int32)
        layout_range = torch.zeros(e, R, dtype=torch.int64)
        src_info = transport.garbage((e, cap), torch.int32, x.device)
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
            cumulative_local_expert_recv_stats += counts
        scales = None
        if use_fp8:
            recv_x = transport.garbage((e, cap, H), torch.float8_e4m3fn, x.device)
            scales = transport.garbage((e, H // 128, cap), torch.float32, x.device).transpose(1, 2)
        else:
            recv_x = transport.garbage((e, cap, H), torch.bfloat16, x.device)

        def fill(intact: bool) -> None:
            data = rows if intact else torch.full_like(rows, float("nan"))
            if use_fp8:
                q, scale = _quantize(data, round_scale)
                recv_x[loc.long(), pos] = q
                assert scales is not None
                scales[loc.long(), pos] = scale
            else:
                recv_x[loc.long(), pos] = data

        hook = self._deferred(fill, return_recv_hook)
        event = EventHandle() if async_ else None
        return recv_x, scales, counts, src_info, layout_range, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        src_info: torch.Tensor,
        layout_range: torch.Tensor,
        combine_wait_recv_cost_stats: torch.Tensor | None,
        num_max: int,
        num_experts: int,
        use_logfmt: bool,
        zero_copy: bool,
        async_: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
        overlap: bool = False,
        src_signals: torch.Tensor | None = None,
        src_signal_expect_value: int = 0,
    ) -> tuple:
        rel, R = self.release, self.num_ranks
        e = num_experts // R
        H = x.size(-1)
        k = topk_idx.size(1)
        self._ll_checks(num_max, H, num_experts, k)
        if use_logfmt or zero_copy or overlap:
            raise NotImplementedError("the emulated runtime has no LogFMT / zero-copy / overlap")
        del combine_wait_recv_cost_stats, src_signals, src_signal_expect_value
        limits.host_assert(
            x.dtype == torch.bfloat16
            and x.is_contiguous()
            and tuple(x.shape) == (e, R * num_max, H),
            "ll.combine_x",
            rel,
        )
        T = topk_idx.size(0)
        limits.host_assert(
            topk_weights.dtype == torch.float32
            and tuple(topk_weights.shape) == tuple(topk_idx.shape)
            and num_max >= T,
            "ll.combine_weights",
            rel,
        )
        limits.host_assert(not (async_ and return_recv_hook), "ll.async_hook", rel)
        result = out if out is not None else torch.empty(T, H, dtype=torch.bfloat16)
        limits.host_assert(
            tuple(result.shape) == (T, H) and result.dtype == x.dtype, "ll.combine_out", rel
        )
        self.ll_launches += 1
        send_rows, send_meta, send_counts = [], [], []
        for s in range(R):
            n_s = 0
            for j in range(e):
                packed = int(layout_range[j, s])
                begin, n = packed >> 32, packed & 0xFFFFFFFF
                send_rows.append(x[j, begin : begin + n])
                ids = torch.full((n,), self.rank * e + j, dtype=torch.int64)
                send_meta.append(torch.stack([src_info[j, begin : begin + n].long(), ids], 1))
                n_s += n
            send_counts.append(n_s)
        fields = [torch.cat(send_meta), torch.cat(send_rows)]
        with transport.kernel("low_latency_combine"):
            recv, _ = transport.exchange(transport.pack(fields), send_counts, self.group)
        meta, rows = transport.unpack(recv, [(torch.int64, (2,)), (torch.bfloat16, (H,))])

        def fill(intact: bool) -> None:
            acc = torch.zeros(T, H, dtype=torch.float32)
            if meta.numel():
                t, g = meta[:, 0], meta[:, 1]
                w = (topk_idx[t] == g.view(-1, 1)).float() * topk_weights[t]
                acc.index_add_(0, t, w.sum(1, keepdim=True) * rows.float())
            result.copy_(acc if intact else torch.full_like(acc, float("nan")))

        hook = self._deferred(fill, return_recv_hook)
        event = EventHandle() if async_ else None
        return result, event, hook

    def get_next_low_latency_combine_buffer(self, *_: Any) -> Any:
        raise NotImplementedError("the emulated runtime has no zero-copy combine buffer")
