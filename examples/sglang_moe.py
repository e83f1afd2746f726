"""SGLang's MoE dispatcher factory giving flexdispatch's dispatcher, on CPU (2 gloo ranks).

A CPU example: its tensors and process group stay on the CPU on a GPU node too.

    python examples/sglang_moe.py                        # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 examples/sglang_moe.py   # or under torchrun

An SGLang server switches with one environment variable (docs/integrations.md)::

    FLEXDISPATCH_SGLANG=1 python -m sglang.launch_server --model-path <moe model> --tp 2 \\
        --moe-a2a-backend deepep --deepep-mode auto

SGLang then runs flexdispatch's ``sglang.srt.plugins`` entry point,
``flexdispatch.integrations.sglang.register()``, and applies the hook it registered on
SGLang's ``create_moe_dispatcher``. This example does the same in code (marked ``# SWITCH``)
after setting SGLang's runtime state the way its engine does for ``--moe-a2a-backend deepep``
on a group of 2, asks SGLang's factory for a layer's dispatcher, and runs an extend (prefill)
batch — DeepEP's normal format, dropless — and a decode batch — DeepEP's low-latency format,
static ``[e, C, H]`` rows — through it with small pure-torch experts, checked against a dense
computation. SGLang's own MoE layers do not run expert-parallel on a CPU, so the experts are
this file's. Needs sglang 0.5.23 (``FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh``); on a
machine without torchvision (the package index has no CPU build for this torch) SGLang's
import of its image transforms is met by the test stub in ``tests/dist/sglang_stubs``.

T tokens on a rank · H hidden · F expert hidden · E experts · k top-k · R ranks · e = E / R ·
B decode tokens per rank · C = R · B.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

E, K, H, FF, B = 8, 2, 64, 32, 8
_STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "dist")
_STATE: dict[str, Any] = {}


def sglang_state(*, deepep_mode: str = "auto", tbo: bool = False) -> None:
    """SGLang's runtime state for a DeepEP layer on this gloo world: the parallel context (TP =
    EP = R, the group DeepEP would use) and the MoE flags (``--moe-a2a-backend deepep``,
    ``--deepep-mode``, two-batch overlap). Once per process; the flags at every call."""
    if "ready" not in _STATE:
        if importlib.util.find_spec("torchvision") is None:
            import transformers.utils.import_utils as hf_imports

            hf_imports.is_torchvision_available()  # NOTE: cached False before the stub exists
            sys.path.insert(0, os.path.join(os.path.normpath(_STUBS), "sglang_stubs"))
        from sglang.srt.runtime_context import get_parallel

        R, rank = dist.get_world_size(), dist.get_rank()
        get_parallel().override_permanently(
            tp_group=types.SimpleNamespace(device_group=dist.group.WORLD),
            tp_size=R,
            tp_rank=rank,
            moe_ep_size=R,
            moe_ep_rank=rank,
            moe_tp_size=1,
            moe_tp_rank=0,
            moe_dp_size=1,
            moe_dp_rank=0,
            attn_tp_size=R,
            attn_tp_rank=rank,
            attn_dp_size=1,
            attn_dp_rank=0,
            attn_cp_size=1,
            attn_cp_rank=0,
        )
        _STATE["ready"] = True
    from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend, MoeRunnerBackend, get_flags

    moe = get_flags().moe
    moe.a2a_backend = MoeA2ABackend.DEEPEP
    moe.runner_backend = MoeRunnerBackend.AUTO
    moe.deepep_mode = DeepEPMode(deepep_mode)
    moe.tbo_enabled = tbo
    moe.sbo_enabled = False
    moe.disable_fp4_allgather = True


def runner_config(*, num_experts: int = E, topk: int = K, hidden: int = H) -> Any:
    """SGLang's ``MoeRunnerConfig`` of a layer with E routed experts split over the group."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    return MoeRunnerConfig(
        num_experts=num_experts,
        num_local_experts=num_experts // dist.get_world_size(),
        hidden_size=hidden,
        top_k=topk,
        num_fused_shared_experts=0,
        params_dtype=torch.float32,
    )


def mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``w13`` ``[2F, H]`` (gate rows, then up rows), ``w2`` ``[H, F]``, SiLU-gated."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def token_major_experts(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
                        w13: Any, w2: Any) -> torch.Tensor:  # fmt: skip
    """What SGLang's runner returns for received rows ``[M, H]`` with local ids (``-1``
    skipped): ``y[m] = sum_j weights[m, j] * expert_{ids[m, j]}(x[m])``."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype)
    for j in range(w13.shape[0]):
        rows, slots = (local_ids == j).nonzero(as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, mlp(x[rows], w13[j], w2[j]) * weights[rows, slots, None])
    return out


def expert_major_experts(x: torch.Tensor, masked_m: torch.Tensor, w13: Any, w2: Any) -> Any:
    """What a masked grouped GEMM returns for ``[e, C, H]`` rows: unweighted, zero past
    ``masked_m[j]`` (read on the host here: a CPU stand-in for the GPU kernel)."""
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype)
    for j, n in enumerate(masked_m.tolist()):
        if n:
            out[j, :n] = mlp(x[j, :n], w13[j], w2[j])
    return out


def run_rank() -> dict[str, Any]:
    """One rank: switch SGLang to flexdispatch, get a DeepEP layer's dispatcher from SGLang's
    factory, run an extend batch and a decode batch through it."""
    sglang_state()  # NOTE: first: SGLang's imports may need the torchvision stub
    os.environ["FLEXDISPATCH_SGLANG"] = "1"  # SWITCH (the server's environment)
    os.environ["FLEXDISPATCH_SGLANG_CONFIG"] = (
        f'{{"backend": "auto", "num_max_dispatch_tokens_per_rank": {B}}}'
    )
    import flexdispatch.integrations.sglang as fd_sglang

    fd_sglang.register()  # SWITCH (SGLang's load_plugins() runs the entry point ...)
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.fused_moe_triton import layer
    from sglang.srt.layers.moe.token_dispatcher.deepep import (
        DeepEPLLCombineInput,
        DeepEPNormalCombineInput,
    )
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()  # SWITCH (... and then applies the hooks)
    rank, R = dist.get_rank(), dist.get_world_size()
    e = E // R
    gen = torch.Generator().manual_seed(0)  # NOTE: the same weights on every rank
    w13_all = torch.randn(E, 2 * FF, H, generator=gen) * 0.1
    w2_all = torch.randn(E, H, FF, generator=gen) * 0.1
    w13, w2 = w13_all[rank * e : (rank + 1) * e], w2_all[rank * e : (rank + 1) * e]
    dispatcher = layer.create_moe_dispatcher(runner_config(), quant_method=None)
    result: dict[str, Any] = {"dispatcher": type(dispatcher).__name__}
    for name, T, extend in (("extend", 6 + rank, True), ("decode", 2, False)):
        g = torch.Generator().manual_seed(10 * rank + T)
        x = torch.randn(T, H, generator=g)
        weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K)
        set_is_extend_in_batch(extend)  # NOTE: what SGLang's scheduler sets for each batch
        out = dispatcher.dispatch(x, StandardTopKOutput(weights, ids, None))
        result[f"{name}_format"] = type(out).__name__
        if extend:
            y = token_major_experts(out.hidden_states, out.topk_ids, out.topk_weights, w13, w2)
            back = dispatcher.combine(DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights))
        else:
            result["decode_rows"] = list(out.hidden_states.shape)  # [e, C, H]
            y = expert_major_experts(out.hidden_states, out.masked_m, w13, w2)
            back = dispatcher.combine(DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights))
        ref = torch.zeros_like(x)
        for t in range(T):
            for j in range(K):
                i = int(ids[t, j])
                ref[t] += weights[t, j] * mlp(x[t : t + 1], w13_all[i], w2_all[i])[0]
        result[f"{name}_max_err"] = float((back - ref).abs().max())
    result["dispatch_calls"] = [d.stats.dispatch_calls for d in dispatcher.dispatchers]
    result["backend"] = dispatcher.dispatchers[0].backend_name
    fd_sglang.uninstall()
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
