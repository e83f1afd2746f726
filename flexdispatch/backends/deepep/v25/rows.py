"""The DeepEP 2.5 path's pure helpers: row layouts, ids, traffic, and a dispatch in flight.

Shape letters (ARCHITECTURE.md): T tokens · E experts · R ranks · e = E / R · k top-k · L ranks
per NVLink domain · N = R / L · n rows DeepEP returned (R * M in worst-case mode) · W rows the
contract returns.

None of these reads a device value on the host (no ``.item()``, no ``bincount``, no boolean
indexing), so they run inside a captured CUDA graph; ``guard_ids`` only raises where the caller
allows a host read (checks on, or CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "STREAMS",
    "CudaStreams",
    "V25Traffic",
    "PendingExpanded",
    "combine_row_bytes",
    "dispatch_row_bytes",
    "guard_ids",
    "tensors_of",
    "traffic_rows",
]


def _a(n: int, b: int) -> int:
    return -(-n // b) * b


def dispatch_row_bytes(row_bytes: int, scales: int, k: int) -> int:
    """DeepEP 2.5's dispatch ``TokenLayout`` bytes of one row (layout/ep/token.cuh:17-41): the
    row, the scales, k (id, weight) pairs and 1 + k ints of metadata, each 32-byte aligned, the
    whole 64-byte aligned."""
    return _a(_a(row_bytes, 32) + _a(4 * scales, 32) + _a(8 * k + 4 * (1 + k), 32), 64)


def combine_row_bytes(columns: int, k: int) -> int:
    """DeepEP 2.5's combine ``TokenLayout`` bytes of one row: bf16 columns and k weights."""
    return _a(_a(2 * columns, 32) + _a(8 * k, 32), 64)


def guard_ids(idx: torch.Tensor, num_experts: int, *, raise_now: bool) -> torch.Tensor:
    """Expert ids DeepEP 2.5's kernels can take: ids >= E count past shared memory
    (``ep.expert_id_range``) and a repeated id in one token traps (``ep.duplicate_experts``).

    Ids outside ``[-1, E)`` become -1 (the dispatcher has reported them, on CPU / with checks by
    raising, on CUDA by counting). A repeated id keeps its first slot; the repeats become -1.
    ``raise_now`` (checks on, or CPU) raises for repeats instead, naming the first token.

    Returns:
        ``[T, k]`` int64 ids, a new tensor (whether anything changed is known only on the
        device): 2 device ops for k = 1, 6 otherwise.
    """
    idx = torch.where((idx < -1) | (idx >= num_experts), -1, idx)
    if idx.shape[1] < 2:
        return idx
    srt, perm = idx.sort(1)
    rep = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if raise_now and bool(rep.any()):
        t = int(rep.any(1).nonzero()[0, 0])
        raise ValueError(
            f"topk_idx names one expert twice in {int(rep.any(1).sum())} token(s) (token {t}: "
            f"{idx[t].tolist()}), which DeepEP 2.5's dispatch kernel traps on "
            f"(ep.duplicate_experts): route each token to distinct experts, or use "
            f"deepep_api='v1' / backend='torch'"
        )
    dup = torch.zeros_like(idx, dtype=torch.bool).scatter_(1, perm[:, 1:], rep)
    return torch.where(dup, -1, idx)


