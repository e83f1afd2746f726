"""The cases both serving-engine plug-in tests run (tests/dist/test_vllm.py, test_sglang.py):
inputs every rank can build for every rank (one seed per rank), the experts' weights (one seed)
and the dense per-token reference, independent of both engines and of flexdispatch.

A case is a dict: ``E`` experts, ``K`` top-k, ``H`` hidden (64), ``F`` expert hidden (32),
``T`` tokens per rank (a list; 6 each), ``dropped`` {rank: [(token, slot), ...]} slots set to
``-1``, ``all_to_rank0`` (every token's experts on rank 0), ``on_input`` (top-1, the router
weight applied to the input).

T tokens on a rank · H hidden · F expert hidden · E experts · k top-k · R ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``w13`` ``[2F, H]`` (gate rows, then up rows), ``w2`` ``[H, F]``, SiLU-gated."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def case_inputs(case: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tokens, ids (``-1`` slots as the case asks) and weights; every rank can
    build every rank's (one seed per rank)."""
    R = dist.get_world_size()
    E, K, H = case["E"], case["K"], case.get("H", 64)
    T = case.get("T", [6] * R)[rank]
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, H, generator=gen)
    pool = E // R if case.get("all_to_rank0") else E
    ids = torch.rand(T, pool, generator=gen).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=gen) + 0.1
    if K > 1:
        w = w / w.sum(1, keepdim=True)
    for t, j in case.get("dropped", {}).get(rank, []):
        ids[t, j] = -1
        w[t, j] = 0.0
    return {"x": x, "ids": ids, "w": w}


def weights(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's ``w13`` ``[E, 2F, H]`` and ``w2`` ``[E, H, F]`` (one seed)."""
    E, H, Fh = case["E"], case.get("H", 64), case.get("F", 32)
    gen = torch.Generator().manual_seed(7)
    return (
        torch.randn(E, 2 * Fh, H, generator=gen) * 0.1,
        torch.randn(E, H, Fh, generator=gen) * 0.1,
    )


def dense_reference(
    inp: dict[str, torch.Tensor], w13: torch.Tensor, w2: torch.Tensor, *, on_input: bool = False
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` token by token (``-1`` skipped);
    with ``on_input`` (top-1) ``expert(w[t, 0] * x[t])``."""
    out = torch.zeros_like(inp["x"])
    for t in range(inp["x"].shape[0]):
        for j in range(inp["ids"].shape[1]):
            i = int(inp["ids"][t, j])
            if i < 0:
                continue
            if on_input:
                out[t] += mlp(inp["w"][t, j] * inp["x"][t : t + 1], w13[i], w2[i])[0]
            else:
                out[t] += inp["w"][t, j] * mlp(inp["x"][t : t + 1], w13[i], w2[i])[0]
    return out


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` (0 for empty tensors)."""
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
