"""Slow, obviously-correct single-process references used by the demo and the tests.

T tokens · H hidden · F expert hidden · E experts · k top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["expert_mlp", "dense_moe_reference"]


def expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """One expert's MLP on ``x`` ``[n, H]`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3``
    ``[H, F]`` (swiglu only). Returns ``[n, H]``."""
    h = x @ w1
    if activation == "swiglu":
        if w3 is None:
            raise ValueError("activation 'swiglu' needs w3")
        h = F.silu(h) * (x @ w3)
    elif activation == "silu":
        h = F.silu(h)
    elif activation == "gelu":
        h = F.gelu(h)
    elif activation == "relu":
        h = F.relu(h)
    else:
        raise ValueError(f"unknown activation {activation!r}: use swiglu, silu, gelu or relu")
    return h @ w2


def dense_moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * expert_{idx[t, j]}(x[t])`` over the valid slots.

    Args:
        x: ``[T, H]`` tokens.
        topk_idx: ``[T, k]`` int64 global expert ids, ``-1`` = dropped.
        topk_probs: ``[T, k]`` float32 weights.
        w1, w2, w3: all experts' weights, ``[E, H, F]``, ``[E, F, H]``, ``[E, H, F]`` or None.
        activation: swiglu, silu, gelu or relu.

    Returns:
        ``[T, H]`` in ``x``'s dtype; computed expert by expert (each expert sees its rows in token
        order), accumulated in fp32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w1.shape[0]):
        tok, slot = (topk_idx == expert).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_mlp(
            x[tok], w1[expert], w2[expert], None if w3 is None else w3[expert], activation
        )
        out = out.index_add(0, tok, y.float() * topk_probs[tok, slot].unsqueeze(-1))
    return out.to(x.dtype)
