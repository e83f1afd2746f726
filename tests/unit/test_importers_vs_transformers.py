"""Imported routers against the transformers reference routers, numerically, on random inputs.

For each family a tiny config is built with its transformers config class (``to_dict()`` is what
the importer reads, so absent keys take the class's defaults), the family's router/gate module is
built from it with random weights (and a random selection bias where it has one), and its
(expert, weight) choices are compared with ``flexdispatch.routing.topk_routing`` run with the
imported ``RouterConfig`` on the same logits. DeepSeek-MoE 16B (model_type ``deepseek``) has no
transformers class: its reference is computed here from its remote modeling code's ops (softmax
over E, top-k, renormalise only when ``norm_topk_prob``).

E experts · k top-k · H hidden size · T tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.deepseek_v4 import modeling_deepseek_v4
from transformers.models.deepseek_v32 import modeling_deepseek_v32
from transformers.models.dots1 import modeling_dots1
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.granitemoe import modeling_granitemoe
from transformers.models.llama4 import modeling_llama4
from transformers.models.minimax_m2 import modeling_minimax_m2
from transformers.models.mixtral import modeling_mixtral
from transformers.models.nemotron_h import modeling_nemotron_h
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

from flexdispatch.importers import moe_config_from_hf
from flexdispatch.routing import topk_routing

H, T = 32, 64
GROUPS = {"n_group": 4, "topk_group": 2}  # 16 experts in 4 groups, 2 kept, k = 4 (4 // 2 = 2)


@dataclass
class Case:
    """One family: how to build its config dict and reference router, and read the router."""

    config: Callable[[], dict[str, Any]]
    router: Callable[[Any], torch.nn.Module]
    has_bias: bool = False  # an e_score_correction_bias (selection only)
    call: str = "plain"  # plain: router(x) -> (logits, weights, idx); see _reference


def _cfg(cls: str, **kw: Any) -> Callable[[], dict[str, Any]]:
    return lambda: getattr(transformers, cls)(hidden_size=H, **kw).to_dict()


def _from(cls: str, module: type) -> Callable[[dict[str, Any]], torch.nn.Module]:
    return lambda c: module(getattr(transformers, cls)(**c))


CASES: dict[str, Case] = {
    "mixtral": Case(
        _cfg("MixtralConfig", num_local_experts=8, num_experts_per_tok=2),
        _from("MixtralConfig", modeling_mixtral.MixtralTopKRouter),
    ),
    "qwen3_moe": Case(
        _cfg("Qwen3MoeConfig", num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
        _from("Qwen3MoeConfig", modeling_qwen3_moe.Qwen3MoeTopKRouter),
    ),
    "qwen3_moe_norm": Case(
        _cfg("Qwen3MoeConfig", num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
        _from("Qwen3MoeConfig", modeling_qwen3_moe.Qwen3MoeTopKRouter),
    ),
    "qwen2_moe": Case(
        _cfg("Qwen2MoeConfig", num_experts=16, num_experts_per_tok=4),
        _from("Qwen2MoeConfig", modeling_qwen2_moe.Qwen2MoeTopKRouter),
    ),
    "qwen3_next": Case(
        _cfg("Qwen3NextConfig", num_experts=16, num_experts_per_tok=4),
        _from("Qwen3NextConfig", modeling_qwen3_next.Qwen3NextTopKRouter),
    ),
    "qwen3_5_moe": Case(
        lambda: {
            "model_type": "qwen3_5_moe",
            "text_config": transformers.Qwen3_5MoeTextConfig(
                hidden_size=H, num_experts=16, num_experts_per_tok=4
            ).to_dict(),
        },
        lambda c: modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter(
            transformers.Qwen3_5MoeTextConfig(**c["text_config"])
        ),
    ),
    "deepseek_v2": Case(
        _cfg(
            "DeepseekV2Config",
            n_routed_experts=16,
            num_experts_per_tok=4,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.0,
            **GROUPS,
        ),
        _from("DeepseekV2Config", modeling_deepseek_v2.DeepseekV2TopkRouter),
    ),
    "deepseek_v3": Case(
        _cfg("DeepseekV3Config", n_routed_experts=16, num_experts_per_tok=4, **GROUPS),
        _from("DeepseekV3Config", modeling_deepseek_v3.DeepseekV3TopkRouter),
        has_bias=True,
    ),
    "kimi_k2": Case(
        lambda: {
            **transformers.DeepseekV3Config(
                hidden_size=H,
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=2.827,
            ).to_dict(),
            "model_type": "kimi_k2",
        },
        lambda c: modeling_deepseek_v3.DeepseekV3TopkRouter(
            transformers.DeepseekV3Config(**{**c, "model_type": "deepseek_v3"})
        ),
        has_bias=True,
    ),
    "kimi_k25": Case(
        lambda: {
            "model_type": "kimi_k25",
            "text_config": {
                **transformers.DeepseekV3Config(
                    hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, **GROUPS
                ).to_dict(),
                "model_type": "kimi_k2",
            },
        },
        lambda c: modeling_deepseek_v3.DeepseekV3TopkRouter(
            transformers.DeepseekV3Config(**{**c["text_config"], "model_type": "deepseek_v3"})
        ),
        has_bias=True,
    ),
    "deepseek_v32": Case(
        _cfg("DeepseekV32Config", n_routed_experts=16, num_experts_per_tok=4, **GROUPS),
        _from("DeepseekV32Config", modeling_deepseek_v32.DeepseekV32TopkRouter),
        has_bias=True,
    ),
    "deepseek_v4": Case(
        _cfg("DeepseekV4Config", n_routed_experts=16, num_experts_per_tok=4),
        _from("DeepseekV4Config", modeling_deepseek_v4.DeepseekV4TopKRouter),
        has_bias=True,
    ),
    "glm4_moe": Case(
        _cfg(
            "Glm4MoeConfig",
            n_routed_experts=16,
            num_experts_per_tok=4,
            routed_scaling_factor=1.5,
            **GROUPS,
        ),
        _from("Glm4MoeConfig", modeling_glm4_moe.Glm4MoeTopkRouter),
        has_bias=True,
    ),
    "glm_moe_dsa": Case(
        _cfg("GlmMoeDsaConfig", n_routed_experts=16, num_experts_per_tok=4),
        _from("GlmMoeDsaConfig", modeling_glm_moe_dsa.GlmMoeDsaTopkRouter),
        has_bias=True,
    ),
    "nemotron_h": Case(
        _cfg(
            "NemotronHConfig",
            n_routed_experts=16,
            num_experts_per_tok=4,
            routed_scaling_factor=2.5,
            **GROUPS,
        ),
        _from("NemotronHConfig", modeling_nemotron_h.NemotronHTopkRouter),
        has_bias=True,
    ),
    "minimax_m2": Case(
        _cfg("MiniMaxM2Config", num_local_experts=16, num_experts_per_tok=4),
        _from("MiniMaxM2Config", modeling_minimax_m2.MiniMaxM2TopKRouter),
        has_bias=True,
        call="bias_arg",
    ),
    "dots1": Case(
        _cfg("Dots1Config", n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4),
        _from("Dots1Config", modeling_dots1.Dots1TopkRouter),
        has_bias=True,
    ),
    "glm4_moe_lite": Case(
        _cfg("Glm4MoeLiteConfig", n_routed_experts=16, num_experts_per_tok=4),
        _from("Glm4MoeLiteConfig", modeling_glm4_moe_lite.Glm4MoeLiteTopkRouter),
        has_bias=True,
    ),
    "olmoe": Case(
        _cfg("OlmoeConfig", num_experts=16, num_experts_per_tok=4),
        _from("OlmoeConfig", modeling_olmoe.OlmoeTopKRouter),
    ),
    "qwen3_vl_moe": Case(
        lambda: {
            "model_type": "qwen3_vl_moe",
            "text_config": transformers.Qwen3VLMoeTextConfig(
                hidden_size=H, num_experts=16, num_experts_per_tok=4
            ).to_dict(),
        },
        lambda c: modeling_qwen3_vl_moe.Qwen3VLMoeTextTopKRouter(
            transformers.Qwen3VLMoeTextConfig(**c["text_config"])
        ),
    ),
    "granitemoe": Case(
        _cfg("GraniteMoeConfig", num_local_experts=16, num_experts_per_tok=4),
        _from("GraniteMoeConfig", modeling_granitemoe.GraniteMoeTopKRouter),
    ),
    "gpt_oss": Case(
        _cfg("GptOssConfig", num_local_experts=16, num_experts_per_tok=4),
        _from("GptOssConfig", modeling_gpt_oss.GptOssTopKRouter),
    ),
    "llama4": Case(
        lambda: {
            "model_type": "llama4",
            "text_config": transformers.Llama4TextConfig(
                hidden_size=H, num_local_experts=16, num_experts_per_tok=1
            ).to_dict(),
        },
        lambda c: modeling_llama4.Llama4Router(transformers.Llama4TextConfig(**c["text_config"])),
        call="dense_scores",
    ),
}


def _dense(idx: torch.Tensor, w: torch.Tensor, E: int) -> torch.Tensor:
    """``[T, E]`` weight matrix from ``[T, k]`` choices (0 where an expert was not chosen)."""
    return torch.zeros(idx.shape[0], E, dtype=torch.float64).scatter(1, idx.long(), w.double())


def _reference(case: Case, router: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None):
    if case.call == "bias_arg":
        _, w, idx = router(x, bias)
    elif case.call == "dense_scores":  # Llama-4: [T, E] sigmoid scores, 0 off the top-k
        scores, _ = router(x)
        w, idx = scores.topk(router.top_k, dim=-1)
    else:
        # NOTE: the order of (logits, weights, index) differs across the supported transformers
        # releases (granitemoe 5.17 returns index, weights, logits): pick by dtype and shape.
        outs = router(x)
        (idx,) = [t for t in outs if not t.is_floating_point()]
        (w,) = [t for t in outs if t.is_floating_point() and t.shape == idx.shape]
    return idx, w


def _compare(case: Case, raw: dict[str, Any], seed: int) -> None:
    """The imported router of ``raw`` against ``case``'s transformers router built from the same
    ``raw``, on random weights and inputs: the same (expert, weight) choices."""
    cfg = moe_config_from_hf(raw)
    rc = cfg.router
    gen = torch.Generator().manual_seed(seed)
    router = case.router(raw).float()
    E = rc.num_experts
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        if rc.router_bias:
            router.bias.copy_(torch.randn(E, generator=gen))
    bias = None
    if case.has_bias:
        bias = torch.randn(E, generator=gen) * 0.2
        if case.call != "bias_arg":
            router.e_score_correction_bias.copy_(bias)
    assert rc.enable_expert_bias is case.has_bias
    x = torch.randn(T, H, generator=gen)
    with torch.no_grad():
        ref_idx, ref_w = _reference(case, router, x, bias)
        logits = F.linear(x, router.weight, router.bias if rc.router_bias else None)
    got = topk_routing(
        logits,
        topk=rc.topk,
        score_function=rc.score_function,
        use_pre_softmax=rc.use_pre_softmax,
        num_groups=rc.num_groups,
        group_topk=rc.group_topk,
        group_score=rc.group_score,
        normalize_topk=rc.normalize_topk,
        scaling_factor=rc.scaling_factor,
        expert_bias=bias,
    )
    assert ref_idx.shape == got.topk_idx.shape == (T, rc.topk)
    torch.testing.assert_close(
        _dense(got.topk_idx, got.topk_probs, E),
        _dense(ref_idx, ref_w, E),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_imported_router_matches_transformers(family: str, seed: int) -> None:
    _compare(CASES[family], CASES[family].config(), seed)


# Issue 45 part 3: each family's routing fields as its own transformers router reads them. The
# same modified config goes to the importer and to the family's config class and router: group
# fields absent, null and set in every family, and fields some routers never read. A field the
# router never reads changes nothing; a null a router does read fails in transformers too, and
# the importer refuses it.
_NULL = None
_ABSENT = object()
GROUP_VARIANTS = {
    "groups-absent": {"n_group": _ABSENT, "topk_group": _ABSENT},
    "groups-null": {"n_group": _NULL, "topk_group": _NULL},
    "groups-set": dict(GROUPS),
}
UNREAD_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "deepseek_v2": [{"scoring_func": "sigmoid"}, {"norm_topk_prob": True}],
    "deepseek_v3": [{"topk_method": "greedy"}, {"scoring_func": "softmax"}],
    "kimi_k2": [{"topk_method": "greedy"}],
    "deepseek_v32": [{"topk_method": "group_limited_greedy"}],
    "glm4_moe": [{"topk_method": "greedy", "scoring_func": "softmax"}],
    "deepseek_v4": [
        {"topk_method": "greedy"},
        {"topk_method": "group_limited_greedy", **GROUPS},
        {"norm_topk_prob": False},
        {"n_shared_experts": 2},
    ],
    "minimax_m2": [{"use_routing_bias": False}, {"scoring_func": "softmax"}],
    "granitemoe": [{"router_jitter_noise": 0.1}],
    "gpt_oss": [{"hidden_act": "gelu"}],
    "qwen3_5_moe": [{"norm_topk_prob": False}],
    "qwen3_vl_moe": [{"norm_topk_prob": False}],
}
VARIANTS = [(f, name, patch) for f in sorted(CASES) for name, patch in GROUP_VARIANTS.items()]
VARIANTS += [(f, "unread", p) for f, ps in sorted(UNREAD_VARIANTS.items()) for p in ps]


def _patched(raw: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    inner = dict(raw.get("text_config") or raw)
    for key, value in patch.items():
        if value is _ABSENT:
            inner.pop(key, None)
        else:
            inner[key] = value
    return {**raw, "text_config": inner} if "text_config" in raw else inner


def _transformers_runs(case: Case, raw: dict[str, Any]) -> bool:
    """Whether the family's transformers router builds from ``raw`` and routes a batch."""
    try:
        router = case.router(raw).float()
        with torch.no_grad():
            router.weight.normal_()
            bias = torch.zeros(router.weight.shape[0]) if case.call == "bias_arg" else None
            _reference(case, router, torch.randn(4, H), bias)
    except Exception:  # NOTE: any failure: transformers cannot run this config
        return False
    return True


