"""The cluster planner behind ``flexdispatch plan``: pure computation, one process, no GPU.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows.

- ``flexdispatch.traffic`` (re-exported): per-source row counts (``count_source_rows``), rows
  per rank and link class for the flat and hierarchical transports (``link_rows``), row sizes
  (torch, DeepEP).
- ``deepep``: DeepEP's buffer-size hints and tuned configs, reimplemented (V1 ``Buffer`` and V2
  ``ElasticBuffer``).
- ``plan``: ``plan_cluster`` (synthetic routing at cluster scale → ``ClusterPlan``).
- ``results``: the frozen result types (``ClusterPlan``, ``VariantPlan``, ...).
- ``report``: the human table (``format_plan``) and the plot (``plot_plan``, needs matplotlib).
"""

from __future__ import annotations

from flexdispatch import traffic
from flexdispatch.planner import deepep, plan, report, results
from flexdispatch.planner.deepep import *  # noqa: F403
from flexdispatch.planner.plan import *  # noqa: F403
from flexdispatch.planner.report import *  # noqa: F403
from flexdispatch.planner.results import *  # noqa: F403
from flexdispatch.traffic import *  # noqa: F403

# NOTE: the face names each module's own list once (its ``__all__``)
__all__ = [*traffic.__all__, *deepep.__all__, *plan.__all__, *results.__all__, *report.__all__]
