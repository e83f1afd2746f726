"""GroupedExperts against a slow per-row reference, grouped_mm against the loop, seeded init.

N rows fed to the experts · H hidden · F expert hidden · e local experts · E experts in total.

The per-row reference comparisons run the module on the ``device`` fixture
(``FLEXDISPATCH_TEST_DEVICE``, tests/conftest.py); the fp64 reference always runs on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from flexdispatch.experts import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    GroupedExperts,
    expert_seed,
    grouped_mm_support,
    init_expert_weights,
)

H, F = 8, 16  # multiples of 8: grouped_mm-aligned for fp32, bf16 and fp16
GROUPED_OK = grouped_mm_support(torch.float32, "cpu", H, F).runs

# sizes per local expert and N (the rows of x; N > sum leaves ignored tail rows)
SIZE_CASES = [
    pytest.param([3, 0, 5, 2], 10, id="one-empty"),
    pytest.param([0, 0, 7, 0], 7, id="all-in-one"),
    pytest.param([2, 1, 0, 3], 9, id="tail-rows"),
    pytest.param([0, 0, 0, 0], 0, id="no-rows"),
    pytest.param([0, 0, 0, 0], 3, id="only-tail"),
    pytest.param([1, 1, 1, 1], 4, id="one-each"),
]


# the expert variants checked against the per-row reference: activation plus its options; the
# limits are small enough that x @ w1 and x @ w3 (|.| ~ 0.6 here) do get clamped
VARIANTS = [pytest.param({"activation": a}, id=a) for a in ACTIVATIONS if a != "swiglu_oai"] + [
    pytest.param({"activation": "swiglu_oai", "swiglu_limit": 0.4}, id="swiglu_oai"),
    pytest.param(
        {"activation": "swiglu_oai", "swiglu_limit": 0.3, "swiglu_alpha": 2.5, "bias": True},
        id="swiglu_oai-alpha-bias",
    ),
    pytest.param({"activation": "swiglu", "swiglu_limit": 0.3}, id="swiglu-limit"),
    pytest.param({"activation": "swiglu", "bias": True}, id="swiglu-bias"),
    pytest.param({"activation": "relu2", "bias": True}, id="relu2-bias"),
    pytest.param({"activation": "gelu", "probs_on_input": True}, id="gelu-probs_on_input"),
    pytest.param(
        {"activation": "swiglu", "bias": True, "probs_on_input": True},
        id="swiglu-bias-probs_on_input",
    ),
]


def _act(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor | None,
    limit: float | None = None,
    alpha: float | None = None,
) -> torch.Tensor:
    """Activations from their formulas (independent of torch.nn.functional)."""
    if limit is not None:
        a = torch.minimum(a, torch.full_like(a, limit))
        b = torch.maximum(torch.minimum(b, torch.full_like(b, limit)), torch.full_like(b, -limit))
    if name == "swiglu":
        return a * torch.sigmoid(a) * b
    if name == "swiglu_oai":
        return a / (1 + torch.exp(-(1.702 if alpha is None else alpha) * a)) * (b + 1)
    if name == "relu2":
        return a.clamp_min(0) * a.clamp_min(0)
    if name == "silu":
        return a * torch.sigmoid(a)
    if name == "gelu":
        return 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
    if name == "relu":
        return a.clamp_min(0)
    raise AssertionError(name)


def per_row_reference(x, sizes, probs, w1, w2, w3, activation, **opts):
    """Row by row: find the row's expert from the sizes, run that expert's MLP on it alone.

    ``opts``: ``swiglu_limit``, ``swiglu_alpha``, biases ``b1``/``b2``/``b3`` (``[e, .]`` or
    None) and ``probs_on_input``."""
    owner = [j for j, n in enumerate(sizes) for _ in range(n)]
    b1, b2, b3 = opts.get("b1"), opts.get("b2"), opts.get("b3")
    on_input = opts.get("probs_on_input", False)
    rows = []
    for i in range(x.shape[0]):
        if i >= len(owner):
            rows.append(torch.zeros(1, x.shape[1], dtype=x.dtype))
            continue
        j = owner[i]
        xi = x[i : i + 1]
        if probs is not None and on_input:
            xi = xi * probs[i]
        a = xi @ w1[j] + (0 if b1 is None else b1[j])
        b = None if w3 is None else xi @ w3[j] + (0 if b3 is None else b3[j])
        act = _act(activation, a, b, opts.get("swiglu_limit"), opts.get("swiglu_alpha"))
        y = act @ w2[j] + (0 if b2 is None else b2[j])
        if probs is not None and not on_input:
            y = y * probs[i]
        rows.append(y)
    return torch.cat([*rows, x.new_zeros(0, x.shape[1])])


def _module(activation="swiglu", grouped=None, dtype=torch.float32, e=4, seed=3, **opts):
    m = GroupedExperts(e, H, F, activation=activation, dtype=dtype, use_grouped_mm=grouped, **opts)
    m.reset_parameters_from_seed(seed)
    return m


def _inputs(sizes, N, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype)
    probs = torch.rand(N, generator=g)
    tpe = torch.tensor(sizes, dtype=torch.int64)
    return x, tpe, probs


def _run_and_grads(module, x, tpe, probs):
    """Forward with a random upstream gradient; returns (y, {name: grad})."""
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    y = module(x, tpe, probs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(99)).to(y.device, y.dtype)
    module.zero_grad(set_to_none=True)
    (y * g).sum().backward()
    grads = {"x": x.grad, "probs": probs.grad}
    for name, p in module.named_parameters():
        grads[name] = p.grad
    return y.detach(), grads


def _reference_and_grads(module, x, tpe, probs):
    """The per-row reference in fp64 on CPU copies of the module's weights."""
    params = {
        n: p.detach().cpu().double().requires_grad_(True) for n, p in module.named_parameters()
    }
    xd = x.detach().cpu().double().requires_grad_(True)
    pd = probs.detach().cpu().double().requires_grad_(True)
    y = per_row_reference(
        xd,
        tpe.tolist(),
        pd,
        params["w1"],
        params["w2"],
        params.get("w3"),
        module.activation,
        b1=params.get("b1"),
        b2=params.get("b2"),
        b3=params.get("b3"),
        swiglu_limit=module.swiglu_limit,
        swiglu_alpha=module.swiglu_alpha,
        probs_on_input=module.probs_on_input,
    )
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(99)).to(x.dtype).double()
    if y.requires_grad:  # False when no row reaches an expert
        (y * g).sum().backward()
    grads = {"x": xd.grad, "probs": pd.grad}
    grads.update({n: p.grad for n, p in params.items()})
    leaves = {"x": xd, "probs": pd, **params}
    # a reference that never reads a row leaves None: its true gradient is zero
    return y.detach(), {
        n: leaves[n].new_zeros(leaves[n].shape) if g is None else g for n, g in grads.items()
    }


