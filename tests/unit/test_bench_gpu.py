"""``benchmarks/bench_gpu.py`` on a machine without CUDA: its arguments, and that it refuses with
one line and status 2 instead of measuring anything (the measurements need a GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fd_bench_gpu", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(bench):
    a = bench.parse_args(["--quick", "--json", "out.json"])
    assert a.quick and a.json == "out.json" and a.reps == 7 and a.sections == list(bench.SECTIONS)
    a = bench.parse_args(["--sections", "permute, routing", "--reps", "3"])
    assert a.sections == ["permute", "routing"] and a.reps == 3 and not a.quick
    for bad in (["--sections", "routing,cuda"], ["--sections", ""], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda_in_one_line(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(_PATH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists()
