"""Run a Hugging Face ``transformers`` MoE model expert-parallel, in place.

``expert_parallel(model, group=..., dispatch=DispatchConfig(...))`` replaces every sparse MoE
block of a supported model with an :class:`EPSparseMoeBlock`: an ``MoELayer`` that keeps the
model's own router ``Parameter`` (the very object, so optimisers and state dicts still see it),
holds this rank's slice ``[r·e, (r+1)·e)`` of the expert weights, routes with the model's
semantics and moves tokens through ``FlexDispatcher``. Everything else (attention, norms,
embeddings) stays replicated: run each rank on its own batch and all-reduce the replicated
gradients (data parallel), as for any ``MoELayer``.

Supported today (transformers 5.x module layout; the releases in ``TRANSFORMERS_SUPPORTED``, the
``hf`` extra of ``pyproject.toml``: checked on 5.17.0 and 5.23.0; where they differ — gpt-oss's
``swiglu_alpha`` is a config key from 5.2x and a constant of the experts module in 5.17 — the
module's own attributes are read):

- Mixtral (``MixtralSparseMoeBlock``): softmax over all E, top-k, renormalised;
- Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): softmax over all E, top-k, renormalised only with
  ``norm_topk_prob``;
- Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): Qwen3-MoE's routing plus one shared expert (an MLP
  of ``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``. The
  shared expert stays whole on every rank: its weights are copied into
  ``layer.shared_experts`` (``w1 = gate_proj.weight^T``, ``w3 = up_proj.weight^T``,
  ``w2 = down_proj.weight^T``) and the gate keeps the model's own ``[1, H]`` Parameter.

- DeepSeek-V3 (``DeepseekV3MoE``): sigmoid scores, the ``e_score_correction_bias`` for the
  choice only (copied into the router's ``expert_bias``), group-limited routing (``n_group``,
  ``topk_group``, groups ranked by the sum of their top-2 scores: exact when
  ``num_experts_per_tok / topk_group == 2``, refused otherwise), ``norm_topk_prob``,
  ``routed_scaling_factor``; the shared experts (one MLP of ``n_shared_experts *
  moe_intermediate_size``, ungated) stay whole, copied like Qwen2-MoE's; dense first layers
  are left alone;
- gpt-oss (``GptOssMLP``): top-k of the biased logits ``x W^T + b`` (the model's own ``bias``
  Parameter is kept too), softmax over the k; clamped GLU experts (``swiglu_oai`` with the
  config's ``swiglu_limit`` and ``swiglu_alpha``) with biases; ``gate_up_proj`` ``[E, H, 2F]``
  interleaves gate (even columns) and up (odd columns). The block returns
  ``(hidden, router_scores)`` like the original.

The others use ``hidden_act="silu"`` gated experts (``gate_up_proj`` ``[E, 2F, H]`` holding the gate
rows first, ``down_proj`` ``[E, H, F]``), mapped to ``w1 = gate^T``, ``w3 = up^T``,
``w2 = down^T``. Router jitter noise (Mixtral, training only) is refused. Other families are
refused with the reason.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flexdispatch.config import DispatchConfig, MoEConfig, RouterConfig
from flexdispatch.moe import MoELayer

__all__ = ["EPSparseMoeBlock", "SUPPORTED_BLOCKS", "TRANSFORMERS_SUPPORTED", "expert_parallel"]

TRANSFORMERS_SUPPORTED = ">=5.17,<5.24"
"""The transformers releases the Hugging Face paths are checked on (PEP 440 specifier; the ``hf``
extra of ``pyproject.toml`` says the same)."""

SUPPORTED_BLOCKS: tuple[str, ...] = (
    "DeepseekV3MoE",
    "GptOssMLP",
    "MixtralSparseMoeBlock",
    "Qwen2MoeSparseMoeBlock",
    "Qwen3MoeSparseMoeBlock",
)


def _router_config(block: nn.Module, model_config: object, num_experts: int) -> RouterConfig:
    """The router ``model_config`` describes, read by ``importers.moe_config_from_hf``: the one
    mapping of the Hugging Face router rules (score function, groups, renormalisation, scaling,
    expert bias; refusals such as Mixtral's router jitter), for a ``config.json`` and a live
    model alike."""
    from flexdispatch.importers import moe_config_from_hf

    to_dict = getattr(model_config, "to_dict", None)
    if to_dict is None:
        raise ValueError(
            f"{type(block).__name__}: the model's config ({type(model_config).__name__}) has no "
            f"to_dict(): pass a transformers model (model.config is a PretrainedConfig)"
        )
    # NOTE: the routing only: the model keeps its own load-balancing loss (transformers adds it
    # from the router logits when asked), the layer adds none of its own
    router = moe_config_from_hf(to_dict()).router
    router = router.model_copy(update={"aux_loss_type": "none", "aux_loss_coeff": 0.0})
    if router.num_experts != num_experts:
        raise ValueError(
            f"{type(block).__name__} holds {num_experts} experts but its config names "
            f"{router.num_experts}: the model and its config disagree"
        )
    return router


class EPSparseMoeBlock(nn.Module):
    """The expert-parallel stand-in of one sparse MoE block (see the module docstring).

    ``forward(hidden [B, S, H]) -> [B, S, H]``, like the block it replaces. ``layer`` is the
    ``MoELayer``; ``layer.router.weight`` is the original block's ``gate.weight``; the experts
    hold global experts ``[r·e, (r+1)·e)`` (``layer.experts.global_expert_ids``).
    """

    def __init__(
        self,
        block: nn.Module,
        model_config: object,
        *,
        group: dist.ProcessGroup | None,
        dispatch: DispatchConfig,
    ) -> None:
        super().__init__()
        name = type(block).__name__
        self.oai = name == "GptOssMLP"
        act = getattr(model_config, "hidden_act", "silu")
        if act != "silu" and not self.oai:
            raise ValueError(f"{name}: hidden_act={act!r}; only silu (SwiGLU) experts map exactly")
        gate_up = block.experts.gate_up_proj  # [E, 2F, H]; gpt-oss: [E, H, 2F]
        down = block.experts.down_proj  # [E, H, F]; gpt-oss: [E, F, H]
        if self.oai:
            E, H, two_f = gate_up.shape
        else:
            E, two_f, H = gate_up.shape
        F_ = two_f // 2
        gate_mod = block.router if self.oai else block.gate
        weight = gate_mod.weight
        if weight.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{name}: router weight is {weight.dtype}; flexdispatch routes in fp32/fp64, "
                f"load the model in float32 (or keep the router in fp32)"
            )
        router = _router_config(block, model_config, E)
        if weight.dtype == torch.float64:
            router = router.model_copy(update={"router_dtype": "fp64"})
        shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        shared_gate = getattr(block, "shared_expert_gate", None)
        extra: dict[str, object] = {}
        if shared is not None:
            extra = {
                "num_shared_experts": 1,
                "shared_expert_ffn_hidden_size": int(shared.gate_proj.weight.shape[0]),
                "shared_expert_gate": shared_gate is not None,
            }
        if self.oai:
            extra = {
                "activation": "swiglu_oai",
                "swiglu_limit": float(block.experts.limit),
                "swiglu_alpha": float(block.experts.alpha),
                "expert_mlp_bias": True,
            }
        cfg = MoEConfig(
            name=name,
            hidden_size=H,
            ffn_hidden_size=F_,
            router=router,
            dispatch=dispatch,
            **({"activation": "swiglu"} | extra),
        )
        self.layer = MoELayer(cfg, group=group, dtype=gate_up.dtype, device=gate_up.device)
        # NOTE: the model's own Parameter, not a copy.
        self.layer.router.weight = weight
        if self.oai:
            self.layer.router.bias = gate_mod.bias
        correction = getattr(gate_mod, "e_score_correction_bias", None)
        if correction is not None:
            assert self.layer.router.expert_bias is not None
            with torch.no_grad():
                self.layer.router.expert_bias.copy_(correction.float())
        ex = self.layer.experts
        ids = list(ex.global_expert_ids)
        sl = slice(ids[0], ids[-1] + 1)
        with torch.no_grad():
            local_gu = gate_up.detach()[sl]
            if self.oai:
                gub = block.experts.gate_up_proj_bias.detach()[sl]
                ex.w1.copy_(local_gu[..., ::2])
                ex.w3.copy_(local_gu[..., 1::2])
                ex.w2.copy_(down.detach()[sl])
                ex.b1.copy_(gub[:, ::2])
                ex.b3.copy_(gub[:, 1::2])
                ex.b2.copy_(block.experts.down_proj_bias.detach()[sl])
            else:
                ex.w1.copy_(local_gu[:, :F_, :].transpose(1, 2))
                ex.w3.copy_(local_gu[:, F_:, :].transpose(1, 2))
                ex.w2.copy_(down.detach()[sl].transpose(1, 2))
        if shared is not None:
            se = self.layer.shared_experts
            assert se is not None
            with torch.no_grad():
                se.w1.copy_(shared.gate_proj.weight.t())
                se.w3.copy_(shared.up_proj.weight.t())
                se.w2.copy_(shared.down_proj.weight.t())
            if shared_gate is not None:
                # NOTE: the model's own gate Parameter ([1, H], the layout SharedExperts uses).
                se.gate_weight = shared_gate.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple:
        shape = hidden_states.shape
        res = self.layer(hidden_states.reshape(-1, shape[-1]))
        out = res.output.reshape(shape)
        if self.oai:
            return out, res.routing.topk_probs
        return out


def expert_parallel(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    dispatch: DispatchConfig | None = None,
) -> nn.Module:
    """Replace, in place, every supported sparse MoE block of ``model`` with an
    ``EPSparseMoeBlock`` over ``group`` (collective: call it on every rank, same model).

    Args:
        model: a ``transformers`` model of a supported family (``SUPPORTED_BLOCKS``), the same
            weights on every rank.
        group: the expert-parallel group (None: the default group).
        dispatch: how tokens move (default ``DispatchConfig()``).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: no supported block was found (the message names the block types seen), or
            a block's settings cannot be expressed exactly.
    """
    dispatch = DispatchConfig() if dispatch is None else dispatch
    model_config = getattr(model, "config", None)
    targets = [
        (name, mod) for name, mod in model.named_modules() if type(mod).__name__ in SUPPORTED_BLOCKS
    ]
    if not targets:
        seen = sorted({type(m).__name__ for m in model.modules() if "Moe" in type(m).__name__})
        raise ValueError(
            f"no supported sparse MoE block in {type(model).__name__} (supported: "
            f"{', '.join(SUPPORTED_BLOCKS)}; MoE-looking modules seen: {seen or 'none'})"
        )
    text_config = getattr(model_config, "text_config", None) or model_config
    for name, block in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, EPSparseMoeBlock(block, text_config, group=group, dispatch=dispatch))
    return model
