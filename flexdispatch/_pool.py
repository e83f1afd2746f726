"""Reuse of the CPU memory behind tensors that dispatch and combine hand to the caller.

Why: on CPU there is no caching allocator. glibc serves every request of 32 MiB or more (and, with
its sliding threshold, often smaller ones) with a fresh ``mmap``, so each new ``[M, H]`` output is
page-faulted row by row on first write: about 8 ms for 32 MiB on a 2-core VM, as much as gloo's
transfer of the same rows. CUDA tensors never pay this (PyTorch's caching allocator), so this pool
only serves CPU tensors.

How: the pool keeps a strong reference to each buffer it has handed out and lends a buffer again
only once nothing else holds its storage: the storage's C++ use count
(``torch._C._storage_Use_Count``, the check ``torch._inductor``'s CUDA-graph trees use for the
same purpose) and the Python reference count of its storage object (which PyTorch keeps alive
with the storage, so a caller holding ``t.untyped_storage()`` shows up only there) are both back
to what they were when the pool was the only owner. Any tensor, view, saved-for-backward tensor,
NumPy array or storage object that still refers to the memory keeps it out of reuse (tested), so
a caller can never see its data overwritten. Handed-out tensors are made with ``Tensor.set_`` on
the storage: they are not views (``_base`` is None), so in-place ops on them work under autograd
like on any fresh tensor.

Bounds: only requests of at least ``MIN_BYTES`` are pooled, at most ``MAX_ENTRIES`` buffers are
kept (the least recently lent free one is dropped first), and ``release()`` drops every buffer
that is not in use. When the private counter is missing (another PyTorch), nothing is pooled and
every request is a plain ``torch.empty``.

The pool is shared by every dispatcher of the process (like a caching allocator), guarded by a
lock, so dispatchers in different threads may use it at the same time. A forked child starts with
an empty pool and a fresh lock (the parent's lock may have been held by another thread).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "CpuOutputPool",
    "OUTPUT_POOL",
    "MIN_BYTES",
    "MAX_ENTRIES",
    "output_empty",
    "arange",
    "ones",
    "scalar",
]

MIN_BYTES = 1 << 20
"""Smaller requests come from ``torch.empty`` (glibc reuses small blocks without faults)."""

MAX_ENTRIES = 8
"""Buffers the pool keeps at most (in use or free)."""

_HEADROOM = 1 / 16
"""New buffers are this much larger than asked, so that dropless outputs whose row count varies a
little from call to call still fit the buffer of the previous call."""

_ALIGN = 1 << 16


def _use_count_fn() -> object | None:
    return getattr(torch._C, "_storage_Use_Count", None)


@dataclass(eq=False)
class _Entry:
    buf: torch.Tensor  # [nbytes] uint8, the pool's own reference
    idle_uses: tuple[int, int]  # ``_uses`` when only the pool holds the storage
    last_lent: int = field(default=0)

    @property
    def nbytes(self) -> int:
        return self.buf.numel()


class CpuOutputPool:
    """Lends CPU buffers for returned tensors; reuses one once the caller has let go of it."""

    def __init__(self, *, min_bytes: int = MIN_BYTES, max_entries: int = MAX_ENTRIES) -> None:
        self.min_bytes = min_bytes
        self.max_entries = max_entries
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        self._use_count = _use_count_fn()
        self.reused = 0
        """Requests served from a buffer lent before (for tests and benchmarks)."""
        self.allocated = 0
        """Buffers the pool allocated."""

    @property
    def enabled(self) -> bool:
        return self._use_count is not None

    def _uses(self, buf: torch.Tensor) -> tuple[int, int]:
        """(C++ use count of the storage, Python references to its storage object)."""
        storage = buf.untyped_storage()
        uses = int(self._use_count(storage._cdata))  # type: ignore[misc]
        return uses, sys.getrefcount(storage)

    def _is_free(self, entry: _Entry) -> bool:
        uses, refs = self._uses(entry.buf)
        return uses <= entry.idle_uses[0] and refs <= entry.idle_uses[1]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` (not a view).

        The caller owns it like the result of ``torch.empty``: its memory is lent again only
        after every reference to it is gone.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.enabled or nbytes < self.min_bytes or torch.compiler.is_compiling():
            # NOTE: a compiled graph allocates its own outputs (no storage games to trace)
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            entry = self._take(nbytes)
            entry.last_lent = next(self._clock)
            out = torch.empty((0,), dtype=dtype)
            out.set_(entry.buf.untyped_storage(), 0, shape)
            return out

    def _take(self, nbytes: int) -> _Entry:
        best: _Entry | None = None
        stale: list[_Entry] = []
        for entry in self._entries:
            if entry.buf.untyped_storage().nbytes() < entry.nbytes:
                stale.append(entry)  # someone resized the storage away under us: forget it
                continue
            fits = nbytes <= entry.nbytes <= 2 * nbytes
            if fits and (best is None or entry.nbytes < best.nbytes) and self._is_free(entry):
                best = entry
        for entry in stale:
            self._entries.remove(entry)
        if best is not None:
            self.reused += 1
            return best
        size = math.ceil(nbytes * (1 + _HEADROOM) / _ALIGN) * _ALIGN
        buf = torch.empty(size, dtype=torch.uint8)
        entry = _Entry(buf=buf, idle_uses=self._uses(buf))
        self.allocated += 1
        self._entries.append(entry)
        if len(self._entries) > self.max_entries:
            self._evict(keep=entry)
        return entry

    def _evict(self, keep: _Entry) -> None:
        """Drop the least recently lent entries until at most ``max_entries`` are left.

        An entry in use is dropped too (the caller's tensor keeps the memory alive and it is
        freed with it); free ones go first.
        """
        order = sorted(
            (e for e in self._entries if e is not keep),
            key=lambda e: (not self._is_free(e), e.last_lent),
        )
        for entry in order[: len(self._entries) - self.max_entries]:
            self._entries.remove(entry)

    def release(self) -> int:
        """Drop every buffer not in use; returns the bytes given back to the C allocator."""
        with self._lock:
            free = [e for e in self._entries if self._is_free(e)]
            for entry in free:
                self._entries.remove(entry)
            return sum(e.nbytes for e in free)

    def reset_after_fork(self) -> None:
        """Forget every buffer and replace the lock (``os.register_at_fork`` in the child)."""
        self._lock = threading.Lock()
        self._entries = []

    def held_bytes(self) -> int:
        """Bytes of every buffer the pool keeps (in use or free)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries)


