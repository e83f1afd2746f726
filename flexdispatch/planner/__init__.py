"""The cluster planner behind ``flexdispatch plan``: pure computation, one process, no GPU.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows.

- ``accounting``: per-source row counts (``count_source_rows``), rows per rank and link class
  for the flat and hierarchical transports (``link_rows``), row sizes (torch, DeepEP).
- ``deepep``: DeepEP's buffer-size hints and tuned configs, reimplemented (V1 ``Buffer`` and V2
  ``ElasticBuffer``).
- ``plan``: ``plan_cluster`` (synthetic routing at cluster scale → ``ClusterPlan``).
- ``results``: the frozen result types (``ClusterPlan``, ``VariantPlan``, ...).
- ``report``: the human table (``format_plan``) and the plot (``plot_plan``, needs matplotlib).
"""

from __future__ import annotations

from flexdispatch.planner.deepep import (
    DeepEPConfig,
    DeepEPElasticHints,
    DeepEPHints,
    ElasticBufferSize,
    combine_config,
    deepep_elastic_hints,
    deepep_hints,
    dispatch_config,
    elastic_buffer_size,
    elastic_buffer_size_hint,
    elastic_hidden,
    low_latency_rdma_size_hint,
)
from flexdispatch.planner.plan import (
    DEFAULT_NVLINK_GBPS,
    DEFAULT_RDMA_GBPS,
    MAX_LOGITS,
    VARIANTS,
    node_limited_group_topk,
    plan_cluster,
    popularity_offsets,
)
from flexdispatch.planner.report import format_plan, plot_plan
from flexdispatch.planner.results import (
    ClusterPlan,
    DirectionTraffic,
    ModeTraffic,
    Stat,
    VariantPlan,
    WorstCase,
)
from flexdispatch.traffic import (
    LinkRows,
    RowFormat,
    SourceRows,
    count_rows_batched,
    count_source_rows,
    deepep_row_format,
    link_rows,
    torch_row_format,
)

__all__ = [
    "SourceRows",
    "LinkRows",
    "RowFormat",
    "count_source_rows",
    "count_rows_batched",
    "link_rows",
    "torch_row_format",
    "deepep_row_format",
    "DeepEPConfig",
    "DeepEPHints",
    "dispatch_config",
    "combine_config",
    "deepep_hints",
    "low_latency_rdma_size_hint",
    "ElasticBufferSize",
    "DeepEPElasticHints",
    "elastic_buffer_size",
    "elastic_buffer_size_hint",
    "elastic_hidden",
    "deepep_elastic_hints",
    "Stat",
    "DirectionTraffic",
    "ModeTraffic",
    "WorstCase",
    "VariantPlan",
    "ClusterPlan",
    "plan_cluster",
    "node_limited_group_topk",
    "popularity_offsets",
    "VARIANTS",
    "DEFAULT_NVLINK_GBPS",
    "DEFAULT_RDMA_GBPS",
    "MAX_LOGITS",
    "format_plan",
    "plot_plan",
]
