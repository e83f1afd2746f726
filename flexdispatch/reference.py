"""Slow, obviously-correct single-process references used by the demo and the tests.

T tokens · H hidden · F expert hidden · E experts · k top-k.
"""

from __future__ import annotations

import torch

from flexdispatch.experts import ACTIVATIONS, apply_activation

__all__ = ["expert_mlp", "dense_moe_reference"]


def expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    activation: str,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    b3: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """One expert's MLP on ``x`` ``[n, H]`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3``
    ``[H, F]`` (gated activations only) and optional biases ``b1`` ``[F]``, ``b2`` ``[H]``,
    ``b3`` ``[F]``: ``act(x w1 + b1, x w3 + b3) w2 + b2`` (``ACTIVATIONS`` in
    ``flexdispatch.experts`` defines ``act``). Returns ``[n, H]``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: use one of {ACTIVATIONS}")
    a = x @ w1
    if b1 is not None:
        a = a + b1
    b = None
    if w3 is not None:
        b = x @ w3
        if b3 is not None:
            b = b + b3
    h = apply_activation(a, b, activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    y = h @ w2
    return y if b2 is None else y + b2


def _pick(t: tuple[torch.Tensor, ...] | None, e: int) -> torch.Tensor | None:
    return None if t is None else t[e]


def _unbind(t: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
    # NOTE: one unbind per weight, not one index per expert: the backward of ``t[e]`` writes a
    # zero-filled [E, ...] gradient for every expert (quadratic in E), unbind's stacks them once.
    return None if t is None else t.unbind(0)


def dense_moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    activation: str,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    b3: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
    probs_on_input: bool = False,
    shared_w1: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_w3: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * expert_{idx[t, j]}(x[t]) + shared(x[t])`` over the valid
    slots.

    Args:
        x: ``[T, H]`` tokens.
        topk_idx: ``[T, k]`` int64 global expert ids, ``-1`` = dropped.
        topk_probs: ``[T, k]`` float32 weights.
        w1, w2, w3: all experts' weights, ``[E, H, F]``, ``[E, F, H]``, ``[E, H, F]`` or None.
        activation: one of ``flexdispatch.experts.ACTIVATIONS``.
        b1, b2, b3: all experts' biases ``[E, F]``, ``[E, H]``, ``[E, F]``, or None.
        swiglu_limit, swiglu_alpha: the gated activations' clamp and slope.
        probs_on_input: the weight scales the expert's input, ``expert(p * x[t])`` (Llama-4).
        shared_w1, shared_w2, shared_w3: the fused shared-expert MLP ``[H, Fs]``, ``[Fs, H]``,
            ``[H, Fs]`` (same activation), or None for no shared experts.
        shared_gate_weight: ``[1, H]``: the shared output is scaled by
            ``sigmoid(x[t] . gate)`` (computed in fp32), or None.

    Returns:
        ``[T, H]`` in ``x``'s dtype; computed expert by expert (each expert sees its rows in token
        order), accumulated in fp32.
    """
    act = {"swiglu_limit": swiglu_limit, "swiglu_alpha": swiglu_alpha}
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    w1s, w2s, w3s = w1.unbind(0), w2.unbind(0), _unbind(w3)
    b1s, b2s, b3s = _unbind(b1), _unbind(b2), _unbind(b3)
    for expert in range(w1.shape[0]):
        tok, slot = (topk_idx == expert).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        p = topk_probs[tok, slot].unsqueeze(-1).float()
        xin = x[tok]
        if probs_on_input:
            xin = (xin.float() * p).to(x.dtype)
        y = expert_mlp(
            xin,
            w1s[expert],
            w2s[expert],
            _pick(w3s, expert),
            activation,
            b1=_pick(b1s, expert),
            b2=_pick(b2s, expert),
            b3=_pick(b3s, expert),
            **act,
        )
        y = y.float() if probs_on_input else y.float() * p
        out = out.index_add(0, tok, y)
    if shared_w1 is not None:
        if shared_w2 is None:
            raise ValueError("shared_w1 needs shared_w2")
        s = expert_mlp(x, shared_w1, shared_w2, shared_w3, activation, **act).float()
        if shared_gate_weight is not None:
            s = s * torch.sigmoid(x.float() @ shared_gate_weight.float().t())
        out = out + s
    return out.to(x.dtype)
