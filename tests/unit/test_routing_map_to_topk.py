"""``routing_map_to_topk``: a dense ``[T, E]`` routing map to ``[T, k]`` ids and probs.

Checked against a per-token loop: the marked experts in ascending id, ``-1`` / prob 0 in the slots
left over, the map (not the probs) choosing, gradients flowing to the marked probs only.
"""

from __future__ import annotations

import pytest
import torch

import flexdispatch as fd


def _loop(routing_map: torch.Tensor, probs: torch.Tensor, k: int):
    T = routing_map.shape[0]
    idx = torch.full((T, k), -1, dtype=torch.int64)
    p = torch.zeros(T, k)
    for t in range(T):
        chosen = [x for x in range(routing_map.shape[1]) if routing_map[t, x]]
        for slot, x in enumerate(chosen):
            idx[t, slot] = x
            p[t, slot] = float(probs[t, x])
    return idx, p


@pytest.mark.parametrize(
    ("T", "E", "k", "density"), [(13, 8, 2, 0.2), (7, 16, 4, 0.25), (0, 4, 1, 0.5)]
)
def test_matches_a_per_token_loop(T: int, E: int, k: int, density: float) -> None:
    g = torch.Generator().manual_seed(T + E)
    scores = torch.rand(T, E, generator=g)
    # up to k experts per token, some tokens fewer or none (capacity drops)
    keep = torch.rand(T, E, generator=g) < density
    top = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True) & keep
    probs = torch.softmax(scores, dim=1) * routing_map
    got = fd.routing_map_to_topk(routing_map, probs, k)
    want_idx, want_probs = _loop(routing_map, probs, k)
    assert torch.equal(got.topk_idx, want_idx)
    assert got.topk_probs.dtype == torch.float32
    assert torch.equal(got.topk_probs, want_probs)
    assert torch.equal(got.tokens_per_expert, routing_map.sum(0))
    assert (got.topk_probs[got.topk_idx == -1] == 0).all()


def test_the_map_chooses_not_the_probs() -> None:
    routing_map = torch.tensor([[False, True, False, True]])
    probs = torch.tensor([[0.9, 0.0, 0.8, 0.1]])  # the largest probs are not routed
    got = fd.routing_map_to_topk(routing_map, probs, 2)
    assert got.topk_idx.tolist() == [[1, 3]]
    assert got.topk_probs.tolist() == [[0.0, pytest.approx(0.1)]]


def test_gradient_reaches_the_marked_probs_only() -> None:
    routing_map = torch.tensor([[True, False, True], [False, True, False]])
    probs = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    got = fd.routing_map_to_topk(routing_map, probs, 2)
    weights = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    (got.topk_probs * weights).sum().backward()
    assert probs.grad.tolist() == [[2.0, 0.0, 3.0], [0.0, 5.0, 0.0]]


def test_traced_by_torch_compile_without_a_graph_break() -> None:
    routing_map = torch.rand(6, 8, generator=torch.Generator().manual_seed(0)) < 0.2
    routing_map[:, 0] = False
    probs = torch.rand(6, 8)

    def fn(m: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = fd.routing_map_to_topk(m, p, 8)
        return r.topk_idx, r.topk_probs

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    idx, p = compiled(routing_map, probs)
    want_idx, want_probs = _loop(routing_map, probs, 8)
    assert torch.equal(idx, want_idx) and torch.equal(p, want_probs)


def test_unchecked_a_row_over_k_counts_only_the_pairs_it_keeps(monkeypatch) -> None:
    # NOTE: the path CUDA takes without checks (and a compiled call): the map is not read on
    # the host, a row marking k + 1 experts keeps its k lowest ids
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    routing_map = torch.tensor([[True, True, True, False], [False, True, False, True]])
    got = fd.routing_map_to_topk(routing_map, torch.rand(2, 4), 2)
    assert got.topk_idx.tolist() == [[0, 1], [1, 3]]
    kept = got.topk_idx[got.topk_idx >= 0]
    assert torch.equal(got.tokens_per_expert, torch.bincount(kept, minlength=4))
