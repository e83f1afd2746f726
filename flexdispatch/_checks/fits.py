"""Sizes bounded before anything is allocated: memory estimates checked against what is available.

Every public entry point that takes a size (``FlexDispatcher``'s ``num_experts`` and W, each
``dispatch``'s rows, ``MoELayer.forward``'s tokens, ``get_dispatch_layout``, ``permute`` /
``unpermute``, ``MoELayer``, ``TopKRouter``, ``spawn_group``, the command line's size flags)
estimates the bytes its call will allocate from its arguments alone and calls ``check_fits``,
which raises one ``ValueError`` naming the argument, its value, the estimate and the memory
available, with what to change. What is available:

- on a CUDA device, the device's free memory (``torch.cuda.mem_get_info``: a driver query, no
  stream synchronisation) and what PyTorch's caching allocator holds unused;
- on CPU, ``flexdispatch._checks.sysmem.available``: the smallest of ``MemAvailable``, the
  address space left under ``RLIMIT_AS`` and the room under the cgroup memory limits (the one
  memory model of every check, the command line's too); with ``tree=True`` (what several processes
  take together: ``spawn_group``'s ranks, ``bench``'s) without ``RLIMIT_AS``, a limit of each
  process on its own.

An estimate fits when it is at most ``SHARE`` (80 %) of that figure: the rest is headroom.

Cost: estimates below ``SMALL_BYTES`` are accepted with a comparison and nothing else (the hot
path of an ordinary step never queries anything); a larger estimate that fitted is remembered
(per argument, value, estimate and device), so a loop over the same shapes queries once.

Estimates count the call's temporaries at its peak, not only its result: ``dispatch_bytes`` and
``layer_bytes`` below are measured (``tests/hostile/test_estimates.py`` compares them with the
peak resident memory a call adds, on one and two ranks: at least 90 % of the peak, within the
headroom ``SHARE`` keeps, at most 3 times it).

``INT32_MAX`` bounds every size field of the configs (rows, experts and hidden sizes are indexed
with 32-bit integers by DeepEP and the Triton kernels).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from flexdispatch._checks import sysmem
from flexdispatch._checks.errors import MemoryRefusal
from flexdispatch._checks.sysmem import SHARE, format_bytes

__all__ = [
    "INT32_MAX",
    "SHARE",
    "SMALL_BYTES",
    "available_bytes",
    "check_dispatch_rows",
    "check_fits",
    "dispatch_bytes",
    "dispatch_refusal",
    "expert_bytes",
    "format_bytes",
    "layer_bytes",
    "refusal",
    "refusal_error",
    "raise_refusal",
    "short_source",
]

INT32_MAX = (1 << 31) - 1

SMALL_BYTES = 256 << 20
"""Estimates below this are never checked (256 MiB)."""

_FITTED: dict[tuple, None] = {}
_FITTED_MAX = 4096
_LOCK = threading.Lock()


def available_bytes(
    device: torch.device | str | None = None, *, tree: bool = False
) -> tuple[int | None, str]:
    """Memory a new allocation on ``device`` can take, and where the figure comes from (the raw
    figure: ``refusal`` plans for ``SHARE`` of it). ``tree``: what this process and the
    processes it starts can take together (``sysmem.available(tree=True)``; CPU only).

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
        # NOTE: what PyTorch's caching allocator holds but does not use serves new tensors too
        # (host-side counters: no synchronisation)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(free) + max(0, int(cached)), f"free memory of {dev} (and its unused cache)"
    if dev.type != "cpu":
        return None, f"no memory figure for {dev.type}"
    return sysmem.available(tree=tree)


def refusal(
    what: str,
    arg: str,
    value: object,
    nbytes: int,
    device: torch.device | str | None,
    *,
    detail: str = "",
    fix: str = "",
    tree: bool = False,
) -> str | None:
    """The refusal message when ``nbytes`` (the estimate for ``arg=value``) cannot fit on
    ``device``, else None (``refusal_error``'s message; same arguments)."""
    err = refusal_error(what, arg, value, nbytes, device, detail=detail, fix=fix, tree=tree)
    return None if err is None else str(err)


def short_source(source: str) -> str:
    """Where a memory figure comes from, in a few words (for a one-line error)."""
    for start, short in (
        ("MemAvailable", "MemAvailable"),
        ("the cgroup memory limit", "the cgroup memory limit"),
        ("address space left under RLIMIT_AS", "what RLIMIT_AS leaves"),
        ("free memory of", source.split(" (")[0]),
    ):
        if source.startswith(start):
            return short
    return source if len(source) <= 40 else source[:39] + "…"


