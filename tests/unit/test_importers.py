"""Config import from Hugging Face config.json and Megatron-Core arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexdispatch import load_config
from flexdispatch.importers import (
    hash_layer_router_config,
    moe_config_from_hf,
    moe_config_from_megatron,
    num_hash_layers,
    supported_model_types,
    to_yaml,
)

HF = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
FIXTURES = sorted(p.name for p in HF.glob("*.json"))


def hf(name: str) -> dict:
    return json.loads((HF / name).read_text())


def text(raw: dict) -> dict:
    """The MoE text model of a config (composite configs keep it in ``text_config``)."""
    return raw.get("text_config", raw)


def test_fixtures_are_present():
    assert set(FIXTURES) == {
        "deepseek_moe_16b.json",
        "deepseek_v2.json",
        "deepseek_v3.json",
        "deepseek_v3_2.json",
        "deepseek_v4_flash.json",
        "dots_llm1.json",
        "glm4_5.json",
        "glm4_7_flash.json",
        "glm5.json",
        "gpt_oss_120b.json",
        "granite_3_0_3b_a800m.json",
        "kimi_k2.json",
        "kimi_k2_5.json",
        "llama4_scout.json",
        "minimax_m2.json",
        "mixtral_8x7b.json",
        "nemotron_3_nano_30b_a3b.json",
        "olmoe_1b_7b.json",
        "qwen1_5_moe_a2_7b.json",
        "qwen3_30b_a3b.json",
        "qwen3_5_moe_35b_a3b.json",
        "qwen3_next_80b_a3b.json",
        "qwen3_vl_30b_a3b.json",
    }


def test_every_supported_model_type_has_a_fixture():
    shipped = {hf(f)["model_type"] for f in FIXTURES}
    inner = {"qwen3_5_moe_text", "llama4_text", "qwen3_vl_moe_text"}  # read inside text_config
    assert set(supported_model_types()) - inner == shipped


@pytest.mark.parametrize("fixture", FIXTURES)
def test_shapes_come_from_the_config(fixture):
    top = hf(fixture)
    raw = text(top)
    cfg = moe_config_from_hf(top)
    E = raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts")
    F = raw.get("moe_intermediate_size") or raw["intermediate_size"]
    assert cfg.router.num_experts == E
    assert cfg.router.topk == raw["num_experts_per_tok"]
    assert cfg.hidden_size == raw["hidden_size"]
    assert cfg.ffn_hidden_size == F
    assert cfg.name == top["model_type"]
    assert cfg.source["hf_model_type"] == top["model_type"]
    assert cfg.router.router_type == "learned"


def test_path_and_folder_inputs(tmp_path):
    raw = hf("deepseek_v3.json")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    a = moe_config_from_hf(tmp_path, name="v3")
    b = moe_config_from_hf(str(tmp_path / "config.json"), name="v3")
    c = moe_config_from_hf(raw, name="v3")
    assert a == b == c and a.name == "v3"


def test_deepseek_v2_rules():
    raw = hf("deepseek_v2.json")
    r = moe_config_from_hf(raw).router
    assert r.score_function == "softmax" and r.use_pre_softmax
    assert (r.num_groups, r.group_topk) == (raw["n_group"], raw["topk_group"])
    assert r.group_score == "max"
    assert r.normalize_topk is False and r.scaling_factor == raw["routed_scaling_factor"]
    assert r.aux_loss_type == "seq_aux_loss" and r.aux_loss_coeff == raw["aux_loss_alpha"]
    assert not r.enable_expert_bias


def test_deepseek_v2_norm_topk_prob_is_read_as_transformers_reads_it():
    # transformers' DeepseekV2TopkRouter never reads norm_topk_prob: it always scales by
    # routed_scaling_factor and never renormalises (DeepSeek's own code renormalises and does
    # not scale with true: recorded as a note; issue 45 part 3: the transformers router rules)
    raw = {**hf("deepseek_v2.json"), "norm_topk_prob": True}
    cfg = moe_config_from_hf(raw)
    assert cfg.router == moe_config_from_hf(hf("deepseek_v2.json")).router
    assert cfg.router.normalize_topk is False and cfg.router.scaling_factor == 16.0
    assert "norm_topk_prob=true (scales by routed_scaling_factor" in cfg.source["ignored"]
    assert "DeepSeek's own V2 modeling code renormalises" in cfg.source["scaling"]


def test_deepseek_v3_rules():
    raw = hf("deepseek_v3.json")
    r = moe_config_from_hf(raw).router
    assert r.score_function == "sigmoid" and r.enable_expert_bias
    assert (r.num_groups, r.group_topk) == (raw["n_group"], raw["topk_group"])
    # HF sums the top-2 of each group; Megatron sums the top k // group_topk = 8 // 4 = 2.
    assert r.group_score == "sum_topk" and r.topk // r.group_topk == 2
    assert r.normalize_topk is True and r.scaling_factor == raw["routed_scaling_factor"]
    assert r.aux_loss_type == "none"


def test_noaux_tc_without_top2_equivalence_is_rejected():
    raw = {**hf("deepseek_v3.json"), "topk_group": 2}  # 8 // 2 = 4 != 2
    with pytest.raises(ValueError, match="sum of their top-2"):
        moe_config_from_hf(raw)


def test_single_group_means_no_group_limit():
    raw = {**hf("deepseek_v3.json"), "n_group": 1, "topk_group": 1}  # Kimi-K2 style
    r = moe_config_from_hf(raw).router
    assert r.num_groups is None and r.group_topk is None


def test_deepseek_v4_rules_and_hash_layers():
    raw = hf("deepseek_v4_flash.json")
    cfg = moe_config_from_hf(raw)
    r = cfg.router
    assert r.score_function == "sqrtsoftplus" and r.enable_expert_bias
    assert r.num_groups is None
    assert r.normalize_topk is True and r.scaling_factor == raw["routed_scaling_factor"]
    assert num_hash_layers(cfg) == raw["num_hash_layers"]
    h = hash_layer_router_config(cfg)
    assert h.router_type == "hash" and not h.enable_expert_bias
    assert (h.num_experts, h.topk, h.score_function) == (r.num_experts, r.topk, r.score_function)
    assert (h.normalize_topk, h.scaling_factor) == (r.normalize_topk, r.scaling_factor)


def test_hash_layers_only_for_v4():
    cfg = moe_config_from_hf(hf("deepseek_v3.json"))
    assert num_hash_layers(cfg) == 0
    with pytest.raises(ValueError, match="no hash-routed layers"):
        hash_layer_router_config(cfg)


def test_mixtral_rules():
    raw = hf("mixtral_8x7b.json")
    r = moe_config_from_hf(raw).router
    assert r.score_function == "softmax" and not r.use_pre_softmax
    assert r.normalize_topk is None and r.scaling_factor is None and r.num_groups is None
    assert r.aux_loss_type == "aux_loss" and r.aux_loss_coeff == raw["router_aux_loss_coef"]


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_norm_topk_prob(norm):
    raw = {**hf("qwen3_30b_a3b.json"), "norm_topk_prob": norm}
    r = moe_config_from_hf(raw).router
    assert r.score_function == "softmax"
    if norm:
        assert not r.use_pre_softmax and r.normalize_topk is None
    else:
        assert r.use_pre_softmax and r.normalize_topk is False


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError) as err:
        moe_config_from_hf({"model_type": "llama"})
    msg = str(err.value)
    assert "'llama'" in msg
    for mt in ("deepseek_v2", "deepseek_v3", "deepseek_v4", "mixtral", "qwen3_moe", "gpt_oss"):
        assert mt in msg


def test_missing_field_without_default_is_named():
    raw = hf("deepseek_v2.json")
    del raw["num_experts_per_tok"]  # DeepseekV2Config has no default for it
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_config_from_hf(raw)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        moe_config_from_hf(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        moe_config_from_hf(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="config must be a dict"):
        moe_config_from_hf(42)
    with pytest.raises(ValueError, match="hidden_act"):
        moe_config_from_hf({**hf("mixtral_8x7b.json"), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="topk_method"):
        moe_config_from_hf({**hf("deepseek_v2.json"), "topk_method": "sinkhorn"})


# -------------------------------------------------------------------------------------- Megatron


def megatron_v3_args() -> dict:
    return {
        "hidden_size": 7168,
        "ffn_hidden_size": 18432,
        "swiglu": True,
        "num_layers": 61,
        "num_moe_experts": 256,
        "moe_router_topk": 8,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_num_groups": 8,
        "moe_router_group_topk": 4,
        "moe_router_topk_scaling_factor": 2.5,
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 1e-3,
        "moe_expert_capacity_factor": None,
        "moe_token_drop_policy": "probs",
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 1e-4,
        "moe_z_loss_coeff": None,
        "moe_router_dtype": "fp32",
        "moe_ffn_hidden_size": 2048,
        "moe_shared_expert_intermediate_size": 2048,
    }


def test_megatron_mapping():
    args = megatron_v3_args()
    cfg = moe_config_from_megatron(args, name="dsv3")
    r = cfg.router
    assert cfg.name == "dsv3" and cfg.hidden_size == args["hidden_size"]
    assert cfg.ffn_hidden_size == args["moe_ffn_hidden_size"] and cfg.activation == "swiglu"
    assert (r.num_experts, r.topk, r.score_function) == (256, 8, "sigmoid")
    assert (r.num_groups, r.group_topk, r.group_score) == (8, 4, "sum_topk")
    assert r.scaling_factor == 2.5 and r.enable_expert_bias and r.bias_update_rate == 1e-3
    assert r.capacity_factor is None and r.drop_policy == "probs"
    assert r.aux_loss_type == "seq_aux_loss" and r.aux_loss_coeff == 1e-4
    assert r.z_loss_coeff == 0.0 and r.router_dtype == "fp32" and r.normalize_topk is None
    assert cfg.num_shared_experts == 1 and cfg.shared_expert_ffn_hidden_size == 2048


def test_megatron_defaults_and_options():
    cfg = moe_config_from_megatron(
        {
            "hidden_size": 64,
            "ffn_hidden_size": 128,
            "num_moe_experts": 8,
            "moe_aux_loss_coeff": [0.01],
            "moe_z_loss_coeff": 1e-3,
            "moe_router_pre_softmax": True,
            "moe_expert_capacity_factor": 1.25,
            "moe_token_drop_policy": "position",
            "swiglu": False,
        }
    )
    r = cfg.router
    assert r.topk == 2 and r.score_function == "softmax" and r.use_pre_softmax
    assert r.aux_loss_type == "aux_loss" and r.aux_loss_coeff == 0.01
    assert r.z_loss_coeff == 1e-3
    assert r.capacity_factor == 1.25 and r.drop_policy == "position"
    assert cfg.ffn_hidden_size == 128 and cfg.activation == "gelu"
    none = moe_config_from_megatron({"hidden_size": 8, "ffn_hidden_size": 8, "num_moe_experts": 4})
    assert none.router.aux_loss_type == "none"  # aux_loss with coefficient 0 is off


def test_megatron_unknown_moe_keys_are_listed():
    args = {**megatron_v3_args(), "moe_router_topk_limited_devices": 4, "moe_jitter": 0.1}
    with pytest.raises(ValueError) as err:
        moe_config_from_megatron(args)
    assert "moe_jitter, moe_router_topk_limited_devices" in str(err.value)


@pytest.mark.parametrize(
    ("update", "needle"),
    [
        ({"num_moe_experts": None}, "num_moe_experts"),
        ({"hidden_size": None}, "hidden_size"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        ({"moe_router_group_topk": 3}, "topk=8 is not divisible by group_topk=3"),
        ({"moe_aux_loss_coeff": [0.1, 0.2]}, "give one coefficient"),
    ],
)
def test_megatron_errors(update, needle):
    with pytest.raises(ValueError, match=needle):
        moe_config_from_megatron({**megatron_v3_args(), **update})


# ----------------------------------------------------------------------------------------- YAML


@pytest.mark.parametrize("fixture", FIXTURES)
def test_to_yaml_round_trips(fixture, tmp_path):
    cfg = moe_config_from_hf(hf(fixture))
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_to_yaml_rejects_other_types():
    with pytest.raises(TypeError, match="MoEConfig"):
        to_yaml({"name": "x"})


# ------------------------------------------------------------------------- families of issue 14


@pytest.mark.parametrize(
    "fixture",
    [
        "deepseek_v3_2.json",
        "dots_llm1.json",
        "glm4_5.json",
        "glm4_7_flash.json",
        "glm5.json",
        "kimi_k2.json",
        "kimi_k2_5.json",
    ],
)
def test_v3_style_families_route_like_deepseek_v3(fixture):
    raw = text(hf(fixture))
    cfg = moe_config_from_hf(hf(fixture))
    r = cfg.router
    assert r.score_function == "sigmoid" and r.enable_expert_bias and not r.use_pre_softmax
    assert r.normalize_topk is raw["norm_topk_prob"]
    assert r.scaling_factor == raw["routed_scaling_factor"]
    if raw["n_group"] > 1:
        assert (r.num_groups, r.group_topk, r.group_score) == (8, 4, "sum_topk")
    else:
        assert r.num_groups is None
    assert cfg.num_shared_experts == raw["n_shared_experts"]
    if "first_k_dense_replace" in raw:
        assert "first_k_dense_replace" in cfg.source["moe_layers"]


def test_olmoe_and_qwen3_vl_moe():
    o = moe_config_from_hf(hf("olmoe_1b_7b.json"))
    assert o.router.use_pre_softmax and o.router.normalize_topk is False
    assert o.ffn_hidden_size == 1024 and o.num_shared_experts == 0
    v = moe_config_from_hf(hf("qwen3_vl_30b_a3b.json"))
    assert not v.router.use_pre_softmax and v.router.normalize_topk is None
    assert v.num_shared_experts == 0 and v.source["hf_text_model_type"] == "qwen3_vl_moe_text"


def test_kimi_k25_reads_text_config():
    cfg = moe_config_from_hf(hf("kimi_k2_5.json"))
    assert cfg.name == "kimi_k25" and cfg.source["hf_text_model_type"] == "deepseek_v3"
    assert cfg.router == moe_config_from_hf(hf("kimi_k2.json")).router


def test_v3_style_gates_ignore_the_keys_they_never_read():
    # their transformers gates always run sigmoid + selection bias by groups (refused before)
    cfg = moe_config_from_hf({**hf("glm4_5.json"), "scoring_func": "softmax"})
    assert cfg.router == moe_config_from_hf(hf("glm4_5.json")).router
    assert 'scoring_func="softmax" (sigmoid scores)' in cfg.source["ignored"]


@pytest.mark.parametrize(
    "fixture, norm",
    [("qwen1_5_moe_a2_7b.json", False), ("qwen3_next_80b_a3b.json", True)],
)
def test_qwen_shared_gated_expert(fixture, norm):
    raw = hf(fixture)
    cfg = moe_config_from_hf(raw)
    assert cfg.num_shared_experts == 1 and cfg.shared_expert_gate
    assert cfg.shared_expert_ffn_hidden_size == raw["shared_expert_intermediate_size"]
    r = cfg.router
    assert r.score_function == "softmax" and r.use_pre_softmax is (not norm)


def test_qwen3_5_moe_always_renormalises():
    cfg = moe_config_from_hf(hf("qwen3_5_moe_35b_a3b.json"))
    assert cfg.source["hf_text_model_type"] == "qwen3_5_moe_text"
    assert not cfg.router.use_pre_softmax and cfg.router.normalize_topk is None
    assert cfg.shared_expert_gate and cfg.num_shared_experts == 1


def test_llama4_sigmoid_top1_on_input():
    cfg = moe_config_from_hf(hf("llama4_scout.json"))
    r = cfg.router
    assert (r.topk, r.score_function, r.normalize_topk) == (1, "sigmoid", False)
    assert cfg.probs_on_input and cfg.num_shared_experts == 1 and not cfg.shared_expert_gate
    assert cfg.shared_expert_ffn_hidden_size == cfg.ffn_hidden_size == 8192
    raw = hf("llama4_scout.json")
    raw["text_config"] = {**raw["text_config"], "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match="top-1 only"):
        moe_config_from_hf(raw)


def test_minimax_m2_rules():
    r = moe_config_from_hf(hf("minimax_m2.json")).router
    assert r.score_function == "sigmoid" and r.enable_expert_bias and r.normalize_topk is True
    assert r.scaling_factor is None and r.num_groups is None
    with pytest.raises(ValueError, match="router_jitter_noise"):
        moe_config_from_hf({**hf("minimax_m2.json"), "router_jitter_noise": 0.1})


def test_gpt_oss_rules():
    cfg = moe_config_from_hf(hf("gpt_oss_120b.json"))
    r = cfg.router
    assert r.router_bias and r.score_function == "softmax" and not r.use_pre_softmax
    assert cfg.activation == "swiglu_oai" and cfg.expert_mlp_bias
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert "swiglu_alpha=1.702" in cfg.source["defaulted"]


def test_deepseek_moe_16b_rules():
    cfg = moe_config_from_hf(hf("deepseek_moe_16b.json"))
    r = cfg.router
    assert r.score_function == "softmax" and r.use_pre_softmax and r.normalize_topk is False
    assert r.scaling_factor is None and r.num_groups is None and not r.enable_expert_bias
    assert (cfg.num_shared_experts, cfg.shared_expert_ffn_hidden_size) == (2, 2 * 1408)


def test_nemotron_h_rules():
    cfg = moe_config_from_hf(hf("nemotron_3_nano_30b_a3b.json"))
    r = cfg.router
    assert r.score_function == "sigmoid" and r.enable_expert_bias and r.normalize_topk is True
    assert r.scaling_factor == 2.5 and cfg.activation == "relu2"
    assert (cfg.num_shared_experts, cfg.shared_expert_ffn_hidden_size) == (1, 3712)
    with pytest.raises(ValueError, match="latent"):
        moe_config_from_hf({**hf("nemotron_3_nano_30b_a3b.json"), "moe_latent_size": 1024})


def test_deepseek_v4_clamps_its_experts():
    assert moe_config_from_hf(hf("deepseek_v4_flash.json")).swiglu_limit == 10.0


# ------------------------------------------------------------------------------ missing keys


def test_deepseek_v3_without_method_keys_takes_v3_defaults():
    raw = {
        k: v for k, v in hf("deepseek_v3.json").items() if k not in ("topk_method", "scoring_func")
    }
    cfg = moe_config_from_hf(raw)
    assert cfg.router == moe_config_from_hf(hf("deepseek_v3.json")).router
    assert 'topk_method="noaux_tc" (fixed by the modeling code)' in cfg.source["defaulted"]
    assert 'scoring_func="sigmoid" (fixed by the modeling code)' in cfg.source["defaulted"]


def test_bare_config_takes_every_default():
    cfg = moe_config_from_hf({"model_type": "deepseek_v3"})
    r = cfg.router
    assert (r.num_experts, r.topk, r.num_groups, r.group_topk) == (256, 8, 8, 4)
    assert r.scaling_factor == 2.5 and cfg.hidden_size == 7168
    for key in ("n_routed_experts", "num_experts_per_tok", "hidden_size", "n_group"):
        assert key in cfg.source["defaulted"]
    q = moe_config_from_hf({"model_type": "qwen2_moe"})
    assert (q.router.num_experts, q.router.topk, q.shared_expert_ffn_hidden_size) == (60, 4, 5632)
    nested = moe_config_from_hf({"model_type": "llama4"})
    assert "text_config.num_local_experts=16" in nested.source["defaulted"]


def test_published_keys_are_not_reported_as_defaulted():
    cfg = moe_config_from_hf(hf("deepseek_v3.json"))
    assert "defaulted" not in cfg.source


# ------------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("num_experts_per_tok", 8.7, "an integer"),
        ("num_experts_per_tok", True, "an integer"),
        ("n_routed_experts", [128], "an integer"),
        ("n_routed_experts", "256", "an integer"),
        ("norm_topk_prob", 1, "true or false"),
        ("routed_scaling_factor", False, "a number"),
        ("hidden_act", 3, "a string"),
    ],
)
def test_wrong_types_are_refused_naming_the_key(key, value, kind):
    with pytest.raises(ValueError, match=f"{key} must be {kind}"):
        moe_config_from_hf({**hf("deepseek_v3.json"), key: value})


def test_wrong_type_in_text_config_names_the_path():
    raw = hf("qwen3_5_moe_35b_a3b.json")
    raw["text_config"] = {**raw["text_config"], "num_experts": 1.5}
    with pytest.raises(ValueError, match=r"text_config\.num_experts must be an integer"):
        moe_config_from_hf(raw)


def test_attribute_map_spellings_are_read():
    # transformers 5.x saves Qwen3MoeConfig.num_experts as num_local_experts (attribute_map).
    raw = {**hf("qwen3_30b_a3b.json")}
    raw["num_local_experts"] = raw.pop("num_experts")
    cfg = moe_config_from_hf(raw)
    assert cfg.router.num_experts == raw["num_local_experts"]
    assert "defaulted" not in cfg.source
    with pytest.raises(ValueError, match="must agree"):
        moe_config_from_hf({**raw, "num_experts": 64})


def test_deepseek_v4_reads_what_its_router_reads():
    # DeepseekV4TopKRouter always renormalises and its block builds one shared MLP: a config
    # saying otherwise was refused; it is the model transformers runs (source["ignored"])
    base = moe_config_from_hf(hf("deepseek_v4_flash.json"))
    for key, value in (("norm_topk_prob", False), ("n_shared_experts", 2)):
        cfg = moe_config_from_hf({**hf("deepseek_v4_flash.json"), key: value})
        assert cfg.router == base.router and cfg.num_shared_experts == 1, key
        assert f"{key}={str(value).lower()}" in cfg.source["ignored"], cfg.source
    with pytest.raises(ValueError, match="scoring_func must be a string"):  # read: ACT2FN[...]
        moe_config_from_hf({**hf("deepseek_v4_flash.json"), "scoring_func": 3})


def test_default_dense_prefix_is_recorded():
    cfg = moe_config_from_hf({"model_type": "glm4_moe"})
    assert "first_k_dense_replace=1 (default)" in cfg.source["moe_layers"]
    assert "first_k_dense_replace=1" in cfg.source["defaulted"]


@pytest.mark.parametrize(
    "mt, reason",
    [("ernie4_5_moe", "selection bias"), ("phimoe", "SparseMixer"), ("longcat_flash", "zero")],
)
def test_inexpressible_families_are_refused_with_the_reason(mt, reason):
    with pytest.raises(ValueError, match=f"cannot be imported exactly: .*{reason}"):
        moe_config_from_hf({"model_type": mt, "hidden_size": 64})


def test_granitemoe_is_post_softmax_topk():
    r = moe_config_from_hf(hf("granite_3_0_3b_a800m.json")).router
    assert r.score_function == "softmax" and not r.use_pre_softmax and r.normalize_topk is None


def test_nemotron_h_always_has_its_shared_mlp():
    raw = {**hf("nemotron_3_nano_30b_a3b.json"), "n_shared_experts": 0}
    cfg = moe_config_from_hf(raw)
    assert (cfg.num_shared_experts, cfg.shared_expert_ffn_hidden_size) == (1, 3712)
    with pytest.raises(ValueError, match="mlp_bias"):
        moe_config_from_hf({**raw, "mlp_bias": True})


def test_nested_text_config_must_be_the_families_text_model():
    raw = {**hf("llama4_scout.json")}
    raw["text_config"] = {**raw["text_config"], "model_type": "mixtral"}
    with pytest.raises(ValueError, match="text_config model_type 'mixtral' is not supported"):
        moe_config_from_hf(raw)
    with pytest.raises(ValueError, match="text_config must be an object"):
        moe_config_from_hf({"model_type": "llama4", "text_config": [1]})


# ------------------------------------------------------------------------------- explicit nulls


@pytest.mark.parametrize("fixture", FIXTURES)
def test_null_routing_keys_are_refused_not_defaulted(fixture):
    """``"num_experts_per_tok": null`` (or another routing key the router needs) is refused
    naming the key, in every family and in nested text configs, not read as the default."""
    from flexdispatch.importers._keys import _NOT_NULL, _NOT_READ

    raw = hf(fixture)
    body = text(raw)
    prefix = "text_config." if "text_config" in raw else ""
    mt = body.get("model_type", raw["model_type"])
    keys = sorted(k for k in _NOT_NULL & set(body) if k not in _NOT_READ.get(mt, {}))
    if "num_experts_per_tok" in body:
        assert "num_experts_per_tok" in keys
    refused = set()
    for key in keys:
        nulled = {**body, key: None}
        case = {**raw, "text_config": nulled} if prefix else nulled
        try:
            moe_config_from_hf(case)
        except ValueError as exc:
            if f"{prefix}{key}: null" in str(exc):
                refused.add(key)
                continue
            # another check came first (the value is read only where the family uses it)
            assert "null" not in str(exc), exc
        else:
            # the family does not read this key: importing must not depend on it
            assert moe_config_from_hf(case).router == moe_config_from_hf(raw).router, key
    if "num_experts_per_tok" in keys:
        assert "num_experts_per_tok" in refused, f"{fixture}: a null top-k was not refused"


def test_null_top_k_message():
    with pytest.raises(ValueError) as err:
        moe_config_from_hf({**hf("mixtral_8x7b.json"), "num_experts_per_tok": None})
    msg = str(err.value)
    assert "mixtral config has num_experts_per_tok: null" in msg and "set it" in msg
    # an absent key still takes the family's default, as transformers does
    absent = {k: v for k, v in hf("mixtral_8x7b.json").items() if k != "num_experts_per_tok"}
    assert moe_config_from_hf(absent).router.topk == 2
