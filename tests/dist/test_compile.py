"""The custom ops on 2 real gloo ranks: ``torch.compile(fullgraph=True)`` of a worst-case
``MoELayer`` (forward and backward, the collectives inside ``flexdispatch::dispatch`` /
``combine``) equals eager, and the deepep backend (DeepEP's Python layer over the emulator) gives
through the ops what it gives through the autograd Functions.

T tokens per rank · H hidden · E experts · k top-k · R ranks · W = R * T worst-case rows.
Compiled with ``backend="aot_eager"`` (docs/compile.md: inductor's C++ build is too slow here).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.dist.harness import run_group

T = 12


def _train_step(layer: Any, fn: Any, x0: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = fn(x)
    (out.float() * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return [out.detach(), x.grad, *[p.grad for _, p in sorted(layer.named_parameters())]]


def _compile_worker(rank: int, R: int) -> dict[str, Any]:
    from torch._dynamo.testing import CompileCounterWithBackend

    from flexdispatch.config import RouterConfig, load_config
    from flexdispatch.dispatch import ops
    from flexdispatch.moe import MoELayer

    torch._dynamo.reset()
    cfg = load_config("tiny_cpu")
    dispatch = cfg.dispatch.model_copy(update={"backend": "torch", "num_worst_tokens": R * T})
    # NOTE: a plain softmax top-2 router traces in half the time of tiny_cpu's (which the
    # world-of-one test compiles); the collectives are what this test adds
    router = RouterConfig(num_experts=cfg.router.num_experts, topk=2)
    cfg = cfg.model_copy(update={"dispatch": dispatch, "router": router})
    layer = MoELayer(cfg, seed=5, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    state = {k: v.clone() for k, v in layer.state_dict().items()}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return layer(x).output

    eager = _train_step(layer, fn, x0)
    layer.load_state_dict(state)
    counter = CompileCounterWithBackend("aot_eager")
    syncs = layer.dispatcher.stats.host_syncs
    compiled = _train_step(layer, torch.compile(fn, fullgraph=True, backend=counter), x0)
    targets = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes}
    torch._dynamo.reset()
    return {
        "frames": counter.frame_count,
        "ops": sorted(t for t in targets if t.startswith("flexdispatch.")),
        "equal": [torch.equal(a, b) for a, b in zip(eager, compiled, strict=True)],
        "syncs": layer.dispatcher.stats.host_syncs - syncs,
        "rows_received": layer.dispatcher.stats.rows_received,
        "live": ops.live_handles(),
    }


def test_compile_fullgraph_worst_case_layer_on_two_ranks() -> None:
    for rank, got in enumerate(run_group(_compile_worker, 2, timeout=240)):
        assert got["frames"] == 1, (rank, got)
        assert {"flexdispatch.dispatch", "flexdispatch.combine"} <= set(got["ops"]), got["ops"]
        assert all(got["equal"]), (rank, got["equal"])
        assert got["syncs"] == 0 and got["rows_received"] > 0 and got["live"] == 0, got


def _deepep_worker(rank: int, R: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.dispatch import ops
    from tests.deepep_emu.load import load_deep_ep
    from tests.dist.reference import all_inputs

    E, k, H = 4 * R, 2, 32
    me = all_inputs(11, R=R, E=E, k=k, H=H, dtype=torch.bfloat16)[rank]
    out: dict[str, Any] = {}
    for W in (0, 8 * R):
        cfg = DispatchConfig(backend="deepep", ranks_per_node=R, num_worst_tokens=W)
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=load_deep_ep(R))
        runs = []
        for eager_ops in (False, True):
            ops.set_eager_ops(eager_ops)
            x, p = me.x.clone().requires_grad_(), me.probs.clone().requires_grad_()
            res = d.dispatch(x, me.idx, p)
            y = res.recv_x * res.recv_topk_probs.sum(1, keepdim=True).to(res.recv_x.dtype)
            back = d.combine(y, res.handle)
            (back.float().square().sum() + res.recv_topk_probs.sum()).backward()
            runs.append([back.detach(), res.recv_x.detach(), res.recv_topk_idx, x.grad, p.grad])
            out[f"state_{W}_{eager_ops}"] = type(res.handle.state).__name__
        ops.set_eager_ops(False)
        out[f"equal_{W}"] = [torch.equal(a, b) for a, b in zip(*runs, strict=True)]
        out["backend"] = d.backend_name
        if W:  # and compiled whole (worst-case: static shapes), equal to eager

            def step(x: torch.Tensor, p: torch.Tensor, d: Any = d) -> torch.Tensor:
                res = d.dispatch(x, me.idx, p)
                y = res.recv_x * res.recv_topk_probs.sum(1, keepdim=True).to(res.recv_x.dtype)
                return d.combine(y, res.handle)

            torch._dynamo.reset()
            got = []
            for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
                x, p = me.x.clone().requires_grad_(), me.probs.clone().requires_grad_()
                back = fn(x, p)
                back.float().square().sum().backward()
                got.append([back.detach(), x.grad, p.grad])
            torch._dynamo.reset()
            out["compiled_equal"] = [torch.equal(a, b) for a, b in zip(*got, strict=True)]
    return out


def test_deepep_backend_through_the_ops_on_two_ranks() -> None:
    """Eager through the ops and not, dropless and worst-case; and a worst-case dispatch +
    combine compiled with ``fullgraph=True``: all bit-equal."""
    for got in run_group(_deepep_worker, 2):
        assert got["backend"] == "deepep"
        for W in (0, 16):
            assert all(got[f"equal_{W}"]), got
            assert got[f"state_{W}_True"] == "Tensor" and got[f"state_{W}_False"] != "Tensor"
        assert all(got["compiled_equal"]), got
