"""Bounded reading of configuration files (YAML and JSON) and errors that never echo a file.

Every config file flexdispatch reads (``load_config``, ``flexdispatch config --from-hf`` /
``--from-megatron``, the Hugging Face importer) goes through ``config_text.read_config_file``,
which refuses, before any Python object of the document is built and before pydantic sees it:

- a path that is not a regular file (``file_kind``: a FIFO, which would block, a device, a
  socket, a ``/proc`` or ``/sys`` file, or a link to one), opened non-blocking and checked again
  on the descriptor;
- a file larger than ``MAX_CONFIG_BYTES`` (read at most that much plus one byte);
- YAML whose tree, with every alias expanded, holds more than ``MAX_CONFIG_NODES`` nodes (a
  "billion laughs" file of nested aliases), or an alias that refers to itself;
- nesting deeper than ``MAX_CONFIG_DEPTH`` levels (YAML or JSON);
- malformed YAML or JSON, reported with the file, the line and the column.

Error messages quote at most ``EXCERPT_CHARS`` characters of the file, escaped (``excerpt``), never
whole lines: a file that is not a config at all (a system file passed by mistake) is not echoed
back. ``validation_message`` formats pydantic's errors the same way (field, message, a short
escaped excerpt of the offending value); an unknown key is named by ``key_text`` (in full only
when it looks like a config key). ``check_output_path`` is the one check of an output path
(``-o``, ``--plot``), and ``write_file`` writes one to regular files only.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flexdispatch._checks.errors import InputError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_NODES",
    "MAX_CONFIG_DEPTH",
    "EXCERPT_CHARS",
    "check_output_path",
    "excerpt",
    "file_error",
    "file_kind",
    "key_text",
    "on_pseudo_fs",
    "write_file",
    "validation_message",
]

MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB; the shipped presets are about 2 KiB, HF configs < 100 KiB)."""

MAX_CONFIG_NODES = 100_000
"""Most YAML/JSON nodes a document may hold with every alias expanded."""

MAX_CONFIG_DEPTH = 64
"""Deepest nesting of mappings/sequences accepted (a MoE config needs about 4)."""

EXCERPT_CHARS = 12
"""Most characters of a file (or of a value) an error message quotes."""


def excerpt(text: object, limit: int = EXCERPT_CHARS) -> str:
    """``text`` cut to ``limit`` characters and escaped (``\\n``, control and non-ASCII
    characters as escapes), in quotes, with ``…`` when cut."""
    s = str(text)
    cut = len(s) > limit
    s = s[:limit].encode("ascii", "backslashreplace").decode("ascii")
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    return "'" + s.replace("'", "\\'") + "'" + ("…" if cut else "")


def _where(path: Path | str, line: int | None, column: int | None) -> str:
    if line is None:
        return f"{path}"
    return f"{path} at line {line + 1}, column {(column or 0) + 1}"


def file_error(
    what: str,
    path: Path | str,
    problem: str,
    fix: str = "",
    line: int | None = None,
    column: int | None = None,
) -> InputError:
    """The error of a config file: ``WHAT PATH[ at line L, column C] PROBLEM[: FIX]``, with the
    parts for a one-line report (``InputError``: the path as the value, the problem with its
    position, the fix). ``line`` / ``column`` count from 0."""
    where = "" if line is None else f"line {line + 1}, column {(column or 0) + 1} "
    return InputError(
        f"{what} {_where(path, line, column)} {problem}" + (f": {fix}" if fix else ""),
        value=str(path),
        problem=where + problem,
        fix=fix,
    )


