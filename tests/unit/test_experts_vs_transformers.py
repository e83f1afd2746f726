"""The expert MLP variants against transformers' own modules on random weights (transformers is
a pinned test dependency): gpt-oss's clamped GLU with biases, Qwen2-MoE's gated shared expert.

T tokens · H hidden · F expert hidden · E experts · k top-k.
"""

from __future__ import annotations

import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP

from flexdispatch.experts import GroupedExperts, SharedExperts
from flexdispatch.reference import dense_moe_reference

T, H, F, E, K = 11, 8, 16, 4, 2


def test_swiglu_oai_with_biases_matches_gpt_oss_experts():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=F, num_local_experts=E, swiglu_limit=0.3
    )
    hf = GptOssExperts(cfg)
    # NOTE: the module's own clamp and alpha are what it runs: some supported transformers
    # releases (5.17) hard-code them (7.0, 1.702) and have no config.swiglu_alpha; setting the
    # attributes makes the clamp bite on every release.
    hf.limit = 0.3
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.4)
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    probs = torch.rand(T, K)
    want = hf(x, router_indices=idx, routing_weights=probs)

    # gpt-oss interleaves gate (even columns) and up (odd columns) in gate_up_proj [E, H, 2F]
    gu, gub = hf.gate_up_proj.detach(), hf.gate_up_proj_bias.detach()
    w = {
        "w1": gu[..., ::2],
        "w3": gu[..., 1::2],
        "w2": hf.down_proj.detach(),
        "b1": gub[:, ::2],
        "b3": gub[:, 1::2],
        "b2": hf.down_proj_bias.detach(),
    }
    alpha = float(hf.alpha)
    assert alpha == float(getattr(cfg, "swiglu_alpha", alpha)) == 1.702
    got_ref = dense_moe_reference(
        x,
        idx,
        probs,
        w["w1"],
        w["w2"],
        w["w3"],
        "swiglu_oai",
        b1=w["b1"],
        b2=w["b2"],
        b3=w["b3"],
        swiglu_limit=0.3,
        swiglu_alpha=alpha,
    )
    torch.testing.assert_close(got_ref, want, rtol=1e-5, atol=1e-5)

    # the grouped experts on rows sorted expert-major, summed back per token
    ex = GroupedExperts(
        E, H, F, activation="swiglu_oai", swiglu_limit=0.3, swiglu_alpha=alpha, bias=True
    )
    with torch.no_grad():
        for name, v in w.items():
            getattr(ex, name).copy_(v)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    rows = ex(x[tok], torch.bincount(flat, minlength=E), probs.reshape(-1)[order])
    got = torch.zeros(T, H).index_add(0, tok, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the clamps do bite at this limit (otherwise the test could not tell them apart)
    assert bool((x @ w["w1"][0] + w["b1"][0]).abs().max() > 0.3)


def test_gated_shared_expert_matches_qwen2_moe():
    torch.manual_seed(1)
    cfg = transformers.Qwen2MoeConfig(hidden_size=H, shared_expert_intermediate_size=F)
    mlp = Qwen2MoeMLP(cfg, intermediate_size=F)
    gate = torch.nn.Linear(H, 1, bias=False)
    x = torch.randn(T, H)
    want = torch.sigmoid(gate(x)) * mlp(x)
    se = SharedExperts(H, F, activation="swiglu", gate=True)
    with torch.no_grad():
        se.w1.copy_(mlp.gate_proj.weight.t())
        se.w3.copy_(mlp.up_proj.weight.t())
        se.w2.copy_(mlp.down_proj.weight.t())
        se.gate_weight.copy_(gate.weight)
    torch.testing.assert_close(se(x), want, rtol=1e-5, atol=1e-6)
    ungated = SharedExperts(H, F, activation="swiglu")
    with torch.no_grad():
        for n in ("w1", "w2", "w3"):
            getattr(ungated, n).copy_(getattr(se, n))
    torch.testing.assert_close(ungated(x), mlp(x), rtol=1e-5, atol=1e-6)
