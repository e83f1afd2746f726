"""The one agreement a DeepEP V2 / V2.5 dispatch makes: an all-gather of five ints on the group
itself, read after DeepEP's own CPU wait.

T tokens on this rank · X row width · k top-k · R ranks · M the per-rank token bound.

A dropless dispatch sends every token, so every rank must use one bound M >= the largest T of the
call (DeepEP's receive slots are ``rank * M + token``), and every rank must dispatch rows of one
shape. The ranks learn each other's ``[T, X, k, dtype code, refused]`` from one all-gather on the
dispatcher's group: no gloo side group, nothing built inside a step, nothing that crosses hosts
beside the group's own collective. On an NCCL group it is a device collective (log-depth
algorithms for small sizes), started before the dispatch without a host wait and read once
DeepEP's CPU wait has returned, when its result is long there; the five ints travel through
pinned host buffers kept per backend (a non-blocking copy in, a non-blocking copy out, an event):
no pageable copy, no stream synchronisation of its own.

Every rank issues the same collective at the same point whatever its ``checks`` setting (a
per-process one); only when it is read differs (``BoundedBackend._check_tokens``).
"""

from __future__ import annotations

from typing import Any

import torch

from flexdispatch.backends.counts import DTYPE_CODES
from flexdispatch.distributed import collective_guard, group_size, is_distributed
from flexdispatch.distributed import start_gather_int64 as _gather

__all__ = ["Agreement", "pinned_buffers"]

WIDTH = 5  # [T, X, k, dtype code, refused]


class Agreement:
    """One dispatch's all-gather (module docstring): ``start`` before the dispatch, ``rows``
    after it (or right away). ``pinned``: the backend's ``pinned_buffers``; ``size``: the
    group's size where the caller knows it (1 where it is not distributed), else looked up."""

    def __init__(
        self, group: Any, device: torch.device, pinned: list[Any], size: int | None = None
    ) -> None:
        self.group, self.device, self.pinned = group, device, pinned
        self.size = size
        self._rows: list[list[int]] | None = None
        self._work: Any = None
        self._out: torch.Tensor | None = None
        self._event: Any = None

    @staticmethod
    def values(T: int, shape: tuple[int, int, torch.dtype], refused: bool) -> list[int]:
        return [T, shape[0], shape[1], DTYPE_CODES.get(shape[2], -1), int(refused)]

    def start(self, vals: list[int], name: str) -> Agreement:
        """Start the all-gather of ``vals`` (``values``) on the group, without a host wait."""
        R = self.size
        if R is None:
            R = group_size(self.group) if is_distributed(self.group) else 1
        if R == 1:
            self._rows = [list(vals)]
            return self
        host_in, host_out, last = self.pinned
        if self.device.type != "cuda":
            for i, v in enumerate(vals):
                host_in[i] = v
            self._out = torch.empty(R * WIDTH, dtype=torch.int64)
            with collective_guard(name, self.group):
                self._work = _gather(self._out, host_in.clone(), self.group, async_op=True)
            return self
        if last is not None:
            last.synchronize()  # NOTE: the previous dispatch's copies left the pinned buffers
        if host_out is None or host_out.numel() != R * WIDTH:
            host_out = self.pinned[1] = torch.empty(R * WIDTH, dtype=torch.int64, pin_memory=True)
        for i, v in enumerate(vals):
            host_in[i] = v
        src = host_in.to(self.device, non_blocking=True)
        out = torch.empty(R * WIDTH, dtype=torch.int64, device=self.device)
        with collective_guard(name, self.group):
            _gather(out, src, self.group)
        host_out.copy_(out, non_blocking=True)
        self._event = self.pinned[2] = torch.cuda.Event()
        self._event.record()
        self._out = host_out
        return self

    def rows(self) -> list[list[int]]:
        """Every rank's five ints, rank-major (on CUDA: waits for the copy out, done by the time
        DeepEP's CPU wait returned; on gloo: for the all-gather)."""
        if self._rows is None:
            if self._work is not None:
                self._work.wait()
            if self._event is not None:
                self._event.synchronize()
            assert self._out is not None
            flat = [int(v) for v in self._out.tolist()]
            self._rows = [flat[i : i + WIDTH] for i in range(0, len(flat), WIDTH)]
        return self._rows


def pinned_buffers(device: torch.device) -> list[Any]:
    """``[host in, host out, last event]`` for ``Agreement`` (pinned on CUDA)."""
    pinned = device.type == "cuda"
    return [torch.empty(WIDTH, dtype=torch.int64, pin_memory=pinned), None, None]
