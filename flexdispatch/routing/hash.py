"""Hash routing: experts chosen by a fixed hash of the token id, with no learned gate.

T tokens · E experts · k top-k · V vocabulary size.

DeepSeek-V4 routes its first ``num_hash_layers`` MoE layers this way: the experts of a token come
from a per-token-id table (``tid2eid``, ``[V, k]``, stored with the checkpoint and never trained),
and the weights are the gate's scores gathered at those experts, renormalised (non-softmax score
functions) and multiplied by the routed scaling factor. flexdispatch follows those semantics with
the table replaced by a hash, so no table has to be stored or shipped; a checkpoint's own table can
still be passed as ``table=`` to reproduce that model's choice exactly.

The hash (rendezvous / highest-random-weight hashing):

1. ``t = fmix32(lo32(id) ^ s)``, then ``t = fmix32(t ^ hi32(id))``, with ``s`` derived from the
   seed and ``fmix32`` the 32-bit finaliser of MurmurHash3 (shifts, xors and two multiplications
   modulo 2**32).
2. For every expert ``x``: ``key[x] = fmix32(t + (x + 1) * 0x9E3779B9 mod 2**32) * E + x``
   (a SplitMix-style stream keyed by ``t``; the ``* E + x`` makes the keys distinct).
3. The token's experts are the ``k`` largest keys, in descending key order.

Why it is balanced: ``fmix32`` is a bijection with full avalanche, so the keys of one token behave
as independent uniform draws and every k-subset of experts is equally likely. Each expert is then
picked by a fraction ``k / E`` of distinct token ids, and over ``n`` distinct ids its count has
mean ``n k / E`` and standard deviation ``sqrt(n k / E (1 - k / E))`` (relative error
``~ 1 / sqrt(n k / E)``). Balance is over token *ids*: a batch that repeats an id repeats its
experts, so a skewed id distribution gives a matching skew in load.

Why it is deterministic everywhere: every step is an integer operation on int64 tensors that
cannot overflow (32-bit products are split into 16-bit halves, so no product exceeds 2**49, and
the final keys stay below 2**63 because E < 2**31), with no float rounding involved; the keys
are distinct, so the top-k has no ties to break. The result is the same on every device,
process, machine and torch version.

Cost: ``O(T * E)`` integer operations (comparable to the gating matmul). For a fixed vocabulary,
``hash_expert_table`` precomputes the ``[V, k]`` table once and ``table=`` turns routing into a
gather.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from flexdispatch._checks.tensors import (
    check_finite,
    check_ids_in_range,
    check_tensor,
    checks_enabled,
)
from flexdispatch._checks.values import check_int
from flexdispatch.types import RoutingResult

__all__ = ["hash_routing", "hash_experts", "hash_expert_table"]

_M32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9
_MAX_TOPK = 32  # DeepEP's limit on k
_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def _fmix32_int(x: int) -> int:
    """MurmurHash3's ``fmix32`` on a Python int (used for the seed only)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    # NOTE: x*lo and x*hi are < 2**48; only the low 16 bits of x*hi survive the shift mod 2**32.
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's ``fmix32`` on int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _seed_word(seed: int) -> int:
    return _fmix32_int((seed & _M32) ^ _fmix32_int((seed >> 32) ^ _GOLDEN32))


def _check_sizes(num_experts: int, topk: int, seed: int) -> None:
    check_int("num_experts", num_experts, at_least=1, rule="a positive int")
    if num_experts >= 2**31:
        raise ValueError(f"num_experts={num_experts} is too large: use fewer than 2**31 experts")
    check_int("topk", topk, at_least=1, at_most=_MAX_TOPK, rule=f"an int in [1, {_MAX_TOPK}]")
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}: set topk <= num_experts")
    check_int("seed", seed, at_least=0, at_most=2**64 - 1, rule="an int in [0, 2**64)")


