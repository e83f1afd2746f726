"""DeepEP's fixed limits and topology rule, as a leaf module (no torch, no backend import), so that
``config.py`` can validate a ``DispatchConfig`` without importing a backend. The per-release
kernel limits (row bytes, local experts, node counts of each DeepEP release) are in
``backends/deepep/rules.py``; the buffer sizing in ``backends/deepep/sizing.py``, which re-exports
these names.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "NUM_BUFFER_ALIGNMENT_BYTES",
    "NUM_MAX_NVL_PEERS",
    "INTRANODE_RANK_COUNTS",
    "INTERNODE_NODE_COUNTS",
    "ANY_RELEASE_INTERNODE_NODE_COUNTS",
    "MAX_TOPK",
    "NUM_MAX_LOCAL_EXPERTS",
    "LOW_LATENCY_HIDDEN_SIZES",
    "LOW_LATENCY_MAX_TOPK",
    "LOW_LATENCY_MAX_TOKENS_PER_RANK",
    "check_topology",
    "resolve_ranks_per_node",
]

NUM_BUFFER_ALIGNMENT_BYTES = 128
"""DeepEP asserts that ``num_nvl_bytes`` and ``num_rdma_bytes`` are multiples of this."""
NUM_MAX_NVL_PEERS = 8
"""DeepEP's NVLink domain: node = rank // 8 once R > 8."""
INTRANODE_RANK_COUNTS = (2, 4, 8)
"""R accepted by the intranode kernels (``SWITCH_RANKS``)."""
INTERNODE_NODE_COUNTS = (2, 4, 8, 16)
"""N = R / 8 accepted by the internode kernels at v1.2.1 (``SWITCH_RDMA_RANKS``)."""
ANY_RELEASE_INTERNODE_NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 18, 20)
"""N accepted by some supported release (v1.2.1: 2/4/8/16/18/20, 2.1.0 adds 3/6/12;
``launch.cuh``): what a config can be checked against before the installed release is known."""
MAX_TOPK = 32
"""k handled by the normal kernels (one warp lane per slot)."""
NUM_MAX_LOCAL_EXPERTS = 1024
"""e accepted by the normal dispatch (``NUM_MAX_LOCAL_EXPERTS``)."""
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
"""H compiled into the low-latency kernels at v1.2.1 (``SWITCH_HIDDEN``; 3072 came later)."""
LOW_LATENCY_MAX_TOPK = 11
"""k accepted by the low-latency kernels (``kNumMaxTopK``)."""
LOW_LATENCY_MAX_TOKENS_PER_RANK = 1024
"""Tokens one rank may send another in low-latency mode (the finish tag of the kernels)."""


def resolve_ranks_per_node(
    num_ranks: int, ranks_per_node: int | None, configured: int | None = None
) -> int:
    """L as the dispatcher resolves it (``distributed.resolve_ranks_per_node``, which raises for a
    bad value): the argument, the config's ``ranks_per_node``, the launcher's
    ``LOCAL_WORLD_SIZE`` (at most R), else R."""
    import os

    if ranks_per_node is not None:
        return ranks_per_node
    if configured is not None:
        return configured
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if env.isdigit() and int(env) > 0:
        return min(int(env), num_ranks)
    return num_ranks


def check_topology(
    num_ranks: int,
    ranks_per_node: int,
    *,
    num_worst_tokens: int = 0,
    intranode_rank_counts: Sequence[int] = INTRANODE_RANK_COUNTS,
    internode_node_counts: Sequence[int] = INTERNODE_NODE_COUNTS,
    nvl_peers: int = NUM_MAX_NVL_PEERS,
    low_latency: bool = False,
) -> tuple[bool, str]:
    """Whether DeepEP's normal kernels (``low_latency``: its low-latency kernels) run on ``R``
    ranks with ``L`` ranks per node.

    DeepEP does not read the launcher's topology: it treats ``R <= 8`` ranks as one NVLink domain
    and, above that, ``rank // 8`` as the node. So a job is supported only when its real
    layout matches that view.

    Args:
        num_ranks: R.
        ranks_per_node: L, ranks per node as launched.
        num_worst_tokens: W; DeepEP's Python wrapper refuses W > 0 across nodes.
        intranode_rank_counts: R accepted on one node.
        internode_node_counts: N accepted across nodes (with L = 8).
        nvl_peers: DeepEP's NVLink domain (8; the test emulator can shrink it to fake nodes).
        low_latency: the low-latency kernels' rule: they switch on the hidden size only, never
            on the node count (v1.2.1 internode_ll.cu), and ``Buffer`` waives R <= 160 in
            low-latency mode (deep_ep.cpp:29): across nodes the node-count list does not apply
            (the rest does: node = rank // 8, deep_ep.cpp:30, 36-37).

    Returns:
        ``(ok, reason)``.
    """
    ranks, local = num_ranks, ranks_per_node
    if ranks < 2:
        return False, f"DeepEP needs at least 2 ranks, the group has {ranks}"
    if local <= 0 or ranks % local:
        return False, f"world size {ranks} is not a multiple of ranks_per_node={local}"
    if local > nvl_peers:
        return False, f"DeepEP's NVLink domain is at most {nvl_peers} ranks, got L={local}"
    if local == ranks:
        if ranks not in intranode_rank_counts:
            allowed = "/".join(map(str, intranode_rank_counts))
            return False, f"DeepEP's intranode kernels support {allowed} ranks, not {ranks}"
        return True, f"intranode: {ranks} ranks on one node"
    if ranks <= nvl_peers:
        return False, (
            f"{ranks} ranks on {ranks // local} nodes: DeepEP treats up to {nvl_peers} ranks as "
            f"one NVLink domain and cannot span nodes with them"
        )
    if local != nvl_peers:
        return False, (
            f"DeepEP's internode kernels take node = rank // {nvl_peers}, but this job "
            f"runs {local} ranks per node"
        )
    nodes = ranks // local
    if low_latency:
        return True, f"low-latency: {nodes} nodes x {local} ranks (any node count)"
    if nodes not in internode_node_counts:
        allowed = "/".join(map(str, internode_node_counts))
        return False, f"DeepEP's internode kernels support {allowed} nodes, not {nodes}"
    if num_worst_tokens > 0:
        return False, (
            f"num_worst_tokens={num_worst_tokens} across {nodes} nodes: DeepEP supports the "
            f"worst-case (CUDA-graph) mode intranode only on its V1 Buffer (deepep_api='v1'); "
            f"across nodes it needs DeepEP V2 or 2.5 (deepep_api='auto' picks one that can run "
            f"here)"
        )
    return True, f"internode: {nodes} nodes x {local} ranks"
