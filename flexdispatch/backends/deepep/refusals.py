"""What the deepep backends refuse before any collective, where DeepEP would trap, assert or hang.

Shape letters (ARCHITECTURE.md): T tokens · E experts · R ranks · L ranks per node · N = R / L
nodes · k top-k. Each rule names DeepEP's limit, the value and what to change.

- ``check_normal_buffer_bytes``: DeepEP's internode normal kernels host-assert
  ``num_rdma_bytes < INT_MAX`` and ``num_nvl_bytes < INT_MAX`` (v1.2.1 internode.cu:341-342,
  1207-1208; main legacy/internode.cu:432-433, 1517-1518), but the one shared buffer of a group
  also holds the low-latency bytes, which pass 2 GiB at e.g. E = 384, H = 7168, 128 tokens.
- ``node_spans`` / ``agree_node_span``: V1's internode dispatch sends
  a token to at most ``min(N, 8)`` nodes (``kNumTopkRDMARanks``, a device assert, v1.2.1
  internode.cu:543); reachable only with k > 8 on more than 8 nodes. Every rank learns every
  rank's widest span first (one small all-gather; V1's internode dispatch is dropless, waits on
  the CPU anyway and is never captured) and all raise before any token moves, naming the rank
  (and, on it, the token).
- ``check_no_capture``: creating or growing a DeepEP buffer (cudaMalloc, IPC handles, a
  barrier) and DeepEP V2's JIT compilation of a new shape cannot happen inside a CUDA-graph
  capture: refused with the fix (warm up first).
- ``check_dropless_capture``: a dropless dispatch (V1, V2, V2.5) waits on the CPU for DeepEP's
  receive counts, so it is refused inside a CUDA-graph capture (worst-case mode is capturable).
- ``agree_buffer_fits``: a DeepEP buffer is built collectively (V1: IPC handles and NVSHMEM; V2 /
  V2.5: ``ncclMemAlloc`` then the collective window registration; a dropless bound that grows
  rebuilds it at the same call on every rank); a rank that cannot allocate it would leave its
  peers inside the collective build, so every rank first checks the new size against what
  DeepEP's allocator can get there (``deepep_free_bytes``: the driver's free memory, after
  PyTorch's cache is returned to the driver when that alone is short — never the cache as such,
  which ``ncclMemAlloc`` / ``cuMemCreate`` / ``cudaMalloc`` cannot use) and all agree (one
  all-gather of a flag on the group itself, at a build only): where one does not fit, every
  rank raises, naming the rank, the bytes and the setting to change.
- ``check_low_latency_graph``: low-latency kernels captured in a CUDA graph replay on the
  signal buffers as they were at capture; a normal *internode* kernel on the same buffer dirties
  them (the clean before the next low-latency kernel is host-side and is not replayed), so it is
  refused once a low-latency kernel has been captured on that buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from flexdispatch._checks import fits, tensors
from flexdispatch.distributed import all_gather_int64, collective_device

__all__ = [
    "INT_MAX",
    "agree_buffer_fits",
    "MAX_TOPK_NODES",
    "check_dropless_capture",
    "check_low_latency_graph",
    "check_no_capture",
    "check_normal_buffer_bytes",
    "deepep_free_bytes",
    "first_use",
    "node_spans",
]

INT_MAX = 2**31 - 1
MAX_TOPK_NODES = 8
"""Nodes one token may reach in V1's internode dispatch (``get_num_topk_rdma_ranks``)."""


def check_normal_buffer_bytes(size: Any, *, internode: bool, low_latency_need: str = "") -> None:
    """Raise ValueError when the shared buffer (``sizing.BufferSize``) is too large for DeepEP's
    internode normal kernels; intranode kernels have no such limit."""
    if not internode or size is None:
        return
    for name, n in (("num_rdma_bytes", size.num_rdma_bytes), ("num_nvl_bytes", size.num_nvl_bytes)):
        if n >= INT_MAX:
            raise ValueError(
                f"DeepEP's internode normal kernels need {name} < INT_MAX = {INT_MAX} "
                f"(internode.cu notify_dispatch / cached_notify host asserts), but the shared "
                f"DeepEP buffer of this process group needs {n} bytes{low_latency_need}: lower "
                f"num_max_dispatch_tokens_per_rank of the low-latency dispatcher, or run "
                f"low-latency decode and normal (prefill / training) dispatch on two process "
                f"groups (one buffer each)"
            )


