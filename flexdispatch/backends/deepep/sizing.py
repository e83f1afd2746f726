"""Pure helpers of the DeepEP backend: buffer sizing, support checks, worst-case masking.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows.

Nothing here imports ``deep_ep``: the sizing functions take the module as an argument (the real
library, or the test emulator), so they can be unit-tested on any machine. The tensor helpers
never read a value on the host (no ``.item()``, no ``bincount``, no boolean indexing), so they
can run inside a captured CUDA graph.

Limits below are those of DeepEP's release tag ``v1.2.1`` (``csrc/kernels/launch.cuh``,
``csrc/kernels/configs.cuh``, ``deep_ep/buffer.py``); later releases only add to them, which is
why the checks take the lists as arguments.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from flexdispatch.backends.base import Capability
from flexdispatch.backends.deepep.limits import (
    INTERNODE_NODE_COUNTS,
    INTRANODE_RANK_COUNTS,
    LOW_LATENCY_HIDDEN_SIZES,
    LOW_LATENCY_MAX_TOKENS_PER_RANK,
    LOW_LATENCY_MAX_TOPK,
    MAX_TOPK,
    NUM_BUFFER_ALIGNMENT_BYTES,
    NUM_MAX_LOCAL_EXPERTS,
    NUM_MAX_NVL_PEERS,
    check_topology,
)

__all__ = [
    "NUM_BUFFER_ALIGNMENT_BYTES",
    "NUM_MAX_NVL_PEERS",
    "INTRANODE_RANK_COUNTS",
    "INTERNODE_NODE_COUNTS",
    "MAX_TOPK",
    "NUM_MAX_LOCAL_EXPERTS",
    "LOW_LATENCY_HIDDEN_SIZES",
    "LOW_LATENCY_MAX_TOPK",
    "LOW_LATENCY_MAX_TOKENS_PER_RANK",
    "BufferSize",
    "MaskedWorstCase",
    "count_valid",
    "pad_cols",
    "pad_tokens",
    "WireFormat",
    "align_bytes",
    "hidden_bytes",
    "normal_buffer_size",
    "normal_configs",
    "low_latency_buffer_size",
    "grow_buffer_size",
    "grow_geometric",
    "check_topology",
    "check_row_bytes",
    "check_low_latency",
    "valid_rows",
    "zero_invalid_rows",
    "zero_invalid_rows_",
    "count_local_experts",
    "mask_worst_case",
    "expert_major_valid_mask",
]


@dataclass(frozen=True, kw_only=True)
class BufferSize:
    """Byte counts of one ``deep_ep.Buffer`` (each a multiple of 128).

    Attributes:
        num_nvl_bytes: NVLink (intranode IPC) buffer.
        num_rdma_bytes: NVSHMEM buffer (internode normal kernels and low-latency kernels).
    """

    num_nvl_bytes: int
    num_rdma_bytes: int

    def covers(self, other: BufferSize) -> bool:
        """Whether a buffer of this size can serve a call that needs ``other``."""
        return (
            self.num_nvl_bytes >= other.num_nvl_bytes
            and self.num_rdma_bytes >= other.num_rdma_bytes
        )

    def union(self, other: BufferSize) -> BufferSize:
        """The smallest size that covers both."""
        return BufferSize(
            num_nvl_bytes=max(self.num_nvl_bytes, other.num_nvl_bytes),
            num_rdma_bytes=max(self.num_rdma_bytes, other.num_rdma_bytes),
        )


def align_bytes(num_bytes: int, alignment: int = NUM_BUFFER_ALIGNMENT_BYTES) -> int:
    """``num_bytes`` rounded up to a multiple of ``alignment``."""
    if num_bytes < 0 or alignment <= 0:
        raise ValueError(
            f"align_bytes needs num_bytes >= 0 and alignment > 0, got {num_bytes}, {alignment}"
        )
    return -(-num_bytes // alignment) * alignment


def hidden_bytes(hidden: int, element_size: int) -> int:
    """Bytes DeepEP's sizing hints assume per row: ``H * max(element_size, 2)``.

    The factor ``max(., 2)`` makes an fp8 buffer large enough for the bf16 combine that follows.
    """
    if hidden <= 0 or element_size <= 0:
        raise ValueError(f"hidden ({hidden}) and element_size ({element_size}) must be positive")
    return hidden * max(element_size, 2)


def normal_configs(
    deep_ep: ModuleType, num_ranks: int, num_sms: int | None = None
) -> tuple[Any, Any]:
    """``(Buffer.get_dispatch_config(R), Buffer.get_combine_config(R))`` for ``num_sms`` SMs
    (None: the current ``Buffer.num_sms``), built once per ``(module, R, num_sms)``.

    DeepEP's ``Buffer.dispatch`` / ``combine`` rebuild these tables (12 pybind ``Config``
    objects each, deep_ep/buffer.py:232-271) on every call that passes no ``config``: the adapter
    passes these instead. DeepEP's tables read the class attribute ``Buffer.num_sms``
    (``set_num_sms`` is process-wide, deep_ep/buffers/legacy.py:153-163, and a pybind ``Config``
    has no readable fields), so a backend's own count is set on the class only while its tables
    are built, under a lock, and put back: a second dispatcher never changes an earlier one's
    channels (issue 44, Q7).

    Raises:
        ValueError: DeepEP has no config for R.
    """
    buffer_cls = deep_ep.Buffer
    sms = int(getattr(buffer_cls, "num_sms", 0)) if num_sms is None else int(num_sms)
    key = (id(deep_ep), num_ranks, sms)
    cached = _CONFIGS.get(key)
    if cached is not None:
        return cached[1]
    try:
        with _SMS_LOCK:
            saved = getattr(buffer_cls, "num_sms", None)
            buffer_cls.num_sms = sms
            try:
                got = (
                    buffer_cls.get_dispatch_config(num_ranks),
                    buffer_cls.get_combine_config(num_ranks),
                )
            finally:
                buffer_cls.num_sms = saved
    except (AssertionError, KeyError, RuntimeError) as exc:
        raise ValueError(
            f"DeepEP has no tuned config for {num_ranks} ranks ({exc}): use the torch backend or "
            f"a supported expert-parallel size"
        ) from exc
    # NOTE: the module is kept in the value, so its id cannot be reused while cached
    _CONFIGS[key] = (deep_ep, got)
    return got


# (id(module), R, num_sms) -> (module, (dispatch config, combine config))
_CONFIGS: dict[tuple[int, int, int], tuple[Any, tuple[Any, Any]]] = {}
_SMS_LOCK = threading.Lock()


def normal_buffer_size(
    deep_ep: ModuleType, num_ranks: int, row_bytes: int, num_sms: int | None = None
) -> BufferSize:
    """Buffer size for the normal (high-throughput) kernels, from DeepEP's own configs.

    The max over ``Buffer.get_dispatch_config(R)`` and ``Buffer.get_combine_config(R)`` of
    ``get_nvl_buffer_size_hint`` and ``get_rdma_buffer_size_hint`` — DeepEP's recommended recipe.
    Cached per ``(module, R, num_sms, row_bytes)`` (``num_sms`` None: ``Buffer.num_sms``):
    DeepEP's tables build ~24 pybind ``Config`` objects per lookup, which every dispatch and
    combine would otherwise repeat.

    Args:
        deep_ep: the ``deep_ep`` module (or the emulator).
        num_ranks: R.
        row_bytes: ``hidden_bytes(H, element_size)``.

    Raises:
        ValueError: DeepEP has no config for R.
    """
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes}")
    sms = int(getattr(deep_ep.Buffer, "num_sms", 0)) if num_sms is None else int(num_sms)
    key = (id(deep_ep), num_ranks, sms, row_bytes)
    cached = _NORMAL_SIZES.get(key)
    if cached is not None:
        return cached[1]
    nvl = rdma = 0
    for cfg in normal_configs(deep_ep, num_ranks, sms):
        nvl = max(nvl, int(cfg.get_nvl_buffer_size_hint(row_bytes, num_ranks)))
        rdma = max(rdma, int(cfg.get_rdma_buffer_size_hint(row_bytes, num_ranks)))
    hit = BufferSize(num_nvl_bytes=align_bytes(nvl), num_rdma_bytes=align_bytes(rdma))
    if len(_NORMAL_SIZES) >= _MAX_CACHED_SIZES:
        _NORMAL_SIZES.clear()
    # NOTE: the module is kept in the value, so its id cannot be reused while cached
    _NORMAL_SIZES[key] = (deep_ep, hit)
    return hit


# (id(module), R, num_sms, row_bytes) -> (module, size); bounded (row widths are few)
_NORMAL_SIZES: dict[tuple[int, int, int, int], tuple[Any, BufferSize]] = {}
_MAX_CACHED_SIZES = 1024


def low_latency_buffer_size(
    deep_ep: ModuleType,
    *,
    num_max_dispatch_tokens_per_rank: int,
    hidden: int,
    num_ranks: int,
    num_experts: int,
) -> BufferSize:
    """Buffer size for the low-latency kernels (``Buffer.get_low_latency_rdma_size_hint``)."""
    rdma = int(
        deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )
    )
    return BufferSize(num_nvl_bytes=0, num_rdma_bytes=align_bytes(rdma))


def grow_buffer_size(current: BufferSize | None, required: BufferSize) -> BufferSize | None:
    """Growth policy: reuse a buffer that is large enough, otherwise grow it (never shrink).

    Args:
        current: size of the live buffer, or None when there is none yet.
        required: what the next call needs.

    Returns:
        None to keep the current buffer, else the size of the buffer to allocate in its place
        (the union of both, so alternating shapes do not reallocate back and forth).
    """
    if current is None:
        return required
    if current.covers(required):
        return None
    return current.union(required)


def check_row_bytes(hidden: int, element_size: int) -> Capability:
    """DeepEP moves rows in 16-byte units: ``H * element_size`` must be a multiple of 16."""
    if hidden <= 0:
        return False, f"hidden size must be positive, got {hidden}"
    if (hidden * element_size) % 16:
        return False, (
            f"rows of {hidden} x {element_size} bytes are not a multiple of 16 bytes, which "
            f"DeepEP's kernels require: pad the hidden size"
        )
    return True, f"rows of {hidden * element_size} bytes"


def check_low_latency(
    *,
    hidden: int,
    topk: int,
    num_experts: int,
    num_ranks: int,
    num_max_dispatch_tokens_per_rank: int,
    hidden_sizes: Sequence[int] = LOW_LATENCY_HIDDEN_SIZES,
) -> Capability:
    """Whether DeepEP's low-latency (decode) kernels accept this shape.

    Args:
        hidden: H.
        topk: k.
        num_experts: E.
        num_ranks: R.
        num_max_dispatch_tokens_per_rank: tokens per rank and call the buffers are sized for.
        hidden_sizes: H compiled into the kernels.
    """
    if hidden not in hidden_sizes:
        sizes = ", ".join(map(str, hidden_sizes))
        return False, (
            f"DeepEP's low-latency kernels are compiled for hidden sizes {sizes}, not {hidden}: "
            f"pad the rows or use the torch backend's decode layout"
        )
    if not 0 < topk <= LOW_LATENCY_MAX_TOPK:
        return (
            False,
            f"low-latency kernels accept 1..{LOW_LATENCY_MAX_TOPK} experts per token, got {topk}",
        )
    if num_ranks < 2 or num_experts % num_ranks:
        return False, f"num_experts={num_experts} must be divisible by {num_ranks} >= 2 ranks"
    if not 0 < num_max_dispatch_tokens_per_rank <= LOW_LATENCY_MAX_TOKENS_PER_RANK:
        return False, (
            f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank} must be in "
            f"1..{LOW_LATENCY_MAX_TOKENS_PER_RANK} for DeepEP's low-latency kernels"
        )
    return (
        True,
        f"low-latency: H={hidden}, k={topk}, up to {num_max_dispatch_tokens_per_rank} tokens",
    )


#: Geometric growth stops doubling here: below DeepEP's ``INT_MAX`` byte checks (deep_ep.cpp:27-28,
#: internode.cu:341-342), 128-aligned. A need beyond it is taken as is.
MAX_GEOMETRIC_BYTES = 2**31 - 128


def grow_geometric(current: BufferSize | None, required: BufferSize) -> BufferSize | None:
    """``grow_buffer_size``, but a byte count that must grow at least doubles.

    Every rebuild of a buffer with RDMA bytes finalises and re-initialises NVSHMEM (DeepEP has
    no resize; NVSHMEM documents a second init as undefined, and it is slow, DeepEP #571), and
    every rebuild exchanges IPC handles: doubling bounds a run to ``log2(largest / first)``
    rebuilds instead of one per new row width.
    """
    grow = grow_buffer_size(current, required)
    if grow is None or current is None:
        return grow

    def step(cur: int, need: int) -> int:
        return cur if need <= cur else max(need, min(2 * cur, MAX_GEOMETRIC_BYTES))

    return BufferSize(
        num_nvl_bytes=step(current.num_nvl_bytes, required.num_nvl_bytes),
        num_rdma_bytes=step(current.num_rdma_bytes, required.num_rdma_bytes),
    )


# --------------------------------------------------------------------- wire format
@dataclass(frozen=True, kw_only=True)
class WireFormat:
    """How ``[n, X]`` rows of ``dtype`` travel through DeepEP: ``[n, Xw]`` bf16 bit views.

    DeepEP's normal kernels copy rows in 16-byte units and document bf16 (or an fp8 tuple). A
    bf16 *view* of fp32 / fp16 rows (``2X`` / ``X`` columns) zero-padded to a multiple of 8
    columns moves any of them bit for bit and sizes the buffer correctly.

    Attributes:
        dtype: dtype of the rows.
        width: X, columns of the rows.
        wire_width: Xw, bf16 columns on the wire (a multiple of 8).
    """

    dtype: torch.dtype
    width: int
    wire_width: int

    @staticmethod
    def of(dtype: torch.dtype, width: int) -> WireFormat:
        """The wire format of bf16 / fp16 / fp32 rows of ``width`` columns."""
        elem = dtype.itemsize
        if elem < 2:
            raise ValueError(f"rows of {dtype} travel as an (x, scales) tuple, not a bit view")
        bf16_cols = width * elem // 2
        return WireFormat(dtype=dtype, width=width, wire_width=-(-bf16_cols // 8) * 8)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row on the wire (a multiple of 16)."""
        return self.wire_width * 2

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, X]`` rows -> ``[n, Xw]`` contiguous bf16 (bit view, zero padding)."""
        v = x.contiguous()
        if v.dtype != torch.bfloat16:
            v = v.view(torch.bfloat16)
        pad = self.wire_width - v.shape[1]
        return F.pad(v, (0, pad)) if pad else v

    def recv(self, w: torch.Tensor) -> torch.Tensor:
        """``[n, Xw]`` bf16 -> ``[n, X]`` rows of ``dtype`` (inverse of ``send``)."""
        elem = self.dtype.itemsize
        v = w[:, : self.width * elem // 2]
        if self.dtype == torch.bfloat16:
            return v.contiguous()
        if not v.is_contiguous() or (v.storage_offset() * 2) % elem:
            v = v.clone(memory_format=torch.contiguous_format)
        return v.view(self.dtype)


def split_rows(
    x: Any, *, fp8_multiple: int
) -> tuple[torch.Tensor, torch.Tensor | None, WireFormat]:
    """``(rows, scales or None, wire format)`` of a dispatch input: a tensor, or DeepEP's
    ``(float8_e4m3fn [T, H], scales)`` tuple whose H must be a multiple of ``fp8_multiple``."""
    if not isinstance(x, tuple):
        return x, None, WireFormat.of(x.dtype, x.shape[1])
    rows, scales = x
    if rows.dtype != torch.float8_e4m3fn or rows.shape[1] % fp8_multiple:
        raise ValueError(
            "an (x, scales) tuple must hold float8_e4m3fn rows whose hidden size is a "
            f"multiple of {fp8_multiple} (DeepEP's kernels here move fp8 rows in "
            f"{fp8_multiple}-byte units, else a device trap), got {rows.dtype} with "
            f"H={rows.shape[1]}: pad the hidden size to a multiple of {fp8_multiple}, or "
            f"dispatch bf16 rows"
        )
    wire = WireFormat(dtype=rows.dtype, width=rows.shape[1], wire_width=rows.shape[1] // 2)
    return rows, scales, wire


def check_topk(k: int, kernels: str) -> None:
    """DeepEP's dispatch kernels take at most ``MAX_TOPK`` experts per token (a device assert)."""
    if k > MAX_TOPK:
        raise ValueError(
            f"DeepEP's {kernels} take at most {MAX_TOPK} experts per token (a device assert), "
            f"got k={k}: use backend='torch' for wider top-k"
        )


