"""``spawn_group`` on gloo hides the GPUs from its ranks (no CUDA context, no device memory taken)
from the rank's first instruction, and leaves the parent's environment as it was."""

from __future__ import annotations

import os

import pytest

from flexdispatch.launch import spawn_group


def _seen() -> dict[str, object]:
    import torch

    return {
        "env": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": torch.cuda.is_available(),
        "count": torch.cuda.device_count(),
    }


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_gloo_ranks_see_no_gpu() -> None:
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    (hidden,) = spawn_group(_seen, 1, timeout_s=90)
    assert hidden == {"env": "", "cuda": False, "count": 0}
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the parent's is left as it was
