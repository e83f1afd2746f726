"""What every sub-command shares: one-line errors, argument types checked at parse time, output
paths checked before the work starts, and the backend availability check.

Every error of the command line is one line on stderr, ``flexdispatch CMD: error: MESSAGE``, with
a non-zero exit (2 for bad input, 1 for a run that failed) and no traceback; ``--debug`` (or
``FLEXDISPATCH_DEBUG=1``) prints the traceback first.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "CliError",
    "CliParser",
    "INT32_MAX",
    "check_backend",
    "check_output_path",
    "debug_enabled",
    "group_failure",
    "int_range",
    "json_text",
    "one_line",
    "positive_float",
    "print_error",
    "timeout_seconds",
    "write_output",
]

INT32_MAX = (1 << 31) - 1


class CliError(Exception):
    """An error the command line prints as one line, with ``exit_code`` (default 1)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class CliParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line (``PROG: error: MESSAGE``, exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    """``--debug`` was given or ``FLEXDISPATCH_DEBUG`` is set to a true value."""
    if args is not None and getattr(args, "debug", False):
        return True
    return os.environ.get("FLEXDISPATCH_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def one_line(exc: BaseException, limit: int = 2000) -> str:
    """The exception as one line: its message's lines joined (at most ``limit`` characters);
    other than a ``ValueError``/``CliError``, prefixed by its type."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not isinstance(exc, (ValueError, CliError)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def int_range(lo: int, hi: int = INT32_MAX) -> Any:
    """An argparse type: an int in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lo or value > hi:
            bound = f">= {lo}" if value < lo else f"<= {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (timeouts, bandwidths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def timeout_seconds(text: str) -> float:
    """An argparse type: a timeout in seconds, in ``flexdispatch.launch.lifetime``'s one range
    (``[MIN_TIMEOUT_S, MAX_TIMEOUT_S]``, ``spawn_group``'s too)."""
    from flexdispatch.launch.lifetime import MAX_TIMEOUT_S, MIN_TIMEOUT_S

    value = positive_float(text)
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:.0f} seconds, got {text}"
        )
    return value


def check_output_path(path: str | Path, flag: str, example: str = "out.yaml") -> Path:
    """Refuse, before any work, an output path that cannot be written
    (``flexdispatch._checks.files.check_output_path``, named ``FLAG PATH``); ``example`` is the file
    name the message suggests inside a folder.

    Raises:
        ValueError: naming the flag, the path and the fix.
    """
    from flexdispatch._checks import files

    return files.check_output_path(path, f"{flag} {path}", example)


def write_output(path: str | Path, text: str, flag: str) -> None:
    """Write ``text`` to the file of ``flag`` (checked by ``check_output_path``); a failure (a
    full disk, a path that became a FIFO) is a ``ValueError`` naming the flag and the path."""
    from flexdispatch._checks.files import write_file

    write_file(path, text.encode("utf-8"), f"{flag} {path}")


def json_text(obj: Any, indent: int = 2) -> str:
    """``obj`` as standard JSON: a NaN or infinite float becomes ``null`` (``json.dumps`` would
    write the bare ``NaN`` / ``Infinity`` that JSON parsers refuse)."""
    import json

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def check_backend(backend: str, flag: str = "--backend") -> None:
    """Refuse ``--backend deepep`` where ``deep_ep`` does not import (one line, before spawning)."""
    if backend != "deepep":
        return
    from flexdispatch.dispatch.select import deepep_available

    ok, why = deepep_available()
    if not ok:
        why = " ".join(str(why).split())
        raise ValueError(f"{flag} deepep is not available here ({why}): use {flag} torch or auto")


_EXITED = re.compile(r"^process exited with code (.+?) before reporting \((.*)\)$")
_ENDED = "ended by the parent"
GROUP_LINE = 170
"""The longest ``group_failure`` message: with ``flexdispatch CMD: error: `` the line stays
within 200 characters."""


