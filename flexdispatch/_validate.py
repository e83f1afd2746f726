"""Input validation shared by every public entry point.

Checks on metadata (dtype, rank, shape, device) are free and always run. Checks on values (id
ranges, NaN) need a device-to-host sync, so they run only when enabled (``checks=True`` or the
environment variable ``FLEXDISPATCH_CHECKS=1``) and never while a CUDA graph is being captured.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

__all__ = [
    "check_tensor",
    "checks_enabled",
    "is_capturing",
    "check_ids_in_range",
    "check_finite",
]


def is_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False on CPU-only builds)."""
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def checks_enabled(flag: bool | None = None) -> bool:
    """Whether value checks (host syncs) may run: ``flag`` or ``FLEXDISPATCH_CHECKS``, never
    during CUDA-graph capture."""
    if flag is None:
        flag = os.environ.get("FLEXDISPATCH_CHECKS", "").strip().lower() in ("1", "true", "yes")
    return bool(flag) and not is_capturing()


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    floating: bool = False,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` when ``value`` is not a suitable tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(
            f"{name} must have dtype {_dtype_names(dtypes)}, got "
            f"{str(value.dtype).replace('torch.', '')}: convert it with .to(...)"
        )
    if floating and not value.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got {str(value.dtype).replace('torch.', '')}"
        )
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(value.shape)}")
    return value


def check_ids_in_range(name: str, ids: torch.Tensor, upper: int) -> None:
    """Host-syncing check that every id is ``-1`` or in ``[0, upper)``."""
    if ids.numel() == 0:
        return
    bad = (ids < -1) | (ids >= upper)
    if bool(bad.any()):
        first = ids[bad].flatten()[0].item()
        count = int(bad.sum().item())
        raise ValueError(
            f"{name} holds {count} id(s) outside [-1, {upper}) (first: {first}): expert ids must "
            f"be -1 (dropped) or in [0, {upper})"
        )


def check_finite(name: str, value: torch.Tensor) -> None:
    """Host-syncing check that ``value`` holds no NaN or inf."""
    if value.numel() and not bool(torch.isfinite(value).all()):
        n = int((~torch.isfinite(value)).sum().item())
        raise ValueError(f"{name} holds {n} NaN/inf value(s): check the inputs of the router")
