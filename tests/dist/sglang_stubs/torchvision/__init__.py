"""Test stub of torchvision for SGLang's imports (see ../README.md): no image code."""

from torchvision import transforms

__all__ = ["transforms"]
