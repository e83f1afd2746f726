"""The fused Triton routing kernel (``topk_routing(impl="triton")``) against the torch path, plus
the tie rule both paths follow, the ``impl`` switch and its errors.

On the ``device`` fixture: CPU tensors under Triton's interpreter (``tests/unit/conftest.py``
sets ``TRITON_INTERPRET=1`` before triton is imported), or CUDA tensors and compiled kernels with
``FLEXDISPATCH_TEST_DEVICE=cuda``. The interpreter runs each kernel program in Python, so the
shapes stay small; every score function, group rule, bias, scaling and renormalisation setting, k
up to 32 and E up to 512 are covered. ``test_kernels_compile.py`` compiles the kernels for sm_90.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexdispatch.routing import TopKRouter, topk_routing
from flexdispatch.routing import topk as topk_mod

pytest.importorskip("triton", reason="the kernel tests need triton (scripts/setup.sh installs it)")


# (E, k, score_function, pre, groups (G, kept, rule) or None, bias, normalize_topk, scaling, dtype)
CONFIGS = [
    (64, 8, "softmax", False, None, False, None, None, torch.float32),  # Qwen3-like
    (8, 2, "softmax", False, None, False, False, None, torch.float32),  # Mixtral, no renorm
    (160, 6, "softmax", True, (8, 3, "max"), False, None, 16.0, torch.float32),  # DeepSeek-V2
    (64, 4, "softmax", True, (4, 2, "sum_topk"), False, True, None, torch.bfloat16),
    (256, 8, "sigmoid", False, (8, 4, "sum_topk"), True, None, 2.5, torch.float32),  # V3
    (32, 1, "sigmoid", False, None, True, None, None, torch.float32),  # k = 1: no renorm
    (48, 6, "sqrtsoftplus", False, (6, 3, "max"), True, False, 1.5, torch.float16),
    (512, 32, "sqrtsoftplus", False, (16, 8, "sum_topk"), False, True, None, torch.float32),
    (32, 4, "sigmoid", False, (8, 2, "sum_topk"), False, False, None, torch.float32),
    (16, 16, "softmax", False, None, False, None, 3.0, torch.float32),  # k = E
]


def _kwargs(E, k, fn, pre, groups, bias, normalize, scaling, *, seed=0):
    kw = {
        "topk": k,
        "score_function": fn,
        "use_pre_softmax": pre,
        "normalize_topk": normalize,
        "scaling_factor": scaling,
    }
    if groups is not None:
        kw.update(num_groups=groups[0], group_topk=groups[1], group_score=groups[2])
    if bias:
        kw["expert_bias"] = torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 0.05
    return kw


def _both(logits, dev, grad_seed=1, **kw):
    """Forward and backward of both paths on ``dev``: ``{impl: (idx, probs, logits.grad)}`` on
    the CPU."""
    out = {}
    if kw.get("expert_bias") is not None:
        kw["expert_bias"] = kw["expert_bias"].to(dev)
    for impl in ("torch", "triton"):
        x = logits.detach().to(dev).requires_grad_(True)
        res = topk_routing(x, impl=impl, checks=False, **kw)
        g = torch.randn(res.topk_probs.shape, generator=torch.Generator().manual_seed(grad_seed))
        (res.topk_probs * g.to(dev)).sum().backward()
        out[impl] = (res.topk_idx.cpu(), res.topk_probs.detach().cpu(), x.grad.cpu())
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[2]}-E{c[0]}-k{c[1]}")
def test_same_experts_probs_and_gradients_as_the_torch_path(cfg, dev):
    E, k, fn, pre, groups, bias, normalize, scaling, dtype = cfg
    T = 8 if E >= 256 else 19
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E + k)).to(dtype)
    kw = _kwargs(E, k, fn, pre, groups, bias, normalize, scaling)
    out = _both(logits, dev, **kw)
    (i_t, p_t, g_t), (i_k, p_k, g_k) = out["torch"], out["triton"]
    assert i_k.dtype == torch.int64 and p_k.dtype == torch.float32 and i_k.shape == (T, k)
    assert torch.equal(i_k, i_t)
    scale = 1.0 if scaling is None else scaling
    torch.testing.assert_close(p_k, p_t, rtol=2e-6, atol=2e-7 * scale)
    assert g_k.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(g_k, g_t, rtol=2e-5, atol=1e-6 * scale)
    else:
        torch.testing.assert_close(g_k.float(), g_t.float(), rtol=1e-2, atol=1e-3 * scale)


def test_capacity_dropping_runs_after_the_kernel(dev):
    logits = torch.randn(24, 16, generator=torch.Generator().manual_seed(3)).to(dev)
    kw = {"topk": 4, "score_function": "sigmoid", "capacity_factor": 0.5, "checks": False}
    for policy in ("position", "probs"):
        a = topk_routing(logits, impl="torch", drop_policy=policy, **kw)
        b = topk_routing(logits, impl="triton", drop_policy=policy, **kw)
        assert int(a.num_dropped) > 0
        assert torch.equal(a.topk_idx, b.topk_idx)
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
        assert torch.equal(a.num_dropped, b.num_dropped)
        torch.testing.assert_close(a.topk_probs, b.topk_probs, rtol=2e-6, atol=2e-7)


# ----------------------------------------------------------------------------- the tie rule


def _rule_order(sel: list[float]) -> list[int]:
    """Experts by descending score, NaN first, equal scores by the lower id."""
    return sorted(range(len(sel)), key=lambda e: (not math.isnan(sel[e]), -sel[e], e))


def _ref_idx(sel_TE: torch.Tensor, k: int, groups: tuple[int, int, str] | None) -> torch.Tensor:
    """The tie rule written out per token (group scores added in fp32, largest first)."""
    out = []
    for row in sel_TE.tolist():
        eligible = list(range(len(row)))
        if groups is not None:
            G, kept, rule = groups
            X = len(row) // G
            n = k // kept if rule == "sum_topk" else 1
            gscore = []
            for g in range(G):
                group = row[g * X : (g + 1) * X]
                vals = [group[x] for x in _rule_order(group)[:n]]
                acc = np.float32(vals[0] + 0.0)  # NOTE: +0.0: -0.0 counts as 0.0
                for v in vals[1:]:
                    acc = np.float32(acc + np.float32(v))
                gscore.append(float(acc))
            keep = set(_rule_order(gscore)[:kept])
            eligible = [e for e in eligible if e // X in keep]
        order = _rule_order([row[e] for e in eligible])
        out.append([eligible[i] for i in order[:k]])
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize(
    ("fn", "pre", "groups", "bias"),
    [
        ("softmax", False, None, False),
        ("softmax", True, (4, 2, "sum_topk"), False),
        ("sigmoid", False, (4, 2, "sum_topk"), True),
        ("sqrtsoftplus", False, (4, 1, "max"), False),
    ],
)
def test_ties_lower_expert_id_first_on_both_paths(fn, pre, groups, bias, dev):
    """Integer logits in a small range tie everywhere: inside the top-k, across the k-th place
    and between whole groups (rows built from one group repeated)."""
    gen = torch.Generator().manual_seed(7)
    E, k, T = 16, 4, 12
    logits = torch.randint(-2, 3, (T, E), generator=gen).float()
    logits[: T // 2] = logits[: T // 2, :4].repeat(1, 4)  # four equal groups
    logits[:2] = 0.0
    logits[1, ::2] = -0.0  # -0.0 ties with 0.0
    kw = {"topk": k, "score_function": fn, "use_pre_softmax": pre, "checks": False}
    if groups is not None:
        kw.update(num_groups=groups[0], group_topk=groups[1], group_score=groups[2])
    bias_E = None
    if bias:
        bias_E = torch.tensor([0.0, 0.5] * (E // 2))
        kw["expert_bias"] = bias_E
    a = topk_routing(logits.to(dev), impl="torch", **kw)
    kw["expert_bias"] = None if bias_E is None else bias_E.to(dev)
    b = topk_routing(logits.to(dev), impl="triton", **kw)
    x = logits.float()
    if fn == "softmax":
        sel = torch.softmax(x, -1) if pre else x
    else:
        s = torch.sigmoid(x) if fn == "sigmoid" else torch.nn.functional.softplus(x).sqrt()
        sel = s if bias_E is None else s + bias_E
    want = _ref_idx(sel, k, groups)
    assert a.topk_idx.is_contiguous() and a.topk_probs.is_contiguous()
    assert torch.equal(a.topk_idx.cpu(), want)
    assert torch.equal(b.topk_idx.cpu(), want)
    torch.testing.assert_close(a.topk_probs, b.topk_probs, rtol=2e-6, atol=2e-7)


@pytest.mark.filterwarnings("ignore:.*(invalid value|All-NaN):RuntimeWarning")
def test_nan_ranks_first_and_inf_last_as_the_torch_path_defines(dev):
    gen = torch.Generator().manual_seed(11)
    E, k, T = 32, 4, 10
    logits = torch.randn(T, E, generator=gen)
    logits[0, [3, 9]] = float("nan")
    logits[1, :] = float("-inf")
    logits[1, [5, 6]] = 1.0
    logits[2, 20:] = float("nan")
    logits[3, 1:] = float("-inf")
    logits[4, 7] = float("inf")
    logits = logits.to(dev)
    for kw in (
        {"score_function": "softmax"},
        {"score_function": "sigmoid", "expert_bias": torch.zeros(E, device=dev)},
        {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2},
        {"score_function": "softmax", "use_pre_softmax": True, "num_groups": 8, "group_topk": 2},
    ):
        a = topk_routing(logits, topk=k, impl="torch", checks=False, **kw)
        b = topk_routing(logits, topk=k, impl="triton", checks=False, **kw)
        assert torch.equal(a.topk_idx, b.topk_idx), kw
        assert a.topk_idx[0, :2].tolist() == [3, 9] or "num_groups" in kw
        torch.testing.assert_close(a.topk_probs, b.topk_probs, equal_nan=True, rtol=2e-6, atol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_keyed_topk_of_the_device_path_follows_the_tie_rule(masked):
    """The torch path off the CPU ranks integer keys (no host read); run here on CPU tensors."""
    gen = torch.Generator().manual_seed(5)
    sel = torch.randint(-3, 4, (40, 24), generator=gen).float() / 2
    sel[0] = 0.0
    sel[1, ::3] = -0.0
    sel[2, [4, 8]] = float("nan")
    sel[3, 10:] = float("-inf")
    mask = torch.rand(40, 24, generator=gen) < 0.6 if masked else None
    if mask is not None:
        mask[:, :6] = True  # at least k eligible
        mask[3] = torch.arange(24) >= 6  # eligible -inf experts beat ineligible finite ones
    for dtype in (torch.float32, torch.float64):
        vals, idx = topk_mod._topk_keyed(sel.to(dtype), 6, mask)
        want = []
        for t, row in enumerate(sel.tolist()):
            ok = [e for e in range(24) if mask is None or bool(mask[t, e])]
            want.append([ok[i] for i in _rule_order([row[e] for e in ok])[:6]])
        assert idx.tolist() == want, dtype
        want_vals = sel.to(dtype).gather(1, idx)
        torch.testing.assert_close(vals, want_vals, equal_nan=True, rtol=0, atol=0)
    if not masked:
        assert torch.equal(topk_mod._topk_cpu(sel, 6)[1], topk_mod._topk_keyed(sel, 6)[1])


# ----------------------------------------------------------------------------- the switch


def test_auto_is_torch_on_cpu(monkeypatch):
    import flexdispatch.kernels.routing as kr

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU under impl='auto'")

    monkeypatch.setattr(kr, "route", refuse)
    res = topk_routing(torch.randn(5, 8), topk=2)
    assert res.topk_idx.shape == (5, 2)


def test_impl_errors(monkeypatch):
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="impl must be one of auto, torch, triton"):
        topk_routing(logits, topk=2, impl="cuda")
    with pytest.raises(ValueError, match="float64"):
        topk_routing(logits.double(), topk=2, impl="triton")
    assert topk_routing(logits.double(), topk=2, impl="auto").topk_probs.dtype == torch.float64
    import flexdispatch.kernels._triton as kt

    monkeypatch.setattr(kt, "_INTERPRETING", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        topk_routing(logits, topk=2, impl="triton")

    monkeypatch.setattr(kt, "_STATUS", (False, "triton is not importable (ImportError: nope)"))
    with pytest.raises(ValueError, match="install triton"):
        topk_routing(logits, topk=2, impl="triton")


def test_router_passes_impl_through(dev):
    from flexdispatch.config import RouterConfig

    base = {
        "num_experts": 16,
        "topk": 4,
        "score_function": "sigmoid",
        "num_groups": 4,
        "group_topk": 2,
        "enable_expert_bias": True,
        "aux_loss_type": "aux_loss",
        "aux_loss_coeff": 1e-2,
        "z_loss_coeff": 1e-3,
    }
    assert RouterConfig(**base).impl == "auto"
    with pytest.raises(ValueError, match="impl"):
        RouterConfig(**base, impl="cuda")
    grads, outs = [], []
    for impl in ("torch", "triton"):
        torch.manual_seed(0)
        router = TopKRouter(RouterConfig(**base, impl=impl), 32).to(dev)
        router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 16))
        h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2)).to(dev)
        res = router(h)
        (res.topk_probs * torch.arange(4.0, device=dev)).sum().backward()
        outs.append(res)
        grads.append(router.weight.grad)
    assert torch.equal(outs[0].topk_idx, outs[1].topk_idx)
    torch.testing.assert_close(outs[0].topk_probs, outs[1].topk_probs, rtol=2e-6, atol=2e-7)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-5, atol=1e-7)
