"""Hostile inputs (issue 28): sizes refused before anything is allocated, config files that try to
exhaust the parser, command-line errors as one line, loopback-only single-node runs.

Command-line checks run ``flexdispatch.cli.main(argv)`` in process where they can; the few that
need a real process (an address-space limit, a traceback that must not appear) go through
``run_cli`` below: a subprocess under ``RLIMIT_AS`` and a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_cli", "AS_LIMIT", "cli_error", "verbose_error", "MAX_LINE"]

MAX_LINE = 200
"""Longest error line the command line prints (issue 45)."""

ROOT = Path(__file__).resolve().parents[2]

AS_LIMIT = 4 << 30
"""Address space a CLI subprocess may map (torch alone maps about 1.5 GiB)."""


def _limit_memory() -> None:  # runs in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run_cli(*argv: str, timeout: float = 60, env: dict[str, str] | None = None, cwd=None):
    """``python -m flexdispatch ARGV`` under ``AS_LIMIT`` and ``timeout``; the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("FLEXDISPATCH_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "flexdispatch.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or ROOT,
        preexec_fn=_limit_memory,
    )


def cli_error(argv: list[str], capsys) -> str:
    """``flexdispatch.cli.main(argv)`` in process, which must exit 2 with one line on stderr
    (``flexdispatch <command>: error: ...``); that line. ``capsys``: pytest's fixture."""
    from flexdispatch.cli import main as cli_main

    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"flexdispatch {argv[0]}: error: ") and err.count("\n") == 1, err
    assert len(err) <= MAX_LINE + 1, err
    return err


def verbose_error(argv: list[str], capsys, code: int = 2) -> str:
    """``flexdispatch.cli.main`` with ``--verbose`` after the command, in process: it must exit
    ``code`` with the one error line (``flexdispatch <command>: error: ...``, at most
    ``MAX_LINE`` characters) and then the detail (the library's whole message, whole paths),
    each line indented; the whole of stderr."""
    from flexdispatch.cli import main as cli_main

    try:
        got = cli_main([argv[0], "--verbose", *argv[1:]])
    except SystemExit as exc:
        got = int(exc.code or 0)
    err = capsys.readouterr().err
    first, *rest = err.splitlines()
    assert got == code, err
    assert first.startswith(f"flexdispatch {argv[0]}: error: ") and len(first) <= MAX_LINE, err
    assert "Traceback" not in err and all(line.startswith("  ") for line in rest), err
    return err