@dataclass(frozen=True)
class V25Traffic:
    """Where one rank's rows go (per-destination weights of its ``[R]`` row counts).

    Direct mode: every row goes straight to its rank (NVLink inside the node, RDMA across).
    Hybrid mode: one RDMA row per (token, destination node) to the forwarder with this rank's
    local index there, forwarded over NVLink to the other destination ranks of that node; this
    rank counts the hops its tokens cause (its own and its forwarders'), so the counts over all
    ranks add up to the traffic. Combine mirrors dispatch.

    Attributes:
        intra: ``[R]`` int64, 1 where a row to that rank makes one NVLink hop.
        inter: ``[R]`` int64 (direct) or ``[N]`` (hybrid), 1 where it crosses nodes.
        hybrid: the mode.
        nodes: N; peers: L.
    """

    intra: torch.Tensor
    inter: torch.Tensor
    hybrid: bool
    nodes: int
    peers: int

    @staticmethod
    def of(rank: int, num_ranks: int, peers: int, hybrid: bool, device: Any) -> V25Traffic:
        r = torch.arange(num_ranks, device=device)
        node, me_node = r // peers, rank // peers
        if hybrid:
            intra = (r % peers != rank % peers).to(torch.int64)
            inter = (torch.arange(num_ranks // peers, device=device) != me_node).to(torch.int64)
        else:
            intra = ((node == me_node) & (r != rank)).to(torch.int64)
            inter = (node != me_node).to(torch.int64)
        return V25Traffic(intra, inter, hybrid, num_ranks // peers, peers)


def traffic_rows(idx: torch.Tensor, e: int, t: V25Traffic) -> torch.Tensor:
    """``[3]`` int64 on the device: rows sent (one per token and destination rank), NVLink
    rows, RDMA rows of one dispatch of ``idx`` ``[T, k]`` (ids in ``[-1, E)``)."""
    T, R = idx.shape[0], t.intra.shape[0]
    dest = torch.where(idx >= 0, idx // e, R)
    hit = torch.zeros(T, R + 1, dtype=torch.int64, device=idx.device)
    hit = hit.scatter_(1, dest, 1)[:, :R]
    per_rank = hit.sum(0)
    if t.hybrid:
        per_node = hit.view(T, t.nodes, t.peers).amax(2).sum(0)
        inter = (per_node * t.inter).sum()
    else:
        inter = (per_rank * t.inter).sum()
    return torch.stack([per_rank.sum(), (per_rank * t.intra).sum(), inter])


class CudaStreams:
    """The CUDA streams and events a deferred epilogue's ``join`` uses (``STREAMS``). The test
    emulator installs a stand-in with the same methods (``tests/deepep_emu/streams.py``), so the
    cross-stream half of the overlap runs, and is checked, without a GPU."""

    @staticmethod
    def applies(tensors: list[torch.Tensor]) -> bool:
        """Whether the rows live on streams (CUDA tensors)."""
        return any(t.is_cuda for t in tensors)

    @staticmethod
    def current() -> Any:
        return torch.cuda.current_stream()

    @staticmethod
    def event() -> Any:
        return torch.cuda.Event()

    @staticmethod
    def record_stream(t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    @staticmethod
    def used(tensors: list[torch.Tensor]) -> None:
        """The rows are read on the current stream now (stream-ordered on CUDA: nothing to do)."""


STREAMS: Any = CudaStreams()


@dataclass(eq=False)
class PendingExpanded:
    """An expanded dispatch in flight (``launch_expanded``): its epilogue runs at ``finish``, or
    earlier, when another call on the same buffer comes first (``settle``)."""

    event: Any
    launch: Any  # NOTE: the dispatch's ``bounded.Launch``
    row_bytes: int
    result: Any = None  # the epilogue's (recv_x, recv_topk_idx, recv_topk_weights, handle)
    captured: bool = False  # launched inside a CUDA-graph capture (``SharedEPBuffer.hold``)
    ran_on: Any = None  # the CUDA stream the epilogue ran on (None: not yet, or not CUDA)
    done: Any = None  # a CUDA event recorded on ``ran_on`` right after the epilogue

    def settle(self, *, early: bool = False) -> bool:
        """Run DeepEP's deferred epilogue (``EventOverlap.current_stream_wait``) on the current
        stream unless it ran; True when it ran now. ``early``: another call on the buffer runs
        it, maybe on another stream than the waiter's (``join``)."""
        if self.result is not None or self.event is None:
            return False
        self.result = self.event.current_stream_wait()
        if early and STREAMS.applies(_tensors(self.result)):
            self.ran_on = STREAMS.current()
            self.done = STREAMS.event()
            self.done.record(self.ran_on)
        return True

    def join(self) -> None:
        """The waiter's side: where the epilogue ran on another stream (another call on the
        buffer settled it there first), the current stream waits for it (an event, no host
        sync), and the rows it wrote are recorded as used here, so the allocator does not hand
        their blocks to the other stream while this one still reads them."""
        if self.done is None:
            return
        here = STREAMS.current()
        if here == self.ran_on:
            return
        here.wait_event(self.done)
        for t in _tensors(self.result):
            STREAMS.record_stream(t, here)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of an epilogue's result (nested tuples: fp8 rows with their scales)."""
    return _tensors(value)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an epilogue's result (nested tuples: fp8 rows with their scales)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
