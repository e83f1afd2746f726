"""Triton behind one guarded, lazy import; the ``impl`` switch; the kernels built on first use.

Kernels are plain functions (in ``_routing_src`` / ``_permute_src``) turned into Triton kernels
here, on first use: compiled (``JITFunction``), or interpreted (``InterpretedFunction``) when
this process runs Triton's interpreter. Triton decides that once, when ``triton`` is imported
(``TRITON_INTERPRET=1`` at that moment makes its own standard library, ``tl.max`` and the like,
interpreted functions, and an interpreted kernel can only call those), so ``interpreting()``
reads it from Triton itself rather than from the environment now.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["IMPLS", "dispatch_kernels", "interpreting", "resolve_impl", "triton_status", "Kernel"]

IMPLS = ("auto", "torch", "triton")

_STATUS: tuple[bool, str] | None = None


def triton_status() -> tuple[bool, str]:
    """``(importable, reason)`` for ``triton``; imported once, the answer cached."""
    global _STATUS
    if _STATUS is None:
        try:
            import triton
            import triton.language
        except Exception as exc:  # ImportError, or a broken install raising anything else
            _STATUS = (False, f"triton is not importable ({type(exc).__name__}: {exc})")
        else:
            _STATUS = (True, f"triton {getattr(triton, '__version__', '?')}")
    return _STATUS


_DISPATCH_KERNELS: bool | None = None


def dispatch_kernels() -> bool:
    """Whether the dispatcher's own kernels (``screen``, ``inband``) may run on CUDA tensors:
    ``triton`` imports and ``FLEXDISPATCH_DISPATCH_KERNELS`` is not ``0`` (read once per
    process; ``0`` is the way out should they fail to build on a GPU: their torch ops run)."""
    global _DISPATCH_KERNELS
    if _DISPATCH_KERNELS is None:
        off = os.environ.get("FLEXDISPATCH_DISPATCH_KERNELS", "").strip() in ("0", "false", "no")
        _DISPATCH_KERNELS = not off and triton_status()[0]
    return _DISPATCH_KERNELS


_INTERPRETING: bool | None = None


def interpreting() -> bool:
    """Triton runs its interpreter in this process (``TRITON_INTERPRET=1`` was set when
    ``triton`` was first imported); False without an importable ``triton``."""
    global _INTERPRETING
    if _INTERPRETING is None:
        if not triton_status()[0]:
            return False
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETING = isinstance(tl.max, InterpretedFunction)
    return _INTERPRETING


def resolve_impl(impl: str, device: torch.device, *, what: str) -> bool:
    """Whether ``impl`` means the Triton kernels for tensors on ``device``.

    Args:
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.
        device: where the inputs live.
        what: the calling function, for the error messages.

    Raises:
        ValueError: an unknown ``impl``; ``"triton"`` without an importable ``triton``, or on a
            non-CUDA device without ``TRITON_INTERPRET=1``.
    """
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda" and triton_status()[0]
    if impl != "triton":
        raise ValueError(f"{what}: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    ok, why = triton_status()
    if not ok:
        raise ValueError(
            f"{what}: impl='triton' but {why}: install triton (pip install triton) or pass "
            f"impl='torch' / 'auto'"
        )
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{what}: impl='triton' runs on CUDA tensors, or on {device.type} tensors under "
            f"Triton's interpreter only, which needs TRITON_INTERPRET=1 in the environment "
            f"before triton is first imported; pass impl='torch' / 'auto' here"
        )
    return True


class Kernel:
    """One kernel source, built on first use in the form this process runs (see the module
    docstring); ``kernel.get()[grid](*args, **constexprs)`` launches it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._built: Any = None

    def get(self) -> Any:
        """The launchable kernel (index it with the grid)."""
        if self._built is None:
            if interpreting():
                from triton.runtime.interpreter import InterpretedFunction

                self._built = InterpretedFunction(self.fn)
            else:
                from triton.runtime.jit import JITFunction

                self._built = JITFunction(self.fn)
        return self._built


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= max(n, 1)`` (Triton block sizes)."""
    return 1 << max(int(n) - 1, 0).bit_length()
