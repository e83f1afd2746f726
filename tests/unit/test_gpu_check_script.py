"""``scripts/gpu_check.sh`` on a CPU machine: its plan (``--dry-run``), its argument errors, the
skips it decides from what the interpreter has, and a real run that finds no CUDA, skips the rest
saying why and still writes its summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["cuda", "gpu_tests", "unit_cuda", "suite", "bench"]


def _run(
    *args: str, python: str | Path = sys.executable, **extra: str
) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEXDISPATCH_PYTHON": str(python), **extra}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=90, env=env
    )


def _plan(stdout: str) -> dict[str, tuple[int, str]]:
    steps = {}
    for line in stdout.splitlines():
        m = re.match(r"^(\w+)\s+<=\s+(\d+)s\s+(.*)$", line)
        if m:
            steps[m.group(1)] = (int(m.group(2)), m.group(3))
    return steps


def _bare_python(tmp_path: Path) -> Path:
    """An interpreter stand-in without pytest-xdist, pytest-timeout or the sgl-deep-ep wheels."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == "-" ]]; then\n'
        '  cat >/dev/null; echo "sgl-deep-ep sgl-deep-ep-v25"; exit 0\n'
        "fi\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    return fake


def test_dry_run_plan_fits_the_budget_and_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(str(out), "--dry-run", "--jobs", "3")
    assert proc.returncode == 0, proc.stderr
    plan = _plan(proc.stdout)
    assert list(plan) == STEPS
    assert sum(limit for limit, _ in plan.values()) <= 360
    assert "FLEXDISPATCH_TEST_DEVICE=cuda" in plan["unit_cuda"][1]
    assert "--ignore=tests/gpu" in plan["suite"][1] and "tests/gpu" in plan["gpu_tests"][1]
    assert "--quick" in plan["bench"][1] and str(out / "bench_gpu.json") in plan["bench"][1]
    try:
        import xdist  # noqa: F401

        assert "-n 3" in plan["suite"][1]
    except ImportError:
        assert "pytest-xdist absent" in proc.stdout and "-n " not in plan["suite"][1]
    assert not out.exists()


def test_dry_run_without_plugins_or_emulator_wheels_says_what_it_leaves_out(
    tmp_path: Path,
) -> None:
    proc = _run(str(tmp_path / "o"), "--dry-run", python=_bare_python(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "pytest-xdist absent" in proc.stdout and "pytest-timeout absent" in proc.stdout
    skip = [line for line in proc.stdout.splitlines() if line.startswith("deepep_emu")]
    assert len(skip) == 1 and "sgl-deep-ep sgl-deep-ep-v25 not installed" in skip[0], proc.stdout
    # the plug-in tests need Megatron-Core and torchtitan, which a machine without a registry lacks
    skip = [line for line in proc.stdout.splitlines() if line.startswith("integrations")]
    assert len(skip) == 1 and "megatron torchtitan spmd_types not importable" in skip[0], skip
    suite = _plan(proc.stdout)["suite"][1]
    for name in ("test_megatron.py", "test_megatron_expert_tp.py", "test_torchtitan.py"):
        assert f"--ignore=tests/dist/{name}" in suite, suite
    plan = _plan(proc.stdout)
    uses = re.compile(r"load_deep_ep|load_v25")
    emulated = sorted(
        str(p.relative_to(ROOT))
        for folder in ("dist", "hardening")
        for p in (ROOT / "tests" / folder).rglob("test_*.py")
        if uses.search(p.read_text())
    )
    assert "tests/dist/test_contract.py" in emulated and "tests/dist/test_deepep_v25.py" in emulated
    hosts = [f"tests/dist/{n}" for n in ("test_megatron.py", "test_megatron_expert_tp.py")]
    hosts.append("tests/dist/test_torchtitan.py")
    ignored = re.findall(r"--ignore=(\S+)", plan["suite"][1])
    assert sorted(set(ignored) - {"tests/gpu"}) == sorted(emulated + hosts)
    assert "--ignore" not in plan["unit_cuda"][1]  # the unit files skip themselves
    assert "-n " not in plan["suite"][1] and "--timeout" not in plan["suite"][1]


def test_wheels_are_installed_from_the_folder_only(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "sgl_deep_ep-0.1.2.post1-py3-none-any.whl").write_bytes(b"")
    proc = _run(str(tmp_path / "o"), "--wheels", str(wheels), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    plan = _plan(proc.stdout)
    assert list(plan) == ["cuda", "wheels", *STEPS[1:]]
    cmd = plan["wheels"][1]
    assert "pip install --no-index --no-deps" in cmd and str(wheels) in cmd


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "OUT .* is required"),
        (("o", "--jobs", "0"), "--jobs must be a positive integer, got '0'"),
        (("o", "--jobs", "many"), "--jobs must be a positive integer"),
        (("o", "--jobs"), "--jobs needs a number"),
        (("o", "--wheels", "/nonexistent/wheels"), "is not a folder"),
        (("o", "--wheels", "EMPTY"), "holds no .whl file"),
        (("o", "--bogus"), "unknown option --bogus"),
        (("o", "p"), "one OUT folder only"),
        (("FILE",), "exists and is not a folder"),
    ],
)
def test_argument_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("EMPTY", "FILE", "o", "p") else a for a in args]
    proc = _run(*argv, "--dry-run")
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr
    assert proc.stderr.startswith("usage: scripts/gpu_check.sh OUT")


def test_without_cuda_it_says_so_skips_the_rest_and_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(str(out), CUDA_VISIBLE_DEVICES="")  # no GPU, on any machine
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    assert re.search(r"^\| cuda \| FAIL \| \d+ \| .*is_available\(\) is False", summary, re.M)
    for name in STEPS[1:]:
        assert re.search(rf"^\| {name} \| SKIP \| 0 \| no CUDA", summary, re.M), summary
    assert (out / "cuda.log").is_file()


def test_emulator_unit_tests_skip_with_the_reason_without_the_wheel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a GPU machine without the sgl-deep-ep files sees: a skip naming the missing wheel,
    not a collection error (tests/unit/test_deepep_pure.py loads the emulator at import)."""
    import importlib.metadata

    from tests.deepep_emu import load

    real = importlib.metadata.distribution

    def missing(name: str):
        if name == "sgl-deep-ep":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(load.importlib.metadata, "distribution", missing)
    monkeypatch.setattr(load, "_CACHE", {})
    with pytest.raises(
        pytest.skip.Exception, match=r"sgl-deep-ep==0\.1\.2\.post1 is not installed"
    ):
        load.emulator_or_skip()


def test_help_is_the_header_comment() -> None:
    proc = _run("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("Everything GPU-relevant")
    assert proc.stdout.rstrip().endswith("1 a step failed, 2 bad usage.")
    assert "set -uo" not in proc.stdout
