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
            weights on every rank (checked: one all-gather of each block's weight sums), in
            bfloat16, float16 or float32 (the router may be float64).
        group: the expert-parallel group (None: the default group).
        dispatch: how tokens move (default ``DispatchConfig()``).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``group`` not a ``ProcessGroup``,
            ``dispatch`` not a ``DispatchConfig``; a block whose class has a supported name but
            is not the transformers class (naming what it lacks); experts in float64.
        ValueError: no supported block was found (the message names the block types seen);
            ``model`` is a block itself (pass the model that holds it); a block's settings
            cannot be expressed exactly; the ranks hold different weights (naming the block).
    """
    _check_arguments(model, group, dispatch)
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
    for name, block in targets:
        _check_block(name, block)
    _check_same_weights(targets, group)
    text_config = getattr(model_config, "text_config", None) or model_config
    for name, block in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, EPSparseMoeBlock(block, text_config, group=group, dispatch=dispatch))
    return model


def _check_arguments(model: object, group: object, dispatch: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}"
            f": load it first, e.g. AutoModelForCausalLM.from_pretrained(path)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None (the default group), got "
            f"{type(group).__name__} {group!r:.40}"
        )
    if dispatch is not None and not isinstance(dispatch, DispatchConfig):
        raise TypeError(f"dispatch must be a DispatchConfig or None, got {type(dispatch).__name__}")


# NOTE: what EPSparseMoeBlock reads of each block (its router, its experts' weights)
_BLOCK_PARTS = {
    "GptOssMLP": ("router.weight", "router.bias", "experts.gate_up_proj", "experts.down_proj"),
}
_DEFAULT_PARTS = ("gate.weight", "experts.gate_up_proj", "experts.down_proj")


def _check_block(name: str, block: nn.Module) -> None:
    """A block with a supported class name: the transformers class (not a user's class of that
    name) holding what ``EPSparseMoeBlock`` reads; never the model itself (``name`` empty: the
    replacement could not be put anywhere); experts in a dtype the dispatcher moves."""
    cls = type(block).__name__
    if not name:
        raise ValueError(
            f"pass the model that holds the block, not the block itself ({cls}): "
            f"expert_parallel replaces the blocks inside the module it is given"
        )
    module = type(block).__module__
    if not module.startswith("transformers.models."):
        raise TypeError(
            f"{name} is a {cls} from {module!r:.60}, not the transformers class: only the "
            f"transformers models' blocks are replaced"
        )
    for part in _BLOCK_PARTS.get(cls, _DEFAULT_PARTS):
        owner: object = block
        for attr in part.split("."):
            owner = getattr(owner, attr, None)
        if not isinstance(owner, torch.Tensor):
            raise TypeError(
                f"{name} ({cls}) has no tensor {part}: this transformers release lays the block "
                f"out differently (supported: {TRANSFORMERS_SUPPORTED})"
            )
    experts = block.experts.gate_up_proj
    if experts.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(
            f"{name} ({cls}): the experts are {experts.dtype}; flexdispatch moves bfloat16, "
            f"float16 or float32 rows: load the model in one of them (model.float())"
        )


def _check_same_weights(targets: list[tuple[str, nn.Module]], group: object) -> None:
    """Refuse on every rank when the ranks hold different weights for a block (each keeps only
    its slice of the experts: different weights would mix silently). One all-gather of a
    fingerprint per block: float64 sums and sums of squares of its router and expert weights."""
    from flexdispatch.distributed import check_fingerprint, is_distributed

    if not is_distributed(group):
        return
    fields = {}
    with torch.no_grad():
        for name, block in targets:
            parts = [p.detach() for p in block.parameters() if not p.is_meta]
            sums = sum(float(p.double().sum()) for p in parts)
            squares = sum(float(p.double().square().sum()) for p in parts)
            fields[name] = f"{sums!r}/{squares!r}"
    check_fingerprint(
        fields,
        group,  # type: ignore[arg-type]
        what="the model's MoE weights",
        fix="load the same checkpoint on every rank before expert_parallel (each rank keeps "
        "only its slice of the experts)",
    )
