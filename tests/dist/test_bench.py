"""``flexdispatch bench`` and its harness (``flexdispatch.bench``) on spawned gloo ranks.

The row counts the benchmark reports are checked against per-token loops over every rank's
workload (rebuilt here from the same seed); the summary's medians and ratios against the raw
samples; the reported command against the parser. The ranks that ``run_spawned`` and the
command spawn run in the module's pooled groups (``tests/dist/harness.py``).

Shape letters: T tokens per rank · H hidden · E experts · e = E / R · k top-k · R ranks ·
L ranks per node · N nodes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shlex
import statistics

import pytest
import torch

from flexdispatch.bench import (
    SCHEMA,
    BenchSpec,
    ProgressBar,
    make_workload,
    run_spawned,
    summarize,
    time_interleaved,
)
from flexdispatch.cli import build_parser, main
from flexdispatch.cli.bench import spec_from_args
from tests.dist import harness

SMALL = {"tokens": 48, "hidden": 32, "experts": 8, "topk": 3, "reps": 3, "warmup": 1}


@pytest.fixture(autouse=True)
def _pooled_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``flexdispatch.launch.spawn_group`` -> the harness's (pooled groups, same signature)."""
    from flexdispatch import launch

    monkeypatch.setattr(launch, "spawn_group", harness.spawn_group)


# --------------------------------------------------------------------------- harness pieces


def test_time_interleaved_runs_round_robin_and_drops_warmup() -> None:
    calls: list[str] = []
    clock = iter(range(1, 1000))

    def timer(name: str, fn) -> float:
        fn()
        return float(next(clock))

    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    rounds = []
    got = time_interleaved(
        fns, reps=4, warmup=2, timer=timer, on_round=lambda: rounds.append(len(calls))
    )
    assert calls == ["a", "b", "c"] * 6
    assert rounds == [3, 6, 9, 12, 15, 18]
    # round r (0-based) gives a, b, c the durations 3r+1, 3r+2, 3r+3; rounds 0 and 1 are warm-up
    assert got == {n: [float(3 * r + 1 + i) for r in range(2, 6)] for i, n in enumerate("abc")}
    plain = time_interleaved({"x": lambda: None}, reps=2)
    assert len(plain["x"]) == 2 and all(t >= 0 for t in plain["x"])
    with pytest.raises(ValueError, match="reps must be >= 1"):
        time_interleaved(fns, reps=0)


