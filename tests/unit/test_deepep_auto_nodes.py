"""``deepep_api='auto'`` across nodes takes the node-deduplicated kernels (issue 25, audit N12).

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · M = num_max_dispatch_tokens_per_rank ·
W worst-case rows.

``auto_deepep_api`` is the local rule (no collective), checked in process: across nodes a
dropless dispatch runs V1's internode kernels (one RDMA copy per destination node, forwarded over
NVLink) rather than V2's direct mode (one per destination rank), unless ``deepep_hybrid=False``
asks for direct mode; DeepEP 2.5 still comes first (its hybrid mode dedups per node).
"""

from __future__ import annotations

import pytest

from flexdispatch.config import DispatchConfig
from flexdispatch.dispatch.select import auto_deepep_api

OK = (True, "ok")


@pytest.mark.timeout(30)
def test_auto_across_nodes_prefers_node_dedup() -> None:
    bound = DispatchConfig(num_max_dispatch_tokens_per_rank=64)
    # one node: V2 as before (its static bound is known)
    assert auto_deepep_api(bound, OK, OK)[0] == "v2"
    # across nodes: V1's internode kernels, with the reason
    api, why = auto_deepep_api(bound, OK, OK, across_nodes=True)
    assert api == "v1" and "once per destination node" in why, why
    # direct mode asked for: V2
    direct = DispatchConfig(num_max_dispatch_tokens_per_rank=64, deepep_hybrid=False)
    assert auto_deepep_api(direct, OK, OK, across_nodes=True)[0] == "v2"
    # V1 unable (e.g. its node counts): V2 direct mode rather than nothing
    assert auto_deepep_api(bound, OK, (False, "no"), across_nodes=True)[0] == "v2"
    # DeepEP 2.5 first (hybrid mode)
    assert auto_deepep_api(bound, OK, OK, OK, across_nodes=True)[0] == "v25"
    # worst-case: V1 has no internode worst-case mode; V2, saying it is direct mode
    api, why = auto_deepep_api(DispatchConfig(num_worst_tokens=64), OK, OK, across_nodes=True)
    assert api == "v2" and "direct mode" in why, why
