"""Process-group helpers: world/rank/node detection and the config fingerprint exchange.

Shape letters (ARCHITECTURE.md): R ranks in the expert-parallel group · L ranks per node ·
N = R / L nodes.

``group=None`` means the default process group (WORLD). When ``torch.distributed`` is not
initialised, every helper behaves as a world of one rank (R = 1, no collectives), which is what
single-process tests and the demo use.

Every collective issued here (and by the ``torch`` backend) runs inside ``collective_guard``: when
it fails — a peer rank raised and left the group, exited, was killed, or did not join within the
process-group timeout — the backend's terse error (gloo: "Connection reset by peer", "Timed out
waiting 10000ms ...") becomes a ``CollectiveError`` that names the collective, this rank and the
timeout, with the original error chained.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import math
import os
import socket
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import excerpt
from flexdispatch._checks.values import env_int

__all__ = [
    "CollectiveError",
    "collective_error",
    "collective_guard",
    "process_group_timeout_s",
    "is_distributed",
    "group_size",
    "group_rank",
    "collective_device",
    "resolve_ranks_per_node",
    "cut_to_hosts",
    "host_id",
    "ranks_per_host",
    "all_gather_int64",
    "start_gather_int64",
    "all_reduce_min_flag",
    "all_reduce_min_flags",
    "MAX_JSON_BYTES",
    "all_gather_json",
    "env_int",
    "is_loopback",
    "join_launcher_group",
    "launcher_env",
    "loopback_store",
    "local_world_size",
    "stable_hash",
    "check_fingerprint",
]


class CollectiveError(RuntimeError):
    """A collective of the expert-parallel group failed on this rank.

    Raised instead of the communication backend's own error when a peer rank raised (and left the
    group), exited, was killed or did not reach the same collective within the process-group
    timeout. The original error is chained (``__cause__``) and quoted in the message. The group
    must not be used afterwards: destroy it (or end the process) and restart from a checkpoint.
    """


def process_group_timeout_s(group: dist.ProcessGroup | None = None) -> float | None:
    """The timeout of ``group``'s communication backend in seconds, or None when unknown."""
    if not is_distributed(group):
        return None
    try:
        pg = group if group is not None else dist.group.WORLD
        device = collective_device(group)
        timeout = pg._get_backend(device).options._timeout  # type: ignore[union-attr]
        return float(timeout.total_seconds())
    except Exception:  # private API: absent or renamed in some torch releases
        return None


