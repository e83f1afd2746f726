"""Megatron-Core on gloo ranks, for the plug-in tests (tests/dist/test_megatron.py).

Functions run inside pooled ranks (``tests/dist/harness.py``); they import Megatron there, never in
the pytest process. ``TORCHDYNAMO_DISABLE=1`` must be in the ranks' environment before Megatron is
imported (its flex dispatcher's ``dispatch_preprocess`` is ``torch.compile``d at import; compiling
it costs ~23 s of CPU on the first step): the tests pass it with every call.

The shims (test-only; Megatron assumes CUDA in a few places):

- flexdispatch as the dispatcher needs one: the router moves a CPU weight to
  ``torch.cuda.current_device()`` on every forward (router.py ``gating``);
- Megatron's own all-to-all dispatcher, the reference, needs three more: its side stream
  (``cuda_dtoh_stream``, ``torch.cuda.current_stream`` / ``torch.cuda.stream``) and the split sizes
  of its all-to-all, which it turns into NumPy arrays only for CUDA tensors.

T tokens per rank · H hidden · E experts · k top-k · F expert hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _HostStream:
    """Stands in for a CUDA stream / event on the CPU."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


_STREAM = _HostStream()


@contextlib.contextmanager
def cpu_shims(*, reference: bool) -> Iterator[None]:
    """Patch what Megatron's layer needs on a CPU build of torch; put it all back afterwards.

    ``reference``: also the shims of Megatron's own all-to-all dispatcher.
    """
    from megatron.core.transformer.moe import token_dispatcher as td

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    if reference:
        moved = td.maybe_move_tensor_to_cpu

        def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return moved(tensor, as_numpy=as_numpy, record_stream=record_stream)

        patch(torch.cuda, "current_stream", lambda *a, **k: _STREAM)
        patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        patch(td.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _STREAM)
        patch(td, "maybe_move_tensor_to_cpu", to_host)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def ensure_parallel(*, ep: int, etp: int) -> None:
    """Megatron's parallel state over the default (gloo) group: expert-parallel ``ep``, expert
    tensor-parallel ``etp``, attention TP 1 (rebuilt when the shape changes)."""
    from megatron.core import parallel_state as ps

    if os.environ.get("TORCHDYNAMO_DISABLE") != "1":
        raise RuntimeError("run the Megatron ranks with TORCHDYNAMO_DISABLE=1 (module docstring)")
    if ps.model_parallel_is_initialized():
        layout = (
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if layout == (ep, etp):
            return
        # NOTE: Megatron names some groups by their ranks, so a second layout in one process
        # collides with the first: one layout per pooled group (per test module)
        raise RuntimeError(
            f"Megatron's parallel state is (ep, etp) = {layout} in this process, not {(ep, etp)}:"
            f" put the (ep, etp) = {(ep, etp)} tests in a test module of their own"
        )
    ps.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def transformer_config(case: dict[str, Any]) -> Any:
    """A small ``TransformerConfig`` for one case (see ``CASES`` in the test module)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = case.get("dtype") == "bf16"
    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=case.get("H", 16),
        num_attention_heads=4,
        ffn_hidden_size=case.get("F", 24),
        moe_ffn_hidden_size=case.get("F", 24),
        num_moe_experts=case["E"],
        moe_router_topk=case["k"],
        expert_model_parallel_size=case.get("ep", 2),
        expert_tensor_parallel_size=case.get("etp", 1),
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_router_pre_softmax=case.get("pre_softmax", False),
        moe_router_score_function=case.get("score", "softmax"),
        use_cpu_initialization=True,
        moe_permute_fusion=False,
        add_bias_linear=False,
        gated_linear_unit=case.get("swiglu", False),
        activation_func=F.silu if case.get("swiglu") else F.gelu,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    if case.get("capacity"):
        kwargs.update(moe_expert_capacity_factor=case["capacity"], moe_token_drop_policy="probs")
    if case.get("shared"):
        kwargs.update(moe_shared_expert_intermediate_size=case["shared"])
    if case.get("groups"):
        kwargs.update(
            moe_router_num_groups=case["groups"],
            moe_router_group_topk=case["group_topk"],
            moe_router_topk_scaling_factor=case.get("scale"),
        )
    kwargs.update(case.get("extra", {}))
    return TransformerConfig(**kwargs)


def build_layer(config: Any, dispatcher_type: str) -> Any:
    """A Megatron ``MoELayer`` with the local (non-TransformerEngine) spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    config = dataclasses.replace(config, moe_token_dispatcher_type=dispatcher_type)
    spec = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts).mlp
    layer = MoELayer(config, get_submodules(spec))
    layer.set_layer_number(0)
    return layer.to(config.params_dtype)


