"""Sizes bounded before anything is allocated: memory estimates checked against what is available.

Every public entry point that takes a size (``FlexDispatcher``'s ``num_experts`` and W,
``get_dispatch_layout``, ``permute`` / ``unpermute``, ``MoELayer``, ``TopKRouter``, the command
line's size flags) estimates the bytes its call will allocate from its arguments alone and calls
``check_fits``, which raises one ``ValueError`` naming the argument, its value, the estimate and the
memory available, with what to change:

- on a CUDA device, the device's free memory (``torch.cuda.mem_get_info``: a driver query, no
  stream synchronisation);
- on CPU, the process's available memory: the smaller of Linux's ``MemAvailable``
  (``/proc/meminfo``) and the address space left under ``RLIMIT_AS``.

Cost: estimates below ``SMALL_BYTES`` are accepted with a comparison and nothing else (the hot
path of an ordinary step never queries anything); a larger estimate that fitted is remembered
(per argument, value, estimate and device), so a loop over the same shapes queries once.
Estimates are lower bounds of what the call allocates (the tensors its result holds and its
largest temporaries), so nothing that fits is refused.

``INT32_MAX`` bounds every size field of the configs (rows, experts and hidden sizes are indexed
with 32-bit integers by DeepEP and the Triton kernels).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = [
    "INT32_MAX",
    "SMALL_BYTES",
    "available_bytes",
    "check_fits",
    "dispatch_refusal",
    "format_bytes",
    "refusal",
    "raise_refusal",
]

INT32_MAX = (1 << 31) - 1

SMALL_BYTES = 256 << 20
"""Estimates below this are never checked (256 MiB)."""

_FITTED: dict[tuple, None] = {}
_FITTED_MAX = 4096
_LOCK = threading.Lock()


def format_bytes(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB / TiB / PiB with one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    used = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return max(0, soft - used)


def available_bytes(device: torch.device | str | None = None) -> tuple[int | None, str]:
    """Memory a new allocation on ``device`` can take, and where the figure comes from.

    None (unknown: nothing is refused) for meta tensors and where no figure can be read.
    """
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "meta":
        return None, "meta tensors allocate nothing"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None, "CUDA is not available"
        try:
            free, _total = torch.cuda.mem_get_info(dev)
        except RuntimeError:
            return None, "torch.cuda.mem_get_info failed"
        return int(free), f"free memory of {dev}"
    if dev.type != "cpu":
        return None, f"no memory figure for {dev.type}"
    figures = []
    avail = _meminfo_available()
    if avail is not None:
        figures.append((avail, "MemAvailable in /proc/meminfo"))
    left = _address_space_left()
    if left is not None:
        figures.append((left, "address space left under RLIMIT_AS"))
    if not figures:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            figures.append((int(pages), "available physical pages"))
        except (ValueError, OSError, AttributeError):
            return None, "no memory figure on this platform"
    return min(figures)


def refusal(
    what: str,
    arg: str,
    value: object,
    nbytes: int,
    device: torch.device | str | None,
    *,
    detail: str = "",
    fix: str = "",
) -> str | None:
    """The refusal message when ``nbytes`` cannot fit on ``device``, else None (see module doc)."""
    if nbytes < SMALL_BYTES:
        return None
    dev = str(torch.device("cpu" if device is None else device))
    key = (what, arg, value, nbytes, dev)
    if key in _FITTED:
        return None
    avail, source = available_bytes(dev)
    if avail is None or nbytes <= avail:
        with _LOCK:
            if len(_FITTED) >= _FITTED_MAX:
                _FITTED.clear()
            _FITTED[key] = None
        return None
    how = f" ({detail})" if detail else ""
    change = f": {fix}" if fix else ""
    prefix = f"{what}: " if what else ""
    return (
        f"{prefix}{arg}={value} needs about {format_bytes(nbytes)}{how}, more than the "
        f"{format_bytes(avail)} available on {dev} ({source}){change}"
    )


def raise_refusal(message: str | None) -> None:
    """Raise ``ValueError(message)`` unless ``message`` is None (a ``refusal`` result)."""
    if message is not None:
        raise ValueError(message)


def check_fits(
    what: str,
    arg: str,
    value: object,
    nbytes: int,
    device: torch.device | str | None,
    *,
    detail: str = "",
    fix: str = "",
) -> None:
    """Raise ValueError when ``nbytes`` (the estimate for ``arg=value``) cannot fit on ``device``.

    Args:
        what: the entry point, e.g. ``"permute"``.
        arg / value: the argument that drives the size, as the caller wrote it.
        nbytes: the estimate (a lower bound of what the call allocates).
        device: where it would be allocated.
        detail: how the estimate is made up, e.g. ``"[E] int64 counts x 3"``.
        fix: what to change.
    """
    msg = refusal(what, arg, value, nbytes, device, detail=detail, fix=fix)
    if msg is not None:
        raise ValueError(msg)


def dispatch_refusal(config: Any, num_experts: int, device: torch.device) -> str | None:
    """Why ``FlexDispatcher``'s dispatches cannot fit in memory, or None.

    Lower bounds: every dispatch allocates ``[E]`` int64 counts at least twice (measured: about
    24 bytes per expert on CPU), and worst-case mode ``[W, H]`` rows plus ``[W, k]`` ids and
    probs (H = ``config.hidden_size`` when known, else 1; k = 1; rows at 2 bytes per element).
    """
    E, W, hidden_size = num_experts, config.num_worst_tokens, config.hidden_size
    why = refusal(
        "FlexDispatcher",
        "num_experts",
        E,
        24 * E,
        device,
        detail="[E] int64 counts and their temporaries at every dispatch, 24 bytes per expert",
        fix="pass the number of experts of the model (E, divisible by the group size)",
    )
    if why is None and W:
        H = hidden_size or 1
        why = refusal(
            "FlexDispatcher",
            "num_worst_tokens",
            W,
            W * (2 * H + 12),
            device,
            detail=f"W rows of hidden size {hidden_size or '>= 1'} at 2 bytes per element plus "
            f"int64 ids and float32 probs",
            fix="use W = R * T (tokens per rank times ranks) or dropless mode (num_worst_tokens=0)",
        )
    return why
