"""Configs that mean what they say (reliability-4 N15-N18): finite coefficients only, a bool is
never an integer, group fields as transformers' gates need them, no size silently replaced.

Shape letters: E experts · k top-k · G groups (n_group) · g groups kept (topk_group).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flexdispatch import RouterConfig, topk_routing
from flexdispatch.cli import main as cli_main
from flexdispatch.config import DispatchConfig, MoEConfig, load_config
from flexdispatch.importers import moe_config_from_hf, moe_config_from_megatron
from flexdispatch.routing.hash import hash_routing
from tests.hostile import cli_error, verbose_error

pytestmark = pytest.mark.timeout(60)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
INF, NAN = float("inf"), float("nan")


def _hf(name: str, **patch: Any) -> dict[str, Any]:
    return {**json.loads((FIXTURES / f"{name}.json").read_text()), **patch}


MEGATRON = {"num_moe_experts": 8, "moe_router_topk": 2, "hidden_size": 64, "ffn_hidden_size": 128}


# --------------------------------------------------------------------------- N15: finite only


@pytest.mark.parametrize(
    "kwargs",
    [
        {"aux_loss_type": "aux_loss", "aux_loss_coeff": INF},
        {"aux_loss_type": "aux_loss", "aux_loss_coeff": NAN},
        {"z_loss_coeff": INF},
        {"scaling_factor": INF},
        {"scaling_factor": NAN},
        {"capacity_factor": INF},
        {"bias_update_rate": INF},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_router_coefficients_are_finite(kwargs):
    field = next(k for k in kwargs if k != "aux_loss_type")
    with pytest.raises(ValueError, match=rf"{field}\n  Input should be a finite number"):
        RouterConfig(num_experts=8, topk=2, **kwargs)


def test_other_config_floats_are_finite():
    with pytest.raises(ValueError, match=r"timeout_s\n  Input should be a finite number"):
        DispatchConfig(timeout_s=INF)
    with pytest.raises(ValueError, match=r"swiglu_limit\n  Input should be a finite number"):
        MoEConfig(
            hidden_size=8, ffn_hidden_size=8, swiglu_limit=INF, router={"num_experts": 4, "topk": 1}
        )


def test_routing_functions_refuse_infinite_factors():
    logits = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"capacity_factor must be a positive finite number"):
        topk_routing(logits, topk=2, capacity_factor=INF)
    with pytest.raises(ValueError, match=r"scaling_factor must be a finite number"):
        topk_routing(logits, topk=2, scaling_factor=INF)
    with pytest.raises(ValueError, match=r"scaling_factor must be > 0 and finite"):
        hash_routing(torch.arange(5), num_experts=8, topk=2, scaling_factor=INF)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"router_aux_loss_coef": 1e400}, "router_aux_loss_coef must be a finite number, got inf"),
        ({"router_aux_loss_coef": NAN}, "router_aux_loss_coef must be a finite number, got nan"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be >= 0"),
        (
            {"routed_scaling_factor": 10**400},
            "routed_scaling_factor must be a finite number, got an integer of 401 digits",
        ),
        ({"routed_scaling_factor": INF}, "routed_scaling_factor must be a finite number, got inf"),
    ],
)
def test_hf_coefficients_are_finite(patch, message):
    name = "mixtral_8x7b" if "router_aux_loss_coef" in patch else "deepseek_v3"
    with pytest.raises(ValueError, match=message):
        moe_config_from_hf(_hf(name, **patch))


def test_hf_infinite_coefficient_from_a_file_exits_2(tmp_path, capsys):
    text = (FIXTURES / "mixtral_8x7b.json").read_text()
    path = tmp_path / "aux.json"
    path.write_text(text.replace('"router_aux_loss_coef": 0.02', '"router_aux_loss_coef": 1e400'))
    assert '"router_aux_loss_coef": 1e400' in path.read_text()
    err = cli_error(["config", "--from-hf", str(path)], capsys)
    assert "router_aux_loss_coef must be a finite number, got inf" in err


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("moe_aux_loss_coeff", INF, "moe_aux_loss_coeff must be a finite number"),
        ("moe_aux_loss_coeff", NAN, "moe_aux_loss_coeff must be a finite number"),
        ("moe_aux_loss_coeff", [NAN], "moe_aux_loss_coeff must be a finite number"),
        ("moe_aux_loss_coeff", -0.01, "moe_aux_loss_coeff must be >= 0"),
        ("moe_z_loss_coeff", INF, "moe_z_loss_coeff must be a finite number"),
        ("moe_router_topk_scaling_factor", INF, "moe_router_topk_scaling_factor must be a finite"),
        ("moe_expert_capacity_factor", INF, "moe_expert_capacity_factor must be a finite number"),
        ("moe_router_bias_update_rate", NAN, "moe_router_bias_update_rate must be a finite"),
        ("moe_router_topk_scaling_factor", "2.5x", "must be a number, got '2.5x' \\(str\\)"),
        ("moe_router_topk_scaling_factor", True, "must be a number, got True \\(bool\\)"),
        ("moe_aux_loss_coeff", "nan", "moe_aux_loss_coeff must be a finite number"),
        ("moe_aux_loss_coeff", "-1e400", "moe_aux_loss_coeff must be a finite number"),
    ],
)
def test_megatron_coefficients_are_finite(key, value, message):
    with pytest.raises(ValueError, match=message):
        moe_config_from_megatron({**MEGATRON, key: value})


def test_megatron_infinite_coefficient_from_yaml_exits_2(tmp_path, capsys):
    path = tmp_path / "args.yaml"
    path.write_text(
        "num_moe_experts: 8\nhidden_size: 64\nffn_hidden_size: 128\nmoe_aux_loss_coeff: .inf\n"
    )
    err = cli_error(["config", "--from-megatron", str(path)], capsys)
    assert "moe_aux_loss_coeff must be a finite number, got inf (float)" in err  # as HF's


def test_megatron_scientific_notation_from_yaml_is_a_number(tmp_path):
    # NOTE: PyYAML reads 1e-2 as the string '1e-2' (YAML 1.1 floats need a dot); Megatron's
    # argparse reads it with float(), and so does the importer
    path = tmp_path / "args.yaml"
    path.write_text(
        "num_moe_experts: 8\nhidden_size: 64\nffn_hidden_size: 128\nmoe_aux_loss_coeff: 1e-2\n"
        "moe_z_loss_coeff: 1E-3\nmoe_router_topk_scaling_factor: '2.5'\n"
    )
    out = tmp_path / "out.yaml"
    assert cli_main(["config", "--from-megatron", str(path), "-o", str(out)]) == 0
    cfg = load_config(out)
    assert (cfg.router.aux_loss_coeff, cfg.router.z_loss_coeff) == (0.01, 0.001)
    assert cfg.router.scaling_factor == 2.5


# --------------------------------------------------------------------------- N16: bools


def test_yaml_booleans_are_not_integers(tmp_path, capsys):
    path = tmp_path / "bool.yaml"
    path.write_text(
        "name: t\nhidden_size: yes\nffn_hidden_size: 96\nrouter:\n  num_experts: 16\n  topk: on\n"
    )
    err = cli_error(["presets", str(path)], capsys)
    assert "bool.yaml: 2 validation errors: hidden_size: Value error, true is not a" in err
    err = verbose_error(["presets", str(path)], capsys)
    assert "router.topk: Value error, true is not a number" in err


@pytest.mark.parametrize("field", ["num_experts", "topk", "hash_seed"])
def test_router_config_refuses_bools(field):
    kwargs: dict[str, Any] = {"num_experts": 8, "topk": 2, field: True}
    with pytest.raises(ValueError, match=rf"{field}\n  Value error, true is not a number"):
        RouterConfig(**kwargs)


def test_other_config_fields_refuse_bools():
    with pytest.raises(ValueError, match=r"num_worst_tokens\n  Value error, true is not a number"):
        DispatchConfig(num_worst_tokens=True)
    with pytest.raises(ValueError, match=r"aux_loss_coeff\n  Value error, true is not a number"):
        RouterConfig(num_experts=8, topk=2, aux_loss_type="aux_loss", aux_loss_coeff=True)
    # NOTE: pydantic's lax mode keeps "8" and 8.0 for the Python API (docs/errors.md)
    assert RouterConfig(num_experts="8", topk=2.0).num_experts == 8


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_moe_experts", True, "num_moe_experts must be an integer .* got True \\(bool\\)"),
        ("moe_router_topk", True, "moe_router_topk must be an integer .* got True \\(bool\\)"),
        ("num_moe_experts", "8", "num_moe_experts must be an integer .* got '8' \\(str\\)"),
        ("num_moe_experts", 8.0, "num_moe_experts must be an integer .* got 8.0 \\(float\\)"),
        ("hidden_size", False, "hidden_size must be an integer .* got False \\(bool\\)"),
        ("moe_router_num_groups", True, "moe_router_num_groups must be an integer"),
        ("moe_router_pre_softmax", "false", "moe_router_pre_softmax must be true or false"),
        ("swiglu", "false", "swiglu must be true or false, got 'false' \\(str\\)"),
    ],
)
def test_megatron_values_have_argparse_types(key, value, message):
    with pytest.raises(ValueError, match=message):
        moe_config_from_megatron({**MEGATRON, key: value})


def test_megatron_true_experts_from_yaml_names_the_key(tmp_path, capsys):
    path = tmp_path / "args.yaml"
    path.write_text("num_moe_experts: true\nhidden_size: 64\nffn_hidden_size: 128\n")
    err = cli_error(["config", "--from-megatron", str(path)], capsys)
    assert "num_moe_experts must be an integer" in err and "topk=2 exceeds" not in err


# --------------------------------------------------------------------------- N17: groups


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"n_group": 0}, "n_group=0 must be a positive divisor of the 256 experts"),
        ({"n_group": -1}, "n_group=-1 must be a positive divisor of the 256 experts"),
        ({"n_group": 3}, "n_group=3 must be a positive divisor of the 256 experts"),
        ({"topk_group": 0}, "topk_group=0 must be between 1 and n_group=8"),
        ({"topk_group": 9}, "topk_group=9 must be between 1 and n_group=8"),
        ({"n_group": None}, "n_group: null; its transformers gate"),
        ({"topk_group": None}, "topk_group: null; its transformers gate"),
        ({"n_group": True}, "n_group must be an integer, got True"),
        ({"n_group": 256, "topk_group": 4}, "leaves 1 expert per group"),
    ],
)
def test_deepseek_group_fields_are_checked(patch, message):
    with pytest.raises(ValueError, match=message):
        moe_config_from_hf(_hf("deepseek_v3", **patch))


def test_deepseek_group_fields_that_keep_every_group_mean_no_groups():
    for patch in ({"n_group": 1, "topk_group": 1}, {"n_group": 8, "topk_group": 8}):
        router = moe_config_from_hf(_hf("deepseek_v3", **patch)).router
        assert router.num_groups is None and router.group_topk is None
    router = moe_config_from_hf(_hf("deepseek_v3")).router
    assert (router.num_groups, router.group_topk) == (8, 4)


def test_deepseek_v2_group_limited_greedy_needs_its_groups():
    for key in ("n_group", "topk_group"):
        cfg = _hf("deepseek_v2")
        del cfg[key]
        with pytest.raises(ValueError, match="group_limited_greedy needs n_group and topk_group"):
            moe_config_from_hf(cfg)


def test_deepseek_bad_groups_from_a_file_exit_2(tmp_path, capsys):
    path = tmp_path / "ng3.json"
    path.write_text(json.dumps(_hf("deepseek_v3", n_group=3)))
    assert "n_group=3 must be a positive divisor" in cli_error(
        ["config", "--from-hf", str(path)], capsys
    )


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"moe_router_num_groups": 0, "moe_router_group_topk": 1}, "moe_router_num_groups must"),
        ({"moe_router_num_groups": -1, "moe_router_group_topk": 1}, "moe_router_num_groups must"),
        ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "not divisible by num_groups=3"),
        ({"moe_router_num_groups": 4, "moe_router_group_topk": 0}, "moe_router_group_topk must"),
        ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "group_topk=5 exceeds"),
        ({"moe_router_num_groups": 4}, "num_groups and group_topk go together"),
    ],
)
def test_megatron_group_fields_are_checked(patch, message):
    with pytest.raises(ValueError, match=message):
        moe_config_from_megatron({**MEGATRON, **patch})


# --------------------------------------------------------------------------- N18


def test_megatron_zero_moe_ffn_hidden_size_is_not_replaced(tmp_path, capsys):
    with pytest.raises(ValueError, match="moe_ffn_hidden_size must be a positive integer, got 0"):
        moe_config_from_megatron({**MEGATRON, "moe_ffn_hidden_size": 0})
    path = tmp_path / "m0.yaml"
    path.write_text(
        "num_moe_experts: 8\nmoe_router_topk: 2\nhidden_size: 64\nmoe_ffn_hidden_size: 0\n"
        "ffn_hidden_size: 128\n"
    )
    assert "moe_ffn_hidden_size must be a positive" in cli_error(
        ["config", "--from-megatron", str(path)], capsys
    )
    # absent or null: Megatron's fallback to ffn_hidden_size
    for extra in ({}, {"moe_ffn_hidden_size": None}):
        assert moe_config_from_megatron({**MEGATRON, **extra}).ffn_hidden_size == 128


def test_hf_model_type_must_be_a_string(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf("mixtral_8x7b", model_type=["mixtral"])))
    err = cli_error(["config", "--from-hf", str(path)], capsys)
    assert "model_type must be a string, got ['mixtral'] (list)" in err
    path.write_text(json.dumps(_hf("mixtral_8x7b", model_type="x" * 500)))
    assert "x" * 13 not in cli_error(["config", "--from-hf", str(path)], capsys)
