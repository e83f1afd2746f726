"""The expert MLP activations (``ACTIVATIONS``) and ``act(a, b)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS: tuple[str, ...] = ("swiglu", "swiglu_oai", "gelu", "relu", "relu2", "silu")
"""Names accepted for ``activation``. With ``a = x @ w1 (+ b1)`` (the gate) and ``b = x @ w3
(+ b3)`` (the up projection) the expert is ``act(a, b) @ w2 (+ b2)`` where ``act`` is:

- ``swiglu``: ``silu(a) * b``; with ``swiglu_limit`` L, ``a`` is first clamped to ``<= L`` and
  ``b`` to ``[-L, L]``;
- ``swiglu_oai`` (gpt-oss): ``a' = min(a, L)``, ``b' = clamp(b, -L, L)``,
  ``a' * sigmoid(alpha * a') * (b' + 1)`` (``swiglu_limit`` L required, ``swiglu_alpha``
  default 1.702);
- ``gelu`` (exact, erf-based), ``relu``, ``silu``: ``act(a)``; ``relu2``: ``relu(a) ** 2``.

Only the two gated ones (``GATED_ACTIVATIONS``) have ``w3``."""

GATED_ACTIVATIONS: tuple[str, ...] = ("swiglu", "swiglu_oai")
_OAI_DEFAULT_ALPHA = 1.702


def _check_activation(
    activation: str, swiglu_limit: float | None = None, swiglu_alpha: float | None = None
) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
    if swiglu_limit is not None:
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"swiglu_limit={swiglu_limit} applies to {GATED_ACTIVATIONS}, not "
                f"activation={activation!r}"
            )
        if not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {swiglu_limit}")
    if activation == "swiglu_oai" and swiglu_limit is None:
        raise ValueError("activation='swiglu_oai' needs swiglu_limit (gpt-oss: 7.0)")
    if swiglu_alpha is not None:
        if activation != "swiglu_oai":
            raise ValueError(
                f"swiglu_alpha={swiglu_alpha} belongs to activation='swiglu_oai', not "
                f"{activation!r}"
            )
        if not swiglu_alpha > 0:
            raise ValueError(f"swiglu_alpha must be positive, got {swiglu_alpha}")


def apply_activation(
    a: torch.Tensor,
    b: torch.Tensor | None,
    activation: str,
    *,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """``act(a, b)`` of ``ACTIVATIONS``: ``a`` the gate projection, ``b`` the up projection
    (gated activations only, else None). Shapes are equal; the result has their shape."""
    if activation in GATED_ACTIVATIONS:
        if b is None:
            raise ValueError(f"activation {activation!r} needs the up projection (w3)")
        if swiglu_limit is not None:
            a = a.clamp(max=swiglu_limit)
            b = b.clamp(min=-swiglu_limit, max=swiglu_limit)
        if activation == "swiglu":
            return F.silu(a) * b
        if swiglu_limit is None:
            raise ValueError("activation='swiglu_oai' needs swiglu_limit")
        alpha = _OAI_DEFAULT_ALPHA if swiglu_alpha is None else swiglu_alpha
        return a * torch.sigmoid(alpha * a) * (b + 1)
    if activation == "silu":
        return F.silu(a)
    if activation == "gelu":
        return F.gelu(a)
    if activation == "relu":
        return F.relu(a)
    if activation == "relu2":
        return F.relu(a).square()
    raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
