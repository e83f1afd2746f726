"""Statistics of the deepep backends with no host read inside dispatch or combine.

Why: keeping every call's DeepEP handle and, after 256 calls, reading them on the host from
inside a dispatch (``int()`` / ``.cpu()``) costs a host sync in the middle of a training step, a
crash inside a CUDA-graph capture, and up to 256 handles kept alive. Here:

- a call records a function that computes its four counters from its handle (``record``);
- outside a capture the function is only kept (no device op on the hot path), and every
  ``max_kept`` calls the kept ones are summed on the device into one ``[4]`` int64 accumulator
  (a few launches, no host read) and their handles released;
- while a CUDA graph is captured the counters are added in place into that accumulator at once,
  so that every replay adds its own (a kept function would see only the latest replay's values);
- ``drain`` (``stats``, ``check_overflow``, ``close``: the safe points) reads the accumulator on
  the host (one read) and never runs while a capture is in progress.

On the CPU code path (``tensors.cuda_code_path`` False) reading a value costs no sync, so the
kept calls are summed on the host. ``DeviceMax`` is the same for the largest W a worst-case dispatch
needed (updated in place, so a replayed graph keeps raising it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexdispatch._checks import tensors

__all__ = ["DeviceMax", "TrafficCounters"]

Values = Sequence[Any]  # four 0-d int64 tensors or ints: intra bytes, inter bytes, sent, received


def _deferred(device: torch.device) -> bool:
    return tensors.cuda_code_path(device)


class TrafficCounters:
    """The ``[4]`` traffic counters of one backend: NVLink bytes, RDMA bytes, rows sent, rows
    received (``DispatchStats`` fields), kept without host reads on the device path.

    Args:
        device: the group's device (the accumulator lives there on the device path).
        max_kept: calls kept before they are summed on the device (releasing their handles).
    """

    def __init__(self, device: torch.device, *, max_kept: int = 64) -> None:
        self.max_kept = max_kept
        self._kept: list[Callable[[], Values]] = []
        self._acc: torch.Tensor | None = None
        if _deferred(device):
            # NOTE: created here, outside any capture: a graph then adds into it in place
            self._acc = torch.zeros(4, dtype=torch.int64, device=device)
        self._host = [0, 0, 0, 0]

    @property
    def kept(self) -> int:
        """Calls recorded and not yet summed (their handles are alive)."""
        return len(self._kept)

    def record(self, compute: Callable[[], Values]) -> None:
        """Count one call; ``compute`` returns its four counters (run now, later or never twice)."""
        if self._acc is not None and tensors.is_capturing():
            self._acc.add_(self._stack([compute()]))
            return
        self._kept.append(compute)
        if len(self._kept) >= self.max_kept:
            self.fold()

    def _stack(self, rows: list[Values]) -> torch.Tensor:
        assert self._acc is not None
        dev = self._acc.device
        flat = [
            v.to(device=dev, dtype=torch.int64).reshape(())
            if isinstance(v, torch.Tensor)
            else torch.full((), int(v), dtype=torch.int64, device=dev)  # a fill, no H2D copy
            for row in rows
            for v in row
        ]
        return torch.stack(flat).view(len(rows), 4).sum(0)

    def fold(self) -> None:
        """Sum the kept calls into the device accumulator (no host read; not while capturing:
        the kept calls ran eagerly and must not be replayed)."""
        if not self._kept or tensors.is_capturing():
            return
        kept, self._kept = self._kept, []
        if self._acc is None:  # CPU code path: reading values costs no sync
            for compute in kept:
                vals = compute()
                self._host = [h + int(v) for h, v in zip(self._host, vals, strict=True)]
            return
        self._acc.add_(self._stack([compute() for compute in kept]))

    def drain(self, stats: Any) -> None:
        """Add everything counted so far to ``stats`` (one host read on the device path; skipped
        while a capture is in progress)."""
        if self._acc is not None:
            if tensors.is_capturing():
                return
            self.fold()
            vals = self._acc.tolist()
            self._acc.zero_()
        else:
            self.fold()
            vals, self._host = self._host, [0, 0, 0, 0]
        intra, inter, sent, received = vals
        stats.bytes_sent_intra_node += intra
        stats.bytes_sent_inter_node += inter
        stats.rows_sent += sent
        stats.rows_received += received


class DeviceMax:
    """The largest value seen (e.g. the W a worst-case dispatch needed): a host int on the CPU
    code path, else a 0-d int64 device tensor raised in place (``torch.maximum(out=)``), so a
    replayed CUDA graph keeps raising it."""

    def __init__(self, device: torch.device) -> None:
        self._dev: torch.Tensor | None = None
        self._host = 0
        if _deferred(device):
            self._dev = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, value: torch.Tensor) -> None:
        """Raise the maximum to ``value`` (a 0-d tensor; read at once on the CPU code path)."""
        if self._dev is None:
            self._host = max(self._host, int(value))
        else:
            torch.maximum(self._dev, value.to(self._dev.device, torch.int64), out=self._dev)

    def read(self) -> int:
        """The maximum (one host read on the device path)."""
        return self._host if self._dev is None else int(self._dev)
