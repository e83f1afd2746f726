"""Paths that are not regular files (reliability-4 N13, N14 and the "does not exist" messages):
config paths and output paths that are FIFOs, devices, sockets, ``/proc`` or ``/sys`` files (or
symbolic links to them) are refused as "not a regular file" in one line, before any work, and
never block; a write that fails names the flag and the path."""

from __future__ import annotations

import io
import os
import socket
import sys
from pathlib import Path

import pytest

from flexdispatch._checks.files import file_kind, read_config_file, write_file
from flexdispatch.cli import main as cli_main
from tests.hostile import verbose_error

pytestmark = pytest.mark.timeout(60)

HF = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "mixtral_8x7b.json"
PLAN = ["plan", "--preset", "tiny_cpu", "--nodes", "1", "--ranks-per-node", "2", "--tokens", "8"]
LINUX = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")


def _code(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Every path this process opens (``os.open``, ``open``) while the test runs: a file that must
    never be written is checked by its name here, never by what the machine holds (another run
    or another user may have made it)."""
    import builtins

    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *a, **k):
        seen.append(os.fspath(path) if not isinstance(path, int) else "")
        return real_os_open(path, *a, **k)

    def py_open(file, *a, **k):
        seen.append(os.fspath(file) if not isinstance(file, int) else "")
        return real_open(file, *a, **k)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)
    return seen


def _one_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"flexdispatch {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def specials(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a path that is not a regular file, what the message calls it)."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.yaml"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    link = tmp_path / "urandom.yaml"
    link.symlink_to("/dev/urandom")
    found = {
        "fifo": (fifo, "a FIFO"),
        "socket": (sock_path, "a socket"),
        "/dev/zero": (Path("/dev/zero"), "a character device"),
        "/dev/stdin": (Path("/dev/stdin"), ""),  # a pipe, a terminal or /dev/null under pytest
        "link to /dev/urandom": (link, "a character device"),
        "/proc/self/environ": (Path("/proc/self/environ"), "a /proc or /sys pseudo-file"),
        "/proc/version": (Path("/proc/version"), "a /proc or /sys pseudo-file"),
    }
    env_link = tmp_path / "environ.json"
    env_link.symlink_to("/proc/self/environ")
    found["link to /proc/self/environ"] = (env_link, "a /proc or /sys pseudo-file")
    yield found
    sock.close()


@LINUX
def test_config_paths_that_are_not_files_are_named_so(specials, capsys):
    for name, (path, kind) in specials.items():
        if name == "/dev/stdin" and file_kind(path) is None:
            continue  # NOTE: stdin redirected from a regular file
        for argv, what in (
            (["presets", str(path)], "config file"),
            (["config", "--from-hf", str(path)], "config file"),
            (["config", "--from-megatron", str(path)], "Megatron argument file"),
        ):
            assert _code(argv) == 2, (name, argv)
            err = _one_line(capsys, argv[0])
            assert f"not a regular file ({kind}" in err and "does not exist" not in err, err
            err = verbose_error(argv, capsys)  # NOTE: the whole message, with --verbose
            assert f"{what} {path} is not a regular file ({kind}" in err, (name, err)
    with pytest.raises(ValueError, match=r"is not a regular file \(a FIFO\)"):
        read_config_file(specials["fifo"][0], kind="yaml")  # NOTE: no hang on the open


def test_missing_and_folder_config_paths(tmp_path, capsys):
    assert _code(["presets", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: does not exist" in _one_line(capsys, "presets")
    err = verbose_error(["presets", str(tmp_path / "nope.yaml")], capsys)
    assert f"config file {tmp_path / 'nope.yaml'} does not exist" in err
    assert _code(["presets", str(tmp_path)]) == 2
    assert ": is a folder: pass a YAML or JSON config file" in _one_line(capsys, "presets")
    assert f"config file {tmp_path} is a folder" in verbose_error(
        ["presets", str(tmp_path)], capsys
    )
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone")
    assert _code(["presets", str(tmp_path / "dangling.yaml")]) == 2
    assert "dangling.yaml: does not exist" in _one_line(capsys, "presets")


@LINUX
def test_output_paths_that_are_not_files_are_refused_before_the_work(
    specials, capsys, monkeypatch, opened
):
    import flexdispatch.importers as importers
    import flexdispatch.planner as planner

    monkeypatch.setattr(importers, "moe_config_from_hf", lambda *a, **k: pytest.fail("imported"))
    monkeypatch.setattr(planner, "plan_cluster", lambda *a, **k: pytest.fail("planned"))
    outputs = {**specials, "/dev/null": (Path("/dev/null"), "a character device")}
    outputs["/dev/full"] = (Path("/dev/full"), "a character device")
    for name, (path, kind) in outputs.items():
        if name == "/dev/stdin":
            continue
        for argv, flag in (
            (["config", "--from-hf", str(HF), "-o", str(path)], "--output"),
            ([*PLAN, "--plot", str(path)], "--plot"),
        ):
            assert _code(argv) == 2, (name, argv)
            err = _one_line(capsys, argv[0])
            assert f"error: {flag} " in err and f": is not a regular file ({kind})" in err, err
            err = verbose_error(argv, capsys)
            assert f"{flag} {path} is not a regular file ({kind})" in err, err
    for argv, flag, path in (
        (["config", "--from-hf", str(HF), "-o", "/sys/x.yaml"], "--output", "/sys/x.yaml"),
        ([*PLAN, "--plot", "/proc/x.png"], "--plot", "/proc/x.png"),
    ):
        assert _code(argv) == 2
        err = _one_line(capsys, argv[0])
        assert f"{flag} {path}: its folder is in /proc or /sys: write elsewhere" in err, err
    assert not [p for p in opened if p in ("/dev/null.png", "/dev/full.png")], opened


def test_plot_folder_suggests_a_png(tmp_path, capsys):
    assert _code([*PLAN, "--plot", str(tmp_path)]) == 2
    assert "is a folder: pass a file name in it, e.g. out.png" in _one_line(capsys, "plan")
    err = verbose_error([*PLAN, "--plot", str(tmp_path)], capsys)
    assert f"is a folder: pass a file name, e.g. {tmp_path / 'out.png'}" in err


@LINUX
def test_plot_plan_never_writes_beside_a_device(tmp_path, opened):
    pytest.importorskip("matplotlib")
    from flexdispatch.config import load_config
    from flexdispatch.planner import plan_cluster, plot_plan

    plan = plan_cluster(load_config("tiny_cpu"), nodes=1, ranks_per_node=2, tokens=8)
    for device in ("/dev/null", "/dev/full"):
        with pytest.raises(ValueError, match=rf"plot file {device} is not a regular file"):
            plot_plan(plan, device)
        assert f"{device}.png" not in opened, opened
    fifo = tmp_path / "p.png"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"is not a regular file \(a FIFO\)"):
        plot_plan(plan, fifo)  # NOTE: would block in matplotlib's open


def test_every_layer_checks_an_output_path_the_same_way(tmp_path):
    # NOTE: one check (_files.check_output_path) behind --output / --plot, plot_plan and
    # write_file: a missing folder is named as such, not as the system's "No such file"
    pytest.importorskip("matplotlib")
    from flexdispatch.config import load_config
    from flexdispatch.planner import plan_cluster, plot_plan

    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"^--output {missing}/x.yaml: folder {missing} does"):
        write_file(missing / "x.yaml", b"x", f"--output {missing / 'x.yaml'}")
    plan = plan_cluster(load_config("tiny_cpu"), nodes=1, ranks_per_node=2, tokens=8)
    with pytest.raises(ValueError, match=rf"^plot file {missing}/p: folder {missing} does not"):
        plot_plan(plan, missing / "p")
    with pytest.raises(
        ValueError, match=rf"plot file {tmp_path} is a folder: .*{tmp_path}/out.png"
    ):
        plot_plan(plan, tmp_path)
    assert not missing.exists()


def test_a_failed_write_names_the_flag_and_path(tmp_path, monkeypatch, capsys):
    if Path("/dev/full").exists():
        with pytest.raises(ValueError, match=r"--output /dev/full is not a regular file"):
            write_file("/dev/full", b"x", "--output /dev/full")
    out = tmp_path / "out.yaml"
    real_fdopen = os.fdopen

    class Full:  # NOTE: the file of write_file, on a disk that is full
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fdopen(fd, mode="r", *a, **k):
        f = real_fdopen(fd, mode, *a, **k)
        return Full(f) if "w" in mode else f

    monkeypatch.setattr(os, "fdopen", fdopen)
    assert _code(["config", "--from-hf", str(HF), "-o", str(out)]) == 2
    err = _one_line(capsys, "config")
    assert "out.yaml: cannot be written: No space left on device" in err
    err = verbose_error(["config", "--from-hf", str(HF), "-o", str(out)], capsys)
    assert f"--output {out} cannot be written: No space left on device" in err


def test_a_full_standard_output_is_named(monkeypatch, capsys):
    class Full(io.StringIO):
        def write(self, s):
            raise OSError(28, "No space left on device")

        def flush(self):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    assert cli_main(["presets"]) == 1
    err = _one_line(capsys, "presets")
    assert "cannot write to standard output: No space left on device" in err
    assert isinstance(sys.stdout, Full)  # NOTE: put back as it was


def test_config_output_to_a_fifo_does_not_block(tmp_path, capsys):
    """N13: before, the open blocked until a reader came (forever); now refused at once."""
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    assert _code(["config", "--from-hf", str(HF), "-o", str(fifo)]) == 2
    assert "is not a regular file (a FIFO)" in _one_line(capsys, "config")
    with pytest.raises(ValueError, match=r"is not a regular file \(a FIFO\)"):
        write_file(fifo, b"x", f"--output {fifo}")
