"""The custom ops on 2 real gloo ranks: the deepep backend (DeepEP's Python layer over the
emulator) gives through the ops what it gives through the autograd Functions.

T tokens per rank · H hidden · E experts · k top-k · R ranks · W worst-case rows.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.dist.harness import run_group


def _deepep_worker(rank: int, R: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher, ops
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
    return out


def test_deepep_backend_through_the_ops_on_two_ranks() -> None:
    for got in run_group(_deepep_worker, 2):
        assert got["backend"] == "deepep"
        for W in (0, 16):
            assert all(got[f"equal_{W}"]), got
            assert got[f"state_{W}_True"] == "Tensor" and got[f"state_{W}_False"] != "Tensor"
