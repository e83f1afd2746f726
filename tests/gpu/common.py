"""Helpers shared by the GPU test files: world size, moving inputs, relative error.

Shape letters (ARCHITECTURE.md): R ranks.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["rel_err", "gpu_world", "to_device"]


def _maxabs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 for empty tensors)."""
    return _maxabs(a.float() - b.float()) / max(_maxabs(b.float()), 1e-30)


def gpu_world() -> int:
    """R for a one-node NCCL group: 8, 4 or 2, the most GPUs of this machine DeepEP takes."""
    n = torch.cuda.device_count()
    return 8 if n >= 8 else 4 if n >= 4 else 2


def to_device(inp: Any, dev: torch.device) -> Any:
    """A ``tests.dist.reference.Inputs`` with its tensors on ``dev``."""
    return type(inp)(x=inp.x.to(dev), idx=inp.idx.to(dev), probs=inp.probs.to(dev))
