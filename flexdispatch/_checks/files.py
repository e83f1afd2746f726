"""Bounded reading of configuration files (YAML and JSON) and errors that never echo a file.

Every config file flexdispatch reads (``load_config``, ``flexdispatch config --from-hf`` /
``--from-megatron``, the Hugging Face importer) goes through ``read_config_file``, which refuses,
before any Python object of the document is built and before pydantic sees it:

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
import json
import os
import re
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

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
    "read_config_file",
    "write_file",
    "parse_config_text",
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


def _at(text: str, index: int) -> str:
    return excerpt(text[index : index + EXCERPT_CHARS]) if 0 <= index < len(text) else "end of file"


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


def check_output_path(path: Path | str, what: str, example: str = "out.yaml") -> Path:
    """The one check of an output path (``config --output``, ``plan --plot``, ``plot_plan``,
    ``write_file``), before any work: refused when it is a folder, when it is not a regular file
    (``file_kind``: a FIFO, which would block; a device, a socket, a ``/proc`` or ``/sys``
    file), or when its folder is missing, not a folder, in ``/proc`` or ``/sys``, or not
    writable.

    Args:
        path: the file to write.
        what: how messages name it, e.g. ``"--output out.yaml"``.
        example: the file name a message suggests inside a folder.

    Raises:
        ValueError: naming ``what`` and the fix.
    """
    out = Path(path)

    def refuse(message: str, problem: str, fix: str = "") -> InputError:
        return InputError(message, value=str(path), problem=problem, fix=fix)

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


def write_file(path: Path | str, data: bytes, what: str) -> None:
    """Write ``data`` to the regular file ``path`` (created or truncated), never blocking on a
    FIFO or writing into a device or a ``/proc`` / ``/sys`` file: ``check_output_path`` first,
    then the kind again on the opened descriptor (the path may have changed since).

    Args:
        path: the file.
        data: its new contents.
        what: how messages name the file, e.g. ``"--output out.yaml"``.

    Raises:
        ValueError: ``path`` cannot be written there (``check_output_path``), or the write
            failed (full disk, no permission, ...), naming ``what`` and the system's reason.
    """
    check_output_path(path, what)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOCTTY", 0)
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
            kind = _kind(os.fstat(fd), path)
            if kind is not None:
                raise InputError(
                    f"{what} is not a regular file ({kind}): pass the name of a file to write",
                    value=str(path),
                    problem=f"is not a regular file ({kind})",
                    fix="pass the name of a file to write",
                )
            f.write(data)
    except OSError as exc:
        raise InputError(
            f"{what} cannot be written: {exc.strerror or exc}",
            value=str(path),
            problem=f"cannot be written: {exc.strerror or exc}",
        ) from None


# --------------------------------------------------------------------------- YAML


# NOTE: what a YAML error is, by the parser's stage: PyYAML's own text ("problem") quotes the
# input (a tag, an alias, a character: "could not determine a constructor for the tag
# '!SECRET…'"), so a message says where and what kind, and quotes only ``_at``'s excerpt
_YAML_PROBLEMS = {
    "ScannerError": "a character or token the scanner cannot read (a tab, an unclosed quote)",
    "ParserError": "a structure that does not parse (the indentation, a missing ':' or bracket)",
    "ComposerError": "an anchor or alias that cannot be resolved",
    "ConstructorError": "a tag or key that cannot be built (an unknown !tag, a list as a key)",
}


def _yaml_error(exc: yaml.YAMLError, path: Path | str, what: str, text: str) -> ValueError:
    if isinstance(exc, yaml.reader.ReaderError):  # NOTE: a character the reader refuses
        line, col = _line_col(text, exc.position)
        char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1])
        return file_error(
            what,
            path,
            f"is not valid YAML: {exc.reason} (character U+{char:04X}; a config is printable text)",
            line=line,
            column=col,
        )
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = _YAML_PROBLEMS.get(type(exc).__name__, "malformed YAML")
    if mark is None:
        return file_error(what, path, f"is not valid YAML: {problem}")
    return file_error(
        what,
        path,
        f"is not valid YAML: {problem} (at {_at(text, mark.index)})",
        line=mark.line,
        column=mark.column,
    )


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that remembers where the node it builds starts: a tagged value that
    does not convert (``!!int SECRET``, ``!!timestamp x``) is named by its position, never by
    the converter's message (which quotes it)."""

    building: Any = None

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        self.building = node.start_mark
        return super().construct_object(node, deep=deep)


