"""The shared DeepEP buffer grows geometrically (issue 25, audit finding N19), in process.

Shape letters (ARCHITECTURE.md): H hidden.

DeepEP has no resize: each rebuild of ``deep_ep.Buffer`` re-exchanges IPC handles and, with RDMA
bytes, finalises and re-initialises NVSHMEM. A fake ``deep_ep`` module records the buffers
``SharedBuffer`` builds while the row width creeps up.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from flexdispatch.backends.deepep import buffer as B
from flexdispatch.backends.deepep import sizing as S


def _fake() -> tuple[Any, list[dict[str, Any]]]:
    built: list[dict[str, Any]] = []

    class Buffer:
        def __init__(self, group: Any, **kw: Any) -> None:
            built.append(kw)

        def destroy(self) -> None:
            pass

    return SimpleNamespace(Buffer=Buffer), built


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rdma", [0, 1], ids=["intranode", "with-rdma"])
def test_growth_rebuilds_logarithmically(rdma: int) -> None:
    module, built = _fake()
    shared = B.SharedBuffer(deep_ep=module, group=None)
    needs = [
        S.BufferSize(num_nvl_bytes=128 * w, num_rdma_bytes=64 * w * rdma) for w in range(8, 1025, 8)
    ]
    for need in needs:
        shared.ensure(need, low_latency=False, num_qps_per_rank=24)
        assert shared.size is not None and shared.size.covers(need)
        got = built[-1]
        assert got["num_nvl_bytes"] >= need.num_nvl_bytes
        assert got["num_rdma_bytes"] >= need.num_rdma_bytes
    # 128 widths from 8 to 1024 columns: at most log2(1024 / 8) + 1 buffers, not 128
    assert len(built) <= math.log2(1024 / 8) + 1, len(built)
    assert shared.nvshmem_reinits == (len(built) - 1) * rdma


@pytest.mark.timeout(30)
def test_geometric_step_examples() -> None:
    cur = S.BufferSize(num_nvl_bytes=1024, num_rdma_bytes=0)
    assert S.grow_geometric(cur, cur) is None
    assert S.grow_geometric(None, cur) == cur
    # a little more doubles; much more is taken as is; 0 RDMA bytes grow to the need
    assert S.grow_geometric(cur, S.BufferSize(num_nvl_bytes=1100, num_rdma_bytes=0)) == (
        S.BufferSize(num_nvl_bytes=2048, num_rdma_bytes=0)
    )
    want = S.BufferSize(num_nvl_bytes=5000, num_rdma_bytes=256)
    assert S.grow_geometric(cur, want) == want
    # doubling never crosses DeepEP's INT_MAX byte checks
    big = S.BufferSize(num_nvl_bytes=2**30 + 2**29, num_rdma_bytes=0)
    more = S.BufferSize(num_nvl_bytes=2**30 + 2**29 + 128, num_rdma_bytes=0)
    assert S.grow_geometric(big, more) == S.BufferSize(
        num_nvl_bytes=S.MAX_GEOMETRIC_BYTES, num_rdma_bytes=0
    )
