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

__all__ = ["ROOT", "run_cli", "AS_LIMIT", "cli_error"]

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
    return err
