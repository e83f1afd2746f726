"""The DeepEP backends' decode hot path: what flexdispatch itself spends, pinned (issue 46, H).

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
W worst-case rows (``num_worst_tokens``, here ``R * T``).

One dispatch + combine of a decode step (T = 8, H = 64, E = 8, k = 2, R = 2 gloo ranks,
intranode, ``checks=False``, ``torch.no_grad()``, after warm-up; both ranks) on DeepEP V1
(``Buffer``), V2 (``ElasticBuffer``) and V2.5 (``EPBuffer``), worst-case and dropless, on the
CUDA code path forced on CPU (what a GPU runs). DeepEP cannot run here: its own Python layer runs
over ``tests/deepep_emu``'s emulated runtime, so only what is flexdispatch's is pinned, counted
by ``benchmarks/bench_decode_deepep.py``'s hooks (``rank_counts``: each ATen op, host read,
collective and Python call attributed to the innermost frame of flexdispatch, DeepEP's Python
layer or the emulator) inside the module's pooled 2-rank group:

- host reads and collectives issued from flexdispatch's frames: EXACT. Worst-case: none.
  Dropless: V1 none (DeepEP's own CPU wait reads the receive counts), V2 / V2.5 one all-gather
  of five ints (the token bound's agreement, ``bounded.Agreement``) read once on the host.
- Python calls of flexdispatch's frames (front end and backend): a CEILING a little above what
  the per-shape plans reach (the exact count moves with the Python and torch versions; before
  the plans: V1 137 / 137, V2 69 / 96, V2.5 97 / 124, worst-case / dropless; after: V1
  38 / 38, V2 40 / 62, V2.5 49 / 71).
- ``stable``: the two counted calls agreed (a count that moves between calls would be a bug in
  a plan's caching).

The emulator's ops and collectives stand in for DeepEP's kernels and say nothing of them:
nothing of DeepEP is pinned here, nor timed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import run_group

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode_deepep.py"
T, H, E, K = 8, 64, 8, 2
# api -> mode -> (host reads, collectives, Python-call ceiling) of flexdispatch's frames
PINNED = {
    "v1": {"worst": (0, 0, 45), "dropless": (0, 0, 45)},
    "v2": {"worst": (0, 0, 48), "dropless": (1, 1, 72)},
    "v25": {"worst": (0, 0, 58), "dropless": (1, 1, 82)},
}


def _bench() -> Any:
    """benchmarks/bench_decode_deepep.py, imported by path (benchmarks/ is not a package)."""
    mod = sys.modules.get("fd_bench_decode_deepep")
    if mod is None:
        spec = importlib.util.spec_from_file_location("fd_bench_decode_deepep", BENCH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fd_bench_decode_deepep"] = mod
        spec.loader.exec_module(mod)
    return mod


def _counts_worker(rank: int, R: int) -> list:
    """``[(api, mode, counts)]`` of this rank, the same order on every rank, on the CUDA code
    path (``force_cuda_path`` patches the loaded modules; the pool puts them back)."""
    bench = _bench()
    bench.bd.force_cuda_path()
    return [
        (api, mode, bench.rank_counts(api, T, H, E, K, mode))
        for api in PINNED
        for mode in ("worst", "dropless")
    ]


def test_deepep_decode_counts_are_pinned() -> None:
    got = run_group(_counts_worker, 2)
    seen = set()
    for rank, per_rank in enumerate(got):
        for api, mode, c in per_rank:
            seen.add((api, mode))
            where = f"rank {rank} deepep-{api} {mode}: {c}"
            reads, collectives, ceiling = PINNED[api][mode]
            assert c["stable"], where
            assert c["fd_host_reads"] == reads, where
            assert c["fd_collectives"] == collectives, where
            assert 0 < c["fd_calls"] <= ceiling, where
            # NOTE: the instrument saw DeepEP's layer and the emulator (not flexdispatch's)
            assert c["deepep_calls"] > 0 and c["emu_calls"] > 0, where
    assert seen == {(api, mode) for api in PINNED for mode in ("worst", "dropless")}