@contextlib.contextmanager
def collective_guard(name: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Turn a failing collective's ``RuntimeError`` into a ``CollectiveError`` naming it.

    Args:
        name: what the collective is, e.g. ``"all_gather (dispatch count exchange)"``.
        group: the process group it runs on (None = WORLD).

    Raises:
        CollectiveError: the collective raised a ``RuntimeError`` (``DistBackendError`` and the
            timeouts of gloo/NCCL are ``RuntimeError`` subclasses); other exceptions pass as is.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        err = collective_error(name, group, exc)
        if err is None:
            raise
        raise err from exc


def collective_error(
    name: str, group: dist.ProcessGroup | None, exc: RuntimeError
) -> CollectiveError | None:
    """The ``CollectiveError`` naming collective ``name`` that failed with ``exc`` (what
    ``collective_guard`` raises), or None when no process group is initialised (``exc`` is then
    not a collective's)."""
    if not is_distributed(group):
        return None
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    timeout = process_group_timeout_s(group)
    within = f"{timeout:g} s" if timeout is not None else "the process-group timeout"
    return CollectiveError(
        f"flexdispatch: collective {name} failed on rank {rank} of {size}: a peer rank "
        f"raised, exited or was killed, or did not reach this collective within {within} "
        f"(look for the first error in the other ranks' logs; the group cannot be used any "
        f"more): {type(exc).__name__}: {exc}"
    )


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when collectives must run: torch.distributed is initialised (any group size)."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """R, the number of ranks of ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if is_distributed(group) else 1


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if is_distributed(group) else 0


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device on which small control tensors must live for ``group``'s backend.

    NCCL groups need CUDA tensors (the current CUDA device); gloo and the world of one use CPU.
    """
    if is_distributed(group) and torch.cuda.is_available():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_ranks_per_node(configured: int | None, num_ranks: int) -> tuple[int, str]:
    """L, the ranks per node, and where it came from.

    Args:
        configured: ``DispatchConfig.ranks_per_node`` (None to detect).
        num_ranks: R.

    Returns:
        ``(L, source)`` with ``source`` one of ``"config"``, ``"LOCAL_WORLD_SIZE"`` or
        ``"world"`` (no launcher information: every rank on one node).

    Raises:
        ValueError: L does not divide R, or LOCAL_WORLD_SIZE is not a positive integer.
    """
    if configured is not None:
        value, source = configured, "config"
    elif (local := local_world_size()) is not None:
        # NOTE: an EP group smaller than the launcher's node (e.g. EP inside a node) is one node.
        value, source = min(local, num_ranks), "LOCAL_WORLD_SIZE"
    else:
        value, source = num_ranks, "world"
    if num_ranks % value:
        raise ValueError(
            f"the expert-parallel world size {num_ranks} is not a multiple of ranks_per_node="
            f"{value} (from {source}): set DispatchConfig.ranks_per_node to a divisor of "
            f"{num_ranks}"
        )
    return value, source


def ranks_per_host(hosts: Sequence[int]) -> int:
    """L as the ranks really sit: the largest divisor of R such that every block of L consecutive
    group ranks runs on one host (``hosts[r]``: an id of rank r's host). A strided group (two ranks
    of each of 8 nodes) gives 2; ranks interleaved over hosts give 1."""
    R = len(hosts)
    starts = [r for r in range(1, R) if hosts[r] != hosts[r - 1]]
    return math.gcd(R, *starts) if R else 1


def host_id() -> int:
    """A 56-bit id of this host (its hostname), equal across processes."""
    name = socket.gethostname().encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=7).digest(), "little")


def cut_to_hosts(
    L: int, source: str, configured: int | None, hosts: Sequence[int] | None
) -> tuple[int, str]:
    """``resolve_ranks_per_node``'s L checked against where the group's ranks run (``hosts``:
    every rank's ``host_id``, gathered with the config fingerprint).

    ``LOCAL_WORLD_SIZE`` describes the launcher's node, not the expert-parallel group: a group
    that takes 2 ranks from each of 8 nodes would be "2 nodes of 8" by it, and DeepEP would open
    CUDA IPC handles to GPUs on other hosts. Where no ``ranks_per_node`` is
    configured, L is cut to the largest block of consecutive group ranks on one host
    (``ranks_per_host``; source ``"hosts"`` when that changed it). A configured value is the
    caller's word and is kept.
    """
    if configured is not None or not hosts:
        return L, source
    placed = math.gcd(L, ranks_per_host(list(hosts)))
    return (placed, "hosts") if placed != L else (L, source)


def local_world_size() -> int | None:
    """``$LOCAL_WORLD_SIZE`` (the launcher's ranks per node), or None when unset (``env_int``).

    Raises:
        ValueError: naming the variable, when it is not an integer >= 1.
    """
    try:
        return env_int("LOCAL_WORLD_SIZE", minimum=1)
    except ValueError as exc:
        raise ValueError(f"{exc} (or set DispatchConfig.ranks_per_node)") from None


def launcher_env() -> dict[str, int]:
    """``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_PORT`` as a
    launcher (torchrun) sets them, checked before ``init_process_group`` reads them: every
    rank is in its range, the node size divides the world, the port is a TCP port.

    Raises:
        ValueError: naming the variable that is missing, not an integer or out of range.
    """
    world = env_int("WORLD_SIZE", minimum=1, maximum=(1 << 31) - 1)
    if world is None:
        raise ValueError("$WORLD_SIZE is not set: start the ranks with a launcher (torchrun)")
    rank = env_int("RANK", minimum=0, maximum=world - 1)
    if rank is None:
        raise ValueError("$RANK is not set: start the ranks with a launcher (torchrun)")
    local = env_int("LOCAL_WORLD_SIZE", minimum=1, maximum=world) or world
    if world % local:
        raise ValueError(
            f"$WORLD_SIZE={world} is not a multiple of $LOCAL_WORLD_SIZE={local}: every node "
            f"must run the same number of ranks"
        )
    local_rank = env_int("LOCAL_RANK", minimum=0, maximum=local - 1)
    port = env_int("MASTER_PORT", minimum=1, maximum=65535)
    return {
        "WORLD_SIZE": world,
        "RANK": rank,
        "LOCAL_WORLD_SIZE": local,
        "LOCAL_RANK": rank % local if local_rank is None else local_rank,
        "MASTER_PORT": 0 if port is None else port,
    }


def _resolve_master_addr(port: int, timeout_s: float) -> None:
    """``$MASTER_ADDR`` resolves to an address (a name service that does not answer within
    ``min(timeout_s, 30)`` seconds counts as not resolving).

    Raises:
        ValueError: naming the variable and its value (an excerpt).
    """
    addr = os.environ.get("MASTER_ADDR", "").strip()
    if not addr:
        return  # NOTE: init_process_group names a missing one itself
    found: list[BaseException | None] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(addr.strip("[]"), port or None, type=socket.SOCK_STREAM)
            found.append(None)
        except (OSError, UnicodeError, ValueError) as exc:
            found.append(exc)

    t = threading.Thread(target=look_up, name="flexdispatch-master-addr", daemon=True)
    t.start()
    t.join(min(timeout_s, 30.0))
    if found and found[0] is None:
        return
    why = (
        "no answer from the name service"
        if not found
        else (getattr(found[0], "strerror", None) or str(found[0]))
    )
    raise InputError(
        f"$MASTER_ADDR={excerpt(addr, 40)} does not resolve ({why}): set MASTER_ADDR to the "
        f"rank-0 host",
        option="$MASTER_ADDR",
        value=addr,
        problem=f"does not resolve ({why})",
        fix="set MASTER_ADDR to the rank-0 host",
    )


def is_loopback(addr: str) -> bool:
    """``addr`` (a ``MASTER_ADDR``) is a loopback address or ``localhost``."""
    text = addr.strip().strip("[]")
    if text.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def loopback_store(
    addr: str, port: int, is_master: bool, world_size: int | None, timeout_s: float
) -> Any:
    """A ``TCPStore`` on the loopback address ``addr``: the master binds ``addr:port`` itself and
    hands the socket over (``master_listen_fd``), so the store listens there only; a client
    connects to it.

    Raises:
        OSError: the master cannot bind the port (in use).
    """
    host = "127.0.0.1" if addr.strip().lower() == "localhost" else addr.strip().strip("[]")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size or 0))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def join_launcher_group(backend: str, timeout_s: float) -> None:
    """``init_process_group`` from a launcher's environment (``launcher_env``, checked first),
    with a failure to assemble the group (a rank that never started, a wrong address) as one
    ``CollectiveError`` naming ``--timeout`` and the fix instead of the store's own message.

    With a loopback ``MASTER_ADDR`` (one machine) and no store of the agent's to share
    (``TORCHELASTIC_USE_AGENT_STORE``), rank 0's store is bound to that address only
    (``loopback_store``): ``scripts/launch/torchrun_single_node.sh`` listens nowhere else.

    Raises:
        ValueError: a launcher variable is missing or malformed, or ``MASTER_ADDR`` does not
            resolve (checked first, within ``timeout_s``: the store would retry a name that never
            resolves for the whole timeout, with pages of C++ warnings).
        CollectiveError: the group did not form within ``timeout_s``.
    """
    import datetime

    env = launcher_env()
    _resolve_master_addr(env["MASTER_PORT"], timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    addr = os.environ.get("MASTER_ADDR", "")
    try:
        if is_loopback(addr) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # NOTE: rank 0 would host the store itself (env://), and a TCPStore that binds its
            # own socket listens on every interface: bound here, to the loopback address only
            store = loopback_store(
                addr, env["MASTER_PORT"], env["RANK"] == 0, env["WORLD_SIZE"], timeout_s
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=env["RANK"],
                world_size=env["WORLD_SIZE"],
                timeout=timeout,
            )
        else:
            dist.init_process_group(backend, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        detail = " ".join(str(exc).split())
        detail = detail if len(detail) <= 200 else detail[:199] + "…"
        raise CollectiveError(
            f"rank {env['RANK']} could not join the launcher's process group of "
            f"{env['WORLD_SIZE']} ranks within --timeout {timeout_s:g} s ({type(exc).__name__}: "
            f"{detail}): start every rank (torchrun --nnodes / --nproc-per-node), check "
            f"MASTER_ADDR and MASTER_PORT, or raise --timeout"
        ) from exc


def start_gather_int64(
    out: torch.Tensor,
    values: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    async_op: bool = False,
) -> dist.Work | None:
    """All-gather ``values`` (``[n]`` int64, same ``n`` everywhere) from every rank into ``out``
    (``[R * n]``, rank-major); the caller runs it inside ``collective_guard``. ``async_op``:
    returns the work to wait on before ``out`` is read (None otherwise).

    (Tried on gloo: one ``all_to_all_single`` of the vector repeated R times instead. Inside a
    dispatch, where the exchange overlaps the send preparation, it gained nothing: 2.18 against
    2.19 ms per dropless call at R = 2, six interleaved runs of ``bench_launch.py``'s shapes.)
    """
    flat = values.reshape(-1).contiguous()
    # NOTE: torch >= 2.13 renames all_gather_into_tensor to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, flat, group=group, async_op=async_op)


def all_gather_int64(
    values: torch.Tensor, group: dist.ProcessGroup | None = None, *, name: str = "all_gather"
) -> torch.Tensor:
    """All-gather a 1-D int64 vector from every rank (``start_gather_int64``).

    Args:
        values: ``[n]`` int64, same ``n`` on every rank, on ``collective_device(group)``.
        group: the process group (None = WORLD).
        name: how a failure names the collective (``CollectiveError``).

    Returns:
        ``[R, n]`` int64; row ``r`` is rank ``r``'s vector.

    Raises:
        CollectiveError: a peer failed or the process-group timeout passed.
    """
    if not is_distributed(group):
        return values.reshape(1, -1).clone()
    size = dist.get_world_size(group)
    n = values.numel()
    out = torch.empty(size * n, dtype=values.dtype, device=values.device)
    with collective_guard(name, group):
        start_gather_int64(out, values, group)
    return out.view(size, n)


def all_reduce_min_flag(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True only when ``flag`` is True on every rank (one small MIN all-reduce)."""
    return all_reduce_min_flags([flag], group)[0]


def all_reduce_min_flags(
    flags: Sequence[bool], group: dist.ProcessGroup | None = None
) -> tuple[bool, ...]:
    """Each flag True only when it is True on every rank (one small MIN all-reduce for all)."""
    if not is_distributed(group):
        return tuple(bool(f) for f in flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64)
    t = t.to(collective_device(group))
    with collective_guard("all_reduce (backend selection)", group):
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return tuple(bool(v) for v in t.tolist())


MAX_JSON_BYTES = 1 << 20
"""Most bytes of JSON one rank may announce to ``all_gather_json`` (a fingerprint is a few KiB)."""


def all_gather_json(
    obj: dict[str, str], group: dist.ProcessGroup | None = None, *, name: str = "json"
) -> list[dict[str, str]]:
    """Every rank's ``obj`` (a mapping of strings) on every rank, as JSON text in uint8 tensors.

    Unlike ``dist.all_gather_object``, which unpickles the peers' bytes without restriction, a
    peer's bytes are only ever parsed as JSON; anything but a mapping of strings (also JSON
    nested too deep for the parser) reads as ``{"<unreadable>": "<what it was>"}``.

    Raises:
        CollectiveError: a peer failed or the process-group timeout passed, or a peer announced
            a size outside ``[0, MAX_JSON_BYTES]`` (checked before anything is allocated).
    """
    device = collective_device(group)
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    n = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    counts = all_gather_int64(n, group, name=f"all_gather ({name} sizes)").flatten().tolist()
    for rank, count in enumerate(counts):
        if not 0 <= count <= MAX_JSON_BYTES:
            raise CollectiveError(
                f"all_gather ({name}): rank {rank} announced {count} bytes of JSON, outside [0, "
                f"{MAX_JSON_BYTES}] (a peer that is not running the same flexdispatch); nothing "
                f"was allocated"
            )
    buf = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    buf[: payload.numel()] = payload.to(device)
    out = torch.empty(len(counts) * buf.numel(), dtype=torch.uint8, device=device)
    with collective_guard(f"all_gather ({name})", group):
        start_gather_int64(out, buf, group)  # NOTE: any dtype gathers the same way
    rows = out.view(len(counts), -1).cpu()
    result: list[dict[str, str]] = []
    for row, count in zip(rows, counts, strict=True):
        try:
            value = json.loads(row[:count].numpy().tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            value = None  # NOTE: RecursionError: JSON nested deeper than the parser's stack
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
        result.append(value if ok else {"<unreadable>": "not a JSON mapping of strings"})
    return result


def stable_hash(value: object) -> int:
    """A hash of ``repr(value)`` that is equal across processes (unlike the salted ``hash``)."""
    return zlib.crc32(repr(value).encode())


def check_fingerprint(
    fields: Mapping[str, object],
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "FlexDispatcher configs",
    fix: str = "every rank must build the dispatcher with the same DispatchConfig, num_experts "
    "and ranks_per_node",
    extra: int | None = None,
) -> list[int] | None:
    """Raise on every rank when the ranks disagree on any field.

    Every rank all-gathers one stable hash per field (a fixed-size int64 vector, so the collective
    itself cannot mismatch); when any column differs, the field values are exchanged with
    ``all_gather_json`` (JSON text, never a pickle; every rank takes this branch together) and
    the error names them.

    Args:
        fields: name -> value, the same names in the same order on every rank.
        group: the process group (None = WORLD).
        what: what differs, the start of the error message.
        fix: how to fix it, in the error message.
        extra: an int64 each rank contributes (e.g. ``host_id()``), gathered in the same first
            all-gather (every rank of a call site passes one, or none does).

    Returns:
        Every rank's ``extra`` (None without ``extra`` or without a process group).

    Raises:
        ValueError: naming each differing field and its value on each rank.
        CollectiveError: a peer failed or the process-group timeout passed.
    """
    if not is_distributed(group):
        return None
    names = list(fields)
    device = collective_device(group)
    # NOTE: the field count goes first so that ranks with different field lists also disagree.
    vec = torch.tensor(
        [len(names), stable_hash(names)] + [stable_hash(fields[n]) for n in names],
        dtype=torch.int64,
        device=device,
    )
    head = [vec.numel()] if extra is None else [vec.numel(), extra]
    n_all = torch.tensor(head, dtype=torch.int64, device=device)
    first = all_gather_int64(n_all, group, name="all_gather (config fingerprint)")
    sizes = first[:, 0]
    extras = None if extra is None else first[:, 1].tolist()
    if len(set(sizes.tolist())) == 1:
        gathered = all_gather_int64(vec, group, name="all_gather (config fingerprint)").cpu()
        if bool((gathered == gathered[0]).all()):
            return extras
    reprs = all_gather_json({n: repr(fields[n]) for n in names}, group, name="config fingerprint")
    lines = []
    all_names = list(dict.fromkeys(n for r in reprs for n in r))
    for name in all_names:
        per_rank = [r.get(name, "<missing>") for r in reprs]
        if len(set(per_rank)) > 1:
            lines.append(f"{name}: " + ", ".join(f"rank {i}={v}" for i, v in enumerate(per_rank)))
    raise ValueError(f"{what} differ across ranks ({fix}): " + "; ".join(lines))
