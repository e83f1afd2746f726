"""DeepEP buffer-size arithmetic, reimplemented so that a plan needs neither DeepEP nor a GPU.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · R ranks · L ranks per
node · N nodes · W worst-case rows.

Sources (DeepEP, read for the arithmetic only):

- ``deep_ep/buffer.py`` ``Buffer.get_dispatch_config`` / ``Buffer.get_combine_config`` at release
  tag ``v1.2.1`` (commit ``9af0e0d``): the tuned ``Config(num_sms, nvl_send, nvl_recv, rdma_send,
  rdma_recv)`` per rank count (``DISPATCH_CONFIGS`` / ``COMBINE_CONFIGS`` below, the one copy of
  these tables in the project: the test emulator reads them from here; ``Buffer.num_sms``
  defaults to 20).
- ``csrc/config.hpp`` ``Config::Config`` (rounds ``rdma_recv`` up to a multiple of
  ``rdma_send``), ``Config::get_nvl_buffer_size_hint``, ``Config::get_rdma_buffer_size_hint``
  and ``LowLatencyLayout`` / ``get_low_latency_rdma_size_hint``.
- ``csrc/kernels/configs.cuh``: ``NUM_MAX_NVL_PEERS = 8``, ``NUM_MAX_RDMA_PEERS = 20``,
  ``NUM_BUFFER_ALIGNMENT_BYTES = 128``; ``topk_idx_t`` is int64; ``internode.cu``
  ``get_source_meta_bytes()`` is 8 (two ints).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "DISPATCH_CONFIGS",
    "COMBINE_CONFIGS",
    "DeepEPConfig",
    "DeepEPHints",
    "dispatch_config",
    "combine_config",
    "low_latency_rdma_size_hint",
    "deepep_hints",
    "DEEPEP_DEFAULT_NUM_SMS",
    "DEEPEP_MAX_NVL_PEERS",
]

DEEPEP_DEFAULT_NUM_SMS = 20
DEEPEP_MAX_NVL_PEERS = 8
_MAX_RDMA_PEERS = 20
_ALIGN = 128
_MAX_TOPK = 128  # kNumMaxTopK in the hints (buffer reserve, not the real k)
_MAX_SCALES = 128  # kNumMaxScales
_SOURCE_META_BYTES = 8
_INT, _INT64, _FLOAT, _INT4 = 4, 8, 4, 16

DISPATCH_CONFIGS: Mapping[int, tuple[int, int, int, int]] = MappingProxyType(
    {
        2: (24, 256, 6, 128),
        4: (6, 256, 6, 128),
        8: (6, 256, 6, 128),
        16: (36, 288, 20, 128),
        24: (8, 288, 32, 128),
        32: (32, 288, 32, 128),
        64: (20, 288, 28, 128),
        128: (20, 560, 32, 128),
        144: (32, 720, 12, 128),
        160: (28, 720, 12, 128),
    }
)
"""``Buffer.get_dispatch_config`` at DeepEP v1.2.1: R -> ``(nvl_send, nvl_recv, rdma_send,
rdma_recv)`` (tokens; the SM count is ``Buffer.num_sms``), read-only."""
COMBINE_CONFIGS: Mapping[int, tuple[int, int, int, int]] = MappingProxyType(
    {
        2: (10, 256, 6, 128),
        4: (9, 256, 6, 128),
        8: (4, 256, 6, 128),
        16: (4, 288, 12, 128),
        24: (1, 288, 8, 128),
        32: (1, 288, 8, 128),
        64: (1, 288, 20, 128),
        128: (1, 560, 12, 128),
        144: (2, 720, 8, 128),
        160: (2, 720, 8, 128),
    }
)
"""``Buffer.get_combine_config`` at DeepEP v1.2.1, in the same layout as ``DISPATCH_CONFIGS``."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class DeepEPConfig:
    """DeepEP's ``Config``: SMs and chunk sizes (tokens) of the normal kernels.

    ``num_max_rdma_chunked_recv_tokens`` is already rounded up to a multiple of
    ``num_max_rdma_chunked_send_tokens``, as DeepEP's constructor does.
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    @classmethod
    def create(
        cls, num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int, rdma_recv: int
    ) -> DeepEPConfig:
        """Build a config the way DeepEP's constructor does (validating and rounding)."""
        if num_sms < 0 or nvl_send <= 0 or nvl_recv <= nvl_send or rdma_send <= 0:
            raise ValueError(
                f"invalid DeepEP config (num_sms={num_sms}, nvl_send={nvl_send}, "
                f"nvl_recv={nvl_recv}, rdma_send={rdma_send}): need num_sms >= 0, "
                f"0 < nvl_send < nvl_recv and rdma_send > 0"
            )
        rdma_recv = _round_up(rdma_recv, rdma_send)
        if rdma_send > rdma_recv // 2:
            raise ValueError(
                f"invalid DeepEP config: rdma_send={rdma_send} must be at most half of "
                f"rdma_recv={rdma_recv}"
            )
        return cls(
            num_sms=num_sms,
            num_max_nvl_chunked_send_tokens=nvl_send,
            num_max_nvl_chunked_recv_tokens=nvl_recv,
            num_max_rdma_chunked_send_tokens=rdma_send,
            num_max_rdma_chunked_recv_tokens=rdma_recv,
        )

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (
            self.num_sms,
            self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens,
        )

    def nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer (``Config::get_nvl_buffer_size_hint``).

        Per channel (``num_sms / 2``) and NVLink peer: ``2 * rdma_ranks + 3`` ints of counters,
        plus ``nvl_recv`` token slots of ``hidden_bytes`` + source meta + 128 int64 top-k ids +
        128 fp32 weights + 128 fp32 scales; rounded up to 128 bytes.
        """
        P = DEEPEP_MAX_NVL_PEERS
        if not (num_ranks < P or num_ranks % P == 0):
            raise ValueError(f"DeepEP needs num_ranks < {P} or a multiple of {P}, got {num_ranks}")
        if num_ranks > P and self.num_sms % 2:
            raise ValueError(f"DeepEP internode needs an even num_sms, got {self.num_sms}")
        rdma_ranks = max(num_ranks // P, 1)
        nvl_ranks = min(num_ranks, P)
        slots = (self.num_sms // 2) * nvl_ranks
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        per_token = (
            hidden_bytes
            + _SOURCE_META_BYTES
            + _MAX_TOPK * _INT64
            + _MAX_TOPK * _FLOAT
            + _MAX_SCALES * _FLOAT
        )
        total = slots * (2 * rdma_ranks + 3) * _INT + tokens * per_token
        return _round_up(total, _ALIGN)

    def rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the RDMA buffer (``Config::get_rdma_buffer_size_hint``); 0 within a node.

        Per channel and RDMA peer: ``(2 * 8 + 2) * 2`` ints of counters, plus ``rdma_recv``
        token slots, doubled (send and receive halves), of ``hidden_bytes`` + source meta +
        128 int64 ids + 128 fp32 weights + 128 fp32 scales + one int4; rounded up to 128 bytes.
        """
        P = DEEPEP_MAX_NVL_PEERS
        if num_ranks <= P:
            return 0
        if num_ranks % P:
            raise ValueError(f"DeepEP internode needs num_ranks a multiple of {P}, got {num_ranks}")
        if self.num_sms % 2:
            raise ValueError(f"DeepEP internode needs an even num_sms, got {self.num_sms}")
        slots = (self.num_sms // 2) * (num_ranks // P)
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        per_token = (
            hidden_bytes
            + _SOURCE_META_BYTES
            + _MAX_TOPK * _INT64
            + _MAX_TOPK * _FLOAT
            + _MAX_SCALES * _FLOAT
            + _INT4
        )
        total = slots * (P * 2 + 2) * 2 * _INT + tokens * per_token * 2
        return _round_up(total, _ALIGN)


def _lookup(
    table: Mapping[int, tuple[int, int, int, int]], num_ranks: int, num_sms: int, what: str
) -> DeepEPConfig:
    if num_ranks not in table:
        raise ValueError(
            f"DeepEP has no tuned {what} config for {num_ranks} ranks (it supports "
            f"{', '.join(map(str, sorted(table)))})"
        )
    return DeepEPConfig.create(num_sms, *table[num_ranks])


def dispatch_config(num_ranks: int, num_sms: int = DEEPEP_DEFAULT_NUM_SMS) -> DeepEPConfig:
    """``Buffer.get_dispatch_config(num_ranks)``; ValueError for an unsupported rank count."""
    return _lookup(DISPATCH_CONFIGS, num_ranks, num_sms, "dispatch")


def combine_config(num_ranks: int, num_sms: int = DEEPEP_DEFAULT_NUM_SMS) -> DeepEPConfig:
    """``Buffer.get_combine_config(num_ranks)``; ValueError for an unsupported rank count."""
    return _lookup(COMBINE_CONFIGS, num_ranks, num_sms, "combine")


def low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """``Buffer.get_low_latency_rdma_size_hint`` (``LowLatencyLayout`` in ``csrc/config.hpp``).

    With ``s = H / 128`` scales, a dispatch message is ``16 + max(2H, H + 4s)`` bytes and a combine
    message ``4s + 2H``; send buffer ``max(W * dispatch, E * W * combine)``, receive buffer
    ``E * W * max(dispatch, combine)``, signalling ``align128(4E)``; everything twice (odd/even
    buffers); the total ``t`` becomes ``(t // 128 + 1) * 128``. ``num_ranks`` does not enter.
    """
    if min(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts) <= 0:
        raise ValueError(
            "num_max_dispatch_tokens_per_rank, hidden, num_ranks and num_experts must be positive"
        )
    W, H, E = num_max_dispatch_tokens_per_rank, hidden, num_experts
    scales = H // 128
    dispatch_msg = _INT4 + max(H * 2, H + scales * _FLOAT)
    combine_msg = scales * 4 + H * 2
    send = max(W * dispatch_msg, E * W * combine_msg)
    recv = max(E * W * dispatch_msg, E * W * combine_msg)
    signalling = _round_up(E * _INT, _ALIGN)
    total = 2 * (send + recv + signalling)
    return (total + _ALIGN) // _ALIGN * _ALIGN


@dataclass(frozen=True, kw_only=True)
class DeepEPHints:
    """Buffer sizes a ``deep_ep.Buffer`` would need for this cluster, and whether it fits at all.

    Attributes:
        supported: DeepEP's normal kernels accept this topology.
        reason: why not (empty when supported).
        num_sms: SMs assumed (``Buffer.num_sms``).
        hidden_bytes: ``H * max(elem_size, 2)``.
        dispatch_config / combine_config: the tuned configs (``as_tuple`` order), or None when
            DeepEP has no entry for R.
        nvl_bytes_dispatch / nvl_bytes_combine / num_nvl_bytes: NVLink hints and their max.
        rdma_bytes_dispatch / rdma_bytes_combine / num_rdma_bytes: RDMA hints and their max.
        ll_max_tokens: low-latency ``num_max_dispatch_tokens_per_rank`` assumed.
        ll_rdma_bytes: ``get_low_latency_rdma_size_hint`` for it.
    """

    supported: bool
    reason: str
    num_sms: int
    hidden_bytes: int
    dispatch_config: tuple[int, int, int, int, int] | None
    combine_config: tuple[int, int, int, int, int] | None
    nvl_bytes_dispatch: int | None
    nvl_bytes_combine: int | None
    num_nvl_bytes: int | None
    rdma_bytes_dispatch: int | None
    rdma_bytes_combine: int | None
    num_rdma_bytes: int | None
    ll_max_tokens: int
    ll_rdma_bytes: int


def _support_reason(num_ranks: int, ranks_per_node: int) -> str:
    P = DEEPEP_MAX_NVL_PEERS
    if num_ranks <= ranks_per_node:
        if num_ranks not in (2, 4, 8):
            return f"intranode kernels support 2, 4 or 8 ranks, not {num_ranks}"
        return ""
    if ranks_per_node != P:
        return (
            f"internode kernels assume {P} ranks per node (node = rank // {P}), not "
            f"L={ranks_per_node}"
        )
    if num_ranks // P > _MAX_RDMA_PEERS:
        return (
            f"internode kernels support at most {_MAX_RDMA_PEERS} nodes ({_MAX_RDMA_PEERS * P} "
            f"ranks), not {num_ranks // P}; the low-latency kernels still apply"
        )
    if num_ranks not in DISPATCH_CONFIGS:
        return f"no tuned DeepEP config for {num_ranks} ranks"
    return ""


def deepep_hints(
    *,
    hidden: int,
    num_experts: int,
    num_ranks: int,
    ranks_per_node: int,
    elem_size: int = 2,
    num_sms: int = DEEPEP_DEFAULT_NUM_SMS,
    ll_max_tokens: int = 128,
) -> DeepEPHints:
    """All DeepEP buffer hints for one cluster shape (see ``DeepEPHints``)."""
    if num_sms <= 0 or num_sms % 2:
        raise ValueError(f"num_sms must be a positive even number (DeepEP rule), got {num_sms}")
    hidden_bytes = hidden * max(elem_size, 2)
    reason = _support_reason(num_ranks, ranks_per_node)
    disp = comb = None
    nvl_d = nvl_c = rdma_d = rdma_c = None
    if num_ranks in DISPATCH_CONFIGS:
        disp, comb = dispatch_config(num_ranks, num_sms), combine_config(num_ranks, num_sms)
        nvl_d = disp.nvl_buffer_size_hint(hidden_bytes, num_ranks)
        nvl_c = comb.nvl_buffer_size_hint(hidden_bytes, num_ranks)
        rdma_d = disp.rdma_buffer_size_hint(hidden_bytes, num_ranks)
        rdma_c = comb.rdma_buffer_size_hint(hidden_bytes, num_ranks)
    return DeepEPHints(
        supported=not reason,
        reason=reason,
        num_sms=num_sms,
        hidden_bytes=hidden_bytes,
        dispatch_config=None if disp is None else disp.as_tuple(),
        combine_config=None if comb is None else comb.as_tuple(),
        nvl_bytes_dispatch=nvl_d,
        nvl_bytes_combine=nvl_c,
        num_nvl_bytes=None if nvl_d is None or nvl_c is None else max(nvl_d, nvl_c),
        rdma_bytes_dispatch=rdma_d,
        rdma_bytes_combine=rdma_c,
        num_rdma_bytes=None if rdma_d is None or rdma_c is None else max(rdma_d, rdma_c),
        ll_max_tokens=ll_max_tokens,
        ll_rdma_bytes=low_latency_rdma_size_hint(ll_max_tokens, hidden, num_ranks, num_experts),
    )
