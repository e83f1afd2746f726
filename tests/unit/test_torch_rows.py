"""Metadata packing of the torch backend: global ids travel, each receiver keeps its own."""

from __future__ import annotations

import pytest
import torch

from flexdispatch.backends.torch_rows import localize, pack_token_meta, unpack_local

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_receiver_side_localize_matches_sender_side(rank: int) -> None:
    E, R = 16, 4
    e = E // R
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(-1, E, (64, 3), generator=g)
    # ids the dispatcher treats as dropped: negative, >= E, and values that wrap in int32
    ids[0] = torch.tensor([-5, E, 2**32 + rank * e])
    ids[1] = torch.tensor([2**31, -(2**32) + rank * e, rank * e])
    probs = torch.rand(64, 3, generator=g)
    got_ids, got_probs = unpack_local(pack_token_meta(ids, probs, E), 3, rank * e, e, E)
    clean = torch.where((ids >= 0) & (ids < E), ids, -1)
    lo = torch.full((64,), rank * e)
    want_ids, want_probs = localize(clean, probs, lo, e, None)
    assert got_ids.dtype == torch.int64 and got_probs.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_probs, want_probs)  # fp32 bits travel unchanged
    assert got_ids[1, 2] == 0 and got_ids[0].eq(-1).all() and got_ids[1, :2].eq(-1).all()
