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

import _compat_pickle
import contextlib
import dataclasses
import enum
import io
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import pickletools
import socket
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._files import excerpt

__all__ = [
    "GroupError",
    "MAX_TIMEOUT_S",
    "RANK_RUNTIME_BYTES",
    "broadcast_object",
    "die_with_parent",
    "end_stopped_local_peers",
    "free_port",
    "gather_objects",
    "loopback_interface",
    "spawn_group",
    "under_launcher",
]


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


def loopback_interface() -> str:
    """Name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return "lo"
    return next(
        (n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), "lo")
    )


def threads_per_rank() -> int:
    """torch's thread count in each spawned rank: ``$FLEXDISPATCH_THREADS`` (default 1; the
    ``env`` of ``spawn_group`` may set it).

    Raises:
        ValueError: naming the variable, when it is not an integer >= 1.
    """
    from flexdispatch.distributed import env_int

    return env_int(THREADS_ENV, minimum=1, maximum=4096) or 1


THREADS_ENV = "FLEXDISPATCH_THREADS"


def _torch_safe_globals() -> dict[str, Any]:
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    except ImportError:  # another PyTorch: only the weights_only path is used
        return {}
    return dict(_get_allowed_globals())


def _is_data_class(cls: type) -> bool:
    """A class whose instances are plain data: a dataclass, an ``Enum``, a ``NamedTuple`` or a
    pydantic model (never a function, a module, an exception or a class with behaviour of its
    own, such as ``subprocess.Popen`` or ``FlexDispatcher``)."""
    if dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum):
        return True
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True
    return any(
        base.__name__ == "BaseModel" and base.__module__.startswith("pydantic")
        for base in cls.__mro__
    )


def _data_class(module: str, name: str) -> type | None:
    """The data class (``_is_data_class``) defined as ``name`` in module ``module`` of the
    ``flexdispatch`` or ``tests`` packages, already imported by this process; None otherwise.

    ``name`` must be the class's own ``__qualname__`` there (``Outer.Inner`` for a nested class):
    a dotted path through something the module imported (``flexdispatch.cli.demo_machine`` +
    ``subprocess.Popen``), a function, a module or a class defined elsewhere is not one.
    """
    root = sys.modules.get(module) if module.split(".")[0] in _TRUSTED_PACKAGES else None
    first, *rest = name.split(".")
    # NOTE: the module's own namespace, then a class's own attributes: never a step through a
    # module that the trusted one imported, nor a lookup hook (``vars``, not ``getattr``)
    obj: Any = vars(root).get(first) if root is not None else None
    for part in rest:
        obj = vars(obj).get(part) if isinstance(obj, type) else None
    if (
        isinstance(obj, type)
        and obj.__module__ == module
        and obj.__qualname__ == name
        and _is_data_class(obj)
    ):
        return obj
    return None


_TRUSTED_PACKAGES = ("flexdispatch", "tests")

# Opcodes that name a global: protocol 0-1 spell it in the opcode (GLOBAL, INST); STACK_GLOBAL
# (protocol 4+) takes it from the stack, which torch.save (protocol 2) never writes.
_NAMED_GLOBAL_OPS = frozenset({"GLOBAL", "INST"})
_STACK_GLOBAL_OPS = frozenset({"STACK_GLOBAL", "OBJ"})


def _referenced_globals(data: bytes) -> list[tuple[str, str]]:
    """``(module, name)`` of every global the pickle inside ``torch.save`` bytes names.

    Raises:
        pickle.UnpicklingError: not a ``torch.save`` archive, or a pickle that names a global
            through the stack (``STACK_GLOBAL``, ``OBJ``), which ``_dumps`` never writes.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise pickle.UnpicklingError("not one pickle in the archive")
            pkl = z.read(names[0])
        found = []
        for op, arg, _ in pickletools.genops(pkl):
            if op.name in _STACK_GLOBAL_OPS:
                raise pickle.UnpicklingError(f"{op.name} opcode")
            if op.name in _NAMED_GLOBAL_OPS:
                module, _, name = str(arg).partition(" ")
                # NOTE: protocol 2 writes Python 2 names (__builtin__.set), read as pickle does
                if (module, name) in _compat_pickle.NAME_MAPPING:
                    module, name = _compat_pickle.NAME_MAPPING[(module, name)]
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)
                found.append((module, name))
        return found
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise pickle.UnpicklingError(f"unreadable result archive ({exc})") from None


