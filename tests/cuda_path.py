"""Run flexdispatch's CUDA code path on CPU tensors: what a GPU runs, op for op.

Every device-dependent choice in flexdispatch goes through ``tensors.cuda_code_path`` (and the
deferred value checks through ``tensors.defer_value_checks``); pointing both at "yes" makes the
CPU take the CUDA branch, which is how the tests and ``benchmarks/`` count the CUDA path's ops,
bytes and host reads without a GPU. ``force_triton_kernels`` adds the Triton kernels that the
CUDA branch runs when triton imports (the dispatcher's value screen, the in-band pack),
interpreted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["force_cuda_path", "force_triton_kernels"]


def force_cuda_path(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make every device-dependent branch of the loaded flexdispatch modules take its CUDA side.

    Args:
        patch: how to replace an attribute: ``setattr`` (for good: a spawned rank, a benchmark)
            or a test's ``monkeypatch.setattr`` (undone after the test). Modules imported later
            keep their own ``cuda_code_path``: import what the code under test uses first.
    """
    from flexdispatch._checks import tensors

    def yes(device: torch.device) -> bool:
        return True

    patch(tensors, "defer_value_checks", yes)
    for name, mod in list(sys.modules.items()):
        if name.startswith("flexdispatch") and hasattr(mod, "cuda_code_path"):
            patch(mod, "cuda_code_path", yes)


def force_triton_kernels(
    on_launch: Callable[[str, tuple], None] | None = None,
    patch: Callable[[Any, str, Any], None] = setattr,
) -> bool:
    """Take the Triton kernels of the CUDA branch on CPU tensors, as CUDA does when triton
    imports: the dispatcher's value screen (``flexdispatch.kernels.screen``) and the in-band pack
    of a flat worst-case dispatch (``flexdispatch.kernels.inband``), under Triton's interpreter.
    The interpreter's own ATen calls are hidden from dispatch modes (they are no launches);
    ``on_launch(kernel name, args)`` is called at each launch instead.

    Returns:
        False (nothing patched) unless triton imports and interprets (``TRITON_INTERPRET=1``
        before triton was first imported).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from flexdispatch.kernels import _triton, inband, screen

    if not (_triton.triton_status()[0] and _triton.interpreting()):
        return False
    patch(screen, "screen_on_device", lambda device: True)
    patch(inband, "pack_on_device", lambda device: True)
    get = _triton.Kernel.get

    class Hidden:
        def __init__(self, name: str, built: Any) -> None:
            self.name, self.built = name, built

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kw: Any) -> Any:
                if on_launch is not None:
                    on_launch(self.name, args)
                with _disable_current_modes():
                    return self.built[grid](*args, **kw)

            return launch

    patch(_triton.Kernel, "get", lambda self: Hidden(self.fn.__name__, get(self)))
    return True
