"""A test-only emulation of DeepEP's ``deep_ep`` V1 Python API over ``torch.distributed``.

``tests/deepep_emu/deep_ep`` is importable as ``tests.deepep_emu.deep_ep`` (what the test suites
use, passing the module to the adapter explicitly) or as plain ``deep_ep`` when this folder is put
on ``sys.path`` (for ad-hoc scripts). It is never installed and never imported by the library:
the adapter only takes it through its private test hook, so that ``auto`` backend selection in
the same process is not fooled by it.

What it reproduces and what it does not is listed in ``deep_ep/__init__.py``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EMULATOR_PATH"]

EMULATOR_PATH = str(Path(__file__).resolve().parent)
"""Put this on ``sys.path`` to make ``import deep_ep`` load the emulator."""
