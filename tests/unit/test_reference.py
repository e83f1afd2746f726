"""The single-process reference (flexdispatch.reference) against a per-token loop written from
the formulas: clamped / gpt-oss SwiGLU, relu², expert biases, input-side probs, shared experts
and their sigmoid gate.

T tokens · H hidden · F expert hidden · Fs shared-expert hidden · E experts · k top-k.
"""

from __future__ import annotations

import pytest
import torch

from flexdispatch.reference import dense_moe_reference, expert_mlp

T, H, F, FS, E, K = 9, 6, 10, 14, 4, 2


def _act(name, a, b, limit, alpha):
    if limit is not None:
        a = torch.minimum(a, torch.tensor(limit, dtype=a.dtype))
        b = torch.clamp(b, -limit, limit)
    if name == "swiglu":
        return a / (1 + torch.exp(-a)) * b
    if name == "swiglu_oai":
        return a / (1 + torch.exp(-alpha * a)) * (b + 1)
    if name == "relu2":
        return torch.where(a > 0, a * a, torch.zeros_like(a))
    if name == "gelu":
        return 0.5 * a * (1 + torch.erf(a / 2**0.5))
    raise AssertionError(name)


def _data(activation: str, bias: bool, shared: bool, gate: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.5):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    gated = activation in ("swiglu", "swiglu_oai")
    d = {
        "x": r(T, H, scale=1.0),
        "w1": r(E, H, F),
        "w2": r(E, F, H),
        "w3": r(E, H, F) if gated else None,
        "b1": r(E, F) if bias else None,
        "b2": r(E, H) if bias else None,
        "b3": r(E, F) if bias and gated else None,
        "sw1": r(H, FS) if shared else None,
        "sw2": r(FS, H) if shared else None,
        "sw3": r(H, FS) if shared and gated else None,
        "gate": r(1, H) if gate else None,
    }
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1  # one dropped slot
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    probs[0, 1] = 0
    return d, idx, probs


def _loop(d, idx, probs, activation, limit, alpha, on_input):
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for s in range(idx.shape[1]):
            ex = int(idx[t, s])
            if ex < 0:
                continue
            p = probs[t, s]
            x = d["x"][t] * p if on_input else d["x"][t]
            a = x @ d["w1"][ex] + (0 if d["b1"] is None else d["b1"][ex])
            b = None
            if d["w3"] is not None:
                b = x @ d["w3"][ex] + (0 if d["b3"] is None else d["b3"][ex])
            y = _act(activation, a, b, limit, alpha) @ d["w2"][ex]
            y = y + (0 if d["b2"] is None else d["b2"][ex])
            out[t] += y if on_input else p * y
        if d["sw1"] is not None:
            x = d["x"][t]
            b = None if d["sw3"] is None else x @ d["sw3"]
            s_out = _act(activation, x @ d["sw1"], b, limit, alpha) @ d["sw2"]
            if d["gate"] is not None:
                s_out = s_out / (1 + torch.exp(-(x @ d["gate"][0])))
            out[t] += s_out
    return out


CASES = [
    pytest.param("swiglu", None, None, False, False, False, False, id="swiglu"),
    pytest.param("swiglu", 0.4, None, True, False, False, False, id="swiglu-limit-bias"),
    pytest.param("swiglu_oai", 0.5, 1.702, True, False, False, False, id="gpt-oss"),
    pytest.param("swiglu_oai", 0.3, 3.0, False, True, True, False, id="oai-shared-gate"),
    pytest.param("relu2", None, None, True, True, False, False, id="relu2-bias-shared"),
    pytest.param("swiglu", None, None, False, True, True, False, id="qwen2-moe-like"),
    pytest.param("gelu", None, None, False, True, False, True, id="probs-on-input-shared"),
]


@pytest.mark.parametrize(("act", "limit", "alpha", "bias", "shared", "gate", "on_input"), CASES)
def test_dense_reference_matches_per_token_loop(act, limit, alpha, bias, shared, gate, on_input):
    d, idx, probs = _data(act, bias, shared, gate)
    if on_input:
        idx, probs = idx[:, :1], probs[:, :1]
    got = dense_moe_reference(
        d["x"],
        idx,
        probs,
        d["w1"],
        d["w2"],
        d["w3"],
        act,
        b1=d["b1"],
        b2=d["b2"],
        b3=d["b3"],
        swiglu_limit=limit,
        swiglu_alpha=alpha,
        probs_on_input=on_input,
        shared_w1=d["sw1"],
        shared_w2=d["sw2"],
        shared_w3=d["sw3"],
        shared_gate_weight=d["gate"],
    )
    want = _loop(d, idx, probs, act, limit, alpha, on_input)
    # NOTE: the reference accumulates in fp32 by design, hence the fp32-level tolerance.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_limit_clamps_and_biases_apply():
    x = torch.tensor([[10.0, -10.0]])
    w1 = torch.eye(2)
    w3 = torch.eye(2)
    w2 = torch.eye(2)
    unclamped = expert_mlp(x, w1, w2, w3, "swiglu")
    clamped = expert_mlp(x, w1, w2, w3, "swiglu", swiglu_limit=1.0)
    # gate 10 -> 1 (above only), up 10 -> 1 and -10 -> -1; gate -10 stays -10
    want = torch.tensor(
        [[1 / (1 + torch.exp(torch.tensor(-1.0))), -10 / (1 + torch.exp(torch.tensor(10.0))) * -1]]
    )
    torch.testing.assert_close(clamped, want)
    assert not torch.allclose(clamped, unclamped)
    b2 = torch.tensor([5.0, -5.0])
    torch.testing.assert_close(expert_mlp(x, w1, w2, w3, "swiglu", b2=b2), unclamped + b2)


def test_unknown_activation_and_missing_w3_raise():
    x, w = torch.zeros(1, 2), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="activation"):
        expert_mlp(x, w, w, None, "tanh")
    with pytest.raises(ValueError, match="w3"):
        expert_mlp(x, w, w, None, "swiglu_oai", swiglu_limit=1.0)
