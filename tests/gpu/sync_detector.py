"""A host-sync detector that sees every wait on the GPU: a long spin, then the step.

``torch.cuda.set_sync_debug_mode("error")`` only sees the synchronising calls it instruments; it
does not see a pinned copy followed by ``Event.synchronize()`` (the dropless dispatch's wait), so
a "never syncs" test built on it proves nothing. This detector needs no instrumentation:

1. run the step once plainly (warm-up) and time it on the host: ``host_ms``;
2. queue a GPU spin (``torch.cuda._sleep``) of ``spin_ms`` = max(``min_spin_ms``,
   ``factor`` x ``host_ms``) on the current stream, then record an event after it;
3. run the step; the moment it returns, ask the event whether it is done (``Event.query()``).

The spin is queued before everything the step launches on that stream (and NCCL's streams wait
on it), so a step that waits for any of its own GPU results waits for the spin too, and returns
after the event. A step that never waits returns in about ``host_ms``, long before the spin ends:
the event is still pending. Verdict: the step synced iff the event is done when it returns. A
done event with a host time far below the spin cannot happen and is reported as inconclusive.

Not seen: a wait on a stream that does not follow the current one (nothing in flexdispatch
waits that way). Shape letters: none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SyncCheck", "SyncDetector", "cuda_detector"]


@dataclass(frozen=True)
class SyncCheck:
    """What one check saw.

    Attributes:
        synced: the step waited on the GPU (the spin's event was done when it returned).
        host_ms: the step's host time during the check.
        plain_ms: its host time in the plain (warm-up) run, which sized the spin.
        spin_ms: the spin the step ran behind, measured on the GPU.
        result: what the step returned in the check.
    """

    synced: bool
    host_ms: float
    plain_ms: float
    spin_ms: float
    result: Any = None


class SyncDetector:
    """See the module docstring. The GPU primitives are injected (``cuda_detector()`` gives the
    real ones) so that the logic is tested on the CPU with a simulated GPU.

    Args:
        sleep: queue a spin of ``cycles`` GPU clock cycles on the current stream.
        new_event: a timing event with ``record()``, ``query()``, ``elapsed_time(other)``.
        synchronize: wait for the whole device.
        clock: host seconds (monotonic).
        min_spin_ms: the shortest spin.
        factor: the spin lasts at least this many times the step's plain host time.
        max_spin_ms: a step so slow that the spin would exceed this is refused (ValueError).
    """

    def __init__(
        self,
        *,
        sleep: Callable[[int], None],
        new_event: Callable[[], Any],
        synchronize: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
        min_spin_ms: float = 50.0,
        factor: float = 20.0,
        max_spin_ms: float = 10_000.0,
    ) -> None:
        if min_spin_ms <= 0 or factor < 2 or max_spin_ms < min_spin_ms:
            raise ValueError(
                f"need min_spin_ms > 0, factor >= 2 and max_spin_ms >= min_spin_ms, got "
                f"{min_spin_ms}, {factor}, {max_spin_ms}"
            )
        self._sleep, self._event, self._sync, self._clock = sleep, new_event, synchronize, clock
        self.min_spin_ms, self.factor, self.max_spin_ms = min_spin_ms, factor, max_spin_ms
        self._cycles_per_ms: float | None = None

    def cycles_per_ms(self) -> float:
        """GPU clock cycles of ``sleep`` per millisecond, measured once with timing events."""
        if self._cycles_per_ms is None:
            probe = 1_000_000
            for _ in range(3):
                self._sync()
                start, end = self._event(), self._event()
                start.record()
                self._sleep(probe)
                end.record()
                self._sync()
                ms = start.elapsed_time(end)
                if ms >= 5.0:
                    break
                probe *= 10  # too short to time well: spin longer
            if ms <= 0:
                raise RuntimeError(f"the GPU spin of {probe} cycles took {ms} ms: cannot calibrate")
            self._cycles_per_ms = probe / ms
        return self._cycles_per_ms

    def check(self, step: Callable[[], Any]) -> SyncCheck:
        """Run ``step`` plainly, then behind a spin; see the module docstring."""
        self._sync()
        t0 = self._clock()
        step()
        plain_ms = (self._clock() - t0) * 1e3
        self._sync()
        target = max(self.min_spin_ms, self.factor * plain_ms)
        if target > self.max_spin_ms:
            raise ValueError(
                f"the step takes {plain_ms:.1f} ms on the host: a spin of {target:.0f} ms "
                f"(factor {self.factor:g}) exceeds max_spin_ms={self.max_spin_ms:g}; check a "
                f"smaller step"
            )
        cycles = int(target * self.cycles_per_ms())
        start, end = self._event(), self._event()
        start.record()
        self._sleep(cycles)
        end.record()
        t0 = self._clock()
        result = step()
        host_ms = (self._clock() - t0) * 1e3
        done = bool(end.query())
        self._sync()
        spin_ms = start.elapsed_time(end)
        if done and host_ms < 0.5 * spin_ms:
            raise RuntimeError(
                f"inconclusive: the spin's event was done when the step returned, yet the step "
                f"took {host_ms:.2f} ms on the host for a {spin_ms:.2f} ms spin"
            )
        if not done and host_ms >= spin_ms:
            raise RuntimeError(
                f"inconclusive: the step took {host_ms:.2f} ms on the host, longer than the "
                f"{spin_ms:.2f} ms spin, yet the spin's event was pending"
            )
        return SyncCheck(done, host_ms, plain_ms, spin_ms, result)


def cuda_detector(**kwargs: Any) -> SyncDetector:
    """A detector on the current CUDA device and stream."""
    import torch

    return SyncDetector(
        sleep=torch.cuda._sleep,
        new_event=lambda: torch.cuda.Event(enable_timing=True),
        synchronize=torch.cuda.synchronize,
        **kwargs,
    )