def _check_yaml_tree(root: yaml.Node, path: Path | str, what: str) -> None:
    """Count the nodes of ``root`` with aliases expanded and its depth, without expanding."""
    size: dict[int, int] = {}  # id(node) -> expanded size
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    # NOTE: iterative post-order walk; each distinct node is visited once (aliases share nodes).
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            mark = node.start_mark
            if size[key] > MAX_CONFIG_NODES:
                raise file_error(
                    what,
                    path,
                    f"expands to more than {MAX_CONFIG_NODES} YAML nodes (aliases counted each "
                    f"time they are used): a config needs a few hundred",
                    "remove the nested aliases",
                    mark.line,
                    mark.column,
                )
            if depth[key] > MAX_CONFIG_DEPTH:
                raise _too_deep(what, path, mark.line, mark.column)
            continue
        if key in size:
            continue
        if key in on_path:
            mark = node.start_mark
            raise file_error(
                what,
                path,
                "holds an alias that refers to itself (a recursive YAML structure): a config "
                "cannot be one",
                line=mark.line,
                column=mark.column,
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _too_deep(what: str, path: Path | str, line: int, column: int) -> InputError:
    return file_error(
        what,
        path,
        f"nests deeper than {MAX_CONFIG_DEPTH} levels: a config needs about 4",
        "",
        line,
        column,
    )


def _check_yaml_depth(text: str, path: Path | str, what: str) -> None:
    """Refuse nesting deeper than ``MAX_CONFIG_DEPTH`` from the parser's events (the parser is a
    state machine; PyYAML's composer, which builds the tree, recurses once per level)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                mark = event.start_mark
                raise _too_deep(what, path, mark.line, mark.column)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _load_yaml(text: str, path: Path | str, what: str) -> Any:
    try:
        _check_yaml_depth(text, path, what)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, path, what, text) from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_tree(node, path, what)
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, AttributeError, OverflowError, LookupError) as exc:
            # NOTE: a tagged value the constructor could not convert (int(), float(), a date)
            raise _number_error(exc, text, path, what, loader.building) from None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, path, what, text) from None
    except RecursionError:
        raise file_error(
            what,
            path,
            f"nests deeper than {MAX_CONFIG_DEPTH} levels (the YAML parser ran out of stack): a "
            f"config needs about 4",
        ) from None
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- JSON


def _json_too_deep(text: str) -> int | None:
    """Index of the first bracket deeper than ``MAX_CONFIG_DEPTH`` (strings skipped), or None."""
    depth, in_str, esc = 0, False, False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                return i
        elif c in "]}":
            depth -= 1
    return None


def _line_col(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index)
    return line, index - (text.rfind("\n", 0, index) + 1)


def _load_json(text: str, path: Path | str, what: str) -> Any:
    # NOTE: the depth scan is a Python loop over the text; it runs only when the document has more
    # opening brackets than a config could nest (cheap count first).
    if text.count("[") + text.count("{") > MAX_CONFIG_DEPTH:
        bad = _json_too_deep(text)
        if bad is not None:
            raise _too_deep(what, path, *_line_col(text, bad))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise file_error(
            what,
            path,
            f"is not valid JSON: {exc.msg} (at {_at(text, exc.pos)})",
            line=exc.lineno - 1,
            column=exc.colno - 1,
        ) from None
    except RecursionError:
        raise file_error(what, path, "nests too deep for the JSON parser") from None
    except ValueError as exc:  # NOTE: an integer past Python's digit limit
        raise _number_error(exc, text, path, what) from None


def _number_error(
    exc: Exception, text: str, path: Path | str, what: str, mark: Any = None
) -> ValueError:
    """A value the parser could not convert (an integer of more digits than Python converts, a
    tagged YAML value such as ``!!int x`` or ``!!timestamp x``), as an error with its position
    (``mark``: where the YAML node starts) and no quote of it: never ``exc``'s text, which
    quotes the value."""
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    found = re.search(rf"[0-9][0-9_]{{{max(limit - 1, 0)},}}", text) if limit else None
    if found is None or not isinstance(exc, ValueError):
        return file_error(
            what,
            path,
            f"holds a value that cannot be converted ({type(exc).__name__})",
            "check its tag (!!int, !!float, !!timestamp, ...) or write it plainly",
            None if mark is None else mark.line,
            None if mark is None else mark.column,
        )
    line, col = _line_col(text, found.start())
    return file_error(
        what,
        path,
        f"holds an integer of more than {limit} digits: a config number has a few",
        line=line,
        column=col,
    )


def parse_config_text(text: str, *, kind: str, path: Path | str = "<text>", what: str = "config"):
    """Parse ``text`` as ``kind`` (``"yaml"`` or ``"json"``) within the bounds above.

    Raises:
        ValueError: too large, too deep, too many nodes once aliases are expanded, or malformed
            (naming ``path``, the line and column, and quoting at most a short escaped excerpt).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise file_error(what, path, f"is larger than {MAX_CONFIG_BYTES} bytes")
    if kind == "json":
        return _load_json(text, path, what)
    if kind == "yaml":
        return _load_yaml(text, path, what)
    raise ValueError(f"kind must be 'yaml' or 'json', got {kind!r}")


def read_config_file(path: str | Path, *, kind: str, what: str = "config file") -> Any:
    """Read and parse a YAML or JSON config file within the bounds of this module.

    Args:
        path: the file.
        kind: ``"yaml"`` or ``"json"``.
        what: how messages name the file (e.g. ``"config file"``).

    Raises:
        ValueError: missing, a folder, not a regular file, unreadable, not UTF-8, too large, too
            deep, too many nodes, or malformed (see ``parse_config_text``).
    """
    path = Path(path)
    if not path.exists():
        raise file_error(what, path, "does not exist")
    if path.is_dir():
        raise file_error(what, path, "is a folder", "pass a YAML or JSON config file")
    return parse_config_text(_read_bounded(path, what), kind=kind, path=path, what=what)


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
