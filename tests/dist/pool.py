"""``GroupPool``: one gloo group of R ranks kept alive to run many test functions.

Spawning a group costs every rank a fresh interpreter and ``import torch`` (~1.5-2 s of CPU per
rank on the CI machine); most multi-process tests then run for well under a second. A pool starts
its R ranks once (forked from a forkserver that imported torch and flexdispatch once per test
session, ~0.1 s of CPU per rank; spawned where there is no forkserver), joins them in one process
group, and runs successive calls in them:

- a call names its function by reference (``module:qualname``, imported in the ranks) and sends
  its arguments parent -> ranks; each rank answers with ``torch.save`` bytes that the parent reads
  with ``torch.load(weights_only=True)``: plain tensors, numbers, strings, lists, tuples and dicts
  only (no arbitrary objects come back from a rank);
- every call gets what a freshly spawned rank would: the parent's environment as it is now plus
  the call's ``env`` and ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` / ``GROUP_RANK``,
  ``CUDA_VISIBLE_DEVICES=""`` (gloo ranks compute on the CPU), a fresh random seed, the default
  dtype, grad mode, torch's thread count, the process group's timeout, no warning registry; after
  it the ranks put back every ``flexdispatch`` (and ``torch.distributed``) global the call rebound
  and the contents of every dict / list / set a ``flexdispatch`` module holds (registries such as
  the shared DeepEP buffers), and check that the group still answers (one tiny all-reduce);
- a call that fails anywhere (a rank raised, died, or the deadline passed) kills the whole group
  and raises ``flexdispatch.launch.GroupError`` as ``spawn_group`` does; the next call starts a
  fresh one, so one failing test cannot poison the next.

``tests/dist/harness.py`` keeps one pool per (R, backend) for the test module that runs and the
root ``conftest.py`` closes them when the module ends. Tests that need a fresh group (peer
failures, timeouts, state that must not be shared) carry ``@pytest.mark.fresh_groups``;
``FLEXDISPATCH_TEST_FRESH_GROUPS=1`` turns pooling off everywhere, and
``FLEXDISPATCH_TEST_POOL_REPORT=1`` prints, per module, how many calls each pool ran, how many
groups it started and the CPU time of their ranks.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import multiprocessing as mp
import os
import pkgutil
import random
import struct
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from flexdispatch.launch import GroupError, free_port

__all__ = ["GroupPool", "fn_reference"]

_THREADS_ENV = "FLEXDISPATCH_THREADS"  # torch's thread count per rank (default 1), as in launch.py
_CHECK_TIMEOUT_S = 30.0  # the process-group timeout of the after-call check
_GRACE_S = 10.0  # how long the others may still report once one rank failed


def fn_reference(fn: Callable[..., Any]) -> tuple[str, str]:
    """``(module, qualname)`` of a module-level function, checked to resolve back to ``fn``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{fn!r} is not a module-level function: a pooled group runs functions by "
            f"reference (module:qualname), so define it at the top level of a module"
        )
    return module, qualname


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# modules whose globals a call may patch (e.g. ``_validate.defer_value_checks = ...``) and that
# are put back after every call; imported when a rank starts so that they are there to snapshot
_PRELOAD = ("flexdispatch.dispatch.dispatcher", "flexdispatch.moe", "flexdispatch.backends")
_RESTORED = ("torch.distributed", "torch.distributed.distributed_c10d")
_MISSING = object()


def _module_globals() -> list[tuple[bool, Any, Any]]:
    """What ``_restore_globals`` puts back: (live, copy) of the globals of every ``flexdispatch``
    module and of ``torch.distributed``, and of every dict / list / set held in a
    ``flexdispatch`` global (process-wide registries such as the shared DeepEP buffers)."""
    saved: list[tuple[bool, Any, Any]] = []
    for name, mod in list(sys.modules.items()):
        if mod is None:
            continue
        ours = name.partition(".")[0] == "flexdispatch"
        if not ours and name not in _RESTORED:
            continue
        live = vars(mod)
        saved.append((True, live, dict(live)))
        if ours:
            saved.extend(
                (False, v, copy.copy(v)) for v in live.values() if isinstance(v, (dict, list, set))
            )
    return saved


def _restore_globals(saved: list[tuple[bool, Any, Any]]) -> None:
    """Put back every global a call rebound and the contents of every container it changed, as
    a fresh process would have them. Module globals a call added stay (a package gets its
    submodules as attributes when they are imported)."""
    for is_module, live, old in saved:
        if is_module:
            for key, value in old.items():
                if live.get(key, _MISSING) is not value:
                    live[key] = value
        elif isinstance(live, dict):
            if live.keys() != old.keys() or any(live[k] is not v for k, v in old.items()):
                live.clear()
                live.update(old)
        elif isinstance(live, list):
            if len(live) != len(old) or any(a is not b for a, b in zip(live, old, strict=True)):
                live[:] = old
        elif live != old:
            live.clear()
            live.update(old)