OUTPUT_POOL = CpuOutputPool()
"""The process-wide pool used by the ``torch`` backend for its CPU outputs."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=OUTPUT_POOL.reset_after_fork)


def output_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor handed to a caller: from ``OUTPUT_POOL`` on CPU (no page faults
    once an earlier output has been dropped), ``torch.empty`` elsewhere (caching allocators)."""
    if device.type == "cpu":
        return OUTPUT_POOL.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


_ARANGES: dict[torch.device, torch.Tensor] = {}


def _not_cached(device: torch.device) -> bool:
    """A cache miss that must not fill the cache: while a CUDA graph is being captured (a tensor
    made there holds its values only after a replay), or while ``torch.compile`` traces (the
    side effect would invalidate its guards at the next call: a recompile)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return True
    return torch.compiler.is_compiling()


def arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64) as a read-only view of a per-device cached tensor.

    The hot paths search sorted keys for ``0..n-1`` on every call; reading a kept ``arange``
    saves that launch. The cache grows by doubling (never past what a call asked for twice).
    While a CUDA graph is being captured or ``torch.compile`` traces nothing is cached
    (``_not_cached``), so the call returns a fresh ``arange``. Never write to the result.
    """
    buf = _ARANGES.get(device)
    if buf is not None and buf.numel() >= n:
        return buf[:n]
    if _not_cached(device):
        return torch.arange(n, dtype=torch.int64, device=device)
    size = max(n, 2 * buf.numel() if buf is not None else 0, 64)
    with torch.inference_mode(False):
        buf = torch.arange(size, dtype=torch.int64, device=device)
    _ARANGES[device] = buf
    return buf[:n]


_SCALARS: dict[tuple[torch.device, torch.dtype, float], torch.Tensor] = {}


def scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-dim ``value`` on ``device`` (read-only): ``torch.where(mask, t, scalar(...))``
    without wrapping a Python number into a new tensor on every call. Not cached while a CUDA
    graph is being captured or ``torch.compile`` traces (see ``arange``)."""
    key = (device, dtype, value)
    t = _SCALARS.get(key)
    if t is None:
        if _not_cached(device):
            return torch.full((), value, dtype=dtype, device=device)
        with torch.inference_mode(False):
            t = torch.full((), value, dtype=dtype, device=device)
        _SCALARS[key] = t
    return t


def ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[n]`` ones of ``dtype`` as a stride-0 view of a cached scalar (read-only)."""
    return scalar(1, dtype, device).expand(n)


_CACHED: dict[tuple, torch.Tensor] = {}
_MAX_CACHED = 256


def cached(key: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A read-only device constant kept across calls: ``make()`` once per ``(key, device)``.

    For index tables that depend only on shapes (a few per dispatcher); the cache is dropped
    whole when it holds ``_MAX_CACHED`` entries. Nothing is kept while a CUDA graph is being
    captured or ``torch.compile`` traces (``_not_cached``).
    """
    full_key = (device, *key)
    t = _CACHED.get(full_key)
    if t is not None:
        return t
    if _not_cached(device):
        return make()
    with torch.inference_mode(False):
        t = make()
    if len(_CACHED) >= _MAX_CACHED:
        _CACHED.clear()
    _CACHED[full_key] = t
    return t
