"""MoELayer on R real gloo ranks equals a single-process dense per-token loop.

Checked: the output, and the gradients of the input, the router weight (summed over ranks, as a
data-parallel all-reduce would) and every expert weight — for flat and hierarchical dispatch,
dropless and worst-case, on 2 and 4 ranks. Every rank builds every rank's inputs from one seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexdispatch.config import load_config
from flexdispatch.experts import init_expert_weights
from flexdispatch.routing import TopKRouter
from tests.dist.harness import spawn_group

T = 12  # tokens per rank
SEED = 3
MODES = [
    ("flat", False),
    ("flat", True),
    ("hierarchical", False),
    ("hierarchical", True),
]


def _config(R: int, L: int, hierarchical: bool, worst: bool, activation: str):
    cfg = load_config("tiny_cpu")
    dispatch = cfg.dispatch.model_copy(
        update={
            "backend": "torch",
            "hierarchical": hierarchical,
            "ranks_per_node": L,
            "num_worst_tokens": T * R if worst else 0,
        }
    )
    return cfg.model_copy(update={"dispatch": dispatch, "activation": activation})


def _inputs(R: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(R, T, H, generator=gen)
    g = torch.randn(R, T, H, generator=gen)
    # NOTE: one rank with no tokens at all (contract point 7) when there are 4 ranks.
    return x, g


def _rank_tokens(R: int, rank: int) -> int:
    return 0 if (R == 4 and rank == 2) else T


def _worker(L: int, activation: str) -> dict:
    import torch.distributed as dist

    from flexdispatch.moe import MoELayer

    R, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for mode, worst in MODES:
        cfg = _config(R, L, mode == "hierarchical", worst, activation)
        layer = MoELayer(cfg, seed=SEED)
        x_all, g_all = _inputs(R, cfg.hidden_size)
        n = _rank_tokens(R, rank)
        x = x_all[rank, :n].clone().requires_grad_(True)
        res = layer(x)
        (res.output * g_all[rank, :n]).sum().backward()
        out[(mode, worst)] = {
            "output": res.output.detach(),
            "grad_x": x.grad,
            "grad_router": layer.router.weight.grad,
            "grad": {k: p.grad for k, p in layer.experts.named_parameters()},
            "host_syncs": layer.dispatcher.stats.host_syncs,
        }
    return out


def _mlp(x: torch.Tensor, w1, w2, w3, activation: str) -> torch.Tensor:
    h = x @ w1
    if activation == "swiglu":
        h = F.silu(h) * (x @ w3)
    elif activation == "gelu":
        h = F.gelu(h)
    return h @ w2


def _reference(R: int, activation: str) -> dict:
    cfg = _config(R, R, False, False, activation)
    E, H = cfg.router.num_experts, cfg.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        router = TopKRouter(cfg.router, H)
    ws = [
        init_expert_weights(
            g, SEED, hidden_size=H, ffn_hidden_size=cfg.ffn_hidden_size, activation=activation
        )
        for g in range(E)
    ]
    w1 = [w.w1.clone().requires_grad_(True) for w in ws]
    w2 = [w.w2.clone().requires_grad_(True) for w in ws]
    w3 = [None if w.w3 is None else w.w3.clone().requires_grad_(True) for w in ws]
    x_all, g_all = _inputs(R, H)
    xs, outs = [], []
    for r in range(R):
        x = x_all[r, : _rank_tokens(R, r)].clone().requires_grad_(True)
        routing = router(x)
        rows = []
        for t in range(x.shape[0]):  # the slow, obviously-correct loop
            y = torch.zeros(H)
            for s in range(routing.topk_idx.shape[1]):
                ex = int(routing.topk_idx[t, s])
                if ex >= 0:
                    y = y + routing.topk_probs[t, s] * _mlp(
                        x[t], w1[ex], w2[ex], w3[ex], activation
                    )
            rows.append(y)
        out = torch.stack(rows) if rows else torch.zeros(0, H)
        if rows:
            (out * g_all[r, : x.shape[0]]).sum().backward()
        xs.append(x)
        outs.append(out.detach())
    return {
        "outputs": outs,
        "grad_x": [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs],
        "grad_router": router.weight.grad,
        "w": {"w1": w1, "w2": w2, "w3": w3},
    }


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("R", "L", "activation"), [(2, 1, "swiglu"), (4, 2, "swiglu"), (4, 2, "gelu")]
)
def test_moe_layer_matches_dense_loop(R: int, L: int, activation: str) -> None:
    results = spawn_group(_worker, R, args=(L, activation), ranks_per_node=L, timeout_s=200)
    ref = _reference(R, activation)
    e = load_config("tiny_cpu").router.num_experts // R
    tol = {"atol": 2e-5, "rtol": 1e-4}
    for key in [(m, w) for m, w in MODES]:
        for r in range(R):
            got = results[r][key]
            torch.testing.assert_close(got["output"], ref["outputs"][r], **tol, msg=f"{key} r{r}")
            torch.testing.assert_close(got["grad_x"], ref["grad_x"][r], **tol, msg=f"{key} r{r}")
            for name, wref in ref["w"].items():
                if wref[0] is None:
                    assert got["grad"].get(name) is None
                    continue
                want = torch.stack([w.grad for w in wref[r * e : (r + 1) * e]])
                torch.testing.assert_close(got["grad"][name], want, **tol, msg=f"{key} {name}")
        router_grad = sum(results[r][key]["grad_router"] for r in range(R))
        torch.testing.assert_close(router_grad, ref["grad_router"], **tol, msg=f"{key} router")
        syncs = [results[r][key]["host_syncs"] for r in range(R)]
        # one dispatch per forward; backward needs none; worst-case mode needs none at all
        assert syncs == [0 if key[1] else 1] * R, (key, syncs)


def test_dropless_layer_syncs_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch's one host sync also sizes the permutation: no second sync in the layer."""
    from flexdispatch.moe import MoELayer

    cfg = _config(1, 1, False, False, "swiglu")
    layer = MoELayer(cfg, seed=SEED)
    x = torch.randn(T, cfg.hidden_size)
    want = layer(x).output  # a first call, with every lazy import done
    calls = []
    real_item = torch.Tensor.item

    def counting_item(self):
        calls.append(tuple(self.shape))
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    got = layer(x)
    assert calls == [], f"MoELayer forward called Tensor.item {len(calls)} time(s)"
    assert got.dispatch.num_recv_pairs == int((got.dispatch.recv_topk_idx >= 0).sum())
    torch.testing.assert_close(got.output, want)
    assert layer.dispatcher.stats.host_syncs == 2  # one per dispatch, two forwards


