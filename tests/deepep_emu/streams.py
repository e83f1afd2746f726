"""Emulated CUDA streams and events for DeepEP 2.5's deferred epilogue (audit-5 EW3). TEST-ONLY.

On a GPU a ``dispatch_expanded_start`` whose copy epilogue another call on the buffer ran first
(``SharedV25Buffer.settle``) wrote its rows on *that* call's stream; the waiter, on its own
stream, must wait for an event recorded after them before it reads them (``PendingExpanded.join``:
``wait_event`` and ``record_stream``). The emulator had no streams, so that half of the overlap
never ran on CPU (``settle`` records an event only for CUDA tensors).

``install(pkg)`` puts ``EmuStreams`` where the adapter takes its streams from
(``backends.deepep.v25.rows.STREAMS``) and tells the emulated ``EPBuffer`` of ``pkg`` to tag what
its deferred epilogues write with the current emulated stream and a sequence number
(``runtime.emu_streams``). ``EmuStreams.stream(name)`` makes a stream current;
``EmuEvent.record(stream)`` marks how far that stream has written; ``EmuStream.wait_event`` lets
its stream see those writes; a read (``used``: the adapter reads the rows on the current stream)
of a row written on another stream past what the reader waited for is DeepEP's race, reported as
a device trap (``stream.cross_read``: the GPU would read rows the epilogue had not finished). The
model covers the epilogue's rows only: kernels run in call order here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tests.deepep_emu.runtime import limits

__all__ = ["EmuEvent", "EmuStream", "EmuStreams", "install"]


class EmuStream:
    """One emulated stream: how far it has written (``seq``) and, per other stream, how far it
    waited for it."""

    def __init__(self, name: str) -> None:
        self.name, self.seq = name, 0
        self.seen: dict[str, int] = {}

    def wait_event(self, event: EmuEvent) -> None:
        if event.stream is not None and event.stream is not self:
            self.seen[event.stream.name] = max(self.seen.get(event.stream.name, 0), event.seq)

    def __repr__(self) -> str:
        return f"EmuStream({self.name})"


class EmuEvent:
    def __init__(self) -> None:
        self.stream: EmuStream | None = None
        self.seq = 0

    def record(self, stream: EmuStream | None = None) -> None:
        assert stream is not None
        self.stream, self.seq = stream, stream.seq


class EmuStreams:
    """The methods of ``rows.CudaStreams``, on emulated streams (module docstring)."""

    def __init__(self) -> None:
        self.streams: dict[str, EmuStream] = {"default": EmuStream("default")}
        self.now = self.streams["default"]
        self.writes: dict[int, tuple[EmuStream, int]] = {}  # data_ptr -> (stream, seq)
        self.recorded: list[str] = []

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[EmuStream]:
        saved = self.now
        self.now = self.streams.setdefault(name, EmuStream(name))
        try:
            yield self.now
        finally:
            self.now = saved

    # ----------------------------------------------------------------- rows.CudaStreams
    @staticmethod
    def applies(tensors: list[torch.Tensor]) -> bool:
        return True

    def current(self) -> EmuStream:
        return self.now

    @staticmethod
    def event() -> EmuEvent:
        return EmuEvent()

    def record_stream(self, t: torch.Tensor, stream: EmuStream) -> None:
        self.recorded.append(stream.name)

    def used(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            got = self.writes.get(t.data_ptr())
            if got is None:
                continue
            stream, seq = got
            ok = stream is self.now or self.now.seen.get(stream.name, 0) >= seq
            limits.device_trap(
                ok,
                "stream.cross_read",
                "2.5.0",
                f"rows written on {stream.name} read on {self.now.name} without waiting for them",
            )

    # ----------------------------------------------------------------- the emulated kernels
    def wrote(self, value: Any) -> Any:
        """Tag what a deferred epilogue returned with the current stream (returns it)."""
        from flexdispatch.backends.deepep.v25.rows import tensors_of

        self.now.seq += 1
        for t in tensors_of(value):
            if t.numel():
                self.writes[t.data_ptr()] = (self.now, self.now.seq)
        return value


def install(pkg: Any) -> tuple[EmuStreams, Any]:
    """Use emulated streams for ``pkg`` (a ``load_v25`` package) and the adapter; returns
    ``(streams, undo)``."""
    from flexdispatch.backends.deepep.v25 import rows

    streams = EmuStreams()
    saved = rows.STREAMS
    rows.STREAMS = streams
    pkg.runtime.emu_streams = streams

    def undo() -> None:
        rows.STREAMS = saved
        pkg.runtime.emu_streams = None

    return streams, undo
