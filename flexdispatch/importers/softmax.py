"""Importers of the softmax / logits top-k families: Mixtral, Granite-MoE, Qwen2/3-MoE (and
OLMoE, Qwen3-Next, Qwen3.5, Qwen3-VL), Llama 4, MiniMax-M2 and gpt-oss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexdispatch._checks.files import excerpt
from flexdispatch.importers._keys import (
    _activation,
    _aux,
    _Keys,
    _layer_pattern,
    _no_jitter,
    _softmax_router,
)


def _mixtral(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    _no_jitter(k)
    router = _softmax_router(
        k, k.int("num_local_experts"), k.int("num_experts_per_tok"), True, source
    )
    router.update(_aux(cfg, source))
    return {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": k.int("intermediate_size"),
        "activation": _activation(k),
        "router": router,
    }


def _qwen(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    """Qwen3-MoE; Qwen2-MoE, Qwen3-Next and Qwen3.5-MoE add one sigmoid-gated shared expert."""
    # NOTE: Qwen3.5-MoE's and Qwen3-VL-MoE's gates always renormalise (_keys._NOT_READ)
    norm = k.bool("norm_topk_prob")
    router = _softmax_router(k, k.int("num_experts"), k.int("num_experts_per_tok"), norm, source)
    router.update(_aux(cfg, source))
    _layer_pattern(cfg, ("decoder_sparse_step", "mlp_only_layers", "layer_types"), source)
    if k.has("decoder_sparse_step"):
        k.int("decoder_sparse_step")
    out: dict[str, Any] = {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": k.int(
            "intermediate_size" if k.mt == "olmoe" else "moe_intermediate_size"
        ),
        "activation": _activation(k),
        "router": router,
    }
    if k.mt in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):
        S = k.int("shared_expert_intermediate_size")
        if S:
            out.update(
                num_shared_experts=1, shared_expert_ffn_hidden_size=S, shared_expert_gate=True
            )
            source["shared_experts"] = (
                f"one shared expert MLP of shared_expert_intermediate_size={S}, scaled by "
                f"sigmoid(Linear(H, 1))"
            )
    return out


def _llama4(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    topk = k.int("num_experts_per_tok")
    if topk != 1:
        raise ValueError(
            f"llama4 config has {k.name('num_experts_per_tok')}={topk}: Llama-4 multiplies the "
            f"routing weight into the expert input, which flexdispatch supports for top-1 only"
        )
    F = k.int("intermediate_size")
    router = {
        "num_experts": k.int("num_local_experts"),
        "topk": 1,
        "score_function": "sigmoid",
        "normalize_topk": False,
    }
    router.update(_aux(cfg, source))
    source["routing"] = (
        "top-1 of the logits, weight sigmoid(logit) (not renormalised), multiplied into the "
        "expert input"
    )
    source["shared_experts"] = f"one ungated shared expert MLP of intermediate_size={F}"
    _layer_pattern(cfg, ("interleave_moe_layer_step", "moe_layers"), source)
    return {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": F,
        "activation": _activation(k),
        "router": router,
        "probs_on_input": True,
        "num_shared_experts": 1,
        "shared_expert_ffn_hidden_size": F,
    }


def _minimax_m2(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    _no_jitter(k)
    # NOTE: its gate always runs sigmoid + e_score_correction_bias, and the block has no shared
    # expert, whatever the config says (_keys._NOT_READ: recorded in source["ignored"])
    k.raw("scoring_func"), k.raw("use_routing_bias"), k.raw("shared_intermediate_size")
    router = {
        "num_experts": k.int("num_local_experts"),
        "topk": k.int("num_experts_per_tok"),
        "score_function": "sigmoid",
        "enable_expert_bias": True,
        "normalize_topk": True,
    }
    router.update(_aux(cfg, source))
    source["routing"] = (
        "sigmoid scores, top-k of scores + e_score_correction_bias (selection only), "
        "renormalised, no scaling"
    )
    return {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": k.int("intermediate_size"),
        "activation": _activation(k),
        "router": router,
    }


def _gpt_oss(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    E = k.int("num_local_experts")
    topk = k.int("num_experts_per_tok")
    if "experts_per_token" in cfg and cfg["experts_per_token"] != topk:
        raise ValueError(
            f"gpt_oss config: experts_per_token={excerpt(cfg['experts_per_token'])} differs from "
            f"num_experts_per_tok={topk}"
        )
    k.raw("hidden_act")  # NOTE: never read: its experts run the clamped GLU (source["ignored"])
    router = {"num_experts": E, "topk": topk, "score_function": "softmax", "router_bias": True}
    router.update(_aux(cfg, source))
    limit, alpha = k.float("swiglu_limit"), k.float("swiglu_alpha")
    source["routing"] = "logits = Linear(H, E) with bias; top-k of the logits, softmax over the k"
    source["experts"] = (
        f"biased projections, gate clamped above by {limit}, up to +-{limit}, "
        f"gate * sigmoid({alpha} * gate) * (up + 1)"
    )
    return {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": k.int("intermediate_size"),
        "activation": "swiglu_oai",
        "swiglu_limit": limit,
        "swiglu_alpha": alpha,
        "expert_mlp_bias": True,
        "router": router,
    }
