"""One DeepEP 2.5 ``EPBuffer`` per process, group and mode; and what its JIT has compiled.

R ranks · M = ``num_max_tokens_per_rank`` (a ``token_bucket``) · H hidden (bf16 columns) · k
top-k · E experts.

``SharedV25Buffer`` is the V2.5 ``buffer.SharedBoundedBuffer``: every ``deepep`` backend with
``deepep_api="v25"`` on the same ``(deep_ep_v25 module, group, hybrid mode)`` joins one
``EPBuffer``, sized with ``EPBuffer.get_buffer_size_hint`` for the union of what its users asked
for, rebuilt (collectively, at the same call on every rank) only when a call needs more bytes,
destroyed when its last user closes. It also fixes the buffer's SM and QP counts: DeepEP
2.5's bandwidth model (``get_theoretical_num_sms``) reads ``nvidia-smi`` / ``ibstat`` on each
host, which can fail (0) or disagree; the probes are agreed once before the first build
(``links.agree_links``: a failed probe takes a documented default, never the SM count), the
model runs on the agreed bandwidths, and the first call per (E, k) agrees on the smallest count
(one MIN all-reduce: devices may differ in SMs).

Timeouts: DeepEP 2.5 compiles each kernel on the host right before its first launch, and its GPU
barriers trap after ``num_gpu_timeout_secs`` (default 100 s, deep_ep_v25/include/deep_ep/comm/
barrier.cuh:30-47). A rank with a cold DeepJIT cache (a new node after a restart) runs nvcc while
its warm peers already wait inside the kernel, so the buffer is built with ``GPU_TIMEOUT_S`` (600
s), which covers a cold compile of one kernel, and a CPU timeout above it (``CPU_TIMEOUT_S``, the
dropless receive-count wait), at the price of a later trap when a peer really hangs
(``docs/deepep.md``). DeepEP 2.5 has no compile-only entry point, so a compile-then-barrier warm-up
cannot be built on it.

One deferred dispatch at a time: with ``defer_epilogue`` DeepEP's copy epilogue
reads the received rows from the buffer's shared receive slots when it runs (at the caller's
``wait()``, buffers/ep.hpp:724; impls/ep/dispatch_copy_epilogue.cuh:82-93), and every other call
on the buffer writes those slots (a dispatch, a cached dispatch, a combine: dispatch.cuh:369-373,
combine.cuh:55), resets the host counts a dropless epilogue waits for (ep.hpp:555-556), or, when
it grows or is destroyed, frees them (ep.hpp:102-120). So the buffer keeps the dispatch whose
epilogue is pending (``pending``) and runs that epilogue (``settle``: the rows are copied out, in
stream order) before any other call reaches the buffer, and before a growth or a destroy. The
overlap is kept where nothing else runs on the buffer in between (``MoELayer``: start, shared
experts, wait); a second micro-batch started before the first's ``wait()`` gets correct rows,
the first's epilogue run at the second's start (``epilogues_run_early`` counts them). Inside a
CUDA-graph capture the epilogue of a dispatch launched outside it cannot run (it would only be
recorded): a call that would run it there raises (``check_epilogue``).

``KernelRegistry`` mirrors DeepJIT's per-process cache: the kernel templates (``kernel_key``)
that have run. A call whose template is new would compile at its first use; inside a CUDA-graph
capture that cannot work, so the backend raises first, naming the template and the fix
(``FlexDispatcher.warmup``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import is_capturing
from flexdispatch.backends.deepep.buffer import BoundedSize, SharedBoundedBuffer
from flexdispatch.backends.deepep.v25.links import Links, agree_links
from flexdispatch.distributed import collective_device, collective_guard, is_distributed

__all__ = [
    "CPU_TIMEOUT_S",
    "GPU_TIMEOUT_S",
    "KernelRegistry",
    "SharedV25Buffer",
    "acquire_v25",
    "check_epilogue",
    "kernels_of",
    "live_v25",
]

GPU_TIMEOUT_S = 600
"""``EPBuffer(num_gpu_timeout_secs=...)``: covers a peer's cold JIT compile (DeepEP: 100 s)."""
CPU_TIMEOUT_S = 660
"""``EPBuffer(num_cpu_timeout_secs=...)``: the dropless CPU wait, above the GPU timeout."""

