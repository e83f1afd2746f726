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

from flexdispatch._checks.config_text import read_config_file
from flexdispatch._checks.files import file_kind, write_file
from flexdispatch.cli import main as cli_main
from tests.hostile import cli_error, verbose_error

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
            if name.startswith("link to"):  # NOTE: any link is refused (reliability-5 S14)
                assert f"error: {flag} " in err and ": is a symbolic link: " in err, err
                continue
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


# --------------------------------------------------------------------------- reliability-5 S13, S14


def test_a_folder_config_json_linking_out_of_the_folder_is_refused_unread(tmp_path, capsys):
    # S13: `config --from-hf model/` read model/config.json -> ../outside/secret.txt and quoted
    # its first 12 characters ('SECRETline:$')
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("SECRETline:$6$abcdefgh\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").symlink_to("../outside/secret.txt")
    argv = ["config", "--from-hf", str(model)]
    line = cli_error(argv, capsys)
    assert line.startswith("flexdispatch config: error: --from-hf /"), line
    assert "/model: its config.json is a symbolic link out of the folder (not read)" in line
    assert "SECRET" not in line + verbose_error(argv, capsys)


def test_the_hugging_face_cache_layout_still_imports(tmp_path, capsys):
    # snapshots/<rev>/config.json -> ../../blobs/<sha>: the cache's own links, into its blobs
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text(HF.read_text())
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/abc123")
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "real.json").write_text(HF.read_text())
    (tmp_path / "inside" / "config.json").symlink_to("real.json")  # a link inside the folder
    for folder in (snap, tmp_path / "inside"):
        assert cli_main(["config", "--from-hf", str(folder)]) == 0
        assert "num_experts: 8" in capsys.readouterr().out


def test_a_file_found_in_a_folder_is_not_quoted(tmp_path, capsys):
    # S13: a file the user did not name (the folder's config.json): the position and the kind
    # of character, never its text; a named file keeps a short escaped excerpt
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("root:$6$Zx9Q2sd8$abc:19000:0:99999:7:::\n")
    argv = ["config", "--from-hf", str(model)]
    line = cli_error(argv, capsys)
    full = verbose_error(argv, capsys)
    assert "line 1, column 1 is not valid JSON: Expecting value (at a letter)" in line, line
    assert "$6$" not in line + full and "Zx9Q" not in line + full, full
    line = cli_error(["config", "--from-hf", str(model / "config.json")], capsys)
    assert "(at 'root:$6$Zx9Q')" in line, line  # NOTE: named: 12 characters, escaped


@pytest.mark.parametrize(
    ("flag", "name", "argv"),
    [
        ("--output", "dang.yaml", ["config", "--from-hf", str(HF), "-o"]),
        ("--plot", "dang.png", [*PLAN, "--plot"]),
    ],
)
def test_an_output_through_a_dangling_link_is_refused(tmp_path, capsys, flag, name, argv):
    # S14: the link's folder was checked and the open followed the link: rc 0 and the file was
    # created where the link pointed (as root: /etc, /dev)
    (tmp_path / "inner").mkdir()
    (tmp_path / "outside").mkdir()
    link = tmp_path / "inner" / name
    link.symlink_to(f"../outside/created{Path(name).suffix}")
    line = cli_error([*argv, str(link)], capsys)
    assert line.startswith(f"flexdispatch {argv[0]}: error: {flag} ") and "symbolic link" in line
    assert list((tmp_path / "outside").iterdir()) == []
    with pytest.raises(ValueError, match="is a symbolic link"):  # NOTE: the library's write too
        write_file(link, b"x", "out")
    assert list((tmp_path / "outside").iterdir()) == []


def test_an_output_that_is_the_input_is_refused(tmp_path, capsys):
    # S14: `config --from-hf x.json -o x.json` replaced the input by its YAML
    src = tmp_path / "in.json"
    src.write_text(HF.read_text())
    os.link(src, tmp_path / "alias.yaml")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(HF.read_text())
    plan_cfg = tmp_path / "p.yaml"
    plan_cfg.write_text(Path(fd_presets() / "tiny_cpu.yaml").read_text())
    for argv in (
        ["config", "--from-hf", str(src), "-o", str(src)],
        ["config", "--from-hf", str(src), "-o", str(tmp_path / "alias.yaml")],  # a hard link
        ["config", "--from-hf", str(model), "-o", str(model / "config.json")],
        ["plan", "--config", str(plan_cfg), "--nodes", "1", "--ranks-per-node", "2", "--plot",
         str(plan_cfg)],
    ):  # fmt: skip
        line = cli_error(argv, capsys)
        assert ": is the input file: write to another file" in line, line
    assert src.read_text() == HF.read_text() == (model / "config.json").read_text()
    with pytest.raises(ValueError, match="is the input file"):
        write_file(tmp_path / "alias.yaml", b"x", "out", inputs=[src])
    assert src.read_text() == HF.read_text()


def fd_presets() -> Path:
    from flexdispatch.config import preset_path

    return preset_path("tiny_cpu").parent
