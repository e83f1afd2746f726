"""``DecodeDispatcher`` and the public expert-major helpers check their arguments (reliability-5
S7): a ``TypeError`` / ``ValueError`` naming the bad value, never an internal exception or a
silent acceptance. In a world of one (torch backend, worst-case mode).

T tokens · H hidden · E experts · k top-k · W worst-case rows · C capacity.
"""

from __future__ import annotations

import pytest
import torch

import flexdispatch as fd
from flexdispatch.dispatch.decode import (
    DecodeDispatcher,
    expert_major_maps,
    from_expert_major,
    to_expert_major,
)

W, H, E = 16, 8, 4


def _dispatcher() -> fd.FlexDispatcher:
    return fd.FlexDispatcher(fd.DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, H, generator=g)
    return x, torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2, generator=g)


@pytest.mark.parametrize("bad", ["4", None, 2.5, True])
def test_num_max_must_be_a_positive_int(bad):
    # '4' / None: TypeError from `<=`; 2.5 failed at the first dispatch (new_zeros); True was 1
    with pytest.raises(TypeError, match=r"num_max_dispatch_tokens_per_rank must be a positive int"):
        DecodeDispatcher(_dispatcher(), num_max_dispatch_tokens_per_rank=bad)
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank must be a positive"):
        DecodeDispatcher(_dispatcher(), num_max_dispatch_tokens_per_rank=0)


@pytest.mark.parametrize("bad", [None, "x", torch.nn.Linear(2, 2)])
def test_the_dispatcher_must_be_a_flex_dispatcher(bad):
    # AttributeError: ... has no attribute 'num_ranks'
    with pytest.raises(TypeError, match=r"dispatcher must be a FlexDispatcher"):
        DecodeDispatcher(bad, num_max_dispatch_tokens_per_rank=2)


def test_a_handle_of_a_decoder_of_another_capacity_is_refused():
    # two decoders on the same dispatcher (capacities 2 and 4): the issuer check passed and the
    # combine returned a silently wrong [2, 8] (max |diff| 1.69 against the right one)
    d = _dispatcher()
    a = DecodeDispatcher(d, num_max_dispatch_tokens_per_rank=2)
    b = DecodeDispatcher(d, num_max_dispatch_tokens_per_rank=4)
    x, idx, p = _inputs()
    ra, rb = a.dispatch(x, idx, p), b.dispatch(x, idx, p)
    with pytest.raises(ValueError, match=r"handle is of a decoder of capacity 2, this one's is 4"):
        b.combine(rb.recv_x, ra.handle)
    # each with its own handle: the weighted sum of the pairs (identity experts)
    want = (x[:, None, :] * p[..., None]).sum(1)
    torch.testing.assert_close(a.combine(ra.recv_x, ra.handle), want)
    torch.testing.assert_close(b.combine(rb.recv_x, rb.handle), want)


def test_the_helpers_check_their_arguments():
    # float ids were truncated to experts 0, 1 silently
    with pytest.raises(TypeError, match=r"recv_topk_idx must have dtype int64"):
        expert_major_maps(torch.tensor([[0.7, 1.2]]), 2, 2)
    with pytest.raises(TypeError, match=r"capacity must be an int"):
        expert_major_maps(torch.tensor([[0, 1]]), 2, 2.0)
    m = expert_major_maps(torch.tensor([[0, 1], [1, 0]]), 2, 2)
    assert m.capacity == 2
    # another capacity returned [2, 5, 4] (IndexError past the maps' slots on larger ones)
    with pytest.raises(ValueError, match=r"capacity=5 but the maps were made for capacity 2"):
        to_expert_major(torch.randn(2, 4), m, 5)
    with pytest.raises(ValueError, match=r"recv_x has 3 rows but the maps hold 4"):
        to_expert_major(torch.randn(3, 4), m, 2)
    # probs of another shape: RuntimeError: shape '[...]' is invalid for input of size ...
    y = to_expert_major(torch.randn(2, 4), m, 2)
    with pytest.raises(ValueError, match=r"recv_topk_probs is \[4, 2\] but the maps hold 4"):
        from_expert_major(y, m, torch.rand(4, 2))
    with pytest.raises(ValueError, match=r"y must be \[2, 2, X\]"):
        from_expert_major(torch.randn(2, 3, 4), m, torch.rand(2, 2))
    out = from_expert_major(y, m, torch.ones(2, 2))
    assert out.shape == (2, 4)
