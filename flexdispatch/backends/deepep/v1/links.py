"""What one V1 (``deep_ep.Buffer``) dispatch puts on each link class, read from DeepEP's handle.

R ranks · L ranks per node · N = R / L nodes. The counters of ``DeepEPV1Backend.stats``: computed on
the device from the handle's prefix matrices (no collective, no host read), later, by
``counters.TrafficCounters``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flexdispatch._checks import tensors

__all__ = ["LazyLinks", "Links", "handle_links"]


@dataclass(frozen=True, kw_only=True)
class Links:
    """Rows one rank puts on NVLink (intra) and RDMA (inter) links, per direction, and the rows it
    sent / received. Host ints (CPU code path), or 0-d device tensors."""

    dispatch_intra: Any
    dispatch_inter: Any
    combine_intra: Any
    combine_inter: Any
    sent: Any
    received: Any


class LazyLinks:
    """``Links`` of one dispatch, computed on first use (memoized; the handle is then released)."""

    __slots__ = ("_compute", "_links")

    def __init__(self, compute: Callable[[], Links]) -> None:
        self._compute: Callable[[], Links] | None = compute
        self._links: Links | None = None

    def get(self) -> Links:
        if self._links is None:
            assert self._compute is not None
            self._links = self._compute()
            self._compute = None
        return self._links


def handle_links(
    handle: tuple,
    ntr: torch.Tensor,
    ntrr: torch.Tensor | None,
    *,
    num_ranks: int,
    ranks_per_node: int,
    rank: int,
) -> Links:
    """Rows per link class of one dispatch, read from DeepEP's handle and layout.

    Intranode: ``rank_prefix_matrix [R, R]`` (tokens from ranks ``0..s`` to each rank) gives the
    rows received from each source; ``num_tokens_per_rank`` the rows sent. Internode: one RDMA
    row per destination node (``num_tokens_per_rdma_rank``), the NVLink forwards of this rank
    (``send_nvl_head >= 0`` outside its own column), and the rows received from each global
    rank and node (``recv_gbl_rank_prefix_sum``, ``recv_rdma_rank_prefix_sum``).
    """
    R, L, me = num_ranks, ranks_per_node, rank
    device = ntr.device
    peers = torch.arange(R, device=device)
    if R // L == 1:
        rpm = handle[0]
        col = rpm[:, me].to(torch.int64)
        recv_from = torch.diff(col, prepend=col.new_zeros(1))
        sent_to = ntr.to(torch.int64)
        other = peers != me
        d_intra = (sent_to * other).sum()
        c_intra = (recv_from * other).sum()
        zero = d_intra * 0
        links = Links(
            dispatch_intra=d_intra,
            dispatch_inter=zero,
            combine_intra=c_intra,
            combine_inter=zero,
            sent=sent_to.sum(),
            received=col[-1],
        )
    else:
        N, node, local = R // L, me // L, me % L
        recv_rdma_sum, recv_gbl_sum, send_nvl_head = handle[4], handle[6], handle[9]
        gbl = recv_gbl_sum.to(torch.int64)
        recv_from = torch.diff(gbl, prepend=gbl.new_zeros(1))
        rdma = recv_rdma_sum.to(torch.int64)
        recv_from_node = torch.diff(rdma, prepend=rdma.new_zeros(1))
        nodes = torch.arange(N, device=device)
        heads = send_nvl_head[:, :L] >= 0
        forwards = heads.sum() - heads[:, local].sum()
        assert ntrr is not None
        links = Links(
            dispatch_intra=forwards,
            dispatch_inter=(ntrr.to(torch.int64) * (nodes != node)).sum(),
            combine_intra=(recv_from * (peers % L != local)).sum(),
            combine_inter=(recv_from_node * (nodes != node)).sum(),
            sent=ntr.to(torch.int64).sum(),
            received=gbl[-1],
        )
    if not tensors.cuda_code_path(device):
        links = Links(**{k: int(v) for k, v in links.__dict__.items()})
    return links
