"""Every command-line error is one line of at most 200 characters (issue 45, part 2):

    flexdispatch CMD: error: OPTION VALUE: PROBLEM: FIX

``format_error`` is the one formatter (``flexdispatch.cli._common``); ``--verbose`` adds the
derivation below the line. The table below drives the error paths of every command in process
(``flexdispatch.cli.main`` with captured stderr).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flexdispatch._checks.errors import InputError
from flexdispatch.cli._common import (
    MAX_LINE,
    CliError,
    format_error,
    option_scope,
    show_value,
)

pytestmark = pytest.mark.timeout(120)

LINE_RE = re.compile(r"^flexdispatch (\w+): error: (.+)$")


def test_a_long_path_keeps_its_start_and_last_part():
    path = "/tmp/" + "d" * 250 + "/x.yaml"
    shown = show_value(path)
    assert len(shown) <= 40 and shown.startswith("/tmp/ddd") and shown.endswith("/x.yaml"), shown
    assert show_value(Path("/a/b.yaml")) == "/a/b.yaml"
    assert show_value("x" * 5000) == "'" + "x" * 37 + "'…"
    assert show_value("a\nb\x1b[2J") == "'a\\nb\\x1b[2J'"  # escaped, never raw control characters
    assert show_value(200000000) == "200000000"


def test_the_line_names_the_option_and_never_cuts_the_fix():
    exc = CliError(
        "needs ~58.1 GiB, " + "x" * 400,
        option="--experts",
        value=200000000,
        fix="lower --experts",
        detail="R=2 ranks ...\nthe gate [E, H] fp32",
        exit_code=2,
    )
    line, *more = format_error("bench", exc)
    assert more == [] and len(line) == MAX_LINE, line
    assert line.startswith("flexdispatch bench: error: --experts 200000000: needs ~58.1 GiB, xx")
    assert line.endswith("…: lower --experts"), line
    lines = format_error("bench", exc, verbose=True)
    assert lines[0] == line and lines[1:] == ["  R=2 ranks ...", "  the gate [E, H] fp32"]


def test_an_older_message_keeps_its_end():
    # a ValueError without parts: the start and the end (where it says what to do) survive
    exc = ValueError("preset 'x' " + "y" * 400 + ": use fewer ranks (--nodes)")
    (line,) = format_error("demo", exc)
    assert len(line) <= MAX_LINE and line.endswith("use fewer ranks (--nodes)"), line
    assert " … " in line


def test_option_scope_names_the_option_and_keeps_the_library_parts():
    with pytest.raises(CliError) as info, option_scope("--from-hf", "/m/config.json"):
        raise InputError("whole message", problem="not JSON", fix="pass a config.json")
    exc = info.value
    assert (exc.option, exc.value, exc.problem, exc.fix) == (
        "--from-hf",
        "/m/config.json",
        "not JSON",
        "pass a config.json",
    )
    assert exc.detail == "whole message" and exc.exit_code == 2
    # a library error that names its own option (an environment variable) keeps it
    with pytest.raises(CliError) as info, option_scope("--from-hf", "x.json"):
        raise InputError("m", option="$FLEXDISPATCH_DEVICE", value="gpu", problem="not a device")
    assert (info.value.option, info.value.value) == ("$FLEXDISPATCH_DEVICE", "gpu")
    with pytest.raises(CliError) as info, option_scope("--preset", "p.yaml"):
        raise ValueError("plain")
    assert str(info.value) == "--preset p.yaml: plain"


def test_an_unexpected_error_says_how_to_see_the_traceback():
    (line,) = format_error("presets", RuntimeError("boom\nsecond"))
    assert line == (
        "flexdispatch presets: error: RuntimeError: boom second: --debug or FLEXDISPATCH_DEBUG=1 "
        "shows the traceback"
    )
    (line,) = format_error("presets", RuntimeError("boom"), debug=True)
    assert line == "flexdispatch presets: error: RuntimeError: boom"


def test_argparse_errors_lead_with_the_option(capsys):
    from flexdispatch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--seed", "-1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "flexdispatch demo: error: --seed: must be >= 0, got -1: see flexdispatch demo --help\n"
    )
