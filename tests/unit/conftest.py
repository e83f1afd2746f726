"""Triton's interpreter for the kernel tests (``test_kernels_*.py``) on machines without a GPU.

Triton decides once, when ``triton`` is first imported, whether it interprets (``TRITON_INTERPRET``
is read as its own standard library is decorated; an interpreted kernel can only call interpreted
library functions), so the variable is set here, while pytest collects the tests and before any of
them imports ``triton`` (flexdispatch imports it lazily). Only where CUDA is not available: with a
GPU the kernel tests run compiled, on CUDA tensors (``FLEXDISPATCH_TEST_DEVICE=cuda``), and nothing
else in the process is made to interpret. An explicit ``TRITON_INTERPRET`` is left as it is.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
