"""``TopKRouter``: the learned gate, top-k routing, load-balancing losses and the expert bias.

Shape letters: T tokens on this rank · H hidden · E experts in total · R ranks · e = E/R local
experts · k top-k · L ranks per node · N nodes · M received rows · W worst-case rows. Also used
here: S sequence length and B sequences of a ``[S, B, H]`` input (T = S * B, token
``t = s * B + b``, the order of ``hidden.reshape(-1, H)``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from flexdispatch._checks import fits
from flexdispatch._checks.tensors import check_tensor
from flexdispatch._checks.values import check_int
from flexdispatch.config import RouterConfig
from flexdispatch.distributed import collective_guard
from flexdispatch.routing.losses import (
    AuxLossAutoScaler,
    aux_loss_scores,
    count_tokens_per_expert,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from flexdispatch.routing.topk import topk_routing
from flexdispatch.types import RoutingResult

__all__ = ["TopKRouter", "gating_linear"]

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class _GatingLinear(torch.autograd.Function):
    """``x.to(rd) @ W.to(rd).T (+ b.to(rd))`` that saves only the original ``x`` and ``W`` (no
    ``rd`` copy; the bias is not needed for backward).

    A bf16 ``x`` of ``[T, H]`` would otherwise keep an fp32 copy of itself alive until backward;
    here the cast is recomputed in backward, and each gradient comes back in its input's dtype.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x_TH: torch.Tensor,
        weight_EH: torch.Tensor,
        bias_E: torch.Tensor | None,
        router_dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(x_TH, weight_EH)
        ctx.router_dtype = router_dtype  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias_E is None else bias_E.dtype  # type: ignore[attr-defined]
        logits = torch.matmul(x_TH.to(router_dtype), weight_EH.to(router_dtype).t())
        if bias_E is not None:
            logits = logits + bias_E.to(router_dtype)
        return logits

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_TE: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x_TH, weight_EH = ctx.saved_tensors  # type: ignore[attr-defined]
        rd = ctx.router_dtype  # type: ignore[attr-defined]
        grad_TE = grad_TE.to(rd)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # type: ignore[attr-defined]
            grad_x = torch.matmul(grad_TE, weight_EH.to(rd)).to(x_TH.dtype)
        if ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
            grad_w = torch.matmul(grad_TE.t(), x_TH.to(rd)).to(weight_EH.dtype)
        if ctx.needs_input_grad[2]:  # type: ignore[attr-defined]
            grad_b = grad_TE.sum(0).to(ctx.bias_dtype)  # type: ignore[attr-defined]
        return grad_x, grad_w, grad_b, None


