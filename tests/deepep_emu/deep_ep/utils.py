"""``EventOverlap`` over a no-op CPU event (DeepEP wraps a CUDA event). TEST-ONLY."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """Stand-in for DeepEP's C++ ``EventHandle``: the CPU has nothing to wait for."""

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (nothing to do on the CPU)."""


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()`` and use as a context manager.

    Args:
        event: the captured event, or None when the kernel did not run asynchronously.
        extra_tensors: tensors kept alive until the event completes.
    """

    def __init__(
        self, event: EventHandle | None = None, extra_tensors: Sequence[torch.Tensor] | None = None
    ) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Wait for the event; like DeepEP, an event of a synchronous call cannot be waited on."""
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
