"""Each family's routing fields read as that family's own transformers router reads them
(transformers 5.23.0; issue 45, part 3): a field the router never reads is never a reason to
refuse, and never changes the import (it is listed in ``source["ignored"]``). Every supported
model_type with its group fields absent, null and set. The readable table; the same variants run
against the transformers routers in ``test_importers_vs_transformers.py``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NESTED = {"kimi_k25", "llama4", "qwen3_5_moe", "qwen3_vl_moe"}
# model_type -> (its transformers router reads n_group/topk_group?, class defaults when absent)
READS_GROUPS = {
    "deepseek_v3": (8, 4),
    "kimi_k2": (8, 4),
    "kimi_k25": (8, 4),
    "deepseek_v32": (8, 4),
    "glm4_moe": (1, 1),
    "glm4_moe_lite": (1, 1),
    "glm_moe_dsa": (1, 1),
    "dots1": (1, 1),
    "nemotron_h": (1, 1),
    "deepseek_v2": None,  # V2: only with topk_method=group_limited_greedy
}


def _configs():
    out = {}
    for f in sorted(FIX.glob("*.json")):
        d = json.loads(f.read_text())
        out[d["model_type"]] = d
        if d["model_type"] in NESTED and isinstance(d.get("text_config"), dict):
            t = d["text_config"]
            inner = {
                "llama4": "llama4_text",
                "qwen3_5_moe": "qwen3_5_moe_text",
                "qwen3_vl_moe": "qwen3_vl_moe_text",
            }.get(d["model_type"])
            if inner:
                out[inner] = {**t, "model_type": inner}
    return out


CONFIGS = _configs()


def _inner(d):
    return d["text_config"] if d["model_type"] in NESTED else d


def _variant(mt, **patch):
    d = copy.deepcopy(CONFIGS[mt])
    t = _inner(d)
    for k, v in patch.items():
        if v is ...:
            t.pop(k, None)
        else:
            t[k] = v
    return d


def _imp(d):
    from flexdispatch.importers import moe_config_from_hf

    return moe_config_from_hf(d)


def test_every_supported_model_type_has_a_fixture_here():
    from flexdispatch.importers import supported_model_types

    assert set(supported_model_types()) <= set(CONFIGS), set(supported_model_types()) - set(CONFIGS)


def _values(mt):
    t = _inner(CONFIGS[mt])
    E = t.get("n_routed_experts") or t.get("num_local_experts") or t.get("num_experts")
    k = t["num_experts_per_tok"]
    return (8 if E % 8 == 0 and E // 8 >= 2 else 1), max(1, k // 2)


@pytest.mark.parametrize("mt", sorted(CONFIGS))
@pytest.mark.parametrize("state", ["absent", "null", "set"])
def test_group_fields_absent_null_set(mt, state):
    G, g = _values(mt)
    patch = {
        "absent": dict(n_group=..., topk_group=...),
        "null": dict(n_group=None, topk_group=None),
        "set": dict(n_group=G, topk_group=g),
    }[state]
    d = _variant(mt, **patch)
    reads = mt in READS_GROUPS and not (
        mt == "deepseek_v2" and _inner(d).get("topk_method") != "group_limited_greedy"
    )
    if not reads:
        # the router never reads them: the import is the one without them, whatever they say
        base = _imp(_variant(mt, n_group=..., topk_group=...)) if mt != "deepseek_v2" else None
        cfg = _imp(d)
        if base is not None:
            assert cfg.router == base.router, (mt, state, cfg.router, base.router)
        if state != "absent" and mt == "deepseek_v4":
            assert "n_group" in cfg.source.get("ignored", ""), (
                cfg.source
            )  # said where it is recorded
        return
    if state == "null":
        with pytest.raises(ValueError, match="n_group"):
            _imp(d)
        return
    if state == "absent" and READS_GROUPS[mt] is None:
        with pytest.raises(ValueError, match="n_group"):  # V2 group_limited_greedy without groups
            _imp(d)
        return
    cfg = _imp(d)
    want = READS_GROUPS[mt] if state == "absent" else (G, g)
    if want[0] > 1 and want[1] < want[0]:
        assert (cfg.router.num_groups, cfg.router.group_topk) == want, cfg.router
    else:
        assert cfg.router.num_groups in (None, 1), cfg.router


# fields some routers never read: (model_type, patch) -> the import must equal the fixture's
UNREAD = [
    ("deepseek_v4", {"norm_topk_prob": False}),  # ec739bd: refused
    ("deepseek_v4", {"n_shared_experts": 2}),  # ec739bd: refused
    ("deepseek_v4", {"topk_method": "greedy"}),  # ec739bd: bias dropped (silently wrong)
    (
        "deepseek_v4",
        {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 4},
    ),  # ec739bd: groups added
    ("deepseek_v3", {"topk_method": "greedy"}),  # ec739bd: groups and bias dropped (silently wrong)
    ("deepseek_v3", {"scoring_func": "softmax"}),  # ec739bd: refused
    ("kimi_k2", {"topk_method": "greedy"}),  # same class as deepseek_v3
    ("deepseek_v2", {"scoring_func": "sigmoid"}),  # ec739bd: imported as sigmoid (silently wrong)
    ("glm4_moe", {"topk_method": "greedy"}),  # ec739bd: refused
    ("minimax_m2", {"use_routing_bias": False}),  # ec739bd: refused
    ("minimax_m2", {"scoring_func": "softmax"}),  # ec739bd: refused
    ("granitemoe", {"router_jitter_noise": 0.1}),  # ec739bd: refused (GraniteMoe never reads it)
    ("gpt_oss", {"hidden_act": "gelu"}),  # ec739bd: refused (GptOssExperts never read it)
    ("nemotron_h", {"n_shared_experts": 2}),  # refused (its block builds one shared MLP)
    ("minimax_m2", {"shared_intermediate_size": 64}),  # refused (the block has no shared one)
]


@pytest.mark.parametrize("mt,patch", UNREAD, ids=[f"{m}-{json.dumps(p)}" for m, p in UNREAD])
def test_a_field_the_router_never_reads_changes_nothing(mt, patch):
    base = _imp(CONFIGS[mt])
    cfg = _imp(_variant(mt, **patch))
    assert cfg.router == base.router and cfg.num_shared_experts == base.num_shared_experts
    assert cfg.activation == base.activation
    assert all(k in cfg.source.get("ignored", "") for k in patch), cfg.source


def test_a_field_the_router_reads_is_still_refused():
    with pytest.raises(ValueError, match="router_jitter_noise"):
        _imp(_variant("mixtral", router_jitter_noise=0.1))  # MixtralSparseMoeBlock reads it
    with pytest.raises(ValueError, match="n_group"):
        _imp(_variant("deepseek_v3", n_group=None))  # DeepseekV3TopkRouter reshapes by it