def node_spans(topk_idx: torch.Tensor, num_experts: int, num_nodes: int) -> torch.Tensor:
    """``[T]`` int64: the nodes each token's experts are on (``topk_idx`` ``[T, k]`` global ids
    in ``[-1, E)``, ``E / N`` experts per node)."""
    T = topk_idx.shape[0]
    node = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_nodes), num_nodes)
    hit = torch.zeros(T, num_nodes + 1, dtype=torch.int64, device=topk_idx.device)
    return hit.scatter_(1, node, 1)[:, :num_nodes].sum(1)


def _span_message(who: str, num_nodes: int) -> str:
    return (
        f"{who}, but DeepEP's internode dispatch sends a token to at most {MAX_TOPK_NODES} nodes "
        f"(kNumTopkRDMARanks, a device assert in internode.cu): use node-limited routing "
        f"(RouterConfig num_groups = {num_nodes} node groups, group_topk <= {MAX_TOPK_NODES}), "
        f"k <= {MAX_TOPK_NODES}, or backend='torch'"
    )


def agree_node_span(
    topk_idx: torch.Tensor, num_experts: int, num_nodes: int, *, group: Any, rank: int
) -> int:
    """Raise ValueError on every rank, before any token moves, when a token of any rank names
    experts on more than ``MAX_TOPK_NODES`` nodes: one all-gather of each rank's widest span,
    read on the host; the rank with such a token names it. Returns 1 where that read was a host
    sync (CUDA)."""
    spans_T = node_spans(topk_idx, num_experts, num_nodes)
    widest = spans_T.amax() if spans_T.numel() else spans_T.new_zeros(())
    mine = widest.to(collective_device(group), torch.int64).reshape(1)
    spans = all_gather_int64(mine, group, name="all_gather (DeepEP node span)").view(-1).tolist()
    worst = max(spans)
    if worst > MAX_TOPK_NODES:
        if spans[rank] > MAX_TOPK_NODES:
            t = int(spans_T.argmax())
            who = f"token {t} has experts on {spans[rank]} nodes (ids {topk_idx[t].tolist()})"
        else:
            who = f"rank {spans.index(worst)} has a token with experts on {worst} nodes"
        raise ValueError(_span_message(who, num_nodes))
    return int(topk_idx.device.type == "cuda")


def check_no_capture(what: str) -> None:
    """Raise RuntimeError when ``what`` (a buffer creation or growth, a first-use compile) would
    run inside a CUDA-graph capture."""
    if tensors.is_capturing():
        raise RuntimeError(
            f"{what} inside a CUDA-graph capture, which cannot be captured (cudaMalloc, IPC "
            f"handles, a barrier, a compile): call FlexDispatcher.warmup(...) (or run one eager "
            f"step) with the shapes of the captured step before capturing"
        )


def deepep_free_bytes(
    device: torch.device, need: int, module: Any = None
) -> tuple[int | None, str]:
    """What DeepEP's allocators can get on ``device`` for a build of ``need`` bytes, and where the
    figure comes from (None: no figure, nothing is refused).

    DeepEP allocates outside PyTorch's caching allocator (V2 / V2.5: ``ncclMemAlloc`` /
    ``cuMemCreate``, deep_ep_v25/csrc/kernels/comm/symmetric.hpp:78-127; V1: ``cudaMalloc`` and
    NVSHMEM), so the figure is the driver's free memory (``torch.cuda.mem_get_info``, a driver
    query, no synchronisation). When that alone is short, PyTorch's unused cache is returned to
    the driver first (``torch.cuda.empty_cache()``, on this rank only: no collective) and the free
    memory read again. The test emulator's modules answer for their emulated device
    (``emu_device_memory`` / ``emu_empty_cache``)."""
    mem = getattr(module, "emu_device_memory", None) if module is not None else None
    if mem is not None:
        free = int(mem["free"])
        if free * fits.SHARE < need:
            module.emu_empty_cache()
            free = int(mem["free"])
            return free, "free memory of the emulated device after returning PyTorch's cache"
        return free, "free memory of the emulated device"
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, f"no figure for {device}"
    try:
        free = int(torch.cuda.mem_get_info(device)[0])
        if free * fits.SHARE >= need:
            return free, f"free memory of {device}"
        torch.cuda.empty_cache()  # NOTE: the only way PyTorch's cache reaches DeepEP
        free = int(torch.cuda.mem_get_info(device)[0])
    except RuntimeError as exc:
        return None, f"torch.cuda.mem_get_info failed ({exc})"
    return free, f"free memory of {device} after returning PyTorch's cache"


