"""The classes behind ``flexdispatch.integrations.megatron`` (this module imports Megatron).

T tokens on this rank · H hidden · E experts of the TP×EP group (``tp · num_moe_experts``) ·
R ranks of that group · e = E / R local experts · k slots per token (``tp · moe_router_topk``) ·
M received rows · N permuted rows.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import (
    MoEFlexTokenDispatcher,
    MoETokenDispatcher,
    _DispatchManager,
)
from pydantic import ValidationError

from flexdispatch.config import DispatchConfig
from flexdispatch.dispatch.dispatcher import FlexDispatcher
from flexdispatch.integrations import _installed
from flexdispatch.permutation import permute, unpermute
from flexdispatch.routing.dense import routing_map_to_topk
from flexdispatch.types import Permutation

__all__ = ["FlexdispatchManager", "FlexdispatchTokenDispatcher", "refusal"]

_NOTED = {"permute_fusion": False}
"""What this process has been told once (a warning per process, not per layer)."""


def refusal(config: Any) -> str | None:
    """Why the plug-in cannot serve a layer of this ``TransformerConfig``, or None.

    Megatron's own ``TransformerConfig`` checks already refuse both options for a ``"flex"``
    layer with the ``"deepep"`` backend, so this is reached only by a config that passed them
    as another dispatcher: an ``"alltoall"`` layer routed to the plug-in (as
    ``scripts/megatron_acceptance``'s ``MLM_VIA=a2a-flex`` does), or one changed after it was
    built. Kept so that such a layer is refused naming the option, not run wrongly."""
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        return (
            "flexdispatch's Megatron plug-in does not pad expert inputs to capacity "
            "(moe_pad_expert_input_to_capacity=True): for static dispatch shapes use "
            "install(DispatchConfig(num_worst_tokens=W)) instead"
        )
    if getattr(config, "moe_expert_rank_capacity_factor", None) is not None:
        return (
            "flexdispatch's Megatron plug-in does not drop by rank capacity "
            "(moe_expert_rank_capacity_factor is set, a HybridEP option): unset it, or use "
            "moe_expert_capacity_factor for per-expert dropping"
        )
    return None


class FlexdispatchManager(_DispatchManager):
    """A ``_DispatchManager`` over a ``FlexDispatcher``, with DeepEP's attribute names.

    Megatron's 1F1B overlap schedule replaces ``token_probs`` and ``dispatched_probs`` by detached
    copies between the calls, so each call reads them from ``self`` when it runs.

    Args:
        group: the TP×EP process group (R ranks; rank r holds experts ``[r·e, (r+1)·e)``).
        num_local_experts: e.
        router_topk: k, ``tp · moe_router_topk``.
        num_experts: E, ``tp · num_moe_experts``.
        config: the layer's ``TransformerConfig``.
        dispatch_config: the ``FlexDispatcher``'s config.
    """

    def __init__(
        self,
        group: Any,
        num_local_experts: int,
        router_topk: int,
        num_experts: int,
        config: Any,
        dispatch_config: DispatchConfig,
    ) -> None:
        self.group = group
        self.num_local_experts = num_local_experts
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.config = config
        self.router_dtype = config.moe_router_dtype
        self.align = 1
        if config.moe_router_padding_for_quantization:
            self.align = max(1, get_align_size_for_quantization(config))
        num_sms = getattr(config, "moe_flex_dispatcher_num_sms", None)
        if num_sms is not None and dispatch_config.deepep_num_sms is None:
            # NOTE: validated (model_copy would not check it), named as the Megatron option
            fields = {**dispatch_config.model_dump(), "deepep_num_sms": num_sms}
            try:
                dispatch_config = DispatchConfig.model_validate(fields)
            except ValidationError as exc:
                why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise ValueError(
                    f"moe_flex_dispatcher_num_sms={num_sms!r} is not a valid "
                    f"DispatchConfig.deepep_num_sms: {why}"
                ) from None
        self.dispatcher = FlexDispatcher(dispatch_config, num_experts=num_experts, group=group)
        # DeepEP's names (see the class docstring)
        self.token_indices: torch.Tensor | None = None  # [T, k] int64, -1 = empty
        self.token_probs: torch.Tensor | None = None  # [T, k] float32
        self.handle: Any = None
        self.dispatched_indices: torch.Tensor | None = None  # [M, k] local ids, -1
        self.dispatched_probs: torch.Tensor | None = (
            None  # [M, k] float32 (permute reads it; [N] probs are its result)
        )
        self.tokens_per_expert: torch.Tensor | None = None  # [e] int64 (padded after permute)
        self._num_pairs: int | None = None
        self._perm: Permutation | None = None

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        """``routing_map`` ``[T, R, e]`` bool and ``probs`` ``[T, R, e]`` -> ``[T, k]``."""
        T = routing_map.shape[0]
        routing = routing_map_to_topk(
            routing_map.reshape(T, self.num_experts),
            probs.reshape(T, self.num_experts),
            self.router_topk,
        )
        self.token_indices = routing.topk_idx
        self.token_probs = routing.topk_probs

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> torch.Tensor:
        """``[T, H]`` -> the ``[M, H]`` rows this rank receives (one per token and rank)."""
        del async_finish, allocate_on_comm_stream  # NOTE: the backend keeps its own streams
        if self.token_indices is None or self.token_probs is None:
            raise RuntimeError("FlexdispatchManager.dispatch before setup_metadata")
        res = self.dispatcher.dispatch(
            hidden_states, self.token_indices, self.token_probs.to(torch.float32)
        )
        self.handle = res.handle
        self.dispatched_indices = res.recv_topk_idx
        self.dispatched_probs = res.recv_topk_probs
        self.tokens_per_expert = res.num_recv_tokens_per_expert
        self._num_pairs = res.num_recv_pairs
        return res.recv_x

    def get_permuted_hidden_states_by_experts(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, H]`` received rows -> ``([N, H]`` rows grouped by local expert, ``[N]`` probs)."""
        if self.dispatched_indices is None or self.dispatched_probs is None:
            raise RuntimeError("FlexdispatchManager: permute before dispatch")
        exact = self._num_pairs if self.align == 1 else None
        perm = permute(
            hidden_states,
            self.dispatched_indices,
            self.num_local_experts,
            topk_probs=self.dispatched_probs,
            align=self.align,
            num_rows=exact,
        )
        self._perm = perm
        self.tokens_per_expert = perm.padded_tokens_per_expert
        probs = cast(torch.Tensor, perm.probs)  # NOTE: given probs, permute returns them
        if self.router_dtype == "fp64":
            probs = probs.to(torch.float64)
        return perm.x, probs

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """``[e]`` int64 rows per local expert (padding included after the permute)."""
        if self.tokens_per_expert is None:
            raise RuntimeError("FlexdispatchManager: no dispatch yet")
        return self.tokens_per_expert

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` expert outputs (already weighted by Megatron's experts) -> ``[M, H]``."""
        if self._perm is None:
            raise RuntimeError("FlexdispatchManager: unpermute before permute")
        out = unpermute(hidden_states, self._perm)
        self._perm = None
        return out

    def combine(
        self,
        hidden_states: torch.Tensor,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> torch.Tensor:
        """``[M, H]`` -> ``[T, H]``: the sum over the ranks each token went to."""
        del async_finish, allocate_on_comm_stream
        if self.handle is None:
            raise RuntimeError("FlexdispatchManager.combine before dispatch")
        out = self.dispatcher.combine(hidden_states, self.handle)
        # NOTE: as DeepEP's manager: release the handle and the received metadata
        self.handle = None
        self.dispatched_indices = None
        self.dispatched_probs = None
        return out


class FlexdispatchTokenDispatcher(MoEFlexTokenDispatcher):
    """Megatron's flex token dispatcher with a ``FlexdispatchManager`` for the ``"deepep"``
    backend (``"hybridep"`` / ``"ncclep"``: Megatron's own managers, unchanged)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
    ) -> None:
        if config.moe_flex_dispatcher_backend != "deepep":
            super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
            return
        why = refusal(config)
        if why is not None:
            raise ValueError(why)
        if getattr(config, "moe_permute_fusion", False) and not _NOTED["permute_fusion"]:
            _NOTED["permute_fusion"] = True
            warnings.warn(
                "flexdispatch's Megatron plug-in permutes the received rows with its own kernels: "
                "moe_permute_fusion=True (TransformerEngine's fused permutation) is not used by "
                "its layers (said once per process)",
                stacklevel=2,
            )
        dispatch_config = _installed.MEGATRON.get("config") or DispatchConfig()
        MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self._comm_manager = FlexdispatchManager(
            group=self.tp_ep_group,
            num_local_experts=num_local_experts,
            router_topk=self.tp_size * config.moe_router_topk,
            num_experts=self.tp_size * config.num_moe_experts,
            config=config,
            dispatch_config=dispatch_config,
        )
        self.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.token_indices"]

    @property
    def dispatcher(self) -> FlexDispatcher:
        """The layer's ``FlexDispatcher`` (its ``stats``, ``backend_name``, ``backend_reason``)."""
        return self._comm_manager.dispatcher
