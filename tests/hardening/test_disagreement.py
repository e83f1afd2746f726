"""Ranks that disagree are reported on every rank, by name — never a hang, never garbage.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · N = R / L nodes · W worst-case rows.

One spawned gloo group (R = 4 as 2 nodes x 2) runs every scenario in turn: one rank builds its
dispatcher or layer with another config (``num_worst_tokens``, ``hierarchical``, ``backend``,
``num_experts``, ``ranks_per_node`` set or taken from ``LOCAL_WORLD_SIZE``, the router's
``topk``, ``hidden_size``, ``seed``, ``dtype``), or dispatches rows of another hidden size, top-k
or dtype (in all four modes, and through the DeepEP adapter on the emulator). Every rank must
raise ``ValueError`` with the same message naming the field and each rank's value. Because every
rank raises at the same point, the group stays in step: the worker ends with a correct dispatch
and combine, checked against the per-token reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import all_inputs, expert_fn, ref_combine, ref_dispatch

R, L, K, H, E = 4, 2, 2, 4, 8
ODD = 2  # the rank that disagrees
FP = (
    "FlexDispatcher configs differ across ranks (every rank must build the dispatcher with the "
    "same DispatchConfig, num_experts and ranks_per_node): "
)
MOE = (
    "MoELayer configs differ across ranks (every rank must build the layer from the same "
    "MoEConfig, seed and dtype): "
)
SHAPES = ": every rank must dispatch rows of the same shape and dtype"
MODES = [(False, 0), (False, 16), (True, 0), (True, 16)]  # (hierarchical, W)


def _per_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values))


def _odd(rank: int, usual: Any, odd: Any) -> Any:
    return odd if rank == ODD else usual


def _values(usual: Any, odd: Any) -> list[Any]:
    return [_odd(r, usual, odd) for r in range(R)]


def _dispatcher(**cfg: Any) -> Any:
    from flexdispatch import DispatchConfig, FlexDispatcher

    num_experts = cfg.pop("num_experts", E)
    cfg.setdefault("backend", "torch")
    return FlexDispatcher(DispatchConfig(**cfg), num_experts=num_experts)


def _emulated_deepep() -> Any:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.load import load_deep_ep

    emu = load_deep_ep(nvl_peers=L)  # 2 emulated nodes of 2 ranks
    # NOTE: the deepep backend checks agreement only with checks on: its default path issues no
    # collective beyond DeepEP's own (docs/deepep.md)
    return FlexDispatcher(
        DispatchConfig(backend="deepep", ranks_per_node=L, checks=True),
        num_experts=E,
        _deep_ep=emu,
    )


def _layer(rank: int, field: str, odd: Any) -> Any:
    from flexdispatch import MoEConfig, MoELayer, RouterConfig

    router = {"num_experts": E, "topk": K}
    sizes = {"hidden_size": H, "ffn_hidden_size": 6}
    kw: dict[str, Any] = {"seed": 0, "dtype": torch.float32}
    if field in router:
        router[field] = _odd(rank, router[field], odd)
    elif field in sizes:
        sizes[field] = _odd(rank, sizes[field], odd)
    else:
        kw[field] = _odd(rank, kw[field], odd)
    cfg = MoEConfig(router=RouterConfig(**router), dispatch={"backend": "torch"}, **sizes)
    return MoELayer(cfg, **kw)


def _local_world_size(rank: int) -> Any:
    old = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = _odd(rank, old, "4")
    try:
        return _dispatcher()
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = old


def _dispatch_rows(rank: int, what: str, hier: bool, W: int) -> Any:
    d = _dispatcher(hierarchical=hier, num_worst_tokens=W, ranks_per_node=L)
    Hr = _odd(rank, H, H + 2) if what == "hidden" else H
    k = _odd(rank, K, K + 1) if what == "topk" else K
    dtype = _odd(rank, torch.float32, torch.bfloat16) if what == "dtype" else torch.float32
    x = torch.randn(3, Hr).to(dtype)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(3)])
    return d.dispatch(x, idx, torch.rand(3, k))


def _dispatch_emulated(rank: int) -> Any:
    d = _emulated_deepep()
    x = torch.randn(3, _odd(rank, H, H + 4))
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(3)])
    return d.dispatch(x, idx, torch.rand(3, K))


# name -> (what every rank runs, the message every rank must raise)
SCENARIOS: dict[str, tuple[Callable[[int], Any], str]] = {
    "num_worst_tokens": (
        lambda r: _dispatcher(num_worst_tokens=_odd(r, 0, 8)),
        FP + "num_worst_tokens: " + _per_rank(_values(0, 8)),
    ),
    "hierarchical": (
        lambda r: _dispatcher(hierarchical=_odd(r, False, True)),
        FP + "hierarchical: " + _per_rank(_values(False, True)),
    ),
    "checks": (
        lambda r: _dispatcher(checks=_odd(r, False, True)),
        FP + "checks: " + _per_rank(_values(False, True)),
    ),
    "num_experts": (
        lambda r: _dispatcher(num_experts=_odd(r, E, 12)),
        FP + "num_experts: " + _per_rank(_values(E, 12)),
    ),
    "backend": (
        lambda r: _dispatcher(backend=_odd(r, "torch", "auto")),
        FP + "backend: " + _per_rank(_values("torch", "auto")),
    ),
    "ranks_per_node": (
        lambda r: _dispatcher(ranks_per_node=_odd(r, None, 1)),
        FP
        + "ranks_per_node: "
        + _per_rank(_values(None, 1))
        + "; ranks_per_node (resolved): "
        + _per_rank(_values(L, 1)),
    ),
    "LOCAL_WORLD_SIZE": (
        _local_world_size,
        FP + "ranks_per_node (resolved): " + _per_rank(_values(L, 4)),
    ),
    "two-fields": (
        lambda r: _dispatcher(num_worst_tokens=_odd(r, 0, 8), hierarchical=_odd(r, False, True)),
        FP
        + "num_worst_tokens: "
        + _per_rank(_values(0, 8))
        + "; hierarchical: "
        + _per_rank(_values(False, True)),
    ),
    "layer-topk": (
        lambda r: _layer(r, "topk", 3),
        MOE + "router.topk: " + _per_rank(_values(K, 3)),
    ),
    "layer-hidden_size": (
        lambda r: _layer(r, "hidden_size", 8),
        MOE + "hidden_size: " + _per_rank(_values(H, 8)),
    ),
    "layer-ffn_hidden_size": (
        lambda r: _layer(r, "ffn_hidden_size", 7),
        MOE + "ffn_hidden_size: " + _per_rank(_values(6, 7)),
    ),
    "layer-seed": (lambda r: _layer(r, "seed", 1), MOE + "seed: " + _per_rank(_values(0, 1))),
    "layer-dtype": (
        lambda r: _layer(r, "dtype", torch.bfloat16),
        MOE + "dtype: " + _per_rank(_values("torch.float32", "torch.bfloat16")),
    ),
    "layer-num_experts": (
        lambda r: _layer(r, "num_experts", 12),
        FP + "num_experts: " + _per_rank(_values(E, 12)),
    ),
    "deepep-emulated-hidden": (
        _dispatch_emulated,
        "ranks disagree on the hidden size H (x.shape[1]): "
        + ", ".join(f"rank {r}={v}" for r, v in enumerate(_values(H, H + 4)))
        + SHAPES,
    ),
}
for _hier, _W in MODES:
    _mode = f"{'hier' if _hier else 'flat'}-{'worst' if _W else 'dropless'}"
    for _what, _label, _usual, _odd_value in (
        ("hidden", "hidden size H (x.shape[1])", H, H + 2),
        ("topk", "topk k (topk_idx.shape[1])", K, K + 1),
        ("dtype", "x dtype", "float32", "bfloat16"),
    ):
        SCENARIOS[f"dispatch-{_what}-{_mode}"] = (
            lambda r, w=_what, h=_hier, W=_W: _dispatch_rows(r, w, h, W),
            f"ranks disagree on the {_label}: "
            + ", ".join(f"rank {r}={v}" for r, v in enumerate(_values(_usual, _odd_value)))
            + SHAPES,
        )


def disagreement_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    seen: dict[str, Any] = {}
    for name, (run, _) in SCENARIOS.items():
        try:
            run(rank)
            seen[name] = ("no error", "")
        except Exception as exc:
            seen[name] = (type(exc).__name__, str(exc))
    # the group is still in step: a correct dispatch + combine in every mode
    inputs = all_inputs(11, R=world, E=E, k=K, H=H)
    mine, ref = inputs[rank], ref_dispatch(inputs, rank, E)
    checked = 0
    for hier, W in MODES:
        d = _dispatcher(hierarchical=hier, num_worst_tokens=4 * W, ranks_per_node=L)
        res = d.dispatch(mine.x, mine.idx, mine.probs)
        M = ref.x.shape[0]
        assert torch.equal(res.recv_x[:M], ref.x) and torch.equal(res.recv_topk_idx[:M], ref.idx)
        out = d.combine(expert_fn(res.recv_x, res.recv_topk_probs, rank), res.handle)
        torch.testing.assert_close(out, ref_combine(mine, E, world), rtol=1e-6, atol=0)
        checked += 1
    seen["after: correct dispatches"] = checked
    return seen


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_disagreements_are_named_on_every_rank() -> None:
    results = run_group(
        disagreement_worker, R, timeout=120, pg_timeout=60, env={"LOCAL_WORLD_SIZE": str(L)}
    )
    failures = []
    for name, (_, want) in SCENARIOS.items():
        for rank in range(R):
            got = results[rank][name]
            if got != ("ValueError", want):
                failures.append(f"{name} rank {rank}: {got!r}\n   want {want!r}")
    assert not failures, "\n".join(failures)
    assert [res["after: correct dispatches"] for res in results] == [len(MODES)] * R
    assert len(SCENARIOS) == 15 + 12
