"""Run a function on every rank of a real gloo group: a thin test-side wrapper over
``flexdispatch.launch.spawn_group`` (fresh processes, a free port on 127.0.0.1, a deadline that
kills the whole group, each rank's traceback reported).

R ranks.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from flexdispatch.launch import free_port, spawn_group

__all__ = ["free_port", "run_agents", "run_group"]


def _call_with_rank(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(dist.get_rank(), dist.get_world_size(), *args)


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
        world_size: R.
        *args: picklable arguments passed to every rank.
        timeout: seconds for the whole group; then every process is killed and
            ``flexdispatch.launch.GroupError`` (a RuntimeError) is raised.
        env: extra environment variables for every rank; ``LOCAL_WORLD_SIZE`` there sets the
            simulated node size (default: one node of R ranks).
        pg_timeout: process-group timeout in seconds (default: ``timeout``), so a hung collective
            fails inside the worker with a traceback before the parent gives up.

    Returns:
        The return values, indexed by rank.
    """
    env = dict(env or {})
    ranks_per_node = int(env.pop("LOCAL_WORLD_SIZE", world_size))
    return spawn_group(
        _call_with_rank,
        world_size,
        args=(fn, args),
        ranks_per_node=ranks_per_node,
        timeout_s=timeout,
        pg_timeout_s=pg_timeout,
        env=env,
    )


def run_agents(
    commands: Sequence[Sequence[str]],
    *,
    envs: Sequence[Mapping[str, str]],
    cwd: str,
    timeout: float,
) -> tuple[list[subprocess.Popen], list[str]]:
    """Start one launcher agent per command (e.g. two ``torchrun --node-rank`` agents), wait for
    all of them, kill whatever outlives ``timeout``, and return them with their combined output."""
    agents = [
        subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)
    return agents, outputs