def _dumps(obj: Any) -> bytes:
    """A rank's result as bytes (``torch.save``: tensors travel as raw storage)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    """``_dumps``'s bytes back, only ever through ``torch.load(weights_only=True)``: tensors,
    numbers, strings, None and containers, plus the data classes of this project that the
    pickle names (``_data_class``: dataclasses, enums, named tuples, pydantic models), allowed
    for this one load. Never an unrestricted pickle.

    Raises:
        pickle.UnpicklingError: naming the first global the pickle refers to that is neither
            allowed by ``weights_only`` nor such a class (``os.system``,
            ``subprocess.Popen``, a function, ...).
    """
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:
        pass  # NOTE: a class weights_only does not know: allowed below if it is plain data
    except (RuntimeError, ValueError, EOFError, OSError) as exc:  # e.g. a TorchScript archive
        raise pickle.UnpicklingError(f"a rank's result is not torch.save bytes: {exc}") from None
    allowed = _torch_safe_globals()
    classes: dict[str, type] = {}
    for module, name in _referenced_globals(data):
        key = f"{module}.{name}"
        if key in allowed or key in classes:
            continue
        cls = _data_class(module, name)
        if cls is None:
            raise pickle.UnpicklingError(
                f"a rank's result refers to {excerpt(key, 80)}, which flexdispatch.launch does "
                f"not unpickle: return tensors, numbers, strings, None, lists, tuples and dicts "
                f"(or dataclasses, enums and named tuples of flexdispatch)"
            )
        classes[key] = cls
    with torch.serialization.safe_globals(list(classes.values())):
        return torch.load(io.BytesIO(data), weights_only=True)


def _guard(name: str, group: Any) -> Any:
    from flexdispatch.distributed import collective_guard

    return collective_guard(name, group)


def _collective_device(group: Any) -> torch.device:
    from flexdispatch.distributed import collective_device

    return collective_device(group)


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` on every rank, as ``_dumps`` bytes in uint8 tensors read back with
    ``_loads`` (``dist.all_gather_object`` would unpickle without restriction)."""
    device = _collective_device(group)
    payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    n = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    with _guard("all_gather (object sizes)", group):
        dist.all_gather(sizes, n, group=group)
    counts = [int(c.item()) for c in sizes]
    buf = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    buf[: payload.numel()] = payload.to(device)
    bufs = [torch.empty_like(buf) for _ in counts]
    with _guard("all_gather (objects)", group):
        dist.all_gather(bufs, buf, group=group)
    return [_loads(b[:c].cpu().numpy().tobytes()) for b, c in zip(bufs, counts, strict=True)]


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` of rank ``src`` on every rank, the same way as ``gather_objects``."""
    device = _collective_device(group)
    mine = dist.get_rank(group) == src
    payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8) if mine else None
    n = torch.tensor([payload.numel() if payload is not None else 0], device=device)
    with _guard("broadcast (object size)", group):
        dist.broadcast(n, src=src, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    if payload is not None:
        buf.copy_(payload)
    with _guard("broadcast (object)", group):
        dist.broadcast(buf, src=src, group=group)
    return _loads(buf.cpu().numpy().tobytes())


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


def end_stopped_local_peers() -> list[int]:
    """Under torchrun: SIGKILL the other workers of this job on this machine that are stopped.

    A worker stopped by SIGSTOP (or a debugger) cannot act on the SIGTERM torchrun sends when
    another worker fails, so torchrun waits its full grace (30 s, whatever
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says for a failed worker group) before its SIGKILL: a hung
    peer would end the job only at twice ``--timeout``. The command line calls this when it fails
    under a launcher (a peer that hung makes this rank's collective time out), just before it
    exits: the job is over either way.

    Only processes with the same parent (the torchrun agent) and the same
    ``TORCHELASTIC_RUN_ID`` in their environment, in state ``T``/``t``, are ended. Linux only
    (``/proc``); returns the pids ended.
    """
    import signal

    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or not os.path.isdir("/proc"):
        return []
    me, parent = os.getpid(), os.getppid()
    ended = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if int(ppid) != parent or state not in ("T", "t"):
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            if f"TORCHELASTIC_RUN_ID={run_id}".encode() not in environ:
                continue
            os.kill(int(entry), signal.SIGKILL)
            ended.append(int(entry))
        except (OSError, ValueError):
            continue  # NOTE: gone meanwhile, or not ours to read
    return ended


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """End this process when its parent ends, by any signal (SIGKILL included).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process when the *thread*
    that started it ends (``spawn_group`` starts its ranks from the thread that waits for them,
    so that thread outlives them). The parent may have ended before the call: then this process
    has been handed to another parent already and exits at once. Elsewhere (no ``prctl``) a
    daemon thread polls ``os.getppid()`` twice a second and exits the process when it changes.
    """
    import signal

    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        os._exit(1)  # NOTE: the parent is gone already: nobody waits for this rank
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    import threading

    threading.Thread(target=watch, name="flexdispatch-parent-watch", daemon=True).start()


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
    torch.set_num_threads(threads_per_rank())
    try:
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
    """The group's rendezvous store, served by this process on 127.0.0.1 only.

    ``TCPStore`` listens on every interface when it binds its own socket, so the socket is bound
    here (to 127.0.0.1) and handed over (``master_listen_fd``; the store closes it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, port


RANK_RUNTIME_BYTES = 160 << 20
"""The least one spawned rank holds before its own tensors: Python, torch and a gloo process
group (measured: 250 MiB with a CPU build of torch 2.13, about 690 MB with a CUDA build;
``flexdispatch.cli.demo_machine``). ``spawn_group`` refuses a world whose ranks cannot all hold
this much; ``demo`` and ``bench`` count the measured figure instead."""

MAX_TIMEOUT_S = 10**7
"""The longest deadline ``spawn_group`` takes (about 116 days): a longer one is not a deadline."""


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not 1e-3 <= value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name} must be a finite number of seconds in [0.001, {MAX_TIMEOUT_S}], got {value!r}"
        )
    return float(value)


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
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
    ):
        raise TypeError(
            f"ranks_per_node must be an int or None, got {type(ranks_per_node).__name__}"
        )
    L = world_size if ranks_per_node is None else ranks_per_node
    if L <= 0 or world_size % L:
        raise ValueError(f"world_size={world_size} is not a multiple of ranks_per_node={L}")
    _check_seconds("timeout_s", timeout_s)
    if pg_timeout_s is not None:
        _check_seconds("pg_timeout_s", pg_timeout_s)
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
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:  # PicklingError, AttributeError (a local object), TypeError
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"fn must be picklable to reach the spawned ranks (a function defined at module "
            f"level), got {name}: {type(exc).__name__}: {exc}"
        ) from None
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
    from flexdispatch import _limits

    _limits.check_fits(
        "spawn_group",
        "world_size",
        world_size,
        world_size * RANK_RUNTIME_BYTES,
        "cpu",
        detail=f"{_limits.format_bytes(RANK_RUNTIME_BYTES)} at least per rank: Python, torch "
        f"and its process group",
        fix="spawn fewer ranks",
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

    Every rank ends with this process, whatever ends it (SIGTERM, SIGHUP, SIGKILL:
    ``die_with_parent``), and so does multiprocessing's resource tracker (it exits once no
    process holds its pipe).

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        TypeError / ValueError: a bad argument, naming it, before any store, pipe or process
            exists: ``world_size`` not a positive int, or more ranks than this machine's memory
            holds (``RANK_RUNTIME_BYTES`` each, ``flexdispatch._limits``) or than its open-file
            limit allows; ``timeout_s`` / ``pg_timeout_s`` not a finite number of seconds in
            ``[0.001, MAX_TIMEOUT_S]``; ``backend`` not ``"gloo"`` or ``"nccl"``; ``fn`` not
            picklable (a lambda or a local function).
        GroupError: a rank raised (its traceback is in the message), died, or the deadline passed.
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
    # NOTE: CUDA_VISIBLE_DEVICES must be in the child's environment from its first instruction
    # (an import calling torch.cuda.is_available() would read it before _worker runs).
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if "CUDA_VISIBLE_DEVICES" in child_env:
            os.environ["CUDA_VISIBLE_DEVICES"] = child_env["CUDA_VISIBLE_DEVICES"]
        for p in procs:
            p.start()
    except BaseException:
        # NOTE: e.g. args that do not pickle: end what started, close every pipe and the store
        for p in procs:
            if p.pid is not None:
                p.kill()
                p.join(timeout=5)
        for reader, writer in pipes:
            reader.close()
            writer.close()
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
    phases = dict.fromkeys(range(world_size), "starting: importing and unpickling its function")
    deadline = time.monotonic() + timeout_s
    try:
        while readers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for r in readers.values():
                    errors[r] = f"timed out after {timeout_s:g} s ({phases[r]})"
                break
            for conn in mp_connection.wait(list(readers), timeout=min(remaining, 0.5)):
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
                        f"process exited with code {procs[rank].exitcode} before reporting"
                        f" ({phases[rank]})"
                    )
                elif data[:1] == b"\x01":
                    results[rank] = _loads(data[1:])
                else:
                    errors[rank] = data[1:].decode("utf-8", "replace")
    finally:
        for conn in readers:
            conn.close()
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
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
