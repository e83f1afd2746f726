"""What the serving-engine plug-ins (``flexdispatch.integrations.vllm`` / ``.sglang``) share;
imports neither engine (nor the dispatcher, until a decode dispatcher is built).

R ranks · B the most tokens a rank dispatches in one decode call · W = R · B worst-case rows.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexdispatch.config import DispatchConfig

if TYPE_CHECKING:
    from flexdispatch.dispatch.decode import DecodeDispatcher

__all__ = ["config_from_env", "decode_dispatcher", "switched_on", "updated_config"]


def switched_on(variable: str) -> bool:
    """Whether the environment variable turns a plug-in on (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


def config_from_env(variable: str) -> DispatchConfig:
    """The ``DispatchConfig`` the environment variable holds as JSON (unset: the defaults).

    Raises:
        ValueError: not a valid ``DispatchConfig``, naming the variable.
    """
    text = os.environ.get(variable, "").strip()
    if not text:
        return DispatchConfig()
    try:
        return DispatchConfig.model_validate_json(text)
    except ValueError as exc:
        raise ValueError(f"{variable} is not a valid DispatchConfig as JSON: {exc}") from exc


def updated_config(base: DispatchConfig, **changes: Any) -> DispatchConfig:
    """``base`` with ``changes``, validated (the fields the user set stay "set": backend
    selection reads which fields were given)."""
    return DispatchConfig.model_validate({**base.model_dump(exclude_unset=True), **changes})


def decode_dispatcher(
    config: DispatchConfig,
    *,
    num_experts: int,
    group: dist.ProcessGroup | None,
    max_tokens_per_rank: int,
    hidden_size: int | None = None,
    topk: int | None = None,
    dtype: torch.dtype | None = None,
) -> DecodeDispatcher:
    """A capturable ``DecodeDispatcher`` for B = ``max_tokens_per_rank`` tokens per rank.

    DeepEP's low-latency kernels where ``config`` asks for them (``backend="deepep"``,
    ``mode="low_latency"``) and they run, else the worst-case dispatch with W = R · B. Built with
    ``cuda_graph=True``, so a configuration that cannot be captured is refused here, and warmed up
    (before any capture) when ``hidden_size`` and ``topk`` are given. Collective over ``group``.

    Raises:
        ValueError: B not positive, or the dispatcher refuses the configuration.
    """
    from flexdispatch import FlexDispatcher
    from flexdispatch.dispatch.decode import DecodeDispatcher
    from flexdispatch.distributed import group_size

    B = max_tokens_per_rank
    if B <= 0:
        raise ValueError(f"max_tokens_per_rank must be positive, got {B}")
    R = group_size(group)
    changes: dict[str, Any] = {"num_max_dispatch_tokens_per_rank": B, "cuda_graph": True}
    if config.backend == "torch" or config.mode == "normal":
        changes["num_worst_tokens"] = max(config.num_worst_tokens, R * B)
    dispatcher = FlexDispatcher(
        updated_config(config, **changes), num_experts=num_experts, group=group
    )
    low_latency = getattr(dispatcher.backend, "mode", "normal") == "low_latency"
    if not low_latency and dispatcher.config.num_worst_tokens < R * B:
        # NOTE: backend="auto" without DeepEP here (every rank decided alike): worst-case decode
        dispatcher.close()
        dispatcher = FlexDispatcher(
            updated_config(config, **changes, num_worst_tokens=R * B, mode="normal"),
            num_experts=num_experts,
            group=group,
        )
    if not low_latency and hidden_size is not None and topk is not None:
        dispatcher.warmup(hidden_size, topk, dtype=dtype or torch.bfloat16, backward=False)
    return DecodeDispatcher(dispatcher, num_max_dispatch_tokens_per_rank=B)
