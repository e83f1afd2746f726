"""The memory estimates are measured, not assumed (reliability-4 N5, N12, item 2).

Every size check of flexdispatch compares an estimate with the memory available
(``flexdispatch._checks.fits``): ``dispatch_bytes`` (a dispatch and its combine, dropless and
worst-case, with and without autograd), ``layer_bytes`` (``MoELayer.forward``) and
``flexdispatch.cli.bench.bench_rank_bytes`` (one ``flexdispatch bench`` rank), and the buffers
``flexdispatch.launch.gather_objects`` counts (``wire.gather_copies``). Here each is
compared with the peak resident memory the call really adds (``tests/hostile/peak_probe.py``) at
several sizes, on one rank (a subprocess under ``RLIMIT_AS``) and on two gloo ranks: the estimate
must be at least ``LOW`` of the peak (the check refuses what would not fit: it plans for 80 % of
the memory, so an estimate a few percent under the peak still keeps the machine safe) and at most
``SLACK`` times it (it does not refuse what fits). The window leaves room for what differs between
machines (glibc's allocator, oneDNN's scratch, torch's kernels: the estimates are 1.25 to 2.4
times the peaks measured here) and still fails a missing term (an estimate per local expert where
every rank holds ``[E]`` tables was 2 to 4 times too low).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flexdispatch._checks import fits
from flexdispatch.cli.bench import bench_rank_bytes
from flexdispatch.launch.wire import gather_copies
from tests.dist.harness import spawn_group
from tests.hostile import AS_LIMIT, ROOT
from tests.hostile.peak_probe import measure_rank

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs"
    ),
]

LOW, SLACK = 0.9, 3.0


def _case(kind: str, T: int, H: int, k: int, E: int, W: int = 0, **kw) -> dict:
    return {
        "kind": kind,
        "T": T,
        "H": H,
        "k": k,
        "E": E,
        "W": W,
        "dtype": kw.get("dtype", "fp32"),
        "grad": kw.get("grad", False),
        "L": kw.get("L", 0),
        **({"F": kw["F"]} if "F" in kw else {}),
    }


ONE_RANK = [
    _case("dispatch", 10000, 256, 2, 8),
    _case("dispatch", 10000, 256, 2, 8, grad=True),
    _case("dispatch", 10000, 8, 8, 64, dtype="bf16"),  # ids and probs dominate
    _case("dispatch", 16, 32, 2, 8, W=100000),  # worst-case rows dominate
    _case("dispatch", 5000, 256, 2, 8, W=10000, dtype="bf16", grad=True),
    _case("dispatch", 16, 32, 2, 10**6, grad=True),  # the per-expert counts dominate
    _case("layer", 4000, 128, 2, 8, F=64, grad=True),
    _case("layer", 2000, 32, 8, 256, F=16),  # the router's [T, E] scores dominate
    _case("layer", 3000, 64, 2, 16, W=6000, F=128, dtype="bf16", grad=True),
    _case("bench", 5000, 256, 2, 8, dtype="bf16"),
    _case("bench", 4000, 256, 2, 8, W=1, dtype="bf16"),
]
TWO_RANKS = [
    _case("dispatch", 10000, 256, 2, 8),
    _case("dispatch", 16, 32, 2, 4 * 10**6),  # every rank holds [E] id tables, not [E / R]
    _case("dispatch", 10000, 256, 4, 8, L=1),  # hierarchical: two hops
    _case("dispatch", 16, 32, 2, 4 * 10**6, L=1),  # hierarchical: a third [E] table
    _case("dispatch", 16, 32, 2, 8, W=100000),
    _case("layer", 4000, 128, 2, 8, F=64, grad=True),
    _case("bench", 4000, 256, 2, 8, W=1, dtype="bf16"),
    # NOTE: reliability-5: 80 MB per rank grew the peak by 538 MB against 5 x 80 MB estimated
    _case("gather", 20_000_000, 0, 0, 0),
]


def _estimate(case: dict, R: int) -> int:
    elem = 4 if case["dtype"] == "fp32" else 2
    T, H, k, E, W = case["T"], case["H"], case["k"], case["E"], case["W"]
    if case["kind"] == "gather":
        return gather_copies(R) * T
    if case["kind"] == "bench":
        return bench_rank_bytes(T=T, H=H, E=E, k=k, R=R, elem=elem, worst_case=W > 0)
    if case["kind"] == "layer":
        F = case["F"]
        return fits.layer_bytes(
            T=T, H=H, F=F, Fs=0, E=E, k=k, R=R, elem=elem, W=W, grad=case["grad"], L=case["L"]
        )
    return fits.dispatch_bytes(
        T=T, H=H, elem=elem, k=k, R=R, E=E, W=W, grad=case["grad"], L=case["L"]
    )


def _check(case: dict, R: int, peak: int) -> str | None:
    est = _estimate(case, R)
    if LOW * peak <= est <= SLACK * peak:
        return None
    return f"R={R} {case}: estimate {est >> 20} MiB vs measured peak {peak >> 20} MiB"


def _limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def test_estimates_bound_the_measured_peak_on_one_rank():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.hostile.peak_probe", json.dumps(ONE_RANK)],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        preexec_fn=_limit,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(measured) == len(ONE_RANK)
    bad = [_check(c, 1, c.pop("peak")) for c in measured]
    assert not any(bad), "\n".join(b for b in bad if b)


def test_estimates_bound_the_measured_peak_on_two_ranks():
    peaks = spawn_group(measure_rank, 2, args=(TWO_RANKS,), timeout_s=200)
    bad = [_check(c, 2, p[i]) for p in peaks for i, c in enumerate(TWO_RANKS)]
    assert not any(bad), "\n".join(b for b in bad if b)