def group_failure(exc: Any, *, phase: str, timeout_s: float) -> CliError:
    """A spawned group's failure (``launch.GroupError``) as one line of at most ``GROUP_LINE``
    characters: the first rank to fail (``exc.first``), what it was doing then (its own phase:
    starting, joining the group; ``phase``, the caller's step, once it ran the work), what it
    reported, and what became of the others; or, when ranks ran out of time, the flag to change."""
    errors: dict[int, str] = getattr(exc, "errors", {}) or {}
    ended = {r for r, e in errors.items() if e.startswith(_ENDED)}
    timed_out = sorted(r for r, e in errors.items() if "timed out" in e and r not in ended)
    if timed_out and len(timed_out) == len(errors):
        ranks = ", ".join(map(str, timed_out))
        where: dict[str, list[int]] = {}
        for r in timed_out:  # "timed out after 5 s (joining the process group)"
            text = errors[r]
            if text.endswith(")") and "(" in text:
                where.setdefault(text[text.index("(") + 1 : -1], []).append(r)
        last = "; ".join(
            f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {p}" for p, rs in where.items()
        )
        return CliError(
            f"rank(s) {ranks} did not finish within --timeout {timeout_s:g} s while {phase}"
            + (f" (last phase: {last})" if last else "")
            + f": raise --timeout (e.g. --timeout {max(60.0, 4 * timeout_s):g}) or make the run "
            f"smaller (--tokens)"
        )
    if not errors:
        return CliError(_fit(f"the spawned ranks failed while {phase}: ", one_line(exc, 400), ""))
    failed = [r for r in errors if r not in ended] or sorted(errors)
    first = getattr(exc, "first", None)
    if first not in failed:
        first = min(failed)
    text = errors[first].strip()
    own = (getattr(exc, "phases", None) or {}).get(first)
    died = _EXITED.match(text)
    if died:
        own = own or died.group(2)
    # NOTE: a rank's own phase says more while it starts or joins; once it runs the work, the
    # caller's step says which part of it
    where_now = phase if not own or own.startswith("running") else own
    others = []
    if len(failed) > 1:
        rest = ", ".join(str(r) for r in sorted(failed) if r != first)
        others.append(f"rank(s) {rest} failed too")
    if ended:
        others.append(f"rank(s) {', '.join(map(str, sorted(ended)))} ended by the parent")
    tail = (
        f" ({'; '.join(others)}; --debug shows every rank's traceback)"
        if others
        else (" (--debug shows its traceback)")
    )
    if died:
        return CliError(
            _fit(f"rank {first} exited with code {died.group(1)} while {where_now}", "", tail)
        )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    last = lines[-1] if lines else "no message"
    if "timed out" in last.lower() or "timeout" in last.lower():
        tail = f"; raise --timeout (now {timeout_s:g} s){tail}"
    return CliError(_fit(f"rank {first} failed while {where_now}: ", last, tail))


def _fit(head: str, middle: str, tail: str, limit: int = GROUP_LINE) -> str:
    """``head + middle + tail`` in at most ``limit`` characters: ``middle`` (a rank's message)
    is cut first, then ``head``."""
    room = limit - len(head) - len(tail)
    if len(middle) > room:
        middle = middle[: max(0, room - 1)] + "…" if room > 1 else ""
    text = head + middle + tail
    return text if len(text) <= limit else text[: limit - 1] + "…"


def print_error(command: str, exc: BaseException, args: argparse.Namespace | None) -> int:
    """Print ``exc`` as the one-line error of ``command`` (the traceback first with --debug);
    return the exit code."""
    if debug_enabled(args):
        import traceback

        traceback.print_exception(exc)
        errors = getattr(exc.__cause__, "errors", None)
        for rank, text in sorted((errors or {}).items()):
            print(f"--- rank {rank} ---\n{text}", file=sys.stderr)
    hint = ""
    if not isinstance(exc, (ValueError, CliError, OSError)) and not debug_enabled(args):
        hint = " (--debug or FLEXDISPATCH_DEBUG=1 shows the traceback)"
    print(f"flexdispatch {command}: error: {one_line(exc)}{hint}", file=sys.stderr)
    if isinstance(exc, CliError):
        return exc.exit_code
    return 2 if isinstance(exc, (ValueError, OSError)) else 1
