"""The torch backend on CUDA: worst-case mode is capturable in a CUDA graph.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · k top-k · W worst-case
rows.

Skipped without CUDA. Each test runs in a spawned process with an NCCL group of world size 1, so
nothing leaks into the pytest process:

- a dispatch -> experts -> combine step in worst-case mode is captured in a CUDA graph, replayed
  on new inputs copied into the static tensors, and equals the eager result bit for bit: as a
  world of one runs it (no collective), and with the backend's collective paths forced on
  (``TorchA2ABackend.distributed``: NCCL's all-to-alls of one rank inside the graph, the paths of
  R ranks without needing two GPUs).

That it never syncs is checked in ``test_no_host_sync.py`` with a detector that sees every wait
(``torch.cuda.set_sync_debug_mode`` does not see the dropless path's event synchronize).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

T, H, E, K = 64, 256, 8, 2


def _inputs(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    idx[::5, 1] = -1
    probs = torch.rand(T, K, generator=g).masked_fill(idx < 0, 0.0)
    return x.to(device), idx.to(device), probs.to(device)


def _step(d: Any, x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    res = d.dispatch(x, idx, probs)
    y = res.recv_x * (1 + res.recv_topk_probs.sum(1, keepdim=True)).to(res.recv_x.dtype)
    return d.combine(y, res.handle)


def graph_worker(collectives: bool) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    d = FlexDispatcher(
        DispatchConfig(backend="torch", num_worst_tokens=T, cuda_graph=True), num_experts=E
    )
    d.backend.distributed = collectives  # NOTE: a group of one: the paths of R ranks if True
    x, idx, probs = (t.clone() for t in _inputs(0, dev))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # NOTE: warm-up (NCCL communicator, allocator) off capture
        for _ in range(2):
            _step(d, x, idx, probs)
    torch.cuda.current_stream().wait_stream(side)
    syncs = d.stats.host_syncs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(d, x, idx, probs)
    results = {}
    for seed in (1, 2):
        nx, nidx, nprobs = _inputs(seed, dev)
        x.copy_(nx)
        idx.copy_(nidx)
        probs.copy_(nprobs)
        graph.replay()
        torch.cuda.synchronize()
        eager = _step(d, nx, nidx, nprobs)
        results[seed] = bool(torch.equal(out, eager))
    d.check_overflow()
    return {"equal": results, "syncs_moved": d.stats.host_syncs - syncs}


def _run(fn: Any, *args: Any) -> Any:
    from flexdispatch.launch import spawn_group

    return spawn_group(fn, 1, args=args, backend="nccl", timeout_s=240)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collectives", [False, True], ids=["world of one", "collectives forced"])
def test_worst_case_step_captured_in_a_cuda_graph_equals_eager(collectives: bool) -> None:
    got = _run(graph_worker, collectives)
    assert got["equal"] == {1: True, 2: True}, got
    assert got["syncs_moved"] == 0
