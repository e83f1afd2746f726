"""Spawn a simulated expert-parallel group on one machine (gloo on 127.0.0.1).

Used by ``flexdispatch demo``/``bench`` and by the multi-process tests: every rank is a real
process with a real ``torch.distributed`` process group, and nothing can hang — a deadline kills
the whole group.

Loopback only: the rendezvous store is served by the parent on a socket bound to 127.0.0.1 (a
``TCPStore`` that binds its own socket listens on every interface), and the ranks' process-group
sockets are bound to the loopback interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``).
Results travel back over one pipe per rank as raw bytes (``torch.save``) and are read with
``torch.load(weights_only=True)`` only, which allows, besides tensors and plain values, the data
classes of this project that the bytes name (``_loads``): never an unrestricted pickle.

R ranks · L ranks per node (exported as ``LOCAL_WORLD_SIZE``, as torchrun does).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.files import excerpt
from flexdispatch._checks.values import check_int
from flexdispatch.launch.lifetime import Reaper, check_timeout, die_with_parent
from flexdispatch.launch.wire import _dumps, _loads

# NOTE: the public names are listed once, in ``flexdispatch.launch.__all__``


class GroupError(RuntimeError):
    """One or more ranks of a spawned group failed, died or timed out.

    Attributes:
        errors: rank → why it returned nothing: its traceback, its exit code, "timed out", or
            "ended by the parent after rank R failed" (``ended``).
        first: the first rank to fail, by the time its failure reached the parent (the lowest
            timed-out rank when the deadline passed).
        phases: rank → what it was doing when it last reported (``"starting: ..."``,
            ``"joining the process group"``, ``"running FN"``).
        ended: the ranks the parent ended because another rank had failed (not failures).
    """

    def __init__(
        self,
        message: str,
        errors: dict[int, str],
        *,
        first: int | None = None,
        phases: dict[int, str] | None = None,
        ended: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(message)
        self.errors = errors
        self.first = first if first is not None else min(errors, default=-1)
        self.phases = dict(phases or {})
        self.ended = frozenset(ended)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def loopback_interface() -> str:
    """Name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return "lo"
    return next(
        (n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), "lo")
    )


def threads_per_rank(env: dict[str, str] | None = None) -> int:
    """torch's thread count in each spawned rank: ``$FLEXDISPATCH_THREADS`` (default 1; the
    ``env`` of ``spawn_group`` may set it: its value, when it has one, wins over this process's).

    Raises:
        ValueError: naming the variable, when it is not an integer in [1, 4096].
    """
    from flexdispatch.distributed import env_int

    if env is None or THREADS_ENV not in env:
        return env_int(THREADS_ENV, minimum=1, maximum=4096) or 1
    text = env[THREADS_ENV].strip()
    try:
        value = int(text) if text else 1
    except ValueError:
        value = 0
    if not 1 <= value <= 4096:
        raise ValueError(
            f"spawn_group's env sets {THREADS_ENV}={excerpt(text)}, which is not an integer in "
            f"[1, 4096] (torch threads per rank): pass one, or leave it out (1)"
        )
    return value


THREADS_ENV = "FLEXDISPATCH_THREADS"

FAIL_GRACE_S = 2.0
"""Once a rank of a spawned group failed (raised, or ended without reporting), how long the
others may still report before ``spawn_group`` ends them: a peer of a failed collective reports
its own error within milliseconds, while one waiting to join the group (a rank that died while
starting) would wait for the whole process-group timeout."""

_STARTING = "starting: importing and unpickling its function"


def _signal_name(code: int | None) -> str:
    """An exit code as ``multiprocessing`` reports it: ``-9`` is named ``-9 (SIGKILL)``."""
    if code is None or code >= 0:
        return str(code)
    try:
        import signal

        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


class _ParentGone(Exception):
    """The parent closed its end (it gave up on the group: deadline, another rank's failure)."""


