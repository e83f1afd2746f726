"""``SharedExperts``: the dense MLP(s) every token runs beside the routed experts."""

from __future__ import annotations

import math

import torch
from torch import nn

from flexdispatch._checks.tensors import check_tensor
from flexdispatch._checks.values import check_int
from flexdispatch.experts.activations import GATED_ACTIVATIONS, _check_activation, apply_activation
from flexdispatch.experts.init import draw_into, expert_draws, expert_generator, expert_seed


class SharedExperts(nn.Module):
    """The shared experts of a layer, fused into one dense MLP that every token goes through.

    ``y = act(x @ w1, x @ w3) @ w2`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3`` ``[H, F]``
    (gated activations only), F the fused hidden size (``num_shared_experts`` experts of F_s
    concatenated along F are this one MLP of ``F = num_shared_experts * F_s``). With ``gate``,
    a ``Linear(H, 1)`` without bias scales the output: ``y * sigmoid(x @ gate_weight.T)``
    (Qwen2-MoE's ``shared_expert_gate``); the gate is computed in fp32.

    Weights come from ``reset_parameters_from_seed(seed, expert_id)`` (at construction with the
    ``seed`` and ``expert_id`` given there), drawn on the parameters' device: the MLP weights
    are ``init_expert_weights(expert_id, seed, ffn_hidden_size=F, device=device)``
    (``MoELayer`` passes ``expert_id = E``, the id after the routed experts, so no routed expert
    shares a stream) and the gate weight is drawn uniform in ``±1/sqrt(H)`` from a generator
    on the device seeded with ``expert_seed(expert_id + 1, seed)``. Nothing is drawn on the
    meta device.

    Args:
        hidden_size: H.
        ffn_hidden_size: F of the fused MLP.
        activation, swiglu_limit, swiglu_alpha: as ``GroupedExperts``.
        gate: add the sigmoid gate.
        dtype, device: of the parameters (inputs must match).
        seed, expert_id: of the construction-time ``reset_parameters_from_seed``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        swiglu_limit: float | None = None,
        swiglu_alpha: float | None = None,
        gate: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int = 0,
        expert_id: int = 0,
    ) -> None:
        super().__init__()
        _check_activation(activation, swiglu_limit, swiglu_alpha)
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            check_int(name, value, at_least=1, rule="a positive int")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        kw = {"dtype": dtype, "device": device}
        H, F_ = hidden_size, ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(H, F_, **kw))
        self.w2 = nn.Parameter(torch.empty(F_, H, **kw))
        if activation in GATED_ACTIVATIONS:
            self.w3 = nn.Parameter(torch.empty(H, F_, **kw))
        else:
            self.register_parameter("w3", None)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, H, **kw))
        else:
            self.register_parameter("gate_weight", None)
        self.reset_parameters_from_seed(seed, expert_id)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation!r}, gate={self.gate_weight is not None}"
        )

    @torch.no_grad()
    def reset_parameters_from_seed(self, seed: int, expert_id: int) -> None:
        """Set the weights from ``seed`` and ``expert_id`` (see the class docstring)."""
        device = self.w1.device
        expert_seed(expert_id + 1, seed)  # NOTE: the argument check, on meta too
        if device.type == "meta":
            return
        gen = expert_generator(expert_id, seed, device)
        draws = expert_draws(
            self.hidden_size, self.ffn_hidden_size, gated=self.w3 is not None, bias=False
        )
        scratch: dict[tuple[int, ...], torch.Tensor] = {}
        for name, _, bound in draws:
            draw_into(getattr(self, name), bound, gen, scratch)
        if self.gate_weight is not None:
            gen = expert_generator(expert_id + 1, seed, device)
            draw_into(self.gate_weight, 1 / math.sqrt(self.hidden_size), gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` → ``[T, H]`` in ``x``'s dtype."""
        check_tensor("x", x, ndim=2, floating=True)
        if x.shape[1] != self.hidden_size:
            raise ValueError(
                f"x has {x.shape[1]} columns but the shared experts were built with "
                f"hidden_size={self.hidden_size}"
            )
        b = None if self.w3 is None else x @ self.w3
        a = x @ self.w1
        y = apply_activation(
            a, b, self.activation, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha
        )
        y = y @ self.w2
        if self.gate_weight is None:
            return y
        g = torch.sigmoid(x.float() @ self.gate_weight.float().t())
        return (y.float() * g).to(x.dtype)
