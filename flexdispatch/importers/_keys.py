"""What every Hugging Face family importer shares: the transformers config classes' defaults,
key aliases, typed reads of a config mapping (``_Keys``), and the router / aux-loss / groups /
shared-expert pieces (``flexdispatch.importers`` has the family table)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexdispatch._checks.config_text import read_config_file
from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import excerpt, file_error
from flexdispatch._checks.values import finite, integer, show

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

# Keys a family's transformers router and MoE block never read (transformers 5.23.0, read from
# ``modeling_<type>.py``), with what they run whatever a config says: the import is the one the
# model runs, a config's other value is listed in ``source["ignored"]`` (never refused, never a
# change to the import). DeepSeek-V3's gate and its relatives' always score with sigmoid and pick
# with ``e_score_correction_bias`` by groups; DeepSeek-V4's gate has no group stage at all.
_V3_RUNS = {
    "topk_method": ("noaux_tc", "sigmoid + e_score_correction_bias by groups"),
    "scoring_func": ("sigmoid", "sigmoid scores"),
}
_RENORMALISES = {"norm_topk_prob": (True, "always renormalises the k weights")}
_NOT_READ: dict[str, dict[str, tuple[Any, str]]] = {
    "deepseek_v2": {
        "scoring_func": ("softmax", "softmax scores"),
        "norm_topk_prob": (False, "scales by routed_scaling_factor, never renormalises"),
    },
    "deepseek_v3": _V3_RUNS,
    "kimi_k2": _V3_RUNS,
    "deepseek_v32": _V3_RUNS,
    "glm_moe_dsa": _V3_RUNS,
    "glm4_moe": _V3_RUNS,
    "glm4_moe_lite": _V3_RUNS,
    "dots1": _V3_RUNS,
    "deepseek_v4": {
        "topk_method": ("noaux_tc", "top-k of the scores + e_score_correction_bias"),
        "n_group": (None, "no group stage"),
        "topk_group": (None, "no group stage"),
        **_RENORMALISES,
        "n_shared_experts": (1, "one shared MLP of moe_intermediate_size"),
    },
    "nemotron_h": {"n_shared_experts": (1, "one shared MLP")},
    "minimax_m2": {
        "scoring_func": ("sigmoid", "sigmoid scores"),
        "use_routing_bias": (True, "always adds e_score_correction_bias"),
        "shared_intermediate_size": (None, "no shared expert"),
    },
    "granitemoe": {"router_jitter_noise": (0.0, "no router jitter")},
    "gpt_oss": {"hidden_act": ("silu", "the clamped GLU of GptOssExperts")},
    "qwen3_5_moe_text": _RENORMALISES,
    "qwen3_vl_moe_text": _RENORMALISES,
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


# Routing keys an explicit ``null`` may not stand for: transformers keeps the null (the config
# class's default applies only to an absent key) and its model fails or routes otherwise, so the
# importer refuses instead of taking the default (``"num_experts_per_tok": null`` is not top-8).
_NOT_NULL = frozenset(
    {
        "num_experts_per_tok",
        "n_routed_experts",
        "num_local_experts",
        "num_experts",
        "norm_topk_prob",
        "routed_scaling_factor",
    }
)


class _Keys:
    """Typed reads of one config mapping; absent keys take the family's defaults (recorded)."""

    def __init__(self, cfg: Mapping[str, Any], mt: str, prefix: str = "") -> None:
        self.cfg, self.mt, self.prefix = cfg, mt, prefix
        self.defaults = _DEFAULTS.get(mt, {})
        self.defaulted: list[str] = []
        self.ignored: dict[str, str] = {}  # key=its value -> what the router runs instead

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def raw(self, key: str) -> Any:
        alias = _ALIASES.get(self.mt, {}).get(key)
        runs = _NOT_READ.get(self.mt, {}).get(key)
        if runs is not None:
            return self._not_read(key, alias, *runs)
        here = key in self.cfg and self.cfg[key] is not None
        if alias is not None and alias in self.cfg and self.cfg[alias] is not None:
            if here and self.cfg[key] != self.cfg[alias]:
                raise ValueError(
                    f"{self.mt} config has {self.name(key)}={show(self.cfg[key])} and its "
                    f"alias {self.name(alias)}={show(self.cfg[alias])}: they must agree"
                )
            if not here:
                return self.cfg[alias]
        if here:
            return self.cfg[key]
        self._refuse_null(key, alias)
        if self.defaults.get(key) is not None:
            value = self.defaults[key]
            self.defaulted.append(f"{self.name(key)}={json.dumps(value)}")
            return value
        raise ValueError(
            f"{self.mt} config lacks {self.name(key)!r} and the architecture has no default "
            f"for it: add it (see the model's config.json)"
        )

    def _not_read(self, key: str, alias: str | None, value: Any, runs: str) -> Any:
        """``value``, what the router runs for ``key`` (a key it never reads); a config's other
        value (or null) is recorded in ``ignored``, an absent one in ``defaulted``."""
        given = [n for n in (key, alias) if n and n in self.cfg]
        for name in given:
            if value is None or self.cfg[name] != value:
                shown = excerpt(json.dumps(self.cfg[name]), 24)[1:-1].rstrip("'")
                self.ignored[f"{self.name(name)}={shown}"] = runs
        if not given and value is not None:
            self.defaulted.append(
                f"{self.name(key)}={json.dumps(value)} (fixed by the modeling code)"
            )
        return value

    def _refuse_null(self, key: str, alias: str | None) -> None:
        if key not in _NOT_NULL:
            return
        for name in (key, alias):
            if name and name in self.cfg and self.cfg[name] is None:
                raise ValueError(
                    f"{self.mt} config has {self.name(name)}: null; a null routing key is not "
                    f"read as the architecture's default (transformers keeps the null): set it "
                    f"to the model's value (see the model card or its modeling code)"
                )

    def has(self, key: str) -> bool:
        alias = _ALIASES.get(self.mt, {}).get(key)
        runs = _NOT_READ.get(self.mt, {}).get(key)
        if runs is not None:
            return runs[0] is not None
        return any(
            name in self.cfg and self.cfg[name] is not None for name in (key, alias) if name
        ) or (self.defaults.get(key) is not None)

    def int(self, key: str) -> int:
        return integer(self.raw(key), f"{self.mt} config: {self.name(key)}")

    def opt_int(self, key: str) -> int | None:
        return self.int(key) if self.has(key) else None

    def float(self, key: str) -> float:
        return finite(self.raw(key), f"{self.mt} config: {self.name(key)}")

    def bool(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise ValueError(
                f"{self.mt} config: {self.name(key)} must be true or false, got {show(value)}"
            )
        return value

    def str(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise ValueError(
                f"{self.mt} config: {self.name(key)} must be a string, got {show(value)}"
            )
        return value


def _check_inside(path: Path) -> None:
    """Refuse, unread, a folder's ``config.json`` that is a symbolic link out of the folder (a
    model folder must not make the importer read, and quote, any file of the machine). Allowed:
    a link that stays inside the folder, and the Hugging Face cache's own layout,
    ``models--ORG--NAME/snapshots/REV/config.json -> ../../blobs/SHA`` (into that repository's
    ``blobs``)."""
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return
    except OSError:
        return  # NOTE: missing: said by the caller
    folder = os.path.realpath(path.parent)
    target = os.path.realpath(path)
    allowed = [folder]
    snapshots = os.path.dirname(folder)
    if os.path.basename(snapshots) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(snapshots), "blobs"))
    if any(os.path.commonpath([target, a]) == a for a in allowed):
        return
    raise InputError(
        f"config file {path} is a symbolic link out of its folder (not read): pass the config "
        f"file itself",
        value=str(path.parent),
        problem="its config.json is a symbolic link out of the folder (not read)",
        fix="pass the config file itself",
    )