def _paths():
    return [pytest.param(False, id="loop"), pytest.param(True, id="grouped_mm")]


def _on_device(module, device, grouped, dtype=torch.float32):
    """``module`` moved to ``device``; skips (with the reason) a forced grouped_mm path that
    ``device`` cannot run."""
    if grouped:
        support = grouped_mm_support(dtype, device, H, F)
        if not support.runs:
            pytest.skip(f"grouped_mm path on {device}: {support.reason}")
    return module.to(device)


# ------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("grouped", _paths())
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("sizes", "N"), SIZE_CASES)
def test_forward_backward_match_per_row_reference(grouped, variant, sizes, N, device):
    m = _on_device(_module(grouped=grouped, **variant), device, grouped)
    x, tpe, probs = _inputs(sizes, N)
    x, tpe, probs = x.to(device), tpe.to(device), probs.to(device)
    y, grads = _run_and_grads(m, x, tpe, probs)
    y_ref, grads_ref = _reference_and_grads(m, x, tpe, probs)
    assert y.dtype == torch.float32 and y.shape == (N, H) and y.device == device
    # NOTE: 1e-5 relies on torch's default of no TF32 in fp32 CUDA matmuls.
    torch.testing.assert_close(y.cpu().double(), y_ref, rtol=1e-5, atol=1e-5)
    gated = variant["activation"] in GATED_ACTIVATIONS
    expected = {"x", "probs", "w1", "w2"} | ({"w3"} if gated else set())
    if variant.get("bias"):
        expected |= {"b1", "b2"} | ({"b3"} if gated else set())
    assert set(grads) == expected
    for name in expected:
        assert grads[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(
            grads[name].cpu().double(), grads_ref[name], rtol=1e-5, atol=1e-5, msg=name
        )
    tail = sum(sizes)
    assert torch.equal(y[tail:], torch.zeros_like(y[tail:]))
    assert torch.equal(grads["x"][tail:], torch.zeros_like(grads["x"][tail:]))
    assert torch.equal(grads["probs"][tail:], torch.zeros_like(grads["probs"][tail:]))


@pytest.mark.parametrize("grouped", _paths())
def test_without_probs_is_unweighted(grouped):
    m = _module("gelu", grouped)
    x, tpe, _ = _inputs([2, 3, 0, 4], 11)
    y = m(x, tpe)
    ref = per_row_reference(x, [2, 3, 0, 4], None, m.w1, m.w2, m.w3, "gelu")
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", _paths())
@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_int32_sizes_and_non_contiguous_upstream_grad(grouped, layout):
    m = _module("swiglu", grouped)
    x, tpe, _ = _inputs([3, 0, 2, 1], 9)
    x.requires_grad_(True)
    y = m(x, tpe.to(torch.int32))
    g = torch.ones(1, 1).expand(9, H) if layout == "expanded" else torch.randn(H, 9).t()
    y.backward(g)  # _grouped_mm's own backward rejects both layouts
    ref_x = x.detach().clone().requires_grad_(True)
    ref = per_row_reference(ref_x, [3, 0, 2, 1], None, m.w1, m.w2, m.w3, "swiglu")
    ref.backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not GROUPED_OK, reason="torch._grouped_mm does not run on this CPU build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("sizes", "N"), SIZE_CASES)
def test_grouped_mm_equals_loop(dtype, sizes, N):
    loop, grouped = _module(grouped=False, dtype=dtype), _module(grouped=True, dtype=dtype)
    x, tpe, probs = _inputs(sizes, N, dtype=dtype)
    y_l, g_l = _run_and_grads(loop, x, tpe, probs)
    y_g, g_g = _run_and_grads(grouped, x, tpe, probs)
    assert y_g.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y_g, y_l, **tol)
    for name in g_l:
        torch.testing.assert_close(g_g[name], g_l[name], **tol, msg=name)


