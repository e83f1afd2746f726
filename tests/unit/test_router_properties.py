"""Property tests of ``TopKRouter`` (learned and hash) and ``hash_routing``, forward and backward,
against the fp64 references of ``routing_reference.py`` (issue 40).

Shape letters: T tokens · H hidden · E experts · k top-k · S sequence length and B sequences of a
``[S, B, H]`` input.

A learned-router case draws (hypothesis, the same cases on every run) a routing configuration as
``test_routing_properties.py`` does, a load-balancing loss (none, per batch, per sequence,
global) with or without the z-loss, the router dtype (fp32, fp64), a gating bias, an expert bias,
a ``[T, H]`` or ``[S, B, H]`` input in fp32 or bf16 and weights of one kind: random, on a grid
(exact small logits: ties in nearly every row) or zero (a zero-initialised router: every score
tied). It checks the ids, probs, aux loss, z-loss and expert-bias counts, and the gradients of
the gating weight, the gating bias and the input after ``backward()`` of the probs (which
carries the losses' gradients through ``AuxLossAutoScaler``), against the reference's
``probs * w + scale * (aux + z)`` in fp64. Hash routing: the experts by the documented hash (or a
table), the weights and their gradient.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexdispatch.config import RouterConfig
from flexdispatch.routing import TopKRouter, gating_linear, hash_routing, topk_routing
from tests.unit.routing_cases import CI, MATRIX, NUMPY_WARNINGS, make_logits, routing_options
from tests.unit.routing_reference import (
    RoutingOptions,
    ref_aux_loss,
    ref_hash_experts,
    ref_hash_probs,
    ref_topk_routing,
    ref_z_loss,
)

pytest.importorskip("triton", reason="the kernel cases need triton (scripts/setup.sh installs it)")

AUX_TYPES = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")


def _grid(shape: tuple[int, ...], scale: float, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=g).float() * scale


@st.composite
def router_cases(
    draw: st.DrawFn, variant: str, rule: str | None, *, max_T: int, dtypes: tuple[str, ...]
) -> dict:
    E = draw(st.sampled_from((4, 8, 16, 32)))
    opts = draw(routing_options(E, variant, rule, max_k=8))
    H = draw(st.integers(1, 6))
    S, B = draw(st.integers(0, max_T)), draw(st.sampled_from([None, 1, 3]))
    aux = draw(st.sampled_from(AUX_TYPES))
    return {
        "opts": opts,
        "E": E,
        "H": H,
        "shape": (S, H) if B is None else (S, B, H),
        "weights": draw(st.sampled_from(["grid", "random", "zero"])),
        "aux": aux,
        "aux_coeff": 0.0 if aux == "none" else 0.05,
        "z_coeff": draw(st.sampled_from([0.0, 1e-2])),
        "router_dtype": draw(st.sampled_from(dtypes)),
        "router_bias": draw(st.booleans()),
        "hidden_dtype": draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
        "seed": draw(st.integers(0, 2**16)),
    }


def check_router(case: dict, dev: torch.device, impl: str) -> None:
    """One learned-router case, forward and backward, against the fp64 reference."""
    opts: RoutingOptions = case["opts"]
    E, H = case["E"], case["H"]
    g = torch.Generator().manual_seed(case["seed"])
    cfg = RouterConfig(
        num_experts=E,
        topk=opts.topk,
        score_function=opts.score_function,
        use_pre_softmax=opts.use_pre_softmax,
        num_groups=None if opts.groups is None else opts.groups[0],
        group_topk=None if opts.groups is None else opts.groups[1],
        group_score="sum_topk" if opts.groups is None else opts.groups[2],
        normalize_topk=opts.normalize_topk,
        scaling_factor=opts.scaling_factor,
        enable_expert_bias=opts.expert_bias is not None,
        capacity_factor=None if opts.capacity is None else opts.capacity[0],
        drop_policy="probs" if opts.capacity is None else opts.capacity[1],
        aux_loss_type=case["aux"],
        aux_loss_coeff=case["aux_coeff"],
        z_loss_coeff=case["z_coeff"],
        router_dtype=case["router_dtype"],
        router_bias=case["router_bias"],
        impl=impl,
    )
    router = TopKRouter(cfg, H)
    work = router.weight.dtype
    with torch.no_grad():
        if case["weights"] == "grid":  # logits are exact multiples of 1/8: ties everywhere
            router.weight.copy_(_grid((E, H), 0.25, g))
            hidden = _grid(case["shape"], 0.5, g)
        else:
            router.weight.copy_(torch.randn(E, H, generator=g) * 0.5)
            hidden = torch.randn(case["shape"], generator=g)
            if case["weights"] == "zero":
                router.weight.zero_()
        if router.bias is not None:
            router.bias.copy_(_grid((E,), 0.125, g))
        if opts.expert_bias is not None:
            router.expert_bias.copy_(opts.expert_bias)
    router.aux_loss_scale = 0.5
    router.to(dev)
    hidden = hidden.to(case["hidden_dtype"])
    h = hidden.detach().to(dev).requires_grad_(True)
    res = router(h, checks=False)
    T = res.topk_idx.shape[0]
    w = torch.randn(T, opts.topk, generator=g)
    (res.topk_probs * w.to(dev)).sum().backward()

    # fp64 reference
    h64 = hidden.double().requires_grad_(True)
    W64 = router.weight.detach().cpu().double().requires_grad_(True)
    x64 = h64.reshape(-1, H) @ W64.t()
    b64 = None
    if router.bias is not None:
        b64 = router.bias.detach().cpu().double().requires_grad_(True)
        x64 = x64 + b64
    rank_probs = None
    if opts.capacity is not None and opts.capacity[1] == "probs":
        kw = RoutingOptions(**{**opts.__dict__, "capacity": None}).kwargs()
        if kw["expert_bias"] is not None:
            kw["expert_bias"] = router.expert_bias
        with torch.no_grad():
            logits = gating_linear(h.reshape(-1, H), router.weight, work, router.bias)
            rank_probs = topk_routing(logits, checks=False, impl=impl, **kw).topk_probs.cpu()
    ref = ref_topk_routing(x64, opts, work, rank_probs=rank_probs)
    S, B = (case["shape"][0], 1) if len(case["shape"]) == 2 else case["shape"][:2]
    total = (ref.probs * w.double()).sum()
    aux = z = None
    if case["aux"] != "none":
        aux = ref_aux_loss(
            x64,
            k=opts.topk,
            fn=opts.score_function,
            loss_type=case["aux"],
            coeff=case["aux_coeff"],
            seq_length=S,
            batch_size=B,
            work=work,
        )
        total = total + 0.5 * aux
    if case["z_coeff"]:
        z = ref_z_loss(x64, case["z_coeff"])
        total = total + 0.5 * z
    total.backward()

    assert torch.equal(res.topk_idx.cpu(), ref.idx)
    assert torch.equal(res.tokens_per_expert.cpu(), ref.tokens_per_expert)
    if opts.expert_bias is not None:
        assert torch.equal(router.local_tokens_per_expert.cpu(), ref.tokens_per_expert)
    tol = {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(res.topk_probs.detach().cpu().double(), ref.probs.detach(), **tol)
    for got, want in ((res.aux_loss, aux), (res.z_loss, z)):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got.detach().cpu().double(), want.detach(), **tol)
    grad_tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(router.weight.grad.cpu().double(), W64.grad, **grad_tol)
    if b64 is not None:
        torch.testing.assert_close(router.bias.grad.cpu().double(), b64.grad, **grad_tol)
    if case["hidden_dtype"] == torch.bfloat16:  # the input's gradient comes back in bf16
        grad_tol = {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(h.grad.cpu().double(), h64.grad, **grad_tol)


@MATRIX
@settings(CI, max_examples=8)
@given(data=st.data())
def test_learned_router_matches_reference(variant, rule, data, device):
    case = router_cases(variant, rule, max_T=120, dtypes=("fp32", "fp32", "fp64"))
    check_router(data.draw(case), device, "torch")


@NUMPY_WARNINGS
@MATRIX
@settings(CI, max_examples=2)
@given(data=st.data())
def test_learned_router_on_the_triton_kernel_matches_reference(variant, rule, data, dev):
    # NOTE: the kernel takes no fp64 logits (router_dtype="fp64" with impl="triton" raises)
    case = router_cases(variant, rule, max_T=12, dtypes=("fp32",))
    check_router(data.draw(case), dev, "triton")


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_router_checks_refuse_nonfinite_input(fn, value):
    """docs/errors.md ``TopKRouter/nan-hidden-checked``: with ``checks=True`` a NaN/inf input
    raises (its logits are NaN/inf), learned and hash; without checks it routes and backward
    runs."""
    for router_type in ("learned", "hash"):
        cfg = RouterConfig(num_experts=8, topk=2, score_function=fn, router_type=router_type)
        router = TopKRouter(cfg, 4)
        hidden = torch.randn(5, 4)
        hidden[3, 1] = value
        ids = torch.arange(5)
        with pytest.raises(ValueError, match=r"^logits holds 8 NaN/inf value\(s\)"):
            router(hidden, token_ids=ids, checks=True)
        h = hidden.requires_grad_(True)
        res = router(h, token_ids=ids, checks=False)
        res.topk_probs.sum().backward()
        assert bool(torch.isfinite(res.topk_probs[[0, 1, 2, 4]]).all())
        assert bool(torch.isfinite(h.grad[[0, 1, 2, 4]]).all())


# ----------------------------------------------------------------------------- hash routing


@settings(CI, max_examples=30)
@given(
    T=st.integers(0, 300),
    E=st.sampled_from((4, 8, 16, 64)),
    k_seed=st.integers(0, 2**16),
    seed=st.sampled_from([0, 1, 2**40 + 3]),
    logits_kind=st.sampled_from([None, "halves", "random", "zero"]),
    fn=st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]),
    normalize=st.sampled_from([None, True, False]),
    scaling=st.sampled_from([None, 1.5]),
    use_table=st.booleans(),
    via_router=st.booleans(),
)
def test_hash_routing_matches_reference(
    T, E, k_seed, seed, logits_kind, fn, normalize, scaling, use_table, via_router, device
):
    """DeepSeek-V4's hash layers: experts by the documented hash of the token id (or a table),
    weights from the gate's scores at them, renormalised and scaled; forward and backward,
    directly and through ``TopKRouter(router_type="hash")``."""
    g = torch.Generator().manual_seed(k_seed)
    k = int(torch.randint(1, min(E, 8) + 1, (), generator=g))
    ids = torch.randint(0, 1000, (T,), generator=g)
    table = None
    if use_table and not via_router:
        table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(1000)])
        want_idx = table[ids]
    else:
        want_idx = torch.tensor(
            [ref_hash_experts(int(t), E, k, seed) for t in ids], dtype=torch.int64
        ).reshape(T, k)
    if via_router:
        H = 3
        cfg = RouterConfig(
            num_experts=E,
            topk=k,
            score_function=fn,
            router_type="hash",
            hash_seed=seed,
            normalize_topk=normalize,
            scaling_factor=scaling,
        )
        router = TopKRouter(cfg, H).to(device)
        if logits_kind == "zero":
            torch.nn.init.zeros_(router.weight)
        hidden = torch.randn(T, H, generator=g)
        h = hidden.detach().to(device).requires_grad_(True)
        res = router(h, token_ids=ids.to(device), checks=True)
        x64 = hidden.double().requires_grad_(True)
        logits64 = x64 @ router.weight.detach().cpu().double().t()
    else:
        logits = None if logits_kind is None else make_logits(logits_kind, T, E, k_seed)
        h = None if logits is None else logits.detach().to(device).requires_grad_(True)
        res = hash_routing(
            ids.to(device),
            num_experts=E,
            topk=k,
            seed=seed,
            logits=h,
            score_function=fn,
            normalize_topk=normalize,
            scaling_factor=scaling,
            table=None if table is None else table.to(device),
            checks=True,
        )
        x64 = None if logits is None else logits.double().requires_grad_(True)
        logits64 = x64
    want = ref_hash_probs(
        logits64, want_idx, fn=fn, normalize_topk=normalize, scaling_factor=scaling
    )
    assert torch.equal(res.topk_idx.cpu(), want_idx)
    assert torch.equal(
        res.tokens_per_expert.cpu(), torch.bincount(want_idx.reshape(-1), minlength=E)
    )
    torch.testing.assert_close(
        res.topk_probs.detach().cpu().double(), want.detach(), rtol=1e-5, atol=2e-6
    )
    if h is not None:
        w = torch.randn(T, k, generator=g)
        (res.topk_probs * w.to(device)).sum().backward()
        (want * w.double()).sum().backward()
        torch.testing.assert_close(h.grad.cpu().double(), x64.grad, rtol=1e-4, atol=1e-5)