def test_progress_bar() -> None:
    stream = io.StringIO()
    bar = ProgressBar(4, label="t", stream=stream, width=8)
    for _ in range(4):
        bar.advance()
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "[t] |########| 4/4" in text.splitlines()[-1].split("\r")[-1]
    assert "[t] |##......| 1/4" in text
    quiet = io.StringIO()
    off = ProgressBar(4, stream=quiet, enabled=False)
    off.advance()
    off.close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"what": ("router", "nope")}, "--what takes a comma-separated subset"),
        ({"experts": 9}, "must be divisible by the world size 2"),
        ({"topk": 9}, "cannot exceed --experts"),
        ({"ranks_per_node": 3, "world_size": 4, "experts": 8}, "positive divisor of R=4"),
        ({"dtype": "int8"}, "--dtype must be one of"),
        ({"reps": 0}, "--reps must be >= 1"),
    ],
)
def test_spec_validation(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BenchSpec(**{**SMALL, **change}).validate()


# --------------------------------------------------------------------------- spawned runs


def _expected_rows(spec: BenchSpec) -> tuple[list[int], list[int], list[int]]:
    """Per-token loops: rows sent (one per token and destination rank), rows received (tokens
    with at least one expert on the rank) and (row, slot) pairs received, per rank."""
    R = spec.world_size
    e = spec.experts // R
    sent, recv, pairs = [0] * R, [0] * R, [0] * R
    for src in range(R):
        idx = make_workload(spec, src, torch.device("cpu")).topk_idx.tolist()
        for token in idx:
            dests = sorted({x // e for x in token if x >= 0})
            sent[src] += len(dests)
            for d in dests:
                recv[d] += 1
            for x in token:
                if x >= 0:
                    pairs[x // e] += 1
    return sent, recv, pairs


def _check_report(report: dict, results: list[dict], spec: BenchSpec) -> None:
    assert report["schema"] == SCHEMA
    assert set(report) == {
        "schema",
        "command",
        "wall_s",
        "machine",
        "config",
        "backend",
        "backend_reason",
        "rows",
        "results",
    }
    assert report["backend"] == "torch"
    assert set(report["machine"]) >= {"cpu_count", "torch", "date", "device", "process_group"}
    assert report["machine"]["torch"] == torch.__version__
    assert [r["stage"] for r in report["results"]] == list(spec.what)
    for row in report["results"]:
        stage = row["stage"]
        per_rank = [1e3 * statistics.median(r["samples"][stage]) for r in results]
        assert row["per_rank_median_ms"] == pytest.approx(per_rank)
        assert row["median_ms"] == pytest.approx(max(per_rank))
        assert row["reps"] == spec.reps
        assert all(len(r["samples"][stage]) == spec.reps for r in results)
        base_key = f"{stage}/baseline"
        if stage == "layout":
            assert row["baseline"] is None and row["ratio"] is None
        else:
            base = max(1e3 * statistics.median(r["samples"][base_key]) for r in results)
            assert row["baseline_median_ms"] == pytest.approx(base)
            assert row["ratio"] == pytest.approx(row["median_ms"] / base)
    # the command reproduces the run
    argv = shlex.split(report["command"])
    assert argv[:2] == ["flexdispatch", "bench"]
    again = spec_from_args(build_parser().parse_args(argv[1:]))
    assert dataclasses.replace(again, progress=False) == dataclasses.replace(
        spec, progress=False, ranks_per_node=spec.ranks_per_node or spec.world_size
    )


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_spawned_bench_counts_rows_like_the_loop() -> None:
    spec = BenchSpec(world_size=2, **SMALL)
    results = run_spawned(spec, timeout_s=150)
    report = summarize(spec, results, launcher="spawn", wall_s=1.0)
    _check_report(report, results, spec)
    sent, recv, pairs = _expected_rows(spec)
    assert report["rows"]["sent_per_rank"] == sent
    assert report["rows"]["received_per_rank"] == recv
    assert report["rows"]["pairs_received_per_rank"] == pairs
    assert report["rows"]["host_syncs_per_dispatch"] == 1  # dropless torch backend
    assert report["config"]["nodes"] == 1


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_spawned_bench_two_nodes_worst_case() -> None:
    spec = BenchSpec(
        world_size=4, ranks_per_node=2, worst_case=True, what=("dispatch", "combine"), **SMALL
    )
    results = run_spawned(spec, timeout_s=150)
    report = summarize(spec, results, launcher="spawn", wall_s=1.0)
    _check_report(report, results, spec)
    sent, recv, pairs = _expected_rows(spec)
    assert report["rows"]["sent_per_rank"] == sent
    assert report["rows"]["received_per_rank"] == recv
    assert report["rows"]["pairs_received_per_rank"] == pairs
    assert report["rows"]["host_syncs_per_dispatch"] == 0  # worst-case mode: no host sync
    assert (report["config"]["nodes"], report["config"]["ranks_per_node"]) == (2, 2)
    assert report["config"]["worst_case"] is True


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    small = [f"--{k}={v}" for k, v in SMALL.items()]
    assert main(["bench", "--json", "--what", "router,layout,permute", *small]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == SCHEMA
    assert [r["stage"] for r in report["results"]] == ["router", "layout", "permute"]
    assert report["machine"]["launcher"] == "spawn"
    assert report["command"].endswith("--json")
    assert main(["bench", "--what", "layout", "--no-progress", *small]) == 0
    out = capsys.readouterr().out
    assert "layout" in out and "command: flexdispatch bench --what layout" in out
    assert main(["bench", "--experts", "9", *small[:2]]) == 2
    assert "--experts 9 must be divisible" in capsys.readouterr().err
