"""Test stub: ``InterpolationMode`` (an enum SGLang names at import time), nothing else."""

import enum
from typing import Any


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"torchvision.transforms.functional.{name}: this is flexdispatch's test stub of "
        f"torchvision (tests/dist/sglang_stubs), which has no image functions"
    )