_LOCK = threading.Lock()
_BUFFERS: dict[tuple[int, int, bool], SharedV25Buffer] = {}
_KERNELS: dict[int, KernelRegistry] = {}


@dataclass(eq=False)
class KernelRegistry:
    """The kernel templates one ``deep_ep_v25`` module has run in this process."""

    seen: set[tuple] = field(default_factory=set)

    def check(self, key: tuple, what: str) -> None:
        """Raise when ``key`` has not run yet and a CUDA graph is being captured."""
        if key in self.seen or not is_capturing():
            return
        raise RuntimeError(
            f"DeepEP 2.5 would compile its {what} kernel for {describe(key)} at its first use, "
            f"inside a CUDA-graph capture, which cannot be captured: call "
            f"FlexDispatcher.warmup(...) (or MoELayer.warmup()) with the shapes of the captured "
            f"step before capturing, or run one eager step first"
        )

    def add(self, key: tuple) -> None:
        self.seen.add(key)


def kernel_key(kind: str, **fields: Any) -> tuple:
    """A template key: ``kind`` and the template arguments the adapter chooses, sorted."""
    return (kind, *sorted(fields.items()))


def describe(key: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in key[1:])


def kernels_of(deep_ep: ModuleType) -> KernelRegistry:
    """The registry of ``deep_ep`` (one per module and process, as DeepJIT's cache)."""
    with _LOCK:
        reg = _KERNELS.get(id(deep_ep))
        if reg is None:
            reg = _KERNELS[id(deep_ep)] = KernelRegistry()
        return reg


