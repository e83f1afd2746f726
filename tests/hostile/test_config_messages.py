"""Config files whose errors quote nothing they should not (reliability-4 N1 and the config
messages of its weak list): an unknown key is named by its position unless it looks like a
config key, a bad value by a few escaped characters, a control character or an over-long integer
by its position."""

from __future__ import annotations

import json

import pytest

from flexdispatch import load_config
from tests.hostile import cli_error, verbose_error

pytestmark = pytest.mark.timeout(60)

HASH = "S3CR3TH4SH"
SHADOW = (
    "root:*:20228:0:99999:7:::\n"
    f"alice:$6$Zx9Q2sd8${HASH * 8}:19000:0:99999:7:::\n"
    f"bob:$6$salt$S3CR3TS3CR3TS3CR3T{'x' * 60}:19000:0:99999:7:::\n"
)


# --------------------------------------------------------------------------- N1: no quotes


def test_a_shadow_file_is_not_quoted(tmp_path, capsys):
    path = tmp_path / "shadow"
    path.write_text(SHADOW)
    for argv in (
        ["presets", str(path)],
        ["plan", "--config", str(path), "--nodes", "1", "--ranks-per-node", "2"],
        ["config", "--from-megatron", str(path)],
    ):
        err = cli_error(argv, capsys) + verbose_error(argv, capsys)  # NOTE: --verbose too
        for secret in ("S3CR3T", "Zx9Q2sd8", "$6$", "salt", "20228", "19000"):
            assert secret not in err, (argv, err)
    err = verbose_error(["presets", str(path)], capsys)
    assert "key #2 (" in err and "characters, starting 'ali'…)" in err


SECRET = "S3CR3TS3CR3TS3CR3TS3CR3T"


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        (f"hidden_size: !!int {SECRET}\n", "line 1, column 14", "cannot be converted"),
        (f"x: !{SECRET} 3\n", "line 1, column 4", "a tag or key that cannot be built"),
        (f"x: !!timestamp {SECRET}\n", "line 1, column 4", "cannot be converted"),
        (f"x: !!bool {SECRET}\n", "line 1, column 4", "cannot be converted"),
        (f"x: !!float {SECRET}\n", "line 1, column 4", "cannot be converted"),
        (f"x: *{SECRET}\n", "line 1, column 4", "an anchor or alias that cannot be resolved"),
        (f"x: '{SECRET}\n", "line 2, column 1", "a character or token the scanner"),
    ],
    ids=["int-tag", "unknown-tag", "timestamp", "bool", "float", "alias", "unclosed-quote"],
)
def test_a_yaml_error_gives_the_position_not_the_value(tmp_path, capsys, text, where, what):
    # NOTE: PyYAML's messages and the converters' quote the value (an unknown tag in full); a
    # malformed !!timestamp raised a bare AttributeError ('NoneType' ... 'groupdict')
    path = tmp_path / "t.yaml"
    path.write_text(text)
    err = cli_error(["presets", str(path)], capsys)
    assert f": {where} " in err, err
    full = verbose_error(["presets", str(path)], capsys)
    assert f"{path} at {where} " in full and what in full, full
    assert SECRET[:13] not in err + full, err  # NOTE: at most 12 characters of the file


def test_megatron_unknown_keys_are_named_in_full_only_when_shaped_like_arguments():
    from flexdispatch.importers import moe_config_from_megatron

    args = {"num_moe_experts": 8, "hidden_size": 64, "ffn_hidden_size": 128}
    args["moe_pad_experts_for_cuda_graph_inference"] = True  # Megatron's longest: in full
    args["moe_" + "s3cr3t" * 8] = 1  # 52 characters: by position
    args["moe_SK-live-" + SECRET] = 1
    with pytest.raises(ValueError, match="unknown Megatron MoE argument") as info:
        moe_config_from_megatron(args)
    msg = str(info.value)
    assert "moe_pad_experts_for_cuda_graph_inference" in msg
    assert "key #5 (52 characters, starting 'moe'…)" in msg and "s3cr3ts3" not in msg
    assert "key #6 (" in msg and "S3CR3T" not in msg


