"""Config files that try to exhaust the loader: refused before pydantic, never echoed back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flexdispatch._checks.config_text import read_config_file
from flexdispatch._checks.files import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
)
from flexdispatch.cli import main as cli_main
from flexdispatch.cli.config_cmd import read_megatron_args
from flexdispatch.config import load_config
from flexdispatch.importers import moe_config_from_hf

pytestmark = pytest.mark.timeout(60)

SECRET = "root:x:0:0:root:/root:/bin/bash"


def _laughs(levels: int = 10, width: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("laughs.yaml", _laughs(), rf"line 6, column 5 expands to more than {MAX_CONFIG_NODES}"),
        ("self.yaml", "a: &a [*a]\n", r"line 1, column 4 holds an alias that refers to itself"),
        ("deep.yaml", "[" * 50_000 + "]" * 50_000, rf"column {MAX_CONFIG_DEPTH + 1} nests deeper"),
        ("deepmap.yaml", "a: {" * 200 + "}" * 200, r"line 1, column \d+ nests deeper than 64"),
        ("big.yaml", "#" * (MAX_CONFIG_BYTES + 1), rf"larger than {MAX_CONFIG_BYTES} bytes"),
        ("broken.yaml", f"{SECRET}\nx: [\n", r"line 2, column \d+ is not valid YAML"),
        ("bin.yaml", b"a: \xff\xfe\n", r"is not UTF-8 text \(byte 3\)"),
    ],
)
def test_hostile_yaml_is_refused_quickly_with_a_position(tmp_path, name, text, match):
    path = _write(tmp_path, name, text)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match) as info:
        load_config(path)
    assert time.perf_counter() - t0 < 5
    assert SECRET not in str(info.value)
    assert len(str(info.value)) < 400


def test_a_system_file_is_not_quoted_back(tmp_path):
    lines = [f"user{i}: {SECRET}{i}" for i in range(30)]
    path = _write(tmp_path, "passwd.yaml", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="is invalid") as info:
        load_config(path)
    msg = str(info.value)
    assert SECRET not in msg and "input_value" not in msg
    assert "\n" not in msg and msg.count(";") <= 5  # a handful of fields, never the file's lines


def test_a_bad_value_is_quoted_short_and_escaped(tmp_path):
    cfg = load_config("tiny_cpu").model_dump(mode="json")
    cfg["activation"] = "x" * 500 + "\u2028\x1b"
    path = _write(tmp_path, "long.yaml", json.dumps(cfg))
    with pytest.raises(ValueError, match=r"activation: Input should be") as info:
        load_config(path)
    assert "x" * 41 not in str(info.value) and "\x1b" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, rf"line 1, column {MAX_CONFIG_DEPTH + 1} nests deeper"),
        (
            '{"a": 1,\n "b": tru}',
            r"line 2, column 7 is not valid JSON: Expecting value \(at 'tru}'\)",
        ),
        ('{"a": "' + "x" * (MAX_CONFIG_BYTES + 10) + '"}', "larger than"),
    ],
)
def test_hostile_json_is_refused_with_a_position(tmp_path, text, match):
    path = _write(tmp_path, "config.json", text)
    with pytest.raises(ValueError, match=match):
        read_config_file(path, kind="json")
    with pytest.raises(ValueError, match=match):
        moe_config_from_hf(path)


def test_megatron_files_go_through_the_same_bounds(tmp_path):
    with pytest.raises(ValueError, match="expands to more than"):
        read_megatron_args(_write(tmp_path, "args.yaml", _laughs()))
    with pytest.raises(ValueError, match="nests deeper"):
        read_megatron_args(_write(tmp_path, "args.json", "[" * 5000 + "]" * 5000))


def test_cli_reports_hostile_files_in_one_line(tmp_path, capsys):
    bomb = _write(tmp_path, "laughs.yaml", _laughs())
    deep = _write(tmp_path, "config.json", "[" * 100_000 + "]" * 100_000)
    for argv in (
        ["presets", str(bomb)],
        ["plan", "--config", str(bomb), "--nodes", "1", "--ranks-per-node", "2"],
        ["config", "--from-hf", str(deep)],
        ["config", "--from-megatron", str(bomb)],
    ):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"flexdispatch {argv[0]}: error: ") and err.count("\n") == 1, err
        assert "Traceback" not in err
