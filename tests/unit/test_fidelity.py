"""Fidelity: flexdispatch routes exactly as the published models' reference code does.

For every fixture model, an independent per-token router written here from the Hugging Face
reference semantics (plain Python floats, one token at a time) is compared with ``topk_routing``
and ``TopKRouter`` configured by the imported preset: identical expert sets per token, weights
within fp32 rounding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flexdispatch.config import RouterConfig
from flexdispatch.importers import hash_layer_router_config, moe_config_from_hf
from flexdispatch.routing import TopKRouter, topk_routing
from flexdispatch.routing.hash import hash_experts, hash_routing

HF = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
MODELS = ["mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2", "deepseek_v3", "deepseek_v4_flash"]


def hf(name: str) -> dict:
    return json.loads((HF / f"{name}.json").read_text())


# ------------------------------------------------------------- reference routers (per token)


def softmax(row: list[float]) -> list[float]:
    m = max(row)
    ex = [math.exp(v - m) for v in row]
    s = sum(ex)
    return [v / s for v in ex]


def score(row: list[float], fn: str) -> list[float]:
    if fn == "softmax":
        return softmax(row)
    if fn == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in row]
    if fn == "sqrtsoftplus":
        return [math.sqrt(math.log1p(math.exp(v))) for v in row]
    raise AssertionError(fn)


def top(values: list[float], k: int, allowed: set[int] | None = None) -> list[int]:
    cand = [i for i in range(len(values)) if allowed is None or i in allowed]
    return sorted(cand, key=lambda i: -values[i])[:k]


def reference_route(
    raw: dict, row: list[float], bias: list[float] | None, token_id: int | None = None
) -> dict[int, float]:
    """One token routed as the model's Hugging Face code does; returns {expert: weight}."""
    mt = raw["model_type"]
    k = raw["num_experts_per_tok"]
    if mt in ("mixtral", "qwen3_moe"):
        s = softmax(row)
        chosen = top(s, k)
        w = [s[i] for i in chosen]
        if mt == "mixtral" or raw.get("norm_topk_prob"):
            w = [v / sum(w) for v in w]
        return dict(zip(chosen, w, strict=True))

    E = raw["n_routed_experts"]
    s = score(row, raw.get("scoring_func", "softmax"))
    method = raw.get("topk_method", "noaux_tc" if mt == "deepseek_v4" else "greedy")
    sel = [v + b for v, b in zip(s, bias, strict=True)] if method == "noaux_tc" and bias else s
    allowed = None
    if method in ("group_limited_greedy", "noaux_tc") and raw.get("n_group", 1) > 1:
        G, size = raw["n_group"], E // raw["n_group"]
        groups = [sel[g * size : (g + 1) * size] for g in range(G)]
        if method == "group_limited_greedy":
            gscore = [max(grp) for grp in groups]
        else:
            gscore = [sum(sorted(grp, reverse=True)[:2]) for grp in groups]
        keep = top(gscore, raw["topk_group"])
        allowed = {g * size + j for g in keep for j in range(size)}
    if mt == "deepseek_v4" and token_id is not None:
        chosen = reference_hash(token_id, E, k)
    else:
        chosen = top(sel, k, allowed)
    w = [s[i] for i in chosen]
    # NOTE: transformers' DeepseekV2TopkRouter never reads norm_topk_prob: it always scales and
    # never renormalises (DeepSeek's own V2 code renormalises and does not scale with true)
    norm = raw.get("norm_topk_prob", False) and k > 1 and mt != "deepseek_v2"
    if norm:
        w = [v / (sum(w) + 1e-20) for v in w]
    w = [v * raw.get("routed_scaling_factor", 1.0) for v in w]
    return dict(zip(chosen, w, strict=True))


def reference_hash(token_id: int, E: int, k: int, seed: int = 0) -> list[int]:
    """flexdispatch's documented hash (rendezvous over MurmurHash3 fmix32), in Python ints."""

    def fmix(x: int) -> int:
        x ^= x >> 16
        x = x * 0x85EBCA6B % 2**32
        x ^= x >> 13
        x = x * 0xC2B2AE35 % 2**32
        return x ^ (x >> 16)

    t = fmix((token_id % 2**32) ^ fmix((seed % 2**32) ^ fmix((seed >> 32) ^ 0x9E3779B9)))
    t = fmix(t ^ (token_id >> 32))
    keys = sorted((fmix((t + (x + 1) * 0x9E3779B9) % 2**32) * E + x, x) for x in range(E))
    return [x for _, x in reversed(keys[-k:])]


# ------------------------------------------------------------------------------------ helpers


def routing_kwargs(r: RouterConfig) -> dict:
    return {
        "topk": r.topk,
        "score_function": r.score_function,
        "use_pre_softmax": r.use_pre_softmax,
        "num_groups": r.num_groups,
        "group_topk": r.group_topk,
        "group_score": r.group_score,
        "normalize_topk": r.normalize_topk,
        "scaling_factor": r.scaling_factor,
    }


def assert_matches_reference(raw, logits, bias, topk_idx, topk_probs, token_ids=None):
    for t in range(logits.shape[0]):
        tid = None if token_ids is None else int(token_ids[t])
        want = reference_route(raw, logits[t].tolist(), bias, tid)
        got_idx = topk_idx[t].tolist()
        assert set(got_idx) == set(want), f"token {t}: experts {sorted(got_idx)} != {sorted(want)}"
        got = dict(zip(got_idx, topk_probs[t].tolist(), strict=True))
        for x, w in want.items():
            assert math.isclose(got[x], w, rel_tol=1e-5, abs_tol=1e-7), f"token {t} expert {x}"