@pytest.mark.parametrize("grouped", _paths())
def test_bf16_close_to_fp64_reference(grouped, device):
    m = _on_device(
        _module("swiglu", grouped, dtype=torch.bfloat16), device, grouped, torch.bfloat16
    )
    x, tpe, probs = _inputs([5, 2, 0, 6], 14, dtype=torch.bfloat16)
    x, tpe, probs = x.to(device), tpe.to(device), probs.to(device)
    y, grads = _run_and_grads(m, x, tpe, probs)
    y_ref, grads_ref = _reference_and_grads(m, x, tpe, probs)
    assert y.dtype == torch.bfloat16 and y.device == device
    torch.testing.assert_close(y.cpu().double(), y_ref, rtol=3e-2, atol=3e-2)
    for name in ("x", "probs", "w1", "w2", "w3"):
        assert grads[name].dtype == (torch.float32 if name == "probs" else torch.bfloat16)
        torch.testing.assert_close(
            grads[name].cpu().double(), grads_ref[name], rtol=5e-2, atol=5e-2
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck_fp64_loop(variant):
    m = GroupedExperts(3, 4, 6, dtype=torch.float64, use_grouped_mm=False, **variant)
    m.reset_parameters_from_seed(1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(7, generator=g, dtype=torch.float64, requires_grad=True)
    tpe = torch.tensor([2, 0, 4])
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in m.named_parameters()]

    def f(x, probs, *ws):
        return functional_call(m, dict(zip(names, ws, strict=True)), (x, tpe, probs))

    assert torch.autograd.gradcheck(f, (x, probs, *params))


# ------------------------------------------------------------------------- path selection


def _count_grouped_calls(monkeypatch) -> list[int]:
    calls = [0]
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


@pytest.mark.skipif(not GROUPED_OK, reason="torch._grouped_mm does not run on this CPU build")
def test_auto_uses_grouped_mm_for_fp32_and_loop_for_fp64(monkeypatch):
    calls = _count_grouped_calls(monkeypatch)
    x, tpe, probs = _inputs([2, 2, 2, 2], 8)
    _module(grouped=None)(x, tpe, probs)
    assert calls[0] == 3  # w1, w3, w2
    m64 = _module(grouped=None, dtype=torch.float64)
    y = m64(x.double(), tpe, probs)
    assert calls[0] == 3
    ref = per_row_reference(x.double(), [2, 2, 2, 2], probs, m64.w1, m64.w2, m64.w3, "swiglu")
    torch.testing.assert_close(y, ref.detach())


def test_forced_loop_never_calls_grouped_mm(monkeypatch):
    calls = _count_grouped_calls(monkeypatch)
    x, tpe, probs = _inputs([2, 2, 2, 2], 8)
    _module(grouped=False)(x, tpe, probs)
    assert calls[0] == 0


@pytest.mark.skipif(not GROUPED_OK, reason="torch._grouped_mm does not run on this CPU build")
def test_grouped_path_reads_nothing_on_the_host(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("host sync")

    m = _module(grouped=True)
    x, tpe, probs = _inputs([3, 0, 4, 1], 9)
    x.requires_grad_(True)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    m(x, tpe, probs, checks=False).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    ("dtype", "h", "f"),
    [(torch.float64, 8, 16), (torch.bfloat16, 6, 16), (torch.float32, 8, 3)],
    ids=["fp64", "bf16-H6", "fp32-F3"],
)
def test_forced_grouped_mm_raises_when_unsupported_and_auto_falls_back(dtype, h, f):
    assert not grouped_mm_support(dtype, "cpu", h, f).runs
    x = torch.randn(5, h, dtype=dtype)
    tpe = torch.tensor([2, 3])
    forced = GroupedExperts(2, h, f, dtype=dtype, use_grouped_mm=True)
    with pytest.raises(RuntimeError, match="use_grouped_mm=True"):
        forced(x, tpe)
    auto = GroupedExperts(2, h, f, dtype=dtype, use_grouped_mm=None)
    ref = per_row_reference(x, [2, 3], None, auto.w1, auto.w2, auto.w3, "swiglu")
    torch.testing.assert_close(auto(x, tpe), ref.detach(), rtol=2e-2, atol=2e-2)


def test_grouped_mm_support_rules():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        s = grouped_mm_support(dtype, "cpu", 16, 32)
        assert s.runs == GROUPED_OK and s.host_sync_free == GROUPED_OK, s.reason
    assert grouped_mm_support(torch.float32, "cpu", 4, 4).runs == GROUPED_OK
    assert not grouped_mm_support(torch.float32, "cpu", 2, 4).runs
    assert not grouped_mm_support(torch.bfloat16, "cpu", 4, 16).runs
    s = grouped_mm_support(torch.float64, "cpu", 16, 16)
    assert not s.runs and "fp32, bf16 or fp16" in s.reason


# ------------------------------------------------------------------------- initialisation


def test_rank_shards_get_the_weights_of_the_full_model():
    E, R, seed = 6, 3, 11
    e = E // R
    full = GroupedExperts(E, H, F, activation="swiglu")
    full.reset_parameters_from_seed(seed)
    for r in range(R):
        shard = GroupedExperts(e, H, F, activation="swiglu", first_expert=r * e)
        shard.reset_parameters_from_seed(seed)
        for name in ("w1", "w2", "w3"):
            assert torch.equal(getattr(shard, name), getattr(full, name)[r * e : (r + 1) * e])
    # a per-expert draw, not one stream: experts differ from each other and across seeds
    assert not torch.equal(full.w1[0], full.w1[1])
    other = GroupedExperts(E, H, F)
    other.reset_parameters_from_seed(seed + 1)
    assert not torch.equal(other.w1, full.w1)


def test_init_expert_weights_scheme():
    g, seed = 5, 2
    ew = init_expert_weights(g, seed, hidden_size=H, ffn_hidden_size=F)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + g)
    assert expert_seed(g, seed) == seed * 1_000_003 + g
    for w, shape, fan_in in ((ew.w1, (H, F), H), (ew.w2, (F, H), F), (ew.w3, (H, F), H)):
        u = torch.rand(shape, generator=gen)
        bound = 1 / math.sqrt(fan_in)
        assert torch.equal(w, u * (2 * bound) - bound)
        assert w.abs().max() <= bound
    relu = init_expert_weights(g, seed, hidden_size=H, ffn_hidden_size=F, activation="relu")
    assert relu.w3 is None and torch.equal(relu.w1, ew.w1) and torch.equal(relu.w2, ew.w2)
    bf = init_expert_weights(g, seed, hidden_size=H, ffn_hidden_size=F, dtype=torch.bfloat16)
    assert torch.equal(bf.w2, ew.w2.to(torch.bfloat16))
    m = GroupedExperts(2, H, F, first_expert=4, dtype=torch.bfloat16)
    m.reset_parameters_from_seed(seed)
    assert torch.equal(m.w3[1], bf.w3)


