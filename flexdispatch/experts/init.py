"""Expert weights as a pure function of a seed and the global expert id."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexdispatch.experts.activations import ACTIVATIONS, GATED_ACTIVATIONS

_SEED_STRIDE = 1_000_003


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    """The weights of one expert.

    Attributes:
        w1: ``[H, F]`` input projection (the gate for swiglu).
        w2: ``[F, H]`` output projection.
        w3: ``[H, F]`` up projection for the gated activations, None for the others.
        b1, b2, b3: biases ``[F]``, ``[H]``, ``[F]`` of the three projections (``bias=True``;
            ``b3`` only with ``w3``), else None.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor | None
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    b3: torch.Tensor | None = None


def expert_seed(global_expert_id: int, seed: int) -> int:
    """The generator seed of one expert: ``seed * 1_000_003 + global_expert_id``."""
    if global_expert_id < 0 or seed < 0:
        raise ValueError(
            f"global_expert_id ({global_expert_id}) and seed ({seed}) must be non-negative"
        )
    return seed * _SEED_STRIDE + global_expert_id


def _uniform(
    shape: tuple[int, ...], bound: float, generator: torch.Generator | None
) -> torch.Tensor:
    # NOTE: always drawn in fp32 on the CPU, then cast/moved by the caller, so the values do not
    # depend on the target device or dtype.
    return torch.rand(shape, generator=generator, dtype=torch.float32).mul_(2 * bound).sub_(bound)


def init_expert_weights(
    global_expert_id: int,
    seed: int,
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    activation: str = "swiglu",
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ExpertWeights:
    """Weights of global expert ``g`` drawn from ``torch.Generator().manual_seed(seed * 1_000_003
    + g)``, independent of which rank holds the expert.

    Scheme: ``w1`` (then ``w2``, then ``w3`` for a gated activation) drawn in that order, then
    with ``bias`` ``b1``, ``b2``, ``b3`` (same bounds as their weights), in fp32 on the CPU,
    uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` with ``fan_in = H`` for ``w1``/``w3`` and
    ``F`` for ``w2`` (``nn.Linear``'s default bound), then cast to ``dtype`` and moved to
    ``device``. ``w1`` and ``w2`` are the same for every activation given the same seed.

    Args:
        global_expert_id: g, the expert's id among all E experts (>= 0).
        seed: the model-wide seed (>= 0).
        hidden_size: H.
        ffn_hidden_size: F.
        activation: one of ``ACTIVATIONS``; only the gated ones get a ``w3``.
        bias: also draw the projection biases (after the weights, which are unchanged).
        dtype: dtype of the returned tensors.
        device: device of the returned tensors (default CPU).

    Returns:
        ``ExpertWeights`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3`` ``[H, F]`` or None.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
    if hidden_size <= 0 or ffn_hidden_size <= 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) and ffn_hidden_size ({ffn_hidden_size}) must be positive"
        )
    gen = torch.Generator().manual_seed(expert_seed(global_expert_id, seed))
    H, F_ = hidden_size, ffn_hidden_size
    w1 = _uniform((H, F_), 1 / math.sqrt(H), gen)
    w2 = _uniform((F_, H), 1 / math.sqrt(F_), gen)
    gated = activation in GATED_ACTIVATIONS
    w3 = _uniform((H, F_), 1 / math.sqrt(H), gen) if gated else None
    b1 = b2 = b3 = None
    if bias:
        b1 = _uniform((F_,), 1 / math.sqrt(H), gen)
        b2 = _uniform((H,), 1 / math.sqrt(F_), gen)
        b3 = _uniform((F_,), 1 / math.sqrt(H), gen) if gated else None

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype)

    return ExpertWeights(
        w1=w1.to(device=device, dtype=dtype),
        w2=w2.to(device=device, dtype=dtype),
        w3=cast(w3),
        b1=cast(b1),
        b2=cast(b2),
        b3=cast(b3),
    )
