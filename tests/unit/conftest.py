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

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def dev(device: torch.device) -> torch.device:
    """The test device where the Triton kernels can run (``test_kernels_*.py``): on CPU only
    under the interpreter (without it: an error, or a skip on a CUDA machine, which runs the
    kernel tests compiled with ``FLEXDISPATCH_TEST_DEVICE=cuda``)."""
    from flexdispatch.kernels import interpreting

    if device.type == "cpu" and not interpreting():
        if torch.cuda.is_available():
            pytest.skip(
                "a CUDA machine runs the kernel tests compiled, on CUDA tensors: "
                "FLEXDISPATCH_TEST_DEVICE=cuda (Triton's interpreter stays off there)"
            )
        pytest.fail(
            "the kernel tests on CPU need Triton's interpreter: TRITON_INTERPRET=1 before triton "
            "is first imported (this conftest sets it unless CUDA is available; with a GPU run "
            "them with FLEXDISPATCH_TEST_DEVICE=cuda)"
        )
    return device
