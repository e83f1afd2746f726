"""Metadata packing of the torch backend: global ids travel, each receiver keeps its own."""

from __future__ import annotations

import pytest
import torch

from flexdispatch.backends.torch.rows import pack_token_meta, unpack_local

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
    # the sender-side rule, one slot at a time: ids of this rank's experts become local, the
    # rest -1 with prob 0
    lo = rank * e
    keep = [[0 <= v - lo < e for v in row] for row in ids.tolist()]
    want_ids = torch.tensor(
        [
            [v - lo if kp else -1 for v, kp in zip(r, ks, strict=True)]
            for r, ks in zip(ids.tolist(), keep, strict=True)
        ]
    )
    want_probs = torch.where(torch.tensor(keep), probs, 0.0)
    assert got_ids.dtype == torch.int64 and got_probs.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_probs, want_probs)  # fp32 bits travel unchanged
    assert got_ids[1, 2] == 0 and got_ids[0].eq(-1).all() and got_ids[1, :2].eq(-1).all()


def test_scratch_lends_one_view_per_shape_and_never_one_of_a_replaced_buffer() -> None:
    from flexdispatch.backends.torch.a2a import TorchA2ABackend

    be = TorchA2ABackend(None, num_experts=4, ranks_per_node=1)
    cpu = torch.device("cpu")
    a = be.scratch("send", (4, 8), torch.float32, cpu)
    assert be.scratch("send", (4, 8), torch.float32, cpu) is a  # cached: no view ops
    b = be.scratch("send", (2, 8), torch.int32, cpu)
    assert b.shape == (2, 8) and b.dtype == torch.int32 and b.data_ptr() == a.data_ptr()
    other = be.scratch("recv0", (4, 8), torch.float32, cpu)
    assert other.data_ptr() != a.data_ptr()
    big = be.scratch("send", (64, 8), torch.float32, cpu)  # grows: a new buffer
    assert big.data_ptr() != a.data_ptr()
    again = be.scratch("send", (4, 8), torch.float32, cpu)
    assert again is not a and again.data_ptr() == big.data_ptr()
    for i in range(100):  # many shapes: the view cache stays bounded
        be.scratch("send", (1, i + 1), torch.float32, cpu)
    assert len(be._scratch_views) <= 64


def test_parts_are_kept_only_while_the_scratch_view_is_the_same(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from flexdispatch.backends.torch.a2a import TorchA2ABackend
    from tests.cuda_path import force_cuda_path

    be = TorchA2ABackend(None, num_experts=4, ranks_per_node=1)
    cpu = torch.device("cpu")
    built: list[int] = []

    def build(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        built.append(b.shape[0])
        return (b[:2], b[2:])

    a = be.scratch("pack", (4, 8), torch.uint8, cpu)
    first = be.parts(("pack", 2), a, build)
    assert be.parts(("pack", 2), be.scratch("pack", (4, 8), torch.uint8, cpu), build) is first
    assert built == [4]
    be.parts(("pack", 3), a, build)  # another key: built for it
    big = be.scratch("pack", (64, 8), torch.uint8, cpu)  # the buffer grows: a new view
    again = be.scratch("pack", (4, 8), torch.uint8, cpu)
    got = be.parts(("pack", 2), again, build)
    assert got is not first and got[0].data_ptr() == big.data_ptr() and built == [4, 4, 4]
    force_cuda_path(monkeypatch.setattr)  # a fresh buffer per call there: nothing kept
    n = len(be._parts)
    be.parts(("pack", 2), again, build)
    be.parts(("pack", 2), again, build)
    assert built == [4, 4, 4, 4, 4] and len(be._parts) == n
