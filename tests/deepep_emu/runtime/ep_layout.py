"""DeepEP V2.5's sizes, domains and JIT templates, as the emulated ``EPBuffer`` computes them.

TEST-ONLY. Shape letters: H hidden · E experts · R ranks · e = E / R · k top-k ·
M = ``num_max_tokens_per_rank`` · N scale-out ranks (nodes in hybrid mode, else 1) · U scale-up
ranks (the NVLink domain in hybrid mode, else R) · C channels (hybrid mode).

Paths below are relative to the ``sgl-deep-ep-v25`` wheel's ``deep_ep_v25/`` folder. Limits go
through ``limits`` (``ep.*`` ids, registered from ``ep_limits``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from . import limits

__all__ = [
    "ALIGNMENT",
    "DEVICE_SMEM",
    "DEVICE_SMS",
    "REL",
    "Domains",
    "calculate_buffer_size",
    "combine_bytes",
    "dispatch_bytes",
    "dispatch_warps",
    "domains",
    "hybrid_channels",
    "jit_compile",
    "token_bytes",
]

REL = "2.5.0"
ALIGNMENT = 2 * 1024 * 1024  # kNumAllocationAlignmentBytes (common/compiled.cuh:69)
DEVICE_SMS = 132  # the emulated device (an H800/H100 SXM)
DEVICE_SMEM = 232448  # its opt-in shared memory per block (227 KiB)
NOTIFY_WARPS = 4  # kNumNotifyWarps (kernels/ep/dispatch.hpp:20)
MAX_CHANNELS_PER_SM = 8  # EPBuffer::kNumMaxChannelsPerSM (buffers/ep.hpp:41)
MAX_CHANNELS = 8 * 160  # EPBuffer::kNumMaxChannels (buffers/ep.hpp:43)
MBARRIER_BYTES = 8  # sizeof(cuda::barrier<thread_scope_block>)


def _a(x: int, b: int) -> int:
    return -(-x // b) * b


def token_bytes(hidden_bytes: int, sf_bytes: int, k: int, meta: bool, mbarrier: bool) -> int:
    """``layout::TokenLayout::get_num_bytes`` (layout/ep/token.cuh:17-41), with its assert: the
    row, the scales and ``k`` (int id, float weight) pairs (+ ``1 + k`` ints of metadata), each
    32-byte aligned, the whole 64-byte aligned (+ an mbarrier in shared memory)."""
    limits.host_assert(
        hidden_bytes % 32 == 0, "ep.token_hidden_bytes", REL, f"{hidden_bytes} bytes"
    )
    meta_bytes = k * 8 + ((1 + k) * 4 if meta else 0)
    data = _a(_a(hidden_bytes, 32) + _a(sf_bytes, 32) + _a(meta_bytes, 32), 64)
    return data + (_a(MBARRIER_BYTES, 32) if mbarrier else 0)


class Domains:
    """The context's domains (kernels/comm/context.cpp:52-62, 166-183).

    Attributes:
        rdma, nvl: physical RDMA ranks (nodes) and NVLink ranks per node.
        scaleout, scaleup: logical N and U (hybrid: ``(rdma, nvl)``; direct: ``(1, R)``).
        nvlink: ``is_scaleup_nvlink`` (U == nvl).
    """

    def __init__(self, num_ranks: int, nvl_peers: int, hybrid: bool) -> None:
        nvl = min(nvl_peers, num_ranks)
        limits.host_assert(
            num_ranks % nvl == 0, "ep.nvl_ranks", REL, f"R={num_ranks}, NVLink domain {nvl}"
        )
        self.rdma, self.nvl = num_ranks // nvl, nvl
        self.scaleout, self.scaleup = (self.rdma, nvl) if hybrid else (1, num_ranks)
        self.nvlink = self.scaleup == nvl


def domains(num_ranks: int, nvl_peers: int, hybrid: bool) -> Domains:
    return Domains(num_ranks, nvl_peers, hybrid)


def dispatch_bytes(M: int, hidden: int, packs: int, k: int, elem: int, d: Domains) -> int:
    """``EPBuffer::get_dispatch_buffer_size`` (buffers/ep.hpp:183-211)."""
    tok = token_bytes(hidden * elem, packs * 4, k, True, False)
    N, U = d.scaleout, d.scaleup
    if N == 1:
        return (0 if d.nvlink else 1) * M * tok + N * U * M * tok
    return U * N * M * tok + M * tok + N * (M + MAX_CHANNELS) * tok


def combine_bytes(M: int, hidden: int, k: int, d: Domains, amr: bool) -> int:
    """``EPBuffer::get_combine_buffer_size`` (buffers/ep.hpp:213-247)."""
    tok = token_bytes(hidden * 2, 0, k, False, False)
    N, U = d.scaleout, d.scaleup
    R = N * U
    if N == 1:
        layout = min(R, k) if amr else k
        send = (0 if d.nvlink else R) * M * (1 if amr else k) * tok
        return send + layout * M * tok
    up = (min(U, k) if amr else k) * N * M * tok
    out = (min(N, k) if amr else k) * M * tok
    return up + out + (1 if amr else k) * N * (M + MAX_CHANNELS) * tok


def calculate_buffer_size(
    R: int, L: int, M: int, hidden: int, k: int, fp8: bool, hybrid: bool, amr: bool
) -> int:
    """``EPBuffer::calculate_buffer_size`` (buffers/ep.hpp:249-283)."""
    limits.host_assert(M > 0 and hidden > 0, "ep.size_args", REL, f"M={M}, hidden={hidden}")
    limits.host_assert(math.ceil(hidden / 32) * 4 <= hidden, "ep.size_sf", REL)
    k = 32 if k == 0 else k
    d = domains(R, L, hybrid)
    packs = math.ceil(hidden / 32) if fp8 else 0
    disp = dispatch_bytes(M, hidden, packs, k, 1 if fp8 else 2, d)
    comb = combine_bytes(M, hidden, k, d, amr)
    return _a(max(disp, comb), ALIGNMENT)


def notify_smem(R: int, E: int) -> int:
    """``get_num_notify_smem_bytes`` (kernels/ep/dispatch.hpp:22-24)."""
    return _a(R + E, NOTIFY_WARPS * 32) * 4


def hybrid_channels(
    R: int, E: int, hidden: int, elem: int, packs: int, k: int, num_sms: int, overlap: bool
) -> int:
    """Channels of a hybrid dispatch (buffers/ep.hpp:437-456): as many per SM as shared memory
    holds dispatch and combine rows for, halved, at most 8 (4 without overlap); 0 for rows too
    wide for two (DeepEP does not clamp: ``ep.hybrid_zero_channels``)."""
    dtok = token_bytes(hidden * elem, packs * 4, k, True, True)
    ctok = token_bytes(hidden * 2, 0, k, False, True)
    per_sm = min((DEVICE_SMEM - notify_smem(R, E)) // dtok, 32 - NOTIFY_WARPS)
    per_sm = min(DEVICE_SMEM // ctok, per_sm)
    per_sm = min(per_sm // 2, MAX_CHANNELS_PER_SM)
    if not overlap:
        per_sm = min(per_sm, 4)
    return num_sms * max(per_sm, 0)


def dispatch_warps(R: int, E: int, hidden_bytes: int, packs: int, k: int, cached: bool) -> int:
    """Dispatch warps of the direct kernel (kernels/ep/dispatch.hpp:64-79): as many token rows as
    fit in shared memory next to the notify counters, at most ``32 - notify warps``."""
    notify_warps = 0 if cached else NOTIFY_WARPS
    smem = 0 if cached else notify_smem(R, E)
    tok = token_bytes(hidden_bytes, packs * 4, k, True, True)
    return min((DEVICE_SMEM - smem) // tok, 32 - notify_warps)


# --------------------------------------------------------------------- JIT (DeepJIT)
def capturing(mod: Any) -> bool:
    """Whether a CUDA graph is being captured (emulated by ``mod.emu_capture()``)."""
    if getattr(mod, "emu_capturing", False):
        return True
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def emu_capture(mod: Any) -> Iterator[None]:
    """Run the body as inside a CUDA-graph capture (the emulated runtime's view)."""
    before = mod.emu_capturing
    mod.emu_capturing = True
    try:
        yield
    finally:
        mod.emu_capturing = before


def jit_compile(mod: Any, name: str, template: tuple) -> None:
    """``jit->compile(name, <template>)``: a new template compiles (counted in
    ``mod.emu_jit_compiles``); inside a capture that is an error (``ep.jit_capture``)."""
    key = (name, template)
    if key in mod.emu_jit_cache:
        return
    if capturing(mod):
        lim = limits.LIMITS["ep.jit_capture"]
        raise RuntimeError(
            f"DeepEP JIT: compiling kernel {name}<{', '.join(map(str, template))}> at its first "
            f"use inside a CUDA-graph capture: {lim.text} [ep.jit_capture: {lim.cite(REL)}]"
        )
    mod.emu_jit_cache.add(key)
    mod.emu_jit_compiles[name] += 1