def hash_experts(
    token_ids: torch.Tensor, *, num_experts: int, topk: int, seed: int = 0
) -> torch.Tensor:
    """The ``k`` distinct experts the hash assigns to each token id (see the module docstring).

    Args:
        token_ids: any shape, int32 or int64 token ids (flattened to ``[T]``). Every int64 value
            hashes to valid experts; ids are meant to be ``>= 0``.
        num_experts: E.
        topk: k, at most ``min(E, 32)``.
        seed: selects an independent hash (a different table), ``0 <= seed < 2**64``.

    Returns:
        ``[T, k]`` int64 distinct expert ids in ``[0, E)``, on ``token_ids``' device.
    """
    check_tensor("token_ids", token_ids, dtypes=(torch.int64, torch.int32))
    _check_sizes(num_experts, topk, seed)
    ids = token_ids.reshape(-1).to(torch.int64)
    lo = ids & _M32
    hi = (ids >> 32) & _M32
    t = _fmix32(lo ^ _seed_word(seed))
    t = _fmix32(t ^ hi)  # [T]
    experts_E = torch.arange(num_experts, dtype=torch.int64, device=ids.device)
    offsets_E = ((experts_E + 1) * _GOLDEN32) & _M32  # < 2**63: E < 2**31, golden < 2**32
    keys_TE = _fmix32((t.unsqueeze(1) + offsets_E) & _M32) * num_experts + experts_E
    return keys_TE.topk(topk, dim=1).indices


def hash_expert_table(
    vocab_size: int,
    *,
    num_experts: int,
    topk: int,
    seed: int = 0,
    device: torch.device | str | None = None,
    chunk_size: int = 65536,
) -> torch.Tensor:
    """Precompute ``hash_experts`` for every id in ``[0, vocab_size)`` (DeepSeek-V4's ``tid2eid``
    shape), in chunks of ``chunk_size`` ids to bound memory.

    Returns:
        ``[V, k]`` int64 table; ``hash_routing(ids, table=table, ...)`` then equals
        ``hash_routing(ids, seed=seed, ...)`` for ids below ``V``.
    """
    if not isinstance(vocab_size, int) or vocab_size < 0:
        raise ValueError(f"vocab_size must be a non-negative int, got {vocab_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    _check_sizes(num_experts, topk, seed)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    parts = [
        hash_experts(chunk, num_experts=num_experts, topk=topk, seed=seed)
        for chunk in ids.split(chunk_size)
    ]
    if not parts:
        return torch.empty(0, topk, dtype=torch.int64, device=device)
    return torch.cat(parts)


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    x = logits.float()
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    return torch.sqrt(F.softplus(x))


