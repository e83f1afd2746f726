"""The count exchange every backend runs before rows move, and the agreement check on it.

T tokens on this rank · R ranks · L ranks per node · N = R / L nodes · H hidden · k top-k.

One all-gather of a ``[2R + N + 4]`` int64 vector per rank — rows for every rank, rows for every
node, then H, k, a dtype code and T, then (token, expert) pairs for every rank — gives every rank
the whole ``[R, 2R + N + 4]`` matrix ``G``.
With it every rank can size its receive buffers and raise the *same* error when the ranks
disagree on the row shape or dtype, instead of hanging or mixing garbage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import is_capturing
from flexdispatch.distributed import (
    collective_guard,
    group_size,
    is_distributed,
    start_gather_int64,
)

__all__ = [
    "DTYPE_CODES",
    "check_agreement",
    "count_vector",
    "check_token_rows",
    "exchange_counts",
    "recv_pairs",
    "start_exchange",
]

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
}


def exchange_counts(
    mask_TR: torch.Tensor,
    *,
    hidden: int,
    topk: int,
    dtype: torch.dtype,
    ranks_per_node: int,
    group: dist.ProcessGroup | None,
    pairs_R: torch.Tensor,
    per_node: bool = True,
) -> torch.Tensor:
    """All-gather ``[rows per rank (R), rows per node (N), H, k, dtype, T, pairs per rank (R)]``.

    Args:
        mask_TR: ``[T, R]`` bool, token ``t`` goes to rank ``r``.
        hidden, topk, dtype: the row shape this rank dispatches.
        ranks_per_node: L (dividing R).
        group: the dispatcher's process group.
        pairs_R: ``[R]`` int64, valid ``(token, slot)`` pairs whose expert lives on each rank.
        per_node: count the rows per node; False (a caller that never reads them, e.g. flat
            mode) sends zeros there instead (two ops fewer; the layout of ``G`` stays).

    Returns:
        ``G``: ``[R, 2R + N + 4]`` int64 on the collective device; row ``s`` is rank ``s``'s.
    """
    G, _ = start_exchange(
        mask_TR,
        hidden=hidden,
        topk=topk,
        dtype=dtype,
        ranks_per_node=ranks_per_node,
        group=group,
        pairs_R=pairs_R,
        per_node=per_node,
        async_op=False,
    )
    return G


def check_token_rows(rows: list[list[int]], refusal: str | None = None) -> list[int]:
    """Every rank's T from the gathered ``[T, X, k, dtype code, refused]`` rows (rank-major),
    after checking them alike on every rank.

    Args:
        refusal: why this rank cannot send its rows (a backend's limit), or None.

    Returns:
        ``[R]`` token counts, rank-major.

    Raises:
        ValueError: on every rank alike, when the ranks' row shapes differ (``check_agreement``)
            or a rank refuses its rows (that rank raises its reason, the others name it).
    """
    check_agreement([r[1:4] for r in rows], num_ranks=0, num_nodes=0)
    refused = [r for r, row in enumerate(rows) if row[4]]
    if refusal is not None:
        raise ValueError(refusal)
    if refused:
        raise ValueError(
            f"rank(s) {', '.join(map(str, refused))} cannot send these rows (their error names "
            f"the limit), so every rank raises before any row moves"
        )
    return [r[0] for r in rows]


EXCHANGE_NAME = "all_gather (dispatch count exchange)"


def start_exchange(
    mask_TR: torch.Tensor,
    *,
    hidden: int,
    topk: int,
    dtype: torch.dtype,
    ranks_per_node: int,
    group: dist.ProcessGroup | None,
    pairs_R: torch.Tensor,
    per_node: bool = False,
    async_op: bool = True,
) -> tuple[torch.Tensor, dist.Work | None]:
    """``exchange_counts`` (same arguments; ``per_node`` False by default: flat mode never reads
    the rows per node), started asynchronously with ``async_op``: ``(G, work)``; ``G`` is
    complete once ``work`` is waited on (``PendingCounts.wait``). ``work`` is None when the
    exchange already finished (``async_op`` False, or no process group)."""
    vec = count_vector(
        mask_TR,
        hidden=hidden,
        topk=topk,
        dtype=dtype,
        ranks_per_node=ranks_per_node,
        pairs_R=pairs_R,
        per_node=per_node,
    )
    if not is_distributed(group) or group_size(group) == 1:
        return vec.reshape(1, -1), None  # NOTE: a world of one: nothing to gather
    G = torch.empty(group_size(group), vec.numel(), dtype=torch.int64, device=vec.device)
    with collective_guard(EXCHANGE_NAME, group):
        work = start_gather_int64(G.view(-1), vec, group, async_op=async_op)
    return G, work


def count_vector(
    mask_TR: torch.Tensor,
    *,
    hidden: int,
    topk: int,
    dtype: torch.dtype,
    ranks_per_node: int,
    pairs_R: torch.Tensor,
    per_node: bool = True,
) -> torch.Tensor:
    """This rank's ``[2R + N + 4]`` int64 row of ``exchange_counts`` (arguments as there)."""
    T, R = mask_TR.shape
    L = ranks_per_node
    per_rank = mask_TR.sum(0, dtype=torch.int64)
    values = (hidden, topk, DTYPE_CODES[dtype], T)
    if per_node:
        # NOTE: with one rank per node the rows per node are the rows per rank (no launch)
        nodes_N = (
            per_rank if L == 1 else mask_TR.view(T, R // L, L).any(-1).sum(0, dtype=torch.int64)
        )
        parts = [per_rank, nodes_N, _info(mask_TR.device, values)]
    else:  # NOTE: the N zeros ride in the cached info vector (no launch)
        parts = [per_rank, _info(mask_TR.device, (0,) * (R // L) + values)]
    return torch.cat([*parts, pairs_R.to(torch.int64)])


_INFOS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_MAX_INFOS = 64


def _info(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    """``[len(values)]`` int64 ``values`` (``(H, k, dtype code, T)``, maybe after N zeros) on
    ``device``, kept across calls (read-only).

    NOTE: filled with scalars on the device (a host-to-device copy would block on CUDA); a
    dispatch with the same shapes as an earlier one reuses that tensor (no launch at all). Not
    kept while a CUDA graph is being captured (values written there exist only on replay).
    """
    key = (device, values)
    info = _INFOS.get(key)
    if info is not None:
        return info
    info = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, value in enumerate(values):
        info[i] = value
    if not is_capturing():
        if len(_INFOS) >= _MAX_INFOS:
            _INFOS.clear()
        _INFOS[key] = info
    return info


def check_agreement(Gh: list[list[int]], *, num_ranks: int, num_nodes: int) -> None:
    """Raise the same ValueError on every rank when H, k or the dtype differ across ranks.

    Args:
        Gh: the host copy of ``G`` (``[R][2R + N + 4]`` ints); or, with ``num_ranks`` and
            ``num_nodes`` 0, rows that start with ``[H, k, dtype code]``.
        num_ranks: R (the columns before H: R + N).
        num_nodes: N.
    """
    base = num_ranks + num_nodes
    names = ("hidden size H (x.shape[1])", "topk k (topk_idx.shape[1])", "x dtype")
    dtype_names = {v: str(d).replace("torch.", "") for d, v in DTYPE_CODES.items()}
    for j, what in enumerate(names):
        col = [row[base + j] for row in Gh]
        if len(set(col)) > 1:
            shown = [dtype_names.get(v, str(v)) for v in col] if j == 2 else col
            raise ValueError(
                f"ranks disagree on the {what}: "
                + ", ".join(f"rank {r}={v}" for r, v in enumerate(shown))
                + ": every rank must dispatch rows of the same shape and dtype"
            )


def recv_pairs(Gh: list[list[int]], *, rank: int, num_ranks: int, num_nodes: int) -> int:
    """``(row, slot)`` pairs with a local expert that ``rank`` receives, from the host copy of
    ``G`` (so a dropless receiver knows it without another sync)."""
    col = 2 * num_ranks + num_nodes + 4 - num_ranks + rank
    return sum(row[col] for row in Gh)
