"""Bounded reading of configuration files (YAML and JSON) and errors that never echo a file.

Every config file flexdispatch reads (``load_config``, ``flexdispatch config --from-hf`` /
``--from-megatron``, the Hugging Face importer) goes through ``read_config_file``, which refuses,
before any Python object of the document is built and before pydantic sees it:

- a file larger than ``MAX_CONFIG_BYTES`` (read at most that much plus one byte);
- YAML whose tree, with every alias expanded, holds more than ``MAX_CONFIG_NODES`` nodes (a
  "billion laughs" file of nested aliases), or an alias that refers to itself;
- nesting deeper than ``MAX_CONFIG_DEPTH`` levels (YAML or JSON);
- malformed YAML or JSON, reported with the file, the line and the column.

Error messages quote at most ``EXCERPT_CHARS`` characters of the file, escaped (``excerpt``), never
whole lines: a file that is not a config at all (a system file passed by mistake) is not echoed
back. ``validation_message`` formats pydantic's errors the same way (field, message, a short
escaped excerpt of the offending value).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_NODES",
    "MAX_CONFIG_DEPTH",
    "EXCERPT_CHARS",
    "excerpt",
    "read_config_file",
    "parse_config_text",
    "validation_message",
]

MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB; the shipped presets are about 2 KiB, HF configs < 100 KiB)."""

MAX_CONFIG_NODES = 100_000
"""Most YAML/JSON nodes a document may hold with every alias expanded."""

MAX_CONFIG_DEPTH = 64
"""Deepest nesting of mappings/sequences accepted (a MoE config needs about 4)."""

EXCERPT_CHARS = 40
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


def _at(text: str, index: int) -> str:
    return excerpt(text[index : index + EXCERPT_CHARS]) if 0 <= index < len(text) else "end of file"


def _read_bounded(path: Path, what: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{what} {path} is larger than {MAX_CONFIG_BYTES} bytes (the limit for config files,"
            f" flexdispatch._files.MAX_CONFIG_BYTES): pass the config itself, not a data file"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{what} {path} is not UTF-8 text (byte {exc.start}): pass a YAML or JSON config"
        ) from None


# --------------------------------------------------------------------------- YAML


def _yaml_error(exc: yaml.YAMLError, path: Path | str, what: str, text: str) -> ValueError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    if mark is None:
        return ValueError(f"{what} {path} is not valid YAML: {problem}")
    return ValueError(
        f"{what} {_where(path, mark.line, mark.column)} is not valid YAML: {problem} "
        f"(at {_at(text, mark.index)})"
    )


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
                raise ValueError(
                    f"{what} {_where(path, mark.line, mark.column)} expands to more than "
                    f"{MAX_CONFIG_NODES} YAML nodes (aliases counted each time they are used): "
                    f"a config needs a few hundred; remove the nested aliases"
                )
            if depth[key] > MAX_CONFIG_DEPTH:
                raise ValueError(
                    f"{what} {_where(path, mark.line, mark.column)} nests deeper than "
                    f"{MAX_CONFIG_DEPTH} levels: a config needs about 4"
                )
            continue
        if key in size:
            continue
        if key in on_path:
            mark = node.start_mark
            raise ValueError(
                f"{what} {_where(path, mark.line, mark.column)} holds an alias that refers to "
                f"itself (a recursive YAML structure): a config cannot be one"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _check_yaml_depth(text: str, path: Path | str, what: str) -> None:
    """Refuse nesting deeper than ``MAX_CONFIG_DEPTH`` from the parser's events (the parser is a
    state machine; PyYAML's composer, which builds the tree, recurses once per level)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                mark = event.start_mark
                raise ValueError(
                    f"{what} {_where(path, mark.line, mark.column)} nests deeper than "
                    f"{MAX_CONFIG_DEPTH} levels: a config needs about 4"
                )
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _load_yaml(text: str, path: Path | str, what: str) -> Any:
    try:
        _check_yaml_depth(text, path, what)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, path, what, text) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_tree(node, path, what)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, path, what, text) from None
    except RecursionError:
        raise ValueError(
            f"{what} {path} nests deeper than {MAX_CONFIG_DEPTH} levels (the YAML parser ran "
            f"out of stack): a config needs about 4"
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
            line, col = _line_col(text, bad)
            raise ValueError(
                f"{what} {_where(path, line, col)} nests deeper than {MAX_CONFIG_DEPTH} levels: "
                f"a config needs about 4"
            )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{what} {_where(path, exc.lineno - 1, exc.colno - 1)} is not valid JSON: {exc.msg} "
            f"(at {_at(text, exc.pos)})"
        ) from None
    except RecursionError:
        raise ValueError(f"{what} {path} nests too deep for the JSON parser") from None


def parse_config_text(text: str, *, kind: str, path: Path | str = "<text>", what: str = "config"):
    """Parse ``text`` as ``kind`` (``"yaml"`` or ``"json"``) within the bounds above.

    Raises:
        ValueError: too large, too deep, too many nodes once aliases are expanded, or malformed
            (naming ``path``, the line and column, and quoting at most a short escaped excerpt).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{what} {path} is larger than {MAX_CONFIG_BYTES} bytes")
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
        ValueError: missing, unreadable, not UTF-8, too large, too deep, too many nodes, or
            malformed (see ``parse_config_text``).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    return parse_config_text(_read_bounded(path, what), kind=kind, path=path, what=what)


def validation_message(exc: Any, limit: int = 5) -> str:
    """pydantic ``ValidationError`` on one line: ``field: message (got 'short excerpt'); ...``.

    Unlike ``str(exc)``, the offending value is cut to ``EXCERPT_CHARS`` characters and escaped,
    so a file that is not a config is not quoted back.
    """
    lines = []
    errors = exc.errors(include_url=False)
    for err in errors[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(document)"
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
        lines.append(f"{excerpt(loc, 80)[1:-1]}: {msg}{got}")
    if len(errors) > limit:
        lines.append(f"and {len(errors) - limit} more")
    n = len(errors)
    return f"{n} validation error{'s' if n > 1 else ''}: " + "; ".join(lines)
