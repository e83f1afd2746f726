"""``flexdispatch config``: Hugging Face and Megatron configs to MoEConfig YAML, and its errors.

Shape letters: E experts · k top-k · H hidden size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flexdispatch.cli import main
from flexdispatch.config import MoEConfig, load_config
from flexdispatch.importers import moe_config_from_hf, moe_config_from_megatron

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
HF_FILES = sorted(FIXTURES.glob("*.json"))

MEGATRON_ARGS = {
    "num_moe_experts": 64,
    "moe_router_topk": 6,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_topk_scaling_factor": 2.5,
    "moe_router_num_groups": 8,
    "moe_router_group_topk": 3,
    "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_aux_loss_coeff": 0.001,
    "moe_ffn_hidden_size": 1408,
    "moe_shared_expert_intermediate_size": 2816,
    "hidden_size": 2048,
    "num_layers": 27,  # a non-MoE argument: ignored
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_hf_fixtures_exist() -> None:
    assert len(HF_FILES) >= 5


@pytest.mark.parametrize("path", HF_FILES, ids=lambda p: p.stem)
def test_from_hf_prints_the_importer_config(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--from-hf", str(path))
    assert code == 0, err
    cfg = MoEConfig.model_validate(yaml.safe_load(out))
    assert cfg == moe_config_from_hf(path)
    top = json.loads(path.read_text())
    raw = top.get("text_config", top)  # composite configs keep the MoE model in text_config
    E = raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts")
    assert cfg.router.num_experts == E
    assert cfg.router.topk == raw["num_experts_per_tok"]
    assert cfg.hidden_size == raw["hidden_size"]
    assert cfg.name == top["model_type"]


@pytest.mark.parametrize("path", HF_FILES[:3], ids=lambda p: p.stem)
def test_from_hf_json(path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _run(capsys, "--from-hf", str(path), "--json")
    assert code == 0, err
    assert MoEConfig.model_validate(json.loads(out)) == moe_config_from_hf(path)
    target = tmp_path / "out.json"
    code, out, err = _run(capsys, "--from-hf", str(path), "--json", "--output", str(target))
    assert code == 0 and out == ""
    assert MoEConfig.model_validate_json(target.read_text()) == moe_config_from_hf(path)


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"num_experts_per_tok": 8.7}, "num_experts_per_tok must be an integer, got 8.7"),
        ({"num_experts_per_tok": True}, "num_experts_per_tok must be an integer, got True"),
        ({"n_routed_experts": [128]}, "n_routed_experts must be an integer, got [128]"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"routed_scaling_factor": True}, "routed_scaling_factor must be a number"),
    ],
)
def test_wrong_types_exit_2_naming_the_key(
    tmp_path: Path, patch: dict, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = {**json.loads((FIXTURES / "deepseek_v3.json").read_text()), **patch}
    path = _write(tmp_path, "config.json", json.dumps(raw))
    code, out, err = _run(capsys, "--from-hf", path)
    assert code == 2 and out == ""
    assert message in err, err


def test_from_hf_name_and_output_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = FIXTURES / "mixtral_8x7b.json"
    out_file = tmp_path / "mixtral.yaml"
    code, out, _ = _run(capsys, "--from-hf", str(src), "--name", "my-mixtral", "-o", str(out_file))
    assert code == 0 and out == ""
    cfg = load_config(out_file)
    assert cfg.name == "my-mixtral"
    assert cfg == moe_config_from_hf(src, name="my-mixtral")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(src.read_text())
    code, out, _ = _run(capsys, "--from-hf", str(folder))
    assert code == 0 and MoEConfig.model_validate(yaml.safe_load(out)) == moe_config_from_hf(src)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_from_megatron(tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / f"args{suffix}"
    dump = json.dumps if suffix == ".json" else yaml.safe_dump
    path.write_text(dump(MEGATRON_ARGS))
    code, out, err = _run(capsys, "--from-megatron", str(path))
    assert code == 0, err
    cfg = MoEConfig.model_validate(yaml.safe_load(out))
    assert cfg == moe_config_from_megatron(MEGATRON_ARGS)
    assert (cfg.router.num_experts, cfg.router.topk, cfg.hidden_size) == (64, 6, 2048)
    assert cfg.ffn_hidden_size == 1408 and cfg.shared_expert_ffn_hidden_size == 2816
    code, out, _ = _run(capsys, "--from-megatron", str(path), "--name", "dsv2-lite")
    assert code == 0 and yaml.safe_load(out)["name"] == "dsv2-lite"


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--from-hf", "{tmp}/nope/config.json"), "does not exist"),
        (("--from-hf", "{llama}"), "unsupported model_type 'llama': supported are"),
        (("--from-hf", "{broken}"), "is not valid JSON"),
        (("--from-megatron", "{tmp}/missing.yaml"), "does not exist"),
        (("--from-megatron", "{list_yaml}"), "must hold a mapping of argument names, got list"),
        (("--from-megatron", "{bad_yaml}"), "is not valid YAML"),
        (("--from-megatron", "{unknown_key}"), "unknown Megatron MoE argument(s) moe_foo"),
        (("--from-megatron", "{no_hidden}"), "lack 'hidden_size'"),
    ],
)
def test_errors_exit_2_with_a_clear_message(
    tmp_path: Path, argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        "tmp": str(tmp_path),
        "llama": _write(tmp_path, "llama.json", json.dumps({"model_type": "llama"})),
        "broken": _write(tmp_path, "broken.json", "{not json"),
        "list_yaml": _write(tmp_path, "list.yaml", "- 1\n- 2\n"),
        "bad_yaml": _write(tmp_path, "bad.yaml", "a: [1, 2\n"),
        "unknown_key": _write(
            tmp_path, "unknown.json", json.dumps({**MEGATRON_ARGS, "moe_foo": 1})
        ),
        "no_hidden": _write(
            tmp_path,
            "nohidden.json",
            json.dumps({k: v for k, v in MEGATRON_ARGS.items() if k != "hidden_size"}),
        ),
    }
    code, out, err = _run(capsys, *(a.format(**files) for a in argv))
    assert code == 2
    assert out == ""
    assert err.startswith("flexdispatch config: error: ") and err.count("\n") == 1, err
    assert len(err) <= 201, err
    # NOTE: the whole message (a temporary folder's path is long) with --verbose
    code, out, err = _run(capsys, "--verbose", *(a.format(**files) for a in argv))
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--from-hf", "a.json", "--from-megatron", "b.json"],
    ],
)
def test_exactly_one_source(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", *argv])
    assert info.value.code == 2
