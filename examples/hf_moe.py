"""A Hugging Face MoE model (a tiny random Mixtral) run expert-parallel by flexdispatch, on CPU
(2 gloo ranks).

    python examples/hf_moe.py                        # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 examples/hf_moe.py   # or under torchrun

The switch is one call, marked ``# SWITCH``:
``flexdispatch.integrations.hf.expert_parallel(model)`` replaces every supported sparse MoE block
in place; each rank keeps its slice of the experts. A real model loads its checkpoint with
``from_pretrained`` instead of the random weights here
(``scripts/launch/serve_hf_expert_parallel.sh`` serves one).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch import DispatchConfig
from flexdispatch.integrations.hf import expert_parallel


def run_rank() -> dict[str, Any]:
    """One rank: the same tiny model on every rank, made expert-parallel, one training step."""
    import transformers

    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    expert_parallel(model, dispatch=DispatchConfig(backend="auto"))  # SWITCH
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    block = model.model.layers[0].mlp
    return {
        "block": type(block).__name__,
        "backend": block.layer.dispatcher.backend_name,
        "loss": float(loss),
        "dispatch_calls": block.layer.dispatcher.stats.dispatch_calls,
    }


def main() -> None:
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        print(dist.get_rank(), run_rank())
        dist.destroy_process_group()
        return
    from flexdispatch import spawn_group

    for rank, result in enumerate(spawn_group(run_rank, 2, timeout_s=300)):
        print(rank, result)


if __name__ == "__main__":
    main()
