"""``flexdispatch demo``: its single-process reference covers every layer variant ``MoELayer``
runs (shared experts and their gate, clamped/biased experts, a router bias, input-side probs,
hash routing), so a preset with any of them passes, and a wrong result does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flexdispatch.cli.demo import DemoSpec, check_against_reference, run_rank
from flexdispatch.config import load_config
from flexdispatch.launch import spawn_group

TOL = 1e-4


def _variant_yaml(tmp_path: Path, name: str) -> str:
    base = load_config("tiny_cpu").model_dump(mode="json")
    router = dict(base["router"])
    ungrouped = {**router, "num_groups": None, "group_topk": None}
    variants = {
        "shared_gate_oai": {
            "num_shared_experts": 2,
            "shared_expert_gate": True,
            "activation": "swiglu_oai",
            "swiglu_limit": 7.0,
            "swiglu_alpha": 1.702,
            "expert_mlp_bias": True,
            "router": {**router, "router_bias": True},
        },
        "probs_on_input_hash": {
            "num_shared_experts": 1,
            "probs_on_input": True,
            "router": {
                **ungrouped,
                "topk": 1,
                "router_type": "hash",
                "aux_loss_type": "none",
                "aux_loss_coeff": 0.0,
            },
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**base, **variants[name]}))
    load_config(path)  # a valid config
    return str(path)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", ["shared_gate_oai", "probs_on_input_hash"])
def test_demo_reference_covers_layer_variants_and_catches_errors(
    tmp_path: Path, variant: str
) -> None:
    spec = DemoSpec(
        preset=_variant_yaml(tmp_path, variant),
        backend="torch",
        tokens=8,
        seed=3,
        iters=1,
        worst_case=False,
    )
    results = spawn_group(run_rank, 2, args=(spec,), timeout_s=150)
    diffs = check_against_reference(spec, results)
    assert {"flat.grad_shared", "hierarchical.grad_shared"} <= diffs.keys()
    assert max(diffs.values()) <= TOL, diffs
    # A wrong shared-expert gradient, a wrong output or a wrong router-bias gradient is caught.
    shared = results[1]["modes"]["flat"]["grad_shared"]
    name = sorted(shared)[0]
    shared[name] = shared[name] + 1e-2
    results[0]["modes"]["hierarchical"]["output"][0, 0] += 1e-2
    router = results[0]["modes"]["flat"]["grad_router"]
    for n in router:
        router[n] = router[n] * 1.1 + 1e-3
    bad = check_against_reference(spec, results)
    assert bad["flat.grad_shared"] > TOL and bad["hierarchical.output"] > TOL
    assert bad["flat.grad_router"] > TOL
    assert bad["flat.output"] <= TOL and bad["hierarchical.grad_shared"] <= TOL
