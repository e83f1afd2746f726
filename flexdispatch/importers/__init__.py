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

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import excerpt
from flexdispatch._checks.values import show
from flexdispatch.config import MoEConfig, RouterConfig, invalid_config
from flexdispatch.importers._keys import _DEFAULTS_FROM, _NESTED, _Keys, _read_hf
from flexdispatch.importers.deepseek import _deepseek, _nemotron_h, _v3_style
from flexdispatch.importers.megatron import moe_config_from_megatron
from flexdispatch.importers.softmax import _gpt_oss, _llama4, _minimax_m2, _mixtral, _qwen

__all__ = [
    "moe_config_from_hf",
    "moe_config_from_megatron",
    "supported_model_types",
    "to_yaml",
    "num_hash_layers",
    "hash_layer_router_config",
]

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


_SEE_SUPPORTED = "see flexdispatch config --help for the supported model types"


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
    if not isinstance(mt, str):
        raise InputError(
            f"model_type must be a string, got {show(mt)}: supported are "
            f"{', '.join(supported_model_types())}",
            problem=f"model_type must be a string, got {show(mt)}",
            fix=_SEE_SUPPORTED,
        )
    if mt in _REFUSED:
        raise ValueError(f"model_type {mt!r} cannot be imported exactly: {_REFUSED[mt]}")
    if mt not in _HF_FAMILIES and mt not in _NESTED:
        raise InputError(
            f"unsupported model_type {excerpt(mt)}: supported are "
            f"{', '.join(supported_model_types())}",
            problem=f"model_type {excerpt(mt)} is not supported",
            fix=_SEE_SUPPORTED,
        )
    source: dict[str, str] = {"hf_model_type": mt}
    archs = top.get("architectures")
    if archs:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"architectures must be a list of strings, got {show(archs)}")
        source["hf_architectures"] = ",".join(archs)
    cfg, prefix, inner = top, "", mt
    if mt in _NESTED:
        text = top.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, Mapping):
            raise ValueError(f"{mt} config: text_config must be an object, got {show(text)}")
        inner = text.get("model_type") or _NESTED[mt]
        if mt == "kimi_k25" and inner == "kimi_k2":
            inner = "deepseek_v3"  # as transformers' Kimi-K2.5 config maps it
        if inner != _NESTED[mt]:
            raise ValueError(
                f"{mt} config: text_config model_type {excerpt(inner)} is not supported: a "
                f"{mt} text model is {_NESTED[mt]!r}"
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
        raise invalid_config(exc, f"{mt} config maps to an invalid MoEConfig") from None


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


def to_yaml(cfg: MoEConfig) -> str:
    """Every field of ``cfg`` as YAML that ``load_config`` reads back to an equal config."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, width=100)