def _send_bytes(conn: Any, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
        raise _ParentGone from exc


def _send_phase(conn: Any, phase: str) -> None:
    _send_bytes(conn, b"\x02" + phase.encode("utf-8", "replace"))


def _send(conn: Any, ok: bool, payload: bytes) -> None:
    _send_bytes(conn, (b"\x01" if ok else b"\x00") + payload)  # raw bytes: no pickle


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
    parent_pid: int | None = None,
) -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)
    # NOTE: one machine: the process-group sockets listen on the loopback interface only.
    lo = loopback_interface()
    os.environ.update({"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo})
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
    try:
        torch.set_num_threads(threads_per_rank())  # NOTE: inside: a bad value is reported
        if backend == "nccl":
            # NOTE: every rank runs on this machine (simulated nodes included): rank i on
            # cuda:i, bound before NCCL builds its communicator.
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=pg_timeout_s)
        _send_phase(out, "joining the process group")
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        _send_phase(out, f"running {getattr(fn, '__name__', 'its function')}")
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
        _send(out, True, _dumps(result))
    except _ParentGone:
        pass  # NOTE: nobody to report to: the parent has already raised, with the reason
    except BaseException:  # reported to the parent, which raises
        with contextlib.suppress(_ParentGone):
            _send(out, False, traceback.format_exc().encode("utf-8", "replace"))
    finally:
        out.close()


def _loopback_store(world_size: int, timeout_s: float) -> tuple[Any, int]:
    """The group's rendezvous store, served by this process on 127.0.0.1 only
    (``flexdispatch.distributed.loopback_store``: a ``TCPStore`` that binds its own socket
    listens on every interface, so the socket is bound here and handed over); and its port."""
    from flexdispatch.distributed import loopback_store

    store = loopback_store("127.0.0.1", 0, True, world_size, timeout_s)
    return store, store.port


RANK_RUNTIME_BYTES = 160 << 20
"""The least one spawned rank holds before its own tensors: Python, torch and a gloo process
group (measured: 250 MiB with a CPU build of torch 2.13, about 690 MB with a CUDA build;
``flexdispatch.cli.demo_machine``). ``spawn_group`` refuses a world whose ranks cannot all hold
this much; ``demo`` and ``bench`` count the measured figure instead."""


def _check_spawn_args(
    fn: Any,
    world_size: Any,
    args: Any,
    ranks_per_node: Any,
    timeout_s: Any,
    pg_timeout_s: Any,
    backend: Any,
    env: Any,
) -> None:
    """``spawn_group``'s arguments, before any store, pipe or process exists (TypeError /
    ValueError naming the argument)."""
    check_int("world_size", world_size, error=TypeError)
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if ranks_per_node is not None:
        check_int("ranks_per_node", ranks_per_node, rule="an int or None", error=TypeError)
    L = world_size if ranks_per_node is None else ranks_per_node
    if L <= 0 or world_size % L:
        raise ValueError(f"world_size={world_size} is not a multiple of ranks_per_node={L}")
    check_timeout("timeout_s", timeout_s)
    if pg_timeout_s is not None:
        check_timeout("pg_timeout_s", pg_timeout_s)
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}"
        )
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if env is not None and not (
        isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict of str to str (environment variables) or None")
    threads_per_rank(env)  # NOTE: what each rank will read, named here rather than in every rank
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    # NOTE: only what can never travel by name is refused here; a plain pickle.dumps would
    # refuse what the spawning context can send (a functools.partial over a multiprocessing
    # Event pickles only while a process is being spawned). Anything else that does not pickle
    # fails at the start, with every store, pipe and process ended.
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", "")
    if "<lambda>" in name or "<locals>" in name:
        what = "a lambda" if "<lambda>" in name else "a function defined inside another"
        raise TypeError(
            f"fn must be picklable to reach the spawned ranks (a function defined at module "
            f"level, or a functools.partial of one), got {name}: {what} is pickled by name and "
            f"cannot be found there"
        )
    # NOTE: the parent holds a pipe and a store connection per rank; each rank needs a runtime.
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        soft = None
    if (
        soft is not None
        and soft != getattr(resource, "RLIM_INFINITY", -1)
        and 3 * world_size + 32 > soft
    ):
        raise ValueError(
            f"world_size={world_size} needs about {3 * world_size + 32} open files in this "
            f"process (a pipe and a store connection per rank), more than its limit of "
            f"{soft} (ulimit -n): spawn fewer ranks"
        )
    from flexdispatch._checks import fits

    fits.check_fits(
        "spawn_group",
        "world_size",
        world_size,
        world_size * RANK_RUNTIME_BYTES,
        "cpu",
        detail=f"{fits.format_bytes(RANK_RUNTIME_BYTES)} at least per rank: Python, torch "
        f"and its process group",
        fix="spawn fewer ranks",
        tree=True,  # NOTE: RLIMIT_AS bounds each rank on its own, not their sum
    )


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

    Every rank ends with this process, whatever ends it (SIGTERM, SIGHUP, SIGKILL), whatever
    the rank is doing, from its first instruction on: a ``lifetime.Reaper`` started before the
    ranks kills them when this process ends, and each rank also arms its own parent-death signal
    (``die_with_parent``) once it runs. multiprocessing's resource tracker exits once no process
    holds its pipe. A rank that fails (raises, or ends without reporting: killed, or dead while it
    starts) ends the group: the others get ``FAIL_GRACE_S`` to report their own errors, then they
    are killed, rather than waiting for it until the process-group timeout.

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        TypeError / ValueError: a bad argument, naming it, before any store, pipe or process
            exists: ``world_size`` not a positive int, or more ranks than this machine's memory
            holds (``RANK_RUNTIME_BYTES`` each, ``flexdispatch._checks.fits``) or than its open-file
            limit allows; ``timeout_s`` / ``pg_timeout_s`` not a finite number of seconds in
            ``[MIN_TIMEOUT_S, MAX_TIMEOUT_S]`` (``flexdispatch.launch.lifetime``: 0.001 to 2147483);
            ``backend`` not ``"gloo"`` or ``"nccl"``; ``fn`` a lambda or a local function
            (also inside a ``functools.partial``). Other objects that do not pickle raise when
            the ranks start, with nothing left behind.
        GroupError: a rank raised (its traceback is in the message), died, or the deadline
            passed; ``first`` names the first rank to fail and ``phases`` what each was doing.
    """
    _check_spawn_args(fn, world_size, args, ranks_per_node, timeout_s, pg_timeout_s, backend, env)
    L = world_size if ranks_per_node is None else ranks_per_node
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
    store, port = _loopback_store(world_size, pg_timeout_s or timeout_s)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
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
                pipes[rank][1],
                os.getpid(),
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    # NOTE: the ranks end with this process from their first instruction on (a SIGKILL of this
    # process while they import torch included): the reaper holds a pipe only this process
    # writes, and kills them when the kernel closes it
    reaper = Reaper()
    # NOTE: CUDA_VISIBLE_DEVICES must be in the child's environment from its first instruction
    # (an import calling torch.cuda.is_available() would read it before _worker runs).
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if "CUDA_VISIBLE_DEVICES" in child_env:
            os.environ["CUDA_VISIBLE_DEVICES"] = child_env["CUDA_VISIBLE_DEVICES"]
        for p in procs:
            p.start()
            reaper.track(p.pid)  # type: ignore[arg-type]
    except BaseException:
        # NOTE: e.g. args that do not pickle: end what started, close every pipe and the store
        for p in procs:
            if p.pid is not None:
                p.kill()
                p.join(timeout=5)
        for reader, writer in pipes:
            reader.close()
            writer.close()
        reaper.close()
        del store
        raise
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    for _, writer in pipes:
        writer.close()  # NOTE: so a rank that dies without reporting reads as end of file
    readers = {pipes[rank][0]: rank for rank in range(world_size)}
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    phases = dict.fromkeys(range(world_size), _STARTING)
    deadline = time.monotonic() + timeout_s
    first: int | None = None
    grace_end = float("inf")  # NOTE: FAIL_GRACE_S after the first failure
    ended: set[int] = set()
    try:
        while readers:
            now = time.monotonic()
            if now >= grace_end:
                # NOTE: a rank failed: the others would wait for it until the process-group
                # timeout (in the rendezvous, or in a collective): end them now
                for r in readers.values():
                    ended.add(r)
                    errors[r] = f"ended by the parent after rank {first} failed ({phases[r]})"
                break
            remaining = deadline - now
            if remaining <= 0:
                for r in readers.values():
                    errors[r] = f"timed out after {timeout_s:g} s ({phases[r]})"
                break
            wait_s = min(remaining, 0.5, grace_end - now)
            for conn in mp_connection.wait(list(readers), timeout=wait_s):
                rank = readers[conn]  # type: ignore[index]
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    data = b""
                if data[:1] == b"\x02":  # a phase report: the rank goes on
                    phases[rank] = data[1:].decode("utf-8", "replace")
                    continue
                del readers[conn]  # type: ignore[arg-type]
                conn.close()
                if not data:
                    procs[rank].join(timeout=1)
                    errors[rank] = (
                        f"process exited with code {_signal_name(procs[rank].exitcode)} before "
                        f"reporting ({phases[rank]})"
                    )
                elif data[:1] == b"\x01":
                    results[rank] = _loads(data[1:])
                    continue
                else:
                    errors[rank] = data[1:].decode("utf-8", "replace")
                if first is None:
                    first, grace_end = rank, time.monotonic() + FAIL_GRACE_S
    finally:
        for conn in readers:
            conn.close()
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        reaper.close()
        del store
    if errors:
        if first is None:  # NOTE: the deadline passed with no failure before it
            first = min(errors)
        failed = len(errors) - len(ended)
        summary = "; ".join(
            f"rank {r}: {errors[r].strip().splitlines()[-1]}" for r in _by_first(errors, first)
        )
        raise GroupError(
            f"{failed} of {world_size} ranks failed ({summary})\n"
            f"--- rank {first} ---\n{errors[first]}",
            errors,
            first=first,
            phases=phases,
            ended=frozenset(ended),
        )
    return [results[r] for r in range(world_size)]


def _by_first(errors: dict[int, str], first: int) -> list[int]:
    """The ranks of ``errors``, the first to fail first, then by rank."""
    return [first, *sorted(r for r in errors if r != first)]
