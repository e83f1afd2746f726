"""Hardening tests: bad input, rank disagreement, peer failure, overflow, determinism, fuzzing.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R local
experts · k top-k · L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

This module also holds the one helper the failure tests share: ``spawn_recorded`` runs a function
on a spawned gloo group and has every rank write its outcome (ok, or the exception's type and
message, and how long it took) to a JSON file *before* the exception leaves the rank. A failed
group raises ``GroupError`` and loses the return values; the files survive, so a test can check
what each surviving rank saw after a peer raised, exited or was killed. ``make_routing`` builds the
routing families (uniform, skewed, all to one expert, drops, ids out of range, an empty rank) that
the conservation and fuzz tests share.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flexdispatch.launch import GroupError, spawn_group

__all__ = ["ROUTING_KINDS", "make_routing", "read_records", "spawn_recorded"]


def _recorded_call(out_dir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run ``fn(rank, R, *args)`` and record the outcome in ``out_dir/rank{r}.json``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    record: dict[str, Any] = {"rank": rank}
    try:
        result = fn(rank, world, *args)
        record.update(ok=True, elapsed=time.monotonic() - t0)
        return result
    except BaseException as exc:
        record.update(
            ok=False, type=type(exc).__name__, message=str(exc), elapsed=time.monotonic() - t0
        )
        raise
    finally:
        path = Path(out_dir) / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


def read_records(out_dir: Path) -> dict[int, dict[str, Any]]:
    """The outcome files ``spawn_recorded`` left, by rank (ranks that died wrote none)."""
    out = {}
    for path in sorted(out_dir.glob("rank*.json")):
        rec = json.loads(path.read_text())
        out[int(rec["rank"])] = rec
    return out


def spawn_recorded(
    fn: Callable[..., Any],
    world_size: int,
    out_dir: Path,
    *args: Any,
    ranks_per_node: int | None = None,
    pg_timeout: float,
    timeout: float,
) -> tuple[dict[int, dict[str, Any]], GroupError | None, float]:
    """Run ``fn(rank, R, *args)`` on ``world_size`` gloo ranks, recording every rank's outcome.

    Args:
        fn: a module-level (picklable) function.
        world_size: R.
        out_dir: an empty folder for the outcome files.
        *args: picklable arguments for every rank.
        ranks_per_node: L (default R).
        pg_timeout: the process-group timeout in seconds.
        timeout: the harness deadline for the whole group (every process is killed past it).

    Returns:
        ``(records by rank, the GroupError or None, wall seconds of the whole group)``.
    """
    t0 = time.monotonic()
    error: GroupError | None = None
    try:
        spawn_group(
            _recorded_call,
            world_size,
            args=(str(out_dir), fn, args),
            ranks_per_node=ranks_per_node,
            timeout_s=timeout,
            pg_timeout_s=pg_timeout,
        )
    except GroupError as exc:
        error = exc
    return read_records(out_dir), error, time.monotonic() - t0


# --------------------------------------------------------------------------- routings

ROUTING_KINDS = ("uniform", "skewed", "one-expert", "with-drops", "out-of-range", "empty")
"""Routing families shared by the conservation and fuzz tests (see ``make_routing``)."""


def make_routing(
    kind: str, seed: int, rank: int, *, T: int, E: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(topk_idx [T', k] int64, topk_probs [T', k] fp32)`` for ``kind``.

    Every process rebuilds every rank's routing from ``seed``. ``T' = T`` except for ``"empty"``
    (rank 1 has no tokens). Kinds: ``uniform`` (k distinct experts at random), ``skewed`` (expert
    ``x`` drawn with weight ``1 / (x + 1)^2``), ``one-expert`` (every token's first slot is
    expert 0, the rest as uniform; ``k = 1``: everything to expert 0), ``with-drops`` (uniform,
    ~30% of the slots ``-1``), ``out-of-range`` (some slots hold ids outside ``[-1, E)``, which
    dispatch treats as ``-1`` when checks are off). Probs are ``0`` where the id is not in
    ``[0, E)``.
    """
    if kind not in ROUTING_KINDS:
        raise ValueError(f"kind must be one of {ROUTING_KINDS}, got {kind!r}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + ROUTING_KINDS.index(kind))
    if kind == "empty" and rank == 1:
        T = 0
    if kind == "skewed":
        weights = 1.0 / (torch.arange(E, dtype=torch.float64) + 1) ** 2
        rows = [torch.multinomial(weights, k, generator=g) for _ in range(T)]
        idx = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)
    else:
        idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].to(torch.int64)
    if kind == "one-expert":
        # put expert 0 first and keep the other slots distinct from it
        has0 = (idx == 0).any(1, keepdim=True)
        first = idx[:, :1].clone()
        idx[:, :1] = 0
        rest = idx[:, 1:]
        idx[:, 1:] = torch.where(~has0 & (rest == 0), first, rest)
        idx[:, 1:] = torch.where(has0 & (rest == 0), first, idx[:, 1:])
    if kind == "with-drops":
        idx = idx.masked_fill(torch.rand(T, k, generator=g) < 0.3, -1)
    if kind == "out-of-range":
        junk = torch.randint(E, 3 * E, (T, k), generator=g)
        junk = torch.where(torch.rand(T, k, generator=g) < 0.5, junk, -junk)
        idx = torch.where(torch.rand(T, k, generator=g) < 0.25, junk, idx)
    probs = torch.rand(T, k, generator=g)
    probs = probs.masked_fill((idx < 0) | (idx >= E), 0.0)
    return idx, probs