# --------------------------------------------------------------------- sync-free tensor helpers
def valid_rows(recv_topk_idx: torch.Tensor) -> torch.Tensor:
    """``[W]`` bool: rows that were really received.

    A received row always carries at least one local expert (it was sent because the token has
    an expert here), and DeepEP sets every id of a worst-case tail row to ``-1``.

    Args:
        recv_topk_idx: ``[W, k]`` local expert ids, ``-1`` elsewhere.
    """
    return (recv_topk_idx >= 0).any(dim=-1)


def zero_invalid_rows(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` with every row where ``valid`` is False set to 0 (also NaN / inf garbage).

    Args:
        x: ``[W, ...]`` rows of any dtype (fp8 included).
        valid: ``[W]`` bool.
    """
    # NOTE: a select, not a multiply: garbage rows may hold NaN, and NaN * 0 is NaN.
    mask = valid.reshape(valid.shape + (1,) * (x.dim() - 1))
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_invalid_rows_(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """In place: every row of ``x`` where ``valid`` is False set to all-zero bits (0.0 in every
    floating dtype, fp8 included; NaN garbage too). Returns ``x``.

    For tensors the adapter owns (DeepEP's freshly allocated outputs): unlike
    ``zero_invalid_rows`` it allocates no second ``[W, ...]`` tensor.
    """
    mask = ~valid.reshape(valid.shape + (1,) * (x.dim() - 1))
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    x.view(bits).masked_fill_(mask, 0)
    return x


def count_local_experts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """``[e]`` int64 number of ``(row, slot)`` pairs per local expert, on the device.

    Uses ``scatter_add_`` into a spare bucket for ``-1`` instead of ``torch.bincount``, whose
    CUDA kernel reads the maximum id on the host (a sync, illegal during graph capture).

    Args:
        recv_topk_idx: ``[W, k]`` local expert ids in ``[0, e)``, ``-1`` elsewhere.
        num_local_experts: e.
    """
    if num_local_experts <= 0:
        raise ValueError(f"num_local_experts must be positive, got {num_local_experts}")
    ids = recv_topk_idx.reshape(-1).to(torch.int64)
    return count_valid(ids, (ids >= 0) & (ids < num_local_experts), num_local_experts)


def count_valid(ids: torch.Tensor, valid: torch.Tensor, e: int) -> torch.Tensor:
    """``[e]`` int64: how often each id in ``[0, e)`` appears where ``valid`` (4 device ops)."""
    counts = torch.zeros(e, dtype=torch.int64, device=ids.device)
    # NOTE: invalid slots add 0 at index 0 (clamped), so no spare bucket is needed
    return counts.scatter_add_(0, ids.clamp(0, e - 1), valid.to(torch.int64))


@dataclass(frozen=True, kw_only=True)
class MaskedWorstCase:
    """A worst-case receive with DeepEP's garbage removed.

    Attributes:
        recv_x: ``[W, H]`` rows, exactly 0 past the real ones.
        recv_topk_idx: ``[W, k]`` int64 local ids, ``-1`` elsewhere and on the tail.
        recv_topk_probs: ``[W, k]`` float32, 0 wherever ``recv_topk_idx == -1``.
        num_recv_tokens_per_expert: ``[e]`` int64 device tensor.
        valid: ``[W]`` bool, the real rows (kept for the cached dispatch of the backward pass).
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_probs: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    valid: torch.Tensor


def mask_worst_case(
    recv_x: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    recv_topk_probs: torch.Tensor,
    num_local_experts: int,
) -> MaskedWorstCase:
    """Clean a ``num_worst_tokens`` receive without any host synchronisation.

    DeepEP leaves the tail of ``recv_x`` and ``recv_topk_weights`` uninitialised, sets only the
    tail of ``recv_topk_idx`` to ``-1``, and returns an empty per-expert count list.

    Args:
        recv_x: ``[W, H]`` received rows (tail is garbage), zeroed in place (DeepEP allocates it
            fresh on every call): no second ``[W, H]`` tensor.
        recv_topk_idx: ``[W, k]`` local ids, ``-1`` elsewhere and on the tail.
        recv_topk_probs: ``[W, k]`` float32 (tail is garbage).
        num_local_experts: e.
    """
    if num_local_experts <= 0:
        raise ValueError(f"num_local_experts must be positive, got {num_local_experts}")
    idx = recv_topk_idx.to(torch.int64)
    has = idx >= 0  # DeepEP's ids are local ([0, e)) or -1
    valid = has.any(dim=-1)
    probs = torch.where(has, recv_topk_probs.to(torch.float32), 0.0)
    return MaskedWorstCase(
        recv_x=zero_invalid_rows_(recv_x, valid),
        recv_topk_idx=idx,
        recv_topk_probs=probs,
        num_recv_tokens_per_expert=count_valid(idx.reshape(-1), has.reshape(-1), num_local_experts),
        valid=valid,
    )


def expert_major_valid_mask(recv_count: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[e, capacity]`` bool: slot ``i`` of expert ``j`` holds a row iff ``i < recv_count[j]``.

    Args:
        recv_count: ``[e]`` integer rows per local expert (low-latency ``recv_count``).
        capacity: ``R * num_max_dispatch_tokens_per_rank``.
    """
    slots = torch.arange(capacity, device=recv_count.device)
    return slots[None, :] < recv_count.to(torch.int64)[:, None]


def pad_cols(w: torch.Tensor, multiple: int) -> torch.Tensor:
    """``w`` zero-padded to a multiple of ``multiple`` columns (contiguous)."""
    pad = -w.shape[1] % multiple
    return F.pad(w, (0, pad)) if pad else w.contiguous()


def pad_tokens(out: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``out`` with zero rows up to ``num_tokens``: the combine rows of the tokens a rank over its
    per-rank token bound did not send, else ``out`` as is."""
    missing = num_tokens - out.shape[0]
    return F.pad(out, (0, 0, 0, missing)) if missing > 0 else out
