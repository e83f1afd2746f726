"""get_dispatch_layout against a slow per-token loop that follows DeepEP's definitions.

T tokens · k top-k · E experts · R ranks · L ranks per node · N = R / L nodes · e = E / R.

The reference comparison runs on the ``device`` fixture (``FLEXDISPATCH_TEST_DEVICE``,
tests/conftest.py); the reference loop runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexdispatch import DispatchLayout, get_dispatch_layout


def ref_layout(topk_idx, num_experts, num_ranks, ranks_per_node):
    """Token by token: which ranks and nodes it needs, and one count per (token, slot) pair."""
    T, k = topk_idx.shape
    e = num_experts // num_ranks
    per_rank = [0] * num_ranks
    per_expert = [0] * num_experts
    num_nodes = max(num_ranks // ranks_per_node, 1)
    per_node = [0] * num_nodes
    mask = torch.zeros(T, num_ranks, dtype=torch.bool)
    for t in range(T):
        ranks, nodes = set(), set()
        for s in range(k):
            x = int(topk_idx[t, s])
            if x < 0:
                continue
            per_expert[x] += 1
            ranks.add(x // e)
            nodes.add(x // e // ranks_per_node)
        for r in ranks:
            per_rank[r] += 1
            mask[t, r] = True
        for n in nodes:
            per_node[n] += 1
    rdma = torch.tensor(per_node, dtype=torch.int32) if num_ranks > ranks_per_node else None
    return (
        torch.tensor(per_rank, dtype=torch.int32),
        rdma,
        torch.tensor(per_expert, dtype=torch.int32),
        mask,
    )


def random_ids(T, k, E, *, drop=0.25, generator=None):
    idx = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(T)])
    mask = torch.rand(T, k, generator=generator) < drop
    return torch.where(mask, torch.full_like(idx, -1), idx)


def assert_layout_equal(layout, ref):
    """``layout`` (on any device) equals the CPU reference ``ref``."""
    per_rank, rdma, per_expert, mask = ref
    assert isinstance(layout, DispatchLayout)
    assert layout.num_tokens_per_rank.dtype == torch.int32
    assert layout.num_tokens_per_expert.dtype == torch.int32
    assert layout.is_token_in_rank.dtype == torch.bool
    assert torch.equal(layout.num_tokens_per_rank.cpu(), per_rank)
    assert torch.equal(layout.num_tokens_per_expert.cpu(), per_expert)
    assert torch.equal(layout.is_token_in_rank.cpu(), mask)
    if rdma is None:
        assert layout.num_tokens_per_rdma_rank is None
    else:
        assert layout.num_tokens_per_rdma_rank.dtype == torch.int32
        assert torch.equal(layout.num_tokens_per_rdma_rank.cpu(), rdma)


@pytest.mark.parametrize(
    ("T", "k", "E", "R", "L"),
    [
        (1, 1, 1, 1, 8),
        (10, 2, 8, 4, 8),  # one node: no rdma counts
        (17, 4, 16, 8, 8),  # R == L: still no rdma counts
        (23, 3, 32, 16, 8),  # two nodes
        (31, 8, 64, 16, 4),  # four nodes
        (12, 6, 12, 6, 2),  # three nodes, e = 2
    ],
)
def test_matches_reference(T, k, E, R, L, device):
    idx = random_ids(T, k, E)
    layout = get_dispatch_layout(idx.to(device), E, R, ranks_per_node=L)
    assert layout.num_tokens_per_rank.device == device
    assert layout.is_token_in_rank.device == device
    assert_layout_equal(layout, ref_layout(idx, E, R, L))


def test_default_ranks_per_node_is_eight():
    idx = random_ids(9, 2, 16)
    assert get_dispatch_layout(idx, 16, 8).num_tokens_per_rdma_rank is None
    layout = get_dispatch_layout(idx, 16, 16)
    assert layout.num_tokens_per_rdma_rank is not None
    assert layout.num_tokens_per_rdma_rank.shape == (2,)


def test_tokens_counted_once_per_rank_but_pairs_per_expert():
    # Token 0: experts 0 and 1 (both on rank 0) -> one token for rank 0, two expert pairs.
    idx = torch.tensor([[0, 1], [2, -1], [-1, -1]])
    layout = get_dispatch_layout(idx, 4, 2)
    assert layout.num_tokens_per_rank.tolist() == [1, 1]
    assert layout.num_tokens_per_expert.tolist() == [1, 1, 1, 0]
    assert layout.is_token_in_rank.tolist() == [[True, False], [False, True], [False, False]]


def test_all_dropped_and_empty(device):
    idx = torch.full((5, 3), -1, dtype=torch.int64)
    layout = get_dispatch_layout(idx.to(device), 8, 4, ranks_per_node=2)
    assert_layout_equal(layout, ref_layout(idx, 8, 4, 2))
    idx = torch.zeros(0, 3, dtype=torch.int64)
    layout = get_dispatch_layout(idx.to(device), 8, 4, ranks_per_node=2)
    assert_layout_equal(layout, ref_layout(idx, 8, 4, 2))
    assert layout.is_token_in_rank.shape == (0, 4)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(0, 20),
    k=st.integers(1, 4),
    e=st.integers(1, 3),
    nodes=st.integers(1, 3),
    L=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_counts_consistent_with_mask(T, k, e, nodes, L, seed):
    R = nodes * L
    E = R * e
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    idx = random_ids(T, k, E, drop=0.3, generator=g) if T else torch.zeros(0, k, dtype=torch.int64)
    layout = get_dispatch_layout(idx, E, R, ranks_per_node=L)
    mask = layout.is_token_in_rank
    assert torch.equal(layout.num_tokens_per_rank, mask.sum(0, dtype=torch.int32))
    per_rank_pairs = layout.num_tokens_per_expert.view(R, e).sum(1)
    assert (per_rank_pairs >= layout.num_tokens_per_rank).all()
    assert int(layout.num_tokens_per_expert.sum()) == int((idx >= 0).sum())
    if R > L:
        in_node = mask.view(T, nodes, L).any(-1).sum(0, dtype=torch.int32)
        assert torch.equal(layout.num_tokens_per_rdma_rank, in_node)
    else:
        assert layout.num_tokens_per_rdma_rank is None
    assert_layout_equal(layout, ref_layout(idx, E, R, L))


@pytest.mark.parametrize(
    ("topk_idx", "E", "R", "L", "error", "needle"),
    [
        (torch.zeros(4, 2), 8, 4, 8, TypeError, "topk_idx must have dtype int64"),
        (torch.zeros(4, 2, dtype=torch.int32), 8, 4, 8, TypeError, "int64"),
        (torch.zeros(4, dtype=torch.int64), 8, 4, 8, ValueError, "topk_idx must be 2-D"),
        (torch.zeros(4, 2, dtype=torch.int64), 10, 4, 8, ValueError, "not divisible"),
        (torch.zeros(4, 2, dtype=torch.int64), 0, 4, 8, ValueError, "must be positive"),
        (torch.zeros(4, 2, dtype=torch.int64), 8, 0, 8, ValueError, "must be positive"),
        (torch.zeros(4, 2, dtype=torch.int64), 12, 12, 8, ValueError, "multiple of ranks_per_node"),
        (torch.zeros(4, 2, dtype=torch.int64), 8, 4, 0, ValueError, "ranks_per_node"),
    ],
)
def test_bad_inputs(topk_idx, E, R, L, error, needle):
    with pytest.raises(error, match=needle):
        get_dispatch_layout(topk_idx, E, R, ranks_per_node=L)


def test_out_of_range_ids_rejected_only_with_checks():
    idx = torch.tensor([[0, 8], [1, -1]])
    with pytest.raises(ValueError, match="topk_idx"):
        get_dispatch_layout(idx, 8, 4, checks=True)
    idx = torch.tensor([[0, -2], [1, -1]])
    with pytest.raises(ValueError, match="topk_idx"):
        get_dispatch_layout(idx, 8, 4, checks=True)
    # Without checks nothing syncs and nothing is validated; -2 is treated like -1.
    layout = get_dispatch_layout(idx, 8, 4, checks=False)
    assert layout.num_tokens_per_expert.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


def test_runs_on_meta_without_host_sync():
    idx = torch.empty(16, 4, dtype=torch.int64, device="meta")
    layout = get_dispatch_layout(idx, 32, 16, ranks_per_node=8)
    assert layout.num_tokens_per_rank.shape == (16,)
    assert layout.num_tokens_per_rdma_rank.shape == (2,)
    assert layout.num_tokens_per_expert.shape == (32,)
    assert layout.is_token_in_rank.shape == (16, 16)
    assert layout.is_token_in_rank.device.type == "meta"


def test_ids_past_the_last_expert_are_dropped_without_checks():
    idx = torch.tensor([[0, 12], [9, 1]])
    layout = get_dispatch_layout(idx, 8, 4, checks=False)
    assert_layout_equal(layout, ref_layout(torch.tensor([[0, -1], [-1, 1]]), 8, 4, 8))
