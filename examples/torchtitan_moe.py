"""torchtitan's MoE module moving its tokens through flexdispatch, on CPU (2 gloo ranks).

A CPU example: its tensors, meshes and process group stay on the CPU on a GPU node too.

    python examples/torchtitan_moe.py                        # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 examples/torchtitan_moe.py   # or under torchrun

A torchtitan job switches with one command-line option (docs/integrations.md)::

    --override.imports flexdispatch.integrations.torchtitan.flexdispatch_override

which this example does in code (``apply_overrides``, marked ``# SWITCH``) on an MoE layer built
the way torchtitan's qwen3 MoE layers are, then parallelizes it with EP = 2 as the trainer does.
Needs torchtitan 0.3.0 (``FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh``).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist


def moe_config() -> Any:
    """A small MoE layer config: softmax router (top-2 of 8), grouped experts, the standard
    all-to-all token dispatcher, EP sharding set."""
    from torch import nn
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    experts_init = {name: init["weight"] for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    cfg = make_moe_config(
        num_experts=8,
        router=make_router_config(
            dim=64, num_experts=8, gate_param_init=init, top_k=2, score_func="softmax"
        ),
        routed_experts=make_routed_experts_config(
            dim=64, hidden_dim=128, num_experts=8, top_k=2, param_init=experts_init,
            comm_backend="standard",
        ),
    )  # fmt: skip
    set_moe_sharding_config(
        cfg, enable_ep=True, enable_sp=False, expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT
    )
    return cfg


def run_rank(dims: Any = None) -> dict[str, Any]:
    """One rank: switch the layer's dispatcher, parallelize (EP = R), one forward and backward.
    ``dims``: a ``ParallelDims`` with its meshes built (default: build one here)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import get_spmd_context

    R = dist.get_world_size()
    cfg = moe_config()
    override = "flexdispatch.integrations.torchtitan.flexdispatch_override"  # SWITCH
    apply_overrides(OverrideConfig(imports=[override]), cfg)  # SWITCH (--override.imports)
    moe = cfg.build()
    moe.init_states()
    if dims is None:
        # NOTE: CPU meshes, on a GPU node too (this example's tensors and gloo group are on
        # the CPU; torchtitan picks "cuda" meshes otherwise)
        parallel_dims_module.device_type = "cpu"
        dims = ParallelDims(dp_replicate=1, dp_shard=R, cp=1, tp=1, pp=1, ep=R, world_size=R)
        dims.build_mesh()
    moe.parallelize(dims)
    x = torch.randn(2, 16, 64, requires_grad=True)  # [B, L, D]
    with get_spmd_context(parallel_dims=dims)():
        out = moe(x)
        out.sum().backward()
    dispatcher = moe.routed_experts.token_dispatcher
    fd = dispatcher.dispatcher  # its FlexDispatcher
    return {
        "dispatcher": type(dispatcher).__name__,
        "backend": fd.backend_name,
        "why": fd.backend_reason,
        "dispatch_calls": fd.stats.dispatch_calls,
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
