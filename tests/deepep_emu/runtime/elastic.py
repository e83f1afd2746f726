"""The emulated ``deep_ep._C.ElasticBuffer`` (DeepEP V2), direct (non-hybrid) mode. TEST-ONLY.

Shape letters: T tokens · H hidden · E experts · R ranks · e = E / R local experts · k top-k ·
M = ``num_max_tokens_per_rank`` · a = ``expert_alignment`` · n received rows.

Positional signatures and return tuples are those ``deep_ep/buffers/elastic.py`` (DeepEP 2.1.0,
commit dd758caf) calls: the 14-argument constructor, ``dispatch`` (29 arguments, a 16-tuple),
``combine`` (18 arguments, a 3-tuple). Host asserts and device traps go through ``limits``
(``elastic.*`` ids, each citing its line in ``csrc/elastic/buffer.hpp``, ``layout.cuh`` or the
JIT kernels under ``deep_ep/include/deep_ep/impls``; a JIT ``EP_STATIC_ASSERT`` surfaces on a
GPU as the host assert "NVCC compilation failed", so it is a host limit here).

What the kernels do, as DeepEP does it (direct mode: one scale-out rank, R scale-up ranks):

- dispatch sends one row per (token, destination rank), whatever the number of its experts
  there. Non-expand: ``recv_x [n, H]`` grouped by source rank (rank order; inside a group the
  order of the sender's receive slots, which DeepEP assigns atomically and the emulator shuffles,
  ``ATOMIC_ORDER``),
  ``recv_topk_idx`` local ids or -1, ``recv_topk_weights`` the sender's row unchanged.
  Expand: one row per (token, local expert), expert ``i`` at ``[start_i, start_i + count_i)``
  with ``start_i = sum_{j<i} align(count_j, a)``; padding uninitialised unless
  ``do_zero_padding``; ``recv_topk_idx`` None, ``recv_topk_weights [N]``.
- ``recv_src_metadata [num_recv_tokens, k + 2]`` int32: ``src_rank * M + token``, ``src_rank * k
  + first local slot``, then (expand only; uninitialised otherwise) the expanded row of each slot
  or -1. ``dst_buffer_slot_idx [T, k]`` int32: ``rank * M + slot`` (this sender's region of the
  destination's receive buffer, I/dispatch.cuh:344-349) at the first slot of each destination
  rank, -1 elsewhere; slots in the shuffled order of the rows.
- ``do_cpu_sync=True``: exact sizes and the aligned per-expert count list. ``False``: ``R * M``
  rows (expand: ``align(R * M * min(k, e) + (a - 1) * e, a)``), tails uninitialised
  (``transport.garbage``), an empty list; the true sizes live in the psum tensors.
- cached dispatch (a handle): the handle's sizes, metadata and slots; no count exchange.
- combine is an unweighted sum over the ranks a token went to (expand: each rank first sums its
  slots in fp32 and, with ``allow_multiple_reduction``, rounds to bf16 before sending; without
  it every slot row travels and the source sums once), plus the biases, one bf16 rounding at the
  source. ``combined_topk_weights[t, j]`` is slot ``j``'s weight as the rank owning it holds it.

Not emulated: hybrid mode (scale-out ranks > 1: ``NotImplementedError``), CPU buffers / Engram,
PP, AGRS, streams (events are ``EventHandle`` stand-ins, kernels finish before returning), the
CPU busy-wait and its timeout, ``cumulative_local_expert_recv_stats`` beyond adding the counts.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import limits, memory, strict, transport
from .bounded import BoundedRuntime, NcclComms, expert_counts
from .config import EventHandle
from .nccl import FakeLibNccl

__all__ = [
    "ALIGNMENT",
    "DEVICE_SMS",
    "ElasticRuntime",
    "calculate_buffer_size",
    "install",
]

ALIGNMENT = 2 * 1024 * 1024  # symmetric::kNumAlignmentBytes (symmetric.hpp:16)
DEVICE_SMS = 132  # the emulated device (an H800/H100 SXM)
_MAX_CHANNELS = 1280  # ElasticBuffer::kNumMaxChannels (buffer.hpp:57-59)
ATOMIC_ORDER = True  # receive slots in a shuffled (atomic-like) order, as on a GPU


def _a(x: int, b: int = 32) -> int:
    return -(-x // b) * b


def _token_bytes(rel: str, hidden_bytes: int, sf_bytes: int, k: int, with_meta: bool) -> int:
    """``layout::TokenLayout::get_num_bytes<false>`` (layout.cuh:186-208), with its assert."""
    limits.host_assert(
        hidden_bytes % 32 == 0, "elastic.token_hidden_bytes", rel, f"{hidden_bytes} bytes"
    )
    meta = k * 8 + ((1 + k) * 4 if with_meta else 0)
    return _a(hidden_bytes) + _a(sf_bytes) + _a(meta)


def _dispatch_bytes(rel: str, M: int, hidden: int, packs: int, k: int, elem: int, R: int,
                    nvlink: bool) -> int:  # fmt: skip
    tok = _token_bytes(rel, hidden * elem, packs * 4, k, True)
    return (0 if nvlink else 1) * M * tok + R * M * tok


def _combine_bytes(rel: str, M: int, hidden: int, k: int, R: int, nvlink: bool,
                   amr: bool) -> int:  # fmt: skip
    tok = _token_bytes(rel, hidden * 2, 0, k, False)
    send = (0 if nvlink else R) * M * (1 if amr else k) * tok
    return send + (min(R, k) if amr else k) * M * tok


def _domains(rel: str, R: int, L: int) -> tuple[int, int]:
    nvl = min(L, R)
    limits.host_assert(R % nvl == 0, "elastic.nvl_ranks", rel, f"R={R}, NVLink domain {nvl}")
    return R // nvl, nvl


def calculate_buffer_size(
    rel: str, R: int, L: int, M: int, hidden: int, k: int, fp8: bool, hybrid: bool, amr: bool
) -> int:
    """``ElasticBuffer::calculate_buffer_size`` (buffer.hpp:651-686), direct case."""
    limits.host_assert(M > 0 and hidden > 0, "elastic.size_args", rel, f"M={M}, hidden={hidden}")
    limits.host_assert(math.ceil(hidden / 32) * 4 <= hidden, "elastic.size_sf", rel)
    k = 32 if k == 0 else k
    rdma, nvl = _domains(rel, R, L)
    if hybrid and rdma > 1:
        raise NotImplementedError("the emulated ElasticBuffer has no hybrid (scale-out) mode")
    nvlink = nvl == R
    d = _dispatch_bytes(rel, M, hidden, math.ceil(hidden / 32) if fp8 else 0, k,
                        1 if fp8 else 2, R, nvlink)  # fmt: skip
    c = _combine_bytes(rel, M, hidden, k, R, nvlink, amr)
    return _a(max(d, c), ALIGNMENT)


def _garbage_sf(n: int, packs: int, dtype: torch.dtype, col_major: bool) -> torch.Tensor:
    if not col_major:
        return transport.garbage((n, packs), dtype)
    return transport.garbage((packs, _a(n, 4)), dtype).t()[:n]


class ElasticRuntime(BoundedRuntime):
    """``_C.ElasticBuffer(rank_idx, num_ranks, nccl_comm, cpu_comm, num_bytes, num_cpu_bytes,
    allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx,
    num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy)`` over the
    gloo group ``ElasticBuffer.__init__`` handed to ``check_nvlink_connections`` (recorded by the
    loader's patch in ``module.pending_group``)."""

    def __init__(
        self,
        module: Any,
        rank_idx: int,
        num_ranks: int,
        nccl_comm: int,
        cpu_comm: list,
        num_bytes: int,
        num_cpu_bytes: int,
        allow_hybrid_mode: bool,
        allow_multiple_reduction: bool,
        prefer_overlap_with_compute: bool,
        sl_idx: int,
        num_allocated_qps: int,
        num_cpu_timeout_secs: int,
        num_gpu_timeout_secs: int,
        explicitly_destroy: bool,
    ) -> None:
        self.release: str = module.EMULATED_RELEASE
        self.module = module
        self.calls = 0
        strict.alloc(module, module.EMULATED_RELEASE, "ElasticBuffer")
        group = self.take_group(module, "deep_ep._C.ElasticBuffer")
        rel = self.release
        limits.host_assert(
            num_bytes > 0 and num_bytes % ALIGNMENT == 0,
            "elastic.buffer_bytes",
            rel,
            str(num_bytes),
        )
        if num_cpu_bytes:
            raise NotImplementedError("the emulated ElasticBuffer has no CPU buffer (Engram)")
        self.device_comm(module, num_ranks, allow_hybrid_mode, rel, v25=False)
        memory.allocate(module, num_bytes, "ncclMemAlloc")  # before the window registration
        self.group = group
        self.rank, self.num_ranks = rank_idx, num_ranks
        self.num_bytes = num_bytes
        self.amr = allow_multiple_reduction
        self.rdma, self.nvl = _domains(rel, num_ranks, module.NUM_MAX_NVL_PEERS)
        if allow_hybrid_mode and self.rdma > 1:
            raise NotImplementedError("the emulated ElasticBuffer has no hybrid (scale-out) mode")
        self.nvlink = num_ranks == self.nvl
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False

    # ----------------------------------------------------------------- set-up
    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.rdma, self.nvl

    def get_logical_domain_size(self) -> tuple[int, int]:
        return 1, self.num_ranks

    def destroy(self) -> None:
        if not self.destroyed:
            memory.release(self.module, self.num_bytes)
        self.destroyed = True

    def barrier(self, use_comm_stream: bool, with_cpu_sync: bool, sequential: bool) -> None:
        with transport.kernel("elastic_barrier"):
            transport.barrier(self.group)

    def get_comm_stream(self) -> Any:
        raise NotImplementedError("the emulated runtime has no CUDA streams")

    # ----------------------------------------------------------------- dispatch
    def _slot_order(
        self,
        parts: list[torch.Tensor],
        dest: torch.Tensor,
        cached_slots: torch.Tensor | None,
        M: int,
    ) -> list[torch.Tensor]:
        """The order of each destination's tokens in its receive slots.

        DeepEP assigns a sender's slots at a destination with ``atomicAdd`` across warps
        (I/dispatch.cuh:344-349): not token order. The emulator shuffles each destination's
        tokens (seeded by rank and call number, so runs repeat) unless ``ATOMIC_ORDER`` is off;
        a cached dispatch reuses the handle's slots, so it keeps the first dispatch's order.
        """
        if cached_slots is not None:
            out = []
            for d, part in enumerate(parts):
                pos = torch.where(dest == d, cached_slots.to(torch.int64), -1).amax(1)
                out.append(part[torch.argsort(pos[part])])
            return out
        if not ATOMIC_ORDER:
            return parts
        g = self.gen()
        return [p[torch.randperm(p.numel(), generator=g)] for p in parts]

    def dispatch(
        self,
        x: torch.Tensor,
        sf: torch.Tensor | None,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        cumulative_local_expert_recv_stats: torch.Tensor | None,
        cached_num_recv_tokens: int | None,
        cached_num_expanded_tokens: int | None,
        cached_num_recv_tokens_per_expert_list: list | None,
        cached_psum_num_recv_tokens_per_scaleup_rank: torch.Tensor | None,
        cached_psum_num_recv_tokens_per_expert: torch.Tensor | None,
        cached_num_unaligned_recv_tokens_per_expert: torch.Tensor | None,
        cached_dst_buffer_slot_idx: torch.Tensor | None,
        cached_token_metadata_at_forward: torch.Tensor | None,
        cached_recv_src_metadata: torch.Tensor | None,
        cached_channel_linked_list: torch.Tensor | None,
        num_max_tokens_per_rank: int,
        num_experts: int,
        expert_alignment: int,
        num_sms: int,
        num_qps: int,
        previous_event: Any,
        previous_event_before_epilogue: Any,
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        do_handle_copy: bool,
        do_cpu_sync: bool,
        do_expand: bool,
        do_zero_padding: bool,
        use_tma_aligned_col_major_sf: bool,
    ) -> tuple:
        rel, R, me, M = self.release, self.num_ranks, self.rank, num_max_tokens_per_rank
        limits.host_assert(num_sms > 0, "elastic.num_sms", rel, f"num_sms={num_sms}")
        limits.host_assert(not do_zero_padding or do_expand, "elastic.zero_padding", rel)
        cached = cached_recv_src_metadata is not None
        if cached:
            for v in (
                cached_num_recv_tokens,
                cached_num_recv_tokens_per_expert_list,
                cached_num_expanded_tokens,
                cached_psum_num_recv_tokens_per_scaleup_rank,
                cached_psum_num_recv_tokens_per_expert,
                cached_dst_buffer_slot_idx,
            ):
                limits.host_assert(v is not None, "elastic.cached_fields", rel)
        if x.dim() != 2:
            raise RuntimeError(f"Failed: Assertion error t.dim() == N (x has {x.dim()} dims)")
        T, H = x.shape
        limits.host_assert(x.is_contiguous(), "elastic.x", rel)
        limits.host_assert((H * x.element_size()) % 16 == 0, "elastic.row_int4", rel, f"H={H}")
        limits.host_assert(T <= M, "elastic.num_max", rel, f"{T} tokens > {M}")
        packs = 0
        if sf is not None:
            limits.host_assert(
                sf.dim() == 2 and sf.size(0) == T and sf.element_size() == 4, "elastic.sf", rel
            )
            packs = sf.size(1)
        limits.host_assert(
            topk_idx.dim() == 2
            and topk_idx.size(0) == T
            and topk_idx.dtype == torch.int64
            and topk_idx.is_contiguous(),
            "elastic.topk",
            rel,
        )
        k = topk_idx.size(1)
        if topk_weights is not None:
            limits.host_assert(
                topk_weights.dim() == 2
                and topk_weights.size(0) == T
                and topk_weights.is_contiguous(),
                "elastic.weights",
                rel,
            )
            if topk_weights.dtype != torch.float32:
                raise RuntimeError(f"expected scalar type Float but found {topk_weights.dtype}")
        limits.host_assert(num_experts % R == 0, "elastic.experts_div", rel, f"E={num_experts}")
        e = num_experts // R
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            limits.host_assert(
                stats.dim() == 1 and stats.numel() == e and stats.dtype == torch.int32,
                "elastic.stats",
                rel,
            )
        if cached:
            assert cached_dst_buffer_slot_idx is not None
            limits.host_assert(
                tuple(cached_dst_buffer_slot_idx.shape) == (T, k), "elastic.cached_slots", rel
            )
        need = _dispatch_bytes(rel, M, H, packs, k, x.element_size(), R, self.nvlink)
        limits.host_assert(
            need <= self.num_bytes, "elastic.dispatch_buffer", rel, f"{need} > {self.num_bytes}"
        )
        limits.host_assert(e <= 256, "elastic.local_experts", rel, f"{e} local experts")
        limits.host_assert(num_sms <= DEVICE_SMS, "elastic.device_sms", rel, f"{num_sms}")
        limits.host_assert(k <= 32, "elastic.topk_max", rel, f"k={k}")
        if cached:
            limits.host_assert(stats is None, "elastic.cached_stats", rel)
        else:
            strict.check_elastic_ids(rel, topk_idx, num_experts, R)
        key = (do_cpu_sync, cached, H * x.element_size(), packs, M, num_experts, k)
        strict.jit(self.module, rel, ("dispatch", *key, expert_alignment, num_sms, do_expand))
        self.check_gin_contexts(self.rdma, "elastic")
        a = expert_alignment
        with transport.kernel("elastic_dispatch"):
            dest, sel_parts = self.dest_parts(topk_idx, e)
            sel_parts = self._slot_order(sel_parts, dest, cached_dst_buffer_slot_idx, M)
            known = None
            if cached:
                psum = cached_psum_num_recv_tokens_per_scaleup_rank
                assert psum is not None
                col = psum.to(torch.int64)
                known = torch.diff(col, prepend=col.new_zeros(1)).tolist()
            rows, recv_counts = self.send_rows(x, sf, topk_idx, topk_weights, sel_parts, M, known)
            r_x, r_src, r_idx, r_sf, r_w = (rows[f] for f in ("x", "src", "idx", "sf", "w"))
            n = r_x.shape[0]
            in_range = (r_idx >= me * e) & (r_idx < (me + 1) * e)
            local = torch.where(in_range, r_idx - me * e, -1)
            self.trap_duplicates(local, "elastic.duplicate_experts", rel)
            counts = expert_counts(local, e)
            aligned = (counts + a - 1) // a * a
            starts = torch.cumsum(aligned, 0) - aligned
            if stats is not None and not cached:
                stats += counts.to(stats.dtype)
            if cached:
                assert cached_num_recv_tokens is not None and cached_num_expanded_tokens is not None
                num_recv, num_exp = cached_num_recv_tokens, cached_num_expanded_tokens
                count_list = cached_num_recv_tokens_per_expert_list
            elif do_cpu_sync:
                num_recv, num_exp = n, int(aligned.sum())
                count_list = [int(c) for c in aligned.tolist()]
            else:
                num_recv = R * M
                num_exp = _a(R * M * min(k, e) + (a - 1) * e, a)
                count_list = []
            N = num_exp if do_expand else num_recv
            recv_x = transport.garbage((N, H), x.dtype)
            recv_sf = (
                _garbage_sf(N, packs, sf.dtype, use_tma_aligned_col_major_sf)
                if sf is not None
                else None
            )
            recv_topk_idx = None
            recv_topk_weights = None
            master = torch.where(in_range, torch.arange(k).expand(n, k), k).min(1).values
            src_rank = torch.repeat_interleave(torch.arange(R), torch.tensor(recv_counts))
            if cached:
                meta = cached_recv_src_metadata
                assert meta is not None
            else:
                meta = transport.garbage((num_recv, k + 2), torch.int32)
                meta[:n, 0] = r_src
                meta[:n, 1] = (src_rank * k + master).to(torch.int32)
            if not do_expand:
                recv_x[:n] = r_x
                if r_sf is not None:
                    assert recv_sf is not None
                    recv_sf[:n] = r_sf
                recv_topk_idx = transport.garbage((N, k), torch.int64)
                recv_topk_idx[:n] = local
                if r_w is not None:
                    recv_topk_weights = transport.garbage((N, k), torch.float32)
                    recv_topk_weights[:n] = r_w
                psum_exp = torch.cumsum(aligned, 0).to(torch.int32)
            else:
                if cached:
                    dst = meta[:n, 2:].to(torch.int64)
                else:
                    dst = self.expand_slots(local, starts, e, None)
                    meta[:n, 2:] = dst.to(torch.int32)
                ok = dst >= 0
                row_of = torch.arange(n).view(n, 1).expand(n, k)[ok]
                recv_x[dst[ok]] = r_x[row_of]
                if r_sf is not None:
                    assert recv_sf is not None
                    recv_sf[dst[ok]] = r_sf[row_of]
                if r_w is not None:
                    recv_topk_weights = transport.garbage((N,), torch.float32)
                    recv_topk_weights[dst[ok]] = r_w[ok]
                if do_zero_padding:
                    pads = [recv_x, recv_sf, recv_topk_weights]
                    self.zero_padding(pads, starts, counts, aligned)
                psum_exp = (starts + counts).to(torch.int32)
            if cached:
                assert cached_psum_num_recv_tokens_per_expert is not None
                psum_su = cached_psum_num_recv_tokens_per_scaleup_rank
                psum_exp = cached_psum_num_recv_tokens_per_expert
                unaligned = cached_num_unaligned_recv_tokens_per_expert
                slots = cached_dst_buffer_slot_idx
                cloned = None
            else:
                psum_su = torch.tensor(recv_counts, dtype=torch.int64).cumsum(0).to(torch.int32)
                unaligned = counts.to(torch.int32)
                slots = self.direct_slots(topk_idx, e, sel_parts, M)
                cloned = topk_idx.clone() if do_handle_copy else None
        event = EventHandle() if async_with_compute_stream else None
        return (
            recv_x,
            recv_sf,
            recv_topk_idx,
            recv_topk_weights,
            cloned,
            num_recv,
            num_exp,
            count_list,
            psum_su,
            psum_exp,
            unaligned,
            meta,
            slots,
            None,
            None,
            event,
        )

    # ----------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        bias_0: torch.Tensor | None,
        bias_1: torch.Tensor | None,
        src_metadata: torch.Tensor,
        combined_topk_idx: torch.Tensor,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        token_metadata_at_forward: torch.Tensor | None,
        channel_linked_list: torch.Tensor | None,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        num_qps: int,
        previous_event: Any,
        previous_event_before_epilogue: Any,
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        use_expanded_layout: bool,
    ) -> tuple:
        rel, R, M = self.release, self.num_ranks, num_max_tokens_per_rank
        expand = use_expanded_layout
        limits.host_assert(num_sms > 0, "elastic.combine_num_sms", rel, f"num_sms={num_sms}")
        if x.dim() != 2:
            raise RuntimeError(f"Failed: Assertion error t.dim() == N (x has {x.dim()} dims)")
        Nx, H = x.shape
        limits.host_assert(
            x.is_contiguous() and x.dtype == torch.bfloat16, "elastic.combine_x", rel, str(x.dtype)
        )
        T, k = combined_topk_idx.shape
        limits.host_assert(T <= M, "elastic.combine_num_max", rel, f"{T} tokens > {M}")
        n_meta = src_metadata.shape[0]
        limits.host_assert(expand or n_meta == Nx, "elastic.combine_rows", rel, f"{Nx} != {n_meta}")
        if topk_weights is not None:
            want = (Nx,) if expand else (Nx, k)
            limits.host_assert(
                tuple(topk_weights.shape) == want
                and topk_weights.dtype == torch.float32
                and topk_weights.is_contiguous(),
                "elastic.combine_weights",
                rel,
                f"{tuple(topk_weights.shape)} != {want}",
            )
        for b in (bias_0, bias_1):
            if b is not None:
                limits.host_assert(
                    b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype
                    and tuple(b.shape) == (T, H),
                    "elastic.combine_bias",
                    rel,
                )  # fmt: skip
        need = _combine_bytes(rel, M, H, k, R, self.nvlink, self.amr)
        limits.host_assert(
            need <= self.num_bytes, "elastic.combine_buffer", rel, f"{need} > {self.num_bytes}"
        )
        limits.host_assert(H % 256 == 0, "elastic.combine_hidden", rel, f"H={H}")
        if expand and not self.amr:
            limits.device_trap(topk_weights is None, "elastic.expand_weights", rel)
        weights = topk_weights is not None
        strict.jit(self.module, rel, ("combine", H, k, M, num_sms, weights, expand))
        self.check_gin_contexts(self.rdma, "elastic")
        with transport.kernel("elastic_combine"):
            got = self.combine_send(
                x,
                topk_weights,
                src_metadata,
                combined_topk_idx,
                psum_num_recv_tokens_per_scaleup_rank,
                num_experts,
                M,
                expand,
                self.amr,
            )
            out = torch.zeros(T, H, dtype=torch.float32)
            out.index_add_(0, got["tok"], got["vals"])
            for b in (bias_0, bias_1):
                if b is not None:
                    out += b.float()
            combined = out.to(torch.bfloat16)
            combined_w = None
            if topk_weights is not None:
                combined_w = self.combine_weights(got, T, k)
        event = EventHandle() if async_with_compute_stream else None
        return combined, combined_w, event