def refusal_error(
    what: str,
    arg: str,
    value: object,
    nbytes: int,
    device: torch.device | str | None,
    *,
    detail: str = "",
    fix: str = "",
    tree: bool = False,
) -> MemoryRefusal | None:
    """The refusal when ``nbytes`` (the estimate for ``arg=value``) cannot fit on ``device``,
    else None (see the module docstring): its message, and its parts for a one-line report
    (``problem``: the estimate and what is available, in a few words).

    Args:
        what: the entry point, e.g. ``"permute"``.
        arg / value: the argument that drives the size, as the caller wrote it.
        nbytes: the estimate of what the call allocates at its peak.
        device: where it would be allocated.
        detail: how the estimate is made up, e.g. ``"[E] int64 counts x 3"``.
        fix: what to change.
        tree: ``nbytes`` is the sum over several processes (spawned ranks and their parent):
            compared with what they can take together, without this process's ``RLIMIT_AS``
            (``available_bytes``).
    """
    if nbytes < SMALL_BYTES:
        return None
    dev = str(torch.device("cpu" if device is None else device))
    key = (what, arg, value, nbytes, dev, tree)
    if key in _FITTED:
        return None
    avail, source = available_bytes(dev, tree=tree)
    if avail is None or nbytes <= SHARE * avail:
        with _LOCK:
            if len(_FITTED) >= _FITTED_MAX:
                _FITTED.clear()
            _FITTED[key] = None
        return None
    how = f" ({detail})" if detail else ""
    change = f": {fix}" if fix else ""
    prefix = f"{what}: " if what else ""
    usable = int(SHARE * avail)
    return MemoryRefusal(
        f"{prefix}{arg}={value} needs about {format_bytes(nbytes)}{how}, more than the "
        f"{format_bytes(usable)} available on {dev} ({SHARE:.0%} of "
        f"{format_bytes(avail)}, {source}; the rest is headroom){change}",
        arg=arg,
        value=value,
        nbytes=int(nbytes),
        usable=usable,
        avail=int(avail),
        source=source,
        problem=f"needs ~{format_bytes(nbytes)}, {format_bytes(usable)} available "
        f"({SHARE:.0%} of {short_source(source)})",
        fix=fix,
        detail=detail,
    )


def raise_refusal(message: str | None) -> None:
    """Raise ``ValueError(message)`` unless ``message`` is None (a ``refusal`` result)."""
    if message is not None:
        raise ValueError(message)


def check_fits(*args: Any, **kwargs: Any) -> None:
    """Raise ``refusal_error``'s ``MemoryRefusal`` (a ValueError; same arguments) when the
    estimate cannot fit: ``check_fits(what, arg, value, nbytes, device, *, detail="", fix="",
    tree=False)``."""
    err = refusal_error(*args, **kwargs)
    if err is not None:
        raise err


# --------------------------------------------------------------------------- estimates
# NOTE: the constants below are measured (peak resident growth of one call, torch backend on CPU,
# torch 2.13; tests/hostile/test_estimates.py compares them with the measured peak at several
# sizes: each estimate is at least the peak and at most about twice it; the test allows 0.9 to
# 3 times, for the allocator's and oneDNN's differences between machines).

_PER_EXPERT, _PER_EXPERT_HIER = 16, 24
"""Bytes per expert (E, on every rank) of the torch backend's id tables: ``[E + 3]`` int64 from
an expert id to its rank and to this rank's local id (``backends/torch/rows.py``), and in
hierarchical mode a third one to the forwarder's local index (``hier.py``), built at the first
dispatch and kept (measured 16 and 24 bytes at R = 1, 2 and 4)."""

_PER_LOCAL_EXPERT = 24
"""Bytes per local expert (E / R) of a dispatch and its combine: ``[e]`` int64 counts (measured
8 bytes per local expert without autograd, 16 with it)."""


