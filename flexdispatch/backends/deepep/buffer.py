"""One ``deep_ep.Buffer`` per process and group, shared by every dispatcher on that group.

R ranks · e = E / R local experts.

DeepEP keeps its NVSHMEM state per process and its README builds one buffer per process, used by
every MoE layer for normal and low-latency kernels alike. ``SharedBuffer`` is that buffer here:
every ``DeepEPV1Backend`` on the same group and ``deep_ep`` module joins the same one, asks for what
its next call needs, and leaves on ``close()``. The buffer is

- sized to the largest need seen so far (the union of byte counts; never shrunk); a byte count
  that must grow at least doubles (``sizing.grow_geometric``), because DeepEP has no resize: a
  rebuild re-exchanges IPC handles and, with RDMA bytes, finalises and re-initialises NVSHMEM,
- reallocated only when a call needs more (or low-latency mode where it had none). A
  reallocation is collective, like DeepEP's constructor: it happens at the same call on every
  rank, because every rank runs the same sequence of dispatches with the same shapes (the
  agreement check, with checks on, makes a mismatch an error instead), and only once every rank
  agreed the new buffer fits (``refusals.agree_buffer_fits``: a rank whose ``cudaMalloc`` failed
  inside DeepEP's constructor would leave its peers waiting in its IPC exchange),
- created with ``num_qps_per_rank = max(24, num_sms, e)`` QPs, which satisfies both DeepEP's
  internode normal kernels (``num_rc_per_pe == num_channels or >= num_sms``) and its low-latency
  kernels (``num_rc_per_pe >= e``) — see ``rules``,
- destroyed when its last user closes.

``SharedBoundedBuffer`` is the same for the token-bounded releases, sized with their
``get_buffer_size_hint``: ``SharedV2Buffer`` for DeepEP V2's ``deep_ep.ElasticBuffer`` here, and
``v25.buffer.SharedV25Buffer`` for DeepEP 2.5's ``EPBuffer``.

``generation`` counts reallocations: a low-latency result lives in the buffer's memory, so a result
from an older generation is gone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch.distributed as dist

from flexdispatch.backends.deepep import refusals, sizing
from flexdispatch.distributed import collective_device

__all__ = [
    "BoundedSize",
    "SharedBoundedBuffer",
    "SharedBuffer",
    "SharedV2Buffer",
    "acquire",
    "acquire_v2",
    "live_buffers",
]

_LOCK = threading.Lock()
_BUFFERS: dict[tuple[int, int], SharedBuffer] = {}


@dataclass(eq=False)
class SharedBuffer:
    """The ``deep_ep.Buffer`` of one ``(deep_ep module, group)`` pair in this process.

    Attributes:
        deep_ep: the module whose ``Buffer`` is used.
        group: the process group.
        users: ids of the backends that joined and have not closed.
        buffer: the live ``deep_ep.Buffer`` or None.
        size: its byte counts.
        low_latency: whether it was built in low-latency mode.
        num_qps_per_rank: the QPs it was built with.
        generation: reallocations so far.
        allocations: buffers built so far (statistics).
        normal_kernel_ran: a normal kernel used the buffer since the last low-latency clean.
        normal_calls: normal kernels run on the buffer (a low-latency result does not survive
            one: its rows live in the buffer's memory).
        low_latency_calls: low-latency kernels run on the buffer (DeepEP alternates two halves,
            so a result survives one more low-latency kernel, not two).
        nvshmem_reinits: rebuilds of a buffer with RDMA bytes (NVSHMEM finalised and
            initialised again; kept rare by ``sizing.grow_geometric``).
        low_latency_captured: a low-latency kernel on it was captured in a CUDA graph (normal
            internode kernels are refused from then on: ``refusals.check_low_latency_graph``).
    """

    deep_ep: ModuleType
    group: Any
    users: set[int] = field(default_factory=set)
    buffer: Any = None
    size: sizing.BufferSize | None = None
    low_latency: bool = False
    num_qps_per_rank: int = 0
    generation: int = 0
    allocations: int = 0
    normal_kernel_ran: bool = False
    normal_calls: int = 0
    low_latency_calls: int = 0
    nvshmem_reinits: int = 0
    low_latency_captured: bool = False

    def ensure(self, need: sizing.BufferSize, *, low_latency: bool, num_qps_per_rank: int) -> Any:
        """The live buffer, (re)built collectively when ``need`` outgrows it."""
        grow = sizing.grow_buffer_size(self.size, need)
        ll = self.low_latency or low_latency
        qps = max(self.num_qps_per_rank, num_qps_per_rank)
        same_mode = ll == self.low_latency and qps <= self.num_qps_per_rank
        if self.buffer is not None and grow is None and same_mode:
            return self.buffer
        new = need if self.size is None else self.size.union(need)
        if grow is not None and self.size is not None:
            new = sizing.grow_geometric(self.size, new) or new  # NOTE: rebuilt O(log) times
        if self.buffer is not None and self.size is not None and self.size.num_rdma_bytes:
            self.nvshmem_reinits += 1
        refusals.check_no_capture(
            f"DeepEP's Buffer would be {'created' if self.buffer is None else 'grown'} "
            f"({new.num_nvl_bytes} NVLink / {new.num_rdma_bytes} RDMA bytes)"
        )
        total = new.num_nvl_bytes + new.num_rdma_bytes
        held = 0 if self.size is None else self.size.num_nvl_bytes + self.size.num_rdma_bytes
        refusals.agree_buffer_fits(
            self.group,
            "DeepEP Buffer",
            num_bytes=total,
            held=held if self.buffer is not None else 0,
            device=collective_device(self.group),
            setting="num_nvl_bytes + num_rdma_bytes",
            value=f"{new.num_nvl_bytes} + {new.num_rdma_bytes}",
            detail=f"{total} bytes (DeepEP's size hints for these rows, low-latency part included)",
            fix=(
                "dispatch narrower rows, fewer low-latency tokens per rank "
                "(num_max_dispatch_tokens_per_rank), or run on a device with more free memory"
            ),
            module=self.deep_ep,
        )
        self._destroy()
        self.buffer = self.deep_ep.Buffer(
            self.group,
            num_nvl_bytes=new.num_nvl_bytes,
            num_rdma_bytes=new.num_rdma_bytes,
            low_latency_mode=ll,
            num_qps_per_rank=qps,
            explicitly_destroy=True,
        )
        self.size, self.low_latency, self.num_qps_per_rank = new, ll, qps
        self.generation += 1
        self.allocations += 1
        self.normal_kernel_ran = False
        return self.buffer

    def _destroy(self) -> None:
        _destroy(self)

    def leave(self, user: int) -> None:
        """``user`` closes; the buffer is destroyed when nobody uses it any more."""
        if _leave(self, _BUFFERS, user):
            self.size = None


def _destroy(shared: Any) -> None:
    if shared.buffer is not None:
        shared.buffer.destroy()
        shared.buffer = None


def _leave(shared: Any, registry: dict, user: int) -> bool:
    """Drop ``user``; the last one out unregisters and destroys the buffer (returns True)."""
    with _LOCK:
        shared.users.discard(user)
        if shared.users:
            return False
        for key, value in list(registry.items()):
            if value is shared:
                del registry[key]
    shared._destroy()
    return True


def _key(deep_ep: ModuleType, group: Any) -> tuple[int, int]:
    return id(deep_ep), id(group if group is not None else dist.group.WORLD)


def acquire(deep_ep: ModuleType, group: Any, user: int) -> SharedBuffer:
    """Join the shared buffer of ``(deep_ep, group)`` (created empty on first use)."""
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        key = _key(deep_ep, group)
        shared = _BUFFERS.get(key)
        if shared is None:
            shared = _BUFFERS[key] = SharedBuffer(deep_ep=deep_ep, group=group)
        shared.users.add(user)
        return shared


def live_buffers() -> int:
    """Shared buffers alive in this process (for tests and ``doctor``)."""
    with _LOCK:
        v1 = sum(1 for b in _BUFFERS.values() if b.buffer is not None)
        return v1 + sum(1 for b in _V2.values() if b.buffer is not None)


# ------------------------------------------------------ DeepEP V2 and 2.5 (a token-bounded buffer)
@dataclass(frozen=True)
class BoundedSize:
    """What a V2 / V2.5 buffer is sized for: M tokens per rank, H bf16 columns, k top-k."""

    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int

    def union(self, other: BoundedSize) -> BoundedSize:
        return BoundedSize(
            max(self.num_max_tokens_per_rank, other.num_max_tokens_per_rank),
            max(self.hidden, other.hidden),
            max(self.num_topk, other.num_topk),
        )


@dataclass(eq=False)
class SharedBoundedBuffer:
    """The buffer of a token-bounded release (DeepEP V2's ``ElasticBuffer``, DeepEP 2.5's
    ``EPBuffer``) of one ``(module, group, ...)`` in this process: sized with the class's
    ``get_buffer_size_hint`` for the union of what its users asked for, rebuilt — collectively,
    at the same call on every rank, once every rank agreed the new size fits — only when a call
    needs more bytes, destroyed when its last user closes.

    Attributes:
        deep_ep: the module whose buffer class is used.
        group: the process group.
        users: ids of the backends that joined and have not closed.
        buffer: the live buffer or None.
        size: what it was sized for; ``num_bytes`` its byte count (the size hint).
        allocations: buffers built so far (statistics).
    """

    deep_ep: ModuleType
    group: Any
    users: set[int] = field(default_factory=set)
    buffer: Any = None
    size: BoundedSize | None = None
    num_bytes: int = 0
    allocations: int = 0

    label = ""  # NOTE: the buffer in messages, e.g. "DeepEP V2 ElasticBuffer"
    hybrid = False  # NOTE: allow_hybrid_mode

    def _buffer_class(self) -> Any:
        raise NotImplementedError

    def _refuse_capture(self, num_bytes: int, new: BoundedSize) -> None:
        """Raise: a (re)build is about to happen inside a CUDA-graph capture."""
        refusals.check_no_capture(
            f"DeepEP's {self.label} would be {'created' if self.buffer is None else 'grown'} "
            f"({num_bytes} bytes)"
        )

    def _build_options(self) -> dict[str, Any]:
        """Constructor arguments of this release beside the size (agreed before the build)."""
        return {}

    def settle(self) -> None:
        """Finish what a call left pending on the buffer before the next one reaches it."""

    def ensure(self, need: BoundedSize, *, tokens: int = 0, worst: int = 0) -> Any:
        """The live buffer, (re)built collectively when ``need`` needs more bytes, after every
        rank agreed that the new size fits (``refusals.agree_buffer_fits``; ``tokens``: the
        largest T a rank dispatched, ``worst``: W, for its message). What a call left pending
        is settled first: every DeepEP call on the buffer comes through here.

        Raises:
            ValueError: on every rank, the new buffer does not fit on some rank.
            RuntimeError: it would be (re)built inside a CUDA-graph capture.
        """
        self.settle()
        new = need if self.size is None else self.size.union(need)
        if self.buffer is not None and new == self.size:
            return self.buffer
        cls = self._buffer_class()
        num_bytes = cls.get_buffer_size_hint(
            self.group,
            new.num_max_tokens_per_rank,
            new.hidden,
            new.num_topk,
            False,  # use_fp8_dispatch: a bf16-sized buffer also holds fp8 rows and scales
            self.hybrid,
            True,  # allow_multiple_reduction
        )
        if self.buffer is not None and num_bytes <= self.num_bytes:
            self.size = new
            return self.buffer
        self._refuse_capture(num_bytes, new)
        setting = "num_worst_tokens" if worst else "num_max_dispatch_tokens_per_rank"
        M = new.num_max_tokens_per_rank
        peak = f", the largest T a rank dispatched {tokens}" if tokens else ""
        refusals.agree_buffer_fits(
            self.group,
            self.label,
            num_bytes=num_bytes,
            held=self.num_bytes,
            device=collective_device(self.group),
            setting=setting,
            value=worst if worst else M,
            detail=(
                f"{num_bytes} bytes in all for M={M} tokens per rank{peak}, H={new.hidden} bf16 "
                f"columns, k={new.num_topk}; the {self.num_bytes} bytes of the buffer it replaces "
                f"are freed first"
            ),
            fix=(
                f"dispatch fewer tokens per rank in one call (split the batch), or set a smaller "
                f"DispatchConfig.{setting}"
            ),
            module=self.deep_ep,
        )
        options = self._build_options()
        self._destroy()
        self.buffer = cls(
            self.group,
            num_bytes=num_bytes,
            num_max_tokens_per_rank=new.num_max_tokens_per_rank,
            hidden=new.hidden,
            num_topk=new.num_topk,
            allow_hybrid_mode=self.hybrid,
            allow_multiple_reduction=True,
            explicitly_destroy=True,
            **options,
        )
        self.size, self.num_bytes = new, num_bytes
        self.allocations += 1
        return self.buffer

    def _destroy(self) -> None:
        self.settle()
        _destroy(self)

    def _registry(self) -> dict:
        raise NotImplementedError

    def leave(self, user: int) -> None:
        """``user`` closes; the buffer is destroyed when nobody uses it any more."""
        if _leave(self, self._registry(), user):
            self.size, self.num_bytes = None, 0


_V2: dict[tuple, SharedV2Buffer] = {}


@dataclass(eq=False)
class SharedV2Buffer(SharedBoundedBuffer):
    """The ``deep_ep.ElasticBuffer`` of one ``(deep_ep module, group)``: the V2 counterpart of
    ``SharedBuffer``, in direct mode (``allow_hybrid_mode=False``)."""

    label = "DeepEP V2 ElasticBuffer"

    def _buffer_class(self) -> Any:
        return self.deep_ep.ElasticBuffer

    def _registry(self) -> dict:
        return _V2


def acquire_v2(deep_ep: ModuleType, group: Any, user: int) -> SharedV2Buffer:
    """Join the shared ``ElasticBuffer`` of ``(deep_ep, group)`` (created empty on first use)."""
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        key = _key(deep_ep, group)
        shared = _V2.get(key)
        if shared is None:
            shared = _V2[key] = SharedV2Buffer(deep_ep=deep_ep, group=group)
        shared.users.add(user)
        return shared
