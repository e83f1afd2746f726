"""Router losses: switch load balancing (per batch, per sequence, global), z-loss, autoscaler.

Shape letters: T tokens on this rank · H hidden · E experts in total · R ranks · e = E/R local
experts · k top-k · L ranks per node · N nodes · M received rows · W worst-case rows. Also used
here: S sequence length and B sequences (micro-batch size) of a ``[S, B, H]`` input, T = S * B,
token ``t = s * B + b`` belonging to sequence ``b``.

Formulas (REFERENCE_FACTS.md, "Aux loss"): with ``P_e = sum_t scores[t, e]`` over the FULL score
distribution and ``n_e`` the detached token count of an unbiased, ungrouped top-k of those
scores, ``aux = coeff * E / (k * T^2) * sum_e P_e * n_e``; z-loss is
``coeff * mean_t logsumexp_e(logits[t])^2``. The losses are reported next to the routing result
and joined to the graph with :class:`AuxLossAutoScaler`, never added to the model's loss.
"""

from __future__ import annotations

import torch

from flexdispatch._checks.tensors import check_tensor
from flexdispatch.routing.topk import _topk

__all__ = [
    "aux_loss_scores",
    "count_tokens_per_expert",
    "switch_aux_loss",
    "seq_aux_loss",
    "global_aux_loss",
    "z_loss",
    "AuxLossAutoScaler",
]

_NORM_EPS = 1e-20


def aux_loss_scores(
    logits: torch.Tensor, *, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full score distribution and unbiased top-k selection used by every load-balancing loss.

    Args:
        logits: ``[T, E]`` floating logits; computed in fp32 (fp64 when ``logits`` is fp64).
        topk: k.
        score_function: ``"softmax"`` (softmax over all E) or ``"sigmoid"`` / ``"sqrtsoftplus"``
            (scores normalised over all E: ``s / (s.sum(-1) + 1e-20)``).

    Returns:
        ``(scores [T, E], topk_idx [T, k] int64)``: scores carry the gradient, the indices are
        the top-k of the detached scores under the routing's tie rule (equal scores: the lower
        expert id first; no bias, no groups, no dropping).
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    if not 1 <= topk <= logits.shape[1]:
        raise ValueError(
            f"topk must be in [1, {logits.shape[1]}] (the columns of logits), got {topk}"
        )
    x_TE = logits if logits.dtype == torch.float64 else logits.float()
    if score_function == "softmax":
        scores_TE = torch.softmax(x_TE, dim=-1)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        if score_function == "sigmoid":
            s_TE = torch.sigmoid(x_TE)
        else:
            s_TE = torch.nn.functional.softplus(x_TE).sqrt()
        scores_TE = s_TE / (s_TE.sum(dim=-1, keepdim=True) + _NORM_EPS)
    else:
        raise ValueError(
            f"score_function must be softmax, sigmoid or sqrtsoftplus, got {score_function!r}"
        )
    # NOTE: the routing's tie rule (equal scores: lower id first), so the counts of a tied
    # router (zero-initialised, bf16) are the same on every device and torch version.
    idx_TK = _topk(scores_TE.detach(), topk)[1]
    return scores_TE, idx_TK


def count_tokens_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64 count of ``(token, slot)`` pairs per expert (ids ``< 0`` ignored, no sync)."""
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    counts.scatter_add_(0, flat.clamp(min=0), valid.long())
    return counts


def switch_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    topk: int,
    num_tokens: int | torch.Tensor,
    coeff: float,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``coeff * E / (k * T^2) * sum_e P_e * n_e``.

    Args:
        probs: ``[T, E]`` full score distribution (gradient flows through it only).
        tokens_per_expert: ``[E]`` counts ``n_e`` (any numeric dtype; detached here).
        topk: k.
        num_tokens: T of the batch the counts describe (an int, or a 0-d tensor); 0 gives 0.
        coeff: loss coefficient.

    Returns:
        0-d tensor in ``probs``' dtype.
    """
    check_tensor("probs", probs, ndim=2, floating=True)
    check_tensor("tokens_per_expert", tokens_per_expert, ndim=1)
    E = probs.shape[1]
    if tokens_per_expert.shape[0] != E:
        raise ValueError(
            f"tokens_per_expert must have shape [{E}] (the columns of probs), got "
            f"{tuple(tokens_per_expert.shape)}"
        )
    n_E = tokens_per_expert.detach().to(probs.dtype)
    # NOTE: T = 0 (an empty rank) gives a zero loss that stays in the graph, not a 0/0.
    if isinstance(num_tokens, torch.Tensor):
        t = num_tokens.clamp(min=1).to(probs.dtype)
    else:
        t = max(num_tokens, 1)
    return (probs.sum(dim=0) * n_E).sum() * (coeff * E / topk) / (t * t)


