# ruff: noqa: E501  (a registry of DeepEP source lines: the texts and needles stay whole)
"""The registry of DeepEP's asserts and traps that the emulated runtime enforces. TEST-ONLY.

Every ``Limit`` names what DeepEP checks, whether the check is a host assert (``EP_HOST_ASSERT``:
a C++ exception, seen in Python as ``RuntimeError``), a device assert / ``trap()`` (the kernel
aborts and the CUDA context is lost: here a ``DeviceTrap`` saying the GPU would have trapped) or
a behaviour the emulator reproduces, and where it is in DeepEP's source at each release it holds
for: release ``"1.2.1"`` = tag ``v1.2.1``, commit ``9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee``
(``csrc/deep_ep.cpp``, ``csrc/kernels/*``); release ``"2.1.0"`` = ``main``, commit
``dd758caf451848bd150e1046af3d0a73e5fff38d`` (``csrc/legacy/buffer.hpp``,
``csrc/kernels/legacy/*``; the ``sgl-deep-ep`` 0.1.2.post1 wheel). Each source is ``(path,
line)``; ``needle`` is text on that line, so ``python -m tests.deepep_emu.runtime.limits
/path/to/DeepEP.git`` re-checks every citation against a checkout (a developer step: CI has no
DeepEP source).

A limit with no source for a release does not hold there (e.g. the v1.2.1 combine divergence). A
limit with no sources at all is a hazard DeepEP never checks (``worst.overflow``: its kernels
write past the buffer): it holds at every release, and the emulator reports it.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from . import ep_limits, nccl, strict

__all__ = [
    "COMMITS",
    "LIMITS",
    "Limit",
    "DeviceTrap",
    "DeepEPHostAssert",
    "host_assert",
    "device_trap",
    "holds",
]

COMMITS = {
    "1.2.1": "9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee",
    "2.1.0": "dd758caf451848bd150e1046af3d0a73e5fff38d",
    ep_limits.RELEASE: ep_limits.WHEEL,  # DeepEP 2.5 (EPBuffer): the wheel's own source
    "nccl": "v2.30.7-1",  # NCCL's own checks (github:NVIDIA/nccl), runtime.nccl.NCCL_ROWS
}


@dataclass(frozen=True)
class Limit:
    """One DeepEP check: id, kind (host/device/behaviour), text, source line per release."""

    id: str
    kind: str
    text: str
    needle: str
    sources: dict[str, tuple[str, int]]

    def cite(self, release: str) -> str:
        if not self.sources:
            return f"not checked anywhere in DeepEP {release}; the emulator reports the hazard"
        path, line = self.sources[release]
        ref = COMMITS[release]
        if release == "nccl":
            return f"{path}:{line} @ NCCL {ref}"
        ref = ref if "==" in ref else ref[:12]  # a commit, or the wheel that ships the source
        return f"{path}:{line} @ {ref} (DeepEP {release})"


def _L(id: str, kind: str, text: str, needle: str, sources: dict) -> Limit:
    return Limit(id, kind, text, needle, sources)


_ALL = [
    _L(
        "buffer.bytes_aligned",
        "host",
        "num_nvl_bytes and num_rdma_bytes are multiples of NUM_BUFFER_ALIGNMENT_BYTES (128)",
        "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 27), "2.1.0": ("csrc/legacy/buffer.hpp", 107)},
    ),
    _L(
        "buffer.rdma_bytes_aligned",
        "host",
        "num_rdma_bytes is a multiple of 128",
        "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 28), "2.1.0": ("csrc/legacy/buffer.hpp", 109)},
    ),
    _L(
        "buffer.num_ranks",
        "host",
        "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0",
        "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 30), "2.1.0": ("csrc/legacy/buffer.hpp", 114)},
    ),
    _L(
        "buffer.rdma_needs_nodes",
        "host",
        "an RDMA buffer needs num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode",
        "NUM_MAX_NVL_PEERS or low_latency_mode",
        {"1.2.1": ("csrc/deep_ep.cpp", 32), "2.1.0": ("csrc/legacy/buffer.hpp", 116)},
    ),
    _L(
        "buffer.destroy_once",
        "host",
        "destroy() runs once",
        "not destroyed",
        {"1.2.1": ("csrc/deep_ep.cpp", 87), "2.1.0": ("csrc/legacy/buffer.hpp", 174)},
    ),
    _L(
        "buffer.sync_once",
        "host",
        "sync() runs once (the runtime is not available yet)",
        "not is_available()",
        {"1.2.1": ("csrc/deep_ep.cpp", 188), "2.1.0": ("csrc/legacy/buffer.hpp", 230)},
    ),
    _L(
        "layout.topk_idx",
        "host",
        "get_dispatch_layout: topk_idx is 2-D and contiguous",
        "topk_idx.dim() == 2",
        {"1.2.1": ("csrc/deep_ep.cpp", 245), "2.1.0": ("csrc/legacy/buffer.hpp", 343)},
    ),
    _L(
        "layout.num_experts",
        "host",
        "get_dispatch_layout: num_experts > 0",
        "num_experts > 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 247), "2.1.0": ("csrc/legacy/buffer.hpp", 345)},
    ),
    _L(
        "event.previous_needs_async",
        "host",
        "previous_event requires async",
        "previous_event.has_value() and async",
        {"1.2.1": ("csrc/deep_ep.cpp", 253), "2.1.0": ("csrc/legacy/buffer.hpp", 351)},
    ),
    _L(
        "config.num_sms_even",
        "host",
        "config.num_sms is even",
        "config.num_sms % 2 == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 315), "2.1.0": ("csrc/legacy/buffer.hpp", 436)},
    ),
    _L(
        "dispatch.cached_needs_matrices",
        "host",
        "cached dispatch needs the handle's prefix matrices",
        "cached_rank_prefix_matrix.has_value()",
        {"1.2.1": ("csrc/deep_ep.cpp", 312), "2.1.0": ("csrc/legacy/buffer.hpp", 433)},
    ),
    _L(
        "dispatch.layout_given",
        "host",
        "non-cached dispatch needs num_tokens_per_rank and num_tokens_per_expert",
        "num_tokens_per_rank.has_value()",
        {"1.2.1": ("csrc/deep_ep.cpp", 321), "2.1.0": ("csrc/legacy/buffer.hpp", 442)},
    ),
    _L(
        "dispatch.itr_bool",
        "host",
        "is_token_in_rank is torch.bool",
        "is_token_in_rank.scalar_type() == torch::kBool",
        {"1.2.1": ("csrc/deep_ep.cpp", 326), "2.1.0": ("csrc/legacy/buffer.hpp", 447)},
    ),
    _L(
        "dispatch.counts_int32",
        "host",
        "num_tokens_per_rank / num_tokens_per_expert are int32",
        "num_tokens_per_expert->scalar_type() == torch::kInt32",
        {"1.2.1": ("csrc/deep_ep.cpp", 331), "2.1.0": ("csrc/legacy/buffer.hpp", 452)},
    ),
    _L(
        "dispatch.x_2d",
        "host",
        "x is 2-D and contiguous",
        "x.dim() == 2 and x.is_contiguous()",
        {"1.2.1": ("csrc/deep_ep.cpp", 336), "2.1.0": ("csrc/legacy/buffer.hpp", 457)},
    ),
    _L(
        "dispatch.row_int4",
        "host",
        "a row is a multiple of 16 bytes: (hidden * element_size) % sizeof(int4) == 0",
        "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 337), "2.1.0": ("csrc/legacy/buffer.hpp", 458)},
    ),
    _L(
        "dispatch.itr_shape",
        "host",
        "is_token_in_rank is [num_tokens, num_ranks]",
        "is_token_in_rank.size(0) == x.size(0) and is_token_in_rank.size(1) == num_ranks",
        {"1.2.1": ("csrc/deep_ep.cpp", 339), "2.1.0": ("csrc/legacy/buffer.hpp", 460)},
    ),
    _L(
        "dispatch.nte_shape",
        "host",
        "num_tokens_per_expert has E entries, E % num_ranks == 0",
        "num_tokens_per_expert->size(0) % num_ranks == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 347), "2.1.0": ("csrc/legacy/buffer.hpp", 468)},
    ),
    _L(
        "dispatch.max_local_experts",
        "host",
        "E / num_ranks <= NUM_MAX_LOCAL_EXPERTS (1024)",
        "num_tokens_per_expert->size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS",
        {"1.2.1": ("csrc/deep_ep.cpp", 348), "2.1.0": ("csrc/legacy/buffer.hpp", 469)},
    ),
    _L(
        "dispatch.ntr_shape",
        "host",
        "num_tokens_per_rank has num_ranks entries",
        "num_tokens_per_rank->size(0) == num_ranks",
        {"1.2.1": ("csrc/deep_ep.cpp", 350), "2.1.0": ("csrc/legacy/buffer.hpp", 471)},
    ),
    _L(
        "dispatch.topk_pair",
        "host",
        "topk_idx and topk_weights are given together",
        "topk_idx.has_value() == topk_weights.has_value()",
        {"1.2.1": ("csrc/deep_ep.cpp", 360), "2.1.0": ("csrc/legacy/buffer.hpp", 481)},
    ),
    _L(
        "dispatch.topk_shape",
        "host",
        "topk_idx / topk_weights are [num_tokens, k], contiguous",
        "num_tokens == topk_idx->size(0) and num_tokens == topk_weights->size(0)",
        {"1.2.1": ("csrc/deep_ep.cpp", 366), "2.1.0": ("csrc/legacy/buffer.hpp", 487)},
    ),
    _L(
        "dispatch.weights_fp32",
        "host",
        "topk_weights are float32",
        "topk_weights->scalar_type() == torch::kFloat32",
        {"1.2.1": ("csrc/deep_ep.cpp", 368), "2.1.0": ("csrc/legacy/buffer.hpp", 489)},
    ),
    _L(
        "dispatch.scales_fp8",
        "host",
        "with x_scales, x has 1-byte elements and the scales are [num_tokens, S] float32 / int",
        "x.element_size() == 1",
        {"1.2.1": ("csrc/deep_ep.cpp", 377), "2.1.0": ("csrc/legacy/buffer.hpp", 498)},
    ),
    _L(
        "dispatch.scales_dtype",
        "host",
        "x_scales are float32 or int32, 2-D",
        "x_scales->scalar_type() == torch::kFloat32 or x_scales->scalar_type() == torch::kInt",
        {"1.2.1": ("csrc/deep_ep.cpp", 378), "2.1.0": ("csrc/legacy/buffer.hpp", 499)},
    ),
    _L(
        "dispatch.scales_rows",
        "host",
        "x_scales has num_tokens rows",
        "x_scales->size(0) == num_tokens",
        {"1.2.1": ("csrc/deep_ep.cpp", 380), "2.1.0": ("csrc/legacy/buffer.hpp", 501)},
    ),
    _L(
        "dispatch.nvl_bytes_notify",
        "host",
        "the NVLink buffer holds the notify counters: R * (R + e) * 4 <= num_nvl_bytes",
        "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes",
        {"1.2.1": ("csrc/deep_ep.cpp", 432), "2.1.0": ("csrc/legacy/buffer.hpp", 552)},
    ),
    _L(
        "dispatch.nvl_bytes",
        "host",
        "the NVLink buffer holds the channel queues of this call",
        "num_ranks * num_ranks * sizeof(int) +",
        {"1.2.1": ("csrc/deep_ep.cpp", 496), "2.1.0": ("csrc/legacy/buffer.hpp", 628)},
    ),
    _L(
        "notify.local_experts",
        "host",
        "intranode notify_dispatch: E / R <= 128 and R <= 128 (one thread each)",
        "num_experts / num_ranks <= kNumThreads and num_ranks <= kNumThreads",
        {
            "1.2.1": ("csrc/kernels/intranode.cu", 123),
            "2.1.0": ("csrc/kernels/legacy/intranode.cu", 168),
        },
    ),
    _L(
        "launch.ranks",
        "host",
        "intranode kernels are compiled for 2, 4 and 8 ranks (SWITCH_RANKS)",
        "Unsupported ranks",
        {"1.2.1": ("csrc/kernels/launch.cuh", 59), "2.1.0": ("csrc/kernels/legacy/launch.cuh", 62)},
    ),
    _L(
        "launch.rdma_ranks",
        "host",
        "internode kernels are compiled for the node counts of SWITCH_RDMA_RANKS",
        "Unsupported RDMA ranks",
        {"1.2.1": ("csrc/kernels/launch.cuh", 70), "2.1.0": ("csrc/kernels/legacy/launch.cuh", 87)},
    ),
    _L(
        "launch.hidden",
        "host",
        "low-latency kernels are compiled for the hidden sizes of SWITCH_HIDDEN",
        "Unsupported hidden",
        {
            "1.2.1": ("csrc/kernels/launch.cuh", 96),
            "2.1.0": ("csrc/kernels/legacy/launch.cuh", 132),
        },
    ),
    _L(
        "dispatch.topk_max",
        "device",
        "num_topk <= 32",
        "EP_DEVICE_ASSERT(num_topk <= 32)",
        {
            "1.2.1": ("csrc/kernels/intranode.cu", 187),
            "2.1.0": ("csrc/kernels/legacy/intranode.cu", 251),
        },
    ),
    _L(
        "dispatch.tma_row",
        "device",
        "SM90 TMA receive path: hidden_int4 % 2 == 0 and hidden_bytes / 2 + 8 <= kNumTMABytesPerWarp (8192)",
        "hidden_int4 % 2 == 0 and half_hidden_bytes + sizeof(uint64_t) <= kNumTMABytesPerWarp",
        {
            "1.2.1": ("csrc/kernels/intranode.cu", 235),
            "2.1.0": ("csrc/kernels/legacy/intranode.cu", 304),
        },
    ),
    _L(
        "combine.x_2d",
        "host",
        "combine: x is 2-D and contiguous",
        "x.dim() == 2 and x.is_contiguous()",
        {"1.2.1": ("csrc/deep_ep.cpp", 547), "2.1.0": ("csrc/legacy/buffer.hpp", 732)},
    ),
    _L(
        "combine.handle",
        "host",
        "combine: src_idx / send_head / prefix matrices are int32 of the handle's shapes",
        "src_idx.dim() == 1 and src_idx.is_contiguous() and src_idx.scalar_type() == torch::kInt32",
        {"1.2.1": ("csrc/deep_ep.cpp", 548), "2.1.0": ("csrc/legacy/buffer.hpp", 733)},
    ),
    _L(
        "combine.rows",
        "host",
        "combine: x has one row per received token",
        "src_idx.size(0) == num_tokens",
        {"1.2.1": ("csrc/deep_ep.cpp", 559), "2.1.0": ("csrc/legacy/buffer.hpp", 746)},
    ),
    _L(
        "combine.row_int4",
        "host",
        "combine: (hidden * element_size) % 16 == 0",
        "(hidden * x.element_size()) % sizeof(int4) == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 563), "2.1.0": ("csrc/legacy/buffer.hpp", 750)},
    ),
    _L(
        "combine.weights",
        "host",
        "combine: topk_weights are [num_recv_tokens, k] float32",
        "topk_weights->size(0) == num_tokens",
        {"1.2.1": ("csrc/deep_ep.cpp", 586), "2.1.0": ("csrc/legacy/buffer.hpp", 773)},
    ),
    _L(
        "combine.bias",
        "host",
        "combine: a bias is [num_tokens, hidden] of x's dtype",
        "bias.scalar_type() == x.scalar_type()",
        {"1.2.1": ("csrc/deep_ep.cpp", 607), "2.1.0": ("csrc/legacy/buffer.hpp", 800)},
    ),
    _L(
        "combine.nvl_bytes",
        "host",
        "combine: the NVLink buffer holds the channel queues of this call",
        "num_channels * num_ranks * sizeof(int) * 2 +",
        {"1.2.1": ("csrc/deep_ep.cpp", 614), "2.1.0": ("csrc/legacy/buffer.hpp", 807)},
    ),
    _L(
        "combine.dtype",
        "host",
        "combine reduces bf16 rows only (SWITCH_TYPES)",
        "Unsupported type",
        {
            "1.2.1": ("csrc/kernels/launch.cuh", 84),
            "2.1.0": ("csrc/kernels/legacy/launch.cuh", 109),
        },
    ),
    _L(
        "internode.rdma_ranks",
        "host",
        "internode: 0 < num_rdma_ranks <= NUM_MAX_RDMA_PEERS",
        "get_num_rdma_ranks() <= NUM_MAX_RDMA_PEERS",
        {"1.2.1": ("csrc/deep_ep.cpp", 670), "2.1.0": ("csrc/legacy/buffer.hpp", 902)},
    ),
    _L(
        "internode.src_meta",
        "host",
        "internode combine: src_meta is [M, sizeof(SourceMeta)] uint8",
        "src_meta.size(1) == internode::get_source_meta_bytes()",
        {"1.2.1": ("csrc/deep_ep.cpp", 958), "2.1.0": ("csrc/legacy/buffer.hpp", 1286)},
    ),
    _L(
        "internode.combine_nvl_chunks",
        "host",
        "internode combine: num_max_nvl_chunked_recv_tokens % num_rdma_ranks == 0",
        "config.num_max_nvl_chunked_recv_tokens % num_rdma_ranks == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 997), "2.1.0": ("csrc/legacy/buffer.hpp", 1326)},
    ),
    _L(
        "internode.combine_nvl_send",
        "host",
        "internode combine: nvl send tokens <= nvl recv tokens / num_rdma_ranks",
        "config.num_max_nvl_chunked_send_tokens <= config.num_max_nvl_chunked_recv_tokens / num_rdma_ranks",
        {"1.2.1": ("csrc/deep_ep.cpp", 998), "2.1.0": ("csrc/legacy/buffer.hpp", 1327)},
    ),
    _L(
        "internode.nvl_peers",
        "device",
        "internode kernels are built for NUM_MAX_NVL_PEERS == 8 (the emulator lowers it to fit fewer processes)",
        "NUM_MAX_NVL_PEERS == 8",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 20),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 25),
        },
    ),
    _L(
        "internode.notify_rdma_experts",
        "device",
        "internode notify_dispatch: the experts of one node, E / N, fit the block's threads",
        "num_rdma_experts <= num_threads",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 191),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 227),
        },
    ),
    _L(
        "internode.notify_nvl_experts",
        "device",
        "internode notify_dispatch: the experts of one rank fit the block's threads",
        "num_nvl_experts <= num_threads",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 226),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 265),
        },
    ),
    _L(
        "internode.qps",
        "device",
        "internode normal kernels: num_rc_per_pe == num_channels or >= num_sms",
        "num_rc_per_pe == num_channels or ibgda_get_state()->num_rc_per_pe >= num_sms",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 386),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 497),
        },
    ),
    _L(
        "internode.dispatch_topk_max",
        "device",
        "internode dispatch: num_topk <= 32",
        "EP_DEVICE_ASSERT(num_topk <= 32)",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 408),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 519),
        },
    ),
    _L(
        "internode.dispatch_token_bytes",
        "device",
        "internode dispatch: bytes per token (row + SourceMeta + scales + ids + weights, 16-aligned) + 8 <= 16384",
        "num_bytes_per_token + sizeof(uint64_t) <= kNumTMABytesPerWarp",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 453),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 578),
        },
    ),
    _L(
        "internode.combine_hidden",
        "device",
        "internode combine: hidden_int4 % 32 == 0 (bf16 width a multiple of 256)",
        "EP_DEVICE_ASSERT(hidden_int4 % 32 == 0)",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 1250),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 1588),
        },
    ),
    _L(
        "internode.combine_token_bytes",
        "device",
        "internode combine: bytes per token + 8 <= 16384",
        "num_bytes_per_token + sizeof(uint64_t) <= kNumTMABytesPerSenderWarp",
        {
            "1.2.1": ("csrc/kernels/internode.cu", 1448),
            "2.1.0": ("csrc/kernels/legacy/internode.cu", 1816),
        },
    ),
    _L(
        "ll.mode",
        "host",
        "low-latency kernels need a buffer built with low_latency_mode",
        "EP_HOST_ASSERT(low_latency_mode)",
        {"1.2.1": ("csrc/deep_ep.cpp", 1069), "2.1.0": ("csrc/legacy/buffer.hpp", 1432)},
    ),
    _L(
        "ll.x",
        "host",
        "low-latency dispatch: x is [T, H] bf16 contiguous, H % 128 == 0, T <= num_max_dispatch_tokens_per_rank",
        "x.size(0) <= num_max_dispatch_tokens_per_rank",
        {"1.2.1": ("csrc/deep_ep.cpp", 1105), "2.1.0": ("csrc/legacy/buffer.hpp", 1481)},
    ),
    _L(
        "ll.x_dtype",
        "host",
        "low-latency dispatch: x is bf16",
        "x.scalar_type() == torch::kBFloat16",
        {"1.2.1": ("csrc/deep_ep.cpp", 1102), "2.1.0": ("csrc/legacy/buffer.hpp", 1478)},
    ),
    _L(
        "ll.hidden128",
        "host",
        "low-latency dispatch: H % 128 == 0",
        "x.size(1) % 128 == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 1103), "2.1.0": ("csrc/legacy/buffer.hpp", 1479)},
    ),
    _L(
        "ll.topk_dtype",
        "host",
        "low-latency dispatch: topk_idx is int64",
        "topk_idx.scalar_type() ==",
        {"1.2.1": ("csrc/deep_ep.cpp", 1106), "2.1.0": ("csrc/legacy/buffer.hpp", 1482)},
    ),
    _L(
        "ll.experts",
        "host",
        "low-latency dispatch: num_experts % num_ranks == 0",
        "num_experts % num_ranks == 0",
        {"1.2.1": ("csrc/deep_ep.cpp", 1107), "2.1.0": ("csrc/legacy/buffer.hpp", 1483)},
    ),
    _L(
        "ll.rdma_bytes",
        "host",
        "low-latency: the layout fits num_rdma_bytes",
        "layout.total_bytes <= num_rdma_bytes",
        {"1.2.1": ("csrc/deep_ep.cpp", 1127), "2.1.0": ("csrc/legacy/buffer.hpp", 1503)},
    ),
    _L(
        "ll.async_hook",
        "host",
        "low-latency: not both async and return_recv_hook",
        "not (async and return_recv_hook)",
        {"1.2.1": ("csrc/deep_ep.cpp", 1135), "2.1.0": ("csrc/legacy/buffer.hpp", 1511)},
    ),
    _L(
        "ll.tma_tokens",
        "host",
        "low-latency dispatch: (num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0 (TMA)",
        "TMA requires the number of tokens to be multiple of 4",
        {"1.2.1": ("csrc/deep_ep.cpp", 1149), "2.1.0": ("csrc/legacy/buffer.hpp", 1526)},
    ),
    _L(
        "ll.combine_x",
        "host",
        "low-latency combine: x is [e, R * num_max, H] bf16",
        "x.size(1) == num_ranks * num_max_dispatch_tokens_per_rank",
        {"1.2.1": ("csrc/deep_ep.cpp", 1222), "2.1.0": ("csrc/legacy/buffer.hpp", 1617)},
    ),
    _L(
        "ll.combine_weights",
        "host",
        "low-latency combine: topk_weights [T, k] float32 with T <= num_max",
        "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank",
        {"1.2.1": ("csrc/deep_ep.cpp", 1228), "2.1.0": ("csrc/legacy/buffer.hpp", 1623)},
    ),
    _L(
        "ll.combine_out",
        "host",
        "low-latency combine: out is [T, H] of x's dtype",
        "out->size(0) == num_combined_tokens and out->size(1) == hidden",
        {"1.2.1": ("csrc/deep_ep.cpp", 1264), "2.1.0": ("csrc/legacy/buffer.hpp", 1659)},
    ),
    _L(
        "ll.qps",
        "device",
        "low-latency kernels: num_rc_per_pe >= num local experts",
        "num_rc_per_pe >= num_local_experts",
        {
            "1.2.1": ("csrc/kernels/internode_ll.cu", 181),
            "2.1.0": ("csrc/kernels/legacy/internode_ll.cu", 284),
        },
    ),
    _L(
        "ll.topk_max",
        "device",
        "low-latency dispatch: num_topk <= kNumMaxTopK (11)",
        "num_topk <= kNumMaxTopK",
        {
            "1.2.1": ("csrc/kernels/internode_ll.cu", 358),
            "2.1.0": ("csrc/kernels/legacy/internode_ll.cu", 501),
        },
    ),
    _L(
        "ll.expert_id_range",
        "device",
        "low-latency dispatch: an id >= E indexes the per-expert send counters (workspace [E counters | E finish counters]) past their end and puts to rank id / e >= R (unchecked: UB; the emulator traps)",
        "atomicAdd(atomic_counter_per_expert + dst_expert_idx, 1)",
        {
            "1.2.1": ("csrc/kernels/internode_ll.cu", 153),
            "2.1.0": ("csrc/kernels/legacy/internode_ll.cu", 255),
        },
    ),
    _L(
        "ll.source_region",
        "device",
        "low-latency dispatch: a sender owns num_max receive slots per expert (rank * num_max + slot); a sender naming one expert more than num_max times (a repeated id) writes into the next source rank's rows (unchecked: silent corruption; the emulator traps)",
        "rank * num_max_dispatch_tokens_per_rank * num_bytes_per_msg +",
        {
            "1.2.1": ("csrc/kernels/internode_ll.cu", 160),
            "2.1.0": ("csrc/kernels/legacy/internode_ll.cu", 262),
        },
    ),
    _L(
        "elastic.buffer_bytes",
        "host",
        "ElasticBuffer: num_bytes > 0 and a multiple of 2 MiB (symmetric::kNumAlignmentBytes)",
        "num_buffer_bytes > 0 and num_buffer_bytes % symmetric::kNumAlignmentBytes == 0",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 98)},
    ),
    _L(
        "elastic.gin_type",
        "host",
        "V2 NCCL context: with R > 1 NCCL reports a GIN type for the communicator (the railed one in hybrid mode), unless EP_DISABLE_GIN is a non-zero integer — also on one node",
        "(allow_hybrid_mode ? props.railedGinType : props.ginType) != NCCL_GIN_TYPE_NONE and",
        {"2.1.0": ("csrc/kernels/backend/nccl.cu", 88)},
    ),
    _L(
        "elastic.nccl_version",
        "host",
        "V2 NCCL context: below NCCL 2.31 the runtime NCCL is the one DeepEP was compiled with (the sgl-deep-ep 0.1.2.post1 _C: 2.30.7)",
        "NCCL_VERSION_CODE == nccl_runtime_version",
        {"2.1.0": ("csrc/kernels/backend/nccl.cu", 104)},
    ),
    _L(
        "elastic.nvl_ranks",
        "host",
        "V2 domains: num_ranks is a multiple of the NVLink (LSA) domain size",
        "num_ranks % num_nvl_ranks == 0",
        {"2.1.0": ("csrc/kernels/backend/nccl.cu", 52)},
    ),
    _L(
        "elastic.size_args",
        "host",
        "calculate_elastic_buffer_size: num_max_tokens_per_rank > 0 and hidden > 0",
        "num_max_tokens_per_rank > 0 and hidden > 0",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 657)},
    ),
    _L(
        "elastic.size_sf",
        "host",
        "calculate_elastic_buffer_size: ceil(hidden / 32) * 4 <= hidden (worst-case SF bytes)",
        "math::ceil_div(hidden, 32) * sizeof(float) <= hidden",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 660)},
    ),
    _L(
        "elastic.token_hidden_bytes",
        "host",
        "V2 token layout: hidden * element_size % 32 == 0 (bf16 hidden % 16, fp8 hidden % 32)",
        "num_hidden_bytes % ptx::kNumTMAAlignBytes == 0",
        {"2.1.0": ("deep_ep/include/deep_ep/common/layout.cuh", 198)},
    ),
    _L(
        "elastic.num_sms",
        "host",
        "V2 dispatch: num_sms > 0",
        "EP_HOST_ASSERT(num_sms > 0);",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 728)},
    ),
    _L(
        "elastic.zero_padding",
        "host",
        "V2 dispatch: do_zero_padding needs do_expand",
        "not do_zero_padding or do_expand",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 731)},
    ),
    _L(
        "elastic.cached_fields",
        "host",
        "V2 cached dispatch: the handle's counts, prefix sums and slots are given",
        "cached_num_recv_tokens.has_value()",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 736)},
    ),
    _L(
        "elastic.x",
        "host",
        "V2 dispatch: x is a contiguous CUDA tensor",
        "x.is_cuda() and x.is_contiguous()",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 754)},
    ),
    _L(
        "elastic.row_int4",
        "host",
        "V2 dispatch: a row is a multiple of 16 bytes",
        "(x.size(1) * x.element_size()) % sizeof(int4) == 0",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 755)},
    ),
    _L(
        "elastic.num_max",
        "host",
        "V2 dispatch: num_tokens <= num_max_tokens_per_rank",
        "num_tokens <= num_max_tokens_per_rank",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 756)},
    ),
    _L(
        "elastic.sf",
        "host",
        "V2 dispatch: sf is [num_tokens, packs] with 4-byte elements",
        "sf->element_size() == sizeof(sf_pack_t)",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 767)},
    ),
    _L(
        "elastic.topk",
        "host",
        "V2 dispatch: topk_idx is [num_tokens, k] contiguous topk_idx_t (int64)",
        "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 777)},
    ),
    _L(
        "elastic.weights",
        "host",
        "V2 dispatch: topk_weights is [num_tokens, k] and contiguous",
        "topk_weights->is_cuda() and topk_weights->is_contiguous()",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 785)},
    ),
    _L(
        "elastic.stats",
        "host",
        "V2 dispatch: cumulative_local_expert_recv_stats is [e] int32",
        "num_local_experts == num_local_experts_",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 795)},
    ),
    _L(
        "elastic.experts_div",
        "host",
        "V2 dispatch: num_experts % num_ranks == 0",
        "num_experts % nccl_context->num_ranks == 0",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 805)},
    ),
    _L(
        "elastic.cached_slots",
        "host",
        "V2 cached dispatch: dst_buffer_slot_idx is [num_tokens, k] (the same T as the handle's dispatch)",
        "num_tokens == num_tokens__ and num_topk == num_topk_",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 874)},
    ),
    _L(
        "elastic.dispatch_buffer",
        "host",
        "V2 dispatch: the dispatch layout of (num_max_tokens_per_rank, hidden, sf, k) fits num_bytes",
        "EP_HOST_ASSERT(get_dispatch_buffer_size(",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 963)},
    ),
    _L(
        "elastic.local_experts",
        "host",
        "V2 workspace layout: local experts (E / R) <= kNumMaxExpertsPerRank (256)",
        "num_experts_per_rank <= kNumMaxExpertsPerRank",
        {"2.1.0": ("deep_ep/include/deep_ep/common/layout.cuh", 40)},
    ),
    _L(
        "elastic.device_sms",
        "host",
        "V2 dispatch: num_sms <= the device's SM count",
        "num_sms <= jit::device_runtime->get_num_sms()",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 979)},
    ),
    _L(
        "elastic.topk_max",
        "host",
        "V2 dispatch kernel: kNumTopk <= 32 (EP_STATIC_ASSERT: the JIT build fails, a host assert at csrc/jit/compiler.hpp:239)",
        "EP_STATIC_ASSERT(kNumTopk <= 32",
        {"2.1.0": ("deep_ep/include/deep_ep/impls/dispatch.cuh", 93)},
    ),
    _L(
        "elastic.cached_stats",
        "host",
        "V2 cached dispatch: no cumulative_local_expert_recv_stats",
        "EP_HOST_ASSERT(cumulative_local_expert_recv_stats == nullptr)",
        {"2.1.0": ("csrc/kernels/elastic/dispatch.hpp", 168)},
    ),
    _L(
        "elastic.duplicate_experts",
        "device",
        "V2 dispatch copy epilogue: a token names each local expert at most once (a duplicate expert id traps)",
        "ptx::deduplicate(dst_expert_idx, lane_idx) or dst_expert_idx == -1",
        {"2.1.0": ("deep_ep/include/deep_ep/impls/dispatch_copy_epilogue.cuh", 107)},
    ),
    _L(
        "elastic.combine_num_sms",
        "host",
        "V2 combine: num_sms > 0",
        "EP_HOST_ASSERT(num_sms > 0);",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1198)},
    ),
    _L(
        "elastic.combine_x",
        "host",
        "V2 combine: x is contiguous bf16",
        "x.scalar_type() == torch::kBFloat16",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1203)},
    ),
    _L(
        "elastic.combine_num_max",
        "host",
        "V2 combine: the handle's num_tokens <= num_max_tokens_per_rank",
        "num_combined_tokens <= num_max_tokens_per_rank",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1214)},
    ),
    _L(
        "elastic.combine_rows",
        "host",
        "V2 combine (non-expand): x has one row per recv_src_metadata row",
        "num_reduced_tokens == (use_expanded_layout ? num_reduced_tokens : num_tokens)",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1219)},
    ),
    _L(
        "elastic.combine_weights",
        "host",
        "V2 combine: topk_weights is [N, k] (expand: [N], line 1228) float32, contiguous",
        "num_tokens == num_tokens__ and num_topk == num_topk__",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1231)},
    ),
    _L(
        "elastic.combine_bias",
        "host",
        "V2 combine: a bias is [num_tokens, hidden] of x's dtype",
        "bias.size(0) == num_combined_tokens and bias.size(1) == hidden",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1244)},
    ),
    _L(
        "elastic.combine_buffer",
        "host",
        "V2 combine: the combine layout fits num_bytes",
        "EP_HOST_ASSERT(get_combine_buffer_size(",
        {"2.1.0": ("csrc/elastic/buffer.hpp", 1254)},
    ),
    _L(
        "elastic.combine_hidden",
        "host",
        "V2 combine kernel: hidden % 256 == 0 (EP_STATIC_ASSERT: the JIT build fails, a host assert at csrc/jit/compiler.hpp:239)",
        "kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0",
        {"2.1.0": ("deep_ep/include/deep_ep/impls/combine.cuh", 109)},
    ),
    _L(
        "elastic.expand_weights",
        "device",
        "V2 combine, expand layout without allow_multiple_reduction: topk_weights must be None (a device assert)",
        "EP_DEVICE_ASSERT(topk_weights == nullptr)",
        {"2.1.0": ("deep_ep/include/deep_ep/impls/combine.cuh", 69)},
    ),
    _L(
        "combine.v121_divergence",
        "device",
        "v1.2.1 intranode combine: the reduce loop runs lanes i = lane, lane + 32, ... < hidden_int4 around warp-wide TMA stores; a width that is not a multiple of 256 bf16 columns (hidden_int4 % 32 != 0) lets the warp diverge (a hang); fixed after the tag",
        "for (int i = lane_id; i < hidden_int4; i += 32)",
        {"1.2.1": ("csrc/kernels/intranode.cu", 805)},
    ),
    _L(
        "worst.overflow",
        "device",
        "num_worst_tokens: a rank receiving more than W rows makes the kernel write past recv_x (no check on the device: memory corruption)",
        "num_worst_tokens",
        {},
    ),
    _L(
        "ll.clean_after_normal",
        "behaviour",
        "after normal dispatch/combine used the buffer, clean_low_latency_buffer must run before any low-latency kernel (dispatch or combine)",
        "after running the normal dispatch/combine",
        {"1.2.1": ("deep_ep/buffer.py", 519), "2.1.0": ("deep_ep/buffers/legacy.py", 542)},
    ),
    _L(
        "ll.two_buffers",
        "behaviour",
        "low-latency results live in one of two alternating buffers: a result is overwritten by the second low-latency kernel after it",
        "there are only two buffers",
        {"1.2.1": ("deep_ep/buffer.py", 541), "2.1.0": ("deep_ep/buffers/legacy.py", 564)},
    ),
]
# DeepEP 2.5 (``EPBuffer``), cited in the sgl-deep-ep-v25 wheel's source (``ep_limits``)
_ALL += [_L(i, k, t, n, {ep_limits.RELEASE: (p, ln)}) for i, k, t, n, p, ln in ep_limits.EP_ROWS]
_ALL += [_L(*row) for row in strict.ROWS]  # audit-3 E1-E7
_ALL += [_L(*row) for row in nccl.NCCL_ROWS]  # NCCL's own (issue 44)
_ALL.append(
    _L(
        "stream.cross_read",
        "device",
        "a deferred epilogue's rows read on another stream than the one they were written on, without waiting for an event recorded after them: no check in DeepEP (a race on the GPU; tests/deepep_emu/streams.py)",
        "current_stream_wait",
        {},
    )
)
_ALL += [
    _L(
        f"{prefix}.no_gin_context",
        "device",
        f"{what} with EP_DISABLE_GIN: no check in DeepEP — its device communicator is built without GIN contexts ({where}) while its kernels across RDMA ranks use them",
        "EP_DISABLE_GIN",
        {},
    )
    for prefix, what, where in (
        ("elastic", "V2 dispatch / combine across nodes", "nccl.cu:86-99"),
        ("ep", "V2.5 dispatch / combine across nodes", "context.cpp:124-155"),
    )
]
LIMITS: dict[str, Limit] = {lim.id: lim for lim in _ALL}


class DeepEPHostAssert(RuntimeError):
    """DeepEP's ``EP_HOST_ASSERT`` (an ``EPException``; pybind11 raises ``RuntimeError``)."""


