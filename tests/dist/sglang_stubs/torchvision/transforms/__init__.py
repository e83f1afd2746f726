"""Test stub: the names SGLang 0.5.23 reads from ``torchvision.transforms`` at import time."""

from typing import Any

from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"torchvision.transforms.{name}: this is flexdispatch's test stub of torchvision "
        f"(tests/dist/sglang_stubs), which has no image transforms"
    )