def _grads(layer: Any) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).float()
        for name, p in layer.named_parameters()
    }


def run_steps(layer: Any, case: dict[str, Any], *, steps: int = 2) -> dict[str, Any]:
    """``steps`` forward/backward passes with per-rank inputs; output, input grads, param grads."""
    rank = dist.get_rank()
    dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
    S, B, H = case.get("S", 6), 2, case.get("H", 16)
    outs, dxs = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + 17 * rank + case.get("seed", 0))
        x = torch.randn(S, B, H, generator=gen).to(dtype)
        if case.get("all_to_rank0") and rank == 1:
            x = x.abs()  # with the biased router of the case, routed to rank 0's experts
        w = torch.randn(S, B, H, generator=gen).to(dtype)
        x.requires_grad_(True)
        out, _ = layer(x)
        (out.float() * w.float()).sum().backward()
        outs.append(out.detach().float())
        dxs.append(x.grad.float())
    return {"out": torch.stack(outs), "dx": torch.stack(dxs), "grads": _grads(layer)}


def max_gaps(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest |a - b| of the output, the input gradient and every parameter gradient."""
    gaps = {
        "out": float((a["out"] - b["out"]).abs().max()),
        "dx": float((a["dx"] - b["dx"]).abs().max()),
    }
    if a["grads"].keys() != b["grads"].keys():
        raise AssertionError(f"parameters differ: {sorted(a['grads'])} vs {sorted(b['grads'])}")
    gaps["params"] = max(
        (float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"]), default=0.0
    )
    return gaps


def _route_all_to_rank0(layer: Any, num_experts: int, num_ranks: int) -> None:
    """Router weights that send every token with positive features to rank 0's experts."""
    e = num_experts // num_ranks
    with torch.no_grad():
        weight = layer.router.weight
        weight.copy_(torch.linspace(0.5, 1.0, weight.numel()).reshape(weight.shape))
        weight[e:] *= -1


def compare(case: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: Megatron's all-to-all dispatcher vs flexdispatch (``install()``),
    same weights, same inputs; the largest gaps, the reference's magnitudes and the number of
    ``FlexDispatcher.dispatch`` calls the flexdispatch layer made."""
    import flexdispatch.integrations.megatron as fd_megatron
    from flexdispatch import DispatchConfig

    ensure_parallel(ep=case.get("ep", 2), etp=case.get("etp", 1))
    config = transformer_config(case)
    dispatch = DispatchConfig(backend="torch", num_worst_tokens=case.get("W", 0))
    with cpu_shims(reference=True):
        torch.manual_seed(1234)
        ref = build_layer(config, "alltoall")
        fd_megatron.install(dispatch)
        try:
            flex = build_layer(config, "flex")
        finally:
            fd_megatron.uninstall()
        flex.load_state_dict(ref.state_dict())
        if case.get("all_to_rank0"):
            _route_all_to_rank0(ref, config.num_moe_experts, dist.get_world_size())
            _route_all_to_rank0(flex, config.num_moe_experts, dist.get_world_size())
        manager = flex.token_dispatcher._comm_manager
        if case.get("broken_combine"):  # the negative control: a combine that halves its sum
            right = manager.combine
            manager.combine = lambda y, *a, **k: 0.5 * right(y, *a, **k)
        want = run_steps(ref, case)
        got = run_steps(flex, case)
    stats = flex.token_dispatcher.dispatcher.stats
    ulps = {}
    if case.get("dtype") == "bf16":
        ulps = {
            "out_ulps": bf16_ulps(got["out"], want["out"]),
            "dx_ulps": bf16_ulps(got["dx"], want["dx"]),
            "params_ulps": max(bf16_ulps(got["grads"][n], want["grads"][n]) for n in want["grads"]),
        }
    return {
        **max_gaps(got, want),
        **ulps,
        "ref_out": float(want["out"].abs().max()),
        "ref_dx": float(want["dx"].abs().max()),
        "dispatch_calls": stats.dispatch_calls,
        "rows_received": stats.rows_received,
        "dispatcher": type(flex.token_dispatcher).__name__,
        "manager": type(manager).__name__,
    }


def _permutation(dispatcher: Any, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Megatron's dispatcher pipeline up to the experts: (rows, tokens per expert, row probs)."""
    x, probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    x, probs = dispatcher.token_dispatch(x, probs)
    return dispatcher.dispatch_postprocess(x, probs)


def _unpermutation(dispatcher: Any, rows: torch.Tensor) -> torch.Tensor:
    rows = dispatcher.combine_preprocess(rows)
    rows = dispatcher.token_combine(rows)
    return dispatcher.combine_postprocess(rows)


def dispatcher_properties(case: dict[str, Any]) -> dict[str, Any]:
    """The properties Megatron's own dispatcher tests check (test_token_dispatcher.py, tag
    core_v0.19.0: ``dispatcher_dropless_test``, ``dispatcher_capacity_test``,
    ``dispatcher_router_padding_for_fp8_test``), run through the plug-in's flex dispatcher:

    - ``round_trip``: probs 1/k on every expert; dispatch -> rows x probs -> combine restores the
      input (divided by the expert-TP size), and the input's gradient equals the input;
    - ``capacity``: tokens per expert at most capacity x ep x etp, the restored output (and the
      gradient) equal ``x * sum of the kept probs``;
    - ``padding``: with ``moe_router_padding_for_quantization`` (fp8: align 16) every local
      expert's row count is a multiple of 16 and sums to the rows, and output and gradient equal
      the unpadded run's.

    Returns the largest gaps and the counts, for the test to judge.
    """
    import flexdispatch.integrations.megatron as fd_megatron
    from flexdispatch import DispatchConfig

    ep, etp = case.get("ep", 2), case.get("etp", 1)
    ensure_parallel(ep=ep, etp=etp)
    config = transformer_config({"E": 8, "k": 2, "H": 32, **case})
    torch.manual_seed(123 + dist.get_rank())
    out: dict[str, Any] = {}
    with cpu_shims(reference=False):
        fd_megatron.install(DispatchConfig(backend="torch"))
        try:
            layer = build_layer(config, "flex")
            # round trip (dispatcher_dropless_test)
            x = torch.randn(32, 8, config.hidden_size).requires_grad_(True)
            probs, routing_map = layer.router(x)
            probs = torch.ones_like(probs) / config.moe_router_topk
            rows, tokens_per_expert, row_probs = _permutation(
                layer.token_dispatcher, x, probs, routing_map
            )
            restored = _unpermutation(layer.token_dispatcher, rows * row_probs.unsqueeze(-1))
            restored = restored / etp
            restored.backward(x.detach())
            out["round_trip"] = float((restored - x).abs().max())
            out["round_trip_grad"] = float((x.grad - x).abs().max())
            out["round_trip_rows"] = int(tokens_per_expert.sum())

            # capacity (dispatcher_capacity_test)
            capped = build_layer(
                dataclasses.replace(
                    config, moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs"
                ),
                "flex",
            )
            capped.load_state_dict(layer.state_dict())
            T = 16
            x = torch.randn(T, config.hidden_size).requires_grad_(True)
            probs, routing_map = capped.router(x)
            kept = (probs != 0).float() / config.moe_router_topk
            answer = x.detach() * kept.sum(dim=1, keepdim=True)
            rows, tokens_per_expert, row_probs = _permutation(
                capped.token_dispatcher, x, kept, routing_map
            )
            capacity = -(-T * config.moe_router_topk * 0.5 // config.num_moe_experts)
            out["capacity_limit"] = int(capacity * ep * etp)
            out["capacity_max_rows"] = int(tokens_per_expert.max())
            out["capacity_dropped"] = int((probs != 0).sum() < T * config.moe_router_topk)
            restored = _unpermutation(capped.token_dispatcher, rows * row_probs.unsqueeze(-1) / etp)
            restored.backward(x.detach())
            out["capacity"] = float((restored - answer).abs().max())
            out["capacity_grad"] = float((x.grad - answer).abs().max())

            # router padding for quantization (dispatcher_router_padding_for_fp8_test)
            results = []
            for pad in (False, True):
                cfg = transformer_config({"E": 8, "k": 2, "H": 32, **case})
                if pad:  # NOTE: set after validation: fp8 configs ask for TransformerEngine
                    cfg.fp8, cfg.moe_router_padding_for_quantization = "hybrid", True
                padded = _build_layer_as_is(cfg)
                padded.load_state_dict(layer.state_dict())
                x = torch.randn(32, config.hidden_size, generator=torch.Generator().manual_seed(5))
                x.requires_grad_(True)
                probs, routing_map = padded.router(x)
                rows, tokens_per_expert, row_probs = _permutation(
                    padded.token_dispatcher, x, probs, routing_map
                )
                restored = _unpermutation(padded.token_dispatcher, rows * row_probs.unsqueeze(-1))
                restored.backward(restored.detach())
                results.append((restored.detach(), x.grad, tokens_per_expert, rows.shape[0]))
            (r0, g0, _, _), (r1, g1, counts, nrows) = results
            out["padding"] = float((r1 - r0).abs().max())
            out["padding_grad"] = float((g1 - g0).abs().max())
            out["padding_counts"] = counts.tolist()
            out["padding_rows"] = nrows
            out["padding_align"] = padded.token_dispatcher._comm_manager.align
            out["dispatch_calls"] = padded.token_dispatcher.dispatcher.stats.dispatch_calls
        finally:
            fd_megatron.uninstall()
    return out


def _build_layer_as_is(config: Any) -> Any:
    """``build_layer`` without re-validating the config (``dataclasses.replace`` would)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    config.moe_token_dispatcher_type = "flex"
    spec = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts).mlp
    layer = MoELayer(config, get_submodules(spec))
    layer.set_layer_number(0)
    return layer


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in units of the bfloat16 ulp at the scale of ``want`` (its largest
    magnitude): the rounding a bf16 sum of that size may differ by."""
    got, want = got.float(), want.float()
    if not want.numel():
        return 0.0
    scale = want.abs().max().clamp_min(torch.finfo(torch.bfloat16).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)  # NOTE: bf16 keeps 7 mantissa bits
    return float((got - want).abs().max() / ulp)


def plugin_lifecycle() -> dict[str, Any]:
    """install() rebinds the name MoELayer looks up, uninstall() gives Megatron's class back, the
    refusals name the option, and a "hybridep" layer keeps Megatron's own manager."""
    from megatron.core.transformer.moe import moe_layer

    import flexdispatch.integrations.megatron as fd_megatron

    ensure_parallel(ep=2, etp=1)
    original = moe_layer.MoEFlexTokenDispatcher
    out: dict[str, Any] = {}
    with cpu_shims(reference=False):
        fd_megatron.install()
        try:
            out["installed"] = moe_layer.MoEFlexTokenDispatcher.__name__
            out["default_backend"] = fd_megatron.installed_config().backend
            config = transformer_config({"E": 4, "k": 2})
            layer = build_layer(config, "flex")
            out["backend_name"] = layer.token_dispatcher.dispatcher.backend_name
            out["cudagraph_attrs"] = list(layer.token_dispatcher.cudagraph_attrs)
            config.moe_permute_fusion = True  # NOTE: accepted, not used: said once per process
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                _build_layer_as_is(config), _build_layer_as_is(config)
            out["permute_fusion"] = [str(w.message) for w in said if "permute" in str(w.message)]
            config.moe_permute_fusion = False
            config.moe_pad_expert_input_to_capacity = True  # NOTE: after Megatron's own checks
            try:
                _build_layer_as_is(config)
            except ValueError as exc:
                out["refusal"] = str(exc)
            config.moe_pad_expert_input_to_capacity = False
            config.moe_flex_dispatcher_num_sms = 24
            sms = _build_layer_as_is(config).token_dispatcher.dispatcher.config.deepep_num_sms
            out["num_sms"] = sms
            config.moe_flex_dispatcher_num_sms = 21  # NOTE: odd: DispatchConfig's own check
            try:
                _build_layer_as_is(config)
            except ValueError as exc:
                out["odd_num_sms"] = str(exc)
            config.moe_flex_dispatcher_num_sms = None
            config.moe_flex_dispatcher_backend = "hybridep"
            try:
                other = _build_layer_as_is(config)
                out["hybridep_manager"] = type(other.token_dispatcher._comm_manager).__name__
            except ImportError as exc:  # Megatron's HybridEP manager needs its library
                out["hybridep_manager"] = f"ImportError: {exc}"
        finally:
            fd_megatron.uninstall()
    out["restored"] = moe_layer.MoEFlexTokenDispatcher is original
    out["config_after"] = fd_megatron.installed_config()
    return out