# ------------------------------------------------------- MLP variants and shared experts

VARIANTS = {
    # Qwen2-MoE-like: two shared experts fused (F = 2 * ffn_hidden_size) behind a sigmoid gate
    "shared-gate": {"num_shared_experts": 2, "shared_expert_gate": True},
    # gpt-oss-like: clamped GLU with alpha, expert biases, router bias (+ an ungated shared MLP);
    # the small limit makes the clamps bite on these activations
    "oai-bias": {
        "activation": "swiglu_oai",
        "swiglu_limit": 0.05,
        "swiglu_alpha": 1.702,
        "expert_mlp_bias": True,
        "num_shared_experts": 1,
        "shared_expert_ffn_hidden_size": 32,
        "router": {"router_bias": True},
    },
    # Llama-4-like: top-1 sigmoid weight on the expert input, plus a gated shared expert; relu2
    "input-probs": {
        "activation": "relu2",
        "probs_on_input": True,
        "num_shared_experts": 1,
        "shared_expert_gate": True,
        "router": {"topk": 1, "num_groups": None, "group_topk": None},
    },
}


def _variant_config(R: int, worst: bool, variant: str):
    cfg = _config(R, 1, False, worst, "swiglu")
    update = dict(VARIANTS[variant])
    router_update = update.pop("router", {})
    router = cfg.router.model_copy(update=router_update)
    # NOTE: validated again (model_copy does not run the validators).
    return type(cfg).model_validate({**cfg.model_dump(), **update, "router": router.model_dump()})


def _variant_worker(variant: str) -> dict:
    import torch.distributed as dist

    from flexdispatch.moe import MoELayer

    R, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for worst in (False, True):
        cfg = _variant_config(R, worst, variant)
        layer = MoELayer(cfg, seed=SEED)
        with torch.no_grad():  # a non-zero router bias, the same on every rank
            if layer.router.bias is not None:
                layer.router.bias.copy_(torch.linspace(-0.05, 0.05, cfg.router.num_experts))
        x_all, g_all = _inputs(R, cfg.hidden_size)
        x = x_all[rank].clone().requires_grad_(True)
        res = layer(x)
        (res.output * g_all[rank]).sum().backward()
        out[worst] = {
            "output": res.output.detach(),
            "grad_x": x.grad,
            "router": {k: p.grad for k, p in layer.router.named_parameters()},
            "experts": {k: p.grad for k, p in layer.experts.named_parameters()},
            "shared": {k: p.grad for k, p in layer.shared_experts.named_parameters()},
        }
    return out


