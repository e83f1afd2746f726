"""Run flexdispatch's CUDA code path on CPU tensors: what a GPU runs, op for op.

Every device-dependent choice in flexdispatch goes through ``_validate.cuda_code_path`` (and the
deferred value checks through ``_validate.defer_value_checks``); pointing both at "yes" makes the
CPU take the CUDA branch, which is how the tests and ``benchmarks/`` count the CUDA path's ops,
bytes and host reads without a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["force_cuda_path"]


def force_cuda_path(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make every device-dependent branch of the loaded flexdispatch modules take its CUDA side.

    Args:
        patch: how to replace an attribute: ``setattr`` (for good: a spawned rank, a benchmark)
            or a test's ``monkeypatch.setattr`` (undone after the test). Modules imported later
            keep their own ``cuda_code_path``: import what the code under test uses first.
    """
    from flexdispatch import _validate

    def yes(device: torch.device) -> bool:
        return True

    patch(_validate, "defer_value_checks", yes)
    for name, mod in list(sys.modules.items()):
        if name.startswith("flexdispatch") and hasattr(mod, "cuda_code_path"):
            patch(mod, "cuda_code_path", yes)