@dataclass(eq=False)
class SharedV25Buffer(SharedBoundedBuffer):
    """The ``deep_ep_v25.EPBuffer`` of one ``(module, group, hybrid)`` in this process.

    Attributes (beside ``SharedBoundedBuffer``'s):
        hybrid: ``allow_hybrid_mode`` of the buffer.
        sms: the agreed SM count per (E, k).
        rdma: the group spans more than one RDMA rank (node): DeepEP probes ``ibstat`` then.
        links: the agreed link probes (``v25.links``), from the first build on.
        pending: the deferred dispatch (``v25.rows.PendingExpanded``) whose epilogue has not
            run.
        epilogues_run_early: pending epilogues run by another call's ``settle`` (statistics).
    """

    hybrid: bool = False
    sms: dict[tuple[int, int], int] = field(default_factory=dict)
    rdma: bool = False
    links: Links | None = None
    pending: Any = None
    epilogues_run_early: int = 0

    label = "DeepEP 2.5 EPBuffer"

    def _buffer_class(self) -> Any:
        return self.deep_ep.EPBuffer

    def _registry(self) -> dict:
        return _BUFFERS

    def _refuse_capture(self, num_bytes: int, new: BoundedSize) -> None:
        if is_capturing():
            raise RuntimeError(
                f"the DeepEP 2.5 buffer would grow to {num_bytes} bytes (for "
                f"M={new.num_max_tokens_per_rank}, H={new.hidden}, k={new.num_topk}) inside a "
                f"CUDA-graph capture: call "
                f"FlexDispatcher.warmup(...) with the captured shapes before capturing"
            )

    def _build_options(self) -> dict[str, Any]:
        if self.links is None:
            self.links = agree_links(self.deep_ep, self.group, hybrid=self.hybrid, rdma=self.rdma)
        return {
            "num_allocated_qps": self.links.num_allocated_qps,
            "num_cpu_timeout_secs": CPU_TIMEOUT_S,
            "num_gpu_timeout_secs": GPU_TIMEOUT_S,
        }

    def hold(self, pending: Any) -> None:
        """Keep ``pending`` (a ``launch_expanded``) as the dispatch whose epilogue has not run,
        noting whether it was launched inside a CUDA-graph capture."""
        pending.captured = is_capturing()
        self.pending = pending

    def settle(self) -> None:
        """Run the pending deferred dispatch's epilogue now, on the current stream: its rows
        leave the shared receive slots before the next call on this buffer can overwrite them
        (and before a growth or a destroy frees them).

        Raises:
            RuntimeError: a CUDA graph is being captured and the pending dispatch was launched
                outside it (``check_epilogue``).
        """
        check_epilogue(self.pending)
        p, self.pending = self.pending, None
        if p is not None and p.settle(early=True):
            self.epilogues_run_early += 1

    def num_sms(self, num_experts: int, topk: int) -> int:
        """DeepEP 2.5's analytic SM count for (E, k) on the agreed link bandwidths, the smallest
        over the ranks (agreed once)."""
        key = (num_experts, topk)
        if key not in self.sms:
            if is_capturing():
                raise RuntimeError(
                    "the DeepEP 2.5 SM count is agreed at the first dispatch (one all-reduce), "
                    "which cannot run inside a CUDA-graph capture: call FlexDispatcher.warmup(...) "
                    "before capturing"
                )
            links = self.links
            assert links is not None  # agreed at the build
            n = int(
                self.buffer.get_theoretical_num_sms(
                    num_experts, topk, rdma_gbs=links.rdma_gbs, nvlink_gbs=links.nvlink_gbs
                )
            )
            if is_distributed(self.group):
                t = torch.tensor([n], dtype=torch.int64, device=collective_device(self.group))
                with collective_guard("all_reduce (DeepEP 2.5 SM count)", self.group):
                    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
                n = int(t.item())
            self.sms[key] = n
        return self.sms[key]

    def leave(self, user: int) -> None:
        super().leave(user)
        if not self.users:
            self.sms.clear()  # NOTE: a rebuild keeps them: they follow the group's ranks and links


def check_epilogue(pending: Any) -> None:
    """Raise RuntimeError when ``pending``'s epilogue (a ``launch_expanded`` not finished yet)
    would run now inside a CUDA-graph capture while its dispatch was launched outside it: the
    epilogue would only be recorded into the graph, so the eager dispatch's rows would never be
    copied out (and every replay would copy stale slots)."""
    if pending is None or pending.result is not None or pending.captured or not is_capturing():
        return
    raise RuntimeError(
        "a DeepEP 2.5 dispatch started with dispatch_expanded_start / launch_expanded outside "
        "this CUDA-graph capture has not been waited on: its receive epilogue would only be "
        "recorded into the graph, not run: call .wait() on it before capturing"
    )


def _key(deep_ep: ModuleType, group: Any, hybrid: bool) -> tuple[int, int, bool]:
    return id(deep_ep), id(group if group is not None else dist.group.WORLD), hybrid


def acquire_v25(
    deep_ep: ModuleType, group: Any, hybrid: bool, user: int, *, rdma: bool = False
) -> SharedV25Buffer:
    """Join the shared ``EPBuffer`` of ``(deep_ep, group, hybrid)`` (created empty first);
    ``rdma``: the group spans more than one node (its RDMA probes run)."""
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        key = _key(deep_ep, group, hybrid)
        shared = _BUFFERS.get(key)
        if shared is None:
            shared = _BUFFERS[key] = SharedV25Buffer(
                deep_ep=deep_ep, group=group, hybrid=hybrid, rdma=rdma
            )
        shared.users.add(user)
        return shared


def live_v25() -> int:
    """Live DeepEP 2.5 buffers in this process (tests, ``doctor``)."""
    with _LOCK:
        return sum(1 for b in _BUFFERS.values() if b.buffer is not None)
