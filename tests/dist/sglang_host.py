"""SGLang (0.5.23, installed ``--no-deps``) on gloo ranks, for the plug-in tests
(tests/dist/test_sglang.py).

No SGLang MoE layer runs expert-parallel on a CPU (its CPU expert path indexes every expert and
does not take ``-1`` ids), so the tests stop at the dispatcher: SGLang's own runtime state (the
parallel context, the MoE flags, ``set_is_extend_in_batch``) is set up in each rank, SGLang's
``StandardDispatcher`` gives the reference semantics of expert parallelism there (every rank sees
every token, ids mapped to local with ``-1`` elsewhere, the layer all-reduces), and
flexdispatch's ``FlexSGLangDispatcher`` must produce SGLang's DeepEP formats with the same sums.
The experts are the pure-torch ones of ``examples/sglang_moe.py`` (as is the set-up of SGLang's
runtime state); inputs, weights and the dense per-token reference are
``tests/dist/engine_cases.py``'s.

SGLang imports ``torchvision.transforms`` on the way to its dispatcher package; the index has no
torchvision that runs on the project's CPU torch, so ``sglang_state`` puts a stub of it
(``tests/dist/sglang_stubs``, image preprocessing only, unrelated to the dispatch) on
``sys.path``, after transformers has recorded that no torchvision is installed.

T tokens on a rank · H hidden · F expert hidden · E experts · k top-k · R ranks · e = E / R ·
B decode tokens per rank · C = R · B.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from examples import sglang_moe as ex
from tests.dist.engine_cases import case_inputs, dense_reference, gap, weights

# NOTE: SGLang's runtime state (and the torchvision stub's path), the pure-torch experts are the
# example's (examples/sglang_moe.py), which imports SGLang only inside its functions
sglang_state = ex.sglang_state


def runner_config(case: dict[str, Any]) -> Any:
    return ex.runner_config(num_experts=case["E"], topk=case["K"], hidden=case.get("H", 64))


# ----------------------------------------------------------------- experts and inputs
def local_experts(
    x: torch.Tensor, local_ids: torch.Tensor, w: torch.Tensor, w13: Any, w2: Any,
    broken: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The example's token-major experts; ``broken`` halves their output (a negative control
    of the comparison, standing in for a combine that loses half its sum)."""
    out = ex.token_major_experts(x, local_ids, w, w13, w2)
    return out * 0.5 if broken else out


expert_major = ex.expert_major_experts


