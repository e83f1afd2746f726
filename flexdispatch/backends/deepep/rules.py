"""DeepEP's kernel limits per release, and the row / chunk plans that honour them (pure Python).

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node (DeepEP's NVLink domain) · N = R / L
nodes · E experts · e = E / R local experts · k top-k · H hidden · Xw bf16 columns on the wire.

Every number here was read in DeepEP's source at two releases: tag ``v1.2.1`` (commit
``9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee``, ``csrc/...``) and ``main`` as of DeepEP 2.1.0
(commit ``dd758caf451848bd150e1046af3d0a73e5fff38d``, ``csrc/kernels/legacy/...``, the
``sgl-deep-ep`` wheel). ``docs/deepep.md`` lists them with what flexdispatch does about each;
the emulated runtime in ``tests/deepep_emu/runtime`` enforces the same limits under DeepEP's own
Python layer.

- Intranode dispatch, SM90 TMA receive path (``intranode.cu`` v1.2.1 l.235, main l.304):
  ``hidden_int4 % 2 == 0 and hidden_bytes / 2 + 8 <= 8192`` — rows a multiple of 32 bytes and at
  most 16,368 bytes, so at most 16,352 bytes (8,176 bf16 columns). A violation traps the GPU.
- Internode dispatch (``internode.cu`` v1.2.1 l.45, l.453): ``get_num_bytes_per_token`` = row +
  8-byte ``SourceMeta`` + 4 per scale + 4 per top-k id + 4 per weight, aligned to 16, and that
  plus 8 must fit the 16,384-byte TMA buffer of a warp.
- Internode combine (``internode.cu`` v1.2.1 l.1250, l.1448): ``hidden_int4 % 32 == 0`` (bf16
  width a multiple of 256) and the same per-token byte cap (row + ``SourceMeta`` + weights).
- Intranode combine at v1.2.1 (``intranode.cu``, the reduce loop over ``hidden_int4`` in steps of
  32 lanes around warp-wide TMA stores): a width that is not a multiple of 256 bf16 columns lets
  the warp diverge (a hang); fixed on main, where any multiple of 8 columns works.
- Local experts: intranode ``notify_dispatch`` runs one thread per local expert with 128 threads
  (``intranode.cu`` v1.2.1 l.123: ``E / R <= 128`` and ``R <= 128``); internode ``notify_dispatch``
  has 512 threads and needs the experts of one node, ``E / N``, to fit (``internode.cu`` v1.2.1
  l.191 ``num_rdma_experts <= num_threads``, l.333).
- Rank / node counts: ``SWITCH_RANKS`` 2/4/8 ranks intranode; ``SWITCH_RDMA_RANKS`` at v1.2.1
  (``launch.cuh`` l.62) 2/4/8/16/18/20 nodes, on main 2/3/4/6/8/12/16/18/20.
- QPs: internode normal kernels trap unless ``num_rc_per_pe == num_channels or >= num_sms``
  (``internode.cu`` v1.2.1 l.386); low-latency dispatch traps unless ``num_rc_per_pe >= e``
  (``internode_ll.cu`` v1.2.1 l.181). One buffer serves both with ``max(num_sms, e)`` QPs.
- Low latency: hidden sizes of ``SWITCH_HIDDEN`` (v1.2.1 ``launch.cuh`` l.87; main adds 3072),
  ``k <= kNumMaxTopK`` (11), ``(R * num_max) % 4 == 0`` (``deep_ep.cpp`` low_latency_dispatch),
  ``NVSHMEM_QP_DEPTH >= 2 * (num_max + 1)`` (main ``legacy.py`` asserts it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "RELEASES",
    "DEFAULT_RELEASE",
    "Rules",
    "rules_for",
    "release_of",
    "Chunk",
    "plan_chunks",
    "internode_token_bytes",
]

RELEASES = ("1.2.1", "2.1.0")
"""The DeepEP releases flexdispatch supports: the v1.2.1 source build and the 2.1.0 wheel."""
DEFAULT_RELEASE = "1.2.1"
"""Limits assumed when a ``deep_ep`` module does not say its release (the stricter set)."""

_TMA_WARP_BYTES_INTRANODE = 8192  # intranode.cu: kNumTMABytesPerWarp of the dispatch
_TMA_WARP_BYTES_INTERNODE = 16384  # internode.cu: kNumTMABytesPerWarp / PerSenderWarp
_MBARRIER_BYTES = 8  # sizeof(uint64_t) that shares the TMA buffer
_SOURCE_META_BYTES = 8  # internode.cu: sizeof(SourceMeta)


@dataclass(frozen=True, kw_only=True)
class Rules:
    """The limits of one DeepEP release that the adapter must honour.

    Attributes:
        release: ``"1.2.1"`` or ``"2.1.0"``.
        intranode_rank_counts: R accepted on one node.
        internode_node_counts: N accepted across nodes.
        max_local_experts_intranode: e accepted by the intranode layout notify.
        max_experts_per_node_internode: ``E / N`` accepted by the internode notify.
        intranode_dispatch_max_row_bytes: largest intranode row (a multiple of
            ``intranode_dispatch_row_multiple``).
        intranode_dispatch_row_multiple: intranode rows are a multiple of this many bytes.
        internode_max_token_bytes: ``get_num_bytes_per_token`` limit (row + metadata).
        intranode_combine_col_multiple: bf16 columns of an intranode combine row divide by it.
        internode_combine_col_multiple: bf16 columns of an internode combine row divide by it.
        low_latency_hidden_sizes: H compiled into the low-latency kernels.
        low_latency_max_topk: k accepted by the low-latency kernels.
        low_latency_max_tokens_per_rank: tokens per rank and low-latency call.
    """

    release: str
    intranode_rank_counts: tuple[int, ...] = (2, 4, 8)
    internode_node_counts: tuple[int, ...] = (2, 4, 8, 16, 18, 20)
    max_local_experts_intranode: int = 128
    max_experts_per_node_internode: int = 512
    intranode_dispatch_max_row_bytes: int = (
        2 * (_TMA_WARP_BYTES_INTRANODE - _MBARRIER_BYTES) // 32 * 32
    )
    intranode_dispatch_row_multiple: int = 32
    internode_max_token_bytes: int = (_TMA_WARP_BYTES_INTERNODE - _MBARRIER_BYTES) // 16 * 16
    intranode_combine_col_multiple: int = 256
    internode_combine_col_multiple: int = 256
    low_latency_hidden_sizes: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
    low_latency_max_topk: int = 11
    low_latency_max_tokens_per_rank: int = 1024

    def combine_col_multiple(self, internode: bool) -> int:
        """bf16 columns a combine row must be a multiple of."""
        if internode:
            return self.internode_combine_col_multiple
        return self.intranode_combine_col_multiple

    def dispatch_col_multiple(self, internode: bool) -> int:
        """bf16 columns a dispatch row must be a multiple of: 16 intranode (the SM90 TMA path
        takes rows of a multiple of 32 bytes), 8 internode (rows of whole int4)."""
        return 8 if internode else self.intranode_dispatch_row_multiple // 2

    def dispatch_max_cols(self, internode: bool, *, num_scales: int = 0, topk: int = 0) -> int:
        """Most bf16 columns one dispatch row may carry (a multiple of 16)."""
        if not internode:
            return self.intranode_dispatch_max_row_bytes // 2
        meta = _SOURCE_META_BYTES + 4 * num_scales + 8 * topk
        return (self.internode_max_token_bytes - meta) // 32 * 16

    def combine_max_cols(self, internode: bool, *, topk: int = 0) -> int:
        """Most bf16 columns one combine row may carry (a multiple of the combine multiple)."""
        multiple = self.combine_col_multiple(internode)
        if not internode:
            # NOTE: the intranode combine has no per-row TMA cap; keep rows within the dispatch
            # cap anyway so one buffer size serves both directions.
            cap = self.intranode_dispatch_max_row_bytes // 2
        else:
            cap = (self.internode_max_token_bytes - _SOURCE_META_BYTES - 4 * topk) // 2
        return cap // multiple * multiple


_RULES = {
    "1.2.1": Rules(release="1.2.1"),
    "2.1.0": Rules(
        release="2.1.0",
        internode_node_counts=(2, 3, 4, 6, 8, 12, 16, 18, 20),
        intranode_combine_col_multiple=8,
        low_latency_hidden_sizes=(2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192),
    ),
}


def rules_for(release: str) -> Rules:
    """The limits of ``release`` (``"1.2.1"`` or ``"2.1.0"``)."""
    try:
        return _RULES[release]
    except KeyError:
        raise ValueError(
            f"unknown DeepEP release {release!r}: flexdispatch knows {', '.join(RELEASES)}"
        ) from None


def release_of(module: object) -> str:
    """The release whose limits apply to a ``deep_ep`` module.

    The test runtime names it (``EMULATED_RELEASE``); DeepEP 2.x has ``__version__``; a v1.2.1
    source build has neither, and an unknown version gets the stricter v1.2.1 limits.
    """
    named = getattr(module, "EMULATED_RELEASE", None)
    if named in _RULES:
        return str(named)
    version = str(getattr(module, "__version__", ""))
    return "2.1.0" if version.startswith("2.") else DEFAULT_RELEASE


@dataclass(frozen=True)
class Chunk:
    """One DeepEP call's share of a wide row: wire columns ``[start, start + width)``, padded."""

    start: int
    width: int
    padded: int


