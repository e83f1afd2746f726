"""``distributed.host_gather_int64``: a few ints agreed on the host (DeepEP V2 / V2.5's dropless
token counts, a buffer's "fits" flags) over a gloo side group of an NCCL group's ranks.

NCCL cannot run here: the side-group path is forced on gloo groups by taking their collectives
as device collectives (``distributed._runs_on_host``), as the DeepEP tests do.

R ranks.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from tests.dist.harness import run_group


def side_groups_of_uneven_histories(rank: int, R: int) -> dict[str, Any]:
    """Rank 0 holds one more group than rank 1 (a group only its members create, as for logging)
    before the first gather: a side group named by ``new_group`` after how many groups each
    member holds waited on two names until the timeout; the gather answers at once. Two groups
    of the same ranks get a side group each; a third gather on the first reuses its own."""
    import torch.distributed as dist

    from flexdispatch import distributed

    distributed._runs_on_host = lambda group: False  # type: ignore[attr-defined]  # as NCCL
    short = datetime.timedelta(seconds=20)
    first = dist.new_group(list(range(R)), timeout=short)
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    second = dist.new_group(list(range(R)), timeout=short)
    a = distributed.host_gather_int64([rank, 10 + rank], first, name="first")
    b = distributed.host_gather_int64([7 * rank], second, name="second")
    c = distributed.host_gather_int64([rank + 100], first, name="first again")
    sides = [side for pg, side in distributed._HOST_GROUPS.values() if pg in (first, second)]
    return {"a": a, "b": b, "c": c, "sides": [type(s).__name__ for s in sides]}


@pytest.mark.timeout(120)
def test_side_groups_do_not_depend_on_the_groups_a_rank_made_before() -> None:
    for out in run_group(side_groups_of_uneven_histories, 2, timeout=60, pg_timeout=20):
        assert out["a"] == [[0, 10], [1, 11]], out
        assert out["b"] == [[0], [7]], out
        assert out["c"] == [[100], [101]], out
        assert out["sides"] == ["ProcessGroupGloo", "ProcessGroupGloo"], out
