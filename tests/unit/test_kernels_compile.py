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
    for name in ("screen_inputs", "pack_inband", "unpack_blocks", "capped_slots"):
        assert name in out, (name, out[-3000:])


def _runtime_range_bounds(path: Path) -> list[str]:
    """``file:line name`` for every ``range(...)`` loop of a kernel whose bound is a runtime
    argument (a parameter not annotated ``tl.constexpr``)."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        runtime = {
            a.arg
            for a in fn.args.args
            if not (a.annotation and "constexpr" in ast.unparse(a.annotation))
        }
        for loop in ast.walk(fn):
            call = getattr(loop, "iter", None) if isinstance(loop, ast.For) else None
            if isinstance(call, ast.Call) and ast.unparse(call.func) in ("range", "tl.range"):
                names = {
                    n.id for arg in call.args for n in ast.walk(arg) if isinstance(n, ast.Name)
                }
                found += [f"{path.name}:{loop.lineno} {n}" for n in sorted(names & runtime)]
    return found


def test_kernel_loops_take_no_runtime_range_bound():
    """Triton 3.6's interpreter (the GPU machine's torch 2.11 ships it) cannot turn a runtime
    scalar argument into a ``range`` bound under numpy 2 (``only 0-dimensional arrays can be
    converted``), where 3.9's (CI's) can: a loop over a runtime count is a ``while`` loop.
    Checked on the source, so CI catches it without that Triton."""
    sources = sorted((_SCRIPT.parents[1] / "flexdispatch" / "kernels").glob("_*_src.py"))
    assert len(sources) >= 4, sources
    assert [hit for src in sources for hit in _runtime_range_bounds(src)] == []