def plan_chunks(total: int, max_cols: int, multiple: int) -> tuple[Chunk, ...]:
    """Split ``total`` bf16 columns into the fewest chunks DeepEP accepts.

    Each chunk is at most ``max_cols`` wide and padded to a multiple of ``multiple``; chunks are
    as equal as the multiple allows, so the padding stays small.

    Raises:
        ValueError: ``max_cols`` is smaller than ``multiple``.
    """
    if total <= 0:
        raise ValueError(f"rows need at least one column, got {total}")
    if max_cols < multiple or multiple <= 0:
        raise ValueError(f"no chunk fits: max_cols={max_cols} < multiple={multiple}")
    cap = max_cols // multiple * multiple
    n = -(-total // cap)
    per = -(-total // n)
    per = -(-per // multiple) * multiple
    chunks = []
    start = 0
    while start < total:
        width = min(per, total - start)
        chunks.append(Chunk(start, width, -(-width // multiple) * multiple))
        start += width
    return tuple(chunks)


def internode_token_bytes(row_bytes: int, *, num_scales: int = 0, topk: int = 0) -> int:
    """DeepEP's ``get_num_bytes_per_token`` for a dispatch row (``internode.cu``)."""
    raw = row_bytes + _SOURCE_META_BYTES + 4 * num_scales + 8 * topk
    return -(-raw // 16) * 16
