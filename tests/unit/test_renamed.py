"""Names before 0.1 that stay for one release as deprecated aliases (README.md, "Renamed in
0.1"): reading one warns and gives the new field; the dropped ``FlexDispatcher.check`` is gone."""

from __future__ import annotations

import pytest
import torch

from flexdispatch import DispatchConfig, ExpandedDispatchResult, FlexDispatcher
from flexdispatch.dispatch.decode import expert_major_maps
from flexdispatch.types import DispatchHandle, ExpertMajorHandle, ExpertMajorResult


def _handle() -> DispatchHandle:
    return DispatchHandle(backend="torch", num_tokens=0, hidden=1, num_recv_rows=0, state=None)


@pytest.mark.parametrize(
    "make, old, new",
    [
        (
            lambda: ExpandedDispatchResult(
                recv_x=torch.zeros(2, 1),
                recv_topk_probs=torch.ones(2),
                num_recv_tokens_per_expert=torch.tensor([2]),
                handle=_handle(),
            ),
            "recv_probs",
            "recv_topk_probs",
        ),
        (
            lambda: ExpandedDispatchResult(
                recv_x=torch.zeros(2, 1),
                recv_topk_probs=torch.ones(2),
                num_recv_tokens_per_expert=torch.tensor([2]),
                handle=_handle(),
            ),
            "tokens_per_expert",
            "num_recv_tokens_per_expert",
        ),
        (
            lambda: ExpertMajorResult(
                recv_x=torch.zeros(1, 2, 1),
                recv_scales=None,
                num_recv_tokens_per_expert=torch.tensor([1]),
                handle=ExpertMajorHandle(
                    backend="torch",
                    num_tokens=0,
                    hidden=1,
                    capacity=2,
                    topk_idx=torch.zeros(0, 1, dtype=torch.int64),
                    topk_probs=torch.zeros(0, 1),
                    generation=-1,
                    state=None,
                ),
            ),
            "recv_count",
            "num_recv_tokens_per_expert",
        ),
        (
            lambda: expert_major_maps(torch.tensor([[0, -1], [1, 0]]), 2, 4),
            "recv_count",
            "num_recv_tokens_per_expert",
        ),
    ],
)
def test_an_old_field_name_reads_the_new_field_with_a_warning(make, old, new):
    result = make()
    with pytest.warns(DeprecationWarning, match=rf"\.{old} is now \.{new}"):
        got = getattr(result, old)
    assert got is getattr(result, new)


def test_the_check_alias_of_check_overflow_is_gone():
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=4)
    assert not hasattr(d, "check")
    d.check_overflow()
    d.close()
