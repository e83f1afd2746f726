"""Spawn a gloo process group, run a function on every rank, collect results or tracebacks.

R ranks, each a fresh process (start method ``spawn``), rendezvous over TCP on a free port of
127.0.0.1. A worker returns a picklable value; a worker that raises sends its traceback back. The
parent raises ``RuntimeError`` naming every failed rank, or ``TimeoutError`` (after killing every
process) when the group does not finish in time.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run_group"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str] | None,
    pg_timeout_s: float,
    results: Any,
) -> None:
    # NOTE: each worker is its own process, so setting its environment here is local to it.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(env or {})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything to the parent, even SystemExit
        results.put((rank, False, traceback.format_exc()))


def run_group(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks.
        *args: picklable arguments passed to every rank.
        timeout: seconds for the whole group; then every process is killed and TimeoutError raised.
        env: extra environment variables for every worker (e.g. ``LOCAL_WORLD_SIZE``).
        pg_timeout: process-group timeout in seconds (default: ``timeout``), so a hung collective
            fails inside the worker with a traceback before the parent gives up.

    Returns:
        The return values, indexed by rank.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, env, pg_timeout or timeout, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"process group of {world_size} did not finish in {timeout:.0f} s; ranks "
                    f"done: {sorted(got)}; failures so far: "
                    + "".join(f"\n--- rank {r}:\n{v}" for r, (ok, v) in got.items() if not ok)
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)
                ]
                if dead:
                    # NOTE: a worker that died without reporting (killed, segfault) cannot answer.
                    time.sleep(0.5)
                    if results.empty():
                        raise RuntimeError(
                            f"rank(s) {dead} exited with codes "
                            f"{[procs[r].exitcode for r in dead]} without a result"
                        ) from None
                continue
            got[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        details = "".join(f"\n--- rank {r}:\n{tb}" for r, tb in sorted(failed.items()))
        raise RuntimeError("rank(s) failed:" + details)
    return [got[r][1] for r in range(world_size)]