class DeviceTrap(RuntimeError):
    """A device assert or ``trap()`` of a DeepEP kernel: on a GPU the kernel aborts."""


def holds(limit_id: str, release: str) -> bool:
    """Whether ``limit_id`` is checked (or, unchecked by DeepEP, a hazard) at ``release``."""
    lim = LIMITS[limit_id]
    return not lim.sources or release in lim.sources


def host_assert(cond: bool, limit_id: str, release: str, detail: str = "") -> None:
    """Raise ``DeepEPHostAssert`` as DeepEP would when ``cond`` is false at ``release``."""
    if cond or not holds(limit_id, release):
        return
    lim = LIMITS[limit_id]
    raise DeepEPHostAssert(
        f"Failed: Assertion error {lim.text} [{limit_id}: {lim.cite(release)}]"
        + (f": {detail}" if detail else "")
    )


def device_trap(cond: bool, limit_id: str, release: str, detail: str = "") -> None:
    """Raise ``DeviceTrap`` when ``cond`` is false: the GPU would have trapped (or hung)."""
    if cond or not holds(limit_id, release):
        return
    lim = LIMITS[limit_id]
    raise DeviceTrap(
        f"the GPU would have trapped (device assert in a DeepEP kernel, the CUDA context is "
        f"lost): {lim.text} [{limit_id}: {lim.cite(release)}]" + (f": {detail}" if detail else "")
    )


def _verify(repo: str) -> int:
    """Check every citation against a DeepEP git checkout (bare or not); returns misses."""
    tags = {"1.2.1": "v1.2.1", "2.1.0": COMMITS["2.1.0"]}
    files: dict[tuple[str, str], list[str]] = {}
    misses = 0
    for lim in LIMITS.values():
        for release, (path, line) in lim.sources.items():
            if release in (ep_limits.RELEASE, "nccl"):  # the wheel's (verify_wheel), NCCL's
                continue
            key = (release, path)
            if key not in files:
                text = subprocess.run(
                    ["git", "-C", repo, "show", f"{tags[release]}:{path}"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                files[key] = text.splitlines()
            got = files[key][line - 1] if 0 < line <= len(files[key]) else ""
            variants = (
                lim.needle,
                lim.needle.replace("NUM_", "LEGACY_NUM_"),
                lim.needle.replace("not (", "not("),
            )
            if not any(v in got for v in variants):
                misses += 1
                print(f"MISS {lim.id} {release} {path}:{line}: {got.strip()!r}")
    print(f"{len(LIMITS)} limits, {misses} citation(s) not found")
    return misses


if __name__ == "__main__":
    sys.exit(1 if _verify(sys.argv[1]) else 0)
