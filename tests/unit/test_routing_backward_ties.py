"""Backward through tied scores (issue 40): the CPU tie path of ``topk_routing`` used to write the
re-ranked rows into the ids ``torch.topk`` had saved for its backward, so ``.backward()`` raised
"modified by an inplace operation" whenever two scores tied within the first k + 1 places.

Shape letters: T tokens · E experts · k top-k · G expert groups.

The sweep below is the issue's: logits rounded to halves (ties in nearly every row), softmax and
sqrtsoftplus, k from 1 to 16, T from 1 to 77, with and without groups. Each case runs forward
and backward on the ``device`` fixture and checks the gradient against a dense fp64 reference
written here for the ids the call chose (the ids themselves, by the tie rule, are checked by
``test_routing_properties.py``). Then the same class around ``TopKRouter``: a zero-initialised
router (every score tied) trains; its aux loss counts the experts the tie rule routes to; and
the router state written between a forward and its backward is saved by no backward.
"""

from __future__ import annotations

import pytest
import torch

from flexdispatch.config import RouterConfig
from flexdispatch.routing import TopKRouter, topk_routing

# (score_function, T, E, k, (num_groups, group_topk) or None): 9 shapes x 2 score functions
_SHAPES = [
    (1, 8, 1, None),
    (5, 16, 2, None),
    (77, 128, 4, None),  # the example
    (33, 64, 8, None),
    (77, 64, 16, None),
    (16, 32, 3, None),
    (77, 128, 4, (8, 4)),
    (20, 64, 8, (8, 2)),
    (1, 32, 16, (4, 2)),
]
SWEEP = [(fn, *shape) for fn in ("softmax", "sqrtsoftplus") for shape in _SHAPES]


def tied_logits(T: int, E: int, seed: int) -> torch.Tensor:
    """``[T, E]`` fp32 logits rounded to halves: most rows hold ties in their first k places."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g) * 2).round() / 2


def _ref_probs(x64: torch.Tensor, idx: torch.Tensor, fn: str, k: int) -> torch.Tensor:
    """fp64 probs at the given ids: softmax over the k chosen logits, or the renormalised
    sqrt(softplus) scores (Megatron's rules, written out densely)."""
    chosen = x64.gather(1, idx)
    if fn == "softmax":
        ex = torch.exp(chosen - chosen.max(dim=-1, keepdim=True).values)
        return ex / ex.sum(dim=-1, keepdim=True)
    s = torch.log1p(torch.exp(chosen)).sqrt()
    return s / (s.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else s


@pytest.mark.parametrize(("fn", "T", "E", "k", "groups"), SWEEP)
def test_backward_through_tied_scores(fn, T, E, k, groups, device):
    logits = tied_logits(T, E, seed=T * 1000 + E + k)
    kw = {} if groups is None else {"num_groups": groups[0], "group_topk": groups[1]}
    x = logits.detach().to(device).requires_grad_(True)
    res = topk_routing(x, topk=k, score_function=fn, impl="torch", **kw)
    w = torch.randn(T, k, generator=torch.Generator().manual_seed(1))
    (res.topk_probs * w.to(device)).sum().backward()

    idx = res.topk_idx.cpu()
    x64 = logits.double().requires_grad_(True)
    want = _ref_probs(x64, idx, fn, k)
    (want * w.double()).sum().backward()
    torch.testing.assert_close(res.topk_probs.detach().cpu().double(), want.detach())
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_zero_initialised_router_trains(fn, groups):
    """A zero-initialised router ties every score of every token; its first backward used to
    raise on CPU (``TopKRouter`` runs the same top-k)."""
    kw = {} if groups is None else {"num_groups": groups[0], "group_topk": groups[1]}
    cfg = RouterConfig(num_experts=16, topk=4, score_function=fn, z_loss_coeff=1e-3, **kw)
    router = TopKRouter(cfg, 8)
    torch.nn.init.zeros_(router.weight)
    hidden = torch.randn(10, 8, requires_grad=True)
    res = router(hidden)
    assert res.topk_idx.tolist() == [[0, 1, 2, 3]] * 10  # the tie rule: lower ids first
    (res.topk_probs * torch.arange(4.0)).sum().backward()
    assert router.weight.grad is not None and bool(torch.isfinite(router.weight.grad).all())
    assert hidden.grad is not None


@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_aux_loss_counts_of_a_tied_router_follow_the_tie_rule(fn):
    """The aux loss's counts ``n_e`` come from an unbiased top-k of the full scores; with every
    score tied (a zero-initialised router) they follow the tie rule too, so they name the experts
    the tokens are routed to (0..k-1), whatever ``torch.topk`` would pick on this device."""
    T, E, k, H, coeff = 6, 32, 4, 5, 0.1
    cfg = RouterConfig(
        num_experts=E, topk=k, score_function=fn, aux_loss_type="aux_loss", aux_loss_coeff=coeff
    )
    router = TopKRouter(cfg, H)
    torch.nn.init.zeros_(router.weight)
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    res = router(hidden)
    w = torch.randn(T, k, generator=torch.Generator().manual_seed(4))
    (res.topk_probs * w).sum().backward()

    # fp64 reference: logits x = h @ W.T (W = 0); every token's experts are 0..k-1
    W64 = torch.zeros(E, H, dtype=torch.float64, requires_grad=True)
    x64 = hidden.double() @ W64.t()
    if fn == "softmax":
        full = torch.softmax(x64, dim=-1)
        probs = torch.softmax(x64[:, :k], dim=-1)
    else:
        s = torch.sigmoid(x64)
        full = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
        probs = s[:, :k] / (s[:, :k].sum(dim=-1, keepdim=True) + 1e-20)
    n = torch.zeros(E, dtype=torch.float64)
    n[:k] = T
    aux = coeff * E / (k * T * T) * (full.sum(dim=0) * n).sum()
    ((probs * w.double()).sum() + aux).backward()

    assert res.topk_idx.tolist() == [list(range(k))] * T
    torch.testing.assert_close(res.aux_loss.double(), aux.detach())
    torch.testing.assert_close(router.weight.grad.double(), W64.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_router_state_updates_between_forward_and_backward(impl):
    """The router's in-place state (expert bias, its counts, the global aux-loss counts) is
    written between a forward and its backward in pipelined training (two micro-batches forward,
    then both backward; a bias update in between). Autograd saves none of it: both backwards
    run and give what they give without the updates."""
    cfg = RouterConfig(
        num_experts=8,
        topk=2,
        score_function="sigmoid",
        enable_expert_bias=True,
        aux_loss_type="global_aux_loss",
        aux_loss_coeff=0.1,
        impl=impl,
    )
    hidden = [torch.randn(6, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def run(update_between: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        router = TopKRouter(cfg, 4)
        with torch.no_grad():
            router.weight.copy_(router.weight.round(decimals=1))  # some ties
        outs = [router(h) for h in hidden]
        if update_between:
            router.update_expert_bias()
        grads = []
        for res in outs:
            router.weight.grad = None
            res.topk_probs.sum().backward()
            grads.append(router.weight.grad.clone())
        return grads

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want)
