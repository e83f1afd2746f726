"""The planner's row/byte accounting agrees with what the torch backend puts on the wire.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · N = R / L nodes.

A real 4-rank gloo group (2 nodes x 2 ranks) dispatches and combines once per (routing, mode,
dtype); every rank's ``DispatchStats`` must equal the planner's prediction built only from the
routing of all ranks (``count_source_rows`` -> ``link_rows`` -> ``torch_row_format``): bytes sent
inside and across nodes (dispatch + combine, self-sends excluded) and rows received.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import all_inputs

R, L, K, H, E_PER_RANK, SEED = 4, 2, 3, 16, 2, 77
E = R * E_PER_RANK
ROUTINGS = ("random", "node_limited")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def routing(kind: str, rank: int) -> torch.Tensor:
    """``[T, k]`` int64 expert ids of ``rank``, rebuilt identically on every process."""
    if kind == "random":
        return all_inputs(SEED, R=R, E=E, k=K, H=H)[rank].idx
    from flexdispatch.routing import topk_routing

    # Node-limited: 2 groups (= nodes) of 4 experts, 1 kept: every token stays on one node.
    g = torch.Generator().manual_seed(SEED * 31 + rank)
    logits = torch.randn(9 + 3 * rank, E, generator=g)
    return topk_routing(
        logits, topk=K, score_function="sigmoid", num_groups=R // L, group_topk=1, group_score="max"
    ).topk_idx


def stats_worker(rank: int, world: int) -> dict[tuple[str, str, bool], dict[str, int]]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    out: dict[tuple[str, str, bool], dict[str, int]] = {}
    for kind in ROUTINGS:
        idx = routing(kind, rank)
        T = idx.shape[0]
        probs = torch.rand(T, K, generator=torch.Generator().manual_seed(rank))
        probs = probs.masked_fill(idx < 0, 0.0)
        for dname, dtype in DTYPES.items():
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(dtype)
            for hier in (False, True):
                cfg = DispatchConfig(backend="torch", hierarchical=hier, ranks_per_node=L)
                d = FlexDispatcher(cfg, num_experts=E)
                res = d.dispatch(x, idx, probs)
                d.combine(res.recv_x, res.handle)
                out[(kind, dname, hier)] = d.stats.as_dict()
                d.close()
    return out


def expected(kind: str, elem_size: int, hier: bool) -> list[dict[str, int]]:
    from flexdispatch.planner import count_source_rows, link_rows, torch_row_format

    counts = [
        count_source_rows(routing(kind, r), num_experts=E, num_ranks=R, ranks_per_node=L)
        for r in range(R)
    ]
    C = torch.stack([c.rows_per_rank for c in counts])
    D = torch.stack([c.rows_per_node for c in counts])
    rows = link_rows(C, D, ranks_per_node=L, mode="hierarchical" if hier else "flat")
    fmt = torch_row_format(hidden=H, topk=K, elem_size=elem_size)
    d, c = fmt.dispatch_bytes, fmt.combine_bytes
    return [
        {
            "bytes_sent_intra_node": int(rows.dispatch_intra[r] * d + rows.combine_intra[r] * c),
            "bytes_sent_inter_node": int(rows.dispatch_inter[r] * d + rows.combine_inter[r] * c),
            "rows_received": int(C[:, r].sum()),
        }
        for r in range(R)
    ]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_planner_matches_torch_backend_stats() -> None:
    reports: list[Any] = run_group(stats_worker, R, timeout=200)
    for kind in ROUTINGS:
        for dname, dtype in DTYPES.items():
            elem = torch.empty((), dtype=dtype).element_size()
            for hier in (False, True):
                want = expected(kind, elem, hier)
                for r in range(R):
                    got = reports[r][(kind, dname, hier)]
                    where = f"rank {r} {kind} {dname} {'hier' if hier else 'flat'}"
                    for key, value in want[r].items():
                        assert got[key] == value, f"{where}: {key} {got[key]} != planner {value}"

    # Node-limited routing keeps a token on one node (3 of its 4 experts: both of its ranks), so
    # hierarchical mode crosses the node boundary once per token where flat crosses twice.
    def inter(hier: bool) -> int:
        return sum(rep[("node_limited", "fp32", hier)]["bytes_sent_inter_node"] for rep in reports)

    assert 0 < inter(True) < inter(False)