def test_unknown_keys_are_named_by_position_or_in_full_when_they_look_like_fields(tmp_path):
    cfg = load_config("tiny_cpu").model_dump(mode="json")
    cfg["router"]["top_kk"] = 2  # a typo: quoted, with the field it resembles
    cfg["moe_layer_freq"] = 1  # a short identifier: quoted
    cfg["k" * 100] = 1  # anything else: position, length and 3 characters
    cfg["sk-live-" + "A" * 40] = 1
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as info:
        load_config(path)
    msg = str(info.value)
    assert "router.top_kk (did you mean 'topk'?): Extra inputs" in msg
    assert "moe_layer_freq: Extra inputs" in msg
    assert "(100 characters, starting 'kkk'…)" in msg and "k" * 4 not in msg.replace("kkk'", "")
    assert "AAAA" not in msg and "(48 characters, starting 'sk-'…)" in msg


def test_a_bad_value_is_quoted_in_a_few_characters(tmp_path):
    cfg = load_config("tiny_cpu").model_dump(mode="json")
    cfg["hidden_size"] = "sk-live-S3CR3TS3CR3TS3CR3TS3CR3TS3CR3TS3CR3T"
    path = tmp_path / "v.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"hidden_size: .* \(got 'sk-live-S3CR'…\)") as info:
        load_config(path)
    assert "S3CR3T" not in str(info.value)


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize(
    ("name", "text", "argv"),
    [
        ("big.yaml", "hidden_size: " + "7" * 5000 + "\n", ["presets"]),
        (
            "big.yaml",
            "hidden_size: " + "7" * 5000 + "\n",
            ["plan", "--nodes", "1", "--ranks-per-node", "1", "--config"],
        ),
        ("big.yaml", "hidden_size: " + "7" * 5000 + "\n", ["demo", "--preset"]),
        ("big.yaml", "num_moe_experts: " + "7" * 5000 + "\n", ["config", "--from-megatron"]),
        (
            "config.json",
            '{"model_type": "mixtral",\n "hidden_size": ' + "7" * 5000 + "}",
            ["config", "--from-hf"],
        ),
    ],
    ids=["presets", "plan", "demo", "megatron", "hf"],
)
def test_a_huge_integer_is_named_with_its_position(tmp_path, capsys, name, text, argv):
    path = tmp_path / name
    path.write_text(text)
    err = cli_error([*argv, str(path)], capsys)
    line = 2 if name.endswith(".json") else 1
    column = text.splitlines()[line - 1].index("7") + 1
    assert f"line {line}, column {column} holds an integer of more than 4300 digits" in err
    full = verbose_error([*argv, str(path)], capsys)
    assert (
        f"{path} at line {line}, column {column} holds an integer of more than 4300 digits" in full
    )
    assert "7" * 20 not in err + full


@pytest.mark.parametrize(
    ("text", "where", "char"),
    [
        ("a: \x00b\n", "line 1, column 4", "U+0000"),
        ("name: t\nhidden_size: 8\x07\n", "line 2, column 15", "U+0007"),
        ("KEY=value\x00OTHER=secret\x00", "line 1, column 10", "U+0000"),
    ],
)
def test_control_characters_in_yaml_have_a_position(tmp_path, capsys, text, where, char):
    path = tmp_path / "c.yaml"
    path.write_bytes(text.encode())
    err = cli_error(["presets", str(path)], capsys)
    assert f"{where} is not valid YAML: special characters are not allowed" in err
    full = verbose_error(["presets", str(path)], capsys)
    assert f"{path} at {where} is not valid YAML: special characters are not allowed" in full
    assert char in full and "secret" not in err + full
