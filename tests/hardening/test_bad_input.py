"""Bad input at every public entry point: a clear exception, raised before any collective.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · M received rows · W worst-case rows.

``ERRORS`` is the matrix behind the table in ``docs/errors.md`` (entry point x bad input ->
exception type and message; every row's id appears there). Inputs that are unusual but valid —
non-contiguous tensors, ``-1``-only ids, empty batches, ids outside ``[0, E)`` with checks off —
must give the right answer, which is checked against slow per-token loops. The spawned-group test
at the end has only rank 1 pass a bad tensor: rank 1 raises before issuing any collective, and
rank 0 fails within the process-group timeout with a ``CollectiveError``, whether rank 1 leaves
the group or stays alive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flexdispatch import (
    DispatchConfig,
    FlexDispatcher,
    MoEConfig,
    MoELayer,
    RouterConfig,
    TopKRouter,
    get_dispatch_layout,
    load_config,
    permute,
    routing_map_to_topk,
    topk_routing,
    unpermute,
)
from flexdispatch._checks import tensors
from flexdispatch.cli import main as cli_main
from flexdispatch.dispatch import ops
from flexdispatch.integrations import megatron as fd_megatron
from tests.dist.reference import Inputs, ref_dispatch
from tests.hardening import spawn_recorded

E, K, H, T = 8, 2, 4, 5
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "errors.md"
META = torch.device("meta")


def _x() -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(1))


def _idx() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()


def _probs() -> torch.Tensor:
    return torch.rand(T, K, generator=torch.Generator().manual_seed(3))


def _logits() -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(4))


def _routing_map() -> torch.Tensor:
    return torch.zeros(T, E, dtype=torch.bool).scatter_(1, _idx(), True)


def _router_cfg(**kw: Any) -> RouterConfig:
    return RouterConfig(num_experts=E, topk=K, **kw)


def _moe_cfg(**dispatch: Any) -> MoEConfig:
    return MoEConfig(
        hidden_size=H, ffn_hidden_size=6, router=_router_cfg(), dispatch=DispatchConfig(**dispatch)
    )


def _unpermute_impl(impl: str) -> torch.Tensor:
    perm = permute(_x(), _idx(), E)
    return unpermute(perm.x, perm, impl=impl)


def _disp(**kw: Any) -> FlexDispatcher:
    return FlexDispatcher(DispatchConfig(**kw), num_experts=E)


def _with_nan(x: torch.Tensor) -> torch.Tensor:
    x[2, 1] = float("nan")
    return x


def _deferred_check(
    x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor, *, screened: bool = False
) -> None:
    """Dispatch on the CUDA-without-checks path (forced), then the safe-point check.
    ``screened``: as a backend that counts no bad ids itself does (DeepEP: the dispatcher screens
    the values on the device; the torch backend checks no value with checks off)."""
    saved = tensors.defer_value_checks
    tensors.defer_value_checks = lambda device: True
    try:
        d = _disp()
        if screened:
            d.backend.counts_bad_ids = False  # type: ignore[misc]
        d.dispatch(x, idx, probs)
    finally:
        tensors.defer_value_checks = saved
    d.check_overflow()


def _unchecked(x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor) -> None:
    """Dispatch with checks off on CPU (nothing forced), then the safe-point check."""
    d = _disp()
    d.dispatch(x, idx, probs)
    d.check_overflow()


def _combine(y: Callable[[torch.Tensor], Any], handle: Callable[[Any], Any] = lambda h: h) -> Any:
    d = _disp()
    res = d.dispatch(_x(), _idx(), _probs())
    return d.combine(y(res.recv_x), handle(res.handle))


def _op_combine(handle: torch.Tensor) -> Any:
    d = _disp()
    return torch.ops.flexdispatch.combine(torch.zeros(T, H), handle, d._op_id, T)


def _perm() -> Any:
    return permute(_x(), _idx(), E, topk_probs=_probs())


def _unpermute(y: Callable[[torch.Tensor], Any], **kw: Any) -> Any:
    perm = _perm()
    return unpermute(y(perm.x), perm, **kw)


def _bad_yaml(tmp: Path) -> str:
    path = tmp / "bad.yaml"
    path.write_text("hidden_size: [1, 2\n")
    return str(path)


def _bad_field_yaml(tmp: Path) -> str:
    path = tmp / "bad_field.yaml"
    path.write_text("hidden_size: 4\nffn_hidden_size: 4\nrouter: {num_experts: 4, topk: 9}\n")
    return str(path)


def _fifo(tmp: Path) -> str:
    path = tmp / "fifo.yaml"
    os.mkfifo(path)
    return str(path)


def _nested_x() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NOTE: the prototype warning of strided nested tensors
        return torch.nested.nested_tensor(list(_x()))


def _out_of_range() -> torch.Tensor:
    idx = _idx()
    idx[1, 0] = E
    return idx


# (id, thunk (gets a tmp folder), exception type, regex on the message)
ERRORS: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    # ---- configs (pydantic's ValidationError is a ValueError; every message names the field)
    ("RouterConfig/topk-above-E", lambda t: RouterConfig(num_experts=4, topk=5), ValueError,
     r"topk=5 exceeds num_experts=4: set topk <= num_experts"),
    ("RouterConfig/zero-experts", lambda t: RouterConfig(num_experts=0, topk=1), ValueError,
     r"num_experts\n  Input should be greater than 0"),
    ("RouterConfig/topk-above-32", lambda t: RouterConfig(num_experts=64, topk=33), ValueError,
     r"topk\n  Input should be less than or equal to 32"),
    ("RouterConfig/unknown-field", lambda t: RouterConfig(num_experts=4, topk=1, top_k=2),
     ValueError, r"top_k\n  Extra inputs are not permitted"),
    ("RouterConfig/unknown-impl", lambda t: _router_cfg(impl="cuda"), ValueError,
     r"impl\n  Input should be 'auto', 'torch' or 'triton'"),
    ("RouterConfig/groups-not-dividing", lambda t: _router_cfg(num_groups=3, group_topk=1),
     ValueError, r"num_experts=8 is not divisible by num_groups=3"),
    ("RouterConfig/group-without-topk", lambda t: _router_cfg(num_groups=2), ValueError,
     r"num_groups and group_topk go together"),
    ("RouterConfig/bias-with-softmax", lambda t: _router_cfg(enable_expert_bias=True),
     ValueError, r"enable_expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus'"),
    ("RouterConfig/triton-fp64", lambda t: _router_cfg(impl="triton", router_dtype="fp64"),
     ValueError, r"impl='triton' routes float32/bfloat16/float16 logits, but router_dtype='fp64'"),
    ("RouterConfig/aux-without-coeff", lambda t: _router_cfg(aux_loss_type="aux_loss"),
     ValueError, r"aux_loss_type='aux_loss' with aux_loss_coeff=0"),
    ("RouterConfig/bool-topk", lambda t: RouterConfig(num_experts=4, topk=True), ValueError,
     r"topk\n  Value error, true is not a number \(YAML also reads yes/no and on/off as "
     r"true/false\): write the number"),
    ("RouterConfig/infinite-aux-coeff",
     lambda t: _router_cfg(aux_loss_type="aux_loss", aux_loss_coeff=float("inf")), ValueError,
     r"aux_loss_coeff\n  Input should be a finite number"),
    ("RouterConfig/infinite-capacity", lambda t: _router_cfg(capacity_factor=float("inf")),
     ValueError, r"capacity_factor\n  Input should be a finite number"),
    ("DispatchConfig/negative-W", lambda t: DispatchConfig(num_worst_tokens=-1), ValueError,
     r"num_worst_tokens\n  Input should be greater than or equal to 0"),
    ("DispatchConfig/graph-dropless", lambda t: DispatchConfig(cuda_graph=True), ValueError,
     r"cuda_graph=True with a dropless dispatch.*set num_worst_tokens > 0"),
    ("DispatchConfig/unknown-backend", lambda t: DispatchConfig(backend="nccl"), ValueError,
     r"backend\n  Input should be 'auto', 'torch' or 'deepep'"),
    ("DispatchConfig/odd-num-sms", lambda t: DispatchConfig(deepep_num_sms=3), ValueError,
     r"deepep_num_sms=3 must be even"),
    ("MoEConfig/no-router", lambda t: MoEConfig(hidden_size=4, ffn_hidden_size=4), ValueError,
     r"router\n  Field required"),
    ("MoEConfig/world-not-dividing-E", lambda t: _moe_cfg().check_world(3), ValueError,
     r"router.num_experts=8 is not divisible by the expert-parallel world size 3"),
    ("MoEConfig/W-not-multiple-of-R", lambda t: _moe_cfg(num_worst_tokens=5).check_world(2),
     ValueError, r"num_worst_tokens=5 is not a multiple of the world size 2: round it up to 6"),
    ("load_config/unknown-preset", lambda t: load_config("nope"), ValueError,
     r"unknown preset 'nope': choose one of .*tiny_cpu"),
    ("load_config/missing-file", lambda t: load_config(t / "missing.yaml"), ValueError,
     r"missing.yaml does not exist"),
    ("load_config/invalid-yaml", lambda t: load_config(_bad_yaml(t)), ValueError,
     r"is not valid YAML"),
    ("load_config/invalid-field", lambda t: load_config(_bad_field_yaml(t)), ValueError,
     r"(?s)is invalid:.*topk=9 exceeds num_experts=4"),
    ("load_config/fifo", lambda t: load_config(_fifo(t)), ValueError,
     r"config file .*fifo.yaml is not a regular file \(a FIFO\): pass a YAML or JSON config"),
    ("load_config/device", lambda t: load_config("/dev/zero"), ValueError,
     r"config file /dev/zero is not a regular file \(a character device\)"),
    # ---- topk_routing
    ("topk_routing/int-logits", lambda t: topk_routing(_logits().long(), topk=K), TypeError,
     r"logits must be a floating-point tensor, got int64"),
    ("topk_routing/1d-logits", lambda t: topk_routing(_logits()[0], topk=K), ValueError,
     r"logits must be 2-D, got shape \(8,\)"),
    ("topk_routing/topk-above-E", lambda t: topk_routing(_logits(), topk=9), ValueError,
     r"topk must be an int in \[1, num_experts=8\].*got 9"),
    ("topk_routing/topk-bool", lambda t: topk_routing(_logits(), topk=True), ValueError,
     r"topk must be an int in \[1, num_experts=8\].*got True"),
    ("topk_routing/no-experts", lambda t: topk_routing(torch.zeros(T, 0), topk=1), ValueError,
     r"topk must be an int in \[1, num_experts=0\]"),
    ("topk_routing/nan-logits-checked",
     lambda t: topk_routing(_logits().index_fill(0, torch.tensor([2]), float("nan")), topk=K,
                            checks=True),
     ValueError, r"logits holds 8 NaN/inf value\(s\): check the inputs of the router"),
    ("topk_routing/inf-logits-checked",
     lambda t: topk_routing(_logits().index_fill(1, torch.tensor([0]), float("inf")), topk=K,
                            checks=True),
     ValueError, r"logits holds 5 NaN/inf value\(s\)"),
    ("topk_routing/bias-wrong-size",
     lambda t: topk_routing(_logits(), topk=K, score_function="sigmoid",
                            expert_bias=torch.zeros(3)),
     ValueError, r"expert_bias must have shape \[num_experts=8\], got \(3,\)"),
    ("topk_routing/bias-other-device",
     lambda t: topk_routing(_logits(), topk=K, score_function="sigmoid",
                            expert_bias=torch.zeros(E, device=META)),
     ValueError, r"expert_bias is on meta but logits is on cpu: move both to the same device"),
    ("topk_routing/bias-with-softmax",
     lambda t: topk_routing(_logits(), topk=K, expert_bias=torch.zeros(E)), ValueError,
     r"expert_bias is not applied with score_function='softmax'"),
    ("topk_routing/bad-capacity", lambda t: topk_routing(_logits(), topk=K, capacity_factor=0),
     ValueError, r"capacity_factor must be a positive finite number or None, got 0"),
    ("topk_routing/infinite-capacity",
     lambda t: topk_routing(_logits(), topk=K, capacity_factor=float("inf")), ValueError,
     r"capacity_factor must be a positive finite number or None, got inf"),
    ("topk_routing/unknown-impl", lambda t: topk_routing(_logits(), topk=K, impl="cuda"),
     ValueError, r"topk_routing: impl must be one of auto, torch, triton, got 'cuda'"),
    ("topk_routing/bad-score-function",
     lambda t: topk_routing(_logits(), topk=K, score_function="tanh"), ValueError,
     r"score_function must be one of softmax, sigmoid, sqrtsoftplus, got 'tanh'"),
    ("topk_routing/groups-too-small",
     lambda t: topk_routing(_logits(), topk=4, num_groups=4, group_topk=1, group_score="max"),
     ValueError, r"group_topk=1 groups of 2 experts hold fewer than topk=4 experts"),
    # ---- routing_map_to_topk
    ("routing_map_to_topk/int-map",
     lambda t: routing_map_to_topk(_routing_map().long(), _logits(), K), TypeError,
     r"routing_map must have dtype bool, got int64"),
    ("routing_map_to_topk/shape-mismatch",
     lambda t: routing_map_to_topk(_routing_map(), _logits()[:, :4], K), ValueError,
     r"probs has shape \(5, 4\) but routing_map has \(5, 8\)"),
    ("routing_map_to_topk/topk-above-E",
     lambda t: routing_map_to_topk(_routing_map(), _logits(), 9), ValueError,
     r"topk must be in \[1, E=8\] \(the map's columns\), got 9"),
    ("routing_map_to_topk/too-many-experts",
     lambda t: routing_map_to_topk(_routing_map(), _logits(), 1), ValueError,
     r"routing_map marks 2 experts for token 0 \(and 5 token\(s\) in all\) but topk=1"),
    ("routing_map_to_topk/other-device",
     lambda t: routing_map_to_topk(_routing_map(), _logits().to(META), K), ValueError,
     r"probs is on meta but routing_map is on cpu"),
    # ---- flexdispatch.integrations.megatron
    ("megatron.install/config-type", lambda t: fd_megatron.install(_router_cfg()), TypeError,
     r"dispatch_config must be a flexdispatch DispatchConfig or None, got RouterConfig"),
    # ---- TopKRouter
    ("TopKRouter/config-type", lambda t: TopKRouter(_moe_cfg(), H), TypeError,
     r"config must be a RouterConfig, got MoEConfig"),
    ("TopKRouter/zero-hidden", lambda t: TopKRouter(_router_cfg(), 0), ValueError,
     r"hidden_size must be a positive int, got 0"),
    ("TopKRouter/wrong-hidden", lambda t: TopKRouter(_router_cfg(), H)(torch.randn(T, H + 1)),
     ValueError, r"hidden has last dimension 5 but the router was built with hidden_size=4"),
    ("TopKRouter/int-hidden", lambda t: TopKRouter(_router_cfg(), H)(_x().long()), TypeError,
     r"hidden must be a floating-point tensor, got int64"),
    ("TopKRouter/1d-hidden", lambda t: TopKRouter(_router_cfg(), H)(_x()[0]), ValueError,
     r"hidden must be 2-D or 3-D, got shape \(4,\)"),
    ("TopKRouter/other-device", lambda t: TopKRouter(_router_cfg(), H)(_x().to(META)),
     ValueError, r"hidden is on meta but the router weight is on cpu"),
    ("TopKRouter/nan-hidden-checked",
     lambda t: TopKRouter(_router_cfg(), H)(torch.full((T, H), float("nan")), checks=True),
     ValueError, r"logits holds 40 NaN/inf value\(s\)"),
    ("TopKRouter/hash-without-ids",
     lambda t: TopKRouter(_router_cfg(router_type="hash"), H)(_x()), ValueError,
     r"token_ids is required when config.router_type='hash'"),
    # ---- get_dispatch_layout
    ("get_dispatch_layout/int32-ids", lambda t: get_dispatch_layout(_idx().int(), E, 2),
     TypeError, r"topk_idx must have dtype int64, got int32: convert it with .to"),
    ("get_dispatch_layout/1d-ids", lambda t: get_dispatch_layout(_idx()[:, 0], E, 2),
     ValueError, r"topk_idx must be 2-D, got shape \(5,\)"),
    ("get_dispatch_layout/list-ids", lambda t: get_dispatch_layout([[0, 1]], E, 2), TypeError,
     r"topk_idx must be a torch.Tensor, got list"),
    ("get_dispatch_layout/float-E", lambda t: get_dispatch_layout(_idx(), 8.0, 2), TypeError,
     r"num_experts must be an int, got float 8.0"),
    ("get_dispatch_layout/R-not-dividing-E", lambda t: get_dispatch_layout(_idx(), E, 3),
     ValueError, r"num_experts=8 is not divisible by num_ranks=3"),
    ("get_dispatch_layout/zero-ranks", lambda t: get_dispatch_layout(_idx(), E, 0), ValueError,
     r"num_experts \(8\) and num_ranks \(0\) must be positive"),
    ("get_dispatch_layout/L-not-dividing-R",
     lambda t: get_dispatch_layout(_idx(), E, 4, ranks_per_node=3), ValueError,
     r"num_ranks=4 is not a multiple of ranks_per_node=3"),
    ("get_dispatch_layout/out-of-range-checked",
     lambda t: get_dispatch_layout(_out_of_range(), E, 2, checks=True), ValueError,
     r"topk_idx holds 1 id\(s\) outside \[-1, 8\) \(first: 8\)"),
    # ---- permute / unpermute
    ("permute/int-x", lambda t: permute(_x().long(), _idx(), E), TypeError,
     r"x must be a floating-point tensor, got int64"),
    ("permute/int32-ids", lambda t: permute(_x(), _idx().int(), E), TypeError,
     r"topk_idx must have dtype int64, got int32"),
    ("permute/rows-mismatch", lambda t: permute(_x()[:3], _idx(), E), ValueError,
     r"topk_idx has 5 rows but x has 3"),
    ("permute/ids-other-device", lambda t: permute(_x(), _idx().to(META), E), ValueError,
     r"topk_idx is on meta but x is on cpu: move both to the same device"),
    ("permute/probs-shape", lambda t: permute(_x(), _idx(), E, topk_probs=_probs()[:, :1]),
     ValueError, r"topk_probs has shape \(5, 1\) but topk_idx has \(5, 2\)"),
    ("permute/float-E", lambda t: permute(_x(), _idx(), 8.0), TypeError,
     r"num_experts must be an int, got float"),
    ("permute/zero-align", lambda t: permute(_x(), _idx(), E, align=0), ValueError,
     r"align must be >= 1, got 0"),
    ("permute/unknown-impl", lambda t: permute(_x(), _idx(), E, impl="cuda"), ValueError,
     r"permute: impl must be one of auto, torch, triton, got 'cuda'"),
    ("unpermute/unknown-impl", lambda t: _unpermute_impl("cuda"), ValueError,
     r"unpermute: impl must be one of auto, torch, triton, got 'cuda'"),
    ("permute/static-rows-too-few", lambda t: permute(_x(), _idx(), E, align=2, static_rows=9),
     ValueError, r"static_rows=9 is below the static bound .* = 5\*2 \+ 8\*1 = 18"),
    ("permute/out-of-range-checked", lambda t: permute(_x(), _out_of_range(), E, checks=True),
     ValueError, r"topk_idx holds 1 id\(s\) outside \[-1, 8\)"),
    ("unpermute/not-a-permutation", lambda t: unpermute(_x(), "perm"), TypeError,
     r"perm must be the Permutation returned by permute"),
    ("unpermute/rows-mismatch", lambda t: _unpermute(lambda y: y[:-1]), ValueError,
     r"y has 9 rows but perm has 10"),
    ("unpermute/hidden-mismatch", lambda t: _unpermute(lambda y: torch.cat([y, y], 1)),
     ValueError, r"y has hidden size 8 but perm.x has 4"),
    ("unpermute/other-device", lambda t: _unpermute(lambda y: y.to(META)), ValueError,
     r"y is on meta but perm.row_token is on cpu"),
    ("unpermute/2d-probs", lambda t: _unpermute(lambda y: y, probs=torch.ones(10, 1)),
     ValueError, r"probs must be 1-D, got shape \(10, 1\)"),
    # ---- FlexDispatcher
    ("FlexDispatcher/config-type", lambda t: FlexDispatcher({}, num_experts=E), TypeError,
     r"config must be a DispatchConfig, got dict"),
    ("FlexDispatcher/bool-experts", lambda t: FlexDispatcher(DispatchConfig(), num_experts=True),
     ValueError, r"num_experts must be a positive int, got True"),
    ("FlexDispatcher/deepep-unavailable", lambda t: _disp(backend="deepep"), ValueError,
     r"deepep backend not available: .*use backend='torch' or 'auto'"),
    ("dispatch/1d-x", lambda t: _disp().dispatch(_x()[0], _idx(), _probs()), ValueError,
     r"x must be 2-D, got shape \(4,\)"),
    ("dispatch/float64-x", lambda t: _disp().dispatch(_x().double(), _idx(), _probs()),
     TypeError, r"x must be bfloat16, float16 or float32, got float64: convert it"),
    ("dispatch/int-x", lambda t: _disp().dispatch(_x().long(), _idx(), _probs()), TypeError,
     r"x must be a floating-point tensor, got int64"),
    ("dispatch/sparse-x", lambda t: _disp().dispatch(_x().to_sparse(), _idx(), _probs()),
     TypeError, r"x must be a dense \(strided\) tensor, got layout torch.sparse_coo: convert it "
     r"with .to_dense\(\)"),
    ("dispatch/nested-x", lambda t: _disp().dispatch(_nested_x(), _idx(), _probs()), TypeError,
     r"x must be a dense \(strided\) tensor, got a nested tensor"),
    ("dispatch/int32-ids", lambda t: _disp().dispatch(_x(), _idx().int(), _probs()), TypeError,
     r"topk_idx must have dtype int64, got int32"),
    ("dispatch/float64-probs", lambda t: _disp().dispatch(_x(), _idx(), _probs().double()),
     TypeError, r"topk_probs must have dtype float32, got float64: convert it"),
    ("dispatch/rows-mismatch", lambda t: _disp().dispatch(_x()[:3], _idx(), _probs()),
     ValueError, r"topk_idx has 5 rows but x has 3: one row of expert ids per token"),
    ("dispatch/probs-shape", lambda t: _disp().dispatch(_x(), _idx(), _probs()[:, :1]),
     ValueError, r"topk_probs has shape \(5, 1\) but topk_idx has \(5, 2\)"),
    ("dispatch/zero-k", lambda t: _disp().dispatch(_x(), _idx()[:, :0], _probs()[:, :0]),
     ValueError, r"topk_idx must have at least one column"),
    ("dispatch/ids-other-device", lambda t: _disp().dispatch(_x(), _idx().to(META), _probs()),
     ValueError, r"topk_idx is on meta but x is on cpu: move both to the same device"),
    ("dispatch/meta-tensors",
     lambda t: _disp().dispatch(_x().to(META), _idx().to(META), _probs().to(META)), ValueError,
     r"x is on the meta device \(shapes only, no data\)"),
    ("dispatch/layout-mismatch",
     lambda t: _disp().dispatch(_x(), _idx(), _probs(), layout=get_dispatch_layout(
         _idx()[:2], E, 1)), ValueError,
     r"layout.is_token_in_rank must be a \[5, 1\] bool tensor, got \(2, 1\)"),
    ("dispatch/out-of-range-checked",
     lambda t: _disp(checks=True).dispatch(_x(), _out_of_range(), _probs()), ValueError,
     r"topk_idx holds 1 id\(s\) outside \[-1, 8\) \(first: 8\)"),
    ("dispatch/out-of-range-cpu",
     lambda t: _disp(checks=True).dispatch(_x(), _out_of_range(), _probs()), ValueError,
     r"topk_idx holds 1 id\(s\) outside \[-1, 8\) \(first: 8\), distinct bad ids \[8\]: expert "
     r"ids must be -1 \(dropped\) or in \[0, 8\); the dispatcher was built for num_experts=8"),
    ("dispatch/nan-x-cpu",
     lambda t: _disp(checks=True).dispatch(_with_nan(_x()), _idx(), _probs()),
     ValueError, r"x holds 1 NaN/inf value\(s\): check the layer that feeds the MoE block"),
    ("dispatch/nan-probs-cpu",
     lambda t: _disp(checks=True).dispatch(_x(), _idx(), _with_nan(_probs())),
     ValueError, r"topk_probs holds 1 NaN/inf value\(s\): check the router's logits"),
    ("check_overflow/out-of-range-unchecked",
     lambda t: _unchecked(_x(), _out_of_range(), _probs()), ValueError,
     r"topk_idx held 1 id\(s\) outside \[-1, 8\) \(highest 8\) since the dispatcher was built; "
     r"they were treated as -1"),
    ("check_overflow/out-of-range-cuda",
     lambda t: _deferred_check(_x(), _out_of_range(), _probs()), ValueError,
     r"topk_idx held 1 id\(s\) outside \[-1, 8\) \(highest 8\) since the dispatcher was built; "
     r"they were treated as -1"),
    ("check_overflow/nan-x-cuda",
     lambda t: _deferred_check(_with_nan(_x()), _idx(), _probs(), screened=True),
     ValueError, r"x held 1 NaN/inf value\(s\) since the dispatcher was built"),
    ("combine/foreign-handle", lambda t: _combine(lambda y: y, lambda h: object()), TypeError,
     r"handle must be the DispatchHandle of this dispatcher's dispatch"),
    ("combine/wrong-rows", lambda t: _combine(lambda y: y[:-1]), ValueError,
     r"y must have shape \[\d+, 4\] \(the rows dispatch returned\), got"),
    ("combine/int-y", lambda t: _combine(lambda y: y.long()), TypeError,
     r"y must be a floating-point tensor, got int64"),
    ("combine/meta-y", lambda t: _combine(lambda y: y.to(META)), ValueError,
     r"y is on the meta device"),
    # ---- the custom ops (flexdispatch.dispatch.ops, docs/compile.md)
    ("ops/set-eager-not-bool", lambda t: ops.set_eager_ops(1), TypeError,
     r"enabled must be a bool, got int"),
    ("ops/stale-handle", lambda t: _op_combine(torch.tensor([10**9, -1])), RuntimeError,
     r"dispatch handle #1000000000 is not registered: combine with the handle tensor its "
     r"dispatch returned"),
    ("ops/unknown-dispatcher", lambda t: torch.ops.flexdispatch.dispatch(_x(), _idx(), _probs(),
     torch.tensor([10**9]), 0, 2), RuntimeError,
     r"no live FlexDispatcher #1000000000 in this process"),
    # ---- MoELayer
    ("MoELayer/config-type", lambda t: MoELayer(_router_cfg()), TypeError,
     r"config must be a MoEConfig, got RouterConfig"),
    ("MoELayer/dtype-string", lambda t: MoELayer(_moe_cfg(), dtype="float32"), TypeError,
     r"dtype must be a floating-point torch.dtype such as torch.bfloat16 or torch.float32, got "
     r"'float32'"),
    ("MoELayer/unknown-device", lambda t: MoELayer(_moe_cfg(), device="nope"), ValueError,
     r"device='nope' is not a device: use e.g. 'cpu' or 'cuda:0'"),
    ("MoELayer/absent-gpu", lambda t: MoELayer(_moe_cfg(), device="cuda:99"), ValueError,
     r"device='cuda:99' but this process sees \d+ CUDA device\(s\)"),
    ("MoELayer/seed-too-large", lambda t: MoELayer(_moe_cfg(), seed=2**70), ValueError,
     r"seed must be an int in \[0, 18446688731495\] \(each expert's generator is seeded"),
    ("MoELayer/sparse-hidden", lambda t: MoELayer(_moe_cfg())(_x().to_sparse()), TypeError,
     r"hidden must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ("MoELayer/wrong-hidden", lambda t: MoELayer(_moe_cfg())(torch.randn(T, H + 2)), ValueError,
     r"hidden must be \[T, 4\] or \[S, B, 4\] \(hidden_size=4\), got shape \(5, 6\)"),
    ("MoELayer/4d-hidden", lambda t: MoELayer(_moe_cfg())(torch.randn(1, 1, T, H)), ValueError,
     r"hidden must be \[T, 4\] or \[S, B, 4\]"),
    ("MoELayer/dtype-mismatch", lambda t: MoELayer(_moe_cfg())(_x().double()), TypeError,
     r"hidden has dtype torch.float64 but the experts hold torch.float32"),
    ("MoELayer/other-device", lambda t: MoELayer(_moe_cfg())(_x().to(META)), ValueError,
     r"hidden is on meta but the layer's parameters are on cpu"),
    ("MoELayer/nan-hidden-checked",
     lambda t: MoELayer(_moe_cfg(checks=True))(torch.full((T, H), float("nan"))), ValueError,
     r"logits holds 40 NaN/inf value\(s\): check the inputs of the router"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "thunk", "exc", "match"), ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_a_clear_error(
    tmp_path: Path, case: str, thunk: Callable[[Path], Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        thunk(tmp_path)


def test_every_case_is_in_the_errors_table() -> None:
    text = DOCS.read_text()
    missing = [case for case, *_ in ERRORS if f"`{case}`" not in text]
    assert not missing, f"docs/errors.md lacks rows for {missing}"


def test_dispatch_errors_leave_the_stats_untouched() -> None:
    d = _disp(checks=True)
    for args in ((_x().double(), _idx(), _probs()), (_x(), _out_of_range(), _probs())):
        with pytest.raises((TypeError, ValueError)):
            d.dispatch(*args)
    assert d.stats.dispatch_calls == 0 and d.stats.host_syncs == 0 and d.stats.rows_sent == 0


# --------------------------------------------------------------------------- the CLI

CLI_ERRORS = [
    (["demo", "--preset", "nope"], "flexdispatch demo: error: --preset nope: unknown preset"),
    (["demo", "--tokens", "-1"], "flexdispatch demo: error: --tokens: must be >= 0"),
    (["demo", "--nodes", "0"], "--nodes: must be >= 1, got 0"),
    (
        ["plan", "--preset", "tiny_cpu", "--nodes", "0", "--ranks-per-node", "2"],
        "flexdispatch plan: error: --nodes: must be >= 1, got 0",
    ),
    (
        ["plan", "--preset", "tiny_cpu", "--nodes", "2", "--ranks-per-node", "3"],
        "num_experts=16 is not divisible by R = nodes x ranks_per_node = 2 x 3 = 6",
    ),
    (
        ["plan", "--preset", "tiny_cpu", "--nodes", "2", "--ranks-per-node", "2", "--tokens", "-5"],
        "--tokens: must be >= 1, got -5",
    ),
    (
        ["plan", "--preset", "tiny_cpu", "--nodes", "2", "--ranks-per-node", "2", "--skew", "nan"],
        "flexdispatch plan: error: --skew: must be a finite number >= 0, got nan",
    ),
    (
        ["plan", "--preset", "tiny_cpu", "--nodes", "1", "--ranks-per-node", "2", "--num-sms", "3"],
        "--num-sms must be a positive even number, got 3",
    ),
    (
        ["plan", "--preset", "nope", "--nodes", "1", "--ranks-per-node", "2"],
        "flexdispatch plan: error: --preset nope: unknown preset",
    ),
    (["config", "--from-hf", "missing.json"], "--from-hf missing.json: does not exist"),
    (["config", "--from-megatron", "missing.yaml"], "--from-megatron missing.yaml: does not exist"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_ERRORS, ids=[" ".join(a) for a, _ in CLI_ERRORS])
def test_cli_bad_input_exits_2_with_the_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # ranges checked at parse time: argparse exits
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err


def test_cli_argument_type_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["plan", "--preset", "tiny_cpu", "--nodes", "x", "--ranks-per-node", "2"])
    assert info.value.code == 2
    assert "--nodes: invalid int value: 'x'" in capsys.readouterr().err


def test_cli_entry_point_in_a_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flexdispatch.cli", "demo", "--preset", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "flexdispatch demo: error: --preset nope: unknown preset" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_cli_demo_world_not_dividing_experts_fails_before_spawning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["demo", "--nodes", "1", "--ranks-per-node", "3", "--tokens", "2", "--iters", "1"]
    argv += ["--timeout", "60"]
    assert cli_main(argv) == 2
    assert "not divisible" in capsys.readouterr().err


# --------------------------------------------------------------------------- valid but unusual


def _ref_layout(idx: torch.Tensor, num_experts: int, R: int) -> tuple[list, list, list]:
    """Per-token loop: (tokens per rank, pairs per expert, is_token_in_rank) ignoring bad ids."""
    e = num_experts // R
    per_rank, per_expert = [0] * R, [0] * num_experts
    mask = []
    for row in idx.tolist():
        ranks = sorted({i // e for i in row if 0 <= i < num_experts})
        for i in row:
            if 0 <= i < num_experts:
                per_expert[i] += 1
        for r in ranks:
            per_rank[r] += 1
        mask.append([r in ranks for r in range(R)])
    return per_rank, per_expert, mask


UNUSUAL_IDS = {
    "random": _idx,
    "non-contiguous": lambda: _idx().t().contiguous().t(),
    "minus-one-only": lambda: torch.full((T, K), -1, dtype=torch.int64),
    "empty": lambda: torch.zeros(0, K, dtype=torch.int64),
    "out-of-range-unchecked": lambda: torch.tensor([[8, 3], [-5, 0], [100, -1], [7, 9], [1, 2]]),
}


@pytest.mark.parametrize("name", list(UNUSUAL_IDS))
def test_layout_on_unusual_ids_matches_the_loop(name: str) -> None:
    idx = UNUSUAL_IDS[name]()
    if name == "non-contiguous":
        assert not idx.is_contiguous()
    for R in (1, 2, 4):
        layout = get_dispatch_layout(idx, E, R, ranks_per_node=2)
        per_rank, per_expert, mask = _ref_layout(idx, E, R)
        assert layout.num_tokens_per_rank.tolist() == per_rank
        assert layout.num_tokens_per_expert.tolist() == per_expert
        assert layout.is_token_in_rank.tolist() == (mask if mask else [])
        assert layout.is_token_in_rank.shape == (idx.shape[0], R)


def _clean(idx: torch.Tensor) -> torch.Tensor:
    return torch.where((idx >= 0) & (idx < E), idx, -1)


@pytest.mark.parametrize("name", list(UNUSUAL_IDS))
@pytest.mark.parametrize("W", [0, 16])
def test_dispatch_on_unusual_ids_matches_the_loop(
    name: str, W: int, request: pytest.FixtureRequest
) -> None:
    idx = UNUSUAL_IDS[name]()
    unchecked = name == "out-of-range-unchecked"
    if unchecked:  # on CPU bad ids raise in dispatch; the sync-free (CUDA) path drops them
        request.getfixturevalue("deferred_value_checks")
    Tn = idx.shape[0]
    x = torch.randn(H, Tn).t()  # non-contiguous rows as well
    probs = torch.rand(K, Tn).t().masked_fill(_clean(idx) < 0, 0.0)
    ref = ref_dispatch([Inputs(x=x.contiguous(), idx=_clean(idx), probs=probs.contiguous())], 0, E)
    d = _disp(num_worst_tokens=W)
    res = d.dispatch(x, idx, probs)
    M = ref.x.shape[0]
    assert res.recv_x.shape[0] == (W or M)
    assert torch.equal(res.recv_x[:M], ref.x)
    assert torch.equal(res.recv_topk_idx[:M], ref.idx)
    assert torch.equal(res.recv_topk_probs[:M], ref.probs)
    assert torch.equal(res.num_recv_tokens_per_expert, ref.counts)
    y = torch.randn(res.recv_x.shape[1], res.recv_x.shape[0]).t()  # non-contiguous y
    out = d.combine(y, res.handle)
    want = torch.zeros(Tn, H)
    for m, (_, t) in enumerate(ref.sources):  # world of one: one row per token sent anywhere
        want[t] = y[m]
    assert torch.equal(out, want)
    if unchecked:  # ...and the safe-point check names them
        with pytest.raises(
            ValueError, match=r"held 4 id\(s\) outside \[-1, 8\) \(lowest -5, highest 100\)"
        ):
            d.check_overflow()
        assert d.stats.extra["invalid_expert_ids"] == 4
    else:
        d.check_overflow()


@pytest.mark.parametrize("name", list(UNUSUAL_IDS))
def test_permute_on_unusual_ids_matches_the_loop(name: str) -> None:
    idx = UNUSUAL_IDS[name]()
    Tn = idx.shape[0]
    x = torch.randn(H, Tn).t()
    probs = torch.rand(K, Tn).t()
    perm = permute(x, idx, E, topk_probs=probs)
    rows = [(e, t, s) for e in range(E) for t in range(Tn) for s in range(K) if idx[t, s] == e]
    assert perm.x.shape == (len(rows), H)
    for n, (_, t, s) in enumerate(rows):
        assert torch.equal(perm.x[n], x[t]) and perm.probs[n] == probs[t, s]
        assert (perm.row_token[n], perm.row_slot[n]) == (t, s)
    y = torch.randn(H, len(rows)).t()
    out = unpermute(y, perm, probs=perm.probs)
    want = torch.zeros(Tn, H, dtype=torch.float64)
    for n, (_, t, s) in enumerate(rows):
        want[t] += float(probs[t, s]) * y[n].double()
    torch.testing.assert_close(out, want.float(), rtol=1e-6, atol=1e-6)


def test_routing_and_layer_on_non_contiguous_and_empty_input() -> None:
    logits = _logits()
    strided = logits.t().contiguous().t()
    a, b = topk_routing(strided, topk=K), topk_routing(logits, topk=K)
    assert torch.equal(a.topk_idx, b.topk_idx)
    torch.testing.assert_close(a.topk_probs, b.topk_probs, rtol=1e-6, atol=0)
    empty = topk_routing(torch.zeros(0, E), topk=K)
    assert empty.topk_idx.shape == (0, K) and int(empty.tokens_per_expert.sum()) == 0
    layer = MoELayer(_moe_cfg())
    x = torch.randn(H, T).t()
    out_strided, out = layer(x).output, layer(x.contiguous()).output
    # NOTE: the gating matmul may pick another BLAS kernel for a transposed input, so the two
    # agree to rounding, not bit for bit (docs/determinism.md).
    torch.testing.assert_close(out_strided, out, rtol=1e-5, atol=1e-6)
    assert layer(torch.zeros(0, H)).output.shape == (0, H)


def test_nan_rows_stay_in_their_own_tokens(deferred_value_checks: None) -> None:
    """On the sync-free paths (checks off), a NaN row is moved, never spread: only its own
    token's output is NaN. The torch backend looks at no value; the dispatcher's screen of a
    backend that counts no bad ids (DeepEP's, CUDA) reports it at the safe point."""
    x = _x()
    x[2, 1] = float("nan")
    for screened in (False, True):
        d = _disp()
        if screened:
            d.backend.counts_bad_ids = False  # type: ignore[misc]
        res = d.dispatch(x, _idx(), _probs())
        out = d.combine(res.recv_x, res.handle)
        bad = torch.isnan(out).any(1)
        assert bad.tolist() == [t == 2 for t in range(T)]
        if not screened:
            d.check_overflow()  # not looked at
            continue
        with pytest.raises(ValueError, match=r"x held 1 NaN/inf value\(s\) since the dispatcher"):
            d.check_overflow()
        assert d.stats.extra["nonfinite_x"] == 1


def test_nan_rows_raise_in_dispatch_with_checks_on() -> None:
    x = _x()
    x[2, 1] = float("nan")
    x[3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"x holds 2 NaN/inf value\(s\): check the layer"):
        _disp(checks=True).dispatch(x, _idx(), _probs())


# --------------------------------------------------------------------------- one bad rank

PG_TIMEOUT = 10.0


def _count_collectives() -> list[str]:
    """Replace torch.distributed's collectives in this process with counting wrappers."""
    import torch.distributed as dist

    calls: list[str] = []
    names = ("all_gather_into_tensor", "all_gather_single", "all_to_all_single", "all_reduce",
             "all_gather_object", "broadcast", "barrier")  # fmt: skip
    for name in names:
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def counted(*a: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _orig(*a, **kw)

        setattr(dist, name, counted)
    return calls


def one_bad_rank_worker(rank: int, world: int, bad: str, rank1_stays: bool) -> str:
    E2 = 2 * world
    d = FlexDispatcher(DispatchConfig(backend="torch", checks=True), num_experts=E2)
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(E2)[:K] for _ in range(T)])  # distinct per token
    probs = torch.rand(T, K)
    if rank == 1:
        if bad == "dtype":
            x = x.double()
        else:
            idx[0, 1] = E2 + 3
        calls = _count_collectives()
        try:
            d.dispatch(x, idx, probs)
        except (TypeError, ValueError):
            if calls:
                raise AssertionError(f"rank 1 issued collectives before raising: {calls}") from None
            if rank1_stays:
                # NOTE: alive and connected, but never reaching the collective (e.g. the error
                # was caught and logged): only the process-group timeout frees the peers.
                time.sleep(PG_TIMEOUT + 2.5)
            raise
        raise AssertionError("rank 1 should have raised")
    d.dispatch(x, idx, probs)
    return "rank 0 finished"


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("bad", "rank1_stays", "exc", "message"),
    [
        ("dtype", False, "TypeError", "x must be bfloat16, float16 or float32, got float64"),
        ("ids", True, "ValueError", "topk_idx holds 1 id(s) outside [-1, 4) (first: 7)"),
    ],
    ids=["bad-dtype-rank-leaves", "bad-ids-rank-stays"],
)
def test_only_rank_1_passes_a_bad_tensor(
    tmp_path: Path, bad: str, rank1_stays: bool, exc: str, message: str
) -> None:
    records, error, wall = spawn_recorded(
        one_bad_rank_worker, 2, tmp_path, bad, rank1_stays, pg_timeout=PG_TIMEOUT, timeout=90
    )
    assert error is not None and wall < 60, wall
    assert records[1]["type"] == exc and message in records[1]["message"], records[1]
    r0 = records[0]
    assert r0["type"] == "CollectiveError", r0
    assert r0["message"].startswith(
        "flexdispatch: collective all_gather (dispatch count exchange) failed on rank 0 of 2"
    )
    assert r0["elapsed"] <= PG_TIMEOUT + 7.0, r0["elapsed"]
    if rank1_stays:
        assert "Timed out" in r0["message"] and r0["elapsed"] >= PG_TIMEOUT - 1.0
    else:
        assert r0["elapsed"] < PG_TIMEOUT, "a peer that left must be noticed without the timeout"