def _at(text: str, index: int, quote: bool = True) -> str:
    """What is at ``index`` of a file's ``text``: a short escaped excerpt, or (``quote=False``, a
    file the user did not name) only the kind of character there, never the text."""
    if not 0 <= index < len(text):
        return "end of file"
    if quote:
        return excerpt(text[index : index + EXCERPT_CHARS])
    c = text[index]
    if not c.isascii():
        return "a non-ASCII character"
    if c.isalpha():
        return "a letter"
    if c.isdigit():
        return "a digit"
    if c.isspace():
        return "a space" if c == " " else "a line break or tab"
    if not c.isprintable():
        return "a control character"
    return "a punctuation mark"


_PSEUDO_ROOTS = ("/proc", "/sys")


def _pseudo_devices() -> set[int]:
    devices = set()
    for root in _PSEUDO_ROOTS:
        with contextlib.suppress(OSError):
            devices.add(os.stat(root).st_dev)
    return devices


def _kind(st: os.stat_result, path: Path | str) -> str | None:
    """What ``st`` (of ``path``, links followed) is when it is not an ordinary regular file."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if not stat.S_ISREG(mode):
        return "not a file"
    if _pseudo(st, path):
        return "a /proc or /sys pseudo-file"
    return None


def _pseudo(st: os.stat_result, path: Path | str) -> bool:
    real = os.path.realpath(path)
    return st.st_dev in _pseudo_devices() or any(
        real == root or real.startswith(root + "/") for root in _PSEUDO_ROOTS
    )


def on_pseudo_fs(path: Path | str) -> bool:
    """True when ``path`` (an existing file or folder) is inside ``/proc`` or ``/sys``, where
    nothing is a file to write (root may pass ``os.access`` there, then fail after the work)."""
    try:
        return _pseudo(os.stat(path), path)
    except OSError:
        return False


def file_kind(path: Path | str) -> str | None:
    """None when ``path`` (symbolic links followed) is a regular file on an ordinary file system
    or does not exist; else what it is: ``"a folder"``, ``"a FIFO"``, ``"a character
    device"``, ``"a block device"``, ``"a socket"`` or ``"a /proc or /sys pseudo-file"``.

    Config paths and output paths are refused when they are any of these: a FIFO would block,
    a device never ends (``/dev/zero``) or is not where a file goes (``/dev/null``), and a
    ``/proc`` file holds the process's secrets (``/proc/self/environ``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _kind(st, path)