def agree_buffer_fits(
    group: Any,
    what: str,
    *,
    num_bytes: int,
    held: int,
    device: torch.device,
    setting: str,
    value: object,
    detail: str,
    fix: str,
    module: Any = None,
) -> None:
    """Raise ValueError on every rank, before a collective (re)build, when the buffer cannot fit
    on some rank (``deepep_free_bytes`` on each rank, one all-gather of a flag on the group).

    Args:
        group: the process group.
        what: the buffer, e.g. ``"DeepEP 2.5 EPBuffer"``.
        num_bytes: its size (the same on every rank); ``held`` of them are freed first (the
            buffer it replaces).
        device: where it is allocated; ``module``: the DeepEP module (the emulator's memory).
        setting / value: the config field that drives the size, as set; ``detail``: how the
            size is made up; ``fix``: what to change.
    """
    need = max(0, num_bytes - held)
    free, source = deepep_free_bytes(device, need, module)
    mine = None
    if free is not None and need > fits.SHARE * free:
        mine = (
            f"{what}: {setting}={value} needs {detail}, more than the "
            f"{fits.format_bytes(fits.SHARE * free)} DeepEP can allocate on {device} "
            f"({fits.SHARE:.0%} of {fits.format_bytes(free)}, {source}; DeepEP allocates outside "
            f"PyTorch's caching allocator): {fix}"
        )
    flag = torch.tensor([int(mine is not None)], dtype=torch.int64)
    flags = all_gather_int64(
        flag.to(collective_device(group)), group, name=f"all_gather ({what} fits)"
    )
    bad = [r for r, f in enumerate(flags.view(-1).tolist()) if f]
    if not bad:
        return
    where = f"rank(s) {', '.join(map(str, bad))}"
    if mine is not None:
        raise ValueError(f"{mine} (it does not fit on {where}: every rank raises)")
    raise ValueError(
        f"{what}: {setting}={value} needs {detail}, which does not fit on {where} (their error "
        f"names the memory there; every rank raises): {fix}"
    )


def check_dropless_capture(what: str) -> None:
    """Raise RuntimeError when a dropless DeepEP ``what`` dispatch would run inside a CUDA-graph
    capture: DeepEP waits on the CPU for its receive counts (and V2 / V2.5 first agree the token
    bound on the host), which a captured graph cannot replay."""
    if tensors.is_capturing():
        raise RuntimeError(
            f"{what}'s dropless dispatch waits on the CPU for its receive counts, which cannot "
            f"be captured in a CUDA graph: build the dispatcher with num_worst_tokens (worst-case "
            f"mode: static shapes, no host sync) to capture it"
        )


_COMPILED: dict[int, set[tuple]] = {}


def first_use(module: Any, key: tuple, what: str) -> None:
    """Note that DeepEP V2 runs its ``what`` kernel for ``key`` (its JIT template arguments); a
    first use compiles, which is refused inside a CUDA-graph capture. The JIT cache is
    per process, so the keys are kept per ``deep_ep`` module."""
    seen = _COMPILED.setdefault(id(module), set())
    if key not in seen:
        check_no_capture(f"DeepEP V2 would compile its {what} kernel for new template arguments")
        seen.add(key)


def check_low_latency_graph(shared: Any, *, internode: bool) -> None:
    """Raise ValueError before a normal internode kernel on a buffer whose low-latency kernels
    were captured in a CUDA graph."""
    if internode and getattr(shared, "low_latency_captured", False):
        raise ValueError(
            "a normal internode DeepEP kernel would run on the buffer whose low-latency kernels "
            "were captured in a CUDA graph: it overwrites the RDMA signal buffers the graph's "
            "replays read (DeepEP's clean before a low-latency kernel runs on the host and is "
            "not replayed), so the next replay would hang or return garbage: run low-latency "
            "decode graphs and normal internode dispatch on two process groups (one buffer "
            "each), or do not capture the low-latency kernels"
        )
