"""Worker for test_torchrun.py: launched by ``torchrun`` (2 nodes x 2 ranks on one machine).

Initialises gloo from the launcher's environment, builds a hierarchical ``FlexDispatcher`` without
``ranks_per_node`` (so L must come from ``LOCAL_WORLD_SIZE``), runs one dispatch/combine round trip
against the slow reference and prints one line per rank:
``FLEXDISPATCH_OK rank=<r> nodes=<N> ranks_per_node=<L> source=<where L came from>``.

Shape letters: T tokens · H hidden · E experts · R ranks · k top-k · L ranks per node · N nodes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from flexdispatch import DispatchConfig, FlexDispatcher
from tests.dist.reference import all_inputs, expert_fn, ref_combine, ref_dispatch

E, K, H = 8, 3, 8


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, R = dist.get_rank(), dist.get_world_size()
    try:
        d = FlexDispatcher(DispatchConfig(hierarchical=True), num_experts=E)
        inputs = all_inputs(11, R=R, E=E, k=K, H=H)
        mine = inputs[rank]
        ref = ref_dispatch(inputs, rank, E)
        res = d.dispatch(mine.x, mine.idx, mine.probs)
        if not (torch.equal(res.recv_x, ref.x) and torch.equal(res.recv_topk_idx, ref.idx)):
            raise SystemExit(f"rank {rank}: dispatch differs from the reference")
        out = d.combine(expert_fn(res.recv_x, res.recv_topk_probs, rank), res.handle)
        torch.testing.assert_close(out, ref_combine(mine, E, R), rtol=1e-6, atol=0)
        print(
            f"FLEXDISPATCH_OK rank={rank} nodes={d.num_nodes} ranks_per_node={d.ranks_per_node} "
            f"source={d.ranks_per_node_source} inter_bytes={d.stats.bytes_sent_inter_node}",
            flush=True,
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