def _read_bounded(path: Path, what: str) -> str:
    def refuse(kind: str) -> ValueError:
        return file_error(
            what, path, f"is not a regular file ({kind})", "pass a YAML or JSON config file"
        )

    kind = file_kind(path)
    if kind is not None:  # NOTE: a socket cannot even be opened
        raise refuse(kind)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        # NOTE: O_NONBLOCK: a FIFO swapped in after the check above cannot block the open; the
        # kind is checked again on the descriptor that is read
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise file_error(what, path, f"cannot be read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        kind = _kind(os.fstat(fd), path)
        if kind is not None:
            raise refuse(kind)
        try:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise file_error(what, path, f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise file_error(
            what,
            path,
            f"is larger than {MAX_CONFIG_BYTES} bytes (the limit for config files,"
            f" flexdispatch._checks.files.MAX_CONFIG_BYTES)",
            "pass the config itself, not a data file",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise file_error(
            what, path, f"is not UTF-8 text (byte {exc.start})", "pass a YAML or JSON config"
        ) from None


def _same_file(st: os.stat_result, inputs: Iterable[Path | str]) -> str | None:
    """The first of ``inputs`` that is the file ``st`` describes (the same inode: the path
    itself, a hard link or a symbolic link to it), or None."""
    for given in inputs:
        try:
            other = os.stat(given)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return str(given)
    return None


def check_output_path(
    path: Path | str, what: str, example: str = "out.yaml", *, inputs: Iterable[Path | str] = ()
) -> Path:
    """The one check of an output path (``config --output``, ``plan --plot``, ``plot_plan``,
    ``write_file``), before any work: refused when it is a symbolic link (dangling or not: a link
    planted in a shared folder would make any write a create-anywhere), a folder, not a regular
    file (``file_kind``: a FIFO, which would block; a device, a socket, a ``/proc`` or ``/sys``
    file), one of ``inputs`` (the same file: the path, a hard link), when its name is too long
    for its folder, or when its folder is missing, not a folder, in ``/proc`` or ``/sys``, or
    not writable.

    Args:
        path: the file to write.
        what: how messages name it, e.g. ``"--output out.yaml"``.
        example: the file name a message suggests inside a folder.
        inputs: the files the command reads (never overwritten by its output).

    Raises:
        ValueError: naming ``what`` and the fix.
    """
    out = Path(path)

    def refuse(message: str, problem: str, fix: str = "") -> InputError:
        return InputError(message, value=str(path), problem=problem, fix=fix)

    try:
        st: os.stat_result | None = os.lstat(out)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise refuse(
            f"{what} is a symbolic link (to {excerpt(os.readlink(out), 40)}): pass the file itself",
            "is a symbolic link",
            "pass the file itself, not a link",
        )
    same = None if st is None else _same_file(st, inputs)
    if same is not None:
        raise refuse(
            f"{what} is the input file {same}: write to another file",
            "is the input file",
            "write to another file",
        )
    kind = file_kind(out)
    if kind == "a folder":
        raise refuse(
            f"{what} is a folder: pass a file name, e.g. {out / example}",
            "is a folder",
            f"pass a file name in it, e.g. {example}",
        )
    if kind is not None:
        raise refuse(
            f"{what} is not a regular file ({kind}): pass the name of a file to write",
            f"is not a regular file ({kind})",
            "pass the name of a file to write",
        )
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.exists():
        raise refuse(
            f"{what}: folder {parent} does not exist (create it first)",
            "its folder does not exist",
            "create the folder first",
        )
    if not parent.is_dir():
        raise refuse(f"{what}: {parent} is not a folder", "its folder is not a folder")
    if on_pseudo_fs(parent):
        raise refuse(
            f"{what}: folder {parent} is in /proc or /sys: write elsewhere",
            "its folder is in /proc or /sys",
            "write elsewhere",
        )
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if (
        len(os.fsencode(out.name)) > name_max
    ):  # NOTE: else refused only by the write, after the work
        raise refuse(
            f"{what}: the file name is longer than the {name_max} bytes its folder allows",
            f"the file name is longer than {name_max} bytes",
            "use a shorter name",
        )
    if not os.access(parent, os.W_OK):
        raise refuse(
            f"{what}: folder {parent} is not writable",
            "its folder is not writable",
            "write to a folder you can write to",
        )
    return out


def write_file(
    path: Path | str, data: bytes, what: str, *, inputs: Iterable[Path | str] = ()
) -> None:
    """Write ``data`` to the regular file ``path`` (created or truncated), never blocking on a
    FIFO, following a symbolic link, writing into a device or a ``/proc`` / ``/sys`` file, or
    over one of ``inputs``: ``check_output_path`` first, then the open refuses a link
    (``O_NOFOLLOW``) and the opened descriptor is checked again (the path may have changed
    since) before it is truncated.

    Args:
        path: the file.
        data: its new contents.
        what: how messages name the file, e.g. ``"--output out.yaml"``.
        inputs: the files the command read (never overwritten).

    Raises:
        ValueError: ``path`` cannot be written there (``check_output_path``), or the write
            failed (full disk, no permission, ...), naming ``what`` and the system's reason.
    """
    inputs = list(inputs)
    check_output_path(path, what, inputs=inputs)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(
            path, flags | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0), 0o666
        )
    except OSError as exc:
        raise InputError(
            f"{what} cannot be written: {exc.strerror or exc}",
            value=str(path),
            problem=f"cannot be written: {exc.strerror or exc}",
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            st = os.fstat(fd)
            kind = _kind(st, path)
            if kind is not None:
                raise InputError(
                    f"{what} is not a regular file ({kind}): pass the name of a file to write",
                    value=str(path),
                    problem=f"is not a regular file ({kind})",
                    fix="pass the name of a file to write",
                )
            same = _same_file(st, inputs)
            if same is not None:
                raise InputError(
                    f"{what} is the input file {same}: write to another file",
                    value=str(path),
                    problem="is the input file",
                    fix="write to another file",
                )
            os.ftruncate(fd, 0)  # NOTE: only now: the checks above come before any byte is lost
            f.write(data)
    except OSError as exc:
        raise InputError(
            f"{what} cannot be written: {exc.strerror or exc}",
            value=str(path),
            problem=f"cannot be written: {exc.strerror or exc}",
        ) from None


# --------------------------------------------------------------------------- YAML


_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,23}")


def key_text(key: object, known: Iterable[str] = (), position: str = "") -> str:
    """How a message names a mapping key read from a file: in full when it is a known field, is
    close to one (a typo, with the suggestion) or is a short identifier (at most 24 characters);
    otherwise by its ``position`` in its mapping (``"3"``: the third key), its length and its
    first 3 escaped characters, so that a line of a file that is not a config (``/etc/shadow``)
    is not quoted."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"[{key}]"
    text = str(key)
    known = list(known)
    if text in known:
        return text
    close = difflib.get_close_matches(text, known, n=1, cutoff=0.75) if len(text) <= 64 else []
    if close:
        return f"{excerpt(text, 64)[1:-1]} (did you mean {close[0]!r}?)"
    if _KEY_RE.fullmatch(text):
        return text
    where = f"#{position} " if position else ""
    return f"key {where}({len(text)} characters, starting {excerpt(text, 3)})"


def _key_position(data: Any, loc: tuple[Any, ...]) -> str:
    """The 1-based place of key ``loc[-1]`` in its mapping inside ``data``, as text (empty when
    it cannot be found)."""
    parent = data
    for part in loc[:-1]:
        try:
            parent = parent[part]
        except (KeyError, IndexError, TypeError):
            return ""
    if isinstance(parent, dict):
        for i, k in enumerate(parent, 1):
            if k == loc[-1]:
                return str(i)
    return ""


def validation_message(
    exc: Any, limit: int = 5, *, data: Any = None, known: Iterable[str] = ()
) -> str:
    """pydantic ``ValidationError`` on one line: ``field: message (got 'short excerpt'); ...``.

    Unlike ``str(exc)``, the offending value is cut to ``EXCERPT_CHARS`` characters and escaped,
    and a key that is not a field (``known``: the models' field names) is named by ``key_text``
    (its position in ``data``, the validated mapping, when given), so a file that is not a config
    is not quoted back.
    """
    known = set(known)
    lines = []
    errors = exc.errors(include_url=False)
    for err in errors[:limit]:
        loc = tuple(err.get("loc", ()))
        parts = []
        for i, part in enumerate(loc):
            last = i == len(loc) - 1 and err.get("type") == "extra_forbidden"
            position = _key_position(data, loc) if last and data is not None else ""
            parts.append(key_text(part, known, position))
        where = ".".join(parts).replace(".[", "[") or "(document)"
        msg = str(err.get("msg", "invalid"))
        got = ""
        # NOTE: no value for unknown keys (a file that is not a config would be quoted line by
        # line); a short escaped excerpt otherwise.
        if "input" in err and err.get("type") not in ("missing", "extra_forbidden"):
            value = err["input"]
            if not isinstance(value, (dict, list, tuple)):
                got = f" (got {excerpt(value)})"
            else:
                got = f" (got a {type(value).__name__})"
        lines.append(f"{where}: {msg}{got}")
    if len(errors) > limit:
        lines.append(f"and {len(errors) - limit} more")
    n = len(errors)
    return f"{n} validation error{'s' if n > 1 else ''}: " + "; ".join(lines)
