"""flexdispatch inside Megatron-Core (``flexdispatch.integrations.megatron.install()``), on 2 gloo
ranks, against Megatron's own all-to-all dispatcher (``moe_token_dispatcher_type="alltoall"``).

Every case builds the reference ``MoELayer`` and a ``"flex"`` one through the plug-in with the
same weights, runs two steps (different inputs per rank and step, the router's aux and z losses
on) forward and backward, and compares the output, the input gradient and every parameter
gradient (router, experts, shared experts): fp32 within 1e-5; bf16 within one bf16 ulp at the
tensor's scale per bf16 rounding of Megatron's sum (Megatron adds a token's k expert outputs, and
the shared experts' output, in bf16; flexdispatch sums a rank's share in fp32 and rounds once).
Each case also checks that the layer really ran flexdispatch (two ``FlexDispatcher.dispatch``
calls per rank). A deliberately wrong combine must fail the comparison (the negative control).
Then the properties Megatron's own dispatcher tests check (round trip, capacity, router padding)
through the plug-in, and the plug-in's life cycle. Expert tensor parallelism:
``tests/dist/test_megatron_expert_tp.py``.

The ranks import Megatron with ``TORCHDYNAMO_DISABLE=1``: the flex dispatcher's
``dispatch_preprocess`` is ``torch.compile``d, ~23 s of CPU at the first step otherwise
(docs/integrations.md). The Megatron test shims are in ``tests/dist/megatron_host.py``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any
from unittest import mock

import pytest

from tests.dist import megatron_host as mh
from tests.dist.harness import spawn_group

pytestmark = pytest.mark.dist

if importlib.util.find_spec("megatron") is None:  # NOTE: a clear error, not a skip
    raise ImportError(
        "megatron-core is not installed: FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh "
        "(scripts/test.sh does it)"
    )

ENV = {"TORCHDYNAMO_DISABLE": "1"}
FP32_GAP = 1e-5
SIGMOID_GROUPS = {"score": "sigmoid", "groups": 4, "group_topk": 2, "scale": 2.5}

CASES: list[tuple[str, dict[str, Any]]] = [
    ("softmax-E4-k2", {"E": 4, "k": 2}),
    ("swiglu-E8-k3", {"E": 8, "k": 3, "swiglu": True}),
    ("pre-softmax-E2-k1", {"E": 2, "k": 1, "pre_softmax": True}),
    ("capacity-0.5", {"E": 4, "k": 2, "capacity": 0.5}),
    ("shared-experts", {"E": 4, "k": 2, "shared": 32}),
    ("sigmoid-groups-k4", {"E": 8, "k": 4, **SIGMOID_GROUPS}),
    ("worst-case-W24", {"E": 4, "k": 2, "W": 24}),
    ("router-fp64", {"E": 4, "k": 2, "extra": {"moe_router_dtype": "fp64"}}),
    ("all-to-rank0", {"E": 4, "k": 2, "all_to_rank0": True}),
    ("bf16-E4-k2", {"E": 4, "k": 2, "dtype": "bf16"}),
    ("bf16-sigmoid-groups-k4-shared",
     {"E": 8, "k": 4, **SIGMOID_GROUPS, "shared": 32, "dtype": "bf16"}),
]  # fmt: skip


def run(fn: Any, *args: Any) -> list[Any]:
    return spawn_group(fn, 2, args=args, env=ENV, timeout_s=240)


def check_comparison(case: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """The verdict on ``megatron_host.compare``'s per-rank results (shared with the expert-TP
    module)."""
    for rank, res in enumerate(results):
        assert res["dispatcher"] == "FlexdispatchTokenDispatcher", res
        assert res["manager"] == "FlexdispatchManager", res
        assert res["dispatch_calls"] == 2, res  # one per step: the plug-in really dispatched
        if case.get("dtype") == "bf16":
            # NOTE: one bf16 ulp (at the tensor's scale) per rounding Megatron's bf16 sum of a
            # token's k expert outputs makes (k - 1), and one for adding the shared experts
            ulps = max(1, case["k"] - 1 + bool(case.get("shared")))
            assert res["out_ulps"] <= ulps and res["dx_ulps"] <= ulps, (rank, res)
            assert res["params_ulps"] <= ulps, (rank, res)
        else:
            assert max(res["out"], res["dx"], res["params"]) <= FP32_GAP, (rank, res)
        if case.get("all_to_rank0") and rank == 1:
            assert res["rows_received"] < 24, res  # rank 1 sent everything to rank 0


def check_properties(results: list[dict[str, Any]]) -> None:
    """The verdict on ``megatron_host.dispatcher_properties``."""
    for res in results:
        assert res["round_trip"] == 0 and res["round_trip_grad"] == 0, res
        assert res["capacity_dropped"] == 1, res  # the capacity case drops something
        assert res["capacity_max_rows"] <= res["capacity_limit"], res
        assert res["capacity"] < 1e-6 and res["capacity_grad"] < 1e-6, res
        assert res["padding_align"] == 16, res
        assert all(c % 16 == 0 for c in res["padding_counts"]), res
        assert sum(res["padding_counts"]) == res["padding_rows"], res
        assert res["padding"] < 1e-6 and res["padding_grad"] < 1e-6, res
        assert res["dispatch_calls"] == 1, res


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_megatron_layer_equals_its_own_alltoall_dispatcher(case: dict[str, Any]) -> None:
    check_comparison(case, run(mh.compare, case))


def test_a_wrong_combine_fails_the_comparison() -> None:
    for res in run(mh.compare, {"E": 4, "k": 2, "broken_combine": True}):
        assert res["out"] > 100 * FP32_GAP and res["dx"] > 100 * FP32_GAP, res
        assert res["params"] > 100 * FP32_GAP, res


def test_megatron_dispatcher_properties_through_the_plugin() -> None:
    check_properties(run(mh.dispatcher_properties, {"ep": 2, "etp": 1}))


def test_install_and_uninstall() -> None:
    for res in run(mh.plugin_lifecycle):
        assert res["installed"] == "FlexdispatchTokenDispatcher", res
        assert res["default_backend"] == "auto" and res["backend_name"] == "torch", res
        assert res["cudagraph_attrs"] == [
            "_comm_manager.token_probs",
            "_comm_manager.token_indices",
        ], res
        # NOTE: moe_permute_fusion=True was accepted and ignored silently (integrations-5)
        (fusion,) = res["permute_fusion"]  # two layers built, one warning
        assert "moe_permute_fusion=True (TransformerEngine's fused permutation)" in fusion, res
        assert "moe_pad_expert_input_to_capacity" in res["refusal"], res
        assert "num_worst_tokens" in res["refusal"], res
        assert "flexdispatch" not in res["hybridep_manager"].lower(), res
        assert res["num_sms"] == 24, res  # moe_flex_dispatcher_num_sms -> deepep_num_sms
        odd = res.get("odd_num_sms", "")  # validated, named as the Megatron option
        assert "moe_flex_dispatcher_num_sms=21" in odd and "must be even" in odd, res
        assert res["restored"] is True and res["config_after"] is None, res


def test_the_megatron_example_runs() -> None:
    with mock.patch.dict(os.environ):  # NOTE: the example sets TORCHDYNAMO_DISABLE at import:
        from examples import megatron_moe  # kept out of this process (its ranks get ENV)

    for res in run(megatron_moe.run_rank):
        assert res["dispatcher"] == "FlexdispatchTokenDispatcher", res
        assert res["dispatch_calls"] == 1 and res["grad_finite"], res