def gating_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    router_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router logits ``[T, E]`` in ``router_dtype`` from ``x`` ``[T, H]``, ``weight`` ``[E, H]``
    and an optional ``bias`` ``[E]`` added to the logits (gpt-oss's router).

    Memory-saving: only the original (possibly bf16) ``x`` and ``weight`` are kept for backward;
    the gradients come back in their own dtypes.
    """
    return _GatingLinear.apply(x, weight, bias, router_dtype)


class TopKRouter(nn.Module):
    """Learned top-k router (Megatron-Core semantics), configured by a ``RouterConfig``.

    Parameters and buffers:

    - ``weight``: ``[E, H]`` Parameter in the router dtype (fp32, or fp64 for
      ``router_dtype="fp64"``), initialised from torch's global RNG with ``normal(0, 0.02)``
      (``reset_parameters``), so ``torch.manual_seed`` makes it reproducible.
    - ``bias``: ``[E]`` Parameter in the router dtype, added to the logits, when
      ``router_bias`` (gpt-oss); initialised to zeros (no draw, so ``weight`` is the same with
      or without it); None otherwise.
    - ``expert_bias`` ``[E]`` fp32 (persistent) and ``local_tokens_per_expert`` ``[E]`` int64
      (not persistent) when ``enable_expert_bias``: counts after capacity dropping accumulate on
      the device in every training-mode forward; :meth:`update_expert_bias` applies them.
    - ``global_tokens_per_expert`` ``[E]`` fp32 and ``ga_steps`` 0-d int64 (not persistent) for
      ``aux_loss_type="global_aux_loss"``: every training-mode forward all-reduces its unbiased
      top-k counts over ``aux_loss_group`` (when given), adds them to the buffer and bumps
      ``ga_steps``; the loss uses the running mean ``buffer / ga_steps`` and
      ``T * group size`` tokens. Call :meth:`reset_global_aux_loss_tracker` after each global
      batch (after the optimizer step), as Megatron does.

    Losses (``aux_loss``, ``z_loss`` on the result) are computed in training mode with grad
    enabled only (None otherwise, and None when their coefficient is 0 / type is ``"none"``).
    They are already multiplied by their coefficient and joined to ``topk_probs`` with
    :class:`AuxLossAutoScaler` using ``self.aux_loss_scale`` (default 1.0; set it to the main
    loss's scale), so backpropagating anything computed from ``topk_probs`` trains the router
    on them too. They are reported, not added: do not add them to the loss yourself.

    Args:
        config: the router configuration.
        hidden_size: H.
        aux_loss_group: process group (data-parallel) over which ``global_aux_loss`` sums its
            token counts; None for a single process.
    """

    def __init__(
        self,
        config: RouterConfig,
        hidden_size: int,
        *,
        aux_loss_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config must be a RouterConfig, got {type(config).__name__}")
        check_int("hidden_size", hidden_size, at_least=1, rule="a positive int")
        self.config = config
        self.hidden_size = hidden_size
        self.router_dtype = _ROUTER_DTYPES[config.router_dtype]
        self.aux_loss_group = aux_loss_group
        self.aux_loss_scale = 1.0
        E = config.num_experts
        fits.check_fits(
            "TopKRouter",
            "hidden_size",
            hidden_size,
            E * hidden_size * torch.finfo(self.router_dtype).bits // 8,
            "cpu",
            detail=f"the [E={E}, H] {config.router_dtype} gating weight",
            fix="check hidden_size and config.num_experts",
        )
        self.weight = nn.Parameter(torch.empty(E, hidden_size, dtype=self.router_dtype))
        if config.router_bias:
            self.bias = nn.Parameter(torch.empty(E, dtype=self.router_dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        if config.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(E, dtype=torch.int64), persistent=False
            )
        else:
            self.expert_bias: torch.Tensor | None = None
            self.local_tokens_per_expert: torch.Tensor | None = None
        if config.aux_loss_type == "global_aux_loss":
            self.register_buffer(
                "global_tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False
            )
            self.register_buffer("ga_steps", torch.zeros((), dtype=torch.int64), persistent=False)

    def reset_parameters(self) -> None:
        """Draw ``weight`` from ``normal(0, 0.02)`` with torch's global RNG; zero ``bias``."""
        nn.init.normal_(self.weight, mean=0.0, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden_size={self.hidden_size}, num_experts={c.num_experts}, topk={c.topk}, "
            f"score_function={c.score_function}, router_type={c.router_type}, "
            f"router_bias={c.router_bias}"
        )

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        token_ids: torch.Tensor | None = None,
        checks: bool | None = None,
    ) -> RoutingResult:
        """Route ``hidden`` (``[T, H]`` or ``[S, B, H]``, any float dtype).

        Args:
            hidden: ``[T, H]`` or ``[S, B, H]`` floating hidden states; tokens are taken in the
                order of ``hidden.reshape(-1, H)``.
            token_ids: ``[T]`` or ``[S, B]`` int64 (or int32) token ids, required (only) when
                ``config.router_type == "hash"``.
            checks: run the host-syncing value checks (NaN/inf logits; hash: token ids); None
                reads ``FLEXDISPATCH_CHECKS``.

        Returns:
            RoutingResult: ``topk_idx`` ``[T, k]`` int64 (``-1`` dropped), ``topk_probs``
            ``[T, k]`` float32 (0 where ``-1``), ``tokens_per_expert`` ``[E]`` int64,
            ``num_dropped`` 0-d int64, ``aux_loss`` / ``z_loss`` 0-d (router dtype) or None.

        Raises:
            TypeError: ``hidden`` is not a floating tensor.
            ValueError: a bad shape or device, a missing ``token_ids`` (hash), or NaN/inf
                logits with checks enabled.
        """
        check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
        H = self.hidden_size
        if hidden.shape[-1] != H:
            raise ValueError(
                f"hidden has last dimension {hidden.shape[-1]} but the router was built with "
                f"hidden_size={H}: pass [T, {H}] or [S, B, {H}]"
            )
        if hidden.device != self.weight.device:
            raise ValueError(
                f"hidden is on {hidden.device} but the router weight is on {self.weight.device}: "
                f"move the input (or the module, with .to(device)) so both are on one device"
            )
        if hidden.dim() == 3:
            seq_length, batch_size = hidden.shape[0], hidden.shape[1]
        else:
            seq_length, batch_size = hidden.shape[0], 1
        x_TH = hidden.reshape(-1, H)
        cfg = self.config

        if cfg.router_type == "hash":
            return self._hash_forward(x_TH, token_ids, checks)

        logits_TE = gating_linear(x_TH, self.weight, self.router_dtype, self.bias)
        result = topk_routing(
            logits_TE,
            topk=cfg.topk,
            score_function=cfg.score_function,
            use_pre_softmax=cfg.use_pre_softmax,
            num_groups=cfg.num_groups,
            group_topk=cfg.group_topk,
            group_score=cfg.group_score,
            normalize_topk=cfg.normalize_topk,
            scaling_factor=cfg.scaling_factor,
            expert_bias=self.expert_bias,
            capacity_factor=cfg.capacity_factor,
            drop_policy=cfg.drop_policy,
            checks=checks,
            impl=cfg.impl,
        )

        if self.training and self.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += result.tokens_per_expert

        aux = zl = None
        if self.training and torch.is_grad_enabled():
            aux = self._aux_loss(logits_TE, seq_length, batch_size)
            if cfg.z_loss_coeff > 0:
                zl = z_loss(logits_TE, cfg.z_loss_coeff)
        probs_TK = result.topk_probs
        if aux is not None:
            probs_TK = AuxLossAutoScaler.apply(probs_TK, aux, self.aux_loss_scale)
        if zl is not None:
            probs_TK = AuxLossAutoScaler.apply(probs_TK, zl, self.aux_loss_scale)
        return dataclasses.replace(result, topk_probs=probs_TK.float(), aux_loss=aux, z_loss=zl)

    def _hash_forward(
        self, x_TH: torch.Tensor, token_ids: torch.Tensor | None, checks: bool | None
    ) -> RoutingResult:
        cfg = self.config
        if token_ids is None:
            raise ValueError(
                "token_ids is required when config.router_type='hash': pass the [T] (or [S, B]) "
                "int64 token ids of the tokens being routed"
            )
        check_tensor("token_ids", token_ids, dtypes=(torch.int64, torch.int32))
        if token_ids.numel() != x_TH.shape[0]:
            raise ValueError(
                f"token_ids has {token_ids.numel()} elements but hidden holds {x_TH.shape[0]} "
                f"tokens: pass one id per token"
            )
        from flexdispatch.routing.hash import hash_routing

        logits_TE = gating_linear(x_TH, self.weight, self.router_dtype, self.bias)
        return hash_routing(
            token_ids.reshape(-1),
            num_experts=cfg.num_experts,
            topk=cfg.topk,
            seed=cfg.hash_seed,
            logits=logits_TE,
            score_function=cfg.score_function,
            normalize_topk=cfg.normalize_topk,
            scaling_factor=cfg.scaling_factor,
            checks=checks,
        )

    def _aux_loss(
        self, logits_TE: torch.Tensor, seq_length: int, batch_size: int
    ) -> torch.Tensor | None:
        cfg = self.config
        if cfg.aux_loss_type == "none" or cfg.aux_loss_coeff == 0:
            return None
        k, E, T = cfg.topk, cfg.num_experts, logits_TE.shape[0]
        scores_TE, idx_TK = aux_loss_scores(logits_TE, topk=k, score_function=cfg.score_function)
        if cfg.aux_loss_type == "seq_aux_loss":
            return seq_aux_loss(
                scores_TE,
                idx_TK,
                topk=k,
                seq_length=seq_length,
                batch_size=batch_size,
                coeff=cfg.aux_loss_coeff,
            )
        counts_E = count_tokens_per_expert(idx_TK, E)
        if cfg.aux_loss_type == "aux_loss":
            return switch_aux_loss(
                scores_TE, counts_E, topk=k, num_tokens=T, coeff=cfg.aux_loss_coeff
            )
        # global_aux_loss
        world = 1
        if self.aux_loss_group is not None:
            with collective_guard("all_reduce (global aux loss counts)", self.aux_loss_group):
                dist.all_reduce(counts_E, group=self.aux_loss_group)
            world = dist.get_world_size(self.aux_loss_group)
        with torch.no_grad():
            self.global_tokens_per_expert += counts_E.to(self.global_tokens_per_expert.dtype)
            self.ga_steps += 1
        mean_counts_E = self.global_tokens_per_expert / self.ga_steps
        return global_aux_loss(
            scores_TE,
            mean_counts_E,
            topk=k,
            global_num_tokens=T * world,
            coeff=cfg.aux_loss_coeff,
        )

    # ------------------------------------------------------------------ state updates

    def reset_global_aux_loss_tracker(self) -> None:
        """Zero the running counts of ``global_aux_loss`` (call after each global batch)."""
        if self.config.aux_loss_type == "global_aux_loss":
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean(n) - n)``, then reset ``n``.

        ``n`` is ``local_tokens_per_expert`` (counts since the last update), all-reduced (sum)
        over ``group`` when one is given, so every rank of the group applies the same update.
        Call it once per global batch, on every rank of ``group``.

        Raises:
            ValueError: the router was built without ``enable_expert_bias``.
        """
        if self.expert_bias is None or self.local_tokens_per_expert is None:
            raise ValueError(
                "update_expert_bias needs config.enable_expert_bias=True (this router has no "
                "expert_bias)"
            )
        counts_E = self.local_tokens_per_expert.clone()
        if group is not None:
            with collective_guard("all_reduce (expert bias counts)", group):
                dist.all_reduce(counts_E, group=group)
        n_E = counts_E.to(torch.float32)
        offset_E = n_E.mean() - n_E
        self.expert_bias += self.config.bias_update_rate * torch.sign(offset_E)
        self.local_tokens_per_expert.zero_()
