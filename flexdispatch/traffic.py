"""Row and byte accounting: what a dispatch puts on each link, per rank, without running it.

Shape letters (ARCHITECTURE.md): T tokens on a source rank · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows. Also used here: S source ranks counted together.

Rank ``g = n * L + l`` is local rank ``l`` of node ``n``; expert ``x`` lives on rank ``x // e``.
Three transports are modelled, each with a dispatch direction and a mirrored combine direction:

- **flat** (ARCHITECTURE.md contract point 1): source ``s`` sends one row per (token, destination
  rank) straight to that rank. ``C[s, g]`` = tokens of ``s`` with an expert on ``g``.
- **hierarchical** (``backends/torch/hier.py``): hop 1 sends a row per (token, destination node) to
  the *forwarder* with the source's local index on that node (``D[s, n]`` rows, inter-node unless
  ``n`` is the source's node, where the forwarder is the source itself); hop 2 forwards inside the
  node, forwarder ``(n, l)`` sending ``F[(n, l), g] = sum over source nodes of C[(n_s, l), g]`` rows
  to each rank ``g`` of node ``n``. Combine sends the same rows back along the same hops.
- **deepep** uses the hierarchical pattern across nodes (DeepEP's internode kernels forward through
  the rank with the same GPU index) and the flat pattern inside one node (intranode kernels).

Self-sends are never counted as traffic (the torch backend's ``stats`` rule). A rank's combine
sends equal its dispatch receives, so receive volumes come for free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexdispatch._checks.tensors import check_tensor

__all__ = [
    "SourceRows",
    "LinkRows",
    "RowFormat",
    "count_source_rows",
    "count_rows_batched",
    "link_rows",
    "torch_row_format",
    "deepep_row_format",
    "TORCH_META_BYTES_PER_SLOT",
]

# torch backend: one int32 expert id + one fp32 prob per top-k slot travel beside every row
# (backends/torch/a2a.py, ``_META_BYTES_PER_SLOT``).
TORCH_META_BYTES_PER_SLOT = 8
# DeepEP internode ``SourceMeta``: ``int src_rdma_rank, is_token_in_nvl_rank_bits``.
_DEEPEP_SOURCE_META_BYTES = 8
_FP8_SCALE_BLOCK = 128


@dataclass(frozen=True, kw_only=True)
class SourceRows:
    """What the tokens of one source rank put on the wire (counts, not bytes).

    Attributes:
        rows_per_rank: ``[R]`` int64, tokens with at least one expert on rank ``g``: the flat rows
            from this source to ``g``, and the hop-2 rows forwarded to ``g`` on its behalf.
        rows_per_node: ``[N]`` int64, tokens with at least one expert on node ``n``: the hop-1
            rows from this source to node ``n``'s forwarder.
        pairs_per_rank: ``[R]`` int64, ``(token, slot)`` pairs whose expert lives on ``g``.
        tokens_per_expert: ``[E]`` int64, ``(token, slot)`` pairs per expert.
        num_tokens: T.
    """

    rows_per_rank: torch.Tensor
    rows_per_node: torch.Tensor
    pairs_per_rank: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int


@dataclass(frozen=True, kw_only=True)
class LinkRows:
    """Rows every rank sends, split by link class, for one transport.

    All fields are ``[R]`` int64 row counts sent by each rank (self-sends excluded). The dispatch
    receives of rank ``g`` equal its combine sends and vice versa.

    Attributes:
        mode: ``"flat"`` or ``"hierarchical"``.
        dispatch_intra: rows sent to ranks of the same node (NVLink), dispatch direction.
        dispatch_inter: rows sent to ranks of other nodes (RDMA), dispatch direction.
        combine_intra: rows sent inside the node, combine direction.
        combine_inter: rows sent across nodes, combine direction.
    """

    mode: str
    dispatch_intra: torch.Tensor
    dispatch_inter: torch.Tensor
    combine_intra: torch.Tensor
    combine_inter: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class RowFormat:
    """Bytes one row occupies on the wire.

    Attributes:
        dispatch_bytes: one dispatched row (payload + per-row metadata).
        combine_bytes: one combined row.
        description: what was counted, for reports.
    """

    dispatch_bytes: int
    combine_bytes: int
    description: str


def _check_topology(num_experts: int, num_ranks: int, ranks_per_node: int) -> int:
    """Validate E, R, L; return e = E / R."""
    if num_ranks < 1 or ranks_per_node < 1 or num_experts < 1:
        raise ValueError(
            f"num_experts ({num_experts}), num_ranks ({num_ranks}) and ranks_per_node "
            f"({ranks_per_node}) must be positive"
        )
    if num_ranks % ranks_per_node:
        raise ValueError(
            f"num_ranks={num_ranks} is not a multiple of ranks_per_node={ranks_per_node}"
        )
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_ranks={num_ranks}: experts are "
            f"sharded contiguously, so pick a rank count that divides the expert count"
        )
    return num_experts // num_ranks


def count_rows_batched(
    topk_idx: torch.Tensor, *, num_experts: int, num_ranks: int, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count_source_rows`` for S sources at once (vectorised, O(S*T*k log k)).

    Args:
        topk_idx: ``[S, T, k]`` int64 global expert ids, ``-1`` = no expert.
        num_experts, num_ranks, ranks_per_node: E, R, L.

    Returns:
        ``(rows_SR [S, R], rows_SN [S, N], pairs_SR [S, R], tokens_per_expert [E])``, all int64.
    """
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=3)
    e = _check_topology(num_experts, num_ranks, ranks_per_node)
    S = topk_idx.shape[0]
    R, L = num_ranks, ranks_per_node
    N = R // L
    valid_STK = topk_idx >= 0
    # NOTE: R is the sentinel rank of an empty slot; sorting puts it last in each token's slots.
    rank_STK = torch.where(valid_STK, topk_idx // e, torch.full_like(topk_idx, R))
    rank_STK = rank_STK.sort(dim=-1).values
    src_STK = torch.arange(S, device=topk_idx.device).view(S, 1, 1).expand_as(rank_STK)

    def distinct_counts(dest_STK: torch.Tensor, sentinel: int) -> torch.Tensor:
        first_STK = torch.ones_like(dest_STK, dtype=torch.bool)
        first_STK[..., 1:] = dest_STK[..., 1:] != dest_STK[..., :-1]
        keep = first_STK & (dest_STK < sentinel)
        key = src_STK[keep] * sentinel + dest_STK[keep]
        return torch.bincount(key, minlength=S * sentinel).view(S, sentinel)

    rows_SR = distinct_counts(rank_STK, R)
    # rank // L is monotone in rank, so the node ids of each token stay sorted.
    rows_SN = distinct_counts(torch.div(rank_STK, L, rounding_mode="floor"), N)
    valid_rank = rank_STK < R
    pairs_SR = torch.bincount(src_STK[valid_rank] * R + rank_STK[valid_rank], minlength=S * R).view(
        S, R
    )
    tokens_per_expert = torch.bincount(topk_idx[valid_STK], minlength=num_experts)
    return rows_SR, rows_SN, pairs_SR, tokens_per_expert


def count_source_rows(
    topk_idx: torch.Tensor, *, num_experts: int, num_ranks: int, ranks_per_node: int
) -> SourceRows:
    """Count the rows one source rank's tokens send, per destination rank and node.

    Usable on a real rank's routing to cross-check a backend's ``stats``: combine the results of
    every rank with ``link_rows`` and a ``RowFormat``.

    Args:
        topk_idx: ``[T, k]`` int64 global expert ids of the source rank, ``-1`` = no expert.
        num_experts: E, divisible by ``num_ranks``.
        num_ranks: R, a multiple of ``ranks_per_node``.
        ranks_per_node: L.

    Returns:
        SourceRows with ``[R]``, ``[N]``, ``[R]`` and ``[E]`` int64 counts (on ``topk_idx``'s
        device).

    Raises:
        TypeError: ``topk_idx`` is not an int64 tensor.
        ValueError: bad shape, or E, R, L that do not divide.
    """
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    rows_SR, rows_SN, pairs_SR, per_expert = count_rows_batched(
        topk_idx.unsqueeze(0),
        num_experts=num_experts,
        num_ranks=num_ranks,
        ranks_per_node=ranks_per_node,
    )
    return SourceRows(
        rows_per_rank=rows_SR[0],
        rows_per_node=rows_SN[0],
        pairs_per_rank=pairs_SR[0],
        tokens_per_expert=per_expert,
        num_tokens=topk_idx.shape[0],
    )


def link_rows(
    rows_SR: torch.Tensor, rows_SN: torch.Tensor, *, ranks_per_node: int, mode: str
) -> LinkRows:
    """Turn the all-sources count matrices into rows each rank sends per link class.

    Args:
        rows_SR: ``[R, R]`` int64, ``C[s, g]`` = ``SourceRows.rows_per_rank`` of source ``s``.
        rows_SN: ``[R, N]`` int64, ``D[s, n]`` = ``SourceRows.rows_per_node`` of source ``s``.
        ranks_per_node: L.
        mode: ``"flat"`` or ``"hierarchical"`` (see the module docstring).

    Returns:
        LinkRows with ``[R]`` int64 counts per sending rank.
    """
    R = rows_SR.shape[0]
    L = ranks_per_node
    if rows_SR.shape != (R, R) or R % L or rows_SN.shape != (R, R // L):
        raise ValueError(
            f"rows_SR must be [R, R] and rows_SN [R, R/L] with L={L} dividing R: got "
            f"{tuple(rows_SR.shape)} and {tuple(rows_SN.shape)}"
        )
    N = R // L
    device = rows_SR.device
    C = rows_SR.to(torch.int64)
    D = rows_SN.to(torch.int64)
    node_R = torch.arange(R, device=device) // L
    same_RR = node_R[:, None] == node_R[None, :]
    not_self_RR = ~torch.eye(R, dtype=torch.bool, device=device)
    intra_RR = same_RR & not_self_RR
    if mode == "flat":
        return LinkRows(
            mode=mode,
            dispatch_intra=(C * intra_RR).sum(1),
            dispatch_inter=(C * ~same_RR).sum(1),
            combine_intra=(C * intra_RR).sum(0),
            combine_inter=(C * ~same_RR).sum(0),
        )
    if mode != "hierarchical":
        raise ValueError(f"mode must be 'flat' or 'hierarchical', got {mode!r}")
    # Hop 1: source s -> forwarder (n, l_s) for every other node n.
    other_node_RN = node_R[:, None] != torch.arange(N, device=device)[None, :]
    hop1_send_R = (D * other_node_RN).sum(1)
    # Rows forwarder (n_f, l_f) received in hop 1 from other nodes: D[(n_s, l_f), n_f], n_s != n_f.
    D_NLN = D.view(N, L, N)
    recv_NLN = D_NLN * other_node_RN.view(N, L, N)
    hop1_recv_R = recv_NLN.sum(0).T.reshape(R)
    # Hop 2: forwarder (n, l) -> rank g of node n: F_l[l, g] = sum over source nodes C[(n_s, l), g];
    # F_FR[f, g] is what forwarder f sends to g (zero outside f's node, self-sends dropped).
    F_LR = C.view(N, L, R).sum(0)
    F_FR = F_LR[torch.arange(R, device=device) % L] * intra_RR
    return LinkRows(
        mode=mode,
        dispatch_intra=F_FR.sum(1),
        dispatch_inter=hop1_send_R,
        combine_intra=F_FR.sum(0),
        combine_inter=hop1_recv_R,
    )


def torch_row_format(*, hidden: int, topk: int, elem_size: int) -> RowFormat:
    """Row sizes of the torch backend (``backends/torch/a2a.py``): rows keep their dtype.

    Dispatch: ``H * elem_size`` plus ``8 * k`` bytes of metadata (int32 id + fp32 prob per slot);
    combine: ``H * elem_size``.
    """
    row = hidden * elem_size
    return RowFormat(
        dispatch_bytes=row + TORCH_META_BYTES_PER_SLOT * topk,
        combine_bytes=row,
        description=f"torch: H*{elem_size} row + {TORCH_META_BYTES_PER_SLOT}*k meta; combine H*"
        f"{elem_size}",
    )


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def deepep_row_format(*, hidden: int, topk: int, internode: bool) -> RowFormat:
    """Row sizes of DeepEP's normal kernels with FP8 dispatch and BF16 combine.

    What travels per token (read from DeepEP ``csrc/kernels/internode.cu`` ``dispatch``/
    ``combine`` and ``get_num_bytes_per_token``, and ``csrc/kernels/intranode.cu`` channel
    buffers); ``num_scales = ceil(H / 128)`` fp32 FP8 scales:

    - internode (RDMA hop and NVLink forward use the same slot): dispatch
      ``align16(H + 8 + 4*num_scales + 4*k + 4*k)`` (fp8 row, ``SourceMeta``, scales, top-k ids
      as int32, top-k weights fp32); combine ``align16(2*H + 8 + 4*k)`` (bf16 row, ``SourceMeta``,
      top-k weights).
    - intranode: dispatch ``H + 4 + 4*num_scales + 8*k + 4*k`` (fp8 row, int32 source index,
      scales, int64 top-k ids, fp32 weights); combine ``2*H + 4 + 4*k``.
    """
    num_scales = -(-hidden // _FP8_SCALE_BLOCK)
    if internode:
        meta = _DEEPEP_SOURCE_META_BYTES
        return RowFormat(
            dispatch_bytes=_align16(hidden + meta + 4 * num_scales + 8 * topk),
            combine_bytes=_align16(2 * hidden + meta + 4 * topk),
            description="deepep internode: align16(fp8 H + 8 SourceMeta + 4*H/128 scales + "
            "4k int32 ids + 4k fp32 weights); combine align16(bf16 2H + 8 + 4k)",
        )
    return RowFormat(
        dispatch_bytes=hidden + 4 + 4 * num_scales + 12 * topk,
        combine_bytes=2 * hidden + 4 + 4 * topk,
        description="deepep intranode: fp8 H + 4 src idx + 4*H/128 scales + 8k int64 ids + 4k "
        "fp32 weights; combine bf16 2H + 4 + 4k",
    )