def _gather_all(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    R = dist.get_world_size()
    parts = [case_inputs(case, r) for r in range(R)]
    return {k: torch.cat([p[k] for p in parts]) for k in ("x", "ids", "w")}


def standard_reference(case: dict[str, Any], w13: Any, w2: Any) -> torch.Tensor:
    """SGLang's own EP semantics: every rank sees every token (what DP attention's gather gives
    the MoE layer), ``StandardDispatcher`` maps the ids to local (``-1`` elsewhere), the local
    experts run, ``combine`` returns the rows and the layer all-reduces; this rank's slice."""
    from sglang.srt.layers.moe.token_dispatcher import standard
    from sglang.srt.layers.moe.token_dispatcher.standard import (
        StandardCombineInput,
        StandardDispatcher,
    )
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    rank, R = dist.get_rank(), dist.get_world_size()
    allt = _gather_all(case)
    sd = StandardDispatcher(runner_config(case))
    # NOTE: the device of StandardDispatcher's id table: SGLang's get_device() answers "cpu"
    # only when SGLang was imported with its CPU engine on (SGLANG_USE_CPU_ENGINE=1, cached),
    # which would need its CPU kernels (sgl_kernel, not on the index); "cpu" for this call
    saved = standard.get_device
    standard.get_device = lambda device_id=None: "cpu"
    try:
        out = sd.dispatch(allt["x"], StandardTopKOutput(allt["w"], allt["ids"], None))
    finally:
        standard.get_device = saved
    y = local_experts(
        out.hidden_states, out.topk_output.topk_ids, out.topk_output.topk_weights, w13, w2
    )
    y = sd.combine(StandardCombineInput(y))
    dist.all_reduce(y)
    sizes = [case_inputs(case, r)["x"].shape[0] for r in range(R)]
    start = sum(sizes[:rank])
    return y[start : start + sizes[rank]]


def expected_counts(case: dict[str, Any]) -> list[int]:
    """(row, slot) pairs per local expert of this rank over every rank's tokens."""
    rank, R = dist.get_rank(), dist.get_world_size()
    e = case["E"] // R
    ids = _gather_all(case)["ids"]
    return [int((ids == rank * e + j).sum()) for j in range(e)]


# ----------------------------------------------------------------- the comparisons
def compare_formats(case: dict[str, Any]) -> dict[str, Any]:
    """SGLang's StandardDispatcher semantics vs flexdispatch's dispatcher in DeepEP's normal
    format, SGLang's Standard format and DeepEP's low-latency format (mode chosen by SGLang's
    ``set_is_extend_in_batch`` under ``--deepep-mode auto``); formats, counts and sums."""
    sglang_state()  # NOTE: first: SGLang imports need the stub path
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.token_dispatcher.deepep import (
        DeepEPLLCombineInput,
        DeepEPLLDispatchOutput,
        DeepEPNormalCombineInput,
        DeepEPNormalDispatchOutput,
    )
    from sglang.srt.layers.moe.token_dispatcher.standard import (
        StandardCombineInput,
        StandardDispatchOutput,
    )
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from flexdispatch import DispatchConfig
    from flexdispatch.integrations.sglang import make_dispatcher

    rank, R = dist.get_rank(), dist.get_world_size()
    E, K = case["E"], case["K"]
    e = E // R
    B = 8
    w13_all, w2_all = weights(case)
    w13, w2 = w13_all[rank * e : (rank + 1) * e], w2_all[rank * e : (rank + 1) * e]
    inp = case_inputs(case, rank)
    topk = StandardTopKOutput(inp["w"], inp["ids"], None)
    ref = dense_reference(inp, w13_all, w2_all)
    res: dict[str, Any] = {"T": inp["x"].shape[0], "ref_max": gap(ref, torch.zeros_like(ref))}
    res["standard_dispatcher"] = gap(standard_reference(case, w13, w2), ref)
    config = DispatchConfig(backend="torch", num_max_dispatch_tokens_per_rank=B)
    broken = bool(case.get("broken_combine"))
    counts = expected_counts(case)
    for fmt in ("deepep", "standard"):
        d = make_dispatcher(runner_config(case), None, config, normal_format=fmt)
        set_is_extend_in_batch(True)  # NOTE: an extend (prefill) batch: normal mode
        out = d.dispatch(inp["x"], topk)
        if fmt == "deepep":
            res["normal_type"] = type(out).__name__
            res["normal_ok"] = isinstance(out, DeepEPNormalDispatchOutput) and (
                out.num_recv_tokens_per_expert == counts
                and out.topk_ids.dtype == torch.int64
                and bool(((out.topk_ids >= -1) & (out.topk_ids < e)).all())
                and bool((out.topk_weights[out.topk_ids < 0] == 0).all())
                and out.hidden_states_scale is None
            )
            y = local_experts(out.hidden_states, out.topk_ids, out.topk_weights, w13, w2, broken)
            combined = d.combine(DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights))
            res["normal"] = gap(combined, ref)
        else:
            tk = out.topk_output
            res["standard_ok"] = isinstance(out, StandardDispatchOutput) and (
                [int((tk.topk_ids == j).sum()) for j in range(e)] == counts
                and tk.topk_ids.dtype == torch.int32
            )
            y = local_experts(out.hidden_states, tk.topk_ids, tk.topk_weights, w13, w2, broken)
            res["standard"] = gap(d.combine(StandardCombineInput(y)), ref)
        if fmt == "deepep":
            set_is_extend_in_batch(False)  # NOTE: a decode batch: low-latency mode
            decode = d._slots[0].decode.dispatcher
            syncs = decode.stats.host_syncs
            out = d.dispatch(inp["x"], topk)
            res["ll_type"] = type(out).__name__
            res["ll_shape"] = list(out.hidden_states.shape)
            res["ll_ok"] = isinstance(out, DeepEPLLDispatchOutput) and (
                out.masked_m.tolist() == counts
                and out.masked_m.dtype == torch.int32
                and out.expected_m == (inp["x"].shape[0] * R * K + E) // E
                and torch.equal(out.topk_ids, inp["ids"])
            )
            y = expert_major(out.hidden_states, out.masked_m, w13, w2)
            if broken:
                y = y * 0.5
            combined = d.combine(DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights))
            res["low_latency"] = gap(combined, ref)
            res["ll_syncs"] = decode.stats.host_syncs - syncs
            res["calls"] = [x.stats.dispatch_calls for x in d.dispatchers]
    res["B"] = B
    return res


