"""MoEConfig's expert-MLP and shared-expert fields: what combinations are accepted."""

import pytest

from flexdispatch.config import MoEConfig, RouterConfig


def _cfg(**kw):
    topk = kw.pop("topk", 2)
    return MoEConfig(
        hidden_size=16,
        ffn_hidden_size=32,
        router=RouterConfig(num_experts=8, topk=topk, router_bias=kw.pop("router_bias", False)),
        **kw,
    )


def test_defaults_describe_a_plain_swiglu_layer():
    cfg = _cfg()
    assert cfg.activation == "swiglu" and cfg.swiglu_limit is None and cfg.swiglu_alpha is None
    assert not cfg.expert_mlp_bias and not cfg.shared_expert_gate and not cfg.probs_on_input
    assert not cfg.router.router_bias


def test_gpt_oss_style_layer_is_accepted():
    cfg = _cfg(
        activation="swiglu_oai",
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        expert_mlp_bias=True,
        router_bias=True,
    )
    assert cfg.swiglu_limit == 7.0 and cfg.router.router_bias


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"activation": "swiglu_oai"}, "needs swiglu_limit"),
        ({"activation": "relu2", "swiglu_limit": 7.0}, "gated activation"),
        ({"activation": "swiglu", "swiglu_alpha": 1.7}, "swiglu_oai"),
        ({"shared_expert_gate": True}, "num_shared_experts=0"),
        ({"shared_expert_ffn_hidden_size": 64}, "num_shared_experts=0"),
        ({"probs_on_input": True}, "topk=1"),
    ],
)
def test_inconsistent_fields_are_refused_with_the_reason(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _cfg(**kw)


def test_shared_gate_and_input_probs_with_their_prerequisites():
    cfg = _cfg(num_shared_experts=1, shared_expert_ffn_hidden_size=64, shared_expert_gate=True)
    assert cfg.shared_expert_gate
    assert _cfg(topk=1, probs_on_input=True).probs_on_input
