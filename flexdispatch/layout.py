"""Dispatch layout: DeepEP's ``Buffer.get_dispatch_layout`` in plain torch.

T tokens · k top-k · E experts · R ranks · L ranks per node · N = R / L nodes · e = E / R.
Vectorised, no host synchronisation (shape checks only read metadata).
"""

from __future__ import annotations

import torch

from flexdispatch._checks import fits
from flexdispatch._checks.tensors import check_ids_in_range, check_tensor, checks_enabled
from flexdispatch._checks.values import check_int
from flexdispatch.types import DispatchLayout

__all__ = ["get_dispatch_layout"]


def get_dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    *,
    ranks_per_node: int = 8,
    checks: bool | None = None,
) -> DispatchLayout:
    """Count what a dispatch will move, exactly as DeepEP does.

    Args:
        topk_idx: ``[T, k]`` int64 global expert ids, ``-1`` = no expert.
        num_experts: E, divisible by ``num_ranks`` (expert ``x`` lives on rank ``x // (E / R)``).
        num_ranks: R, ranks of the expert-parallel group.
        ranks_per_node: L; ``num_tokens_per_rdma_rank`` is computed only when ``R > L``.
        checks: run the host-syncing id-range check (default: ``FLEXDISPATCH_CHECKS``).

    Returns:
        ``DispatchLayout`` with int32 counts and a ``[T, R]`` bool mask, on ``topk_idx``'s device.

    Raises:
        TypeError: ``topk_idx`` is not an int64 tensor, or a count is not an int.
        ValueError: a bad shape or count (the message names it), or ids outside ``[-1, E)``
            when checks are enabled.
    """
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    for name, value in (
        ("num_experts", num_experts),
        ("num_ranks", num_ranks),
        ("ranks_per_node", ranks_per_node),
    ):
        check_int(name, value, error=TypeError)
    if num_experts <= 0 or num_ranks <= 0:
        raise ValueError(
            f"num_experts ({num_experts}) and num_ranks ({num_ranks}) must be positive"
        )
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_ranks={num_ranks}: experts are "
            f"sharded contiguously, so pick a world size that divides the expert count"
        )
    if ranks_per_node <= 0:
        raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
    has_rdma = num_ranks > ranks_per_node
    if has_rdma and num_ranks % ranks_per_node:
        raise ValueError(
            f"num_ranks={num_ranks} is not a multiple of ranks_per_node={ranks_per_node}"
        )
    T, k = topk_idx.shape
    # NOTE: host ints only: an estimate under fits.SMALL_BYTES costs one comparison.
    if 4 * num_experts + T * (2 * num_ranks + 24 * k) >= fits.SMALL_BYTES:
        fits.check_fits(
            "get_dispatch_layout",
            "num_experts",
            num_experts,
            4 * num_experts,
            topk_idx.device,
            detail="[E] int32 counts",
        )
        fits.check_fits(
            "get_dispatch_layout",
            "num_ranks" if num_ranks > 12 * k else "topk_idx.shape",
            num_ranks if num_ranks > 12 * k else (T, k),
            T * (2 * num_ranks + 24 * k),
            topk_idx.device,
            detail=f"[T, R] bool masks for T={T} tokens, k={k}",
        )
    if checks_enabled(checks):
        check_ids_in_range("topk_idx", topk_idx, num_experts)

    device = topk_idx.device
    experts_per_rank = num_experts // num_ranks
    # NOTE: without checks, ids outside [0, E) are treated like -1 (never an out-of-bounds index).
    valid_TK = (topk_idx >= 0) & (topk_idx < num_experts)
    # NOTE: -1 ids land in a spare bucket that is cut off afterwards. scatter_add_, not bincount:
    # bincount reads the maximum on the host (a device sync on CUDA).
    safe_TK = torch.where(valid_TK, topk_idx, torch.full_like(topk_idx, num_experts))
    num_tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    num_tokens_per_expert.scatter_add_(
        0, safe_TK.flatten(), torch.ones(safe_TK.numel(), dtype=torch.int32, device=device)
    )
    num_tokens_per_expert = num_tokens_per_expert[:num_experts]

    rank_TK = torch.where(
        valid_TK, topk_idx // experts_per_rank, torch.full_like(topk_idx, num_ranks)
    )
    is_token_in_rank = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=device)
    is_token_in_rank.scatter_(1, rank_TK, True)
    is_token_in_rank = is_token_in_rank[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)

    num_tokens_per_rdma_rank = None
    if has_rdma:
        num_nodes = num_ranks // ranks_per_node
        in_node_TN = is_token_in_rank.view(T, num_nodes, ranks_per_node).any(-1)
        num_tokens_per_rdma_rank = in_node_TN.sum(0, dtype=torch.int32)
    return DispatchLayout(
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        is_token_in_rank=is_token_in_rank,
    )
