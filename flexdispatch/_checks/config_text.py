"""Config text: read a YAML / JSON config file within bounds and parse it into plain data, with
every error one line that names the file, the line and column and the kind of problem, quoting
only a short excerpt (``files._at``). The file-system side (which paths may be read or written,
bounded reads, excerpts, output files) is ``files.py``; its limits (``MAX_CONFIG_*``) bound what
is parsed here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    _at,
    _read_bounded,
    file_error,
)

__all__ = ["parse_config_text", "read_config_file"]


# NOTE: what a YAML error is, by the parser's stage: PyYAML's own text ("problem") quotes the
# input (a tag, an alias, a character: "could not determine a constructor for the tag
# '!SECRET…'"), so a message says where and what kind, and quotes only ``_at``'s excerpt
_YAML_PROBLEMS = {
    "ScannerError": "a character or token the scanner cannot read (a tab, an unclosed quote)",
    "ParserError": "a structure that does not parse (the indentation, a missing ':' or bracket)",
    "ComposerError": "an anchor or alias that cannot be resolved",
    "ConstructorError": "a tag or key that cannot be built (an unknown !tag, a list as a key)",
}


def _yaml_error(
    exc: yaml.YAMLError, path: Path | str, what: str, text: str, quote: bool = True
) -> ValueError:
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
        f"is not valid YAML: {problem} (at {_at(text, mark.index, quote)})",
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


def _load_yaml(text: str, path: Path | str, what: str, quote: bool = True) -> Any:
    try:
        _check_yaml_depth(text, path, what)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, path, what, text, quote) from None
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
        raise _yaml_error(exc, path, what, text, quote) from None
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


def _load_json(text: str, path: Path | str, what: str, quote: bool = True) -> Any:
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
            f"is not valid JSON: {exc.msg} (at {_at(text, exc.pos, quote)})",
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


def parse_config_text(
    text: str,
    *,
    kind: str,
    path: Path | str = "<text>",
    what: str = "config",
    quote: bool = True,
):
    """Parse ``text`` as ``kind`` (``"yaml"`` or ``"json"``) within the bounds above; ``quote``:
    a malformed document's error may quote a short excerpt where it breaks (else it says only
    the kind of character there: ``_at``).

    Raises:
        ValueError: too large, too deep, too many nodes once aliases are expanded, or malformed
            (naming ``path``, the line and column, and quoting at most a short escaped excerpt).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise file_error(what, path, f"is larger than {MAX_CONFIG_BYTES} bytes")
    if kind == "json":
        return _load_json(text, path, what, quote)
    if kind == "yaml":
        return _load_yaml(text, path, what, quote)
    raise ValueError(f"kind must be 'yaml' or 'json', got {kind!r}")


def read_config_file(
    path: str | Path, *, kind: str, what: str = "config file", named: bool = True
) -> Any:
    """Read and parse a YAML or JSON config file within the bounds of this module.

    Args:
        path: the file.
        kind: ``"yaml"`` or ``"json"``.
        what: how messages name the file (e.g. ``"config file"``).
        named: the user named this file (else it was found, e.g. ``config.json`` in a named
            folder): an error quotes none of a file the user did not name, only where it breaks
            and the kind of character there.

    Raises:
        ValueError: missing, a folder, not a regular file, unreadable, not UTF-8, too large, too
            deep, too many nodes, or malformed (see ``parse_config_text``).
    """
    path = Path(path)
    if not path.exists():
        raise file_error(what, path, "does not exist")
    if path.is_dir():
        raise file_error(what, path, "is a folder", "pass a YAML or JSON config file")
    text = _read_bounded(path, what)
    return parse_config_text(text, kind=kind, path=path, what=what, quote=named)
