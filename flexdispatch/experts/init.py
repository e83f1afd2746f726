"""Expert weights as a pure function of a seed and the global expert id."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexdispatch._checks.values import check_int
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


MAX_SEED = ((1 << 64) - 1 - (1 << 31)) // _SEED_STRIDE
"""Largest model-wide seed: ``seed * 1_000_003 + global_expert_id`` (any id below 2**31, the
shared experts' included) stays below 2**64, the range of ``torch.Generator.manual_seed``."""


def check_seed(seed: object) -> int:
    """``seed`` as a model-wide seed (an int in ``[0, MAX_SEED]``, not a bool).

    Raises:
        ValueError: naming the range and why.
    """
    rule = (
        f"an int in [0, {MAX_SEED}] (each expert's generator is seeded with seed * 1000003 + "
        f"its id, below 2**64)"
    )
    return check_int("seed", seed, at_least=0, at_most=MAX_SEED, rule=rule)


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
    # NOTE: fp32 on the generator's device (the CPU for None), cast by the caller, so the values
    # do not depend on the target dtype.
    device = None if generator is None else generator.device
    return (
        torch.rand(shape, generator=generator, dtype=torch.float32, device=device)
        .mul_(2 * bound)
        .sub_(bound)
    )


def expert_generator(
    global_expert_id: int, seed: int, device: torch.device | str | None = None
) -> torch.Generator:
    """A generator on ``device`` (default CPU) seeded with ``expert_seed(global_expert_id,
    seed)``: the stream of one expert's draws."""
    device = torch.device("cpu" if device is None else device)
    return torch.Generator(device=device).manual_seed(expert_seed(global_expert_id, seed))


def expert_draws(
    hidden_size: int, ffn_hidden_size: int, *, gated: bool, bias: bool
) -> tuple[tuple[str, tuple[int, ...], float], ...]:
    """``(name, shape, bound)`` of one expert's tensors, in the order they are drawn: ``w1``,
    ``w2``, ``w3`` (gated), then with ``bias`` ``b1``, ``b2``, ``b3`` (gated); the bound is
    ``1/sqrt(fan_in)``, ``fan_in = H`` for ``w1``/``w3``/``b1``/``b3`` and ``F`` for
    ``w2``/``b2``."""
    H, F_ = hidden_size, ffn_hidden_size
    bh, bf = 1 / math.sqrt(H), 1 / math.sqrt(F_)
    out: list[tuple[str, tuple[int, ...], float]] = [("w1", (H, F_), bh), ("w2", (F_, H), bf)]
    if gated:
        out.append(("w3", (H, F_), bh))
    if bias:
        out += [("b1", (F_,), bh), ("b2", (H,), bf)]
        if gated:
            out.append(("b3", (F_,), bh))
    return tuple(out)


def draw_into(
    dst: torch.Tensor,
    bound: float,
    generator: torch.Generator,
    scratch: dict[tuple[int, ...], torch.Tensor] | None = None,
) -> None:
    """Fill ``dst`` (on the generator's device) with ``U(-bound, bound)`` drawn in fp32: straight
    into ``dst`` when it is contiguous fp32 (no temporary), else into an fp32 buffer (kept in
    ``scratch`` per shape, reused across experts) that is then cast into ``dst``. Same values as
    ``_uniform(dst.shape, bound, generator).to(dst.dtype)``."""
    dst = dst.detach()  # NOTE: ``out=`` and ``copy_`` refuse a leaf that requires grad
    shape = tuple(dst.shape)
    direct = dst.dtype == torch.float32 and dst.is_contiguous()
    if direct:
        buf = dst
    else:
        buf = None if scratch is None else scratch.get(shape)
        if buf is None:
            buf = torch.empty(shape, dtype=torch.float32, device=dst.device)
            if scratch is not None:
                scratch[shape] = buf
    torch.rand(shape, generator=generator, dtype=torch.float32, device=dst.device, out=buf)
    buf.mul_(2 * bound).sub_(bound)
    if not direct:
        dst.copy_(buf)


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
    """Weights of global expert ``g`` drawn on ``device`` from ``torch.Generator(device)
    .manual_seed(seed * 1_000_003 + g)``, independent of which rank holds the expert.

    Scheme: ``w1`` (then ``w2``, then ``w3`` for a gated activation) drawn in that order, then
    with ``bias`` ``b1``, ``b2``, ``b3`` (same bounds as their weights), in fp32 on ``device``,
    uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` with ``fan_in = H`` for ``w1``/``w3`` and
    ``F`` for ``w2`` (``nn.Linear``'s default bound), then cast to ``dtype``. ``w1`` and ``w2``
    are the same for every activation given the same seed.

    The values depend on the seed, ``g`` and the device's generator, never on the expert split
    or the dtype: on the CPU (the default) they are those of a CPU generator; on a GPU those of
    that device's generator (the same for every GPU of one model; torch's CUDA generator
    differs from the CPU one, so a CUDA layer and a CPU layer built from one seed differ).
    Nothing is drawn on the CPU for a GPU device, and nothing at all for ``device="meta"``
    (the tensors are then shapes only).

    Args:
        global_expert_id: g, the expert's id among all E experts (>= 0).
        seed: the model-wide seed (>= 0).
        hidden_size: H.
        ffn_hidden_size: F.
        activation: one of ``ACTIVATIONS``; only the gated ones get a ``w3``.
        bias: also draw the projection biases (after the weights, which are unchanged).
        dtype: dtype of the returned tensors.
        device: device the tensors are drawn on and returned on (default CPU).

    Returns:
        ``ExpertWeights`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3`` ``[H, F]`` or None.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
    if hidden_size <= 0 or ffn_hidden_size <= 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) and ffn_hidden_size ({ffn_hidden_size}) must be positive"
        )
    device = torch.device("cpu" if device is None else device)
    draws = expert_draws(
        hidden_size, ffn_hidden_size, gated=activation in GATED_ACTIVATIONS, bias=bias
    )
    if device.type == "meta":
        got = {n: torch.empty(shape, dtype=dtype, device=device) for n, shape, _ in draws}
        expert_seed(global_expert_id, seed)  # NOTE: the same argument check
    else:
        gen = expert_generator(global_expert_id, seed, device)
        got = {}
        for name, shape, bound in draws:
            got[name] = torch.empty(shape, dtype=dtype, device=device)
            draw_into(got[name], bound, gen)
    return ExpertWeights(
        w1=got["w1"],
        w2=got["w2"],
        w3=got.get("w3"),
        b1=got.get("b1"),
        b2=got.get("b2"),
        b3=got.get("b3"),
    )