# a reply: (the group may be reused, the rank's CPU seconds so far), then the torch.save bytes
_HEADER = struct.Struct("<?d")


def _header(healthy: bool) -> bytes:
    return _HEADER.pack(healthy, time.process_time())


def _encode(payload: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def _decode(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


def _plain_result(result: Any) -> bytes:
    """The answer bytes, or an error naming what cannot travel back as plain data."""
    data = _encode({"ok": True, "result": result})
    try:
        _decode(data)
    except Exception as exc:  # the parent would refuse it: say so from the rank, with the type
        raise TypeError(
            f"a pooled rank returned {type(result).__name__}, which torch.load(weights_only=True) "
            f"refuses ({str(exc).splitlines()[0][:200]}): return plain tensors, numbers, "
            f"strings, lists, tuples and dicts"
        ) from None
    return data


def _rank_main(
    rank: int, world_size: int, port: int, backend: str, timeout_s: float, conn: Connection
) -> None:
    """A pooled rank: join the group, then run calls until told to stop (None) or killed."""
    import torch.distributed as dist

    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        # NOTE: gloo ranks on CPU: a GPU machine's CUDA must not be picked up by the tests' ranks
        "CUDA_VISIBLE_DEVICES": "",
    }
    os.environ.update(base_env)
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    for name in _PRELOAD:
        importlib.import_module(name)
    backends = sys.modules["flexdispatch.backends"]
    for info in pkgutil.walk_packages(backends.__path__, "flexdispatch.backends."):
        importlib.import_module(info.name)
    warning_filters = list(warnings.filters)
    default_dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    call_id = 0
    while True:
        task = conn.recv()
        if task is None:
            break
        call_id += 1
        module, qualname, args, parent_env, env, ranks_per_node, pg_timeout_s = task
        os.environ.clear()
        os.environ.update(parent_env)  # as a process spawned now would inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.update(env)
        os.environ.update(base_env)
        os.environ.update(
            {
                "LOCAL_RANK": str(rank % ranks_per_node),
                "LOCAL_WORLD_SIZE": str(ranks_per_node),
                "GROUP_RANK": str(rank // ranks_per_node),
            }
        )
        torch.set_num_threads(max(1, int(env.get(_THREADS_ENV, "1"))))
        torch.seed()  # a fresh process's random seed, as spawn_group's ranks get
        random.seed()
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(True)
        if torch.are_deterministic_algorithms_enabled() != deterministic:
            torch.use_deterministic_algorithms(
                deterministic
            )  # NOTE: ~1.4 s of CPU: only if changed
        saved = _module_globals()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=pg_timeout_s))
        try:
            result = _resolve(module, qualname)(*args)
            data = _plain_result(result)
            _restore_globals(saved)
            # NOTE: a filter change bumps the filters' version, which empties every module's
            # __warningregistry__: a warning shown once per process shows again in the next call
            warnings.simplefilter("default")
            warnings.filters[:] = warning_filters
        except BaseException:  # reported to the parent, which raises GroupError
            error = _encode({"ok": False, "error": traceback.format_exc()})
            conn.send_bytes(_header(False) + error)
            return  # the parent kills the group; nothing here is to be trusted any more
        # NOTE: the ranks must still be in step for the next call to reuse the group: one tiny
        # all-reduce of the call number (a peer that failed has exited: this fails fast).
        healthy = dist.is_initialized()
        if healthy:
            try:
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=_CHECK_TIMEOUT_S))
                t = torch.tensor([call_id], dtype=torch.int64)
                dist.all_reduce(t)
                healthy = int(t) == call_id * world_size
            except Exception:
                healthy = False
        conn.send_bytes(_header(healthy) + data)
        if not healthy:
            return  # the parent retires the group after taking the results
    if dist.is_initialized():
        dist.destroy_process_group()