def halves_two_subbatches(case: dict[str, Any]) -> dict[str, Any]:
    """Two-batch overlap's call pattern: ``dispatch_a`` / ``dispatch_b`` / ``combine_a`` /
    ``combine_b`` of two sub-batches interleaved on one thread, in both modes; each sub-batch's
    result equals the reference."""
    sglang_state(tbo=True)  # NOTE: first: SGLang imports need the stub path
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.token_dispatcher.deepep import (
        DeepEPLLCombineInput,
        DeepEPNormalCombineInput,
    )
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from flexdispatch import DispatchConfig
    from flexdispatch.integrations.sglang import make_dispatcher

    rank, R = dist.get_rank(), dist.get_world_size()
    e = case["E"] // R
    w13_all, w2_all = weights(case)
    w13, w2 = w13_all[rank * e : (rank + 1) * e], w2_all[rank * e : (rank + 1) * e]
    subs = [case_inputs(case, rank), case_inputs({**case, "T": [3] * R}, (rank + 1) % R)]
    refs = [dense_reference(s, w13_all, w2_all) for s in subs]
    d = make_dispatcher(
        runner_config(case),
        None,
        DispatchConfig(backend="torch", num_max_dispatch_tokens_per_rank=8),
    )
    res: dict[str, Any] = {"slots": len(d._slots)}
    try:
        d.dispatch_b(tbo_subbatch_index=0)
        res["out_of_order"] = ""
    except RuntimeError as exc:
        res["out_of_order"] = str(exc)
    for extend in (True, False):
        set_is_extend_in_batch(extend)
        for i, s in enumerate(subs):
            d.dispatch_a(s["x"], StandardTopKOutput(s["w"], s["ids"], None), tbo_subbatch_index=i)
        outs = [d.dispatch_b(tbo_subbatch_index=i) for i in range(2)]
        for i, o in enumerate(outs):
            if extend:
                y = local_experts(o.hidden_states, o.topk_ids, o.topk_weights, w13, w2)
                d.combine_a(
                    DeepEPNormalCombineInput(y, o.topk_ids, o.topk_weights), tbo_subbatch_index=i
                )
            else:
                y = expert_major(o.hidden_states, o.masked_m, w13, w2)
                d.combine_a(
                    DeepEPLLCombineInput(y, o.topk_ids, o.topk_weights), tbo_subbatch_index=i
                )
        got = [d.combine_b(tbo_subbatch_index=i) for i in range(2)]
        res["normal" if extend else "low_latency"] = max(
            gap(g, r) for g, r in zip(got, refs, strict=True)
        )
    return res