def expert_bytes(E: int, R: int, hierarchical: bool = False) -> int:
    """Bytes the ``E`` experts cost one rank of ``R`` at a dispatch (torch backend): the id
    tables (``_PER_EXPERT`` per expert, ``_PER_EXPERT_HIER`` hierarchical) and the per-local-
    expert counts (``_PER_LOCAL_EXPERT`` per ``E // R``)."""
    per = _PER_EXPERT_HIER if hierarchical else _PER_EXPERT
    return per * E + _PER_LOCAL_EXPERT * max(1, E // max(1, R))


_ROWS_T, _ROWS_S, _ROWS_M, _ROWS_W = 1.0, 2.25, 1.5, 5.5
"""Copies of a row (``H`` x element size) a dispatch + combine holds at its peak, per token of
``x`` (T), per row sent (S), per row received in dropless mode (M) and per worst-case row (W):
the packed send rows, the received rows, their ordering, the rows sent back and the combined
output. Measured on 1, 2, 4 and 8 gloo ranks: about 0.95 T + 2.1 S + 1.1 M dropless (up to
1.2 M on the rank of four that receives the most, k = 2); a worst-case row costs 2.9 copies on
one rank, 3.7 on two and 4.7 on four or eight (the first call, which also sizes the
dispatcher's scratch buffers). A hierarchical dispatch's first hop costs the same per row
(the estimate is 1.3 to 2.1 times the peak measured on 2 and 4 ranks)."""

_ROWS_GRAD = 1.75
"""Factor on the rows when autograd records the dispatch (the backward's combine and dispatch
of the gradients: measured 1.3 to 1.65)."""

_PER_ROW, _PER_SLOT = 64, 32
"""Bytes per row sent or received (index maps) and per (row, slot) (ids, probs, their packed
copies): measured about 115 bytes per worst-case row with k = 2."""


def dispatch_bytes(
    *,
    T: int,
    H: int,
    elem: int,
    k: int,
    R: int,
    E: int,
    W: int = 0,
    grad: bool = False,
    L: int = 0,
) -> int:
    """Peak bytes one rank's ``dispatch`` and ``combine`` allocate (torch backend).

    S = T * min(k, R) rows sent at most (one per token and destination rank); M = W rows
    received in worst-case mode, else S (balanced routing: a rank that receives more than it
    sends, a hot expert's rank, needs more). ``x`` is counted once (its contiguous copy).
    Hierarchical mode (``0 < L < R`` ranks per node) adds its first hop, across the nodes:
    S1 = T * min(k, R / L) rows sent, W or S1 received, at the same rates per row.
    """
    hierarchical = 0 < L < R
    S = T * min(k, R)
    M = W if W else S
    rows = T * _ROWS_T + S * _ROWS_S + M * (_ROWS_W if W else _ROWS_M)
    pairs = S + M
    if hierarchical:
        S1 = T * min(k, R // L)
        M1 = W if W else S1
        rows += S1 * _ROWS_S + M1 * _ROWS_M
        pairs += S1 + M1
    if grad:
        rows *= _ROWS_GRAD
    return (
        int(rows * H * elem) + pairs * (_PER_ROW + _PER_SLOT * k) + expert_bytes(E, R, hierarchical)
    )


_LAYER_TOKEN, _LAYER_TOKEN_GRAD = 4.5, 8.0
"""Copies of a token's row (``H``) ``MoELayer.forward`` holds per token of ``hidden`` (measured
with the experts in fp32)."""
_LAYER_PAIR_F, _LAYER_PAIR_F_GRAD = 4.0, 6.5
"""Copies of a (token, expert) pair's expert hidden state (``F``): the gated projections, the
activation and its input (measured 4.0 without autograd, 5.8 with it)."""
_LAYER_PAIR_H, _LAYER_PAIR_H_GRAD = 2.0, 3.5
"""Copies of a pair's row (``H``): the permuted rows and the expert outputs (measured 1.8 and
3.2)."""


def layer_bytes(
    *,
    T: int,
    H: int,
    F: int,
    Fs: int,
    E: int,
    k: int,
    R: int,
    elem: int,
    W: int,
    grad: bool,
    L: int = 0,
) -> int:
    """Peak bytes of one ``MoELayer.forward`` (and its backward when ``grad``) on one rank: the
    router's ``[T, E]`` fp32 logits and scores, the dispatch and combine (``dispatch_bytes``),
    the (token, expert) pairs this rank computes (P = T * k for balanced routing, in both modes:
    worst-case mode pads the received rows, not the pairs the experts compute) and the shared
    experts' ``[T, Fs]`` hidden states. ``L``: ranks per node of a hierarchical dispatch (0:
    flat)."""
    P = T * k  # NOTE: worst-case mode computes only the real pairs too (measured)
    # NOTE: with autograd, half-precision experts keep float32 copies for the backward on the CPU
    # (measured: a bf16 layer with its backward peaks at 1.5x the fp32 one)
    compute = elem + 4 if grad and elem < 4 else elem
    if grad:
        pair_f, pair_h = _LAYER_PAIR_F_GRAD, _LAYER_PAIR_H_GRAD
    else:
        pair_f, pair_h = _LAYER_PAIR_F, _LAYER_PAIR_H
    token = _LAYER_TOKEN_GRAD if grad else _LAYER_TOKEN
    return int(
        T * H * compute * token
        + (5 if grad else 3) * 4 * T * E
        + P * (F * compute * pair_f + H * compute * pair_h)
        + 6 * T * Fs * compute
        + dispatch_bytes(T=T, H=H, elem=elem, k=k, R=R, E=E, W=W, grad=grad, L=L)
    )


def check_dispatch_rows(
    x: torch.Tensor, k: int, R: int, E: int, W: int, backend: str = "torch", L: int = 0
) -> None:
    """Refuse a dispatch of ``x`` (``[T, H]``, ``k`` ids per row, ``R`` ranks, ``E`` experts,
    ``W`` worst-case rows, ``L`` ranks per node when hierarchical, else 0) whose rows cannot
    fit, before anything is allocated: the torch
    backend's ``dispatch_bytes``; DeepEP moves rows through its own preallocated buffers, so for
    it what it hands back (x's contiguous copy, the received rows, their ids and probs). Host
    ints only, one comparison below ``SMALL_BYTES``. An ``expand``ed x of a few bytes counts as
    the T rows its contiguous copy would be. Raises ``ValueError`` naming ``T`` or
    ``num_worst_tokens``, whichever drives the estimate."""
    T, H = x.shape
    elem = x.element_size()
    if backend == "torch":
        nbytes = dispatch_bytes(T=T, H=H, elem=elem, k=k, R=R, E=E, W=W, grad=x.requires_grad, L=L)
    else:
        nbytes = (T + (W or T * min(k, R))) * (H * elem + 12 * k)
    if nbytes < SMALL_BYTES:
        return
    if W and W >= T:
        arg, value = "num_worst_tokens", W
        fix = "use W = R * T (tokens per rank times ranks) or dropless mode (num_worst_tokens=0)"
    else:
        arg, value = "T", T
        fix = "dispatch fewer tokens per call (x.shape[0]), or a smaller hidden size"
    check_fits(
        "FlexDispatcher.dispatch",
        arg,
        value,
        nbytes,
        x.device,
        detail=f"x of T={T} rows of H={H} at {elem} bytes, k={k}, R={R}"
        f"{f', hierarchical with L={L}' if 0 < L < R else ''}"
        f"{f', W={W} rows received' if W else ''}: the rows sent, received, sent back and "
        f"combined, with their ids and probs",
        fix=fix,
    )


def dispatch_refusal(
    config: Any, num_experts: int, num_ranks: int, device: torch.device
) -> str | None:
    """Why ``FlexDispatcher``'s dispatches cannot fit in memory, or None (at construction: what
    the config alone implies; each dispatch checks its own shapes again).

    ``num_experts``: ``expert_bytes`` (the id tables of all E experts, every rank builds them,
    and the counts of the local ones). Worst-case mode: the ``dispatch_bytes`` of W received
    rows of hidden size ``config.hidden_size`` (1 when not given) at 2 bytes per element,
    T = W / R tokens (W = R * T, as recommended) and k = 1.
    """
    E, W, hidden_size, R = num_experts, config.num_worst_tokens, config.hidden_size, num_ranks
    e = max(1, E // max(1, R))
    hierarchical = bool(config.hierarchical) and R > 1
    per = _PER_EXPERT_HIER if hierarchical else _PER_EXPERT
    tables = "three" if hierarchical else "two"
    why = refusal(
        "FlexDispatcher",
        "num_experts",
        E,
        expert_bytes(E, R, hierarchical),
        device,
        detail=f"{tables} [E + 3] int64 id tables on every rank ({per} bytes per expert) and "
        f"[E / R = {e}] int64 counts at every dispatch ({_PER_LOCAL_EXPERT} bytes per local "
        f"expert)",
        fix="pass the number of experts of the model (E, divisible by the group size)",
    )
    if why is None and W:
        H = hidden_size or 1
        # NOTE: k = 1: a hierarchical first hop sends one row per token whatever L is
        L = 1 if hierarchical else 0
        nbytes = dispatch_bytes(T=W // max(1, R), H=H, elem=2, k=1, R=R, E=E, W=W, L=L)
        why = refusal(
            "FlexDispatcher",
            "num_worst_tokens",
            W,
            nbytes,
            device,
            detail=f"W rows of hidden size {hidden_size or '>= 1'} at 2 bytes per element, "
            f"received, ordered and sent back, with their ids and probs",
            fix="use W = R * T (tokens per rank times ranks) or dropless mode (num_worst_tokens=0)",
        )
    return why