def seq_aux_loss(
    probs: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    topk: int,
    seq_length: int,
    batch_size: int,
    coeff: float,
) -> torch.Tensor:
    """Sequence-level load-balancing loss: the switch loss of every sequence, averaged.

    Token ``t = s * B + b`` (the order of ``hidden.reshape(-1, H)`` for ``[S, B, H]`` input)
    belongs to sequence ``b``. For each sequence, ``P`` and ``n`` are sums over its S tokens and
    the switch loss uses ``T = S``; the result is the mean over the B sequences (Megatron's
    ``seq_aux_loss``).

    Args:
        probs: ``[T, E]`` full score distribution, ``T = seq_length * batch_size``.
        topk_idx: ``[T, k]`` int64 unbiased top-k of ``probs`` (detached), ``-1`` ignored.
        topk: k.
        seq_length: S (0 allowed: the loss is then 0).
        batch_size: B.
        coeff: loss coefficient.

    Returns:
        0-d tensor in ``probs``' dtype.
    """
    check_tensor("probs", probs, ndim=2, floating=True)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    T, E = probs.shape
    if seq_length * batch_size != T:
        raise ValueError(
            f"seq_length * batch_size = {seq_length} * {batch_size} must equal the {T} rows of "
            f"probs"
        )
    if topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx must have {T} rows like probs, got {tuple(topk_idx.shape)}")
    P_BE = probs.view(seq_length, batch_size, E).sum(dim=0)
    seq_of_token = torch.arange(T, device=probs.device) % batch_size
    flat_idx = topk_idx.detach()
    valid = flat_idx >= 0
    slot_key = seq_of_token.unsqueeze(1) * E + flat_idx.clamp(min=0)
    n_BE = torch.zeros(batch_size * E, dtype=torch.int64, device=probs.device)
    n_BE.scatter_add_(0, slot_key.reshape(-1), valid.reshape(-1).long())
    n_BE = n_BE.view(batch_size, E).to(probs.dtype)
    per_seq_scale = coeff * E / (topk * max(seq_length, 1) ** 2)
    return (P_BE * n_BE).sum() * per_seq_scale / max(batch_size, 1)


def global_aux_loss(
    probs: torch.Tensor,
    global_tokens_per_expert: torch.Tensor,
    *,
    topk: int,
    global_num_tokens: int | torch.Tensor,
    coeff: float,
) -> torch.Tensor:
    """Global-batch load-balancing loss: local ``P``, counts from the whole global batch.

    ``global_tokens_per_expert`` is the count summed over the data-parallel group, averaged over
    the micro-batches seen since the last reset, and ``global_num_tokens`` the tokens of one
    micro-batch across the group (``T * group size``). This is the switch loss with those counts
    (Megatron's ``global_aux_loss``; ``TopKRouter`` keeps the running buffer).

    Returns:
        0-d tensor in ``probs``' dtype.
    """
    return switch_aux_loss(
        probs, global_tokens_per_expert, topk=topk, num_tokens=global_num_tokens, coeff=coeff
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss ``coeff * mean_t(logsumexp_e(logits[t])^2)`` (ST-MoE).

    Args:
        logits: ``[T, E]`` floating logits (computed in at least fp32).
        coeff: loss coefficient.

    Returns:
        0-d tensor (fp32, or fp64 for fp64 logits); 0 when T = 0.
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    x_TE = logits if logits.dtype == torch.float64 else logits.float()
    # sum / max(T, 1) rather than mean(): an empty rank gives 0, not NaN.
    return torch.logsumexp(x_TE, dim=-1).square().sum() / max(x_TE.shape[0], 1) * coeff


class AuxLossAutoScaler(torch.autograd.Function):
    """Join an auxiliary loss to the graph of ``output`` without adding it to the model's loss.

    ``AuxLossAutoScaler.apply(output, aux_loss, scale)`` returns ``output`` unchanged; in
    backward, ``output``'s gradient passes through and ``aux_loss`` receives
    ``ones_like(aux_loss) * scale``, so backpropagating the main loss also backpropagates
    ``scale * aux_loss``. Pass the main loss's own scale (e.g. ``1 / num_micro_batches`` or a
    loss-scaler value) as ``scale``; there is no global state.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        output: torch.Tensor,
        aux_loss: torch.Tensor,
        scale: float = 1.0,
    ) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale  # type: ignore[attr-defined]
        return output

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad_output, torch.ones_like(aux_loss) * ctx.scale, None  # type: ignore[attr-defined]