def _read_hf(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise TypeError(
            f"config must be a dict, or the path of a config.json or of its directory, got "
            f"{type(config).__name__}"
        )
    path = Path(config)
    named = not path.is_dir()
    if not named:
        path = path / "config.json"
        _check_inside(path)
    if not path.exists():
        raise file_error("config file", path, "does not exist", "pass a config.json or its folder")
    data = read_config_file(path, kind="json", what="config file", named=named)
    if not isinstance(data, dict):
        raise file_error("config file", path, f"must hold a JSON object, got {type(data).__name__}")
    return data


def _activation(k: _Keys) -> str:
    act = k.str("hidden_act")
    if act not in _GATED_ACTIVATIONS:
        raise ValueError(
            f"{k.mt} config has {k.name('hidden_act')}={excerpt(act)}; the gated expert MLPs of "
            f"this family use {' or '.join(_GATED_ACTIVATIONS)} (SwiGLU)"
        )
    return _GATED_ACTIVATIONS[act]


def _aux(cfg: Mapping[str, Any], source: dict[str, str]) -> dict[str, Any]:
    """Map aux-loss coefficients (DeepSeek ``aux_loss_alpha``/``seq_aux``, HF
    ``router_aux_loss_coef``) when present and positive (never defaulted: the transformers
    models add the loss only when asked to, ``output_router_logits``)."""
    for key in ("aux_loss_alpha", "router_aux_loss_coef"):
        value = cfg.get(key)
        if value is not None and finite(value, key) < 0:
            raise ValueError(f"{key} must be >= 0, got {show(value)}")
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
    """Group-limited routing from ``n_group``/``topk_group``; nothing when every group is kept.

    The values are those the family's transformers gate can run (it reshapes the scores to
    ``[T, n_group, E / n_group]`` and takes the top ``topk_group`` groups): ``n_group`` a
    positive divisor of E, ``topk_group`` in ``[1, n_group]``, and an explicit null refused
    (transformers keeps it, and its gate fails). transformers' config classes check only the
    types; its gate raises on the others (``topk_group: 0`` masks every expert)."""
    for key in ("n_group", "topk_group"):
        if key in k.cfg and k.cfg[key] is None:
            raise ValueError(
                f"{k.mt} config has {k.name(key)}: null; its transformers gate divides the "
                f"experts into groups with it: set it (see the model's config.json)"
            )
    G = k.opt_int("n_group")
    g = k.opt_int("topk_group")
    if rule == "max" and (G is None or g is None):
        raise ValueError(
            f"{k.mt} topk_method=group_limited_greedy needs {k.name('n_group')} and "
            f"{k.name('topk_group')}: its transformers gate splits the experts into n_group groups "
            f"and keeps topk_group of them"
        )
    if G is None and g is None:
        return {}
    G = 1 if G is None else G
    g = G if g is None else g
    if G <= 0 or E % G:
        raise ValueError(
            f"{k.mt} config: {k.name('n_group')}={G} must be a positive divisor of the "
            f"{E} experts (its transformers gate splits them into n_group equal groups)"
        )
    if not 1 <= g <= G:
        raise ValueError(
            f"{k.mt} config: {k.name('topk_group')}={g} must be between 1 and "
            f"{k.name('n_group')}={G} (the groups each token may use)"
        )
    if rule == "sum_top2" and G > 1 and E // G < 2:
        raise ValueError(
            f"{k.mt} config: n_group={G} leaves {E // G} expert per group, but its gate ranks "
            f"groups by the sum of their top-2 scores: use n_group <= {E // 2}"
        )
    if G <= 1 or g >= G:
        return {}
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
