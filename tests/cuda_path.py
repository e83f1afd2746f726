"""Run flexdispatch's CUDA code path on CPU tensors: what a GPU runs, op for op.

Every device-dependent choice in flexdispatch goes through ``_validate.cuda_code_path`` (and the
deferred value checks through ``_validate.defer_value_checks``); pointing both at "yes" makes the
CPU take the CUDA branch, which is how the tests and ``benchmarks/`` count the CUDA path's ops,
bytes and host reads without a GPU. ``force_screen_kernel`` adds the one Triton kernel that
CUDA runs when triton imports (the dispatcher's value screen), interpreted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["force_cuda_path", "force_screen_kernel"]


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


def force_screen_kernel(
    on_launch: Callable[[tuple], None] | None = None,
    patch: Callable[[Any, str, Any], None] = setattr,
) -> bool:
    """Take the dispatcher's value screen (``flexdispatch.kernels.screen``) on CPU tensors as
    CUDA does when triton imports, under Triton's interpreter. The interpreter's own ATen calls
    are hidden from dispatch modes (they are no launches); ``on_launch(args)`` is called at each
    launch with the kernel's arguments instead.

    Returns:
        False (nothing patched) unless triton imports and interprets (``TRITON_INTERPRET=1``
        before triton was first imported).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from flexdispatch.kernels import _triton, screen

    if not (_triton.triton_status()[0] and _triton.interpreting()):
        return False
    patch(screen, "screen_on_device", lambda device: True)
    get = _triton.Kernel.get

    class Hidden:
        def __init__(self, built: Any) -> None:
            self.built = built

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kw: Any) -> Any:
                if on_launch is not None:
                    on_launch(args)
                with _disable_current_modes():
                    return self.built[grid](*args, **kw)

            return launch

    patch(_triton.Kernel, "get", lambda self: Hidden(get(self)))
    return True
