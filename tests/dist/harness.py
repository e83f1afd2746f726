"""Run a function on every rank of a real gloo group.

``spawn_group`` has ``flexdispatch.launch.spawn_group``'s signature (fresh processes, a free port on
127.0.0.1, a deadline that kills the whole group, each rank's traceback reported) but, by default,
runs the call in a group kept alive for the test module (``tests/dist/pool.py``): spawning R
ranks costs R interpreters importing torch, more than most of these tests take to run. Pooled
calls return plain data only (tensors, numbers, strings, lists, tuples, dicts).

Fresh groups instead, per call: tests marked ``@pytest.mark.fresh_groups`` (peer failure,
timeouts, state that must not be shared), or everywhere with ``FLEXDISPATCH_TEST_FRESH_GROUPS=1``.
``FLEXDISPATCH_TEST_POOL_REPORT=1`` prints the calls and spawns of every module's pools at the
end of the run. Gloo ranks run with ``CUDA_VISIBLE_DEVICES=""``: they compute on the CPU.

R ranks · L ranks per node.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from flexdispatch import launch
from flexdispatch.launch import free_port
from tests.dist.pool import GroupPool

__all__ = [
    "close_pools",
    "free_port",
    "fresh_groups",
    "pool_report",
    "run_agents",
    "run_group",
    "spawn_group",
]

FRESH_ENV = "FLEXDISPATCH_TEST_FRESH_GROUPS"
REPORT_ENV = "FLEXDISPATCH_TEST_POOL_REPORT"

# NOTE: the product's own, kept before tests patch ``launch.spawn_group`` with this module's
_fresh_spawn_group = launch.spawn_group
_POOLS: dict[tuple[int, str], GroupPool] = {}
_REPORT: list[str] = []
_fresh_test = False  # set per test by the root conftest (the fresh_groups marker)


def set_fresh_test(fresh: bool) -> None:
    """Whether the test that runs now asked for fresh groups (root conftest)."""
    global _fresh_test
    _fresh_test = fresh


@contextlib.contextmanager
def fresh_groups() -> Iterator[None]:
    """Calls inside spawn fresh groups (e.g. a second run that must not share the processes)."""
    global _fresh_test
    before, _fresh_test = _fresh_test, True
    try:
        yield
    finally:
        _fresh_test = before


def pooling() -> bool:
    """True when calls run in the module's pooled groups."""
    return not _fresh_test and os.environ.get(FRESH_ENV, "").strip() not in ("1", "true", "yes")


def close_pools(where: str = "") -> None:
    """Stop every pooled group (the end of a test module); note their use for the report."""
    for (R, backend), pool in sorted(_POOLS.items()):
        if pool.calls:
            pool.close()
            _REPORT.append(
                f"{where or '?'}: {backend} R={R}: {pool.calls} calls, {pool.spawns} spawns, "
                f"{pool.cpu_s:.1f} s rank CPU"
            )
        pool.close()
    _POOLS.clear()


def pool_report() -> list[str]:
    """One line per module and pool: calls run, groups spawned (FLEXDISPATCH_TEST_POOL_REPORT)."""
    return list(_REPORT)


def spawn_group(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    ranks_per_node: int | None = None,
    timeout_s: float = 120.0,
    pg_timeout_s: float | None = None,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``flexdispatch.launch.spawn_group``, in the module's pooled group when pooling is on.

    Args:
        fn: a module-level function; ``fn(*args)`` runs on every rank.
        world_size: R.
        args: arguments for every rank.
        ranks_per_node: L (``LOCAL_WORLD_SIZE``; default R).
        timeout_s: the deadline for the call; past it the group is killed.
        pg_timeout_s: the process-group timeout (default ``timeout_s``).
        backend: "gloo" (pooled) or another backend (always a fresh group).
        env: extra environment variables for the ranks during the call.

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        flexdispatch.launch.GroupError: a rank raised, died, or the deadline passed.
    """
    env = dict(env or {})
    if backend == "gloo":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    if backend != "gloo" or not pooling():
        return _fresh_spawn_group(
            fn,
            world_size,
            args=tuple(args),
            ranks_per_node=ranks_per_node,
            timeout_s=timeout_s,
            pg_timeout_s=pg_timeout_s,
            backend=backend,
            env=env,
        )
    pool = _POOLS.get((world_size, backend))
    if pool is None:
        pool = _POOLS[(world_size, backend)] = GroupPool(world_size, backend=backend)
    return pool.run(
        fn,
        tuple(args),
        ranks_per_node=ranks_per_node,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        env=env,
    )


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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (pooled: see the module).

    Args:
        fn: a module-level function.
        world_size: R.
        *args: arguments passed to every rank.
        timeout: seconds for the whole call; then every process is killed and
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
