"""``flexdispatch demo``: its single-process reference covers every layer variant ``MoELayer``
runs (shared experts and their gate, clamped/biased experts, a router bias, input-side probs,
hash routing), so a preset with any of them passes, and a wrong result does not; every shipped
preset runs on this machine, shrunk to fit (routing kept), spawned and under torchrun; the memory
estimate bounds the peak the processes really reach.

Every subprocess has a timeout; 2 ranks and few tokens keep each run to seconds.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flexdispatch.cli.demo import DemoSpec, check_against_reference, run_rank
from flexdispatch.cli.demo_fit import AVAILABLE_ENV, format_bytes, parse_size
from flexdispatch.cli.demo_machine import RUNTIME_ENV, measure_runtime
from flexdispatch.config import list_presets, load_config
from flexdispatch.launch import free_port
from tests.dist.harness import spawn_group

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
SMALL = ["--nodes", "1", "--ranks-per-node", "2", "--tokens", "8", "--iters", "1"]
SHRUNK = re.compile(
    r"^shrunk to fit ([0-9.]+ [MG]iB) \((.+?)\): hidden_size (\d+) -> (\d+), "
    r"ffn_hidden_size (\d+) -> (\d+)(.*?); routing kept: E=(\d+), k=(\d+), (\w+)",
    re.M,
)


@functools.lru_cache(maxsize=1)
def _runtime_bytes() -> int:
    """The demo's runtime allowance on this machine, probed once for the module's runs (each
    demo would probe again: seconds); the JSON test below lets the demo probe for itself."""
    return measure_runtime("cpu")[0]


def _limit(processes: int, tensors_gib: float, at_least_gib: float) -> str:
    """A --max-memory giving ``tensors_gib`` beside the runtime of ``processes`` processes, and
    never less than ``at_least_gib`` (the figure these tests were sized with on a CPU build of
    torch: a CUDA build's runtime is nearly three times larger)."""
    need = processes * _runtime_bytes() + tensors_gib * 2**30
    return f"{max(need, at_least_gib * 2**30) / 2**20:.0f}MiB"


def _env(*, probe: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (AVAILABLE_ENV, RUNTIME_ENV)}
    if not probe:
        env[RUNTIME_ENV] = f"{_runtime_bytes()}b"
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    for k in (*launcher, "MASTER_PORT"):
        env.pop(k, None)
    env.pop("FLEXDISPATCH_VISIBLE_GPUS", None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    # NOTE: these are CPU runs (gloo, fp32 on the host) on any machine; tests/gpu runs it on GPUs.
    env["FLEXDISPATCH_DEVICE"] = "cpu"
    return env


def _demo(*argv: str, timeout: float = 150, probe: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flexdispatch.cli", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_env(probe=probe),
        check=False,
    )


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


def _demo_here(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str
) -> tuple[int, str, str]:
    """``flexdispatch demo`` run in this process, its ranks in the module's pooled group
    (``tests/dist/harness.py``): the command's code, stdout and stderr. ``_demo`` runs the
    command as a subprocess, its ranks spawned by the command itself."""
    from flexdispatch import launch
    from flexdispatch.cli import main

    for key in (AVAILABLE_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(launch, "spawn_group", spawn_group)
    capsys.readouterr()
    code = main(["demo", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_runs_shrunk_to_fit(
    preset: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shipped preset passes its own check on 2 ranks within 1.5 GiB (more where
    the runtime is larger); the report says what
    was shrunk from what to what, and the routing it kept is the preset's. The command runs in
    this process (its ranks pooled); the tests below run it as a subprocess."""
    code, out, err = _demo_here(
        capsys, monkeypatch, "--preset", preset, *SMALL, "--max-memory", _limit(3, 0.3, 1.5)
    )
    text = out + err
    assert code == 0, text[-4000:]
    assert "Traceback" not in text
    assert re.search(r"check vs single-process reference \(.*\): OK \(", out), text
    cfg = load_config(preset)
    if cfg.hidden_size <= 64:  # tiny_cpu fits as it is
        assert "sizes: preset's own (H=64, F=96)" in out
        return
    m = SHRUNK.search(out)
    assert m, out
    H0, H1, F0, F1 = (int(m.group(i)) for i in (3, 4, 5, 6))
    assert (cfg.hidden_size, cfg.ffn_hidden_size) == (H0, F0) and H1 < H0 and F1 < F0
    r = cfg.router
    kept = (int(m.group(8)), int(m.group(9)), m.group(10))
    assert kept == (r.num_experts, r.topk, r.score_function)
    if cfg.num_shared_experts:
        assert "shared_expert_ffn_hidden_size" in m.group(7)
        assert "shared experts): OK" in out  # the shared experts were checked too
    assert m.group(0) in err  # also said before the ranks were spawned
    assert err.index(m.group(0)) < err.index("spawning")


def _json_demo(preset: str, max_memory: str, probe: bool = False) -> dict:
    argv = ("--preset", preset, *SMALL, "--max-memory", max_memory, "--json")
    proc = _demo(*argv, probe=probe)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_json_reflects_the_shrink_and_the_estimate_bounds_the_measured_peak() -> None:
    """``--json`` carries the sizes run and the shrink; the estimate is an upper bound of the
    peak resident memory of every rank and of the parent, and not a loose one: what the tensors
    add over a process's runtime is at least half of what the estimate gives them."""
    base = _json_demo("tiny_cpu", _limit(3, 0.3, 1.5), probe=True)  # the runtime alone, nearly
    assert base["fit"]["shrunk"] == {} and base["hidden_size"] == 64
    runtime = base["fit"]["measured_peak_rss"]
    # the runtime allowance is measured on this machine (a probe process), not a constant
    allowance = base["fit"]["runtime"]
    RUNTIME = allowance["allowance"]
    assert allowance["measured"] and "probe process" in allowance["source"], allowance
    assert base["fit"]["estimate"]["runtime_per_process"] == RUNTIME >= allowance["measured"]
    assert runtime["largest_rank"] <= RUNTIME and runtime["this_process"] <= RUNTIME
    for preset in ("mixtral_8x7b", "deepseek_v3"):
        limit = _limit(3, 1.3, 2.5)
        rep = _json_demo(preset, limit)
        fit, cfg = rep["fit"], load_config(preset)
        assert rep["ok"] and fit["limit"] == parse_size(limit)
        assert fit["shrunk"]["hidden_size"] == {"from": cfg.hidden_size, "to": rep["hidden_size"]}
        assert fit["shrunk"]["ffn_hidden_size"]["to"] == rep["ffn_hidden_size"]
        assert fit["hidden_size"] == rep["hidden_size"] and rep["tokens_per_rank"] == 8
        shown = format_bytes(parse_size(limit))
        assert rep["fit_line"].startswith(f"shrunk to fit {shown} (--max-memory {shown})")
        est, seen = fit["estimate"], fit["measured_peak_rss"]
        assert est["total"] <= fit["limit"]
        assert seen["largest_rank"] <= est["per_rank"], (preset, seen, est)
        assert seen["this_process"] <= est["parent"], (preset, seen, est)
        tensors_rank = seen["largest_rank"] - runtime["largest_rank"]
        tensors_parent = seen["this_process"] - runtime["this_process"]
        rt = est["runtime_per_process"]  # probed once for the module: the same to a few pages
        assert abs(rt - RUNTIME) <= 0.05 * RUNTIME, (rt, RUNTIME)
        assert tensors_rank >= 0.5 * (est["per_rank"] - rt), (preset, seen, est)
        assert tensors_parent >= 0.5 * (est["parent"] - rt), (preset, seen, est)


def _torchrun(*argv: str) -> subprocess.CompletedProcess:
    env = _env()
    env.update(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch" / "torchrun_single_node.sh"), *argv],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=env,
        check=False,
    )


@pytest.mark.dist
@pytest.mark.timeout(330)
def test_under_torchrun_every_rank_runs_rank_0s_sizes_or_every_rank_refuses() -> None:
    args = ("--preset", "deepseek_v3", "--tokens", "8", "--iters", "1")
    proc = _torchrun(*args, "--max-memory", _limit(2, 0.7, 1.5))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert ": OK (" in proc.stdout and proc.stdout.count("flexdispatch demo —") == 1
    m = SHRUNK.search(proc.stdout)
    assert m and m.group(3) == "7168" and "on this machine (2 local rank(s)" in proc.stdout
    refused = _torchrun(*args, "--max-memory", "500MiB")
    assert refused.returncode != 0
    msg = "flexdispatch demo: error: --max-memory 500.0MiB: 2 rank(s) need ~"
    assert refused.stderr.count(msg) == 2, refused.stderr[-4000:]  # both ranks, same reason
    assert "checking against" not in refused.stderr
