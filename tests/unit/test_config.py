"""Config validation and preset loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flexdispatch import DispatchConfig, MoEConfig, RouterConfig, list_presets, load_config
from flexdispatch.config import preset_path


def _router(**kw):
    base = {"num_experts": 16, "topk": 4}
    base.update(kw)
    return RouterConfig(**base)


def test_defaults_are_megatron_like():
    r = _router()
    assert r.score_function == "softmax" and not r.use_pre_softmax
    assert r.group_score == "sum_topk" and r.normalize_topk is None
    assert r.capacity(100) is None


def test_capacity_formula():
    r = _router(capacity_factor=1.5)
    # ceil(T * k / E * cf) = ceil(10 * 4 / 16 * 1.5) = ceil(3.75) = 4
    assert r.capacity(10) == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"topk": 17}, "topk=17 exceeds num_experts=16"),
        ({"num_groups": 4}, "num_groups and group_topk go together"),
        ({"num_groups": 5, "group_topk": 1}, "not divisible by num_groups=5"),
        ({"num_groups": 4, "group_topk": 5}, "group_topk=5 exceeds num_groups=4"),
        ({"num_groups": 4, "group_topk": 3}, "topk=4 is not divisible by group_topk=3"),
        ({"num_groups": 16, "group_topk": 2}, "groups of 1 experts hold fewer than topk=4"),
        ({"use_pre_softmax": True, "score_function": "sigmoid"}, "use_pre_softmax"),
        ({"enable_expert_bias": True}, "enable_expert_bias"),
        ({"aux_loss_type": "aux_loss"}, "aux_loss_coeff"),
        ({"score_function": "relu"}, "score_function"),
        ({"topk": 0}, "topk"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
    ],
)
def test_router_config_errors_name_the_field(kwargs, needle):
    with pytest.raises(ValidationError) as err:
        _router(**kwargs)
    assert needle in str(err.value)


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="num_expert"):
        RouterConfig(num_expert=8, topk=2)
    with pytest.raises(ValidationError, match="hierarchy"):
        DispatchConfig(hierarchy=True)


def test_max_group_rule_allows_topk_not_divisible():
    # DeepSeek-V2 ranks groups by their max score, so k need not divide evenly.
    r = _router(num_experts=160, topk=6, num_groups=8, group_topk=4, group_score="max")
    assert r.num_experts_per_group == 20


def test_check_world():
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=8, router=_router())
    cfg.check_world(4)
    with pytest.raises(ValueError, match="not divisible by the expert-parallel world size 3"):
        cfg.check_world(3)
    cfg = cfg.model_copy(update={"dispatch": DispatchConfig(num_worst_tokens=10)})
    with pytest.raises(ValueError, match="round it up to 12"):
        cfg.check_world(4)


def test_tiny_preset_loads_by_name_and_path(tmp_path):
    assert "tiny_cpu" in list_presets()
    cfg = load_config("tiny_cpu")
    assert cfg.router.num_experts == 16 and cfg.hidden_size == 64
    path = tmp_path / "x.yaml"
    path.write_text(cfg.model_dump_json())  # JSON is valid YAML
    assert load_config(path) == cfg


def test_a_preset_name_is_the_preset_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_cpu").mkdir()  # NOTE: `flexdispatch demo` (preset tiny_cpu) run here
    (tmp_path / "deepseek_v3").write_text("not: a config\n")
    assert load_config("tiny_cpu") == load_config(preset_path("tiny_cpu"))
    assert load_config("deepseek_v3").router.num_experts == 256
    with pytest.raises(ValueError, match=r"config file tiny_cpu is a folder"):
        load_config(Path("tiny_cpu"))  # NOTE: a Path, or ./tiny_cpu, is the file system's
    with pytest.raises(ValueError, match=r"config file deepseek_v3 is invalid"):
        load_config("./deepseek_v3")
    (tmp_path / "mine").write_text(load_config("tiny_cpu").model_dump_json())
    assert load_config("mine") == load_config("tiny_cpu")  # NOTE: no preset of that name


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_config("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 8\nffn_hidden_size: 8\nrouter: {num_experts: 4, topk: 9}\n")
    with pytest.raises(ValueError, match="topk=9 exceeds num_experts=4"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_deepep_api_field_and_worst_case_across_nodes_on_the_elastic_path():
    assert DispatchConfig().deepep_api == "auto"
    with pytest.raises(ValidationError):
        DispatchConfig(deepep_api="v3")
    legacy = DispatchConfig(backend="deepep", num_worst_tokens=32, deepep_api="v1")
    with pytest.raises(ValueError, match="intranode only on its V1 Buffer"):
        legacy.check_world(16, 8)
    # DeepEP V2 takes num_worst_tokens across nodes (do_cpu_sync=False); 'auto' runs V2 there
    DispatchConfig(backend="deepep", num_worst_tokens=32, deepep_api="v2").check_world(16, 8)
    DispatchConfig(backend="deepep", num_worst_tokens=32).check_world(16, 8)
    graphs = {"backend": "deepep", "num_worst_tokens": 32, "cuda_graph": True}
    DispatchConfig(**graphs).check_world(16, 8)
    # issue 44 (Q1): the hint names 'auto' (which picks a generation that can run here), never a
    # generation whose NCCL rule may fail in this process
    with pytest.raises(ValueError, match=r"cuda_graph=True needs it.*deepep_api='auto'"):
        DispatchConfig(**graphs, deepep_api="v1").check_world(16, 8)
    # the same through MoEConfig: 2 nodes of 8 with cuda_graph=True on V2, refused on V1
    layer = load_config("tiny_cpu")
    for api, ok in (("auto", True), ("v2", True), ("v1", False)):
        cfg = layer.model_copy(
            update={"dispatch": DispatchConfig(**graphs, deepep_api=api, ranks_per_node=8)}
        )
        if ok:
            cfg.check_world(16, 8)
        else:
            with pytest.raises(ValueError, match="cuda_graph=True needs it"):
                cfg.check_world(16, 8)


@pytest.mark.parametrize("old, new", [("legacy", "v1"), ("elastic", "v2"), ("ep", "v25")])
def test_deepep_api_names_before_0_1_are_read_as_the_release_names(old, new):
    with pytest.warns(DeprecationWarning, match=f"deepep_api='{old}' is now deepep_api='{new}'"):
        cfg = DispatchConfig(deepep_api=old)
    assert cfg.deepep_api == new and cfg.model_dump()["deepep_api"] == new
    with pytest.raises(ValueError, match="deepep_api"):
        DispatchConfig(deepep_api="v3")