def install(mod: Any) -> None:
    """Add ``ElasticBuffer`` and the V2 module functions to the emulated ``_C`` module ``mod``."""
    comms = NcclComms(0x1000)
    rel, L = mod.EMULATED_RELEASE, mod.NUM_MAX_NVL_PEERS
    _size = comms.size

    class ElasticBuffer(ElasticRuntime):
        def __init__(self, *args: Any) -> None:
            super().__init__(mod, *args)

    def get_physical_domain_size(nccl_comm: int) -> tuple[int, int]:
        return _domains(rel, _size(nccl_comm), L)

    def get_logical_domain_size(nccl_comm: int, allow_hybrid_mode: bool) -> tuple[int, int]:
        rdma, nvl = _domains(rel, _size(nccl_comm), L)
        return (rdma, nvl) if allow_hybrid_mode else (1, rdma * nvl)

    def calculate_elastic_buffer_size(
        nccl_comm: int,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        use_fp8_dispatch: bool,
        allow_hybrid_mode: bool,
        allow_multiple_reduction: bool,
    ) -> int:
        return calculate_buffer_size(
            rel, _size(nccl_comm), L, num_max_tokens_per_rank, hidden, num_topk,
            use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction,
        )  # fmt: skip

    # the network NCCL finds (GDAKI by default; a test sets a GIN type to 0 = NONE, as DeepEP
    # #629's single B300 node): what ncclCommQueryProperties reports follows from it (nccl.py)
    mod.emu_gin = {"ginType": 3, "railedGinType": 3, "gdaki": True, "all_p2p": True}
    mod.emu_nccl = FakeLibNccl(mod, "v2")
    mod.ElasticBuffer = ElasticBuffer
    comms.install(mod)
    mod.get_physical_domain_size = get_physical_domain_size
    mod.get_logical_domain_size = get_logical_domain_size
    mod.calculate_elastic_buffer_size = calculate_elastic_buffer_size
    mod.get_elastic_buffer_alignment = lambda: ALIGNMENT
