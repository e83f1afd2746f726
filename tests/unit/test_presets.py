"""Published-model presets: they load, equal the importer's output, hold the published numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flexdispatch import list_presets, load_config
from flexdispatch.config import preset_path
from flexdispatch.importers import moe_config_from_hf, num_hash_layers

ROOT = Path(__file__).resolve().parent.parent.parent
HF = ROOT / "tests" / "fixtures" / "hf"

# preset -> fixture it is generated from
PUBLISHED = {
    "mixtral_8x7b": "mixtral_8x7b.json",
    "qwen3_moe": "qwen3_30b_a3b.json",
    "deepseek_v2": "deepseek_v2.json",
    "deepseek_v3": "deepseek_v3.json",
    "deepseek_v4_flash": "deepseek_v4_flash.json",
}


def _gen_module():
    spec = importlib.util.spec_from_file_location(
        "gen_presets", ROOT / "scripts" / "gen_presets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert load_config(preset_path(name)) == cfg


def test_published_presets_are_shipped():
    assert set(PUBLISHED) <= set(list_presets())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_equals_importer_output(name):
    assert load_config(name) == moe_config_from_hf(HF / PUBLISHED[name], name=name)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_committed_file_is_what_the_generator_writes(name):
    gen = _gen_module()
    assert gen.MODELS[name][0] == PUBLISHED[name]
    assert preset_path(name).read_text() == gen.render(name), "run scripts/gen_presets.py"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_numbers(name):
    raw = json.loads((HF / PUBLISHED[name]).read_text())
    cfg = load_config(name)
    r = cfg.router
    E = raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts")
    assert r.num_experts == E
    assert r.topk == raw["num_experts_per_tok"]
    assert cfg.hidden_size == raw["hidden_size"]
    assert cfg.ffn_hidden_size == (raw.get("moe_intermediate_size") or raw["intermediate_size"])
    assert cfg.num_shared_experts == raw.get("n_shared_experts", 0)
    if "n_group" in raw:
        assert (r.num_groups, r.group_topk) == (raw["n_group"], raw["topk_group"])
    else:
        assert r.num_groups is None
    if "routed_scaling_factor" in raw:
        assert r.scaling_factor == raw["routed_scaling_factor"]
    else:
        assert r.scaling_factor is None
    assert num_hash_layers(cfg) == raw.get("num_hash_layers", 0)


def test_known_values_of_the_big_three():
    # The numbers the field quotes, checked once by hand against the model cards.
    v2, v3, v4 = (
        load_config("deepseek_v2"),
        load_config("deepseek_v3"),
        load_config("deepseek_v4_flash"),
    )
    assert (v2.router.num_experts, v2.router.topk, v2.router.group_score) == (160, 6, "max")
    assert (v3.router.num_experts, v3.router.topk, v3.router.group_topk) == (256, 8, 4)
    assert v3.router.scaling_factor == 2.5 and v3.router.enable_expert_bias
    assert (v4.router.num_experts, v4.router.topk, v4.router.score_function) == (
        256,
        6,
        "sqrtsoftplus",
    )


def test_header_comments_name_source_and_routing_kind():
    for name, fixture in PUBLISHED.items():
        head = preset_path(name).read_text().split("\nname:")[0]
        assert fixture in head and "gen_presets.py" in head
    assert "Device-limited" in preset_path("deepseek_v2").read_text()
    assert "Node-limited" in preset_path("deepseek_v3").read_text()


def test_generator_check_mode_passes():
    assert _gen_module().main(["--check"]) == 0
