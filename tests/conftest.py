"""Shared pytest set-up: deterministic torch, few threads (the CI machine has 2 cores), and the
``device`` fixture.

``device`` is where the core correctness tests run their inputs: ``cpu`` by default, ``cuda`` with
``FLEXDISPATCH_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh`` sets it). A requested ``cuda`` without
a GPU skips those tests with the reason; any other value is an error. References are always
computed on the CPU.
"""

from __future__ import annotations

import os

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


@pytest.fixture
def deferred_value_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drive the CUDA-without-checks path of the dispatcher's value checks on any device: bad ids
    and NaN/inf are counted on the device and raised by ``check_overflow``, not in ``dispatch``."""
    from flexdispatch import _validate

    monkeypatch.setattr(_validate, "defer_value_checks", lambda device: True)
