"""``MoEConfig`` from Megatron-Core arguments (``--num-moe-experts``, ``--moe-router-*``, ...)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from flexdispatch._checks.files import excerpt, key_text
from flexdispatch._checks.values import finite, integer, show
from flexdispatch.config import MoEConfig, invalid_config

# Megatron-Core argument -> RouterConfig field, by the type Megatron's argparse gives it (a
# value of another type is refused naming the argument: `vars(args)` never holds one).
_MEGATRON_INTS = {
    "num_moe_experts": "num_experts",
    "moe_router_topk": "topk",
    "moe_router_num_groups": "num_groups",
    "moe_router_group_topk": "group_topk",
}
_MEGATRON_FLOATS = {
    "moe_router_topk_scaling_factor": "scaling_factor",
    "moe_router_bias_update_rate": "bias_update_rate",
    "moe_expert_capacity_factor": "capacity_factor",
}
_MEGATRON_BOOLS = {
    "moe_router_pre_softmax": "use_pre_softmax",
    "moe_router_enable_expert_bias": "enable_expert_bias",
}
_MEGATRON_STRS = {
    "moe_router_score_function": "score_function",
    "moe_token_drop_policy": "drop_policy",
}
_MEGATRON_ROUTER = {**_MEGATRON_INTS, **_MEGATRON_FLOATS, **_MEGATRON_BOOLS, **_MEGATRON_STRS}
_MEGATRON_OTHER = {
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_dtype",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
}


def _int_arg(args: Mapping[str, Any], key: str) -> int | None:
    """Megatron argument ``key`` as a positive int, or None when absent or null.

    Megatron's argparse types these as ``int``, so ``vars(args)`` holds an int: a bool
    (YAML ``true``), a string (``'8'``) or a float (``2.0``) is refused, as the Hugging Face
    importer refuses them (``_checks.values.integer``)."""
    value = args.get(key)
    if value is None:
        return None
    value = integer(value, f"Megatron argument {key}", why=" (Megatron's argparse reads it as int)")
    if value <= 0:
        raise ValueError(f"Megatron argument {key} must be a positive integer, got {value}")
    return value


def _float_arg(args: Mapping[str, Any], key: str, value: Any = None) -> float | None:
    """Megatron argument ``key`` (or ``value``) as a finite float, or None when absent or null.

    A string that ``float()`` reads is a number too, as Megatron's argparse reads it (``type=
    float``): YAML reads ``1e-2`` as the string ``'1e-2'`` (YAML 1.1 floats need a dot), which
    is how an arguments file spells a coefficient. A bool is never a number
    (``_checks.values.finite``).
    """
    value = args.get(key) if value is None else value
    if value is None:
        return None
    return finite(value, f"Megatron argument {key}", strings=True)


def _typed_arg(args: Mapping[str, Any], key: str, kind: type) -> Any:
    value = args.get(key)
    if value is not None and not isinstance(value, kind):
        what = {bool: "true or false", str: "a string"}[kind]
        raise ValueError(f"Megatron argument {key} must be {what}, got {show(value)}")
    return value


def _one_coeff(name: str, value: Any) -> float:
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(
                f"{name}={excerpt(value)}: give one coefficient (one load-balancing type)"
            )
        value = value[0]
    coeff = _float_arg({}, name, value)
    if coeff is not None and coeff < 0:
        raise ValueError(f"Megatron argument {name} must be >= 0, got {coeff}")
    return 0.0 if coeff is None else coeff


_ARG_NAME = re.compile(r"moe_[a-z0-9_]{1,44}")
"""An unknown key named in full: shaped like a Megatron argument (argparse's lower-case names,
at most 48 characters: Megatron-Core's own reach 40); any other key as a config file's keys are
(``key_text``: position, length, 3 characters)."""


def _arg_name(key: str, known: list[str], position: int) -> str:
    return key if _ARG_NAME.fullmatch(key) else key_text(key, known, str(position))


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
    sum rule. Values have the types Megatron's argparse gives them: an integer argument is an
    int (never a bool, a string such as ``'8'`` or a float such as ``2.0``), a float argument a
    finite number (never a bool; a string only when ``float()`` reads it, as ``'1e-2'``: YAML
    reads ``1e-2`` as a string), a flag true or false.

    Raises:
        ValueError: an unknown ``moe_*`` key (all listed), a missing ``num_moe_experts`` or
            ``hidden_size``, a value of the wrong type, a non-finite coefficient, a size that is
            not a positive integer (``moe_ffn_hidden_size: 0``), an unsupported load-balancing
            type, or an invalid combination.
    """
    if not isinstance(args, Mapping):
        raise TypeError(f"args must be a mapping of Megatron argument names, got {type(args)}")
    known = [*_MEGATRON_ROUTER, *_MEGATRON_OTHER]
    unknown = sorted(
        _arg_name(key, known, i)
        for i, key in enumerate(args, 1)
        if isinstance(key, str) and key.startswith("moe_") and key not in known
    )
    if unknown:
        raise ValueError(
            f"unknown Megatron MoE argument(s) {', '.join(unknown)}: supported are "
            f"{', '.join(sorted([*_MEGATRON_ROUTER, *_MEGATRON_OTHER]))}"
        )
    for key in ("num_moe_experts", "hidden_size"):
        if args.get(key) is None:
            raise ValueError(f"Megatron args lack {key!r}: it is required")
    router: dict[str, Any] = {}
    for keys, read in (
        (_MEGATRON_INTS, _int_arg),
        (_MEGATRON_FLOATS, _float_arg),
        (_MEGATRON_BOOLS, lambda a, k: _typed_arg(a, k, bool)),
        (_MEGATRON_STRS, lambda a, k: _typed_arg(a, k, str)),
    ):
        for key, field in keys.items():
            value = read(args, key)
            if value is not None:
                router[field] = value
    router.setdefault("topk", 2)  # Megatron's default moe_router_topk
    lb = args.get("moe_router_load_balancing_type") or "aux_loss"
    if isinstance(lb, (list, tuple)):
        if len(lb) != 1:
            raise ValueError(f"moe_router_load_balancing_type={excerpt(lb)}: give one type")
        lb = lb[0]
    coeff = _one_coeff("moe_aux_loss_coeff", args.get("moe_aux_loss_coeff"))
    if lb not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        raise ValueError(
            f"moe_router_load_balancing_type={excerpt(lb)} is not supported: use aux_loss, "
            f"seq_aux_loss, global_aux_loss or none"
        )
    if lb != "none" and coeff > 0:
        router.update(aux_loss_type=lb, aux_loss_coeff=coeff)
    z = _one_coeff("moe_z_loss_coeff", args.get("moe_z_loss_coeff"))
    if z > 0:
        router["z_loss_coeff"] = z
    if args.get("moe_router_dtype") is not None:
        router["router_dtype"] = _typed_arg(args, "moe_router_dtype", str)
    # NOTE: only an absent or null moe_ffn_hidden_size falls back to ffn_hidden_size (0 is
    # refused, never replaced)
    ffn = _int_arg(args, "moe_ffn_hidden_size")
    if ffn is None:
        ffn = _int_arg(args, "ffn_hidden_size")
    if ffn is None:
        raise ValueError("Megatron args lack moe_ffn_hidden_size (and ffn_hidden_size)")
    swiglu = _typed_arg(args, "swiglu", bool)
    data: dict[str, Any] = {
        "name": name,
        "hidden_size": _int_arg(args, "hidden_size"),
        "ffn_hidden_size": ffn,
        "activation": "swiglu" if swiglu is None or swiglu else "gelu",
        "router": router,
        "source": {"importer": "moe_config_from_megatron", "load_balancing_type": str(lb)},
    }
    shared = _int_arg(args, "moe_shared_expert_intermediate_size")
    if shared:
        data.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared)
        data["source"]["shared_experts"] = (
            f"moe_shared_expert_intermediate_size={shared}: one shared MLP of that size"
        )
    try:
        return MoEConfig.model_validate(data)
    except ValidationError as exc:
        raise invalid_config(exc, "Megatron args map to an invalid MoEConfig") from None
