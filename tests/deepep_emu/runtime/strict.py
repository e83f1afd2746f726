# ruff: noqa: E501  (a registry of DeepEP source lines: the texts and needles stay whole)
"""DeepEP's checks the emulated runtime was more permissive about (audit-3 E1-E7). TEST-ONLY.

Registered in ``limits.LIMITS`` (``ROWS``, same citation rules) and applied by ``normal.py``
(V1 ``Buffer``) and ``elastic.py`` (V2 ``ElasticBuffer``):

- E1 ``internode.topk_rdma_ranks``: a token reaches at most ``min(N, 8)`` nodes (device assert);
- E2 ``internode.*_int_max``: internode normal kernels need both byte counts ``< INT_MAX``, and
  the constructor's ``buffer.nvl_int_max`` / ``buffer.rdma_int_max``;
- E3 ``elastic.max_experts`` / ``elastic.max_ranks``: V2's workspace layout (E <= 2048,
  R <= 1024);
- E5 ``internode.num_channels``: ``num_channels * 2 > 3`` in cached notify (combine, cached
  dispatch);
- E6 ``dispatch.scales_2d``: ``x_scales`` must be 2-D;
- E7 capture-time rules: ``capture.buffer_alloc`` (a buffer built while a graph is captured:
  cudaMalloc / IPC / barriers) and ``elastic.jit_capture`` (V2 compiles each new template at
  its first use; inside a capture that fails). ``emu_capture(module)`` marks the body as a
  capture; the emulated module counts compiles in ``module.emu_v2_jit``;
- ``elastic.expert_id_range``: an id >= E indexes V2's counters out of bounds (no check in
  DeepEP: reported as a device trap).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

INT_MAX = 2**31 - 1

_CPP = "csrc/deep_ep.cpp"
_LEG = "csrc/legacy/buffer.hpp"
_INT = ("csrc/kernels/internode.cu", "csrc/kernels/legacy/internode.cu")

ROWS: list[tuple[str, str, str, str, dict[str, tuple[str, int]]]] = [
    (
        "internode.topk_rdma_ranks",
        "device",
        "internode dispatch: a token's destination nodes <= min(N, 8) (kNumTopkRDMARanks)",
        "EP_DEVICE_ASSERT(num_topk_ranks <= kNumTopkRDMARanks);",
        {"1.2.1": (_INT[0], 543), "2.1.0": (_INT[1], 686)},
    ),
    (
        "internode.rdma_bytes_int_max",
        "host",
        "internode notify_dispatch: num_rdma_bytes < INT_MAX",
        "EP_HOST_ASSERT(num_rdma_bytes < std::numeric_limits<int>::max());",
        {"1.2.1": (_INT[0], 341), "2.1.0": (_INT[1], 432)},
    ),
    (
        "internode.nvl_bytes_int_max",
        "host",
        "internode notify_dispatch: num_nvl_bytes < INT_MAX",
        "EP_HOST_ASSERT(num_nvl_bytes < std::numeric_limits<int>::max());",
        {"1.2.1": (_INT[0], 342), "2.1.0": (_INT[1], 433)},
    ),
    (
        "internode.cached_rdma_bytes_int_max",
        "host",
        "internode cached_notify (combine, cached dispatch): num_rdma_bytes < INT_MAX",
        "EP_HOST_ASSERT(num_rdma_bytes < std::numeric_limits<int>::max());",
        {"1.2.1": (_INT[0], 1207), "2.1.0": (_INT[1], 1517)},
    ),
    (
        "internode.num_channels",
        "host",
        "internode cached_notify: num_channels * 2 > 3 (num_sms >= 4)",
        "EP_HOST_ASSERT(num_channels * 2 > 3);",
        {"1.2.1": (_INT[0], 1209), "2.1.0": (_INT[1], 1519)},
    ),
    (
        "buffer.nvl_int_max",
        "host",
        "Buffer: num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0",
        "(num_nvl_bytes <= std::numeric_limits<int>::max() or num_rdma_bytes == 0)",
        {"1.2.1": (_CPP, 27), "2.1.0": (_LEG, 108)},
    ),
    (
        "buffer.rdma_int_max",
        "host",
        "Buffer: low_latency_mode or num_rdma_bytes <= INT_MAX",
        "(low_latency_mode or num_rdma_bytes <= std::numeric_limits<int>::max())",
        {"1.2.1": (_CPP, 28), "2.1.0": (_LEG, 110)},
    ),
    (
        "dispatch.scales_2d",
        "host",
        "dispatch: x_scales is 2-D",
        "EP_HOST_ASSERT(x_scales->dim() == 2);",
        {"1.2.1": (_CPP, 379), "2.1.0": (_LEG, 500)},
    ),
    (
        "elastic.max_ranks",
        "host",
        "elastic dispatch (WorkspaceLayout): num_ranks <= 1024",
        "EP_UNIFIED_ASSERT(num_ranks <= kNumMaxRanks);",
        {"2.1.0": ("deep_ep/include/deep_ep/common/layout.cuh", 38)},
    ),
    (
        "elastic.max_experts",
        "host",
        "elastic dispatch (WorkspaceLayout): num_experts <= 2048",
        "EP_UNIFIED_ASSERT(num_experts <= kNumMaxExperts);",
        {"2.1.0": ("deep_ep/include/deep_ep/common/layout.cuh", 39)},
    ),
    (
        "elastic.jit_capture",
        "behaviour",
        "elastic kernels compile at the first use of their template arguments (jit::compiler->build), which fails inside a CUDA-graph capture",
        'const auto runtime = jit::compiler->build("dispatch", code);',
        {"2.1.0": ("csrc/kernels/elastic/dispatch.hpp", 228)},
    ),
    (
        "capture.buffer_alloc",
        "behaviour",
        "a Buffer is built with cudaMalloc / IPC handles / barriers, which fail inside a CUDA-graph capture",
        "cudaMalloc(&",
        {"1.2.1": (_CPP, 49), "2.1.0": (_LEG, 149)},
    ),
    (
        "elastic.expert_id_range",
        "device",
        "no check in DeepEP V2: an expert id >= E indexes its per-expert and per-rank counters out of bounds",
        "atomicAdd_block(expert_count + dst_expert_idx, 1)",
        {},
    ),
]


def capturing(module: Any) -> bool:
    """Whether the emulated module is inside ``emu_capture`` (a CUDA-graph capture)."""
    return bool(getattr(module, "emu_capturing", False))


@contextlib.contextmanager
def emu_capture(module: Any) -> Iterator[None]:
    """Run the body as inside a CUDA-graph capture (the emulated runtime's view)."""
    before = capturing(module)
    module.emu_capturing = True
    try:
        yield
    finally:
        module.emu_capturing = before


def check_buffer(module: Any, rel: str, num_nvl_bytes: int, num_rdma_bytes: int, ll: bool) -> None:
    """E2 / E7 at ``Buffer`` construction."""
    from . import limits

    limits.host_assert(
        num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0,
        "buffer.nvl_int_max",
        rel,
        f"{num_nvl_bytes}",
    )
    limits.host_assert(
        ll or num_rdma_bytes <= INT_MAX, "buffer.rdma_int_max", rel, f"{num_rdma_bytes}"
    )
    alloc(module, rel, "Buffer")


def alloc(module: Any, rel: str, what: str) -> None:
    """E7: a buffer built inside a capture fails (cudaMalloc, IPC, barriers)."""
    from . import limits

    if capturing(module):
        raise limits.DeepEPHostAssert(
            f"{what} built inside a CUDA-graph capture: operation not permitted when stream is "
            f"capturing [capture.buffer_alloc: {limits.LIMITS['capture.buffer_alloc'].cite(rel)}]"
        )


def check_internode_bytes(rt: Any, *, cached: bool) -> None:
    """E2: the byte limits of internode notify / cached notify."""
    from . import limits

    rel = rt.release
    lid = "internode.cached_rdma_bytes_int_max" if cached else "internode.rdma_bytes_int_max"
    limits.host_assert(rt.num_rdma_bytes < INT_MAX, lid, rel, f"{rt.num_rdma_bytes}")
    limits.host_assert(rt.num_nvl_bytes < INT_MAX, "internode.nvl_bytes_int_max", rel)


def check_node_span(rt: Any, is_token_in_rank: torch.Tensor) -> None:
    """E1: every token reaches at most ``min(N, 8)`` nodes."""
    from . import limits

    T, N, L = is_token_in_rank.shape[0], rt.num_rdma_ranks, rt.L
    if T == 0:
        return
    span = int(is_token_in_rank.view(T, N, L).any(-1).sum(-1).max())
    limits.device_trap(span <= min(N, 8), "internode.topk_rdma_ranks", rt.release, f"{span} nodes")


def jit(module: Any, rel: str, key: tuple) -> None:
    """E7: V2 compiles a kernel at the first use of its template arguments (counted in
    ``module.emu_v2_jit``); inside a capture that is an error."""
    from . import limits

    seen = module.__dict__.setdefault("emu_v2_jit", {})
    if key in seen:
        seen[key] += 1
        return
    if capturing(module):
        raise limits.DeepEPHostAssert(
            f"DeepJIT compile of {key[0]} inside a CUDA-graph capture "
            f"[elastic.jit_capture: {limits.LIMITS['elastic.jit_capture'].cite(rel)}]"
        )
    seen[key] = 1


def check_elastic_ids(rel: str, topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> None:
    """E3 and the id range of V2's dispatch."""
    from . import limits

    limits.host_assert(num_ranks <= 1024, "elastic.max_ranks", rel, f"R={num_ranks}")
    limits.host_assert(num_experts <= 2048, "elastic.max_experts", rel, f"E={num_experts}")
    if topk_idx.numel():
        hi = int(topk_idx.max())
        limits.device_trap(
            hi < num_experts, "elastic.expert_id_range", rel, f"id {hi} >= E={num_experts}"
        )
