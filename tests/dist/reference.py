"""Inputs every rank can rebuild from one seed, and slow per-token references of the contract.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

Nothing here communicates: every rank builds every rank's inputs and computes what it must
receive and what combine must return with plain Python loops over tokens and slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CASES = ("random", "empty_rank", "all_dropped", "receives_nothing")


@dataclass(frozen=True)
class Inputs:
    """One rank's dispatch inputs: ``x [T, H]``, ``idx [T, k]`` int64, ``probs [T, k]`` fp32."""

    x: torch.Tensor
    idx: torch.Tensor
    probs: torch.Tensor


def make_inputs(
    seed: int,
    rank: int,
    *,
    R: int,
    E: int,
    k: int,
    H: int,
    case: str = "random",
    dtype: torch.dtype = torch.float32,
    exact: bool = True,
) -> Inputs:
    """Rank ``rank``'s inputs for ``case`` (see ``CASES``), identical on every process.

    ``exact`` rows are ``rank * 1000 + t + col / 4`` (they identify their source and sum exactly
    in fp32); otherwise random normal values.
    """
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    T = 5 + 2 * rank
    if case == "empty_rank" and rank == 1 % R:
        T = 0
    e = E // R
    high = E - e if case == "receives_nothing" else E  # no expert of the last rank
    idx = torch.rand(T, high, generator=g).argsort(1)[:, :k].to(torch.int64)
    drop = torch.rand(T, k, generator=g) < 0.25
    if case == "all_dropped" and rank == 0:
        drop[:] = True
    idx = idx.masked_fill(drop, -1)
    probs = torch.rand(T, k, generator=g).masked_fill(idx < 0, 0.0)
    if exact:
        t = torch.arange(T, dtype=torch.float32)[:, None]
        col = torch.arange(H, dtype=torch.float32)[None, :] / 4
        x = rank * 1000 + t + col
    else:
        x = torch.randn(T, H, generator=g)
    return Inputs(x=x.to(dtype), idx=idx, probs=probs)


def all_inputs(seed: int, **kw: object) -> list[Inputs]:
    """Every rank's inputs (``R`` taken from ``kw``)."""
    return [make_inputs(seed, r, **kw) for r in range(int(kw["R"]))]  # type: ignore[arg-type]


def dests(idx_row: list[int], e: int) -> list[int]:
    """Ranks holding at least one expert of a token, ascending (each once)."""
    return sorted({i // e for i in idx_row if i >= 0})


@dataclass(frozen=True)
class RefDispatch:
    """What rank ``me`` must receive (rows in source-rank, source-token order)."""

    x: torch.Tensor  # [M, H]
    idx: torch.Tensor  # [M, k] local ids / -1
    probs: torch.Tensor  # [M, k]
    counts: torch.Tensor  # [e] int64
    sources: list[tuple[int, int]]  # (source rank, token) per row


def ref_dispatch(inputs: list[Inputs], me: int, E: int) -> RefDispatch:
    """Slow reference of dispatch at rank ``me``."""
    R = len(inputs)
    e = E // R
    k = inputs[0].idx.shape[1]
    H = inputs[0].x.shape[1]
    rows, ids, prs, srcs = [], [], [], []
    counts = [0] * e
    for s, inp in enumerate(inputs):
        for t in range(inp.x.shape[0]):
            row = inp.idx[t].tolist()
            if me not in dests(row, e):
                continue
            loc = [i - me * e if i >= 0 and i // e == me else -1 for i in row]
            pr = [float(inp.probs[t, j]) if loc[j] >= 0 else 0.0 for j in range(k)]
            for j in loc:
                if j >= 0:
                    counts[j] += 1
            rows.append(inp.x[t])
            ids.append(loc)
            prs.append(pr)
            srcs.append((s, t))
    dtype = inputs[0].x.dtype
    return RefDispatch(
        x=torch.stack(rows) if rows else torch.zeros(0, H, dtype=dtype),
        idx=torch.tensor(ids, dtype=torch.int64).reshape(-1, k),
        probs=torch.tensor(prs, dtype=torch.float32).reshape(-1, k),
        counts=torch.tensor(counts, dtype=torch.int64),
        sources=srcs,
    )


def expert_fn(x: torch.Tensor, probs: torch.Tensor, rank: int) -> torch.Tensor:
    """The "experts" of rank ``rank``: ``x * (rank + 1) * (1 + sum_j probs_j * (j + 1))``.

    Uses every slot's prob (also slots that are ``-1`` here), so a gradient that leaks into
    another rank's slots shows up in the probs gradient.
    """
    c = torch.arange(1, probs.shape[-1] + 1, dtype=torch.float32)
    return x * (rank + 1) * (1 + (probs * c).sum(-1, keepdim=True)).to(x.dtype)


def ref_combine(
    inp: Inputs, E: int, R: int, x: torch.Tensor | None = None, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Slow reference of ``combine(expert_fn(dispatch(...)))`` for one source rank's tokens.

    ``x`` / ``probs`` override the inputs (leaf tensors for autograd references).
    """
    x = inp.x if x is None else x
    probs = inp.probs if probs is None else probs
    e = E // R
    out = []
    for t in range(inp.x.shape[0]):
        row = inp.idx[t].tolist()
        acc = torch.zeros_like(x[t])
        for r in dests(row, e):
            keep = torch.tensor([i >= 0 and i // e == r for i in row])
            acc = acc + expert_fn(x[t], torch.where(keep, probs[t], 0.0), r)
        out.append(acc)
    return torch.stack(out) if out else torch.zeros_like(x)


def pair_counts(inputs: list[Inputs], E: int) -> list[list[int]]:
    """``C[s][g]``: tokens of rank ``s`` with an expert on rank ``g``."""
    R = len(inputs)
    e = E // R
    C = [[0] * R for _ in range(R)]
    for s, inp in enumerate(inputs):
        for t in range(inp.idx.shape[0]):
            for g in dests(inp.idx[t].tolist(), e):
                C[s][g] += 1
    return C


def node_counts(inputs: list[Inputs], E: int, L: int) -> list[list[int]]:
    """``NC[s][n]``: tokens of rank ``s`` with an expert on node ``n``."""
    R = len(inputs)
    e = E // R
    NC = [[0] * (R // L) for _ in range(R)]
    for s, inp in enumerate(inputs):
        for t in range(inp.idx.shape[0]):
            for n in sorted({g // L for g in dests(inp.idx[t].tolist(), e)}):
                NC[s][n] += 1
    return NC


def worst_needed(inputs: list[Inputs], E: int, L: int, hierarchical: bool) -> int:
    """Smallest W (a multiple of R) that the flat or hierarchical torch dispatch accepts."""
    R = len(inputs)
    N = R // L
    C = pair_counts(inputs, E)
    need = R * max(max(row) for row in C)
    if hierarchical:
        NC = node_counts(inputs, E, L)
        need = N * max(max(row) for row in NC)
        for f in range(R):
            for j in range(L):
                g = (f // L) * L + j
                need = max(need, L * sum(C[n * L + f % L][g] for n in range(N)))
    return -(-need // R) * R