def hash_routing(
    token_ids: torch.Tensor,
    *,
    num_experts: int,
    topk: int,
    seed: int = 0,
    logits: torch.Tensor | None = None,
    score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax",
    normalize_topk: bool | None = None,
    scaling_factor: float | None = None,
    table: torch.Tensor | None = None,
    checks: bool | None = None,
) -> RoutingResult:
    """Route every token to ``k`` distinct experts picked by a hash of its id.

    Experts: ``hash_experts(token_ids, num_experts=E, topk=k, seed=seed)``, or ``table[token_ids]``
    when a table is given. Weights (DeepSeek-V4's hash layers):

    - with ``logits``: ``s = score_function(logits)`` over all E experts (fp32), gathered at the
      chosen experts; renormalised to sum to 1 when ``normalize_topk`` (``None``: when ``k > 1``
      and the score function is not softmax, as in Megatron and DeepSeek-V4); then
      ``* scaling_factor``. Gradients flow to ``logits``.
    - without ``logits``: ``1 / k`` each, ``* scaling_factor``.

    No host synchronisation (value checks only with ``checks``), no capacity dropping.

    Args:
        token_ids: any shape, int64 (or int32) token ids ``>= 0``; flattened to ``[T]`` in
            row-major order.
        num_experts: E.
        topk: k, ``1 <= k <= min(E, 32)``.
        seed: selects the hash (``RouterConfig.hash_seed``).
        logits: ``[T, E]`` or ``token_ids.shape + (E,)`` floating gate logits, or None.
        score_function: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"`` (used with logits).
        normalize_topk: renormalise the k gathered scores; None = the rule above.
        scaling_factor: multiply the weights by it (> 0), or None.
        table: ``[V, k]`` int64/int32 expert table indexed by token id (e.g. a checkpoint's
            ``tid2eid``), or None to hash. Rows must hold distinct ids in ``[0, E)``.
        checks: run host-syncing value checks (ids >= 0 and within the table, table values in
            range, finite logits); default ``FLEXDISPATCH_CHECKS``.

    Returns:
        ``RoutingResult`` with ``topk_idx`` ``[T, k]`` int64 (never ``-1``), ``topk_probs``
        ``[T, k]`` float32, ``tokens_per_expert`` ``[E]`` int64, ``num_dropped`` 0-d int64 zero,
        no losses.

    Raises:
        TypeError: a tensor of the wrong type or dtype.
        ValueError: bad sizes, shapes or options (the message names the argument).
    """
    check_tensor("token_ids", token_ids, dtypes=(torch.int64, torch.int32))
    _check_sizes(num_experts, topk, seed)
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be one of {', '.join(_SCORE_FUNCTIONS)}, got {score_function!r}"
        )
    if scaling_factor is not None and not (
        isinstance(scaling_factor, (int, float))
        and not isinstance(scaling_factor, bool)
        and 0 < scaling_factor < math.inf
    ):
        raise ValueError(f"scaling_factor must be > 0 and finite, or None, got {scaling_factor!r}")
    ids_T = token_ids.reshape(-1)
    T = ids_T.shape[0]
    device = token_ids.device
    logits_TE: torch.Tensor | None = None
    if logits is not None:
        check_tensor("logits", logits, floating=True)
        shapes = ((T, num_experts), (*token_ids.shape, num_experts))
        if tuple(logits.shape) not in shapes:
            raise ValueError(
                f"logits must have shape [T, E] = {list(shapes[0])} or token_ids.shape + [E] = "
                f"{list(shapes[1])}, got {list(logits.shape)}"
            )
        if logits.device != device:
            raise ValueError(
                f"logits are on {logits.device} but token_ids on {device}: put them on one device"
            )
        logits_TE = logits.reshape(T, num_experts)
    if table is not None:
        check_tensor("table", table, dtypes=(torch.int64, torch.int32), ndim=2)
        if table.shape[1] != topk:
            raise ValueError(f"table must be [V, topk={topk}], got shape {list(table.shape)}")
        if table.device != device:
            raise ValueError(
                f"table is on {table.device} but token_ids on {device}: put them on one device"
            )
    if checks_enabled(checks):
        if T and bool((ids_T < 0).any()):
            raise ValueError("token_ids holds negative ids: token ids must be >= 0")
        if table is not None:
            check_ids_in_range("token_ids", ids_T, table.shape[0])
            check_ids_in_range("table", table.to(torch.int64), num_experts)
            if bool((table < 0).any()):
                raise ValueError(f"table holds -1 entries: every id must be in [0, {num_experts})")
        if logits_TE is not None:
            check_finite("logits", logits_TE)

    if table is None:
        topk_idx = hash_experts(ids_T, num_experts=num_experts, topk=topk, seed=seed)
    else:
        topk_idx = table.index_select(0, ids_T.to(torch.int64)).to(torch.int64)

    if logits_TE is None:
        probs = torch.full((T, topk), 1.0 / topk, dtype=torch.float32, device=device)
    else:
        probs = _scores(logits_TE, score_function).gather(1, topk_idx)
        if normalize_topk is None:
            normalize_topk = topk > 1 and score_function != "softmax"
        if normalize_topk:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        probs = probs * scaling_factor

    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=device)
    tokens_per_expert.scatter_add_(0, topk_idx.reshape(-1), torch.ones_like(topk_idx.reshape(-1)))
    return RoutingResult(
        topk_idx=topk_idx,
        topk_probs=probs,
        tokens_per_expert=tokens_per_expert,
        num_dropped=torch.zeros((), dtype=torch.int64, device=device),
    )
