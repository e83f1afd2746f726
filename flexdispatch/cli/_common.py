"""What every sub-command shares: one-line errors, argument types checked at parse time, output
paths checked before the work starts, and the backend availability check.

Every error of the command line is one line on stderr of at most ``MAX_LINE`` characters,

    flexdispatch CMD: error: OPTION VALUE: PROBLEM: FIX

(``format_error``): the option at fault (a flag, ``$VARIABLE``, ``ulimit -v``) and its value
shown short, what is wrong, and what to do; a non-zero exit (2 for bad input, 1 for a run that
failed) and no traceback. ``--verbose`` (or ``FLEXDISPATCH_VERBOSE=1``) adds the derivation on
the lines below; ``--debug`` (or ``FLEXDISPATCH_DEBUG=1``) prints the traceback first.

A command raises ``CliError`` with these parts, or wraps the calls an option feeds in
``option_scope(option, value)``, which turns the library's ``ValueError`` (an ``InputError``
keeps its parts: ``flexdispatch._checks.errors``) into one.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

from flexdispatch._checks.errors import InputError

__all__ = [
    "CliError",
    "CliParser",
    "INT32_MAX",
    "MAX_LINE",
    "check_backend",
    "check_open_files",
    "check_output_path",
    "clear_status",
    "debug_enabled",
    "format_error",
    "group_failure",
    "int_range",
    "json_text",
    "memory_size",
    "nonnegative_float",
    "one_line",
    "option_scope",
    "positive_float",
    "print_error",
    "show_value",
    "status",
    "timeout_seconds",
    "verbose_enabled",
    "write_output",
]

INT32_MAX = (1 << 31) - 1
MAX_LINE = 200
"""Longest error line (characters) the command line prints without ``--verbose``."""
MAX_VALUE = 40
"""Longest value an error line shows (``show_value``)."""

_NO_VALUE: Any = object()


class CliError(Exception):
    """One command-line error, printed by ``format_error`` as
    ``flexdispatch CMD: error: OPTION VALUE: PROBLEM: FIX``; ``str()`` is the parts uncut.

    Args:
        problem: what is wrong, short (cut with ``…`` when the line would be too long).
        option: what the user changes: ``--experts``, ``$FLEXDISPATCH_DEVICE``, ``ulimit -v``
            (empty: nothing to name, e.g. a rank that failed).
        value: the option's value (shown short: ``show_value``); omitted: not shown.
        fix: what to do, in the imperative, at most ``MAX_FIX`` (80) characters: never cut.
        detail: how it was worked out (an estimate's parts, whole paths, each rank's last
            line): printed below the line with ``--verbose`` only.
        exit_code: 2 for bad input, 1 for a run that failed (the default).
    """

    def __init__(
        self,
        problem: str = "",
        *,
        option: str = "",
        value: object = _NO_VALUE,
        fix: str = "",
        detail: str = "",
        exit_code: int = 1,
    ) -> None:
        self.problem = problem
        self.option = option
        self.value = value
        self.fix = fix
        self.detail = detail
        self.exit_code = exit_code
        super().__init__(self._joined())

    @property
    def has_value(self) -> bool:
        return self.value is not _NO_VALUE

    def _joined(self) -> str:
        subject = " ".join(p for p in (self.option, show_value(self.value)) if p)
        return ": ".join(p for p in (subject, self.problem, self.fix) if p)


@contextlib.contextmanager
def option_scope(
    option: str,
    value: object = _NO_VALUE,
    fix: str = "",
    *,
    args: Mapping[str, tuple[str, object]] | None = None,
    exit_code: int = 2,
) -> Iterator[None]:
    """Name ``option`` (and ``value``) in the error of any ``ValueError`` the block raises: a
    ``CliError`` with the library's parts (``InputError``: its problem, fix and, where it names
    one, its own option such as an environment variable), its whole message as the detail.

    Args:
        option / value: the option that fed the block, and its value.
        fix: what to do, where the library's error does not say.
        args: the options of the library's argument names (``MemoryRefusal.arg``), when another
            option than ``option`` feeds one: ``{"nodes x ranks_per_node": ("--nodes", 4)}``.
        exit_code: of the ``CliError`` (2: bad input).
    """
    try:
        yield
    except CliError:
        raise
    except InputError as exc:
        mapped = (args or {}).get(getattr(exc, "arg", ""))
        if exc.option:
            option, value = exc.option, (exc.value if exc.has_value else _NO_VALUE)
        elif mapped is not None:
            option, value = mapped
        raise CliError(
            exc.problem or one_line(exc),
            option=option,
            value=value,
            fix=exc.fix or fix,
            detail=str(exc),
            exit_code=exit_code,
        ) from exc
    except ValueError as exc:
        raise CliError(
            one_line(exc), option=option, value=value, fix=fix, exit_code=exit_code
        ) from exc


class CliParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line (``format_error``: the option, what is
    wrong, ``see PROG --help``), exit 2."""

    def error(self, message: str) -> NoReturn:
        option = ""
        err = sys.exc_info()[1]  # NOTE: argparse calls error() inside its `except ArgumentError`
        if isinstance(err, argparse.ArgumentError) and err.argument_name:
            option, message = err.argument_name.split("/")[0], err.message
        elif message.startswith("argument ") and ": " in message:
            option, message = message[len("argument ") :].split(": ", 1)
            option = option.split("/")[0]
        if option == "command":  # NOTE: the sub-command's positional, not an option to name
            option = ""
        command = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        exc = CliError(message, option=option, fix=f"see {self.prog} --help", exit_code=2)
        self.exit(2, "\n".join(format_error(command, exc)) + "\n")