@pytest.mark.parametrize(
    ("family", "variant", "patch"),
    VARIANTS,
    ids=[f"{f}-{n}-{'-'.join(p)}" if n == "unread" else f"{f}-{n}" for f, n, p in VARIANTS],
)
def test_every_variant_is_read_as_its_transformers_router_reads_it(family, variant, patch):
    case = CASES[family]
    raw = _patched(case.config(), patch)
    runs = _transformers_runs(case, raw)
    try:
        moe_config_from_hf(raw)
    except ValueError as exc:
        # NOTE: refused where transformers cannot run it either (naming the field), or where
        # flexdispatch cannot express its routing (the class defaults 8/4 groups, k = 4)
        inexpressible = "flexdispatch can represent this model only when" in str(exc)
        assert not runs or inexpressible, f"refused, but transformers runs it: {exc}"
        assert any(key in str(exc) for key in patch), exc
        return
    assert runs, "imported, but transformers cannot run it"
    _compare(case, raw, seed=0)
    if variant == "unread":
        ignored = moe_config_from_hf(raw).source.get("ignored", "")
        assert all(key in ignored for key in patch), ignored


@pytest.mark.parametrize("norm", [False, True])
def test_deepseek_moe_16b_matches_its_remote_code_ops(norm: bool) -> None:
    # No transformers class: DeepSeek-MoE's gate is softmax over E, top-k, then divide by the
    # sum of the k weights when norm_topk_prob (its remote modeling code), no scaling.
    raw = {
        "model_type": "deepseek",
        "hidden_size": H,
        "moe_intermediate_size": 16,
        "n_routed_experts": 16,
        "n_shared_experts": 2,
        "num_experts_per_tok": 4,
        "norm_topk_prob": norm,
    }
    rc = moe_config_from_hf(raw).router
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(T, 16, generator=gen)
    w, idx = logits.softmax(dim=-1).topk(4, dim=-1)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    got = topk_routing(
        logits,
        topk=rc.topk,
        score_function=rc.score_function,
        use_pre_softmax=rc.use_pre_softmax,
        normalize_topk=rc.normalize_topk,
        scaling_factor=rc.scaling_factor,
    )
    torch.testing.assert_close(
        _dense(got.topk_idx, got.topk_probs, 16), _dense(idx, w, 16), rtol=1e-5, atol=1e-6
    )
