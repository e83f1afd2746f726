"""Determinism: the same inputs give bit-identical outputs and gradients, run after run and mode
after mode (CPU, gloo; see docs/determinism.md for what this does and does not say about GPUs).

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

Two separate spawned groups (R = 4 as 2 nodes x 2, one thread per rank) each run

- ``MoELayer`` (the ``tiny_cpu`` preset: sigmoid router with expert bias, node-limited groups,
  swiglu experts, aux and z losses) forward and backward in four modes — flat / hierarchical x
  dropless / worst-case — twice in a row;
- ``dispatch`` -> a non-linear expert function -> ``combine`` with gradients of ``x`` and
  ``topk_probs``, on random (non-exact) bf16 and fp32 rows, in the same four modes.

Every tensor must be bit-identical between the two groups, between the two repeats, and between
the four modes (the prefix ``[:M]`` of a worst-case dispatch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import fresh_groups, run_group
from tests.dist.reference import all_inputs

R, L, T, SEED = 4, 2, 10, 17
MODES = [("flat", False), ("flat", True), ("hier", False), ("hier", True)]


def _layer_run(rank: int, world: int, mode: str, worst: bool) -> dict[str, torch.Tensor]:
    from flexdispatch import MoELayer, load_config

    cfg = load_config("tiny_cpu")
    dispatch = cfg.dispatch.model_copy(
        update={
            "backend": "torch",
            "hierarchical": mode == "hier",
            "ranks_per_node": L,
            "num_worst_tokens": T * world if worst else 0,
        }
    )
    cfg = cfg.model_copy(update={"dispatch": dispatch})
    layer = MoELayer(cfg, seed=SEED)
    layer.router.expert_bias.copy_(torch.linspace(-0.1, 0.1, cfg.router.num_experts))
    gen = torch.Generator().manual_seed(SEED)
    x_all = torch.randn(world, T, cfg.hidden_size, generator=gen)
    g_all = torch.randn(world, T, cfg.hidden_size, generator=gen)
    x = x_all[rank].clone().requires_grad_(True)
    res = layer(x)
    (res.output * g_all[rank]).sum().backward()
    out = {
        "output": res.output.detach(),
        "grad_x": x.grad,
        "grad_router": layer.router.weight.grad,
        "aux_loss": res.aux_loss.detach(),
        "z_loss": res.z_loss.detach(),
        "expert_counts": layer.router.local_tokens_per_expert.clone(),
    }
    for name, p in layer.experts.named_parameters():
        out[f"grad_{name}"] = p.grad
    return out


def _expert(y: torch.Tensor, probs: torch.Tensor, rank: int) -> torch.Tensor:
    """A non-linear stand-in for the experts that uses every slot's prob."""
    w = (probs * torch.arange(1, probs.shape[1] + 1)).sum(1, keepdim=True)
    return (torch.tanh(y.float() * (rank + 1.3)) * (1 + w)).to(y.dtype)


def _dispatch_run(
    rank: int, world: int, mode: str, worst: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, H = 3 * world, 3, 8
    inputs = all_inputs(SEED, R=world, E=E, k=k, H=H, exact=False, dtype=dtype)
    mine = inputs[rank]
    W = 4 * world * 11 if worst else 0
    cfg = DispatchConfig(
        backend="torch", hierarchical=mode == "hier", ranks_per_node=L, num_worst_tokens=W
    )
    d = FlexDispatcher(cfg, num_experts=E)
    x = mine.x.clone().requires_grad_(True)
    p = mine.probs.clone().requires_grad_(True)
    res = d.dispatch(x, mine.idx, p)
    out = d.combine(_expert(res.recv_x, res.recv_topk_probs, rank), res.handle)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
    (out.float() * g.float()).sum().backward()
    M = int((res.recv_topk_idx >= 0).any(1).sum())
    return {
        "recv_x": res.recv_x[:M].detach(),
        "recv_idx": res.recv_topk_idx[:M],
        "recv_probs": res.recv_topk_probs[:M].detach(),
        "combined": out.detach(),
        "grad_x": x.grad,
        "grad_probs": p.grad,
    }


def determinism_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, worst in MODES:
        for repeat in (0, 1):
            out[("layer", mode, worst, repeat)] = _layer_run(rank, world, mode, worst)
        for dtype in (torch.float32, torch.bfloat16):
            out[("dispatch", mode, worst, str(dtype))] = _dispatch_run(
                rank, world, mode, worst, dtype
            )
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> None:
    assert a.keys() == b.keys(), where
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, f"{where}: {name}"
        # NOTE: bit-level equality (NaN-safe): compare the raw bytes.
        same = torch.equal(
            x.reshape(-1).contiguous().view(torch.uint8),
            y.reshape(-1).contiguous().view(torch.uint8),
        )
        assert same, f"{where}: {name} differs (max abs {(x.double() - y.double()).abs().max()})"


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_bit_identical_across_runs_repeats_and_modes() -> None:
    env = {"LOCAL_WORLD_SIZE": str(L)}
    first = run_group(determinism_worker, R, timeout=120, env=env)
    with fresh_groups():  # other processes (the first run may share the module's pooled ones)
        second = run_group(determinism_worker, R, timeout=120, env=env)
    compared = 0
    for rank in range(R):
        a, b = first[rank], second[rank]
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key], f"rank {rank} {key}: run 1 vs run 2")
            compared += 1
        for mode, worst in MODES:
            base = a[("layer", "flat", False, 0)]
            _same(base, a[("layer", mode, worst, 1)], f"rank {rank} layer {mode} worst={worst}")
            for dtype in ("torch.float32", "torch.bfloat16"):
                ref = a[("dispatch", "flat", False, dtype)]
                got = a[("dispatch", mode, worst, dtype)]
                _same(ref, got, f"rank {rank} dispatch {dtype} {mode} worst={worst}")
                compared += 1
        # the tensors are not trivially equal: every rank holds real, varied numbers
        assert a[("layer", "flat", False, 0)]["grad_x"].abs().sum() > 0
    assert compared == R * (len(MODES) * 4 + len(MODES) * 2)


def test_world_of_one_repeats_bit_identically() -> None:
    from flexdispatch import DispatchConfig, FlexDispatcher, permute, unpermute

    inp = all_inputs(3, R=1, E=6, k=2, H=5, exact=False)[0]
    outs = []
    for _ in range(2):
        d = FlexDispatcher(DispatchConfig(), num_experts=6)
        x = inp.x.clone().requires_grad_(True)
        p = inp.probs.clone().requires_grad_(True)
        res = d.dispatch(x, inp.idx, p)
        perm = permute(res.recv_x, res.recv_topk_idx, 6, topk_probs=res.recv_topk_probs, align=4)
        y = unpermute(torch.sin(perm.x) * 3.1, perm, probs=perm.probs)
        out = d.combine(y, res.handle)
        out.square().sum().backward()
        outs.append({"out": out.detach(), "gx": x.grad, "gp": p.grad, "rows": perm.x.detach()})
    _same(outs[0], outs[1], "world of one")
