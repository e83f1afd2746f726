"""flexdispatch.integrations.hf in one process (a world of one): what it refuses, and that a
replaced model still computes the original logits."""

from __future__ import annotations

import pytest
import torch
import transformers

from flexdispatch.config import DispatchConfig
from flexdispatch.integrations.hf import EPSparseMoeBlock, expert_parallel


def _mixtral(**kw):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        attn_implementation="eager",
        **kw,
    )
    return transformers.MixtralForCausalLM(cfg).float()


def test_world_of_one_keeps_logits():
    model = _mixtral()
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.normal_(0, 0.5)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids).logits.detach()
    expert_parallel(model, dispatch=DispatchConfig(backend="torch"))
    assert isinstance(model.model.layers[0].mlp, EPSparseMoeBlock)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_refuses_router_jitter():
    with pytest.raises(ValueError, match="router_jitter_noise"):
        expert_parallel(_mixtral(router_jitter_noise=0.1))


def test_refuses_a_model_without_supported_blocks():
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(ValueError, match="no supported sparse MoE block"):
        expert_parallel(transformers.LlamaForCausalLM(cfg))


def test_refuses_inexact_deepseek_group_rule():
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,  # 2 / 2 = 1 score per group, but DeepSeek-V3 sums the top 2
        first_k_dense_replace=0,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
    )
    with pytest.raises(ValueError, match="top-2"):
        expert_parallel(transformers.DeepseekV3ForCausalLM(cfg))


def test_supported_transformers_range_is_declared_once_and_holds_the_installed_release():
    from pathlib import Path

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from flexdispatch.integrations.hf import TRANSFORMERS_SUPPORTED

    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    (req,) = extras["optional-dependencies"]["hf"]
    assert req == f"transformers{TRANSFORMERS_SUPPORTED}"
    spec = SpecifierSet(TRANSFORMERS_SUPPORTED)
    # the release of the first GPU run (5.17.0) and the pinned test release are both inside
    assert Version("5.17.0") in spec and Version("5.23.0") in spec
    installed = Version(transformers.__version__)
    assert installed in spec, (
        f"transformers {installed} is outside the supported {TRANSFORMERS_SUPPORTED}: "
        f"install one inside (pip install -e .[hf]) or widen the range after checking it"
    )


# --------------------------------------------------------------------------- reliability-5 S5, S6


def test_the_block_itself_is_refused_not_corrupted():
    # S5: the block was found as module '' and replaced by setattr(block, '', ...): the block
    # came back unchanged, with a child named '' (state-dict keys starting with '.')
    block = _mixtral().model.layers[0].mlp
    with pytest.raises(ValueError, match=r"pass the model that holds the block, not the block "):
        expert_parallel(block)
    assert "" not in dict(block.named_children())


@pytest.mark.parametrize("model", [{}, "/models/x", None])
def test_a_model_that_is_not_a_module_is_a_type_error(model):
    # S6: AttributeError: 'dict' object has no attribute 'named_modules'
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        expert_parallel(model)


def test_a_group_that_is_not_a_process_group_is_a_type_error():
    # S6: group=5 was accepted silently
    model = _mixtral()
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup"):
        expert_parallel(model, group=5)
    assert not isinstance(model.model.layers[0].mlp, EPSparseMoeBlock)


def test_a_user_class_with_a_supported_name_is_named():
    # S6: blocks are matched by class name: AttributeError ... no attribute 'experts'
    fake = type("MixtralSparseMoeBlock", (torch.nn.Module,), {"__module__": "mymodels"})
    holder = torch.nn.Module()
    holder.moe = fake()
    with pytest.raises(TypeError, match=r"moe is a MixtralSparseMoeBlock from 'mymodels'"):
        expert_parallel(holder)
    # the transformers class without what the stand-in reads (another release's layout)
    model = _mixtral()
    del model.model.layers[0].mlp.gate
    with pytest.raises(TypeError, match=r"has no tensor gate.weight"):
        expert_parallel(model)


def test_a_float64_model_is_refused_before_the_first_forward():
    # reliability-5 (inconclusive row, re-run): refused only at the first forward by the
    # dispatcher's dtype check (x must be bfloat16, float16 or float32)
    model = _mixtral().double()
    with pytest.raises(TypeError, match=r"experts are torch.float64.*\(model.float\(\)\)"):
        expert_parallel(model, dispatch=DispatchConfig(backend="torch"))
