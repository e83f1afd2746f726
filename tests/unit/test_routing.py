"""``topk_routing`` against a slow per-token reference written here, plus properties and errors.

The reference works on Python floats (float64) one token at a time and shares no code with the
implementation. The reference comparisons run on the ``device`` fixture
(``FLEXDISPATCH_TEST_DEVICE``, tests/conftest.py); the reference itself always runs on the CPU.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexdispatch.routing import expert_capacity, topk_routing

# ----------------------------------------------------------------------------- reference


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    ex = [math.exp(x - m) for x in xs]
    s = sum(ex)
    return [v / s for v in ex]


def _score(x: float, fn: str) -> float:
    if fn == "sigmoid":
        return 1.0 / (1.0 + math.exp(-x))
    softplus = x if x > 20 else math.log1p(math.exp(x))
    return math.sqrt(softplus)


def ref_route_token(
    row: list[float],
    *,
    k: int,
    fn: str,
    pre: bool = False,
    groups: tuple[int, int, str] | None = None,
    normalize: bool | None = None,
    scaling: float | None = None,
    bias: list[float] | None = None,
) -> dict[int, float]:
    """One token: {expert: prob} by the documented rules, in plain Python."""
    E = len(row)
    if fn == "softmax":
        full = _softmax(row)
        sel = full if pre else list(row)
    else:
        s = [_score(x, fn) for x in row]
        sel = [s[e] + bias[e] for e in range(E)] if bias is not None else list(s)
    eligible = list(range(E))
    if groups is not None:
        G, g, rule = groups
        size = E // G
        gscore = []
        for gi in range(G):
            vals = sorted(sel[gi * size : (gi + 1) * size], reverse=True)
            gscore.append(sum(vals[: k // g]) if rule == "sum_topk" else vals[0])
        kept = sorted(range(G), key=lambda i: -gscore[i])[:g]
        eligible = [e for e in range(E) if e // size in kept]
    chosen = sorted(eligible, key=lambda e: -sel[e])[:k]
    if fn == "softmax":
        if pre:
            p = [full[e] for e in chosen]
            if normalize:
                p = [v / (sum(p) + 1e-20) for v in p]
        elif normalize is False:
            p = [full[e] for e in chosen]
        else:
            p = _softmax([row[e] for e in chosen])
    else:
        p = [s[e] for e in chosen]
        if (k > 1) if normalize is None else normalize:
            tot = sum(p)
            p = [v / (tot + 1e-20) for v in p]
    if scaling is not None:
        p = [v * scaling for v in p]
    return dict(zip(chosen, p, strict=True))


def _as_dicts(idx: torch.Tensor, probs: torch.Tensor) -> list[dict[int, float]]:
    out = []
    for t in range(idx.shape[0]):
        out.append(
            {
                int(e): float(p)
                for e, p in zip(idx[t].tolist(), probs[t].tolist(), strict=True)
                if e >= 0
            }
        )
    return out


def _assert_matches(got: list[dict[int, float]], want: list[dict[int, float]], atol=1e-6):
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), f"token {t}: experts {sorted(g)} != {sorted(w)}"
        for e in w:
            assert abs(g[e] - w[e]) <= atol, f"token {t} expert {e}: {g[e]} != {w[e]}"


# ----------------------------------------------------------------------------- vs reference

E_REF, T_REF = 16, 24
_VARIANTS = []
for fn, pre in (("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)):
    for use_bias, groups, scaling, normalize in itertools.product(
        (False, True), (None, (4, 2, "sum_topk"), (4, 2, "max")), (None, 2.5), (None, True, False)
    ):
        if use_bias and fn == "softmax":
            continue
        _VARIANTS.append((fn, pre, use_bias, groups, scaling, normalize))


@pytest.mark.parametrize(("fn", "pre", "use_bias", "groups", "scaling", "normalize"), _VARIANTS)
@pytest.mark.parametrize("k", [1, 4])
def test_matches_per_token_reference(fn, pre, use_bias, groups, scaling, normalize, k, device):
    logits = torch.randn(T_REF, E_REF) * 2
    bias = (torch.randn(E_REF) * 0.3) if use_bias else None
    kw = {}
    if groups is not None:
        kw = {"num_groups": groups[0], "group_topk": groups[1], "group_score": groups[2]}
        if groups[2] == "sum_topk" and k % groups[1]:
            kw["group_topk"] = 1
            groups = (groups[0], 1, groups[2])
    res = topk_routing(
        logits.to(device),
        topk=k,
        score_function=fn,
        use_pre_softmax=pre,
        scaling_factor=scaling,
        normalize_topk=normalize,
        expert_bias=None if bias is None else bias.to(device),
        **kw,
    )
    assert res.topk_idx.device == device and res.topk_probs.device == device
    assert res.topk_idx.dtype == torch.int64 and res.topk_idx.shape == (T_REF, k)
    assert res.topk_probs.dtype == torch.float32 and res.topk_probs.shape == (T_REF, k)
    want = [
        ref_route_token(
            logits[t].double().tolist(),
            k=k,
            fn=fn,
            pre=pre,
            groups=groups,
            normalize=normalize,
            scaling=scaling,
            bias=bias.double().tolist() if bias is not None else None,
        )
        for t in range(T_REF)
    ]
    _assert_matches(_as_dicts(res.topk_idx, res.topk_probs), want)
    counts = torch.zeros(E_REF, dtype=torch.int64)
    for d in want:
        for e in d:
            counts[e] += 1
    assert torch.equal(res.tokens_per_expert.cpu(), counts)
    assert res.num_dropped.dim() == 0 and int(res.num_dropped) == 0


def test_bf16_and_fp64_logits():
    logits = torch.randn(20, 8)
    ref = topk_routing(logits.bfloat16().float(), topk=2, score_function="sigmoid")
    res = topk_routing(logits.bfloat16(), topk=2, score_function="sigmoid")
    assert torch.equal(res.topk_idx, ref.topk_idx) and res.topk_probs.dtype == torch.float32
    assert torch.allclose(res.topk_probs, ref.topk_probs)
    r64 = topk_routing(logits.double(), topk=2, score_function="sigmoid")
    assert r64.topk_probs.dtype == torch.float64
    r32 = topk_routing(logits, topk=2, score_function="sigmoid")
    assert torch.equal(r64.topk_idx, r32.topk_idx)
    assert torch.allclose(r64.topk_probs.float(), r32.topk_probs, atol=1e-6)


def test_bias_changes_selection_not_probs():
    logits = torch.randn(64, 8)
    bias = torch.zeros(8)
    bias[3] = 10.0  # every token picks expert 3
    res = topk_routing(logits, topk=2, score_function="sigmoid", expert_bias=bias)
    assert (res.topk_idx == 3).any(dim=1).all()
    s = torch.sigmoid(logits).gather(1, res.topk_idx)
    assert torch.allclose(res.topk_probs, s / s.sum(-1, keepdim=True), atol=1e-6)


def test_group_rules_differ():
    # Group 0 = {0,1}: one huge score; group 1 = {2,3}: two good scores. Top-1 group by max is
    # group 0, by the sum of the top-2 it is group 1.
    logits = torch.tensor([[5.0, -5.0, 3.0, 3.5]])
    kw = {"topk": 2, "score_function": "sigmoid", "num_groups": 2, "group_topk": 1}
    by_max = topk_routing(logits, group_score="max", **kw).topk_idx
    by_sum = topk_routing(logits, group_score="sum_topk", **kw).topk_idx
    assert set(by_max[0].tolist()) == {0, 1} and set(by_sum[0].tolist()) == {2, 3}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_group_top_sum_equals_topk_sum(n, ties):
    # ``_top_sum`` takes up to 4 values per group by repeated max on CPU (a short-dim topk is slow
    # there): the group scores must be topk's, a repeated maximum counted as often as it occurs.
    from flexdispatch.routing.topk import _top_sum

    torch.manual_seed(n)
    x = torch.randn(257, 6, 8)
    if ties:
        x = (x * 2).round() / 2  # few distinct values: every group holds repeated maxima
    got = _top_sum(x, n)
    want = x.topk(n, dim=-1).values.sum(-1)
    assert got.shape == want.shape == (257, 6)
    if n <= 2:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("k", "groups", "kept"), [(3, 4, 1), (4, 4, 1), (8, 4, 2), (6, 2, 1)])
def test_group_limited_larger_group_topk_matches_reference(k, groups, kept):
    # topk // group_topk of 3, 4 and 4 values per group: the repeated-max path beyond top-2
    logits = torch.randn(T_REF, E_REF) * 2
    kw = {"topk": k, "score_function": "sigmoid", "num_groups": groups, "group_topk": kept}
    res = topk_routing(logits, **kw)
    want = [
        ref_route_token(row.double().tolist(), k=k, fn="sigmoid", groups=(groups, kept, "sum_topk"))
        for row in logits
    ]
    _assert_matches(_as_dicts(res.topk_idx, res.topk_probs), want)


# ----------------------------------------------------------------------------- capacity


def ref_drop(idx: torch.Tensor, probs: torch.Tensor, E: int, cap: int, policy: str):
    T, k = idx.shape
    keep = [[False] * k for _ in range(T)]
    for e in range(E):
        pairs = [(t, j) for t in range(T) for j in range(k) if int(idx[t, j]) == e]
        if policy == "probs":
            pairs.sort(key=lambda tj: (-float(probs[tj[0], tj[1]]), tj[0] * k + tj[1]))
        for t, j in pairs[:cap]:
            keep[t][j] = True
    out_idx = idx.clone()
    out_p = probs.clone()
    for t in range(T):
        for j in range(k):
            if not keep[t][j]:
                out_idx[t, j] = -1
                out_p[t, j] = 0.0
    return out_idx, out_p


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.25, 0.6, 1.0, 1.3])
@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_capacity_matches_reference(policy, cf, fn, device):
    T, E, k = 40, 8, 2
    logits = torch.randn(T, E)
    logits[:, 0] += 2.0  # make expert 0 popular so that something is dropped
    free = topk_routing(logits.to(device), topk=k, score_function=fn)
    res = topk_routing(
        logits.to(device), topk=k, score_function=fn, capacity_factor=cf, drop_policy=policy
    )
    assert res.topk_idx.device == device
    cap = math.ceil(T * k / E * cf)
    # the drop reference runs on the CPU over the capacity-free routing of the same device
    want_idx, want_p = ref_drop(free.topk_idx.cpu(), free.topk_probs.cpu(), E, cap, policy)
    assert torch.equal(res.topk_idx.cpu(), want_idx)
    assert torch.equal(res.topk_probs.cpu(), want_p)
    assert int(res.num_dropped) == int((want_idx == -1).sum())
    counts = torch.bincount(want_idx[want_idx >= 0], minlength=E)
    assert torch.equal(res.tokens_per_expert.cpu(), counts)
    assert int(res.tokens_per_expert.max()) <= cap


def test_position_policy_slot_order_breaks_ties():
    # Both slots of token 0 and token 1 pick experts {0, 1}; capacity 1 per expert.
    logits = torch.tensor([[1.0, 2.0, -9, -9], [3.0, 1.5, -9, -9]] + [[-9, -9, 1.0, 2.0]] * 2)
    res = topk_routing(logits, topk=2, capacity_factor=0.5, drop_policy="position")
    # capacity = ceil(4*2/4*0.5) = 1: token 0 keeps both its slots (experts 1 and 0), token 1
    # loses both; experts 2/3 kept by token 2.
    assert expert_capacity(4, 4, 2, 0.5) == 1
    assert set(res.topk_idx[0].tolist()) == {0, 1}
    assert res.topk_idx[1].tolist() == [-1, -1]
    assert set(res.topk_idx[2].tolist()) == {2, 3} and res.topk_idx[3].tolist() == [-1, -1]


def test_capacity_at_least_T_drops_nothing():
    T, E, k = 16, 4, 2
    logits = torch.randn(T, E)
    logits[:, 1] += 50.0
    cf = E / k  # capacity = T exactly
    res = topk_routing(logits, topk=k, capacity_factor=cf)
    free = topk_routing(logits, topk=k)
    assert int(res.num_dropped) == 0
    assert torch.equal(res.topk_idx, free.topk_idx)
    assert torch.equal(res.topk_probs, free.topk_probs)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 40),
    e_per_group=st.integers(1, 4),
    G=st.sampled_from([1, 2, 4]),
    k_seed=st.integers(0, 1000),
    cf=st.floats(0.05, 3.0),
    policy=st.sampled_from(["probs", "position"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_capacity_never_exceeded(T, e_per_group, G, k_seed, cf, policy, seed):
    E = e_per_group * G
    k = 1 + k_seed % E
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    res = topk_routing(
        logits, topk=k, capacity_factor=cf, drop_policy=policy, score_function="sigmoid"
    )
    cap = math.ceil(T * k / E * cf)
    counts = torch.bincount(res.topk_idx[res.topk_idx >= 0], minlength=E)
    assert int(counts.max()) <= cap
    assert torch.equal(res.tokens_per_expert, counts)
    assert bool((res.topk_probs[res.topk_idx == -1] == 0).all())
    assert int(res.num_dropped) == int((res.topk_idx == -1).sum())
    # a dropped pair is never more attractive than a kept pair of the same expert (probs policy)
    if policy == "probs":
        free = topk_routing(logits, topk=k, score_function="sigmoid")
        for e in range(E):
            sel = free.topk_idx == e
            kept = sel & (res.topk_idx == e)
            dropped = sel & (res.topk_idx == -1)
            if kept.any() and dropped.any():
                assert float(free.topk_probs[kept].min()) >= float(free.topk_probs[dropped].max())


# ----------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 30),
    G=st.sampled_from([1, 2, 4, 8]),
    per_group=st.integers(1, 4),
    g_seed=st.integers(0, 100),
    k_seed=st.integers(0, 100),
    fn=st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]),
    pre=st.booleans(),
    rule=st.sampled_from(["sum_topk", "max"]),
    scaling=st.sampled_from([None, 1.0, 2.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_routing_properties(T, G, per_group, g_seed, k_seed, fn, pre, rule, scaling, seed):
    E = G * per_group
    g = 1 + g_seed % G
    k = 1 + k_seed % (g * per_group)
    if rule == "sum_topk":
        # the group score sums the top k//g: g must divide k
        k = g * (1 + k_seed % per_group)
    pre = pre and fn == "softmax"
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen) * 3
    res = topk_routing(
        logits,
        topk=k,
        score_function=fn,
        use_pre_softmax=pre,
        num_groups=G,
        group_topk=g,
        group_score=rule,
        scaling_factor=scaling,
        normalize_topk=True,
    )
    idx = res.topk_idx
    assert idx.shape == (T, k) and bool((idx >= 0).all()) and bool((idx < E).all())
    for t in range(T):
        row = idx[t].tolist()
        assert len(set(row)) == k
        assert len({e // per_group for e in row}) <= g
    assert bool((res.topk_probs >= 0).all())
    want_sum = scaling if scaling is not None else 1.0
    assert torch.allclose(res.topk_probs.sum(-1), torch.full((T,), want_sum), atol=1e-5)
    assert int(res.tokens_per_expert.sum()) == T * k


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "kw",
    [
        {"score_function": "sigmoid"},
        {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "scaling_factor": 2.5},
        {"score_function": "sqrtsoftplus"},
        {"score_function": "softmax"},
        {"score_function": "softmax", "num_groups": 4, "group_topk": 2},
        {"score_function": "softmax", "use_pre_softmax": True},
        {"score_function": "softmax", "use_pre_softmax": True, "normalize_topk": True},
    ],
)
def test_gradcheck_probs_wrt_logits(kw):
    logits = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)

    def f(x):
        return topk_routing(x, topk=4, **kw).topk_probs

    assert f(logits).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (logits,))


def test_dropped_slots_get_no_gradient():
    logits = torch.randn(12, 4, requires_grad=True)
    res = topk_routing(logits, topk=2, capacity_factor=0.5, score_function="sigmoid")
    assert int(res.num_dropped) > 0
    (res.topk_probs * torch.randn_like(res.topk_probs)).sum().backward()
    dropped_tokens = (res.topk_idx == -1).all(dim=1)
    assert bool((logits.grad[dropped_tokens] == 0).all())


# ----------------------------------------------------------------------------- no host sync


def test_runs_on_meta_device():
    T, E, k = 64, 32, 8
    logits = torch.empty(T, E, device="meta")
    bias = torch.empty(E, device="meta")
    for policy in ("probs", "position"):
        res = topk_routing(
            logits,
            topk=k,
            score_function="sigmoid",
            num_groups=8,
            group_topk=4,
            expert_bias=bias,
            capacity_factor=0.5,
            drop_policy=policy,
        )
        assert res.topk_idx.shape == (T, k) and res.topk_idx.device.type == "meta"
        assert res.tokens_per_expert.shape == (E,) and res.num_dropped.shape == ()
    res = topk_routing(logits, topk=2, use_pre_softmax=True, num_groups=4, group_topk=2)
    assert res.topk_probs.shape == (T, 2)


def test_no_host_sync_calls(monkeypatch):
    """Nothing reads a tensor value on the host, except the CPU-only tie check of the top-k
    (``_topk_cpu``: one bool per top-k, and the rows it fixes); the device path reads nothing (the
    meta-device test above: a meta tensor has no values to read)."""
    import sys

    from flexdispatch.routing import topk as topk_mod

    def guard(name, real):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller is topk_mod._topk_cpu.__code__:
                return real(*args, **kwargs)
            raise AssertionError(f"host sync: {name} from {caller.co_name}")

        return call

    logits = torch.randn(32, 16)
    logits[::3, 5] = logits[::3, 7]  # ties, so that the CPU tie check has rows to fix
    bias = torch.randn(16) * 0.1
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", guard("nonzero", torch.nonzero))
    for policy in ("probs", "position"):
        topk_routing(
            logits,
            topk=4,
            score_function="sigmoid",
            num_groups=4,
            group_topk=2,
            expert_bias=bias,
            capacity_factor=0.5,
            drop_policy=policy,
            checks=False,
        )


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kw", "exc", "name"),
    [
        ({"logits": torch.randn(4, 8).long()}, TypeError, "logits"),
        ({"logits": torch.randn(4, 8, 2)}, ValueError, "logits"),
        ({"logits": [[1.0, 2.0]]}, TypeError, "logits"),
        ({"topk": 0}, ValueError, "topk"),
        ({"topk": 9}, ValueError, "topk"),
        ({"score_function": "relu"}, ValueError, "score_function"),
        ({"use_pre_softmax": True, "score_function": "sigmoid"}, ValueError, "use_pre_softmax"),
        ({"num_groups": 4}, ValueError, "group_topk"),
        ({"num_groups": 3, "group_topk": 1}, ValueError, "num_groups"),
        ({"num_groups": 4, "group_topk": 5}, ValueError, "group_topk"),
        ({"num_groups": 4, "group_topk": 3, "topk": 4}, ValueError, "group_topk"),
        (
            {"num_groups": 4, "group_topk": 1, "topk": 4, "group_score": "max"},
            ValueError,
            "group_topk",
        ),
        ({"group_score": "mean"}, ValueError, "group_score"),
        ({"expert_bias": torch.zeros(8)}, ValueError, "expert_bias"),
        (
            {"expert_bias": torch.zeros(7), "score_function": "sigmoid"},
            ValueError,
            "expert_bias",
        ),
        (
            {"expert_bias": torch.zeros(8, dtype=torch.long), "score_function": "sigmoid"},
            TypeError,
            "expert_bias",
        ),
        ({"capacity_factor": 0.0}, ValueError, "capacity_factor"),
        ({"drop_policy": "random"}, ValueError, "drop_policy"),
        ({"scaling_factor": float("nan")}, ValueError, "scaling_factor"),
    ],
)
def test_bad_inputs(kw, exc, name):
    args = {"logits": torch.randn(4, 8), "topk": 2}
    args.update(kw)
    logits = args.pop("logits")
    with pytest.raises(exc, match=name):
        topk_routing(logits, **args)


def test_nan_checked_only_when_enabled(monkeypatch):
    logits = torch.randn(4, 8)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match="logits"):
        topk_routing(logits, topk=2, checks=True)
    monkeypatch.setenv("FLEXDISPATCH_CHECKS", "1")
    with pytest.raises(ValueError, match="logits"):
        topk_routing(logits, topk=2)
    monkeypatch.setenv("FLEXDISPATCH_CHECKS", "0")
    topk_routing(logits, topk=2)  # no check, no error


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"use_pre_softmax": True, "num_groups": 4, "group_topk": 2, "group_score": "max"},
        {"score_function": "sigmoid", "expert_bias": torch.zeros(8), "capacity_factor": 0.5},
    ],
)
def test_empty_input(kw):
    res = topk_routing(torch.randn(0, 8), topk=2, **kw)
    assert res.topk_idx.shape == (0, 2) and res.topk_probs.shape == (0, 2)
    assert torch.equal(res.tokens_per_expert, torch.zeros(8, dtype=torch.int64))
    assert int(res.num_dropped) == 0
