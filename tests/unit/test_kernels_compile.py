"""The Triton kernels compile for a GPU (sm_90), checked without one: ``scripts/compile_kernels.py
--quick`` records the launches that ``topk_routing`` / ``permute`` / ``unpermute`` (forward and
backward) make and compiles each down to a cubin. The interpreter tests beside this file accept
code the compiler would reject, so this is the check that the GPU path builds at all.

It runs in a subprocess without ``TRITON_INTERPRET`` (this process interprets, see
``conftest.py``) and with a fresh Triton cache, so every kernel is really compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernel tests need triton (scripts/setup.sh installs it)")

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_kernels.py"


@pytest.mark.timeout(600)
def test_every_kernel_branch_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " 0 failed" in out and "route_fwd" in out and "sum_rows" in out, out[-3000:]
    for name in ("screen_inputs", "pack_inband", "unpack_blocks", "capped_slots", "pack_blocks"):
        assert name in out, (name, out[-3000:])