def plugin_wiring(_: Any = None) -> dict[str, Any]:
    """``register()`` off and on through SGLang's own ``load_plugins()`` (the entry point of
    this package's metadata, then ``HookRegistry.apply_hooks``): the factory SGLang's
    ``FusedMoE`` calls returns flexdispatch's dispatcher for DeepEP layers and SGLang's own
    otherwise; the refusals."""
    sglang_state()  # NOTE: first: SGLang imports need the stub path
    from importlib.metadata import entry_points

    import sglang.srt.plugins as sgl_plugins
    from sglang.srt.layers.moe import fused_moe_triton
    from sglang.srt.layers.moe.fused_moe_triton import layer
    from sglang.srt.layers.moe.utils import MoeA2ABackend, get_flags
    from sglang.srt.plugins.hook_registry import HookRegistry

    import flexdispatch.integrations.sglang as fd_sglang

    case = {"E": 8, "K": 2}
    keys = (fd_sglang.ENV_SWITCH, fd_sglang.ENV_CONFIG, "SGLANG_PLUGINS")
    env_before = {k: os.environ.get(k) for k in keys}
    res: dict[str, Any] = {
        "entry_points": sorted(
            ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "flexdispatch"
        )
    }

    def ours() -> int:
        return sum(
            h is fd_sglang.create_moe_dispatcher_around
            for _, h, _ in HookRegistry._hooks.get(fd_sglang.TARGET, [])
        )

    def sglangs_answer() -> str:
        try:
            return type(layer.create_moe_dispatcher(runner_config(case), None)).__name__
        except Exception as exc:  # NOTE: SGLang's DeepEP dispatcher needs deep_ep's kernels here
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    try:
        os.environ.pop(fd_sglang.ENV_SWITCH, None)
        before = ours()  # NOTE: 1 when an earlier call in this rank registered it (the example)
        fd_sglang.register()
        res["off_added"] = ours() - before
        res["off_answer"] = sglangs_answer()
        os.environ[fd_sglang.ENV_SWITCH] = "1"
        os.environ[fd_sglang.ENV_CONFIG] = (
            '{"backend": "torch", "num_max_dispatch_tokens_per_rank": 8}'
        )
        os.environ["SGLANG_PLUGINS"] = "flexdispatch"
        sgl_plugins._plugins_loaded = False
        sgl_plugins.load_plugins()
        res["on_hooks"] = ours()
        fn = layer.create_moe_dispatcher
        inner = fn
        while getattr(inner, "__wrapped__", None) is not None:
            inner = inner.__wrapped__
        # NOTE: a hook wrapper around SGLang's own function (the one its module defines)
        res["wrapped"] = fn is not inner and inner.__module__ == layer.__name__
        res["package_binding"] = getattr(fused_moe_triton, "create_moe_dispatcher", fn) is fn
        res["deepep_layer"] = type(layer.create_moe_dispatcher(runner_config(case), None)).__name__
        get_flags().moe.a2a_backend = MoeA2ABackend.NONE
        res["none_layer"] = type(layer.create_moe_dispatcher(runner_config(case), None)).__name__
        get_flags().moe.a2a_backend = MoeA2ABackend.DEEPEP
        fd_sglang.register()  # NOTE: read again; the hook is not registered twice
        res["hooks_after_second_register"] = ours()
        refusals = {}
        get_flags().moe.sbo_enabled = True
        try:
            layer.create_moe_dispatcher(runner_config(case), None)
            refusals["sbo"] = ""
        except ValueError as exc:
            refusals["sbo"] = str(exc)
        get_flags().moe.sbo_enabled = False
        try:
            layer.create_moe_dispatcher(runner_config(case), object())
            refusals["quantized"] = ""
        except ValueError as exc:
            refusals["quantized"] = str(exc)
        res["refusals"] = refusals
        d = layer.create_moe_dispatcher(runner_config(case), None)
        try:
            d.set_overlap_args(None, {})
            res["overlap_args"] = ""
        except ValueError as exc:
            res["overlap_args"] = str(exc)
        os.environ.pop(fd_sglang.ENV_SWITCH)
        fd_sglang.register()  # NOTE: switched off: SGLang's own factory answers again
        res["off_again"] = sglangs_answer()
    finally:
        fd_sglang.uninstall()
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


def run_example() -> dict[str, Any]:
    """examples/sglang_moe.py's rank function, in this pooled rank."""
    return ex.run_rank()
