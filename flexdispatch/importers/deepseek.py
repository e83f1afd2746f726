"""DeepSeek-family importers: DeepSeek-MoE, V2, V3 (and its relatives: Kimi-K2, GLM-4.5 MoE,
dots1, DeepSeek-V3.2), V4, and Nemotron-H, whose routing is DeepSeek-V3's."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flexdispatch._checks.files import excerpt
from flexdispatch.importers._keys import (
    _activation,
    _aux,
    _groups,
    _Keys,
    _layer_pattern,
    _shared,
)


def _deepseek(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    """The DeepSeek gate family: V2 (softmax, optional max-groups), V3 and its relatives
    (sigmoid, selection bias, top-2-sum groups), V4 (sqrtsoftplus, hash layers), DeepSeek-MoE."""
    mt = k.mt
    E = k.int("n_routed_experts")
    topk = k.int("num_experts_per_tok")
    F = k.int("moe_intermediate_size")
    # NOTE: read as the family's transformers router reads them: a key it never reads is the
    # value it runs (_keys._NOT_READ), whatever the config says (source["ignored"])
    scoring = k.str("scoring_func")
    method = k.str("topk_method")
    norm = k.bool("norm_topk_prob")
    scale = k.float("routed_scaling_factor") if mt != "deepseek" else 1.0
    if scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise ValueError(f"{mt} scoring_func={excerpt(scoring)} is not supported")
    methods = ("greedy", "group_limited_greedy") if mt in ("deepseek", "deepseek_v2") else ()
    if methods and method not in methods:
        raise ValueError(
            f"{mt} topk_method={excerpt(method)} is not supported: its gate runs "
            f"{' or '.join(methods)}"
        )
    router: dict[str, Any] = {"num_experts": E, "topk": topk, "score_function": scoring}
    if method == "group_limited_greedy":
        router.update(_groups(k, E, topk, "max", source))
    elif method == "noaux_tc":
        if mt == "deepseek_v4":
            k.raw("n_group"), k.raw("topk_group")  # NOTE: no group stage: recorded if given
        else:
            router.update(_groups(k, E, topk, "sum_top2", source))
        router["enable_expert_bias"] = True
    if scoring == "softmax":
        router["use_pre_softmax"] = True  # softmax over all E, then top-k
    router["normalize_topk"] = norm
    if mt == "deepseek_v2" and k.cfg.get("norm_topk_prob") is True and topk > 1:
        source["scaling"] = (
            "norm_topk_prob=true: DeepSeek's own V2 modeling code renormalises and does not "
            "scale; transformers' DeepseekV2TopkRouter, followed here, always scales and never "
            "renormalises (every published V2 config has norm_topk_prob=false, where both agree)"
        )
    if scale != 1.0:
        router["scaling_factor"] = scale
    router.update(_aux(cfg, source))
    source["routing"] = (
        f"topk_method={method}, scoring_func={scoring}, norm_topk_prob={str(norm).lower()}"
        + (f", routed_scaling_factor={scale}" if mt != "deepseek" else "")
    )
    if k.has("first_k_dense_replace"):
        k.int("first_k_dense_replace")  # typed, and listed as defaulted when absent
    _layer_pattern(cfg, ("first_k_dense_replace", "moe_layer_freq", "mlp_layer_types"), source)
    if "first_k_dense_replace" not in cfg and k.has("first_k_dense_replace"):
        note = f"first_k_dense_replace={k.int('first_k_dense_replace')} (default)"
        source["moe_layers"] = f"{source['moe_layers']}, {note}" if "moe_layers" in source else note
    out: dict[str, Any] = {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": F,
        "activation": _activation(k),
        "router": router,
    }
    if mt == "deepseek_v4":
        types = cfg.get("mlp_layer_types")
        if isinstance(types, list) and "num_hash_layers" not in cfg:
            n_hash = sum(1 for t in types if t == "hash_moe")
        else:
            n_hash = k.int("num_hash_layers")
        source["num_hash_layers"] = str(n_hash)
        if n_hash:
            source["hash_layers"] = (
                f"the first {n_hash} MoE layers pick experts from a per-token-id table "
                f"(tid2eid, stored with the checkpoint) instead of the gate, with weights = the "
                f"gate's sqrtsoftplus scores there, renormalised, x scaling; see "
                f"hash_layer_router_config (pass the checkpoint table to hash_routing(table=) "
                f"to match its experts exactly)"
            )
        out["swiglu_limit"] = k.float("swiglu_limit")
    out.update(_shared(k, F, source))
    return out


def _nemotron_h(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    if k.has("moe_latent_size"):
        raise ValueError(
            f"nemotron_h moe_latent_size={k.cfg['moe_latent_size']}: its experts run in a "
            f"projected latent space, which flexdispatch cannot express"
        )
    act = k.str("mlp_hidden_act")
    if act != "relu2":
        raise ValueError(
            f"nemotron_h mlp_hidden_act={excerpt(act)}: supported is relu2 (non-gated)"
        )
    E, topk = k.int("n_routed_experts"), k.int("num_experts_per_tok")
    router: dict[str, Any] = {
        "num_experts": E,
        "topk": topk,
        "score_function": "sigmoid",
        "enable_expert_bias": True,
        "normalize_topk": k.bool("norm_topk_prob"),
    }
    router.update(_groups(k, E, topk, "sum_top2", source))
    scale = k.float("routed_scaling_factor")
    if scale != 1.0:
        router["scaling_factor"] = scale
    router.update(_aux(cfg, source))
    source["routing"] = (
        f"sigmoid, e_score_correction_bias for selection, norm_topk_prob="
        f"{str(router['normalize_topk']).lower()}, routed_scaling_factor={scale}"
    )
    out: dict[str, Any] = {
        "hidden_size": k.int("hidden_size"),
        "ffn_hidden_size": k.int("moe_intermediate_size"),
        "activation": "relu2",
        "router": router,
    }
    if cfg.get("mlp_bias"):
        raise ValueError(
            "nemotron_h mlp_bias=true: its shared MLP then has biases but its routed experts "
            "do not, which one MoEConfig cannot express"
        )
    # NOTE: the transformers block builds one shared MLP whatever n_shared_experts says
    k.raw("n_shared_experts")
    S = k.int("moe_shared_expert_intermediate_size")
    out.update(num_shared_experts=1, shared_expert_ffn_hidden_size=S)
    source["shared_experts"] = (
        f"one relu2 shared MLP of moe_shared_expert_intermediate_size={S} (the block always "
        f"builds it)"
    )
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type")
    if pattern is not None:
        source["moe_layers"] = f"layer pattern (E = MoE): {json.dumps(pattern)}"
    return out
