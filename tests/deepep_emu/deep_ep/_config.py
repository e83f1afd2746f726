"""DeepEP's constants, ``Config`` and buffer-size hints, re-derived for the emulator. TEST-ONLY.

The hint formulas follow ``csrc/config.hpp`` (v1.2.1) in spirit: they size the buffers for the
largest top-k and scale counts a call may use, so a buffer sized by them passes every check.
"""

from __future__ import annotations

__all__ = [
    "NUM_BUFFER_ALIGNMENT_BYTES",
    "NUM_MAX_NVL_PEERS",
    "NUM_MAX_RDMA_PEERS",
    "NUM_MAX_LOCAL_EXPERTS",
    "LOW_LATENCY_HIDDEN_SIZES",
    "LOW_LATENCY_MAX_TOPK",
    "SOURCE_META_BYTES",
    "Config",
    "ep_assert",
    "get_low_latency_rdma_size_hint",
    "low_latency_layout_bytes",
]

NUM_BUFFER_ALIGNMENT_BYTES = 128
NUM_MAX_NVL_PEERS = 8
"""Ranks of one NVLink domain (node = rank // this once R exceeds it). Tests may lower it inside
a worker process to emulate several nodes with few processes."""
NUM_MAX_RDMA_PEERS = 20
NUM_MAX_LOCAL_EXPERTS = 1024
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
LOW_LATENCY_MAX_TOPK = 11
SOURCE_META_BYTES = 8
_MAX_TOPK_IN_HINT = 128
_MAX_SCALES_IN_HINT = 128


def ep_assert(condition: bool, what: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT``: a C++ exception, which Python sees as ``RuntimeError``."""
    if not condition:
        raise RuntimeError(f"Failed: Assertion error {what}")


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class Config:
    """Performance config of the normal kernels (channels = ``num_sms / 2``).

    Args:
        num_sms: SMs used by the kernels (even).
        num_max_nvl_chunked_send_tokens / num_max_nvl_chunked_recv_tokens: NVLink chunking.
        num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: RDMA chunking.
    """

    def __init__(
        self,
        num_sms: int,
        num_max_nvl_chunked_send_tokens: int,
        num_max_nvl_chunked_recv_tokens: int,
        num_max_rdma_chunked_send_tokens: int = 16,
        num_max_rdma_chunked_recv_tokens: int = 128,
    ) -> None:
        ep_assert(num_sms >= 0, "num_sms >= 0")
        ep_assert(
            0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
            "0 < nvl send tokens < nvl recv tokens",
        )
        ep_assert(num_max_rdma_chunked_send_tokens > 0, "rdma send tokens > 0")
        rdma_recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        ep_assert(num_max_rdma_chunked_send_tokens <= rdma_recv // 2, "rdma send <= recv / 2")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes for rows of ``hidden_bytes`` (the worst top-k / scale counts)."""
        ep_assert(
            num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0,
            "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0",
        )
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        per_token = (
            hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK_IN_HINT * (8 + 4) + _MAX_SCALES_IN_HINT * 4
        )
        channels = self.num_sms // 2
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        n += channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens * per_token
        return _align(n, NUM_BUFFER_ALIGNMENT_BYTES)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes; 0 for a single NVLink domain."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        ep_assert(num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % NUM_MAX_NVL_PEERS == 0")
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        channels = self.num_sms // 2
        per_token = (
            hidden_bytes
            + SOURCE_META_BYTES
            + _MAX_TOPK_IN_HINT * (8 + 4)
            + _MAX_SCALES_IN_HINT * 4
            + 16
        )
        n = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        n += 1 << 20
        return _align(n, NUM_BUFFER_ALIGNMENT_BYTES)


def low_latency_layout_bytes(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Bytes of the two send / receive / signal buffers of the low-latency kernels."""
    del num_ranks  # the layout depends on E and the per-rank token budget only
    num_scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    m = num_max_dispatch_tokens_per_rank
    send = max(m * dispatch_msg, num_experts * m * combine_msg)
    recv = max(num_experts * m * dispatch_msg, num_experts * m * combine_msg)
    signal = _align(num_experts * 4, 128)
    return 2 * (send + recv + signal)


def get_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """RDMA buffer bytes the low-latency kernels need (aligned up to 128)."""
    n = low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return (
        (n + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES
    )
