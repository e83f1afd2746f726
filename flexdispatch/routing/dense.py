"""Dense routing maps (``[T, E]`` bool, Megatron-Core's and torchtitan's format) to ``[T, k]``.

Shape letters: T tokens on this rank · E experts in total · k top-k.

A framework that routes into a dense map hands flexdispatch ``routing_map [T, E]`` (which experts
a token goes to, after capacity dropping) and ``probs [T, E]``. The dispatcher takes ``[T, k]``
ids with ``-1`` for an empty slot. The experts are chosen by the **map**, never by the probs
(Megatron's DeepEP manager takes ``torch.topk(probs)`` instead, which can pick an expert the map
dropped when its prob is not exactly zero): a pair the map dropped stays dropped.
"""

from __future__ import annotations

import torch

from flexdispatch._checks.tensors import check_tensor, checks_enabled
from flexdispatch._checks.values import check_int
from flexdispatch.types import RoutingResult

__all__ = ["routing_map_to_topk"]


def routing_map_to_topk(
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    topk: int,
    *,
    checks: bool | None = None,
) -> RoutingResult:
    """The ``[T, k]`` form of a dense routing map.

    Every row keeps the experts its map marks, in ascending expert id, and ``-1`` (prob 0) in the
    slots left over (a token with fewer than ``k`` experts, e.g. after capacity dropping). No host
    sync, shapes fixed by the arguments (capturable in a CUDA graph, traceable by
    ``torch.compile``).

    Args:
        routing_map: ``[T, E]`` bool, True where token ``t`` goes to expert ``x``; at most
            ``topk`` per row.
        probs: ``[T, E]`` floating routing weights (any float dtype); only the entries the map
            marks are read.
        topk: k, the number of ``[T, k]`` slots, ``1 <= k <= E``.
        checks: check that no row marks more than ``topk`` experts (reads the map's values). On
            CPU always; on CUDA only when this flag (or ``FLEXDISPATCH_CHECKS=1``) asks for it,
            because it syncs with the host; never inside ``torch.compile`` (a data-dependent
            branch). Unchecked, a row with more than ``topk`` experts keeps its ``topk`` lowest
            ids.

    Returns:
        ``RoutingResult`` with ``topk_idx`` ``[T, k]`` int64 (``-1`` = empty slot),
        ``topk_probs`` ``[T, k]`` float32 (``probs`` gathered, 0 where ``-1``; differentiable in
        ``probs``) and ``tokens_per_expert`` ``[E]`` int64 (the kept pairs per expert: the ids
        ``>= 0`` of ``topk_idx`` counted).

    Raises:
        TypeError: ``routing_map`` not bool, ``probs`` not floating, ``topk`` not an int.
        ValueError: shapes or devices that do not match, ``topk`` out of range, or (checks on) a
            row with more than ``topk`` experts.
    """
    check_tensor("routing_map", routing_map, dtypes=(torch.bool,), ndim=2)
    check_tensor("probs", probs, ndim=2, floating=True)
    if probs.shape != routing_map.shape:
        raise ValueError(
            f"probs has shape {tuple(probs.shape)} but routing_map has "
            f"{tuple(routing_map.shape)}: pass the [T, E] probs that belong to the map"
        )
    if probs.device != routing_map.device:
        raise ValueError(
            f"probs is on {probs.device} but routing_map is on {routing_map.device}: move them "
            f"to one device"
        )
    E = routing_map.shape[1]
    check_int("topk", topk, error=TypeError)
    if not 1 <= topk <= E:
        raise ValueError(f"topk must be in [1, E={E}] (the map's columns), got {topk}")
    if not torch.compiler.is_compiling() and (
        checks_enabled(checks) or routing_map.device.type != "cuda"
    ):
        per_token = routing_map.sum(dim=1)
        over = per_token > topk
        if bool(over.any()):
            t = int(over.nonzero()[0, 0])
            raise ValueError(
                f"routing_map marks {int(per_token[t])} experts for token {t} (and "
                f"{int(over.sum())} token(s) in all) but topk={topk}: pass the router's top-k, "
                f"or the map's largest row count"
            )
    # NOTE: the k lowest marked ids of each row by one top-k over distinct integer keys
    # (E - id where marked, 0 elsewhere): no sort, no tie, ascending ids out.
    ids_E = torch.arange(E, 0, -1, dtype=torch.int32, device=routing_map.device)
    keys_TE = torch.where(routing_map, ids_E, 0)
    keys_TK, idx_TK = torch.topk(keys_TE, topk, dim=1)
    marked_TK = keys_TK > 0
    topk_idx = torch.where(marked_TK, idx_TK, -1)
    picked_TK = probs.gather(1, idx_TK).to(torch.float32)
    topk_probs = torch.where(marked_TK, picked_TK, 0.0)
    # NOTE: the kept slots counted, not the map's marks: unchecked, a row marking more than k
    # experts keeps k (a [E] scatter-add on the device: no host sync, capturable)
    tokens_per_expert = torch.zeros(E, dtype=torch.int64, device=routing_map.device)
    tokens_per_expert.scatter_add_(0, idx_TK.reshape(-1), marked_TK.reshape(-1).to(torch.int64))
    return RoutingResult(
        topk_idx=topk_idx,
        topk_probs=topk_probs,
        tokens_per_expert=tokens_per_expert,
    )
