"""Build ``MoEConfig`` from published model configs: Hugging Face ``config.json`` and Megatron-Core
arguments.

E experts · k top-k · H hidden size · F expert MLP hidden size.

Each Hugging Face family is mapped to the routing its reference code runs (REFERENCE_FACTS.md,
"Routing as published models define it"):

==================  ==================================================================
model_type          routing (transformers 5.23 modeling code)
==================  ==================================================================
mixtral, granitemoe softmax over E, top-k, renormalise = Megatron post-softmax top-k
qwen3_moe, olmoe    as Mixtral when ``norm_topk_prob``; else softmax over E (pre), no renorm
qwen2_moe,          as qwen3_moe, plus one shared expert scaled by sigmoid(Linear(H, 1))
qwen3_next
qwen3_5_moe,        (``text_config``) softmax, top-k, always renormalised; Qwen3.5 adds the
qwen3_vl_moe        gated shared expert
deepseek_v2         softmax over E (pre); ``group_limited_greedy``: groups ranked by their
                    max score; renormalise only when ``norm_topk_prob`` (then no scaling),
                    else x ``routed_scaling_factor``
deepseek            DeepSeek-MoE 16B (remote code): softmax over E, top-k, renormalise when
                    ``norm_topk_prob``, no scaling; shared experts
deepseek_v3,        ``noaux_tc``: sigmoid, expert bias for selection only, groups ranked by
kimi_k2, kimi_k25,  the sum of their top-2 biased scores, renormalise when
deepseek_v32,       ``norm_topk_prob``, x scaling; shared experts
glm4_moe(_lite),
glm_moe_dsa, dots1,
nemotron_h          (nemotron_h: non-gated relu2 experts, one shared MLP)
deepseek_v4         sqrtsoftplus, expert bias, top-k, renormalise, x scaling, clamped SwiGLU;
                    the first ``num_hash_layers`` MoE layers route by token id
minimax_m2          sigmoid, expert bias for selection, renormalise, no scaling
gpt_oss             Linear(H, E) with bias, top-k of the logits, softmax over the k;
                    gpt-oss's clamped GLU experts with biases
llama4              (``text_config``) top-1 of the logits, sigmoid weight multiplied into
                    the expert input, one ungated shared expert
==================  ==================================================================

Keys a config lacks take the defaults of the family's transformers config class (listed in
``source["defaulted"]``); a key of the wrong type is refused naming it. Families whose routing
flexdispatch cannot express (ernie4_5_moe, phimoe, longcat_flash) are refused with the reason.

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
    "supported_model_types",
    "to_yaml",
    "num_hash_layers",
    "hash_layer_router_config",
]

_GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}

# Defaults of the transformers config classes (transformers 5.23.0, ``configuration_<type>.py``)
# for the keys the importer reads; a key absent from a config.json takes this value and is listed
# in ``source["defaulted"]``. ``None`` marks a key without a default (the import then fails).
# ``scoring_func``/``topk_method`` are not attributes of the V3-style classes: their modeling code
# always runs sigmoid + selection bias (noaux_tc), so those are the defaults.
_V3_DEFAULTS: dict[str, Any] = {
    "hidden_size": 7168,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        "hidden_size": 4096,
        "moe_intermediate_size": 1407,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": None,
        "n_group": None,
        "topk_group": None,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
        "hidden_act": "silu",
    },
    "deepseek_v3": _V3_DEFAULTS,
    # Kimi-K2 ships model_type kimi_k2 with DeepSeek-V3's architecture (transformers' Kimi-K2.5
    # config maps a kimi_k2 text config onto deepseek_v3), so it takes V3's defaults.
    "kimi_k2": _V3_DEFAULTS,
    "deepseek_v32": _V3_DEFAULTS,
    "glm_moe_dsa": {
        **_V3_DEFAULTS,
        "hidden_size": 6144,
        "n_group": 1,
        "topk_group": 1,
    },
    "glm4_moe": {
        **_V3_DEFAULTS,
        "hidden_size": 4096,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
    },
    "deepseek_v4": {
        "hidden_size": 4096,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_hash_layers": 3,
        "hidden_act": "silu",
    },
    # DeepSeek-MoE 16B (remote code, model_type "deepseek"; not in transformers): the defaults
    # of its DeepseekConfig. E, k and the expert size have none there.
    "deepseek": {
        "hidden_size": 4096,
        "moe_intermediate_size": 1407,
        "n_routed_experts": None,
        "n_shared_experts": 0,
        "num_experts_per_tok": None,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "first_k_dense_replace": 0,
        "hidden_act": "silu",
    },
    "dots1": {
        **_V3_DEFAULTS,
        "hidden_size": 4608,
        "moe_intermediate_size": 1408,
        "n_routed_experts": None,
        "n_shared_experts": None,
        "num_experts_per_tok": None,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    },
    "glm4_moe_lite": {
        **_V3_DEFAULTS,
        "hidden_size": 2048,
        "moe_intermediate_size": 1536,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "first_k_dense_replace": None,
    },
    "olmoe": {
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "hidden_act": "silu",
    },
    "qwen3_vl_moe_text": {
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
    },
    "granitemoe": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
    },
    "mixtral": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,
        "hidden_act": "silu",
    },
    "qwen3_moe": {
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
    },
    "qwen2_moe": {
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
    },
    "qwen3_next": {
        "hidden_size": 2048,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
    },
    "qwen3_5_moe_text": {
        "hidden_size": 2048,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "hidden_act": "silu",
    },
    "llama4_text": {
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "hidden_act": "silu",
    },
    "minimax_m2": {
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "router_jitter_noise": 0.0,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "hidden_act": "silu",
    },
    "gpt_oss": {
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "hidden_act": "silu",
    },
    "nemotron_h": {
        "hidden_size": 4096,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 7688,
        "moe_shared_expert_intermediate_size": 7688,
        "moe_latent_size": None,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "mlp_hidden_act": "relu2",
    },
}


# Alternative spellings of a key (the config class's ``attribute_map``, both ways): transformers
# 5.x saves e.g. a Qwen3-MoE config's ``num_experts`` as ``num_local_experts``.
def _both_ways(**pairs: str) -> dict[str, str]:
    return {**pairs, **{v: k for k, v in pairs.items()}}


_LOCAL = _both_ways(num_local_experts="num_experts")
_ROUTED = _both_ways(n_routed_experts="num_local_experts")
_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": _LOCAL,
    "qwen3_moe": _LOCAL,
    "minimax_m2": _LOCAL,
    "gpt_oss": _LOCAL,
    "deepseek_v2": _both_ways(n_routed_experts="num_experts"),
    "deepseek_v3": _ROUTED,
    "kimi_k2": _ROUTED,
    "deepseek_v32": _ROUTED,
    "glm4_moe": _ROUTED,
    "glm_moe_dsa": _ROUTED,
    "nemotron_h": _ROUTED,
    "dots1": _ROUTED,
    "glm4_moe_lite": _ROUTED,
    "olmoe": _LOCAL,
    "qwen3_vl_moe_text": _LOCAL,
    "deepseek_v4": {**_ROUTED, **_both_ways(moe_intermediate_size="intermediate_size")},
}

# Keys that are not attributes of the family's config class: the modeling code hard-codes them,
# and the default is what it runs.
_V3_FIXED = frozenset({"topk_method", "scoring_func"})
_FIXED_IN_MODELING: dict[str, frozenset[str]] = {
    "deepseek_v2": frozenset({"scoring_func"}),
    "deepseek_v3": _V3_FIXED,
    "kimi_k2": _V3_FIXED,
    "deepseek_v32": _V3_FIXED,
    "glm_moe_dsa": _V3_FIXED,
    "glm4_moe": _V3_FIXED,
    "glm4_moe_lite": _V3_FIXED,
    "dots1": _V3_FIXED,
    "deepseek_v4": frozenset({"topk_method"}),
    "minimax_m2": frozenset({"scoring_func", "use_routing_bias"}),
}

_DEFAULTS_FROM = {
    "kimi_k2": "the transformers deepseek_v3 config class (Kimi-K2 is DeepSeek-V3's architecture)",
    "deepseek": "DeepSeek-MoE's own DeepseekConfig (remote code; no transformers class)",
}

# Composite (multimodal) configs whose MoE text model is the ``text_config`` mapping, with the
# text model_type the config class assumes when ``text_config`` carries none.
_NESTED = {
    "kimi_k25": "deepseek_v3",
    "llama4": "llama4_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
}


class _Keys:
    """Typed reads of one config mapping; absent keys take the family's defaults (recorded)."""

    def __init__(self, cfg: Mapping[str, Any], mt: str, prefix: str = "") -> None:
        self.cfg, self.mt, self.prefix = cfg, mt, prefix
        self.defaults = _DEFAULTS.get(mt, {})
        self.defaulted: list[str] = []

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def raw(self, key: str) -> Any:
        alias = _ALIASES.get(self.mt, {}).get(key)
        here = key in self.cfg and self.cfg[key] is not None
        if alias is not None and alias in self.cfg and self.cfg[alias] is not None:
            if here and self.cfg[key] != self.cfg[alias]:
                raise ValueError(
                    f"{self.mt} config has {self.name(key)}={self.cfg[key]!r} and its alias "
                    f"{self.name(alias)}={self.cfg[alias]!r}: they must agree"
                )
            if not here:
                return self.cfg[alias]
        if here:
            return self.cfg[key]
        if self.defaults.get(key) is not None:
            value = self.defaults[key]
            fixed = key in _FIXED_IN_MODELING.get(self.mt, ())
            note = " (fixed by the modeling code)" if fixed else ""
            self.defaulted.append(f"{self.name(key)}={json.dumps(value)}{note}")
            return value
        raise ValueError(
            f"{self.mt} config lacks {self.name(key)!r} and the architecture has no default "
            f"for it: add it (see the model's config.json)"
        )

    def has(self, key: str) -> bool:
        alias = _ALIASES.get(self.mt, {}).get(key)
        return any(
            name in self.cfg and self.cfg[name] is not None for name in (key, alias) if name
        ) or (self.defaults.get(key) is not None)

    def int(self, key: str) -> int:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{self.mt} config: {self.name(key)} must be an integer, got {value!r} "
                f"({type(value).__name__})"
            )
        return value

    def opt_int(self, key: str) -> int | None:
        return self.int(key) if self.has(key) else None

    def float(self, key: str) -> float:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"{self.mt} config: {self.name(key)} must be a number, got {value!r} "
                f"({type(value).__name__})"
            )
        return float(value)

    def bool(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise ValueError(
                f"{self.mt} config: {self.name(key)} must be true or false, got {value!r} "
                f"({type(value).__name__})"
            )
        return value

    def str(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise ValueError(
                f"{self.mt} config: {self.name(key)} must be a string, got {value!r} "
                f"({type(value).__name__})"
            )
        return value


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


def _activation(k: _Keys) -> str:
    act = k.str("hidden_act")
    if act not in _GATED_ACTIVATIONS:
        raise ValueError(
            f"{k.mt} config has {k.name('hidden_act')}={act!r}; the gated expert MLPs of this "
            f"family use {' or '.join(_GATED_ACTIVATIONS)} (SwiGLU)"
        )
    return _GATED_ACTIVATIONS[act]


def _aux(cfg: Mapping[str, Any], source: dict[str, str]) -> dict[str, Any]:
    """Map aux-loss coefficients (DeepSeek ``aux_loss_alpha``/``seq_aux``, HF
    ``router_aux_loss_coef``) when present and positive (never defaulted: the transformers
    models add the loss only when asked to, ``output_router_logits``)."""
    for key in ("aux_loss_alpha", "router_aux_loss_coef"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{key} must be a number, got {value!r} ({type(value).__name__})")
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


def _groups(k: _Keys, E: int, topk: int, rule: str, source: dict[str, str]) -> dict[str, Any]:
    """Group-limited routing from ``n_group``/``topk_group``; nothing when every group is kept."""
    G = k.opt_int("n_group") or 1
    g = k.opt_int("topk_group") or G
    if G <= 1 or g >= G:
        return {}
    if E % G:
        raise ValueError(f"{k.mt}: {E} experts do not split into n_group={G} groups")
    if rule == "sum_top2" and topk // g != 2:
        raise ValueError(
            f"{k.mt} ranks groups by the sum of their top-2 scores but Megatron's rule sums the "
            f"top num_experts_per_tok // topk_group = {topk}//{g} = {topk // g}: flexdispatch "
            f"can represent this model only when that quotient is 2"
        )
    per_node = E // G
    source["groups"] = f"{G} groups of {per_node} experts, {g} kept per token, ranked by " + (
        "the max score (group_limited_greedy)" if rule == "max" else "the sum of the top-2"
    )
    return {"num_groups": G, "group_topk": g, "group_score": "max" if rule == "max" else "sum_topk"}


def _shared(k: _Keys, F: int, source: dict[str, str]) -> dict[str, Any]:
    n = k.int("n_shared_experts") if k.has("n_shared_experts") else 0
    if not n:
        return {}
    source["shared_experts"] = (
        f"{n} shared expert(s), one MLP of moe_intermediate_size x n_shared_experts = {F} x {n}"
        f" = {F * n} (as the reference code builds it)"
    )
    return {"num_shared_experts": n, "shared_expert_ffn_hidden_size": F * n}


def _layer_pattern(cfg: Mapping[str, Any], keys: tuple[str, ...], source: dict[str, str]) -> None:
    """Record the dense/MoE layer pattern keys that are present (importer metadata)."""
    found = {key: cfg[key] for key in ("num_hidden_layers", *keys) if key in cfg}
    if any(key in cfg for key in keys):
        source["moe_layers"] = ", ".join(f"{key}={json.dumps(v)}" for key, v in found.items())


def _deepseek(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    """The DeepSeek gate family: V2 (softmax, optional max-groups), V3 and its relatives
    (sigmoid, selection bias, top-2-sum groups), V4 (sqrtsoftplus, hash layers), DeepSeek-MoE."""
    mt = k.mt
    E = k.int("n_routed_experts")
    topk = k.int("num_experts_per_tok")
    F = k.int("moe_intermediate_size")
    scoring = k.str("scoring_func")
    method = k.str("topk_method")
    norm = k.bool("norm_topk_prob")
    scale = k.float("routed_scaling_factor") if mt != "deepseek" else 1.0
    if scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise ValueError(f"{mt} scoring_func={scoring!r} is not supported")
    router: dict[str, Any] = {"num_experts": E, "topk": topk, "score_function": scoring}
    if method == "group_limited_greedy":
        router.update(_groups(k, E, topk, "max", source))
    elif method == "noaux_tc":
        router.update(_groups(k, E, topk, "sum_top2", source))
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
    if mt == "deepseek_v2" and norm and topk > 1:
        # NOTE: DeepSeek-V2's reference code scales only the branch that does not renormalise.
        source["scaling"] = (
            "norm_topk_prob=true: V2 code renormalises and does not scale (DeepSeek's own "
            "modeling code; transformers 5.23's DeepseekV2 gate ignores norm_topk_prob and "
            "always scales - every published V2 config has norm_topk_prob=false, where both agree)"
        )
    elif scale != 1.0:
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
        if not norm:
            raise ValueError(
                "deepseek_v4 norm_topk_prob=false: the transformers DeepSeek-V4 gate always "
                "renormalises the k weights, so this config does not describe that model"
            )
        n_shared = k.int("n_shared_experts")
        if n_shared != 1:
            raise ValueError(
                f"deepseek_v4 n_shared_experts={n_shared}: the transformers DeepSeek-V4 block "
                f"always builds exactly one shared MLP of moe_intermediate_size"
            )
    out.update(_shared(k, F, source))
    return out


def _softmax_router(
    k: _Keys, E: int, topk: int, norm: bool, source: dict[str, str]
) -> dict[str, Any]:
    """Softmax over all E, top-k, renormalised or not (Mixtral / Qwen gates)."""
    router: dict[str, Any] = {"num_experts": E, "topk": topk, "score_function": "softmax"}
    if not norm:
        router.update(use_pre_softmax=True, normalize_topk=False)
    source["routing"] = (
        "softmax over all experts, top-k, renormalise = post-softmax top-k"
        if norm
        else "softmax over all experts, top-k, no renormalisation = pre-softmax top-k"
    )
    return router


def _no_jitter(k: _Keys) -> None:
    if k.has("router_jitter_noise") and k.float("router_jitter_noise") > 0:
        raise ValueError(
            f"{k.mt} config has router_jitter_noise={k.cfg['router_jitter_noise']}: the training-"
            f"time multiplicative noise on the router input is not supported by flexdispatch"
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
    # Qwen3.5-MoE's and Qwen3-VL-MoE's gates always renormalise (no norm_topk_prob in their
    # config classes).
    always = k.mt in ("qwen3_5_moe_text", "qwen3_vl_moe_text")
    norm = True if always else k.bool("norm_topk_prob")
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
    scoring = k.str("scoring_func")
    if scoring != "sigmoid":
        raise ValueError(f"minimax_m2 scoring_func={scoring!r}: its gate computes sigmoid scores")
    if not k.bool("use_routing_bias"):
        raise ValueError(
            "minimax_m2 use_routing_bias=false: the transformers gate always adds its "
            "e_score_correction_bias, a config without it is not the published architecture"
        )
    if cfg.get("shared_intermediate_size"):
        raise ValueError(
            f"minimax_m2 shared_intermediate_size={cfg['shared_intermediate_size']}: the "
            f"transformers MiniMax-M2 block has no shared expert"
        )
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
            f"gpt_oss config: experts_per_token={cfg['experts_per_token']!r} differs from "
            f"num_experts_per_tok={topk}"
        )
    act = k.str("hidden_act")
    if act != "silu":
        raise ValueError(f"gpt_oss hidden_act={act!r}: its experts run the clamped SwiGLU")
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


def _v3_style(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    """DeepSeek-V3 relatives without ``topk_method``/``scoring_func`` (their gate is fixed)."""
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if key in cfg and cfg[key] not in (None, want):
            raise ValueError(
                f"{k.mt} config has {k.name(key)}={cfg[key]!r}, but its transformers gate "
                f"always runs {want}"
            )
    return _deepseek(cfg, k, source)


def _nemotron_h(cfg: Mapping[str, Any], k: _Keys, source: dict[str, str]) -> dict[str, Any]:
    if k.has("moe_latent_size"):
        raise ValueError(
            f"nemotron_h moe_latent_size={k.cfg['moe_latent_size']}: its experts run in a "
            f"projected latent space, which flexdispatch cannot express"
        )
    act = k.str("mlp_hidden_act")
    if act != "relu2":
        raise ValueError(f"nemotron_h mlp_hidden_act={act!r}: supported is relu2 (non-gated)")
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
    n = k.int("n_shared_experts")
    if n > 1:
        raise ValueError(
            f"nemotron_h n_shared_experts={n}: its block builds one shared MLP of "
            f"moe_shared_expert_intermediate_size, whatever n_shared_experts says"
        )
    # NOTE: the transformers block builds the shared MLP whatever n_shared_experts is.
    S = k.int("moe_shared_expert_intermediate_size")
    out.update(num_shared_experts=1, shared_expert_ffn_hidden_size=S)
    source["shared_experts"] = (
        f"one relu2 shared MLP of moe_shared_expert_intermediate_size={S} (the block always "
        f"builds it; n_shared_experts={n})"
    )
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type")
    if pattern is not None:
        source["moe_layers"] = f"layer pattern (E = MoE): {json.dumps(pattern)}"
    return out


_Family = Callable[[Mapping[str, Any], _Keys, dict[str, str]], dict[str, Any]]
_HF_FAMILIES: dict[str, _Family] = {
    "deepseek": _deepseek,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v4": _deepseek,
    "kimi_k2": _deepseek,
    "deepseek_v32": _v3_style,
    "glm4_moe": _v3_style,
    "glm_moe_dsa": _v3_style,
    "glm4_moe_lite": _v3_style,
    "dots1": _v3_style,
    "mixtral": _mixtral,
    "granitemoe": _mixtral,
    "olmoe": _qwen,
    "qwen3_vl_moe_text": _qwen,
    "qwen3_moe": _qwen,
    "qwen2_moe": _qwen,
    "qwen3_next": _qwen,
    "qwen3_5_moe_text": _qwen,
    "llama4_text": _llama4,
    "minimax_m2": _minimax_m2,
    "gpt_oss": _gpt_oss,
    "nemotron_h": _nemotron_h,
}


# MoE families whose routing or experts flexdispatch cannot express, with the reason (read from
# their transformers modeling code); refused instead of approximated.
_REFUSED = {
    "ernie4_5_moe": "its gate adds a selection bias to softmax scores and renormalises with a "
    "floor (moe_norm_min); flexdispatch's expert bias applies to sigmoid/sqrtsoftplus scores",
    "phimoe": "it routes with SparseMixer (masked, jittered top-2 sampling), not a top-k rule",
    "longcat_flash": "it mixes zero-computation (identity) experts into the top-k",
}


def supported_model_types() -> list[str]:
    """The Hugging Face ``model_type`` values ``moe_config_from_hf`` imports."""
    return sorted({*_HF_FAMILIES, *_NESTED})


def moe_config_from_hf(
    config: Mapping[str, Any] | str | Path, *, name: str | None = None
) -> MoEConfig:
    """One MoE layer of a published Hugging Face model, routed as its reference code routes it.

    Keys the config lacks take the defaults of the family's transformers config class; they are
    listed in ``source["defaulted"]``. Composite configs (``kimi_k25``, ``llama4``,
    ``qwen3_5_moe``) are read from their ``text_config``.

    Args:
        config: the parsed ``config.json``, its path, or the folder that holds it.
        name: ``MoEConfig.name``; default: the (top-level) ``model_type``.

    Returns:
        A validated ``MoEConfig`` (dispatch settings left at their defaults); ``source`` holds
        ``hf_model_type``, ``hf_architectures``, ``routing`` and, as applicable, ``groups``,
        ``shared_experts``, ``aux_loss``, ``moe_layers``, ``scaling``, ``num_hash_layers``,
        ``hf_text_model_type``, ``defaulted``.

    Raises:
        ValueError: unknown ``model_type`` (the message lists the supported ones), a missing
            field without a default, a field of the wrong type (named), or routing flexdispatch
            cannot represent.
        TypeError: ``config`` is neither a mapping nor a path.
    """
    top = _read_hf(config)
    mt = top.get("model_type")
    if mt in _REFUSED:
        raise ValueError(f"model_type {mt!r} cannot be imported exactly: {_REFUSED[mt]}")
    if not isinstance(mt, str) or (mt not in _HF_FAMILIES and mt not in _NESTED):
        raise ValueError(
            f"unsupported model_type {mt!r}: supported are {', '.join(supported_model_types())}"
        )
    source: dict[str, str] = {"hf_model_type": mt}
    archs = top.get("architectures")
    if archs:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"architectures must be a list of strings, got {archs!r}")
        source["hf_architectures"] = ",".join(archs)
    cfg, prefix, inner = top, "", mt
    if mt in _NESTED:
        text = top.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, Mapping):
            raise ValueError(f"{mt} config: text_config must be an object, got {text!r}")
        inner = text.get("model_type") or _NESTED[mt]
        if mt == "kimi_k25" and inner == "kimi_k2":
            inner = "deepseek_v3"  # as transformers' Kimi-K2.5 config maps it
        if inner != _NESTED[mt]:
            raise ValueError(
                f"{mt} config: text_config model_type {inner!r} is not supported: a {mt} text "
                f"model is {_NESTED[mt]!r}"
            )
        cfg, prefix = text, "text_config."
        source["hf_text_model_type"] = inner
    keys = _Keys(cfg, inner, prefix)
    data = _HF_FAMILIES[inner](cfg, keys, source)
    if keys.defaulted:
        origin = _DEFAULTS_FROM.get(inner, f"the transformers {inner} config class")
        source["defaulted"] = f"absent, taken from {origin}: " + ", ".join(
            dict.fromkeys(keys.defaulted)
        )
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
