"""DeepEP's ``Config``, buffer-size hints, compiled shape sets and ``EventHandle``. TEST-ONLY.

The emulated ``deep_ep._C`` exposes these exactly as the compiled module does (positional
constructor, the same method names). Formulas follow ``csrc/config.hpp`` (v1.2.1) /
``csrc/legacy/config.hpp`` (main), which agree for the V1 ``Config``: the NVLink hint is
``C * L * (2N + 3) * 4`` counter bytes plus ``C * L * recv_tokens`` rows of ``hidden_bytes +
SourceMeta + 128 * (8 + 4) top-k bytes + 128 * 4 scale bytes``; the RDMA hint (``R > L``) is the
same per-row sum plus 16 bytes, doubled (send and receive halves), over ``C * N`` queues. The
low-latency hint is the two-buffer layout of ``LowLatencyLayout`` (``config.hpp`` v1.2.1
l.110-165) aligned up to 128 bytes.

Shape letters: C channels (``num_sms / 2``) · L ranks per NVLink domain · N nodes · R ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import limits

__all__ = [
    "NUM_BUFFER_ALIGNMENT_BYTES",
    "SOURCE_META_BYTES",
    "Shapes",
    "shapes_for",
    "make_config_class",
    "EventHandle",
    "low_latency_layout_bytes",
    "low_latency_rdma_size_hint",
]

NUM_BUFFER_ALIGNMENT_BYTES = 128
SOURCE_META_BYTES = 8  # internode.cu: sizeof(SourceMeta) = two int32


@dataclass(frozen=True)
class Shapes:
    """What one DeepEP release's kernels were compiled for (the ``SWITCH_*`` macros).

    Attributes:
        intranode_ranks: ``SWITCH_RANKS`` (intranode kernels).
        rdma_ranks: ``SWITCH_RDMA_RANKS`` (internode kernels: node counts).
        low_latency_hidden: ``SWITCH_HIDDEN`` (low-latency kernels).
        max_nvl_peers: ``NUM_MAX_NVL_PEERS`` the kernels were built for.
        max_rdma_peers: ``NUM_MAX_RDMA_PEERS``.
    """

    intranode_ranks: tuple[int, ...]
    rdma_ranks: tuple[int, ...]
    low_latency_hidden: tuple[int, ...]
    max_nvl_peers: int = 8
    max_rdma_peers: int = 20


_SHAPES = {
    # launch.cuh v1.2.1 l.62 (SWITCH_RDMA_RANKS), l.87 (SWITCH_HIDDEN), SWITCH_RANKS 2/4/8
    "1.2.1": Shapes(
        intranode_ranks=(2, 4, 8),
        rdma_ranks=(2, 4, 8, 16, 18, 20),
        low_latency_hidden=(2048, 2560, 4096, 5120, 6144, 7168, 8192),
    ),
    # csrc/kernels/legacy/launch.cuh on main (DeepEP 2.1.0)
    "2.1.0": Shapes(
        intranode_ranks=(2, 4, 8),
        rdma_ranks=(2, 3, 4, 6, 8, 12, 16, 18, 20),
        low_latency_hidden=(2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192),
    ),
}


def shapes_for(release: str) -> Shapes:
    return _SHAPES[release]


#: ``Config`` objects built since import (the adapter's per-call cost of DeepEP's config tables,
#: read by tests and ``benchmarks/bench_deepep_savings.py``).
CONFIGS_BUILT = [0]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def make_config_class(release: str, nvl_peers: int) -> type:
    """``deep_ep._C.Config`` for one emulated runtime (its NVLink domain is ``nvl_peers``)."""

    class Config:
        """``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`` (``config.hpp``)."""

        def __init__(
            self,
            num_sms: int,
            num_max_nvl_chunked_send_tokens: int,
            num_max_nvl_chunked_recv_tokens: int,
            num_max_rdma_chunked_send_tokens: int,
            num_max_rdma_chunked_recv_tokens: int,
        ) -> None:
            ok = (
                num_sms >= 0
                and num_max_nvl_chunked_send_tokens > 0
                and num_max_nvl_chunked_recv_tokens > 0
                and num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens
                and num_max_rdma_chunked_send_tokens > 0
                and num_max_rdma_chunked_recv_tokens > 0
            )
            if not ok:
                raise limits.DeepEPHostAssert("Failed: Assertion error Config arguments")
            rdma_recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
            if not num_max_rdma_chunked_send_tokens <= rdma_recv // 2:
                raise limits.DeepEPHostAssert(
                    "Failed: Assertion error num_max_rdma_chunked_send_tokens <= "
                    "num_max_rdma_chunked_recv_tokens / 2"
                )
            CONFIGS_BUILT[0] += 1
            self.num_sms = num_sms
            self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
            self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
            self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
            self.num_max_rdma_chunked_recv_tokens = rdma_recv

        def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            limits.host_assert(
                num_ranks < nvl_peers or num_ranks % nvl_peers == 0, "buffer.num_ranks", release
            )
            rdma_ranks = max(num_ranks // nvl_peers, 1)
            nvl_ranks = min(num_ranks, nvl_peers)
            C, recv = self.num_sms // 2, self.num_max_nvl_chunked_recv_tokens
            per_row = hidden_bytes + SOURCE_META_BYTES + 128 * (8 + 4) + 128 * 4
            n = C * nvl_ranks * (2 * rdma_ranks + 3) * 4 + C * nvl_ranks * recv * per_row
            return _align(n, NUM_BUFFER_ALIGNMENT_BYTES)

        def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            if num_ranks <= nvl_peers:
                return 0
            limits.host_assert(num_ranks % nvl_peers == 0, "buffer.num_ranks", release)
            rdma_ranks = num_ranks // nvl_peers
            C, recv = self.num_sms // 2, self.num_max_rdma_chunked_recv_tokens
            per_row = hidden_bytes + SOURCE_META_BYTES + 128 * (8 + 4) + 128 * 4 + 16
            n = C * rdma_ranks * (nvl_peers * 2 + 2) * 2 * 4 + C * rdma_ranks * recv * per_row * 2
            return _align(n, NUM_BUFFER_ALIGNMENT_BYTES)

    return Config


class EventHandle:
    """``deep_ep._C.EventHandle``: a CUDA event on the current stream. No streams here: the
    emulated kernels finish before they return, so waiting is a no-op."""

    def __init__(self, *_: object) -> None:
        self.waits = 0

    def current_stream_wait(self) -> None:
        self.waits += 1
        EVENT_WAITS[0] += 1


#: ``EventHandle.current_stream_wait`` calls since import (where the current stream waits).
EVENT_WAITS = [0]


def low_latency_layout_bytes(num_max: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """``LowLatencyLayout::total_bytes``: two send, receive and signal buffers."""
    del num_ranks  # the layout depends on E and the per-rank token budget only
    num_scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(num_max * dispatch_msg, num_experts * num_max * combine_msg)
    recv = max(num_experts * num_max * dispatch_msg, num_experts * num_max * combine_msg)
    signal = _align(num_experts * 4, 128)
    return 2 * (send + recv + signal)


def low_latency_rdma_size_hint(num_max: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """``get_low_latency_rdma_size_hint``: the layout bytes aligned up to 128 (``config.hpp``)."""
    n = low_latency_layout_bytes(num_max, hidden, num_ranks, num_experts)
    return (
        (n + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES
    )
