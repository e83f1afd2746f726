"""``flexdispatch demo`` and the launch recipe on a GPU machine: one rank per GPU over NCCL, said
in the report; more ranks than GPUs refused in one line before anything starts.

Skipped without CUDA. G GPUs visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexdispatch.launch import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PET_")}
    for k in ("FLEXDISPATCH_DEVICE", "FLEXDISPATCH_VISIBLE_GPUS", "NPROC_PER_NODE"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHON=sys.executable, **extra)
    return env


def _run(cmd: list[str], timeout: float = 240, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(**extra), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(300)
def test_demo_runs_one_rank_per_gpu_over_nccl_and_says_so() -> None:
    G = torch.cuda.device_count()
    demo = [sys.executable, "-m", "flexdispatch.cli", "demo", "--tokens", "8", "--iters", "1"]
    proc = _run([*demo, "--json"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads(proc.stdout)
    assert rep["ok"] and rep["devices"]["process_group"] == "nccl", rep["devices"]
    assert rep["devices"]["device"] == "cuda" and rep["devices"]["gpus_visible"] == G
    assert 1 <= rep["world_size"] <= G and 16 % rep["world_size"] == 0  # tiny_cpu: E = 16
    assert "NCCL, one rank per GPU" in rep["devices"]["line"]  # stderr: only with --verbose
    # the runtime allowance was measured with the GPU in use, and bounds every rank's peak
    fit = rep["fit"]
    assert "probe process (cuda)" in fit["runtime"]["source"], fit["runtime"]
    assert fit["measured_peak_rss"]["largest_rank"] <= fit["estimate"]["per_rank"], fit

    refused = _run([*demo, "--nodes", "1", "--ranks-per-node", str(G + 1)], timeout=60)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-2000:]
    assert f"{G + 1} rank(s) on this machine but only {G} GPU(s)" in lines[-1]
    assert "NCCL error" not in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.timeout(300)
def test_launch_recipe_on_the_gpus_and_refusing_more_ranks() -> None:
    G = torch.cuda.device_count()
    script = ["bash", str(ROOT / "scripts" / "launch" / "torchrun_single_node.sh")]
    args = ["--tokens", "8", "--iters", "1"]
    proc = _run([*script, *args], NPROC_PER_NODE="1", MASTER_PORT=str(free_port()))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "devices: 1 rank(s) on this machine" in proc.stdout and "NCCL" in proc.stdout
    refused = _run([*script, *args], timeout=60, NPROC_PER_NODE=str(G + 1))
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines() == [
        f"flexdispatch: refused: {G + 1} rank(s) on this machine but only {G} GPU(s) visible "
        f"(torch.cuda.device_count()): pass NPROC_PER_NODE={G} for one rank per GPU, or "
        f"FLEXDISPATCH_DEVICE=cpu to run on gloo/CPU"
    ]
