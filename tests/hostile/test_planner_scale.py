"""A planner that answers at any scale: sampled above a budget of simulated logits, refused up
front where even one token per rank is too much, with a progress bar on stderr."""

from __future__ import annotations

import json
import time

import pytest
import yaml

import flexdispatch.planner as planner
from flexdispatch.cli import main as cli_main
from flexdispatch.cli.plan import LateProgress
from flexdispatch.config import load_config
from flexdispatch.planner import plan_cluster

pytestmark = pytest.mark.timeout(120)


def test_a_huge_token_count_is_sampled_and_scaled():
    cfg = load_config("tiny_cpu")
    R, k, T = 4, cfg.router.topk, 10**12
    calls = []
    t0 = time.perf_counter()
    plan = plan_cluster(
        cfg, nodes=2, ranks_per_node=2, tokens=T, max_logits=1 << 14,
        progress=lambda done, total: calls.append((done, total)),
    )  # fmt: skip
    assert time.perf_counter() - t0 < 30
    assert any(n.startswith("sampled: each rank routed ") for n in plan.notes), plan.notes
    for v in plan.variants:
        assert sum(v.tokens_per_expert) == pytest.approx(R * T * k, rel=1e-9)
        assert sum(v.recv_pairs) == pytest.approx(R * T * k, rel=1e-9)
    assert plan.total_tokens == R * T
    assert (
        calls
        and calls[-1][0] == calls[-1][1]
        and [d for d, _ in calls] == sorted(d for d, _ in calls)
    )


def test_sampling_by_a_divisor_of_T_scales_exactly():
    cfg = load_config("tiny_cpu")
    plan = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=4096, max_logits=4 * 16 * 3 * 64)
    assert "routed 64 of its 4096 tokens" in " ".join(plan.notes)
    for v in plan.variants:
        assert sum(v.tokens_per_expert) == 4 * 4096 * cfg.router.topk
    exact = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=64)
    assert not any(n.startswith("sampled") for n in exact.notes)


def test_too_many_experts_are_refused_up_front(tmp_path, capsys):
    data = load_config("tiny_cpu").model_dump(mode="json")
    data["router"]["num_experts"] = 10**9
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(data))
    t0 = time.perf_counter()
    argv = ["plan", "--config", str(path), "--nodes", "1", "--ranks-per-node", "8"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 5
    assert err.startswith("flexdispatch plan: error: --config /") and "huge.yaml: one token" in err
    assert "plan fewer ranks or experts" in err and err.count("\n") == 1 and len(err) <= 201


def test_cli_answers_for_a_trillion_tokens_with_a_progress_bar(monkeypatch, capsys):
    monkeypatch.setattr(planner, "MAX_LOGITS", 1 << 14)
    monkeypatch.setenv("FLEXDISPATCH_PROGRESS", "1")
    orig = LateProgress.__init__

    def immediate(self, label, *, after_s=2.0, enabled=True):
        orig(self, label, after_s=0.0, enabled=enabled)

    monkeypatch.setattr(LateProgress, "__init__", immediate)
    argv = ["plan", "--preset", "tiny_cpu", "--nodes", "2", "--ranks-per-node", "2"]
    assert cli_main([*argv, "--tokens", str(10**12), "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["tokens_per_rank"] == 10**12 and any("sampled" in n for n in doc["notes"])
    assert "[plan] |" in err and err.endswith("\n")
    assert cli_main([*argv, "--tokens", "64", "--no-progress"]) == 0
    assert "[plan]" not in capsys.readouterr().err


def test_the_bar_waits_two_seconds(monkeypatch, capsys):
    monkeypatch.setenv("FLEXDISPATCH_PROGRESS", "1")
    bar = LateProgress("plan")
    bar(1, 2)
    bar.close()
    assert capsys.readouterr().err == ""
    bar._t0 -= 3
    bar(1, 2)
    bar.close()
    assert capsys.readouterr().err.startswith("\r[plan] |###############")