def make_inputs(raw: dict, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    E = raw.get("n_routed_experts") or raw.get("num_local_experts") or raw["num_experts"]
    logits = torch.randn(T, E, generator=g) * 2
    bias = (torch.rand(E, generator=g) * 0.2 - 0.1).tolist()
    return logits, bias


# -------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("seed", [0, 1])
def test_topk_routing_matches_reference(model, seed):
    raw = hf(model)
    r = moe_config_from_hf(raw).router
    logits, bias = make_inputs(raw, T=48, seed=seed)
    expert_bias = torch.tensor(bias) if r.enable_expert_bias else None
    res = topk_routing(logits, expert_bias=expert_bias, **routing_kwargs(r))
    assert_matches_reference(
        raw, logits, bias if r.enable_expert_bias else None, res.topk_idx, res.topk_probs
    )


@pytest.mark.parametrize(
    "variant",
    [
        ("qwen3_30b_a3b", {"norm_topk_prob": False}),
        ("deepseek_v2", {"norm_topk_prob": True}),
        ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
        ("deepseek_v2", {"topk_method": "greedy"}),
    ],
    ids=["qwen3-no-norm", "v2-norm", "v3-one-group", "v2-greedy"],
)
def test_config_variants_match_reference(variant):
    model, update = variant
    raw = {**hf(model), **update}
    r = moe_config_from_hf(raw).router
    logits, bias = make_inputs(raw, T=32, seed=3)
    expert_bias = torch.tensor(bias) if r.enable_expert_bias else None
    res = topk_routing(logits, expert_bias=expert_bias, **routing_kwargs(r))
    assert_matches_reference(
        raw, logits, bias if r.enable_expert_bias else None, res.topk_idx, res.topk_probs
    )


@pytest.mark.parametrize("model", MODELS)
def test_topk_router_with_given_weights_matches_reference(model):
    raw = hf(model)
    r = moe_config_from_hf(raw).router
    H, T = 32, 24
    router = TopKRouter(r, H).eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g)
    with torch.no_grad():
        router.weight.copy_(torch.randn(r.num_experts, H, generator=g) * 0.5)
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.rand(r.num_experts, generator=g) * 0.2 - 0.1)
        res = router(x)
    logits = x @ router.weight.float().T
    bias = router.expert_bias.tolist() if router.expert_bias is not None else None
    assert_matches_reference(raw, logits, bias, res.topk_idx, res.topk_probs)


def _spike_logits() -> torch.Tensor:
    """DeepSeek-V2 shape (160 experts, 8 groups of 20): groups 0-2 hold one high score each,
    groups 3-5 two slightly lower ones. By max, groups 0-2 win; by the sum of the top 2 (softmax
    scores e^5 + e^-5 < 2 e^4.8), groups 3-5 win."""
    logits = -5.0 - 0.01 * torch.arange(160.0).unsqueeze(0)  # distinct low scores: no ties
    for g in range(3):
        logits[0, g * 20] = 5.0
    for g in range(3, 6):
        logits[0, g * 20 : g * 20 + 2] = 4.8
    return logits


def test_v2_max_rule_and_megatron_sum_rule_choose_differently():
    raw = hf("deepseek_v2")
    r = moe_config_from_hf(raw).router
    assert r.group_score == "max"
    logits = _spike_logits()
    by_max = topk_routing(logits, **routing_kwargs(r))
    by_sum = topk_routing(logits, **{**routing_kwargs(r), "group_score": "sum_topk"})
    assert {x // 20 for x in by_max.topk_idx[0].tolist()} == {0, 1, 2}
    assert {x // 20 for x in by_sum.topk_idx[0].tolist()} == {3, 4, 5}
    # The published max rule is what the reference code does; the sum rule is not.
    assert_matches_reference(raw, logits, None, by_max.topk_idx, by_max.topk_probs)
    want = set(reference_route(raw, logits[0].tolist(), None))
    assert set(by_sum.topk_idx[0].tolist()) != want


def test_v4_hash_layer_router_equals_hash_routing_and_reference():
    raw = hf("deepseek_v4_flash")
    cfg = moe_config_from_hf(raw)
    hr = hash_layer_router_config(cfg)
    H, T = 32, 20
    router = TopKRouter(hr, H).eval()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g)
    token_ids = torch.randint(0, 129_280, (T,), generator=g)
    with torch.no_grad():
        router.weight.copy_(torch.randn(hr.num_experts, H, generator=g))
        res = router(x, token_ids=token_ids)
    logits = x @ router.weight.float().T
    direct = hash_routing(
        token_ids,
        num_experts=hr.num_experts,
        topk=hr.topk,
        seed=hr.hash_seed,
        logits=logits,
        score_function=hr.score_function,
        normalize_topk=hr.normalize_topk,
        scaling_factor=hr.scaling_factor,
    )
    assert torch.equal(res.topk_idx, direct.topk_idx)
    torch.testing.assert_close(res.topk_probs, direct.topk_probs, rtol=1e-6, atol=0)
    assert torch.equal(res.topk_idx, hash_experts(token_ids, num_experts=256, topk=6))
    assert_matches_reference(raw, logits, None, res.topk_idx, res.topk_probs, token_ids=token_ids)
    # weights of a hash layer sum to the routed scaling factor (sqrtsoftplus, renormalised)
    torch.testing.assert_close(res.topk_probs.sum(1), torch.full((T,), 1.5), rtol=1e-5, atol=0)
