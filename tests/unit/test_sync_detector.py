"""The logic of ``tests/gpu/sync_detector.py`` on a simulated GPU (one stream, a host clock):
a step that waits on the GPU is caught, one that does not is cleared, and the spin is sized from
the step's own host time."""

from __future__ import annotations

import pytest

from tests.gpu.sync_detector import SyncDetector

pytestmark = pytest.mark.timeout(30)

CYCLES_PER_MS = 1_900_000.0  # ~1.9 GHz


class FakeGPU:
    """One in-order stream. ``tail``: when the queued work ends (ms); ``now``: the host clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.tail = 0.0
        self.syncs = 0

    # --- the primitives the detector takes
    def sleep(self, cycles: int) -> None:
        self.tail = max(self.tail, self.now) + cycles / CYCLES_PER_MS

    def synchronize(self) -> None:
        self.syncs += 1
        self.now = max(self.now, self.tail)

    def clock(self) -> float:
        return self.now / 1e3

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    # --- what steps do
    def launch(self, gpu_ms: float, host_ms: float = 0.01) -> None:
        self.now += host_ms
        self.tail = max(self.tail, self.now) + gpu_ms


class FakeEvent:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.t = gpu, None

    def record(self) -> None:
        self.t = max(self.gpu.tail, self.gpu.now)

    def query(self) -> bool:
        return self.gpu.now >= self.t

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def _detector(gpu: FakeGPU, **kw) -> SyncDetector:
    return SyncDetector(
        sleep=gpu.sleep,
        new_event=gpu.new_event,
        synchronize=gpu.synchronize,
        clock=gpu.clock,
        **kw,
    )


def test_a_step_that_never_waits_is_cleared() -> None:
    gpu = FakeGPU()

    def step():  # launches 5 kernels, 1 ms of host time, never waits
        for _ in range(5):
            gpu.launch(gpu_ms=2.0, host_ms=0.2)
        return "out"

    got = _detector(gpu).check(step)
    assert not got.synced and got.result == "out"
    assert got.plain_ms == pytest.approx(1.0) and got.host_ms == pytest.approx(1.0)
    assert got.spin_ms >= 50.0 - 1e-6


def test_a_step_that_waits_is_caught_however_it_waits() -> None:
    gpu = FakeGPU()

    def device_sync():  # e.g. .item(), .tolist(), nonzero()
        gpu.launch(gpu_ms=1.0)
        gpu.synchronize()

    def event_wait():  # the dropless path: a pinned copy, then Event.synchronize()
        gpu.launch(gpu_ms=1.0)
        ev = gpu.new_event()
        ev.record()
        gpu.now = max(gpu.now, ev.t)

    for step in (device_sync, event_wait):
        got = _detector(gpu).check(step)
        assert got.synced, step.__name__
        assert got.host_ms >= got.spin_ms


def test_the_spin_outlasts_a_slow_step() -> None:
    """A step with 30 ms of host work and no wait: a fixed 50 ms spin could end before it
    returns; the spin is sized from the step (factor x its host time), so it is cleared."""
    gpu = FakeGPU()
    got = _detector(gpu, factor=20).check(lambda: gpu.launch(gpu_ms=1.0, host_ms=30.0))
    assert not got.synced and got.spin_ms == pytest.approx(600.0, rel=1e-6)


def test_refusals() -> None:
    gpu = FakeGPU()
    with pytest.raises(ValueError, match="exceeds max_spin_ms=100"):
        _detector(gpu, max_spin_ms=100).check(lambda: gpu.launch(1.0, host_ms=20.0))
    with pytest.raises(ValueError, match="factor >= 2"):
        _detector(gpu, factor=1)


def test_calibration_reads_the_spin_rate_and_is_reused() -> None:
    gpu = FakeGPU()
    det = _detector(gpu)
    assert det.cycles_per_ms() == pytest.approx(CYCLES_PER_MS)
    before = gpu.syncs
    det.cycles_per_ms()
    assert gpu.syncs == before


def test_a_broken_timer_is_inconclusive_not_a_verdict() -> None:
    """If the event reads done although the host returned at once (a clock or event that lies),
    the detector refuses to give a verdict."""
    gpu = FakeGPU()
    det = _detector(gpu)
    det.cycles_per_ms()

    class LyingEvent(FakeEvent):
        def query(self) -> bool:
            return True

    det._event = lambda: LyingEvent(gpu)
    with pytest.raises(RuntimeError, match="inconclusive"):
        det.check(lambda: gpu.launch(1.0))
