"""Result types of the cluster planner: frozen, keyword-only dataclasses with ``as_dict``.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows.

Per-rank arrays are tuples (immutable, JSON-ready); the two count matrices stay tensors.
``ClusterPlan.as_dict`` is the ``flexdispatch plan --json`` document (keys documented in
``flexdispatch/cli/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flexdispatch.planner.deepep import DeepEPElasticHints, DeepEPHints, ElasticBufferSize
from flexdispatch.traffic import LinkRows, RowFormat

__all__ = ["Stat", "DirectionTraffic", "ModeTraffic", "WorstCase", "VariantPlan", "ClusterPlan"]


@dataclass(frozen=True, kw_only=True)
class Stat:
    """min / mean / max over ranks, nodes or experts; ``imbalance = max / mean`` (0 if mean 0)."""

    min: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: torch.Tensor) -> Stat:
        v = values.double()
        return cls(min=float(v.min()), mean=float(v.mean()), max=float(v.max()))

    @property
    def imbalance(self) -> float:
        return self.max / self.mean if self.mean > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "mean": self.mean, "max": self.max, "imbalance": self.imbalance}


@dataclass(frozen=True, kw_only=True)
class DirectionTraffic:
    """One direction (dispatch or combine) of one transport.

    Attributes:
        nvlink_bytes: ``[R]`` bytes each rank sends to ranks of its node.
        rdma_bytes: ``[R]`` bytes each rank sends to other nodes.
        nvlink_recv_bytes / rdma_recv_bytes: ``[R]`` bytes each rank receives per link class.
        time_us: estimated time of the slowest rank (module docstring).
    """

    nvlink_bytes: tuple[int, ...]
    rdma_bytes: tuple[int, ...]
    nvlink_recv_bytes: tuple[int, ...]
    rdma_recv_bytes: tuple[int, ...]
    time_us: float

    def as_dict(self) -> dict[str, Any]:
        nvl, rdma = torch.tensor(self.nvlink_bytes), torch.tensor(self.rdma_bytes)
        return {
            "nvlink_bytes": Stat.of(nvl).as_dict(),
            "rdma_bytes": Stat.of(rdma).as_dict(),
            "nvlink_recv_bytes": Stat.of(torch.tensor(self.nvlink_recv_bytes)).as_dict(),
            "rdma_recv_bytes": Stat.of(torch.tensor(self.rdma_recv_bytes)).as_dict(),
            "total_nvlink_bytes": int(nvl.sum()),
            "total_rdma_bytes": int(rdma.sum()),
            "time_us": self.time_us,
        }


@dataclass(frozen=True, kw_only=True)
class ModeTraffic:
    """Bytes and time of one transport (``flat``, ``hierarchical`` or ``deepep``)."""

    mode: str
    row_format: RowFormat
    overlap: str
    rows: LinkRows
    dispatch: DirectionTraffic
    combine: DirectionTraffic

    def as_dict(self) -> dict[str, Any]:
        return {
            "dispatch_row_bytes": self.row_format.dispatch_bytes,
            "combine_row_bytes": self.row_format.combine_bytes,
            "row_format": self.row_format.description,
            "link_pattern": self.rows.mode,
            "overlap": self.overlap,
            "dispatch": self.dispatch.as_dict(),
            "combine": self.combine.as_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class WorstCase:
    """Suggestions for ``num_worst_tokens`` W from the simulated batch (add headroom).

    Attributes:
        observed_max_recv_rows: most rows any rank received (M of the hottest rank).
        deepep_w: ``observed_max_recv_rows`` rounded up to a multiple of R (DeepEP only needs
            ``M <= W``; intranode only).
        deepep_test_w: ``T * R``, what DeepEP's own test uses (always safe).
        torch_flat_w: smallest W the torch backend's flat mode accepts (``W / R`` rows per peer).
        torch_hier_w: same for its hierarchical mode (``W / N`` per node in hop 1, ``W / L`` per
            peer in hop 2), rounded up to a multiple of R.
        deepep_v2_w: smallest W DeepEP V2 (``deepep_api='v2'``) takes: ``T * R``, whatever
            the routing (``M = W / R`` receive slots per source rank must hold its T tokens);
            intranode and across nodes.
    """

    observed_max_recv_rows: int
    deepep_w: int
    deepep_test_w: int
    torch_flat_w: int
    torch_hier_w: int
    deepep_v2_w: int

    def as_dict(self) -> dict[str, int]:
        return {
            "observed_max_recv_rows": self.observed_max_recv_rows,
            "deepep_w": self.deepep_w,
            "deepep_test_w": self.deepep_test_w,
            "torch_flat_w": self.torch_flat_w,
            "torch_hier_w": self.torch_hier_w,
            "deepep_v2_w": self.deepep_v2_w,
        }


@dataclass(frozen=True, kw_only=True)
class VariantPlan:
    """Load and traffic of one routing variant.

    Attributes:
        name: ``"preset"``, ``"ungrouped"`` or ``"node_limited"``.
        num_groups / group_topk: the grouping routed with (None = ungrouped).
        same_as: name of an earlier variant with the same grouping (results shared), or None.
        note: why the grouping was chosen, when not obvious.
        rows_SR: ``[R, R]`` int64 flat rows from source rank ``s`` to rank ``g``.
        rows_SN: ``[R, N]`` int64 rows from source ``s`` to node ``n`` (one per token and node).
        recv_rows: ``[R]`` rows each rank receives (M per rank; same in every transport).
        recv_pairs: ``[R]`` ``(token, expert)`` pairs each rank's experts receive.
        tokens_per_expert: ``[E]`` pairs per expert.
        node_recv_rows: ``[N]`` rows received by the ranks of each node.
        node_rdma_rows_in: ``[N]`` rows entering each node over RDMA (hierarchical/deepep).
        avg_ranks_per_token / avg_nodes_per_token: mean destinations of a token.
        traffic: one ``ModeTraffic`` per transport.
        worst_case: W suggestions.
    """

    name: str
    num_groups: int | None
    group_topk: int | None
    same_as: str | None
    note: str
    rows_SR: torch.Tensor
    rows_SN: torch.Tensor
    recv_rows: tuple[int, ...]
    recv_pairs: tuple[int, ...]
    tokens_per_expert: tuple[int, ...]
    node_recv_rows: tuple[int, ...]
    node_rdma_rows_in: tuple[int, ...]
    avg_ranks_per_token: float
    avg_nodes_per_token: float
    traffic: tuple[ModeTraffic, ...]
    worst_case: WorstCase

    def mode(self, name: str) -> ModeTraffic:
        for m in self.traffic:
            if m.mode == name:
                return m
        raise ValueError(f"no transport {name!r}: choose one of flat, hierarchical, deepep")

    def hot_ranks(self, n: int = 5) -> list[tuple[int, int]]:
        """The ``n`` ranks receiving the most rows, as ``(rank, rows)``, hottest first."""
        return _top(self.recv_rows, n)

    def hot_experts(self, n: int = 5) -> list[tuple[int, int]]:
        """The ``n`` experts with the most pairs, as ``(expert, pairs)``, hottest first."""
        return _top(self.tokens_per_expert, n)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_groups": self.num_groups,
            "group_topk": self.group_topk,
            "same_as": self.same_as,
            "note": self.note,
            "load": {
                "recv_rows": Stat.of(torch.tensor(self.recv_rows)).as_dict(),
                "recv_pairs": Stat.of(torch.tensor(self.recv_pairs)).as_dict(),
                "tokens_per_expert": Stat.of(torch.tensor(self.tokens_per_expert)).as_dict(),
                "node_recv_rows": Stat.of(torch.tensor(self.node_recv_rows)).as_dict(),
                "node_rdma_rows_in": Stat.of(torch.tensor(self.node_rdma_rows_in)).as_dict(),
                "avg_ranks_per_token": self.avg_ranks_per_token,
                "avg_nodes_per_token": self.avg_nodes_per_token,
                "hot_ranks": [list(p) for p in self.hot_ranks()],
                "hot_experts": [list(p) for p in self.hot_experts()],
                "per_rank_recv_rows": list(self.recv_rows),
                "per_node_recv_rows": list(self.node_recv_rows),
                "per_expert_tokens": list(self.tokens_per_expert),
            },
            "traffic": {m.mode: m.as_dict() for m in self.traffic},
            "worst_case": self.worst_case.as_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    """Everything ``flexdispatch plan`` reports (``as_dict`` is the ``--json`` document)."""

    preset: str
    num_experts: int
    topk: int
    hidden_size: int
    nodes: int
    ranks_per_node: int
    tokens_per_rank: int
    skew: float
    seed: int
    elem_size: int
    nvlink_gbps: float
    rdma_gbps: float
    variants: tuple[VariantPlan, ...]
    deepep: DeepEPHints
    deepep_elastic: DeepEPElasticHints
    wall_s: float
    notes: tuple[str, ...]

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_rank * self.num_ranks

    def variant(self, name: str) -> VariantPlan:
        for v in self.variants:
            if v.name == name:
                return v
        names = ", ".join(v.name for v in self.variants)
        raise ValueError(f"no routing variant {name!r} in this plan: choose one of {names}")

    def as_dict(self) -> dict[str, Any]:
        d = self.deepep
        return {
            "schema": "flexdispatch.plan/1",
            "preset": self.preset,
            "num_experts": self.num_experts,
            "topk": self.topk,
            "hidden_size": self.hidden_size,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "num_ranks": self.num_ranks,
            "experts_per_rank": self.experts_per_rank,
            "tokens_per_rank": self.tokens_per_rank,
            "total_tokens": self.total_tokens,
            "skew": self.skew,
            "seed": self.seed,
            "elem_size": self.elem_size,
            "bandwidth_gbps": {"nvlink": self.nvlink_gbps, "rdma": self.rdma_gbps},
            "wall_s": self.wall_s,
            "notes": list(self.notes),
            "variants": [v.as_dict() for v in self.variants],
            "deepep": {
                "supported": d.supported,
                "reason": d.reason,
                "num_sms": d.num_sms,
                "hidden_bytes": d.hidden_bytes,
                "dispatch_config": None if d.dispatch_config is None else list(d.dispatch_config),
                "combine_config": None if d.combine_config is None else list(d.combine_config),
                "num_nvl_bytes": d.num_nvl_bytes,
                "nvl_bytes_dispatch": d.nvl_bytes_dispatch,
                "nvl_bytes_combine": d.nvl_bytes_combine,
                "num_rdma_bytes": d.num_rdma_bytes,
                "rdma_bytes_dispatch": d.rdma_bytes_dispatch,
                "rdma_bytes_combine": d.rdma_bytes_combine,
                "low_latency": {
                    "max_tokens_per_rank": d.ll_max_tokens,
                    "rdma_bytes": d.ll_rdma_bytes,
                },
                "elastic": _elastic_dict(self.deepep_elastic),
            },
        }


def _elastic_size_dict(s: ElasticBufferSize) -> dict[str, int]:
    return {
        "num_max_tokens_per_rank": s.num_max_tokens_per_rank,
        "num_bytes": s.num_bytes,
        "dispatch_bytes": s.dispatch_bytes,
        "combine_bytes": s.combine_bytes,
    }


def _elastic_dict(v2: DeepEPElasticHints) -> dict[str, Any]:
    s = v2.dropless
    return {
        "supported": v2.supported,
        "reason": v2.reason,
        "mode": "direct",
        "use_fp8_dispatch": False,
        "allow_hybrid_mode": False,
        "allow_multiple_reduction": True,
        "num_rdma_ranks": s.num_rdma_ranks,
        "num_nvl_ranks": s.num_nvl_ranks,
        "num_scaleout_ranks": s.num_scaleout_ranks,
        "num_scaleup_ranks": s.num_scaleup_ranks,
        "scaleup_nvlink": s.scaleup_nvlink,
        "num_topk": s.num_topk,
        "elem_size": v2.elem_size,
        "dispatch_hidden": v2.dispatch_hidden,
        "combine_hidden": v2.combine_hidden,
        "hidden": v2.hidden,
        "dispatch_token_bytes": s.dispatch_token_bytes,
        "combine_token_bytes": s.combine_token_bytes,
        "dropless": _elastic_size_dict(v2.dropless),
        "worst_case": {"num_worst_tokens": v2.worst_case_w, **_elastic_size_dict(v2.worst_case)},
    }


def _top(values: tuple[int, ...], n: int) -> list[tuple[int, int]]:
    t = torch.tensor(values)
    k = min(n, t.numel())
    top = torch.topk(t, k)
    return [(int(i), int(v)) for v, i in zip(top.values, top.indices, strict=True)]
