"""Property tests of ``topk_routing``, forward and backward, on every path and option (issue 40).

Shape letters: T tokens · E experts · k top-k · G expert groups of X = E / G experts.

Each case draws (hypothesis, ``derandomize=True``: the same cases on every run) a routing
configuration — softmax post or pre, sigmoid, sqrtsoftplus; an expert bias (random, zero, or on a
grid); no groups, Megatron's sum-of-top or DeepSeek-V2's max group rule; ``normalize_topk``;
a scaling factor; capacity dropping by probs or by position — and logits of one kind: random,
rounded to halves or to {-1, 0, 1} (ties in nearly every row), constant rows, all zero (a
zero-initialised router), or with NaN and ±inf entries; fp32, bf16 or fp64; T from 0 to 300.
It checks the ids, probs, counts and the gradient of the logits against the fp64 reference of
``routing_reference.py`` (written from the documented rules, no code shared), on the torch path
(``device`` fixture) and on the Triton kernel (``dev`` fixture: Triton's interpreter on CPU, so
its shapes stay small). ``test_gradcheck_*`` adds finite differences in fp64
(``torch.autograd.gradcheck``) where the function is differentiable: random logits, and tied
logits whose selection is pinned (ties inside the chosen set and among the others, none at the
cut). Value checks: ``checks=True`` refuses NaN/inf logits and expert biases with the message of
docs/errors.md; without checks they are routed by the tie rule (NaN above everything) and
backward runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexdispatch.routing import topk_routing
from tests.unit.routing_cases import (
    CI,
    KINDS,
    MATRIX,
    NUMPY_WARNINGS,
    make_logits,
    routing_options,
)
from tests.unit.routing_reference import RoutingOptions, ref_topk_routing

pytest.importorskip("triton", reason="the kernel cases need triton (scripts/setup.sh installs it)")


@st.composite
def routing_cases(
    draw: st.DrawFn,
    variant: str,
    rule: str | None,
    *,
    max_T: int,
    experts: tuple[int, ...],
    dtypes: tuple,
    max_k: int = 16,
) -> tuple[torch.Tensor, RoutingOptions, str]:
    E = draw(st.sampled_from(experts))
    T = draw(st.integers(-max_T // 8, max_T).map(lambda t: max(t, 0)))
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(dtypes))
    opts = draw(routing_options(E, variant, rule, max_k=max_k))
    logits = make_logits(kind, T, E, seed=draw(st.integers(0, 2**16))).to(dtype)
    return logits, opts, kind


def check_against_reference(
    logits: torch.Tensor, opts: RoutingOptions, dev: torch.device, impl: str
) -> None:
    """Forward and backward of ``topk_routing`` on ``dev`` against the fp64 reference."""
    T, _ = logits.shape
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    kw = opts.kwargs()
    if kw["expert_bias"] is not None:
        kw["expert_bias"] = kw["expert_bias"].to(dev)
    x = logits.detach().to(dev).requires_grad_(True)
    res = topk_routing(x, checks=False, impl=impl, **kw)
    w = torch.randn(T, opts.topk, generator=torch.Generator().manual_seed(T + 7))
    (res.topk_probs * w.to(dev, res.topk_probs.dtype)).sum().backward()

    rank_probs = None
    if opts.capacity is not None and opts.capacity[1] == "probs":
        # the drop rule ranks the implementation's own probs (see ref_topk_routing)
        dropless = RoutingOptions(**{**opts.__dict__, "capacity": None}).kwargs()
        dropless["expert_bias"] = kw["expert_bias"]
        with torch.no_grad():
            rank_probs = topk_routing(x, checks=False, impl=impl, **dropless).topk_probs.cpu()
    x64 = logits.double().requires_grad_(True)
    ref = ref_topk_routing(x64, opts, work, rank_probs=rank_probs)
    (ref.probs * w.double()).sum().backward()

    assert res.topk_idx.dtype == torch.int64 and res.topk_probs.dtype == work
    assert torch.equal(res.topk_idx.cpu(), ref.idx)
    assert torch.equal(res.tokens_per_expert.cpu(), ref.tokens_per_expert)
    assert int(res.num_dropped) == ref.num_dropped
    fp64 = work == torch.float64
    tol = {"rtol": 1e-10, "atol": 1e-12} if fp64 else {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(
        res.topk_probs.detach().cpu().double(), ref.probs.detach(), equal_nan=True, **tol
    )
    # NOTE: a row holding NaN/inf has no meaningful gradient (the reference's and the
    # implementation's formulas differ there): only that backward runs and leaves the finite
    # rows exact is checked
    finite = torch.isfinite(logits.double()).all(dim=1)
    got = x.grad.cpu().double()
    assert got.shape == logits.shape
    if logits.dtype == torch.bfloat16:  # the gradient comes back in bf16
        tol = {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got[finite], x64.grad[finite], **tol)


@MATRIX
@settings(CI, max_examples=20)
@given(data=st.data())
def test_torch_path_matches_reference(variant, rule, data, device):
    logits, opts, _ = data.draw(
        routing_cases(
            variant,
            rule,
            max_T=300,
            experts=(4, 8, 16, 32, 64),
            dtypes=(torch.float32, torch.float32, torch.bfloat16, torch.float64),
        )
    )
    check_against_reference(logits, opts, device, "torch")


@NUMPY_WARNINGS
@MATRIX
@settings(CI, max_examples=6)
@given(data=st.data())
def test_triton_kernel_matches_reference(variant, rule, data, dev):
    logits, opts, _ = data.draw(
        routing_cases(
            variant,
            rule,
            max_T=24,
            experts=(4, 8, 16, 32),
            dtypes=(torch.float32, torch.bfloat16),
            max_k=8,
        )
    )
    check_against_reference(logits, opts, dev, "triton")


# ----------------------------------------------------------------------------- finite differences


def pin_selection(
    logits: torch.Tensor, opts: RoutingOptions, seed: int
) -> tuple[torch.Tensor, RoutingOptions]:
    """Tied logits (halves) whose selection is fixed with a margin: every token's selection
    scores favour one set S of k experts (inside ``group_topk`` groups, at least one expert in
    each group of S) by far more than the ties are wide. Ties stay inside S and among the
    others; none is at the cut. Softmax moves S's logits up; sigmoid and sqrtsoftplus pin S with
    the expert bias (selection only), and capacity drops by position only (probs tie across
    tokens)."""
    E = logits.shape[1]
    k = opts.topk
    g = torch.Generator().manual_seed(seed)
    if opts.groups is None:
        S = torch.randperm(E, generator=g)[:k]
        n = 1
    else:
        G, kept, rule = opts.groups
        X = E // G
        groups = torch.randperm(G, generator=g)[: min(kept, k)]
        members = (groups.unsqueeze(1) * X + torch.arange(X)).reshape(-1)
        first = groups * X + torch.randint(0, X, (len(groups),), generator=g)
        rest = members[~torch.isin(members, first)]
        S = torch.cat([first, rest[torch.randperm(len(rest), generator=g)][: k - len(first)]])
        n = k // kept if rule == "sum_topk" else 1
    capacity = opts.capacity
    if capacity is not None:
        capacity = (capacity[0], "position")
    if opts.score_function == "softmax":
        logits = logits.clone()
        logits[:, S] += 8.0 * (n + 1)
        return logits, RoutingOptions(**{**opts.__dict__, "capacity": capacity})
    bias = torch.zeros(E, dtype=logits.dtype)
    bias[S] = 4.0 * (n + 1)
    return logits, RoutingOptions(**{**opts.__dict__, "expert_bias": bias, "capacity": capacity})


@st.composite
def gradcheck_cases(
    draw: st.DrawFn, variant: str, rule: str | None
) -> tuple[torch.Tensor, RoutingOptions, str]:
    E = draw(st.sampled_from((4, 8, 16)))
    T = draw(st.integers(1, 6))
    opts = draw(routing_options(E, variant, rule, max_k=8))
    kind = draw(st.sampled_from(["random", "pinned"]))
    seed = draw(st.integers(0, 2**16))
    logits = make_logits("random" if kind == "random" else "halves", T, E, seed).double()
    if kind == "pinned":
        logits, opts = pin_selection(logits, opts, seed)
    return logits, opts, kind


@MATRIX
@settings(CI, max_examples=8)
@given(data=st.data())
def test_gradcheck_fp64(variant, rule, data, device):
    """Finite differences of the probs, laid out densely by expert (``[T, E]``, so the order of
    tied experts in the slots does not matter), against the analytic gradient, in fp64."""
    logits, opts, _ = data.draw(gradcheck_cases(variant, rule))
    check_against_reference(logits, opts, device, "torch")
    kw = opts.kwargs()
    if kw["expert_bias"] is not None:
        kw["expert_bias"] = kw["expert_bias"].to(device)

    def dense(x: torch.Tensor) -> torch.Tensor:
        res = topk_routing(x, checks=False, impl="torch", **kw)
        out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        return out.scatter_add(1, res.topk_idx.clamp(min=0), res.topk_probs)

    x = logits.to(device).requires_grad_(True)
    assert torch.autograd.gradcheck(dense, (x,), fast_mode=True)


# ----------------------------------------------------------------------------- value checks


@NUMPY_WARNINGS
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_checks_refuse_nonfinite_logits_and_bias(value, impl, dev):
    """docs/errors.md (``topk_routing/nan-logits-checked``, ``inf-logits-checked``): with
    ``checks=True`` a NaN/inf logit or expert bias raises naming the tensor and the count;
    without checks the same call routes (the tie rule puts NaN first) and backward runs."""
    logits = make_logits("halves", 6, 8, seed=5)
    logits[2, 3] = value
    logits[4, 0] = value
    with pytest.raises(ValueError, match=r"^logits holds 2 NaN/inf value\(s\): check the inputs"):
        topk_routing(logits.to(dev), topk=2, checks=True, impl=impl)
    bias = torch.zeros(8)
    bias[5] = value
    with pytest.raises(ValueError, match=r"^expert_bias holds 1 NaN/inf value\(s\)"):
        topk_routing(
            make_logits("halves", 6, 8, seed=5).to(dev),
            topk=2,
            score_function="sigmoid",
            expert_bias=bias.to(dev),
            checks=True,
            impl=impl,
        )
    for fn in ("softmax", "sigmoid"):
        opts = RoutingOptions(topk=2, score_function=fn, groups=(4, 2, "sum_topk"))
        check_against_reference(logits, opts, dev, impl)
