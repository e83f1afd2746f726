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
- DeepEP 2.1.0 (commit ``dd758caf``), V2: ``csrc/elastic/buffer.hpp``
  ``ElasticBuffer::get_dispatch_buffer_size`` / ``get_combine_buffer_size`` /
  ``calculate_buffer_size`` (``kNumMaxChannels = 8 * 160``; 2 MiB alignment, ``symmetric.hpp``)
  and ``deep_ep/include/deep_ep/common/layout.cuh`` (``TokenLayout``: 32-byte TMA-aligned parts,
  ``num_hidden_bytes % 32 == 0``; ``BufferLayout``: ranks x tokens x token bytes;
  ``WorkspaceLayout``: at most 1024 ranks, 2048 experts, 256 experts per rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

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
    "ELASTIC_ALIGNMENT_BYTES",
    "ELASTIC_MAX_TOPK",
    "ElasticBufferSize",
    "DeepEPElasticHints",
    "elastic_buffer_size",
    "elastic_buffer_size_hint",
    "elastic_hidden",
    "deepep_elastic_hints",
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


# --------------------------------------------------------------------- DeepEP V2 (ElasticBuffer)
ELASTIC_ALIGNMENT_BYTES = 2 * 1024 * 1024
"""``symmetric::kNumAlignmentBytes``: an ``ElasticBuffer`` is a multiple of 2 MiB."""
ELASTIC_MAX_TOPK = 32
"""The V2 kernels' ``kNumTopk <= 32``; also the k the size hint assumes for ``num_topk=0``."""
_ELASTIC_MAX_CHANNELS = 8 * 160  # kNumMaxChannelsPerSM * kNumMaxSMs = kNumMaxChannels
_ELASTIC_TMA_ALIGN = 32  # ptx::kNumTMAAlignBytes: every part of a token slot
_ELASTIC_MAX_RANKS = 1024  # WorkspaceLayout::kNumMaxRanks
_ELASTIC_MAX_EXPERTS = 2048  # WorkspaceLayout::kNumMaxExperts
_ELASTIC_MAX_LOCAL_EXPERTS = 256  # WorkspaceLayout::kNumMaxExpertsPerRank
# flexdispatch's V2 path (backends/deepep/elastic.py): dispatch rows padded to 16 bf16 columns,
# combine rows to a multiple of 256, and never fewer than 256 columns asked of the buffer.
_V2_DISPATCH_COLS = 16
_V2_COMBINE_COLS = 256


@dataclass(frozen=True, kw_only=True)
class ElasticBufferSize:
    """``ElasticBuffer.get_buffer_size_hint`` and the parts it is the maximum of.

    Attributes:
        num_rdma_ranks / num_nvl_ranks: physical domains (``get_physical_domain_size``): NVLink
            domains, and ranks in each.
        num_scaleout_ranks / num_scaleup_ranks: logical domains (``get_logical_domain_size``):
            hybrid mode ``(num_rdma_ranks, num_nvl_ranks)``, direct mode ``(1, R)``.
        scaleup_nvlink: the scale-up domain is one NVLink domain (direct mode: one node).
        num_max_tokens_per_rank: M.
        hidden: the hidden size passed (elements of the dispatch dtype).
        num_topk: the k the sizes assume (32 when 0 was passed).
        dispatch_token_bytes / combine_token_bytes: bytes of one token slot.
        dispatch_bytes / combine_bytes: the dispatch and combine buffer layouts.
        num_bytes: ``max(dispatch_bytes, combine_bytes)`` rounded up to 2 MiB (the hint).
    """

    num_rdma_ranks: int
    num_nvl_ranks: int
    num_scaleout_ranks: int
    num_scaleup_ranks: int
    scaleup_nvlink: bool
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    dispatch_token_bytes: int
    combine_token_bytes: int
    dispatch_bytes: int
    combine_bytes: int
    num_bytes: int


def elastic_buffer_size(
    *,
    num_ranks: int,
    num_nvl_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    use_fp8_dispatch: bool = False,
    allow_hybrid_mode: bool = False,
    allow_multiple_reduction: bool = True,
) -> ElasticBufferSize:
    """``ElasticBuffer.get_buffer_size_hint`` (``ElasticBuffer::calculate_buffer_size``), in parts.

    With ``a(x)`` = x rounded up to 32 bytes, ``elem`` = 1 (fp8) or 2 (bf16), ``s`` =
    ``ceil(H / 32)`` scale packs for fp8 (else 0), a dispatch slot is
    ``a(H * elem) + a(4s) + a(8k + 4(1 + k))`` bytes and a combine slot ``a(2H) + a(8k)``.
    Direct mode (one scale-out domain; ``nvl`` = the scale-up domain is the NVLink domain,
    ``amr`` = ``allow_multiple_reduction``)::

        dispatch = ((0 if nvl else 1) + R) * M * slot_d
        combine  = (0 if nvl else R) * M * (1 if amr else k) * slot_c
                   + (min(R, k) if amr else k) * M * slot_c

    Hybrid mode (``SO`` scale-out x ``SU`` scale-up ranks, ``SO > 1``; ``C = 1280`` channels)::

        dispatch = SU * SO * M * slot_d + M * slot_d + SO * (M + C) * slot_d
        combine  = (min(SU, k) if amr else k) * SO * M * slot_c
                   + (min(SO, k) if amr else k) * M * slot_c
                   + (1 if amr else k) * SO * (M + C) * slot_c

    The hint is ``max(dispatch, combine)`` rounded up to 2 MiB.

    Args:
        num_ranks: R, ranks of the group.
        num_nvl_ranks: ranks of one NVLink domain (what NCCL reports; the planner's L), capped
            at R; R must be a multiple of it.
        num_max_tokens_per_rank: M > 0.
        hidden: H > 0, in elements of the dispatch dtype (bf16 columns unless fp8).
        num_topk: k >= 0 (0: size for 32).
        use_fp8_dispatch / allow_hybrid_mode / allow_multiple_reduction: as DeepEP's.

    Raises:
        ValueError: where DeepEP's host asserts fail (M or H not positive, ``4 * ceil(H / 32) > H``,
            ``H * elem`` not a multiple of 32, R not a multiple of the NVLink domain).
    """
    R, M, H = num_ranks, num_max_tokens_per_rank, hidden
    if M <= 0 or H <= 0:
        raise ValueError(f"num_max_tokens_per_rank and hidden must be positive, got M={M}, H={H}")
    if -(-H // 32) * _FLOAT > H:
        raise ValueError(f"hidden={H} is too small: DeepEP needs ceil(H / 32) * 4 <= H")
    if num_topk < 0:
        raise ValueError(f"num_topk must be >= 0, got {num_topk}")
    if R < 1 or num_nvl_ranks < 1:
        raise ValueError(f"num_ranks and num_nvl_ranks must be >= 1, got {R}, {num_nvl_ranks}")
    k = ELASTIC_MAX_TOPK if num_topk == 0 else num_topk
    nvl = min(num_nvl_ranks, R)
    if R % nvl:
        raise ValueError(f"num_ranks={R} is not a multiple of the NVLink domain of {nvl} ranks")
    rdma = R // nvl
    SO, SU = (rdma, nvl) if allow_hybrid_mode else (1, R)
    nvlink = nvl == SU  # is_scaleup_nvlink
    elem = 1 if use_fp8_dispatch else 2
    packs = -(-H // 32) if use_fp8_dispatch else 0
    if (H * elem) % _ELASTIC_TMA_ALIGN:
        raise ValueError(
            f"hidden={H} x {elem} B = {H * elem} bytes is not a multiple of "
            f"{_ELASTIC_TMA_ALIGN} (DeepEP's token layout: bf16 H % 16, fp8 H % 32)"
        )
    a = _ELASTIC_TMA_ALIGN
    slot_d = (
        _round_up(H * elem, a) + _round_up(packs * _FLOAT, a) + _round_up(k * 8 + (1 + k) * 4, a)
    )
    slot_c = _round_up(H * 2, a) + _round_up(k * 8, a)
    amr = allow_multiple_reduction
    if SO == 1:
        dispatch = ((0 if nvlink else 1) + R) * M * slot_d
        combine = (0 if nvlink else R) * M * (1 if amr else k) * slot_c
        combine += (min(R, k) if amr else k) * M * slot_c
    else:
        C = _ELASTIC_MAX_CHANNELS
        dispatch = SU * (SO * M) * slot_d + M * slot_d + SO * (M + C) * slot_d
        combine = (min(SU, k) if amr else k) * (SO * M) * slot_c
        combine += (min(SO, k) if amr else k) * M * slot_c
        combine += (1 if amr else k) * (SO * (M + C)) * slot_c
    return ElasticBufferSize(
        num_rdma_ranks=rdma,
        num_nvl_ranks=nvl,
        num_scaleout_ranks=SO,
        num_scaleup_ranks=SU,
        scaleup_nvlink=nvlink,
        num_max_tokens_per_rank=M,
        hidden=H,
        num_topk=k,
        dispatch_token_bytes=slot_d,
        combine_token_bytes=slot_c,
        dispatch_bytes=dispatch,
        combine_bytes=combine,
        num_bytes=_round_up(max(dispatch, combine), ELASTIC_ALIGNMENT_BYTES),
    )


def elastic_buffer_size_hint(**sizes: Any) -> int:
    """Bytes ``ElasticBuffer.get_buffer_size_hint`` returns: ``elastic_buffer_size(**sizes)``'s
    total (same keyword arguments)."""
    return elastic_buffer_size(**sizes).num_bytes


def elastic_hidden(hidden: int, elem_size: int) -> tuple[int, int]:
    """``(dispatch, combine)`` hidden, in bf16 columns, that flexdispatch's V2 path sizes for.

    What ``backends/deepep/elastic.py`` asks its shared buffer for with ``[T, H]`` rows:

    - dispatch (and cached dispatch) of rows of 2 or 4 bytes: their bf16 bit view, ``H * elem /
      2`` columns rounded up to 8 (``WireFormat``) and then to 16 (32-byte token rows), at least
      256; ``elem_size=1`` stands for an fp8 ``(x, scales)`` tuple: ``H / 2`` columns (its bytes
      in bf16 columns; H a multiple of 32), at least 256;
    - combine: rows cast to bf16, padded to a multiple of 256 columns (narrow fp32 rows take the
      exact path, which also asks for 256).

    The shared buffer is sized for the larger of the two once a layer has dispatched and combined
    (it keeps the union of what its calls asked for).
    """
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    if elem_size == 1:
        if hidden % 32:
            raise ValueError(f"fp8 (x, scales) rows need H % 32 == 0 on the V2 path, got {hidden}")
        dispatch = hidden // 2
    elif elem_size in (2, 4):
        wire = _round_up(hidden * elem_size // 2, 8)
        dispatch = _round_up(wire, _V2_DISPATCH_COLS)
    else:
        raise ValueError(f"elem_size must be 1 (fp8 tuple), 2 or 4 bytes, got {elem_size}")
    return max(dispatch, _V2_COMBINE_COLS), _round_up(hidden, _V2_COMBINE_COLS)


@dataclass(frozen=True, kw_only=True)
class DeepEPElasticHints:
    """What flexdispatch's V2 path (``deepep_api='v2'``) would allocate for a cluster shape.

    Direct mode (``allow_hybrid_mode=False``), ``allow_multiple_reduction=True``, a bf16-sized
    buffer (``use_fp8_dispatch=False``), hidden = ``max(dispatch_hidden, combine_hidden)``.

    Attributes:
        supported: the V2 kernels accept this shape.
        reason: why not (empty when supported).
        elem_size: bytes per element of the dispatched rows (1: fp8 ``(x, scales)`` tuples).
        dispatch_hidden / combine_hidden / hidden: bf16 columns (``elastic_hidden``).
        dropless: the hint at ``M = T`` (``num_max_dispatch_tokens_per_rank`` must be >= T).
        worst_case_w: the smallest ``num_worst_tokens`` the V2 path takes: ``T * R``
            (``M = W / R`` receive slots per source rank must hold each rank's T tokens).
        worst_case: the hint at ``M = worst_case_w / R`` (= T: the dropless figure).
    """

    supported: bool
    reason: str
    elem_size: int
    dispatch_hidden: int
    combine_hidden: int
    hidden: int
    dropless: ElasticBufferSize
    worst_case_w: int
    worst_case: ElasticBufferSize


def _elastic_reason(
    num_experts: int, num_ranks: int, topk: int, hidden: int, elem_size: int
) -> str:
    if topk > ELASTIC_MAX_TOPK:
        return f"V2 kernels take at most {ELASTIC_MAX_TOPK} experts per token, not k={topk}"
    if num_ranks > _ELASTIC_MAX_RANKS:
        return f"V2 takes at most {_ELASTIC_MAX_RANKS} ranks, not {num_ranks}"
    if num_experts > _ELASTIC_MAX_EXPERTS:
        return f"V2 takes at most {_ELASTIC_MAX_EXPERTS} experts, not E={num_experts}"
    if num_experts // num_ranks > _ELASTIC_MAX_LOCAL_EXPERTS:
        return (
            f"V2 takes at most {_ELASTIC_MAX_LOCAL_EXPERTS} experts per rank, not "
            f"e={num_experts // num_ranks}"
        )
    if elem_size == 1 and hidden % 32:
        return f"fp8 (x, scales) rows need H % 32 == 0, not H={hidden}"
    return ""


def deepep_elastic_hints(
    *,
    hidden: int,
    num_experts: int,
    num_ranks: int,
    ranks_per_node: int,
    topk: int,
    tokens: int,
    elem_size: int = 2,
) -> DeepEPElasticHints:
    """The V2 buffer flexdispatch would build for T ``tokens`` per rank (see the class)."""
    if tokens <= 0 or topk <= 0:
        raise ValueError(f"tokens and topk must be positive, got {tokens}, {topk}")
    reason = _elastic_reason(num_experts, num_ranks, topk, hidden, elem_size)
    # NOTE: fp8 rows with H % 32 != 0 are refused (reason); the sizes pad H to 32 regardless.
    fp8_pad = elem_size == 1 and hidden % 32
    d_hidden, c_hidden = elastic_hidden(_round_up(hidden, 32) if fp8_pad else hidden, elem_size)
    H = max(d_hidden, c_hidden)

    def size(M: int) -> ElasticBufferSize:
        return elastic_buffer_size(
            num_ranks=num_ranks,
            num_nvl_ranks=ranks_per_node,
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=topk,
            use_fp8_dispatch=False,
            allow_hybrid_mode=False,
            allow_multiple_reduction=True,
        )

    W = tokens * num_ranks
    dropless = size(tokens)
    return DeepEPElasticHints(
        supported=not reason,
        reason=reason,
        elem_size=elem_size,
        dispatch_hidden=d_hidden,
        combine_hidden=c_hidden,
        hidden=H,
        dropless=dropless,
        worst_case_w=W,
        worst_case=size(W // num_ranks),
    )
