"""Build ``MoEConfig`` from published model configs: Hugging Face ``config.json`` and Megatron-Core
arguments.

E experts · k top-k · H hidden size · F expert MLP hidden size.

Each Hugging Face family is mapped to the routing its reference code runs (REFERENCE_FACTS.md,
"Routing as published models define it"):

================  ====================================================================
model_type        routing
================  ====================================================================
mixtral           softmax over E, top-k, renormalise = Megatron post-softmax top-k
qwen3_moe         as Mixtral when ``norm_topk_prob``; else softmax over E (pre), no renorm
deepseek_v2       softmax over E (pre); ``group_limited_greedy``: groups ranked by their
                  max score; renormalise only when ``norm_topk_prob`` (then no scaling),
                  else x ``routed_scaling_factor``
deepseek_v3       ``noaux_tc``: sigmoid, expert bias for selection only, groups ranked by
                  the sum of their top-2 biased scores, renormalise, x scaling
deepseek_v4       sqrtsoftplus, expert bias, top-k, renormalise, x scaling; the first
                  ``num_hash_layers`` MoE layers route by token id (``router_type="hash"``)
================  ====================================================================

``MoEConfig.source`` records where each number came from and what was not representable.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flexdispatch.config import MoEConfig, RouterConfig

__all__ = [
    "moe_config_from_hf",
    "moe_config_from_megatron",
    "to_yaml",
    "num_hash_layers",
    "hash_layer_router_config",
]

_GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}


def _read_hf(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise TypeError(
            f"config must be a dict, or the path of a config.json or of its directory, got "
            f"{type(config).__name__}"
        )
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist: pass a config.json or its folder")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _req(cfg: Mapping[str, Any], key: str, model_type: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{model_type} config lacks {key!r}: add it (see the model's config.json)")
    return cfg[key]


def _activation(cfg: Mapping[str, Any], model_type: str) -> str:
    act = cfg.get("hidden_act", "silu")
    if act not in _GATED_ACTIVATIONS:
        raise ValueError(
            f"{model_type} config has hidden_act={act!r}; the gated expert MLPs of the supported "
            f"models use {' or '.join(_GATED_ACTIVATIONS)} (SwiGLU)"
        )
    return _GATED_ACTIVATIONS[act]


def _aux(cfg: Mapping[str, Any], source: dict[str, str]) -> dict[str, Any]:
    """Map aux-loss coefficients (DeepSeek ``aux_loss_alpha``/``seq_aux``, HF
    ``router_aux_loss_coef``) when present and positive."""
    if cfg.get("aux_loss_alpha"):
        kind = "seq_aux_loss" if cfg.get("seq_aux") else "aux_loss"
        source["aux_loss"] = (
            f"aux_loss_alpha={cfg['aux_loss_alpha']}, seq_aux={bool(cfg.get('seq_aux'))} -> "
            f"{kind} (DeepSeek's sequence-wise loss is Megatron's formula per sequence)"
        )
        return {"aux_loss_type": kind, "aux_loss_coeff": float(cfg["aux_loss_alpha"])}
    if cfg.get("router_aux_loss_coef"):
        source["aux_loss"] = (
            f"router_aux_loss_coef={cfg['router_aux_loss_coef']} -> aux_loss with the same "
            f"coefficient; HF sums its switch loss over the k slots (k x Megatron's per-layer "
            f"value) over all layers' tokens at once, Megatron per layer"
        )
        return {"aux_loss_type": "aux_loss", "aux_loss_coeff": float(cfg["router_aux_loss_coef"])}
    return {}


def _groups(
    cfg: Mapping[str, Any], E: int, k: int, rule: str, source: dict[str, str]
) -> dict[str, Any]:
    """Group-limited routing from ``n_group``/``topk_group``; nothing when every group is kept."""
    G = cfg.get("n_group") or 1
    g = cfg.get("topk_group") or G
    if G <= 1 or g >= G:
        return {}
    if rule == "sum_top2" and k // g != 2:
        raise ValueError(
            f"noaux_tc ranks groups by the sum of their top-2 scores but Megatron's rule sums the "
            f"top num_experts_per_tok // topk_group = {k}//{g} = {k // g}: flexdispatch can "
            f"represent this model only when that quotient is 2"
        )
    per_node = E // G
    source["groups"] = f"{G} groups of {per_node} experts, {g} kept per token, ranked by " + (
        "the max score (group_limited_greedy)" if rule == "max" else "the sum of the top-2"
    )
    return {
        "num_groups": G,
        "group_topk": g,
        "group_score": "max" if rule == "max" else "sum_topk",
    }


def _shared(cfg: Mapping[str, Any], F: int, source: dict[str, str]) -> dict[str, Any]:
    n = int(cfg.get("n_shared_experts") or 0)
    if not n:
        return {}
    source["shared_experts"] = (
        f"{n} shared expert(s), one MLP of moe_intermediate_size x n_shared_experts = {F} x {n}"
        f" = {F * n} (as the reference code builds it)"
    )
    return {"num_shared_experts": n, "shared_expert_ffn_hidden_size": F * n}


def _deepseek(cfg: Mapping[str, Any], mt: str, source: dict[str, str]) -> dict[str, Any]:
    E = int(_req(cfg, "n_routed_experts", mt))
    k = int(_req(cfg, "num_experts_per_tok", mt))
    F = int(_req(cfg, "moe_intermediate_size", mt))
    scoring = cfg.get("scoring_func", "sqrtsoftplus" if mt == "deepseek_v4" else "softmax")
    # NOTE: DeepSeek-V4's config has no topk_method; its reference gate adds a selection-only
    # score bias, which is noaux_tc without groups.
    method = cfg.get("topk_method") or ("noaux_tc" if mt == "deepseek_v4" else "greedy")
    norm = bool(cfg.get("norm_topk_prob", False))
    scale = float(cfg.get("routed_scaling_factor", 1.0))
    if scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise ValueError(f"{mt} scoring_func={scoring!r} is not supported")
    router: dict[str, Any] = {"num_experts": E, "topk": k, "score_function": scoring}
    if method == "group_limited_greedy":
        router.update(_groups(cfg, E, k, "max", source))
    elif method == "noaux_tc":
        router.update(_groups(cfg, E, k, "sum_top2", source))
        if scoring == "softmax":
            raise ValueError(f"{mt} topk_method=noaux_tc with softmax scores is not supported")
        router["enable_expert_bias"] = True
    elif method != "greedy":
        raise ValueError(
            f"{mt} topk_method={method!r} is not supported: use greedy, group_limited_greedy or "
            f"noaux_tc"
        )
    if scoring == "softmax":
        router["use_pre_softmax"] = True  # softmax over all E, then top-k
    router["normalize_topk"] = norm
    if mt == "deepseek_v2" and norm and k > 1:
        # NOTE: DeepSeek-V2's reference code scales only the branch that does not renormalise.
        source["scaling"] = "norm_topk_prob=true: V2 code renormalises and does not scale"
    elif scale != 1.0:
        router["scaling_factor"] = scale
    router.update(_aux(cfg, source))
    source["routing"] = (
        f"topk_method={method}, scoring_func={scoring}, norm_topk_prob={str(norm).lower()}, "
        f"routed_scaling_factor={scale}"
    )
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        source["moe_layers"] = (
            f"num_hidden_layers={cfg.get('num_hidden_layers')}, first_k_dense_replace="
            f"{cfg.get('first_k_dense_replace', 0)}, moe_layer_freq={cfg.get('moe_layer_freq', 1)}"
        )
    if mt == "deepseek_v4":
        n_hash = int(cfg.get("num_hash_layers") or 0)
        source["num_hash_layers"] = str(n_hash)
        if n_hash:
            source["hash_layers"] = (
                f"the first {n_hash} MoE layers pick experts from a per-token-id table "
                f"(tid2eid, stored with the checkpoint) instead of the gate, with weights = the "
                f"gate's sqrtsoftplus scores there, renormalised, x scaling; see "
                f"hash_layer_router_config (pass the checkpoint table to hash_routing(table=) "
                f"to match its experts exactly)"
            )
    out: dict[str, Any] = {
        "hidden_size": int(_req(cfg, "hidden_size", mt)),
        "ffn_hidden_size": F,
        "activation": _activation(cfg, mt),
        "router": router,
    }
    out.update(_shared(cfg, F, source))
    return out


def _mixtral(cfg: Mapping[str, Any], mt: str, source: dict[str, str]) -> dict[str, Any]:
    router: dict[str, Any] = {
        "num_experts": int(_req(cfg, "num_local_experts", mt)),
        "topk": int(_req(cfg, "num_experts_per_tok", mt)),
        "score_function": "softmax",
    }
    router.update(_aux(cfg, source))
    source["routing"] = "softmax over all experts, top-k, renormalise = post-softmax top-k"
    return {
        "hidden_size": int(_req(cfg, "hidden_size", mt)),
        "ffn_hidden_size": int(_req(cfg, "intermediate_size", mt)),
        "activation": _activation(cfg, mt),
        "router": router,
    }


def _qwen3(cfg: Mapping[str, Any], mt: str, source: dict[str, str]) -> dict[str, Any]:
    norm = bool(cfg.get("norm_topk_prob", False))
    router: dict[str, Any] = {
        "num_experts": int(_req(cfg, "num_experts", mt)),
        "topk": int(_req(cfg, "num_experts_per_tok", mt)),
        "score_function": "softmax",
    }
    if not norm:
        router.update(use_pre_softmax=True, normalize_topk=False)
    router.update(_aux(cfg, source))
    source["routing"] = (
        "softmax over all experts, top-k, renormalise (norm_topk_prob=true) = post-softmax top-k"
        if norm
        else "softmax over all experts, top-k, no renormalisation = pre-softmax top-k"
    )
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        source["moe_layers"] = (
            f"decoder_sparse_step={cfg.get('decoder_sparse_step', 1)}, "
            f"mlp_only_layers={cfg.get('mlp_only_layers')}"
        )
    return {
        "hidden_size": int(_req(cfg, "hidden_size", mt)),
        "ffn_hidden_size": int(_req(cfg, "moe_intermediate_size", mt)),
        "activation": _activation(cfg, mt),
        "router": router,
    }


_HF_FAMILIES: dict[str, Callable[[Mapping[str, Any], str, dict[str, str]], dict[str, Any]]] = {
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v4": _deepseek,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3,
}


def moe_config_from_hf(
    config: Mapping[str, Any] | str | Path, *, name: str | None = None
) -> MoEConfig:
    """One MoE layer of a published Hugging Face model, routed as its reference code routes it.

    Args:
        config: the parsed ``config.json``, its path, or the folder that holds it.
        name: ``MoEConfig.name``; default: the ``model_type``.

    Returns:
        A validated ``MoEConfig`` (dispatch settings left at their defaults); ``source`` holds
        ``hf_model_type``, ``hf_architectures``, ``routing`` and, as applicable, ``groups``,
        ``shared_experts``, ``aux_loss``, ``moe_layers``, ``scaling``, ``num_hash_layers``.

    Raises:
        ValueError: unknown ``model_type`` (the message lists the supported ones), a missing
            field, or routing flexdispatch cannot represent.
        TypeError: ``config`` is neither a mapping nor a path.
    """
    cfg = _read_hf(config)
    mt = cfg.get("model_type")
    if mt not in _HF_FAMILIES:
        raise ValueError(
            f"unsupported model_type {mt!r}: supported are {', '.join(sorted(_HF_FAMILIES))}"
        )
    source: dict[str, str] = {"hf_model_type": mt}
    if cfg.get("architectures"):
        source["hf_architectures"] = ",".join(cfg["architectures"])
    data = _HF_FAMILIES[mt](cfg, mt, source)
    data["name"] = name or mt
    data["source"] = dict(sorted(source.items()))
    try:
        return MoEConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{mt} config maps to an invalid MoEConfig:\n{exc}") from exc


def num_hash_layers(cfg: MoEConfig) -> int:
    """Number of leading MoE layers that route by token-id hash (DeepSeek-V4), else 0."""
    return int(cfg.source.get("num_hash_layers", "0"))


def hash_layer_router_config(cfg: MoEConfig) -> RouterConfig:
    """The router of a hash layer of ``cfg``: same E, k, score function, normalisation and
    scaling, with ``router_type="hash"``, no expert bias and no groups.

    Raises:
        ValueError: ``cfg`` has no hash layers (``num_hash_layers(cfg) == 0``).
    """
    if num_hash_layers(cfg) == 0:
        raise ValueError(
            f"config {cfg.name!r} has no hash-routed layers (source['num_hash_layers'] is unset "
            f"or 0): only DeepSeek-V4-style configs have them"
        )
    data = cfg.router.model_dump()
    data.update(
        router_type="hash",
        enable_expert_bias=False,
        num_groups=None,
        group_topk=None,
        capacity_factor=None,
    )
    return RouterConfig.model_validate(data)


# Megatron-Core argument -> RouterConfig field (values copied as they are).
_MEGATRON_ROUTER = {
    "num_moe_experts": "num_experts",
    "moe_router_topk": "topk",
    "moe_router_score_function": "score_function",
    "moe_router_pre_softmax": "use_pre_softmax",
    "moe_router_num_groups": "num_groups",
    "moe_router_group_topk": "group_topk",
    "moe_router_topk_scaling_factor": "scaling_factor",
    "moe_router_enable_expert_bias": "enable_expert_bias",
    "moe_router_bias_update_rate": "bias_update_rate",
    "moe_expert_capacity_factor": "capacity_factor",
    "moe_token_drop_policy": "drop_policy",
}
_MEGATRON_OTHER = {
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_dtype",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
}


def _one_coeff(name: str, value: Any) -> float:
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{name}={value!r}: give one coefficient (one load-balancing type)")
        value = value[0]
    return float(value or 0.0)


def moe_config_from_megatron(args: Mapping[str, Any], *, name: str = "megatron") -> MoEConfig:
    """A ``MoEConfig`` from Megatron-Core argument names (``vars(args)`` of a training run).

    Uses ``num_moe_experts``, ``moe_router_topk``, ``moe_router_score_function``,
    ``moe_router_pre_softmax``, ``moe_router_num_groups``, ``moe_router_group_topk``,
    ``moe_router_topk_scaling_factor``, ``moe_router_enable_expert_bias``,
    ``moe_router_bias_update_rate``, ``moe_expert_capacity_factor``, ``moe_token_drop_policy``,
    ``moe_router_load_balancing_type``, ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``,
    ``moe_router_dtype``, ``moe_shared_expert_intermediate_size``, ``hidden_size``,
    ``moe_ffn_hidden_size`` (else ``ffn_hidden_size``) and ``swiglu`` (False: gelu; absent:
    swiglu, as in every published MoE, although Megatron's flag defaults to False). Other
    non-``moe_`` keys are ignored; ``None`` means Megatron's default. Group scores use Megatron's
    sum rule.

    Raises:
        ValueError: an unknown ``moe_*`` key (all listed), a missing ``num_moe_experts`` or
            ``hidden_size``, an unsupported load-balancing type, or an invalid combination.
    """
    if not isinstance(args, Mapping):
        raise TypeError(f"args must be a mapping of Megatron argument names, got {type(args)}")
    unknown = sorted(
        key
        for key in args
        if key.startswith("moe_") and key not in _MEGATRON_ROUTER and key not in _MEGATRON_OTHER
    )
    if unknown:
        raise ValueError(
            f"unknown Megatron MoE argument(s) {', '.join(unknown)}: supported are "
            f"{', '.join(sorted([*_MEGATRON_ROUTER, *_MEGATRON_OTHER]))}"
        )
    for key in ("num_moe_experts", "hidden_size"):
        if args.get(key) is None:
            raise ValueError(f"Megatron args lack {key!r}: it is required")
    router: dict[str, Any] = {
        field: args[key] for key, field in _MEGATRON_ROUTER.items() if args.get(key) is not None
    }
    router.setdefault("topk", 2)  # Megatron's default moe_router_topk
    lb = args.get("moe_router_load_balancing_type") or "aux_loss"
    if isinstance(lb, (list, tuple)):
        if len(lb) != 1:
            raise ValueError(f"moe_router_load_balancing_type={lb!r}: give one type")
        lb = lb[0]
    coeff = _one_coeff("moe_aux_loss_coeff", args.get("moe_aux_loss_coeff"))
    if lb not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        raise ValueError(
            f"moe_router_load_balancing_type={lb!r} is not supported: use aux_loss, "
            f"seq_aux_loss, global_aux_loss or none"
        )
    if lb != "none" and coeff > 0:
        router.update(aux_loss_type=lb, aux_loss_coeff=coeff)
    z = _one_coeff("moe_z_loss_coeff", args.get("moe_z_loss_coeff"))
    if z > 0:
        router["z_loss_coeff"] = z
    if args.get("moe_router_dtype") is not None:
        router["router_dtype"] = args["moe_router_dtype"]
    ffn = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
    if ffn is None:
        raise ValueError("Megatron args lack moe_ffn_hidden_size (and ffn_hidden_size)")
    data: dict[str, Any] = {
        "name": name,
        "hidden_size": args["hidden_size"],
        "ffn_hidden_size": ffn,
        "activation": "swiglu" if args.get("swiglu", True) else "gelu",
        "router": router,
        "source": {"importer": "moe_config_from_megatron", "load_balancing_type": str(lb)},
    }
    shared = args.get("moe_shared_expert_intermediate_size")
    if shared:
        data.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared)
        data["source"]["shared_experts"] = (
            f"moe_shared_expert_intermediate_size={shared}: one shared MLP of that size"
        )
    try:
        return MoEConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"Megatron args map to an invalid MoEConfig:\n{exc}") from exc


def to_yaml(cfg: MoEConfig) -> str:
    """Every field of ``cfg`` as YAML that ``load_config`` reads back to an equal config."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, width=100)