def test_reset_parameters_is_deterministic():
    a = GroupedExperts(3, H, F, activation="gelu")
    b = GroupedExperts(3, H, F, activation="gelu")
    a.reset_parameters(torch.Generator().manual_seed(4))
    b.reset_parameters(torch.Generator().manual_seed(4))
    assert a.w3 is None and torch.equal(a.w1, b.w1) and torch.equal(a.w2, b.w2)
    torch.manual_seed(8)
    c = GroupedExperts(3, H, F, dtype=torch.bfloat16)
    torch.manual_seed(8)
    d = GroupedExperts(3, H, F)
    assert torch.equal(c.w1, d.w1.to(torch.bfloat16))
    assert c.w1.abs().max() <= 1 / math.sqrt(H) and d.w2.abs().max() <= 1 / math.sqrt(F)
    assert not torch.equal(d.w1, d.w3)


# ------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"num_local_experts": 0}, ValueError, "num_local_experts"),
        ({"hidden_size": -1}, ValueError, "hidden_size"),
        ({"first_expert": -2}, ValueError, "first_expert"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
        ({"use_grouped_mm": "yes"}, TypeError, "use_grouped_mm"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    args = {"num_local_experts": 2, "hidden_size": H, "ffn_hidden_size": F, **kwargs}
    with pytest.raises(error, match=match):
        GroupedExperts(
            args.pop("num_local_experts"),
            args.pop("hidden_size"),
            args.pop("ffn_hidden_size"),
            **args,
        )


def test_bad_seeds():
    with pytest.raises(ValueError, match="seed"):
        init_expert_weights(0, -1, hidden_size=H, ffn_hidden_size=F)
    with pytest.raises(ValueError, match="global_expert_id"):
        init_expert_weights(-1, 0, hidden_size=H, ffn_hidden_size=F)


@pytest.mark.parametrize("grouped", _paths())
def test_bad_forward_inputs(grouped):
    m = _module(grouped=grouped)
    x, tpe, probs = _inputs([2, 2, 2, 2], 8)
    cases = [
        ((x.tolist(), tpe), TypeError, "x must be a torch.Tensor"),
        ((x[0], tpe), ValueError, "x must be 2-D"),
        ((x.long(), tpe), TypeError, "x must be a floating-point"),
        ((torch.randn(8, H + 1), tpe), ValueError, "hidden_size"),
        ((x.double(), tpe), TypeError, "convert x"),
        ((x, tpe.float()), TypeError, "tokens_per_expert must have dtype int32 or int64"),
        ((x, tpe[None]), ValueError, "tokens_per_expert must be 1-D"),
        ((x, tpe[:3]), ValueError, "one row count per local expert"),
        ((x, tpe, probs[:5]), ValueError, "one routing weight per row"),
        ((x, tpe, probs[:, None]), ValueError, "probs must be 1-D"),
        ((x, tpe, (probs * 10).long()), TypeError, "probs must be a floating-point"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            m(*args)


@pytest.mark.parametrize("grouped", _paths())
@pytest.mark.parametrize("sizes", [[2, -1, 2, 2], [3, 3, 3, 3]], ids=["negative", "too-many"])
def test_bad_sizes_are_caught(grouped, sizes):
    m = _module(grouped=grouped)
    x, _, _ = _inputs([0, 0, 0, 0], 8)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        m(x, torch.tensor(sizes), checks=True)


def test_grouped_path_clamps_oversized_counts_without_checks():
    if not GROUPED_OK:
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    m = _module(grouped=True)
    x, _, _ = _inputs([0, 0, 0, 0], 6)
    y = m(x, torch.tensor([2, 2, 2, 9]), checks=False)  # never reads past x's 6 rows
    ref = per_row_reference(x, [2, 2, 2, 0], None, m.w1, m.w2, m.w3, "swiglu")
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
