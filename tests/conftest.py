"""Shared pytest set-up: deterministic torch, few threads (the CI machine has 2 cores), and the
``device`` fixture.

``device`` is where the core correctness tests run their inputs: ``cpu`` by default, ``cuda`` with
``FLEXDISPATCH_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh`` sets it). A requested ``cuda`` without
a GPU skips those tests with the reason; any other value is an error. References are always
computed on the CPU.

Multi-process tests run in process groups kept alive for their module (``tests/dist/harness.py``,
``tests/dist/pool.py``): ``_group_pools`` closes them when the module ends, ``_fresh_groups`` gives
tests marked ``fresh_groups`` fresh ones, and ``FLEXDISPATCH_TEST_POOL_REPORT=1`` prints how many
calls and spawns each module's pools had.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TEST_DEVICE_ENV = "FLEXDISPATCH_TEST_DEVICE"
TEST_DEVICES = ("cpu", "cuda")


def resolve_test_device(requested: str | None, cuda_available: bool) -> tuple[str | None, str]:
    """The device type the ``device`` fixture gives, or None and why the tests must skip.

    Args:
        requested: the value of ``$FLEXDISPATCH_TEST_DEVICE`` (None or empty = ``cpu``).
        cuda_available: ``torch.cuda.is_available()``.

    Returns:
        ``("cpu" | "cuda", reason)``, or ``(None, reason)`` when ``cuda`` is asked for but absent.

    Raises:
        ValueError: a value other than ``cpu`` / ``cuda``.
    """
    name = (requested or "cpu").strip().lower()
    if name not in TEST_DEVICES:
        raise ValueError(
            f"${TEST_DEVICE_ENV}={requested!r} is not a test device: set it to "
            f"{' or '.join(TEST_DEVICES)} (or unset it for cpu)"
        )
    if name == "cuda" and not cuda_available:
        return None, (
            f"${TEST_DEVICE_ENV}=cuda but torch.cuda.is_available() is False (no GPU, or a CPU "
            f"build of torch)"
        )
    return name, f"${TEST_DEVICE_ENV} -> {name}"


@pytest.fixture
def device() -> torch.device:
    """The device of the core correctness tests (see the module docstring)."""
    requested = os.environ.get(TEST_DEVICE_ENV)
    cuda = torch.cuda.is_available() if (requested or "").strip().lower() == "cuda" else False
    name, why = resolve_test_device(requested, cuda)
    if name is None:
        pytest.skip(why)
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _group_pools(request: pytest.FixtureRequest) -> Iterator[None]:
    """Close the module's pooled process groups when the module ends."""
    yield
    if "tests.dist.harness" in sys.modules:  # only modules that spawned import the harness
        sys.modules["tests.dist.harness"].close_pools(request.node.nodeid)


@pytest.fixture(autouse=True)
def _fresh_groups(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``fresh_groups`` spawn a fresh group per call instead of the module's pool."""
    fresh = request.node.get_closest_marker("fresh_groups") is not None
    if not fresh:
        yield
        return
    from tests.dist import harness

    harness.set_fresh_test(True)
    try:
        yield
    finally:
        harness.set_fresh_test(False)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if os.environ.get("FLEXDISPATCH_TEST_POOL_REPORT", "").strip() not in ("1", "true", "yes"):
        return
    harness = sys.modules.get("tests.dist.harness")
    lines = harness.pool_report() if harness else []
    terminalreporter.section("pooled process groups")
    for line in lines:
        terminalreporter.write_line(line)
    calls = sum(int(x.split(": ")[-1].split()[0]) for x in lines)
    spawns = sum(int(x.split(", ")[-2].split()[0]) for x in lines)
    cpu = sum(float(x.split(", ")[-1].split()[0]) for x in lines)
    terminalreporter.write_line(
        f"total: {calls} pooled calls in {spawns} spawned groups, {cpu:.1f} s CPU in their ranks"
    )


@pytest.fixture
def deferred_value_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drive the CUDA-without-checks path of the dispatcher's value checks on any device: bad ids
    and NaN/inf are counted on the device and raised by ``check_overflow``, not in ``dispatch``."""
    from flexdispatch._checks import tensors

    monkeypatch.setattr(tensors, "defer_value_checks", lambda device: True)
