"""``MoEConfig`` from Megatron-Core arguments (``--num-moe-experts``, ``--moe-router-*``, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from flexdispatch._files import validation_message
from flexdispatch.config import MoEConfig

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
        raise ValueError(
            f"Megatron args map to an invalid MoEConfig: {validation_message(exc)}"
        ) from None
