"""Every command-line error is one line ``flexdispatch CMD: error: ...`` with a non-zero exit and
no traceback (``--debug`` / ``FLEXDISPATCH_DEBUG=1`` show it); output paths are checked before the
work starts; the demo runs on empty batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from flexdispatch.cli import main as cli_main
from flexdispatch.cli._common import group_failure
from flexdispatch.launch import GroupError
from tests.hostile import run_cli

pytestmark = pytest.mark.timeout(120)

HF = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "mixtral_8x7b.json"
PLAN = ["plan", "--preset", "tiny_cpu", "--nodes", "1", "--ranks-per-node", "2", "--tokens", "8"]


def _code(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as exc:  # parse-time errors exit through argparse
        return int(exc.code or 0)


def _one_line(err: str, command: str) -> None:
    assert err.startswith(f"flexdispatch {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


PARSE_ERRORS = [
    (["demo", "--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["demo", "--timeout", "-5"], "--timeout: must be a finite number > 0, got -5"),
    (["demo", "--timeout", "0"], "--timeout: must be a finite number > 0"),
    (["demo", "--timeout", "nan"], "--timeout: must be a finite number > 0"),
    (["demo", "--iters", "0"], "--iters: must be >= 1"),
    (["bench", "--timeout", "0"], "--timeout: must be a finite number > 0"),
    (["bench", "--seed", "-3"], "--seed: must be >= 0"),
    (["bench", "--tokens", "0"], "--tokens: must be >= 1"),
    (
        ["bench", "--experts", str(1 << 31)],
        "--experts: must be <= 2147483647, got 2147483648",
    ),
    (["bench", "--topk", "33"], "--topk: must be <= 32, got 33"),
    ([*PLAN, "--seed", "-1"], "--seed: must be >= 0"),
    ([*PLAN, "--nvlink-gbps", "inf"], "--nvlink-gbps: must be a finite number > 0"),
    (["demo", "--seed", "x"], "--seed: invalid int value: 'x'"),
]


@pytest.mark.parametrize(
    ("argv", "message"), PARSE_ERRORS, ids=[" ".join(a) for a, _ in PARSE_ERRORS]
)
def test_ranges_are_refused_at_parse_time_in_one_line(argv, message, capsys):
    assert _code(argv) == 2
    err = capsys.readouterr().err
    _one_line(err, argv[0])
    assert message in err


def test_bench_checks_the_backend_like_demo(monkeypatch, capsys):
    import flexdispatch.dispatch.select as select
    import flexdispatch.launch as launch

    monkeypatch.setattr(select, "deepep_available", lambda: (False, "no deep_ep\nhere"))
    monkeypatch.setattr(launch, "spawn_group", lambda *a, **k: pytest.fail("spawned"))
    for command in ("bench", "demo"):
        assert _code([command, "--backend", "deepep"]) == 2
        err = capsys.readouterr().err
        _one_line(err, command)
        assert "--backend deepep: deep_ep is not available here (no deep_ep here): use" in err


def test_bench_sizes_are_refused_before_spawning(monkeypatch, capsys):
    import flexdispatch.launch as launch

    monkeypatch.setattr(launch, "spawn_group", lambda *a, **k: pytest.fail("spawned"))
    for flag in ("--tokens", "--experts"):
        argv = ["bench", flag, str((1 << 31) - 16), "--hidden", "65536"]
        assert _code(argv) == 2
        err = capsys.readouterr().err
        _one_line(err, "bench")
        assert f"error: {flag} 2147483632: needs ~" in err and len(err) <= 201, err


def test_output_paths_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    import flexdispatch.importers as importers
    import flexdispatch.planner as planner

    monkeypatch.setattr(importers, "moe_config_from_hf", lambda *a, **k: pytest.fail("imported"))
    monkeypatch.setattr(planner, "plan_cluster", lambda *a, **k: pytest.fail("planned"))
    cases = [
        (["config", "--from-hf", str(HF), "-o", str(tmp_path / "no" / "x.yaml")], "does not exist"),
        (["config", "--from-hf", str(HF), "-o", str(tmp_path)], "is a folder"),
        ([*PLAN, "--plot", str(tmp_path / "no" / "p.png")], "does not exist"),
    ]
    for argv, message in cases:
        assert _code(argv) == 2
        err = capsys.readouterr().err
        _one_line(err, argv[0])
        assert message in err
    assert list(tmp_path.iterdir()) == []


def test_plot_reports_the_path_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli_main([*PLAN, "--plot", str(tmp_path / "traffic")]) == 0
    assert f"plot written to {tmp_path / 'traffic.png'}\n" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["traffic.png"]


def _line(exc) -> str:
    from flexdispatch.cli._common import format_error

    (line,) = format_error("demo", exc)
    assert len(line) <= 200, line
    return line


def test_a_reached_deadline_is_one_line_with_rank_phase_and_flag():
    errors = {r: f"timed out after 5 s (running {r > 0})" for r in range(3)}
    exc = group_failure(GroupError("x", errors), phase="[2/3] forward+backward", timeout_s=5)
    line = _line(exc)
    assert line.startswith(
        "flexdispatch demo: error: --timeout 5: rank(s) 0, 1, 2 did not finish while [2/3] "
        "forward+backward (last phase: rank 0: running False; "
    ), line
    assert line.endswith(": raise it (e.g. --timeout 60) or use fewer --tokens"), line
    tb = "Traceback (most recent call last):\n  File x\nCollectiveError: boom"
    exc = group_failure(GroupError("x", {1: tb}), phase="timing", timeout_s=9)
    assert _line(exc) == (
        "flexdispatch demo: error: rank 1 failed while timing: CollectiveError: boom: --debug "
        "shows every rank's traceback"
    )


def test_a_rank_failure_names_the_first_rank_its_own_phase_and_fits_a_line():
    # NOTE: reliability-5 S2: the line named the lowest failed rank and the caller's step
    # ("[2/3] running forward+backward") for a rank that died while it started
    from flexdispatch.cli._common import format_error

    errors = {
        0: "ended by the parent after rank 1 failed (joining the process group)",
        1: "process exited with code -9 (SIGKILL) before reporting (starting: importing and "
        "unpickling its function)",
    }
    exc = GroupError("x", errors, first=1, ended=frozenset({0}))
    got = group_failure(exc, phase="[2/3] running forward+backward", timeout_s=300)
    assert _line(got) == (
        "flexdispatch demo: error: rank 1 exited with code -9 (SIGKILL) while starting: importing "
        "and unpickling its function (rank(s) 0 ended by the parent): --debug shows every rank's "
        "traceback"
    )
    assert format_error("demo", got, verbose=True)[1:] == [
        "  rank 0: ended by the parent after rank 1 failed (joining the process group)",
        "  rank 1: " + errors[1],
    ]
    long = {1: "Traceback\nValueError: " + "x" * 400, 2: "Traceback\nCollectiveError: peer"}
    phases = {1: "running run_rank", 2: "running run_rank"}
    exc = GroupError("x", long, first=1, phases=phases)
    line = _line(group_failure(exc, phase="[2/3] forward+backward", timeout_s=300))
    start = (
        "flexdispatch demo: error: rank 1 failed while [2/3] forward+backward (rank(s) 2 failed)"
    )
    assert line.startswith(start + ": ValueError: xxx"), line
    assert line.endswith(": --debug shows every rank's traceback"), line


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    assert cli_main(["presets", str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert cli_main(["presets", str(bad), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("flexdispatch presets:")
    monkeypatch.setenv("FLEXDISPATCH_DEBUG", "1")
    assert cli_main(["presets", str(bad)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_too(monkeypatch, capsys):
    import flexdispatch.cli.presets_cmd as presets_cmd

    def boom(*a, **k):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(presets_cmd, "list_presets", boom)
    assert cli_main(["presets"]) == 1
    err = capsys.readouterr().err
    _one_line(err, "presets")
    assert "RuntimeError: disk on fire second line: --debug" in err


def test_demo_runs_on_empty_batches(tmp_path):
    """``demo --tokens 0``: the rank body and the reference check, on a group of one."""
    from flexdispatch.cli.demo import DemoSpec, check_against_reference, run_rank

    spec = DemoSpec(preset="tiny_cpu", backend="torch", tokens=0, seed=0, iters=1, worst_case=False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        result = run_rank(spec)
    finally:
        dist.destroy_process_group()
    assert result["modes"]["flat"]["output"].shape == (0, 64)
    diffs = check_against_reference(spec, [result])
    assert diffs and all(v == 0 for v in diffs.values())


@pytest.mark.timeout(180)
def test_cli_in_subprocesses_under_a_memory_limit(tmp_path):
    """Real processes under RLIMIT_AS: a reached demo deadline, and a hostile preset file."""
    proc = run_cli(
        "demo",
        "--nodes",
        "1",
        "--ranks-per-node",
        "2",
        "--tokens",
        "2",
        "--timeout",
        "0.5",
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert last.startswith(
        "flexdispatch demo: error: --timeout 0.5: rank(s) 0, 1 did not finish while [2/3]"
    ), last
    assert last.endswith(": raise it (e.g. --timeout 60) or use fewer --tokens"), last
    assert len(last) <= 200
    bomb = tmp_path / "b.yaml"
    bomb.write_text(
        "a: &a [1, 1]\n"
        + "".join(
            f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1 if i > 1 else ''}"] * 10) + "]\n"
            for i in range(1, 12)
        )
    )
    proc = run_cli("presets", "b.yaml", timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "expands to more than" in proc.stderr
    assert not os.environ.get("FLEXDISPATCH_DEBUG")


# --------------------------------------------------------------------------- reliability-4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--timeout", "1e-9"], "--timeout: must be between 0.001 and 2147483"),
        (["demo", "--timeout", "1e300"], "--timeout: must be between 0.001 and 2147483"),
        (["bench", "--timeout", "1e-4"], "--timeout: must be between 0.001 and 2147483"),
        (["bench", "--timeout", "3e6"], "--timeout: must be between 0.001 and 2147483"),
    ],
)
def test_timeouts_the_process_group_cannot_take_are_refused(argv, message, capsys):
    assert _code(argv) == 2
    err = capsys.readouterr().err
    _one_line(err, argv[0])
    assert message in err


LAUNCHER = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "abc"}, "error: $RANK abc: is not an integer"),
        ({"WORLD_SIZE": "abc"}, "error: $WORLD_SIZE abc: is not an integer"),
        ({"MASTER_PORT": "abc"}, "error: $MASTER_PORT abc: is not an integer"),
        ({"WORLD_SIZE": "0"}, "error: $WORLD_SIZE 0: must be >= 1"),
        ({"LOCAL_WORLD_SIZE": "0"}, "error: $LOCAL_WORLD_SIZE 0: must be >= 1 and <= 2"),
        ({"RANK": "2"}, "error: $RANK 2: must be >= 0 and <= 1"),
        ({"MASTER_PORT": "99999"}, "error: $MASTER_PORT 99999: must be >= 1 and <= 65535"),
        ({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "is not a multiple of $LOCAL_WORLD_SIZE=2"),
    ],
)
def test_launcher_variables_are_named(env, message, capsys, monkeypatch):
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("pg"))
    for key, value in {**LAUNCHER, **env}.items():
        monkeypatch.setenv(key, value)
    for command in ("demo", "bench"):
        assert _code([command, "--backend", "torch"]) == 2
        err = capsys.readouterr().err
        _one_line(err, command)
        assert message in err and "ZeroDivisionError" not in err


def test_doctor_names_a_zero_world_size(capsys, monkeypatch):
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "0")
        assert _code(["doctor"]) == 2
        err = capsys.readouterr().err
        _one_line(err, "doctor")
        assert f"error: ${key} 0: must be >= 1" in err
        monkeypatch.delenv(key)


def test_a_missing_peer_names_the_timeout(capsys, monkeypatch):
    # NOTE: rank 1 of 2 on a loopback MASTER_ADDR where nobody listens: its client store waits
    # the whole --timeout (a real wait, kept short) and the failure is one line naming it
    for key, value in LAUNCHER.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for command in ("demo", "bench"):
        assert _code([command, "--backend", "torch", "--timeout", "2"]) == 1
        err = capsys.readouterr().err.splitlines()[-1] + "\n"  # NOTE: after the demo's progress
        _one_line(err, command)
        # NOTE: one line of at most 200 characters: its start and its end (what to do)
        assert "rank 1 could not join the launcher" in err
        assert "check MASTER_ADDR and MASTER_PORT, or raise --timeout" in err and len(err) <= 201


def test_a_bad_thread_count_is_named_before_spawning(capsys, monkeypatch):
    import flexdispatch.launch as launch

    monkeypatch.setattr(launch, "spawn_group", lambda *a, **k: pytest.fail("spawned"))
    monkeypatch.setenv("FLEXDISPATCH_THREADS", "abc")
    assert _code(["bench"]) == 2
    err = capsys.readouterr().err
    _one_line(err, "bench")
    assert "error: $FLEXDISPATCH_THREADS abc: is not an integer" in err


def test_the_demo_check_fails_on_any_nan(tmp_path):
    """N15: a NaN in one expert's gradient was hidden behind Python's max() (``max(a, nan, b)``
    is ``max(a, b)``); now the check fails naming it, and ``--json`` writes null, never NaN."""
    import json

    from flexdispatch.cli._common import json_text
    from flexdispatch.cli.demo import DemoSpec, build_report, check_against_reference, run_rank

    spec = DemoSpec(preset="tiny_cpu", backend="torch", tokens=4, seed=0, iters=1, worst_case=False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        result = run_rank(spec)
    finally:
        dist.destroy_process_group()
    assert build_report(spec, [result], check_against_reference(spec, [result]), 1e-4)["ok"]
    result["modes"]["flat"]["grad_experts"]["w2"][0, 0, 0] = float("nan")
    diffs = check_against_reference(spec, [result])
    assert diffs["flat.grad_experts"] != diffs["flat.grad_experts"]  # NaN
    report = build_report(spec, [result], diffs, 1e-4)
    assert not report["ok"] and report["nonfinite_diffs"] == ["flat.grad_experts"]

    def refuse(name):
        raise ValueError(f"bare {name} in the JSON")

    back = json.loads(json_text(report), parse_constant=refuse)
    assert back["max_abs_diff"]["flat.grad_experts"] is None and back["ok"] is False