def _variant_reference(R: int, variant: str) -> dict:
    from flexdispatch.experts import SharedExperts
    from flexdispatch.reference import dense_moe_reference

    cfg = _variant_config(R, False, variant)
    E, H = cfg.router.num_experts, cfg.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        router = TopKRouter(cfg.router, H)
    with torch.no_grad():
        if router.bias is not None:
            router.bias.copy_(torch.linspace(-0.05, 0.05, E))
    ws = [
        init_expert_weights(
            g,
            SEED,
            hidden_size=H,
            ffn_hidden_size=cfg.ffn_hidden_size,
            activation=cfg.activation,
            bias=cfg.expert_mlp_bias,
        )
        for g in range(E)
    ]
    experts = {
        name: None
        if getattr(ws[0], name) is None
        else torch.stack([getattr(w, name) for w in ws]).requires_grad_(True)
        for name in ("w1", "w2", "w3", "b1", "b2", "b3")
    }
    fs = cfg.shared_expert_ffn_hidden_size or cfg.num_shared_experts * cfg.ffn_hidden_size
    shared = SharedExperts(
        H,
        fs,
        activation=cfg.activation,
        swiglu_limit=cfg.swiglu_limit,
        swiglu_alpha=cfg.swiglu_alpha,
        gate=cfg.shared_expert_gate,
    )
    shared.reset_parameters_from_seed(SEED, E)
    sp = dict(shared.named_parameters())
    x_all, g_all = _inputs(R, H)
    x_all = x_all.clone().requires_grad_(True)
    outs = []
    for r in range(R):
        routing = router(x_all[r])
        y = dense_moe_reference(
            x_all[r],
            routing.topk_idx,
            routing.topk_probs,
            experts["w1"],
            experts["w2"],
            experts["w3"],
            cfg.activation,
            b1=experts["b1"],
            b2=experts["b2"],
            b3=experts["b3"],
            swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha,
            probs_on_input=cfg.probs_on_input,
            shared_w1=sp["w1"],
            shared_w2=sp["w2"],
            shared_w3=sp.get("w3"),
            shared_gate_weight=sp.get("gate_weight"),
        )
        (y * g_all[r]).sum().backward()
        outs.append(y.detach())
    return {
        "outputs": outs,
        "grad_x": x_all.grad,
        "router": {k: p.grad for k, p in router.named_parameters()},
        "experts": {k: None if v is None else v.grad for k, v in experts.items()},
        "shared": {k: p.grad for k, p in sp.items()},
    }


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_layer_variants_and_shared_experts_match_reference(variant: str) -> None:
    """Shared experts (+ sigmoid gate), clamped/biased experts, router bias and input-side probs
    on 2 gloo ranks, dropless and worst-case: output and every gradient equal the dense
    single-process reference's (replicated parameters: the sum over ranks)."""
    R = 2
    results = spawn_group(_variant_worker, R, args=(variant,), timeout_s=200)
    ref = _variant_reference(R, variant)
    e = ref["experts"]["w1"].shape[0] // R
    tol = {"atol": 2e-5, "rtol": 1e-4}
    for worst in (False, True):
        for r in range(R):
            got = results[r][worst]
            msg = f"{variant} worst={worst} r{r}"
            torch.testing.assert_close(got["output"], ref["outputs"][r], **tol, msg=msg)
            torch.testing.assert_close(got["grad_x"], ref["grad_x"][r], **tol, msg=msg)
            for name, want in ref["experts"].items():
                if want is None:
                    assert got["experts"].get(name) is None, (msg, name)
                    continue
                want_r = want[r * e : (r + 1) * e]
                torch.testing.assert_close(got["experts"][name], want_r, **tol, msg=msg + name)
        for group in ("router", "shared"):
            assert set(results[0][worst][group]) == set(ref[group]), group
            for name, want in ref[group].items():
                summed = sum(results[r][worst][group][name] for r in range(R))
                torch.testing.assert_close(summed, want, **tol, msg=f"{variant} {group}.{name}")
