"""``flexdispatch demo`` fits the machine: the memory estimate, the shrink (routing untouched) and
the refusal up front, without spawning anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexdispatch.cli import demo_fit
from flexdispatch.cli import main as cli_main
from flexdispatch.config import list_presets, load_config
from flexdispatch.moe import MoELayer

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = demo_fit.GiB, demo_fit.MiB


def _fit(name: str, limit: int, *, ranks: int = 4, tokens: int = 64, worst_case: bool = False):
    cfg = load_config(name)
    return cfg, demo_fit.fit_demo(
        cfg, ranks, tokens, worst_case=worst_case, limit=limit, limit_reason="test"
    )


def test_parse_size() -> None:
    assert demo_fit.parse_size("4GiB") == 4 * GiB
    assert demo_fit.parse_size("512 MiB") == 512 * MiB
    assert demo_fit.parse_size("1.5g") == int(1.5 * GiB)
    assert demo_fit.parse_size("2") == 2 * GiB
    for bad in ("", "lots", "-1GiB", "0", "3 parsecs"):
        with pytest.raises(ValueError, match="memory size"):
            demo_fit.parse_size(bad)


@pytest.mark.parametrize("name", ["tiny_cpu", "deepseek_v3", "mixtral_8x7b"])
def test_estimated_parameters_are_the_layers_own(name: str) -> None:
    """The parameter bytes the estimate counts per rank are those of a real MoELayer (R = 1, so
    the layer holds every expert; the shrunk sizes keep it small)."""
    cfg, plan = _fit(name, 2 * GiB, ranks=1)
    from flexdispatch.cli.demo import DemoSpec, demo_config

    spec = DemoSpec(
        preset=name,
        backend="torch",
        tokens=plan.tokens,
        seed=0,
        iters=1,
        worst_case=False,
        hidden_size=plan.hidden_size,
        ffn_hidden_size=plan.ffn_hidden_size,
        shared_expert_ffn_hidden_size=plan.shared_expert_ffn_hidden_size,
    )
    layer = MoELayer(demo_config(spec))
    held = sum(t.numel() * t.element_size() for t in layer.parameters())
    held += sum(t.numel() * t.element_size() for t in layer.buffers())
    counted = plan.estimate.parts["params_per_rank"]
    assert held <= counted <= held + 16 * cfg.router.num_experts


@pytest.mark.parametrize("name", list_presets())
def test_shrink_keeps_the_routing_and_fits_as_large_as_possible(name: str) -> None:
    limit = 3 * GiB  # 4 ranks and the parent: 2 GiB of runtime, 1 GiB of tensors
    cfg, plan = _fit(name, limit)
    assert plan.estimate.total <= limit
    from flexdispatch.cli.demo import DemoSpec, demo_config

    def sized(h: int | None, f: int | None, fs: int | None):
        return demo_config(
            DemoSpec(
                preset=name,
                backend="auto",
                tokens=plan.tokens,
                seed=0,
                iters=1,
                worst_case=False,
                hidden_size=h,
                ffn_hidden_size=f,
                shared_expert_ffn_hidden_size=fs,
            )
        )

    run = sized(plan.hidden_size, plan.ffn_hidden_size, plan.shared_expert_ffn_hidden_size)
    assert run.router == cfg.router
    keep = ("hidden_size", "ffn_hidden_size", "shared_expert_ffn_hidden_size")
    assert {k: v for k, v in run.model_dump().items() if k not in keep} == {
        k: v for k, v in cfg.model_dump().items() if k not in keep
    }
    if name == "tiny_cpu":
        assert plan.shrunk == {}
        assert "preset's own" in plan.shrink_line(cfg)
        return
    H0, H1 = cfg.hidden_size, plan.hidden_size
    assert plan.shrunk["hidden_size"] == (H0, H1) and H1 < H0 and H1 % 8 == 0
    assert plan.tokens == 64  # the sizes had room to shrink; the tokens stay
    # The ratio F/H is kept (to the rounding to multiples of 8).
    assert abs(plan.ffn_hidden_size / H1 - cfg.ffn_hidden_size / H0) <= 8 / H1 + 1e-9
    # The next multiple of 8 would not fit: the demo keeps as much of the model as it can.
    bigger = demo_fit._resized(cfg, H1 + 8)
    assert demo_fit.estimate_memory(bigger, 4, 64, worst_case=False).total > limit
    line = plan.shrink_line(cfg)
    assert f"hidden_size {H0} -> {H1}" in line
    assert f"E={cfg.router.num_experts}, k={cfg.router.topk}" in line


def test_estimate_grows_with_what_the_demo_holds() -> None:
    cfg = load_config("deepseek_v3")
    small = demo_fit._resized(cfg, 128)

    def total(c=small, ranks: int = 4, tokens: int = 64, worst_case: bool = False) -> int:
        return demo_fit.estimate_memory(c, ranks, tokens, worst_case=worst_case).total

    assert total() < total(demo_fit._resized(cfg, 256))
    assert total() < total(tokens=512)
    # Worst-case mode feeds k static rows per received token; dropless at most e = E/R of them.
    assert total(ranks=64) < total(ranks=64, worst_case=True)
    assert total(ranks=4) == total(ranks=4, worst_case=True)  # e = 64 >= k = 8: the same bound
    assert total() < total(ranks=8)  # one more runtime per rank, and more rows in flight
    full = demo_fit.estimate_memory(cfg, 4, 64, worst_case=False)
    # DeepSeek-V3's 256 experts at full size: 3 * 7168 * 2048 fp32 each, about 45 GB; the demo
    # holds them at least twice (the ranks' weights and gradients) and again in the reference.
    assert full.total > 3 * 256 * 3 * 7168 * 2048 * 4


def test_tokens_shrink_when_the_sizes_cannot() -> None:
    cfg, plan = _fit("qwen3_moe", int(1.5 * GiB), ranks=2, tokens=1 << 16)
    assert plan.hidden_size == demo_fit.MIN_HIDDEN and plan.ffn_hidden_size == demo_fit.MIN_FFN
    assert 1 <= plan.tokens < 1 << 16 and plan.shrunk["tokens_per_rank"] == (1 << 16, plan.tokens)
    assert plan.estimate.total <= 1.5 * GiB
    assert (
        demo_fit.estimate_memory(
            demo_fit._resized(cfg, demo_fit.MIN_HIDDEN), 2, 2 * plan.tokens, worst_case=False
        ).total
        > 1.5 * GiB
    )


def test_refused_with_the_memory_it_would_need() -> None:
    # 16 ranks + the parent at 400 MiB of runtime each cannot fit 2 GiB at any size.
    with pytest.raises(ValueError) as info:
        _fit("deepseek_v3", 2 * GiB, ranks=16)
    msg = str(info.value)
    assert "does not fit" in msg and "would need" in msg and "16 rank(s)" in msg
    need = demo_fit.estimate_memory(
        demo_fit._resized(load_config("deepseek_v3"), demo_fit.MIN_HIDDEN), 16, 1, worst_case=False
    )
    assert demo_fit.format_bytes(need.total) in msg and need.total > 2 * GiB


def test_limit_never_exceeds_what_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(demo_fit.AVAILABLE_ENV, "2GiB")
    limit, why = demo_fit.memory_limit(8 * GiB)
    assert limit == int(0.8 * 2 * GiB) and "available" in why and demo_fit.AVAILABLE_ENV in why
    assert demo_fit.memory_limit(1 * GiB) == (1 * GiB, "--max-memory 1.0 GiB")
    monkeypatch.delenv(demo_fit.AVAILABLE_ENV)
    avail, source = demo_fit.available_memory()
    assert avail is None or avail > 0, source


def test_cli_refuses_before_spawning(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv(demo_fit.AVAILABLE_ENV, "1GiB")  # a small machine: 0.8 GiB to plan for
    # NOTE: 4 gloo ranks on any machine (a 1-GPU one would refuse them first), and the runtime
    # given rather than probed (a second's subprocess): this is about the memory refusal.
    monkeypatch.setenv("FLEXDISPATCH_DEVICE", "cpu")
    monkeypatch.setenv("FLEXDISPATCH_RUNTIME_BYTES", "400MiB")
    argv = ["demo", "--preset", "deepseek_v3", "--nodes", "2", "--ranks-per-node", "2"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "flexdispatch demo: error: --nodes 2: 4 rank(s) need ~2.0 GiB, 819.2 MiB allowed (80% "
        "of $FLEXDISPATCH_MEMORY_AVAILABLE): use fewer ranks\n"
    )
    assert cli_main([*argv, "--verbose"]) == 2
    err = capsys.readouterr().err  # NOTE: the derivation with --verbose
    assert "preset 'deepseek_v3' on 4 rank(s) does not fit" in err
    assert "would need" in err and "available ($FLEXDISPATCH_MEMORY_AVAILABLE)" in err
    assert "spawning" not in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # NOTE: refused at parse time, before the runtime probe
        cli_main(["demo", "--max-memory", "much"])
    err = capsys.readouterr().err
    assert err.startswith("flexdispatch demo: error: --max-memory: 'much' is not a memory size")


def test_cli_refusal_in_a_subprocess_is_quick_and_clean() -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "flexdispatch.cli", "demo", "--preset", "mixtral_8x7b"),
            *("--max-memory", "600MiB", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "FLEXDISPATCH_RUNTIME_BYTES": "400MiB"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("flexdispatch demo: error: --max-memory 600.0MiB: 4 rank(s) need")
    assert "600.0 MiB allowed (--max-memory): raise --max-memory" in proc.stderr
    assert proc.stderr.count("\n") == 1 and len(proc.stderr) <= 201, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_the_demo_layer_config_is_validated(tmp_path: Path) -> None:
    """The demo's own dispatch fields are checked with the preset's (a preset file with
    ``cuda_graph: true`` run without ``--worst-case`` is dropless: refused, not built)."""
    from flexdispatch.cli.demo import DemoSpec, _layer_config

    data = load_config("tiny_cpu").model_dump()
    data["dispatch"].update(cuda_graph=True, num_worst_tokens=64)
    path = tmp_path / "graph.yaml"
    path.write_text(json.dumps(data))  # NOTE: JSON is YAML
    spec = DemoSpec(preset=str(path), backend="torch", tokens=8, seed=0, iters=1, worst_case=True)
    assert _layer_config(spec, "flat", 2, 2).dispatch.num_worst_tokens == 16
    spec = DemoSpec(preset=str(path), backend="torch", tokens=8, seed=0, iters=1, worst_case=False)
    with pytest.raises(ValueError, match="cuda_graph=True with a dropless dispatch"):
        _layer_config(spec, "flat", 2, 2)