def _context() -> Any:
    """Forkserver where there is one: ranks fork from a server that imported torch and
    flexdispatch once (a fresh interpreter importing torch costs ~1.5-2 s of CPU per rank); it
    ran nothing but imports, so forking it is safe. Else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    backends = importlib.import_module("flexdispatch.backends")
    names = [i.name for i in pkgutil.walk_packages(backends.__path__, "flexdispatch.backends.")]
    ctx.set_forkserver_preload([__name__, *_PRELOAD, *names])
    return ctx


class GroupPool:
    """R spawned ranks in one process group, reused for successive calls (module docstring).

    Attributes:
        world_size: R.
        calls: calls run (passed or failed).
        spawns: groups spawned.
        cpu_s: CPU seconds the closed groups' ranks reported (ranks forked from a forkserver
            are not children of this process: ``time`` does not count them).
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", init_timeout_s: float = 120.0):
        if world_size <= 0:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.init_timeout_s = init_timeout_s
        self.calls = 0
        self.spawns = 0
        self.cpu_s = 0.0  # CPU seconds of the ranks closed so far (as they last reported)
        self._cpu: dict[int, float] = {}
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _spawn(self, timeout_s: float) -> None:
        ctx = _context()
        port = free_port()
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, self.world_size, port, self.backend, timeout_s, child),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.spawns += 1

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        ranks_per_node: int | None = None,
        timeout_s: float = 120.0,
        pg_timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank, as ``flexdispatch.launch.spawn_group`` does.

        Args:
            fn: a module-level function (sent by reference).
            args: arguments for every rank (sent from this process).
            ranks_per_node: L, exported as ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` (default R).
            timeout_s: the deadline for the call, spawning included; past it the group is killed.
            pg_timeout_s: the process-group timeout during the call (default ``timeout_s``).
            env: extra environment variables for the call (restored afterwards).

        Returns:
            Each rank's return value (plain data), indexed by rank.

        Raises:
            GroupError: a rank raised, died or the deadline passed; the group is gone.
        """
        R = self.world_size
        L = R if ranks_per_node is None else ranks_per_node
        if L <= 0 or R % L:
            raise ValueError(f"world_size={R} is not a multiple of ranks_per_node={L}")
        module, qualname = fn_reference(fn)
        deadline = time.monotonic() + timeout_s
        if not self.alive:
            self.close()
            self._spawn(max(self.init_timeout_s, timeout_s))
        self.calls += 1
        task = (
            module,
            qualname,
            tuple(args),
            dict(os.environ),
            dict(env or {}),
            L,
            pg_timeout_s or timeout_s,
        )
        try:
            results, errors, retire = self._collect(task, deadline, timeout_s)
        except BaseException:  # e.g. pytest-timeout: replies may still come; start afresh
            self.close(kill=True)
            raise
        if errors:
            self.close(kill=True)
            first = min(errors)
            summary = "; ".join(
                f"rank {r}: {errors[r].strip().splitlines()[-1]}" for r in sorted(errors)
            )
            raise GroupError(
                f"{len(errors)} of {R} ranks failed ({summary})\n"
                f"--- rank {first} ---\n{errors[first]}",
                errors,
            )
        if retire:  # the function destroyed the group or the ranks fell out of step
            self.close(kill=True)
        return [results[r] for r in range(R)]

    def _collect(
        self, task: tuple[Any, ...], deadline: float, timeout_s: float
    ) -> tuple[dict[int, Any], dict[int, str], bool]:
        """Send ``task`` to every rank; (results, errors, whether to retire the group)."""
        errors: dict[int, str] = {}
        results: dict[int, Any] = {}
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(task)
            except (BrokenPipeError, OSError) as exc:
                errors[rank] = f"could not send the call: {exc}"
        pending = {c: r for r, c in enumerate(self._conns) if r not in errors}
        retire, grace_end = False, float("inf")
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or time.monotonic() >= grace_end:
                why = (
                    f"timed out after {timeout_s:.0f} s"
                    if remaining <= 0
                    else "killed: a peer failed"
                )
                for r in pending.values():
                    errors[r] = why
                break
            if errors:  # one rank failed: the others get a short grace to say why they stop
                remaining = min(remaining, grace_end - time.monotonic())
            for conn in wait(list(pending), timeout=max(0.0, min(remaining, 0.5))):
                r = pending.pop(conn)
                try:
                    raw = conn.recv_bytes()
                except (EOFError, OSError):
                    p = self._procs[r]
                    p.join(timeout=1)
                    errors[r] = f"process exited with code {p.exitcode} before reporting"
                    continue
                healthy, cpu_s = _HEADER.unpack(raw[: _HEADER.size])
                self._cpu[r] = cpu_s
                reply = _decode(raw[_HEADER.size :])
                if reply["ok"]:
                    results[r] = reply["result"]
                    retire |= not healthy
                else:
                    errors[r] = reply["error"]
                if errors and grace_end == float("inf"):
                    grace_end = time.monotonic() + _GRACE_S
        return results, errors, retire

    def close(self, kill: bool = True) -> None:
        """Stop the ranks; the pool can spawn again afterwards.

        Args:
            kill: SIGKILL at once (nothing in a rank is worth a clean exit); False asks the ranks
                to leave the group and exit first.
        """
        if not kill:
            for conn in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        for p in self._procs:
            if not kill:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self.cpu_s += sum(self._cpu.values())
        self._cpu = {}
