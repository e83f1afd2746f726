"""Spawn a simulated expert-parallel group on one machine (gloo on 127.0.0.1).

Used by ``flexdispatch demo``/``bench`` and by the multi-process tests: every rank is a real
process with a real ``torch.distributed`` process group, the rendezvous uses a free TCP port on
127.0.0.1, and nothing can hang — a deadline kills the whole group.

R ranks · L ranks per node (exported as ``LOCAL_WORLD_SIZE``, as torchrun does).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GroupError", "free_port", "spawn_group", "under_launcher"]


class GroupError(RuntimeError):
    """One or more ranks of a spawned group failed, died or timed out.

    Attributes:
        errors: rank → the failure text (a traceback, an exit code, or "timed out").
    """

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    ranks_per_node: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % ranks_per_node),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "GROUP_RANK": str(rank // ranks_per_node),
        }
    )
    torch.set_num_threads(max(1, int(env.get("FLEXDISPATCH_THREADS", "1"))))
    try:
        if backend == "nccl":
            # NOTE: every rank runs on this machine (simulated nodes included): rank i on
            # cuda:i, bound before NCCL builds its communicator.
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, _dumps(result)))
    except BaseException:  # reported to the parent, which raises
        out.put((rank, False, traceback.format_exc()))


def spawn_group(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    ranks_per_node: int | None = None,
    timeout_s: float = 120.0,
    pg_timeout_s: float | None = None,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes joined in one process group.

    Args:
        fn: a module-level (picklable) function; its return value travels back (torch.save).
        world_size: R.
        args: positional arguments, the same for every rank (ranks read ``dist.get_rank()``).
        ranks_per_node: L, exported as ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` (default R: one node).
        timeout_s: the deadline for the whole group; past it every process is killed.
        pg_timeout_s: the process-group timeout (default ``timeout_s``).
        backend: "gloo" (CPU: the ranks see no GPU, ``CUDA_VISIBLE_DEVICES=""``, unless ``env``
            sets it) or "nccl" (rank i is bound to ``cuda:i``: all ranks run on this machine,
            so ``world_size`` may not exceed the GPUs visible).
        env: extra environment variables for the ranks.

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        GroupError: a rank raised (its traceback is in the message), died, or the deadline passed.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    L = world_size if ranks_per_node is None else ranks_per_node
    if L <= 0 or world_size % L:
        raise ValueError(f"world_size={world_size} is not a multiple of ranks_per_node={L}")
    child_env = dict(env or {})
    if backend == "gloo":
        # NOTE: gloo ranks run on the CPU: with no GPU visible they create no CUDA context and
        # take no device memory (the caller's env may still name GPUs for a CUDA-over-gloo test).
        child_env.setdefault("CUDA_VISIBLE_DEVICES", "")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > gpus:
            raise ValueError(
                f"world_size={world_size} NCCL ranks but {gpus} GPU(s) visible on this machine: "
                f"use at most {gpus} rank(s), or backend='gloo' (CPU)"
            )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                L,
                port,
                backend,
                pg_timeout_s or timeout_s,
                child_env,
                fn,
                args,
                out,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    # NOTE: CUDA_VISIBLE_DEVICES must be in the child's environment from its first instruction
    # (an import calling torch.cuda.is_available() would read it before _worker runs).
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if "CUDA_VISIBLE_DEVICES" in child_env:
            os.environ["CUDA_VISIBLE_DEVICES"] = child_env["CUDA_VISIBLE_DEVICES"]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for r in range(world_size):
                    if r not in results and r not in errors:
                        errors[r] = f"timed out after {timeout_s:.0f} s"
                break
            try:
                rank, ok, payload = out.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} before reporting"
                continue
            if ok:
                results[rank] = _loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        first = min(errors)
        summary = "; ".join(
            f"rank {r}: {errors[r].strip().splitlines()[-1]}" for r in sorted(errors)
        )
        raise GroupError(
            f"{len(errors)} of {world_size} ranks failed ({summary})\n"
            f"--- rank {first} ---\n{errors[first]}",
            errors,
        )
    return [results[r] for r in range(world_size)]