def test_environment_checks_flag_turns_value_checks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXDISPATCH_CHECKS", "1")
    with pytest.raises(ValueError, match=r"outside \[-1, 8\)"):
        _disp().dispatch(_x(), _out_of_range(), _probs())
    monkeypatch.setenv("FLEXDISPATCH_CHECKS", "0")
    d = _disp()  # checks off, on CPU too: counted, raised at the safe point
    assert d.dispatch(_x(), _out_of_range(), _probs()).recv_x.shape[1] == H
    with pytest.raises(ValueError, match=r"held 1 id\(s\) outside \[-1, 8\) \(highest 8\)"):
        d.check_overflow()
    monkeypatch.setattr(tensors, "defer_value_checks", lambda device: True)
    d = _disp()  # the CUDA path: counted, raised at the safe point
    assert d.dispatch(_x(), _out_of_range(), _probs()).recv_x.shape[1] == H
    with pytest.raises(ValueError, match=r"held 1 id\(s\) outside \[-1, 8\) \(highest 8\)"):
        d.check_overflow()
    monkeypatch.setenv("FLEXDISPATCH_CHECKS", "1")  # checks on: raised in dispatch, even there
    with pytest.raises(ValueError, match=r"outside \[-1, 8\)"):
        _disp().dispatch(_x(), _out_of_range(), _probs())
