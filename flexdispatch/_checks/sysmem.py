"""The memory this process, or the processes it starts, may still take on the CPU: one model for
every size check.

Every check of flexdispatch that compares an estimate with the machine (the API's
``flexdispatch._checks.fits``, ``flexdispatch demo``'s fit, ``flexdispatch bench`` before it spawns,
``spawn_group``, ``flexdispatch plan``) reads ``available()`` here, and plans for at most
``SHARE`` of it (``usable()``): the rest is headroom for what no estimate counts (the allocator's
slack, other processes, the page cache the kernel needs).

Two figures, because one limit is per process:

- ``available(tree=True)``, what a tree of processes may take together (the demo's and bench's
  ranks and their parent, ``spawn_group``'s ranks): the smallest of ``MemAvailable`` and the
  cgroup room below, which every process of the tree shares;
- ``available()`` (``tree=False``), what one process may take: the same, and the address space
  left under this process's ``RLIMIT_AS``. ``RLIMIT_AS`` bounds each process on its own (a
  child inherits the limit, not a share of it), so it bounds the in-process checks
  (``flexdispatch._checks.fits``) and the largest single process of a tree, never the tree's sum.

What is read:

- ``MemAvailable`` in ``/proc/meminfo`` (the kernel's estimate of memory that can be allocated
  without swapping);
- the address space left under ``RLIMIT_AS`` (its soft limit minus ``VmSize``), per process only;
- the room left under every cgroup memory limit that applies to this process, at its own level
  and at each ancestor's: v2 ``memory.max`` minus the working set (``memory.current`` less
  ``inactive_file`` of ``memory.stat``, the page cache the kernel can drop), v1
  ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes`` less ``total_inactive_file``. The
  cgroup is found through ``/proc/self/cgroup`` and the mount points of ``/proc/self/mountinfo``,
  so a container (which sees its own cgroup as the root) and a nested cgroup on a host both
  read their own limit.

``$FLEXDISPATCH_MEMORY_AVAILABLE`` (a size such as ``6GiB``) replaces the detection (both
figures), for tests.

No torch import: the command line's parent process reads this before it imports torch.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

__all__ = [
    "AVAILABLE_ENV",
    "SHARE",
    "available",
    "cgroup_room",
    "figures",
    "format_bytes",
    "MAX_SIZE",
    "parse_size",
    "usable",
]

SHARE = 0.8
"""Flexdispatch plans for at most this share of the memory available (the demo's 80 % rule)."""
AVAILABLE_ENV = "FLEXDISPATCH_MEMORY_AVAILABLE"
"""Replaces the detected available memory (a size such as ``6GiB``; for tests)."""

_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as 2^63 rounded down to a page

_UNITS = {
    "": 1 << 30,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


MAX_SIZE = 1 << 60
"""The largest size ``parse_size`` reads (1 EiB: more is a typo that would turn every memory check
off)."""


def parse_size(text: str, name: str = "") -> int:
    """``"4GiB"``, ``"512MiB"``, ``"1.5G"``, ``"2"`` (GiB) → bytes (binary units throughout), from
    1 byte to ``MAX_SIZE``.

    ``name``: where the text comes from (an environment variable, ``$NAME``), named by the
    error with the text cut short (its option); without it the text alone (a flag's argument)."""
    from flexdispatch._checks.errors import InputError

    shown = f"{_short(text, 40)}" if not name else f"{name}={_short(text)}"

    def refuse(problem: str, fix: str) -> InputError:
        return InputError(
            f"{shown} {problem}: {fix}", option=name, value=str(text), problem=problem, fix=fix
        )

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text), re.ASCII)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise refuse(
            "is not a memory size",
            "write a number with a unit, e.g. 4GiB or 512MiB (a bare number is GiB)",
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise refuse("is not a positive memory size", "write at least 1B, e.g. 512MiB")
    if value > MAX_SIZE:
        raise refuse("is more than 1 EiB", "write the size of the memory, e.g. 64GiB")
    return int(value)


def _short(text: str, limit: int = 12) -> str:
    s = str(text)
    quoted = repr(s[:limit])
    return quoted + ("…" if len(s) > limit else "")


def _read(path: str | Path) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(1 << 20)
    except (OSError, ValueError):
        return None


def _int(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _meminfo_available(proc: str) -> int | None:
    m = re.search(r"^MemAvailable:\s+(\d+) kB", _read(f"{proc}/meminfo") or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def _address_space_left(proc: str) -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    m = re.search(r"^VmSize:\s+(\d+) kB", _read(f"{proc}/self/status") or "", re.M)
    used = int(m.group(1)) * 1024 if m else 0
    return max(0, soft - used)


def _stat(directory: Path, key: str) -> int:
    m = re.search(rf"^{key} (\d+)$", _read(directory / "memory.stat") or "", re.M)
    return int(m.group(1)) if m else 0


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(fs type, super options, mount root, mount point) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or not tail[0].startswith("cgroup"):
            continue
        unescape = lambda s: re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
        out.append((tail[0], tail[2], unescape(fields[3]), unescape(fields[4])))
    return out


def cgroup_room(proc: str = "/proc") -> tuple[int, str] | None:
    """(bytes, which limit) left under the tightest cgroup memory limit of this process, or None
    when no limit applies (or none can be read). ``proc`` is the ``/proc`` to read (tests pass a
    fake tree)."""
    mounts = _mounts(_read(f"{proc}/self/mountinfo") or "")
    best: tuple[int, str] | None = None
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            kind, limit_f, usage_f, cache = (
                "cgroup2",
                "memory.max",
                "memory.current",
                "inactive_file",
            )
        elif "memory" in controllers.split(","):
            kind = "cgroup"
            limit_f, usage_f = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache = "total_inactive_file"
        else:
            continue
        for fstype, options, root, point in mounts:
            if fstype != kind or (kind == "cgroup" and "memory" not in options.split(",")):
                continue
            rel = path
            if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
                rel = path[len(root.rstrip("/")) :]
            top = Path(point)
            here = top / rel.lstrip("/")
            if not here.is_dir():
                here = top  # NOTE: a cgroup namespace whose path does not resolve: its root
            while True:
                limit, usage = _int(_read(here / limit_f)), _int(_read(here / usage_f))
                if limit is not None and usage is not None and limit < _NO_LIMIT:
                    working = max(0, usage - _stat(here, cache))
                    room = max(0, limit - working)
                    if best is None or room < best[0]:
                        best = (room, f"the cgroup memory limit {here / limit_f}")
                if here == top or top not in here.parents:
                    break
                here = here.parent
    return best


def figures(proc: str = "/proc", *, tree: bool = False) -> list[tuple[int, str]]:
    """Every figure of the memory this process (``tree``: this process and the processes it
    starts, together) may still take: (bytes, where it comes from)."""
    env = os.environ.get(AVAILABLE_ENV, "").strip()
    if env:
        return [(parse_size(env, f"${AVAILABLE_ENV}"), f"${AVAILABLE_ENV}")]
    found: list[tuple[int, str]] = []
    avail = _meminfo_available(proc)
    if avail is not None:
        found.append((avail, "MemAvailable in /proc/meminfo"))
    left = None if tree else _address_space_left(proc)
    if left is not None:
        found.append((left, "address space left under RLIMIT_AS"))
    room = cgroup_room(proc)
    if room is not None:
        found.append(room)
    if not found:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            found.append((int(pages), "available physical pages"))
        except (ValueError, OSError, AttributeError):
            pass
    return found


def available(proc: str = "/proc", *, tree: bool = False) -> tuple[int | None, str]:
    """(bytes, source): the smallest of ``figures()`` (one process; ``tree``: the processes it
    starts and itself, together, with no ``RLIMIT_AS``); ``(None, why)`` when none can be read."""
    found = figures(proc, tree=tree)
    if not found:
        return None, "no memory figure on this platform"
    return min(found)


def usable(proc: str = "/proc", *, tree: bool = False) -> tuple[int | None, str]:
    """(bytes, source): ``SHARE`` of ``available()``, what a size check may plan for."""
    avail, source = available(proc, tree=tree)
    if avail is None:
        return None, source
    return int(SHARE * avail), f"{SHARE:.0%} of the {format_bytes(avail)} available: {source}"


def format_bytes(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB / TiB / PiB with one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