def show_value(value: object) -> str:
    """``value`` as an error line shows it: at most ``MAX_VALUE`` characters, printable. A path
    keeps its start and its last part (``/tmp/ddd…/x.yaml``); another string that is not a plain
    word is quoted and escaped (``files.excerpt``); nothing for no value."""
    from flexdispatch._checks.files import excerpt

    if value is _NO_VALUE:
        return ""
    if isinstance(value, (Path, str)) and (isinstance(value, Path) or "/" in value):
        text = excerpt(value, len(str(value)))[1:-1].replace("\\'", "'")
        if len(text) <= MAX_VALUE:
            return text
        last = text[text.rfind("/") :]
        tail = text[-min(len(last), MAX_VALUE // 2 + 7) :]
        return text[: MAX_VALUE - 1 - len(tail)] + "…" + tail
    if isinstance(value, str):
        plain = value.isascii() and value.isprintable() and " " not in value and value
        if plain and len(value) <= MAX_VALUE:
            return value
        return excerpt(value, MAX_VALUE - 3)
    text = str(value)
    return text if len(text) <= MAX_VALUE else excerpt(text, MAX_VALUE - 3)


def _parts(exc: BaseException, debug: bool) -> tuple[str, object, str, str, str, bool]:
    """(option, value, problem, fix, detail, the fix may come at the end of the problem) of
    ``exc``."""
    if isinstance(exc, CliError):
        return exc.option, exc.value, exc.problem, exc.fix, exc.detail, not exc.fix
    if isinstance(exc, InputError):
        value = exc.value if exc.has_value and exc.option else _NO_VALUE
        return exc.option, value, exc.problem or one_line(exc), exc.fix, str(exc), not exc.fix
    if isinstance(exc, (ValueError, OSError)):
        return "", _NO_VALUE, one_line(exc), "", "", True
    hint = "" if debug else "--debug or FLEXDISPATCH_DEBUG=1 shows the traceback"
    return "", _NO_VALUE, one_line(exc), hint, "", True


def _cut(text: str, room: int, keep_tail: bool) -> str:
    """``text`` in at most ``room`` characters: its start and ``…``; with ``keep_tail`` also its
    end (where a message without a separate fix says what to do)."""
    if len(text) <= room:
        return text
    if room <= 1:
        return "…"[:room]
    if keep_tail and room >= 40:
        tail = min(len(text), room // 2 - 1)
        return text[: room - tail - 3] + " … " + text[-tail:]
    return text[: room - 1] + "…"


def format_error(
    command: str, exc: BaseException, verbose: bool = False, debug: bool = False
) -> list[str]:
    """The lines that report ``exc`` for ``flexdispatch COMMAND``: the error line (at most
    ``MAX_LINE`` characters: the value shown short, the problem cut, never the fix), then with
    ``verbose`` the detail, each line indented by two spaces."""
    option, value, problem, fix, detail, tail = _parts(exc, debug)
    head = f"flexdispatch{' ' + command if command else ''}: error: "
    subject = " ".join(p for p in (option, show_value(value)) if p)
    fixed = [p for p in (subject, fix) if p]
    room = MAX_LINE - len(head) - sum(map(len, fixed)) - 2 * len(fixed)
    problem = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(problem.split()))
    short = _cut(problem, max(room, 0), tail)
    line = head + ": ".join(p for p in (subject, short, fix) if p)
    if len(line) > MAX_LINE:  # NOTE: only when the option and the fix alone do not fit
        line = line[: MAX_LINE - 1] + "…"
    lines = [line]
    if verbose:
        more = detail or (problem if short != problem else "")
        whole = str(value)
        if (isinstance(value, Path) or "/" in whole) and show_value(value) != whole:
            # NOTE: the whole path (escaped), which the line shortened
            from flexdispatch._checks.files import excerpt

            more = f"{option or 'path'}: {excerpt(whole, len(whole))}" + (
                f"\n{more}" if more else ""
            )
        lines += ["  " + ln for ln in more.splitlines() if ln.strip()]
    return lines


def verbose_enabled(args: argparse.Namespace | None = None) -> bool:
    """``--verbose`` was given or ``FLEXDISPATCH_VERBOSE`` is set to a true value."""
    if args is not None and getattr(args, "verbose", False):
        return True
    return _env_true("FLEXDISPATCH_VERBOSE")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_STATUS: dict[str, bool] = {"drawn": False}


def status(command: str, message: str, verbose: bool) -> None:
    """What ``flexdispatch COMMAND`` is doing, on stderr: a line per step with ``verbose``; else
    one status line on a terminal, redrawn in place and cleared (``clear_status``) before the
    result or an error; nothing when stderr is not a terminal."""
    if verbose:
        print(f"[{command}] {message}", file=sys.stderr, flush=True)
    elif sys.stderr.isatty():
        sys.stderr.write(f"\r\x1b[K[{command}] {message}")
        sys.stderr.flush()
        _STATUS["drawn"] = True


def clear_status() -> None:
    """Clear the status line ``status`` drew on the terminal (nothing when none)."""
    if _STATUS["drawn"]:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
        _STATUS["drawn"] = False


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    """``--debug`` was given or ``FLEXDISPATCH_DEBUG`` is set to a true value."""
    if args is not None and getattr(args, "debug", False):
        return True
    return _env_true("FLEXDISPATCH_DEBUG")


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


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite float >= 0 (``plan --skew``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (timeouts, bandwidths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def memory_size(text: str) -> int:
    """An argparse type: a memory size (``4GiB``, ``512MiB``; ``sysmem.parse_size``), in bytes."""
    from flexdispatch._checks.sysmem import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def check_output_path(
    path: str | Path, flag: str, example: str = "out.yaml", inputs: Iterable[str | Path] = ()
) -> Path:
    """Refuse, before any work, an output path that cannot be written
    (``flexdispatch._checks.files.check_output_path``: a symbolic link, a device, one of the
    ``inputs`` the command reads, ...), naming ``FLAG PATH``; ``example`` is the file name the
    message suggests inside a folder.

    Raises:
        CliError: naming the flag, the path and the fix.
    """
    from flexdispatch._checks import files

    with option_scope(flag, path):
        return files.check_output_path(path, f"{flag} {path}", example, inputs=inputs)


def write_output(path: str | Path, text: str, flag: str, inputs: Iterable[str | Path] = ()) -> None:
    """Write ``text`` to the file of ``flag`` (checked by ``check_output_path``; never over one
    of ``inputs``); a failure (a full disk, a path that became a FIFO or a link) is a
    ``CliError`` naming the flag and the path."""
    from flexdispatch._checks.files import write_file

    with option_scope(flag, path):
        write_file(path, text.encode("utf-8"), f"{flag} {path}", inputs=inputs)


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
        raise CliError(
            f"deep_ep is not available here ({why})",
            option=flag,
            value="deepep",
            fix=f"use {flag} torch or auto",
            exit_code=2,
        )


def check_open_files(ranks: int) -> None:
    """Refuse, before anything starts (the demo's runtime probe, the spawn), ``ranks`` spawned
    ranks that this process's open-file limit cannot serve: ``spawn_group`` holds a pipe and a
    store connection per rank (``flexdispatch.launch.spawn._check_spawn_args`` refuses the same
    later, naming ``world_size``); the option at fault is ``ulimit -n``."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return
    need = 3 * ranks + 32
    if soft != resource.RLIM_INFINITY and need > soft:
        raise CliError(
            f"{ranks} ranks need about {need} open files (a pipe and a store connection each)",
            option="ulimit -n",
            value=soft,
            fix=f"raise it (ulimit -n {max(1024, 2 * need)}), or use fewer ranks",
            exit_code=2,
        )


_EXITED = re.compile(r"^process exited with code (.+?) before reporting \((.*)\)$")
_ENDED = "ended by the parent"


def group_failure(exc: Any, *, phase: str, timeout_s: float) -> CliError:
    """A spawned group's failure (``launch.GroupError``) as one error: when ranks ran out of time,
    ``--timeout`` and how to raise it; else the first rank to fail (``exc.first``), what it was
    doing then (its own phase while it started or joined the group; ``phase``, the caller's step,
    once it ran the work), what it reported and what became of the others. Each rank's last line
    is the detail (``--verbose``); ``format_error`` fits the line in 200 characters."""
    errors: dict[int, str] = getattr(exc, "errors", {}) or {}
    detail = "\n".join(f"rank {r}: {_last_line(errors[r])}" for r in sorted(errors))
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
            f"rank(s) {ranks} did not finish while {phase}"
            + (f" (last phase: {last})" if last else ""),
            option="--timeout",
            value=f"{timeout_s:g}",
            fix=f"raise it (e.g. --timeout {max(60.0, 4 * timeout_s):g}) or use fewer --tokens",
            detail=detail,
        )
    if not errors:
        return CliError(f"the spawned ranks failed while {phase}: {one_line(exc, 400)}")
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
        others.append(f"rank(s) {', '.join(str(r) for r in sorted(failed) if r != first)} failed")
    if ended:
        others.append(f"rank(s) {', '.join(map(str, sorted(ended)))} ended by the parent")
    rest = f" ({'; '.join(others)})" if others else ""
    fix = "--debug shows every rank's traceback"
    if died:
        problem = f"rank {first} exited with code {died.group(1)} while {where_now}{rest}"
        return CliError(problem, fix=fix, detail=detail)
    last = _last_line(text)
    if "timed out" in last.lower() or "timeout" in last.lower():
        fix = f"raise --timeout (now {timeout_s:g} s); {fix}"
    return CliError(f"rank {first} failed while {where_now}{rest}: {last}", fix=fix, detail=detail)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def print_error(command: str, exc: BaseException, args: argparse.Namespace | None) -> int:
    """Print ``exc`` as the one-line error of ``command`` (``format_error``; the traceback first
    with ``--debug``, the detail below with ``--verbose``); return the exit code."""
    clear_status()
    debug = debug_enabled(args)
    if debug:
        import traceback

        traceback.print_exception(exc)
        errors = getattr(exc.__cause__, "errors", None)
        for rank, text in sorted((errors or {}).items()):
            print(f"--- rank {rank} ---\n{text}", file=sys.stderr)
    for line in format_error(command, exc, verbose_enabled(args), debug):
        print(line, file=sys.stderr)
    if isinstance(exc, CliError):
        return exc.exit_code
    return 2 if isinstance(exc, (ValueError, OSError)) else 1
