# ruff: noqa: E501  (a registry of DeepEP source lines: the texts and needles stay whole)
"""DeepEP V2.5's asserts and traps (``EPBuffer``) that the emulated runtime enforces. TEST-ONLY.

Release ``"2.5.0"`` is SGLang's wheel ``sgl-deep-ep-v25==0.1.0rc0`` (DeepEP 2.5, deepseek-ai/DeepEP
PR #763, the ``sgl-deepep-v25`` branch of sgl-project/DeepEP), which ships DeepEP's C++/CUDA source
beside its Python layer: every path below is relative to the installed ``deep_ep_v25/`` folder
(``csrc/...`` host code, ``include/deep_ep/...`` the JIT-compiled kernels). The registry joins
``limits.LIMITS`` (``limits`` turns each row into a ``Limit``: the same ``host_assert`` / ``device_trap``), and
``verify_wheel`` re-checks every citation against the installed wheel, which the test set-up
installs, so CI checks these citations (``tests/unit/test_deepep_ep_limits.py``).

Kinds as in ``limits``: ``host`` (``EP_HOST_ASSERT``, or a JIT ``EP_STATIC_ASSERT``: DeepJIT fails
the kernel build, a host exception at the first call), ``device`` (``EP_DEVICE_ASSERT`` /
out-of-bounds: the kernel traps) and ``behaviour`` (what the kernels do, e.g. compiling at first
use).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["EP_ROWS", "RELEASE", "WHEEL", "verify_wheel", "wheel_root"]

RELEASE = "2.5.0"
WHEEL = "sgl-deep-ep-v25==0.1.0rc0"

_B = "csrc/buffers/ep.hpp"
_CTX = "csrc/kernels/comm/context.cpp"
_KD = "csrc/kernels/ep/dispatch.hpp"
_KC = "csrc/kernels/ep/combine.hpp"
_I = "include/deep_ep/impls/ep/"
_WS = "include/deep_ep/layout/ep/workspace.cuh"
_TOK = "include/deep_ep/layout/ep/token.cuh"


Row = tuple[str, str, str, str, str, int]
"""``(id, kind, text, needle, path, line)``; ``limits`` turns each into a ``Limit``."""


def _L(id: str, kind: str, text: str, needle: str, path: str, line: int) -> Row:
    return (id, kind, text, needle, path, line)


EP_ROWS: list[Row] = [
    # ------------------------------------------------------------------ buffer and context
    _L(
        "ep.buffer_bytes",
        "host",
        "V2.5 EPBuffer: num_bytes > 0 and a multiple of 2 MiB (kNumAllocationAlignmentBytes)",
        "num_buffer_bytes > 0 and num_buffer_bytes % kNumAllocationAlignmentBytes == 0",
        _B,
        66,
    ),
    _L(
        "ep.lb_bytes",
        "host",
        "V2.5 EPBuffer: the load-balance region is >= 0 bytes and a multiple of 2 MiB",
        "num_lb_buffer_bytes >= 0",
        _B,
        67,
    ),
    _L(
        "ep.destroy_once",
        "host",
        "V2.5 EPBuffer.destroy() runs once",
        "EP_HOST_ASSERT(not destroyed);",
        _B,
        103,
    ),
    _L(
        "ep.previous_event",
        "host",
        "V2.5: previous_event needs allocate_on_comm_stream",
        "EP_HOST_ASSERT(allocate_on_comm_stream);",
        _B,
        142,
    ),
    _L(
        "ep.size_args",
        "host",
        "V2.5 size hint: num_max_tokens_per_rank > 0 and hidden > 0",
        "num_max_tokens_per_rank > 0 and hidden > 0",
        _B,
        254,
    ),
    _L(
        "ep.size_sf",
        "host",
        "V2.5 size hint: the worst-case scale bytes fit in the row (ceil(hidden / 32) * 4 <= hidden)",
        "math::ceil_div(hidden, 32) * sizeof(float) <= hidden",
        _B,
        257,
    ),
    _L(
        "ep.nvl_ranks",
        "host",
        "V2.5 domains: the group is a whole number of NVLink (NCCL LSA) domains",
        "num_ranks % num_nvl_ranks == 0",
        _CTX,
        55,
    ),
    _L(
        "ep.num_ranks",
        "host",
        "V2.5 context: 0 < num_ranks <= kNumMaxRanks (1024)",
        "num_ranks > 0 and num_ranks <= kNumMaxRanks",
        _CTX,
        94,
    ),
    _L(
        "ep.qps",
        "host",
        "V2.5 context: 0 < num_allocated_qps <= kNumMaxQPs (1024)",
        "num_allocated_qps > 0 and num_allocated_qps <= kNumMaxQPs",
        _CTX,
        95,
    ),
    _L(
        "ep.gin_type",
        "host",
        "V2.5 context: NCCL reports a GIN type for the communicator (the railed one in hybrid mode), unless EP_DISABLE_GIN is set — also on one node",
        "(allow_hybrid_mode ? props.railedGinType : props.ginType) != NCCL_GIN_TYPE_NONE and",
        _CTX,
        126,
    ),
    _L(
        "ep.gin_gdaki",
        "host",
        "V2.5 context: NCCL supports GDAKI for the communicator, unless EP_DISABLE_GIN is set",
        "props.ginSupport[NCCL_GIN_TYPE_GDAKI] and",
        _CTX,
        130,
    ),
    # ------------------------------------------------------------------ dispatch (host)
    _L(
        "ep.num_sms",
        "host",
        "V2.5 dispatch: 0 < num_sms <= the device's SM count",
        "num_sms > 0 and num_sms <= jit->device.get_num_sms()",
        _B,
        312,
    ),
    _L(
        "ep.hybrid_two_sms",
        "host",
        "V2.5 hybrid dispatch needs at least 2 SMs",
        "num_sms > 1 or context->num_scaleout_ranks == 1",
        _B,
        313,
    ),
    _L(
        "ep.zero_padding",
        "host",
        "V2.5 dispatch: do_zero_padding only with do_expand",
        "not do_zero_padding or do_expand",
        _B,
        317,
    ),
    _L(
        "ep.cached_fields",
        "host",
        "V2.5 cached dispatch: the handle's counts, prefix sums, slots and metadata are all given",
        "cached_num_recv_tokens_per_expert_list.has_value()",
        _B,
        323,
    ),
    _L(
        "ep.cached_hybrid_fields",
        "host",
        "V2.5 cached hybrid dispatch: the handle's forward metadata and linked list are given",
        "cached_token_metadata_at_forward.has_value()",
        _B,
        333,
    ),
    _L(
        "ep.x",
        "host",
        "V2.5 dispatch: x is a contiguous CUDA tensor",
        "x.is_cuda() and x.is_contiguous()",
        _B,
        342,
    ),
    _L(
        "ep.row_int4",
        "host",
        "V2.5 dispatch: a row is a multiple of 16 bytes",
        "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
        _B,
        343,
    ),
    _L(
        "ep.num_max",
        "host",
        "V2.5 dispatch: num_tokens <= num_max_tokens_per_rank",
        "num_tokens <= num_max_tokens_per_rank",
        _B,
        344,
    ),
    _L(
        "ep.sf_rows",
        "host",
        "V2.5 dispatch: the scales have one row per token",
        "EP_HOST_ASSERT(num_tokens == num_tokens_);",
        _B,
        353,
    ),
    _L(
        "ep.sf_pack",
        "host",
        "V2.5 dispatch: scales are 4-byte packs (fp32 or UE8M0x4)",
        "sf->element_size() == sizeof(sf_pack_t)",
        _B,
        355,
    ),
    _L(
        "ep.topk_rows",
        "host",
        "V2.5 dispatch: topk_idx has one row per token",
        "EP_HOST_ASSERT(num_tokens == num_tokens_);",
        _B,
        364,
    ),
    _L(
        "ep.topk_dtype",
        "host",
        "V2.5 dispatch: topk_idx is topk_idx_t (int64)",
        "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value",
        _B,
        365,
    ),
    _L(
        "ep.topk_contiguous",
        "host",
        "V2.5 dispatch: topk_idx is contiguous",
        "topk_idx.is_cuda() and topk_idx.is_contiguous()",
        _B,
        366,
    ),
    _L(
        "ep.weights_rows",
        "host",
        "V2.5 dispatch: topk_weights has one row per token",
        "EP_HOST_ASSERT(num_tokens == num_tokens__);",
        _B,
        372,
    ),
    _L(
        "ep.weights_contiguous",
        "host",
        "V2.5 dispatch: topk_weights is contiguous",
        "topk_weights->is_cuda() and topk_weights->is_contiguous()",
        _B,
        373,
    ),
    _L(
        "ep.stats",
        "host",
        "V2.5 dispatch: cumulative_local_expert_recv_stats has E / R entries",
        "num_local_experts == num_local_experts_",
        _B,
        383,
    ),
    _L(
        "ep.experts_div",
        "host",
        "V2.5 dispatch: num_experts % num_ranks == 0",
        "num_experts % context->num_ranks == 0",
        _B,
        394,
    ),
    _L(
        "ep.cached_psum_experts",
        "host",
        "V2.5 cached dispatch: the handle's per-expert prefix sum has E / R entries",
        "num_local_experts == num_local_experts_",
        _B,
        398,
    ),
    _L(
        "ep.cached_psum_ranks",
        "host",
        "V2.5 cached dispatch: the handle's per-scale-up-rank prefix sum has one entry per scale-up rank",
        "num_scaleup_ranks == context->num_scaleup_ranks",
        _B,
        427,
    ),
    _L(
        "ep.hybrid_max_sms",
        "host",
        "V2.5 hybrid dispatch: num_sms <= kNumMaxSMs (160)",
        "num_sms <= kNumMaxSMs",
        _B,
        442,
    ),
    _L(
        "ep.cached_slots",
        "host",
        "V2.5 cached direct dispatch: dst_buffer_slot_idx is [num_tokens, k] (the handle's T)",
        "num_tokens == num_tokens__ and num_topk == num_topk_",
        _B,
        463,
    ),
    _L(
        "ep.cached_slots_hybrid",
        "host",
        "V2.5 cached hybrid dispatch: dst_buffer_slot_idx is [channels, scale-out ranks, ceil(M / channels), k]",
        "num_channels == num_channels_ and context->num_scaleout_ranks == num_scaleout_ranks_",
        _B,
        485,
    ),
    _L(
        "ep.cached_forward_meta",
        "host",
        "V2.5 cached hybrid dispatch: token_metadata_at_forward has the handle's shape",
        "num_channels == num_channels_ and num_max_forwarded_tokens == num_max_forwarded_tokens_",
        _B,
        508,
    ),
    _L(
        "ep.cached_linked_list",
        "host",
        "V2.5 cached hybrid dispatch: channel_linked_list has the handle's shape",
        "d1_ == context->num_scaleout_ranks * num_max_tokens_per_channel + 1",
        _B,
        527,
    ),
    _L(
        "ep.dispatch_buffer",
        "host",
        "V2.5 dispatch: the dispatch layout of (num_max_tokens_per_rank, hidden, scales, k) fits num_bytes",
        "EP_HOST_ASSERT(get_dispatch_buffer_size(",
        _B,
        544,
    ),
    _L(
        "ep.max_ranks",
        "host",
        "V2.5 workspace layout: num_ranks <= kNumMaxRanks (1024)",
        "num_ranks <= kNumMaxRanks",
        _WS,
        44,
    ),
    _L(
        "ep.max_experts",
        "host",
        "V2.5 workspace layout: num_experts <= kNumMaxExperts (2048)",
        "num_experts <= EPSignals::kNumMaxExperts",
        _WS,
        45,
    ),
    _L(
        "ep.local_experts",
        "host",
        "V2.5 workspace layout: local experts (E / R) <= kNumMaxExpertsPerRank (512)",
        "num_experts_per_rank <= EPSignals::kNumMaxExpertsPerRank",
        _WS,
        46,
    ),
    _L(
        "ep.token_hidden_bytes",
        "host",
        "V2.5 token layout: hidden bytes are a multiple of kNumTMAAlignmentBytes (32)",
        "num_hidden_bytes % kNumTMAAlignmentBytes == 0",
        _TOK,
        29,
    ),
    _L(
        "ep.cached_stats",
        "host",
        "V2.5 cached dispatch: no cumulative_local_expert_recv_stats",
        "EP_HOST_ASSERT(cumulative_local_expert_recv_stats == nullptr);",
        _KD,
        57,
    ),
    _L(
        "ep.defer_dispatch",
        "host",
        "V2.5 dispatch: defer_epilogue needs async_with_compute_stream",
        "EP_HOST_ASSERT(async_with_compute_stream);",
        _B,
        773,
    ),
    # ------------------------------------------------------------------ dispatch (JIT and device)
    _L(
        "ep.topk_max",
        "host",
        "V2.5 dispatch kernel: kNumTopk <= 32 (EP_STATIC_ASSERT: DeepJIT fails the build, a host error at the first call)",
        'EP_STATIC_ASSERT(kNumTopk <= 32, "Insufficient lanes");',
        _I + "dispatch.cuh",
        92,
    ),
    _L(
        "ep.dispatch_threads",
        "host",
        "V2.5 direct dispatch kernel: num_ranks <= its threads ((4 notify + dispatch warps) * 32, the dispatch warps as many token rows as fit in shared memory, at most 28) (EP_STATIC_ASSERT)",
        "kNumRanks <= kNumThreads",
        _I + "dispatch.cuh",
        402,
    ),
    _L(
        "ep.dispatch_no_warps",
        "device",
        "V2.5 direct dispatch kernel with no dispatch warp (rows too wide to fit one in shared memory beside the notify counters): no token is ever sent and the receivers wait until the GPU timeout (the emulator traps)",
        "const auto token_stride = kNumDispatchWarps * kNumSMs;",
        _I + "dispatch.cuh",
        278,
    ),
    _L(
        "ep.hybrid_scaleout",
        "host",
        "V2.5 hybrid dispatch kernel: scale-out ranks (nodes) <= 32 (EP_STATIC_ASSERT)",
        'EP_STATIC_ASSERT(kNumScaleoutRanks <= 32, "Invalid number of scale-out ranks");',
        _I + "hybrid_dispatch.cuh",
        336,
    ),
    _L(
        "ep.hybrid_notify",
        "host",
        "V2.5 hybrid dispatch kernel: scale-up ranks + local experts <= 128 notify threads (EP_STATIC_ASSERT)",
        "kNumScaleupRanks + kNumExpertsPerRank <= kNumNotifyWarps * 32",
        _I + "hybrid_dispatch.cuh",
        261,
    ),
    _L(
        "ep.hybrid_dispatch_scaleup",
        "host",
        "V2.5 hybrid dispatch kernel: scale-up ranks <= 64 (EP_STATIC_ASSERT)",
        'EP_STATIC_ASSERT(kNumScaleupRanks <= 64, "Invalid number of scale-up peers");',
        _I + "hybrid_dispatch.cuh",
        600,
    ),
    _L(
        "ep.hybrid_zero_channels",
        "host",
        "V2.5 hybrid dispatch: at least 2 token rows (dispatch and combine layouts) fit in shared memory per SM, else 0 channels per SM and ceil_div(M, 0) (no assert: the host crashes)",
        "/* 2 kinds of warps */ num_channels_per_sm / 2, kNumMaxChannelsPerSM);",
        _B,
        450,
    ),
    _L(
        "ep.hybrid_scaleup",
        "host",
        "V2.5 hybrid combine kernel: scale-up ranks <= 64 (EP_STATIC_ASSERT)",
        "kNumScaleupRanks <= 64",
        _I + "hybrid_combine.cuh",
        179,
    ),
    _L(
        "ep.expert_id_range",
        "device",
        "V2.5 dispatch notify warps: an expert id >= num_experts is counted into shared memory past the counters (no check on the device: out-of-bounds writes)",
        "atomicAdd_block(expert_count + dst_expert_idx, 1)",
        _I + "dispatch.cuh",
        100,
    ),
    _L(
        "ep.duplicate_experts",
        "device",
        "V2.5 dispatch copy epilogue: a token names each local expert at most once (a duplicate expert id traps)",
        "ptx::deduplicate(dst_expert_idx, lane_idx) or dst_expert_idx == -1",
        _I + "dispatch_copy_epilogue.cuh",
        108,
    ),
    # ------------------------------------------------------------------ combine
    _L(
        "ep.combine_num_sms",
        "host",
        "V2.5 combine: 0 < num_sms <= the device's SM count",
        "num_sms > 0 and num_sms <= jit->device.get_num_sms()",
        _B,
        808,
    ),
    _L(
        "ep.combine_hybrid_two_sms",
        "host",
        "V2.5 hybrid combine needs at least 2 SMs",
        "num_sms > 1 or context->num_scaleout_ranks == 1",
        _B,
        809,
    ),
    _L(
        "ep.defer_combine",
        "host",
        "V2.5 combine: defer_epilogue needs async_with_compute_stream",
        "not defer_epilogue or async_with_compute_stream",
        _B,
        811,
    ),
    _L(
        "ep.combine_x",
        "host",
        "V2.5 combine: x is a contiguous CUDA tensor",
        "x.is_cuda() and x.is_contiguous()",
        _B,
        815,
    ),
    _L(
        "ep.combine_dtype",
        "host",
        "V2.5 combine: x is bf16",
        "x.scalar_type() == torch::kBFloat16",
        _B,
        816,
    ),
    _L(
        "ep.combine_row_int4",
        "host",
        "V2.5 combine: a row is a multiple of 16 bytes",
        "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
        _B,
        817,
    ),
    _L(
        "ep.combine_topk_idx",
        "host",
        "V2.5 combine: the handle's topk_idx is topk_idx_t",
        "combined_topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value",
        _B,
        823,
    ),
    _L(
        "ep.combine_psum",
        "host",
        "V2.5 combine: the handle's prefix sum has one entry per scale-up rank",
        "num_scaleup_ranks == context->num_scaleup_ranks",
        _B,
        824,
    ),
    _L(
        "ep.combine_num_max",
        "host",
        "V2.5 combine: the handle's num_tokens <= num_max_tokens_per_rank",
        "num_combined_tokens <= num_max_tokens_per_rank",
        _B,
        827,
    ),
    _L(
        "ep.combine_rows",
        "host",
        "V2.5 combine (non-expand): x has one row per recv_src_metadata row",
        "num_reduced_tokens == (use_expanded_layout ? num_reduced_tokens : num_tokens)",
        _B,
        832,
    ),
    _L(
        "ep.combine_meta",
        "host",
        "V2.5 combine: recv_src_metadata is [rows, k + 2]",
        "num_topk_p2 == num_topk + 2",
        _B,
        833,
    ),
    _L(
        "ep.combine_expand_weights_shape",
        "host",
        "V2.5 combine (expand): topk_weights is [rows]",
        "EP_HOST_ASSERT(num_tokens == num_tokens__);",
        _B,
        841,
    ),
    _L(
        "ep.combine_weights",
        "host",
        "V2.5 combine (non-expand): topk_weights is [rows, k]",
        "num_tokens == num_tokens__ and num_topk == num_topk__",
        _B,
        844,
    ),
    _L(
        "ep.combine_weights_dtype",
        "host",
        "V2.5 combine: topk_weights is float32",
        "topk_weights->scalar_type() == torch::kFloat",
        _B,
        847,
    ),
    _L(
        "ep.combine_bias_layout",
        "host",
        "V2.5 combine: a bias is a contiguous 2-D CUDA tensor",
        "bias.dim() == 2 and bias.is_cuda() and bias.is_contiguous()",
        _B,
        854,
    ),
    _L(
        "ep.combine_bias_dtype",
        "host",
        "V2.5 combine: a bias has x's dtype (bf16)",
        "bias.scalar_type() == x.scalar_type()",
        _B,
        855,
    ),
    _L(
        "ep.combine_bias",
        "host",
        "V2.5 combine: a bias is [num_tokens, hidden] (the combined shape)",
        "bias.size(0) == num_combined_tokens and bias.size(1) == hidden",
        _B,
        856,
    ),
    _L(
        "ep.combine_buffer",
        "host",
        "V2.5 combine: the combine layout fits num_bytes",
        "EP_HOST_ASSERT(get_combine_buffer_size(",
        _B,
        866,
    ),
    _L(
        "ep.combine_hybrid_meta",
        "host",
        "V2.5 hybrid combine: the handle's forward metadata matches its channels",
        "d1 == context->num_scaleout_ranks * num_max_tokens_per_channel + 1",
        _B,
        880,
    ),
    _L(
        "ep.combine_channels",
        "host",
        "V2.5 hybrid combine: the handle's channels are a multiple of num_sms (use the dispatch's SM count)",
        "num_channels % num_sms == 0",
        _KC,
        50,
    ),
    _L(
        "ep.combine_hidden",
        "host",
        "V2.5 combine kernel: hidden % 256 == 0 (EP_STATIC_ASSERT)",
        "kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0",
        _I + "combine.cuh",
        110,
    ),
    _L(
        "ep.hybrid_combine_smem",
        "host",
        "V2.5 hybrid combine: its 2 x channels-per-SM warps of combine token rows fit in shared memory (a combine wider than its dispatch can exceed it)",
        "EP_HOST_ASSERT(num_warps * token_layout.get_num_bytes<true>() <= num_smem_bytes and",
        _KC,
        56,
    ),
    _L(
        "ep.hybrid_combine_hidden",
        "host",
        "V2.5 hybrid combine kernel: hidden % 256 == 0 (EP_STATIC_ASSERT)",
        "kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0",
        _I + "hybrid_combine.cuh",
        220,
    ),
    _L(
        "ep.combine_topk_max",
        "host",
        "V2.5 combine reduce epilogue: kNumTopk <= 32 (EP_STATIC_ASSERT)",
        'EP_STATIC_ASSERT(kNumTopk <= 32, "Too many top-k selections");',
        _I + "combine_reduce_epilogue.cuh",
        65,
    ),
    _L(
        "ep.expand_weights",
        "device",
        "V2.5 combine, expand layout without allow_multiple_reduction: topk_weights must be None (a device assert)",
        "EP_DEVICE_ASSERT(topk_weights == nullptr);",
        _I + "combine.cuh",
        70,
    ),
    _L(
        "ep.hybrid_expand_weights",
        "device",
        "V2.5 hybrid combine, expand layout without allow_multiple_reduction: topk_weights must be None",
        "EP_DEVICE_ASSERT(topk_weights == nullptr);",
        _I + "hybrid_combine.cuh",
        120,
    ),
    # ------------------------------------------------------------------ the shared receive region (audit-4 EV1, EV8)
    _L(
        "ep.epilogue_reads_buffer",
        "behaviour",
        "V2.5 dispatch copy epilogue reads the received rows from the buffer's shared slots when it runs (with defer_epilogue: at current_stream_wait()), not when the dispatch kernel ran: any dispatch or combine on the same buffer in between overwrites them",
        "launch_dispatch_copy_epilogue(context->buffer, context->workspace,",
        _B,
        724,
    ),
    _L(
        "ep.host_counts_reset",
        "behaviour",
        "V2.5 dispatch: every call resets the host receive counts that a dropless (do_cpu_sync) epilogue waits for; only a dropless kernel writes them again",
        "std::fill_n(host_workspace_layout.get_scaleup_rank_count_ptr<false>(), context->num_scaleup_ranks, 0);",
        _B,
        555,
    ),
    _L(
        "ep.cpu_wait_timeout",
        "host",
        "V2.5 dropless dispatch: the CPU wait for the receive counts times out (num_cpu_timeout_secs, 300 s by default) when no count arrives",
        'throw EPExceptionWithLineInfo("Dispatch CPU wait", get_buffer_info());',
        _B,
        661,
    ),
    _L(
        "ep.combine_overwrites",
        "behaviour",
        "V2.5 combine receives its rows at the buffer's base, where the dispatch's receive slots are",
        "token_layout, kNumTokensInLayout, kNumMaxTokensPerRank, buffer);",
        _I + "combine.cuh",
        55,
    ),
    _L(
        "ep.combine_src_metadata",
        "device",
        "V2.5 combine sends each row to the source its recv_src_metadata names: metadata that names no rank of the group (garbage rows) writes out of bounds",
        "const int src_token_idx = __ldg(src_metadata + i * kMetadataStride) % kNumMaxTokensPerRank;",
        _I + "combine.cuh",
        90,
    ),
    _L(
        "ep.epilogue_after_destroy",
        "device",
        "V2.5 destroy() frees the buffer (context->finalize()): a deferred dispatch epilogue run after it reads freed memory",
        "context->finalize();",
        _B,
        113,
    ),
    # ------------------------------------------------------------------ JIT
    _L(
        "ep.jit_first_use",
        "behaviour",
        "V2.5 kernels are compiled (nvcc, DeepJIT) at first use of each template: num_max_tokens_per_rank, hidden bytes, scale packs, E, k, expert_alignment, num_sms, QPs, do_cpu_sync, cached / expand / zero-padding and the topology are template arguments",
        'const auto kernel = jit->compile("dispatch", std::format(R"(',
        _KD,
        115,
    ),
    _L(
        "ep.jit_capture",
        "behaviour",
        "V2.5 first-use compile inside a CUDA-graph capture fails (compiling and loading a module is not capturable): every template a captured step uses must have run before the capture",
        'const auto kernel = jit->compile("combine", std::format(R"(',
        _KC,
        91,
    ),
]


def wheel_root() -> Path:
    """The installed wheel's ``deep_ep_v25`` folder (raises ``ModuleNotFoundError`` if absent)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("sgl-deep-ep-v25")
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            f"{WHEEL} is not installed: run scripts/setup.sh (pip install --no-deps {WHEEL})"
        ) from None
    root = Path(str(dist.locate_file("deep_ep_v25")))
    if not (root / "buffers" / "ep.py").is_file():
        raise ModuleNotFoundError(f"{root} has no buffers/ep.py: is {WHEEL} installed whole?")
    return root


def verify_wheel(root: Path | None = None) -> list[str]:
    """Every 2.5.0 citation checked against the wheel's source; returns the misses."""
    root = wheel_root() if root is None else root
    misses = []
    cache: dict[str, list[str]] = {}
    for lid, _, _, needle, path, line in EP_ROWS:
        if path not in cache:
            cache[path] = (root / path).read_text().splitlines()
        text = cache[path]
        got = text[line - 1] if 0 < line <= len(text) else ""
        if needle not in got:
            misses.append(f"{lid} {path}:{line}: {got.strip()!r}")
    return misses


if __name__ == "__main__":
    bad = verify_wheel(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print("\n".join(bad) or f"{len(EP_ROWS)} citations found")
    sys.exit(1 if bad else 0)
