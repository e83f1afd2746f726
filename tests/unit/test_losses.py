"""Router losses against per-token / per-sequence loops written here, and their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from flexdispatch.routing import (
    AuxLossAutoScaler,
    aux_loss_scores,
    count_tokens_per_expert,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)


def _ref_scores(row: list[float], fn: str) -> list[float]:
    if fn == "softmax":
        m = max(row)
        ex = [math.exp(x - m) for x in row]
        return [v / sum(ex) for v in ex]
    if fn == "sigmoid":
        s = [1 / (1 + math.exp(-x)) for x in row]
    else:
        s = [math.sqrt(math.log1p(math.exp(x))) for x in row]
    return [v / (sum(s) + 1e-20) for v in s]


def _ref_switch(rows: list[list[float]], k: int, fn: str, coeff: float) -> float:
    """coeff * E / (k T^2) * sum_e P_e n_e, one token at a time."""
    T, E = len(rows), len(rows[0])
    P = [0.0] * E
    n = [0] * E
    for row in rows:
        s = _ref_scores(row, fn)
        for e in range(E):
            P[e] += s[e]
        for e in sorted(range(E), key=lambda e: -s[e])[:k]:
            n[e] += 1
    return coeff * E / (k * T * T) * sum(P[e] * n[e] for e in range(E))


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_switch_aux_loss_matches_loop(fn):
    T, E, k, coeff = 20, 8, 2, 0.01
    logits = torch.randn(T, E, dtype=torch.float64)
    scores, idx = aux_loss_scores(logits, topk=k, score_function=fn)
    got = switch_aux_loss(
        scores, count_tokens_per_expert(idx, E), topk=k, num_tokens=T, coeff=coeff
    )
    want = _ref_switch(logits.tolist(), k, fn, coeff)
    assert math.isclose(float(got), want, rel_tol=1e-10)


def test_aux_scores_ignore_bias_and_groups():
    # The aux-loss selection is a plain top-k of the full normalised scores.
    logits = torch.randn(10, 8)
    scores, idx = aux_loss_scores(logits, topk=3, score_function="sigmoid")
    s = torch.sigmoid(logits)
    assert torch.allclose(scores, s / s.sum(-1, keepdim=True))
    assert torch.equal(idx.sort(-1).values, s.topk(3, -1).indices.sort(-1).values)
    assert not idx.requires_grad


def test_switch_aux_loss_grad_is_analytic():
    T, E, k, coeff = 12, 6, 2, 0.1
    probs = torch.rand(T, E, requires_grad=True)
    n = torch.randint(0, 10, (E,))
    loss = switch_aux_loss(probs, n, topk=k, num_tokens=T, coeff=coeff)
    loss.backward()
    want = (coeff * E / (k * T * T) * n.float()).expand(T, E)
    assert torch.allclose(probs.grad, want)


@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_aux_loss_gradcheck_wrt_logits(fn):
    logits = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)

    def f(x):
        s, idx = aux_loss_scores(x, topk=2, score_function=fn)
        return switch_aux_loss(s, count_tokens_per_expert(idx, 6), topk=2, num_tokens=8, coeff=1.0)

    assert torch.autograd.gradcheck(f, (logits,))


def test_seq_aux_loss_matches_per_sequence_loop():
    S, B, E, k, coeff = 7, 3, 8, 2, 0.05
    logits_SBE = torch.randn(S, B, E, dtype=torch.float64)
    flat = logits_SBE.reshape(-1, E)
    scores, idx = aux_loss_scores(flat, topk=k, score_function="softmax")
    got = seq_aux_loss(scores, idx, topk=k, seq_length=S, batch_size=B, coeff=coeff)
    want = sum(_ref_switch(logits_SBE[:, b].tolist(), k, "softmax", coeff) for b in range(B)) / B
    assert math.isclose(float(got), want, rel_tol=1e-10)
    # one sequence == the batch loss
    one = seq_aux_loss(scores, idx, topk=k, seq_length=S * B, batch_size=1, coeff=coeff)
    batch = switch_aux_loss(
        scores, count_tokens_per_expert(idx, E), topk=k, num_tokens=S * B, coeff=coeff
    )
    assert torch.allclose(one, batch)


def test_global_aux_loss_uses_given_counts():
    T, E, k = 10, 4, 2
    probs = torch.rand(T, E)
    counts = torch.tensor([3.0, 5.0, 7.5, 4.5])
    got = global_aux_loss(probs, counts, topk=k, global_num_tokens=4 * T, coeff=0.2)
    want = 0.2 * E / (k * (4 * T) ** 2) * float((probs.sum(0) * counts).sum())
    assert math.isclose(float(got), want, rel_tol=1e-6)


def test_z_loss_value_and_grad():
    T, E, coeff = 9, 5, 1e-3
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    got = z_loss(logits, coeff)
    rows = logits.detach().tolist()
    lse = [math.log(sum(math.exp(x) for x in r)) for r in rows]
    assert math.isclose(float(got.detach()), coeff * sum(v * v for v in lse) / T, rel_tol=1e-12)
    got.backward()
    want = (
        coeff
        * 2
        * torch.tensor(lse, dtype=torch.float64)[:, None]
        * torch.softmax(logits.detach(), -1)
        / T
    )
    assert torch.allclose(logits.grad, want)
    assert z_loss(torch.randn(3, 4).bfloat16(), 1.0).dtype == torch.float32


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_autoscaler_adds_scaled_aux_gradient(scale):
    w = torch.randn(5, requires_grad=True)
    out = w * 2
    aux = (w**2).sum()
    y = AuxLossAutoScaler.apply(out, aux, scale)
    assert torch.equal(y, out)
    y.sum().backward()
    assert torch.allclose(w.grad, 2 + scale * 2 * w.detach())


def test_loss_bad_inputs():
    with pytest.raises(ValueError, match="tokens_per_expert"):
        switch_aux_loss(torch.rand(4, 3), torch.ones(5), topk=1, num_tokens=4, coeff=1.0)
    with pytest.raises(TypeError, match="probs"):
        switch_aux_loss(
            torch.ones(4, 3, dtype=torch.long), torch.ones(3), topk=1, num_tokens=4, coeff=1.0
        )
    with pytest.raises(ValueError, match="seq_length"):
        seq_aux_loss(
            torch.rand(6, 3),
            torch.zeros(6, 1, dtype=torch.long),
            topk=1,
            seq_length=4,
            batch_size=2,
            coeff=1.0,
        )
    with pytest.raises(ValueError, match="score_function"):
        aux_loss_scores(torch.rand(4, 3), topk=1, score_function="relu")
    with pytest.raises(ValueError, match="topk"):
        aux_loss_scores(torch.rand(4, 3), topk=4, score_function="softmax")
    with pytest.raises(ValueError, match="logits"):
        z_loss(torch.rand(4), 1.0)
