"""Megatron-Core's MoE layer moving its tokens through flexdispatch, on CPU (2 gloo ranks).

A CPU example: its tensors and process group stay on the CPU on a GPU node too (the CPU
workaround below is applied always).

    python examples/megatron_moe.py                        # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 examples/megatron_moe.py   # or under torchrun

The lines that switch a Megatron job to flexdispatch are marked ``# SWITCH``: import the plug-in,
``install()`` it before the model is built, and build with ``moe_token_dispatcher_type="flex"``
(backend ``"deepep"``, Megatron's default: docs/integrations.md says why the string stays). Needs
megatron-core 0.19 (``FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# NOTE: Megatron compiles its flex dispatcher's dispatch_preprocess with torch.compile at the
# first step (~23 s on a CPU): this example skips that; a training job keeps it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import torch.distributed as dist

import flexdispatch.integrations.megatron as fd_megatron  # SWITCH
from flexdispatch import DispatchConfig


@contextlib.contextmanager
def cpu_router() -> Iterator[None]:
    """Megatron's router moves its weight to torch.cuda.current_device() at every forward
    (router.py); this example's tensors and gloo group are on the CPU (on a GPU node too), so
    point that at the CPU. (flexdispatch itself needs nothing.)"""
    before = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = before


def run_rank() -> dict[str, Any]:
    """One rank: build a Megatron MoELayer through the plug-in, one forward and backward."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    R = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=R)
    fd_megatron.install(DispatchConfig(backend="auto"))  # SWITCH: before the model is built
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=4,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
            expert_model_parallel_size=R,
            moe_token_dispatcher_type="flex",  # SWITCH (moe_flex_dispatcher_backend="deepep")
            moe_router_dtype="fp32",
            moe_aux_loss_coeff=1e-2,
            use_cpu_initialization=True,
            moe_permute_fusion=False,
            add_bias_linear=False,
        )
        spec = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts).mlp
        with cpu_router():
            layer = MoELayer(config, get_submodules(spec))
            x = torch.randn(8, 2, config.hidden_size, requires_grad=True)  # [S, B, H]
            out, _ = layer(x)
            out.sum().backward()
    finally:
        fd_megatron.uninstall()
    fd = layer.token_dispatcher.dispatcher  # the layer's FlexDispatcher
    return {
        "dispatcher": type(layer.token_dispatcher).__name__,
        "backend": fd.backend_name,
        "why": fd.backend_reason,
        "dispatch_calls": fd.stats.dispatch_calls,
        "rows_received": fd.stats.rows_received,
        "out_shape": list(out.shape),
        "grad_finite": bool(torch.isfinite(x.grad).all()),
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
