"""One caller at a time: the guard that ``FlexDispatcher`` and ``MoELayer`` take at their entry
points, so that an object shared by two threads raises instead of returning a wrong answer.

A dispatcher keeps state between the steps of one call (its backend's buffers, the counts of bad
inputs, the statistics), so two threads inside it at once can mix their rows (measured: 7 of 100
layer outputs wrong, silently). ``CallGuard.enter`` takes a non-blocking lock: a second
thread that enters while a call is running raises ``ConcurrentUseError`` naming both calls; the
thread that holds it may enter again (``MoELayer.forward`` calls ``dispatch`` and ``combine``, a
recomputation under activation checkpointing runs inside the backward). The backward of a
dispatch or combine does not take the guard: autograd runs it on its own thread (the device
threads of the engine on CUDA), after the forward call has returned.

Cost: a thread id, one uncontended lock acquire and release per call, well under a microsecond
of host time (``docs/errors.md``, "Shared use").

Under ``torch.compile`` the guard is left out of the trace (dynamo cannot trace a lock or a thread
id, and ``fullgraph=True`` would refuse the graph): a compiled caller runs the custom ops
(``flexdispatch.dispatch.ops``) without it, so one compiled module must not be shared by two threads
either, and nothing detects it there.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["CallGuard", "ConcurrentUseError", "guarded"]

_F = TypeVar("_F", bound=Callable[..., Any])


class ConcurrentUseError(RuntimeError):
    """A ``FlexDispatcher`` or ``MoELayer`` was entered by a second thread while a call was
    running: give each thread its own object (a dispatcher per thread and process group)."""


class CallGuard:
    """Refuses a second thread while one is inside a call of the object that holds it (re-entry
    by the same thread is allowed). Copied or pickled, it starts free (a lock cannot be
    copied)."""

    __slots__ = ("_call", "_depth", "_lock", "_thread")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None
        self._depth = 0
        self._call = ""

    def enter(self, call: str) -> None:
        """Start ``call`` (e.g. ``"FlexDispatcher.dispatch"``) on this thread.

        Raises:
            ConcurrentUseError: another thread is inside a call of the same object.
        """
        me = threading.get_ident()
        if self._thread == me:  # NOTE: only this thread ever writes its own id here
            self._depth += 1
            return
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{call} was called from thread {threading.current_thread().name!r} while "
                f"{self._call} of the same object is running on another thread: a FlexDispatcher "
                f"(or the MoELayer that holds it) cannot be shared between threads; give each "
                f"thread its own (and its own process group), or serialise the calls with a lock"
            )
        self._thread, self._depth, self._call = me, 1, call

    def exit(self) -> None:
        """End the call ``enter`` started on this thread."""
        self._depth -= 1
        if self._depth == 0:
            self._thread = None
            self._lock.release()

    def __reduce__(self) -> tuple[Any, ...]:
        return (CallGuard, ())


def guarded(call: str) -> Callable[[_F], _F]:
    """Decorate a method of an object with a ``_guard`` (``CallGuard``): the method runs inside
    ``_guard.enter(call)`` / ``exit()``."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # NOTE: traced: no lock in the graph (docstring)
                return fn(self, *args, **kwargs)
            guard = self._guard
            guard.enter(call)
            try:
                return fn(self, *args, **kwargs)
            finally:
                guard.exit()

        return inner  # type: ignore[return-value]

    return wrap
