"""flexdispatch inside SGLang (``flexdispatch.integrations.sglang``, sglang 0.5.23), on 2 gloo
ranks: the dispatcher's formats and sums against SGLang's own expert-parallel semantics.

SGLang's MoE layers cannot run expert-parallel on a CPU, so these tests stop at the dispatcher
(``tests/dist/sglang_host.py``): SGLang's ``StandardDispatcher`` (every rank sees every token,
local ids, an all-reduce) and ``FlexSGLangDispatcher`` in DeepEP's normal format, SGLang's
Standard format and DeepEP's low-latency format (mode per call from SGLang's
``set_is_extend_in_batch`` under ``--deepep-mode auto``) must all give the dense reference,
fp32 within 1e-6, with ``-1`` slots, a rank that receives nothing and a rank with no tokens; the
halves of two sub-batches interleaved (two-batch overlap's call pattern); a combine that halves
its sum must fail. Then the plug-in's hook through SGLang's own ``load_plugins()``.

SGLang is installed without its dependencies (its full install is CUDA-only); its dispatcher
package imports ``torchvision.transforms``, which has no CPU build for the project's torch on the
index: a stub of it (``tests/dist/sglang_stubs``, image preprocessing only) is used. No CUDA graph
is captured here (no GPU).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.dist import sglang_host as sh
from tests.dist.harness import spawn_group

pytestmark = pytest.mark.dist

if importlib.util.find_spec("sglang") is None:  # NOTE: a clear error, not a skip
    raise ImportError(
        "SGLang is not installed: FLEXDISPATCH_INTEGRATIONS=1 bash scripts/setup.sh "
        "(scripts/test.sh does it)"
    )

FP32_GAP = 1e-6
TIMEOUT_S = 300  # NOTE: the first call of the module imports SGLang in both ranks

CASES: list[tuple[str, dict[str, Any]]] = [
    ("E8-k2-dropped-slots", {"E": 8, "K": 2, "dropped": {1: [(0, 1), (3, 0)]}}),
    ("rank1-receives-nothing", {"E": 8, "K": 2, "all_to_rank0": True}),
    ("rank1-has-no-tokens", {"E": 8, "K": 2, "T": [6, 0]}),
    ("E4-k1", {"E": 4, "K": 1}),
]


def _run(fn: Any, case: Any) -> list[dict[str, Any]]:
    return spawn_group(fn, 2, args=(case,), timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_formats_and_sums_equal_sglangs_ep_semantics(case: dict[str, Any]) -> None:
    for rank, res in enumerate(_run(sh.compare_formats, case)):
        gaps = {k: res[k] for k in ("standard_dispatcher", "normal", "standard", "low_latency")}
        assert max(gaps.values()) <= FP32_GAP, (rank, res)
        assert res["normal_ok"] and res["standard_ok"] and res["ll_ok"], (rank, res)
        assert res["normal_type"] == "DeepEPNormalDispatchOutput", res
        assert res["ll_type"] == "DeepEPLLDispatchOutput", res
        assert res["ll_shape"] == [case["E"] // 2, 2 * res["B"], 64], res  # [e, R*B, H]
        assert res["ll_syncs"] == 0, res  # the decode path reads nothing on the host
        # one normal dispatch, one decode dispatch (after the decode path's warm-up)
        assert res["calls"] == [1, 2], res


def test_a_halved_combine_fails_the_comparison() -> None:
    for res in _run(sh.compare_formats, {"E": 8, "K": 2, "broken_combine": True}):
        assert res["standard_dispatcher"] <= FP32_GAP, res  # the reference itself is fine
        for key in ("normal", "standard", "low_latency"):
            assert res[key] > 100 * FP32_GAP, (key, res)


def test_halves_of_two_subbatches_interleave() -> None:
    for res in _run(sh.halves_two_subbatches, {"E": 8, "K": 2}):
        assert res["slots"] == 2, res
        assert "out of order" in res["out_of_order"], res
        assert res["normal"] <= FP32_GAP and res["low_latency"] <= FP32_GAP, res


def test_register_hooks_sglangs_dispatcher_factory() -> None:
    res = _run(sh.plugin_wiring, None)[0]
    assert res["entry_points"] == ["flexdispatch.integrations.sglang:register"], res
    # switched off: no hook registered, and SGLang's own DeepEP dispatcher is built (it needs
    # DeepEP's kernels, which do not run here)
    assert res["off_added"] == 0, res
    assert res["off_answer"].startswith("ImportError: DeepEP is not available"), res
    assert res["on_hooks"] == 1 and res["wrapped"] and res["package_binding"], res
    assert res["deepep_layer"] == "FlexSGLangDispatcher", res
    assert res["none_layer"] == "StandardDispatcher", res  # not a DeepEP layer: SGLang's own
    assert res["hooks_after_second_register"] == 1, res
    assert "single-batch overlap" in res["refusals"]["sbo"], res
    assert "unquantized rows" in res["refusals"]["quantized"], res
    assert "single-batch overlap" in res["overlap_args"], res
    for message in (*res["refusals"].values(), res["overlap_args"]):
        assert "\n" not in message, message
    # off again: SGLang's own DeepEP dispatcher is built, and needs DeepEP's kernels
    assert res["off_again"].startswith("ImportError: DeepEP is not available"), res


def test_the_sglang_example_runs() -> None:
    for res in spawn_group(sh.run_example, 2, timeout_s=TIMEOUT_S):
        assert res["dispatcher"] == "FlexSGLangDispatcher", res
        assert res["extend_format"] == "DeepEPNormalDispatchOutput", res
        assert res["decode_format"] == "DeepEPLLDispatchOutput", res
        assert res["decode_rows"] == [4, 16, 64], res  # [e, R*B, H], B = 8
        assert res["extend_max_err"] <= FP32_GAP and res["decode_max_err"] <= FP32_GAP, res
        assert res["dispatch_calls"] == [1, 2] and res["backend"] == "torch", res
