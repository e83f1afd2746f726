"""Tests of ``flexdispatch plan``: JSON keys, the human table, the plot and error messages.

Shape letters: T tokens per rank · E experts · R ranks · k top-k · L ranks per node · N nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from flexdispatch.cli import plan as plan_cmd
from flexdispatch.cli._common import CliError, format_error


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexdispatch")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cmd.register(sub)
    return parser.parse_args(["plan", *argv])


def run(argv: list[str]) -> int:
    args = parse(argv)
    return args.func(args)


SMALL = ["--preset", "tiny_cpu", "--nodes", "2", "--ranks-per-node", "2", "--tokens", "64"]


def test_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*SMALL, "--json", "--skew", "0.5", "--seed", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    top = {
        "schema", "preset", "num_experts", "topk", "hidden_size", "nodes", "ranks_per_node",
        "num_ranks", "experts_per_rank", "tokens_per_rank", "total_tokens", "skew", "seed",
        "elem_size", "bandwidth_gbps", "wall_s", "notes", "variants", "deepep",
    }  # fmt: skip
    assert set(doc) == top
    assert doc["schema"] == "flexdispatch.plan/1"
    assert (doc["num_ranks"], doc["experts_per_rank"], doc["total_tokens"]) == (4, 4, 256)
    assert (doc["skew"], doc["seed"]) == (0.5, 3)
    assert [v["name"] for v in doc["variants"]] == ["preset", "ungrouped", "node_limited"]
    v = doc["variants"][0]
    assert set(v) == {"name", "num_groups", "group_topk", "same_as", "note", "load", "traffic",
                      "worst_case"}  # fmt: skip
    assert set(v["load"]) == {
        "recv_rows", "recv_pairs", "tokens_per_expert", "node_recv_rows", "node_rdma_rows_in",
        "avg_ranks_per_token", "avg_nodes_per_token", "hot_ranks", "hot_experts",
        "per_rank_recv_rows", "per_node_recv_rows", "per_expert_tokens",
    }  # fmt: skip
    assert set(v["load"]["recv_rows"]) == {"min", "mean", "max", "imbalance"}
    assert len(v["load"]["per_rank_recv_rows"]) == 4 and len(v["load"]["per_expert_tokens"]) == 16
    assert set(v["traffic"]) == {"flat", "hierarchical", "deepep"}
    t = v["traffic"]["hierarchical"]
    assert set(t) == {"dispatch_row_bytes", "combine_row_bytes", "row_format", "link_pattern",
                      "overlap", "dispatch", "combine"}  # fmt: skip
    assert set(t["dispatch"]) == {
        "nvlink_bytes", "rdma_bytes", "nvlink_recv_bytes", "rdma_recv_bytes",
        "total_nvlink_bytes", "total_rdma_bytes", "time_us",
    }  # fmt: skip
    assert set(v["worst_case"]) == {
        "observed_max_recv_rows", "deepep_w", "deepep_test_w", "torch_flat_w", "torch_hier_w",
        "deepep_v2_w",
    }  # fmt: skip
    assert v["worst_case"]["deepep_v2_w"] == 64 * 4  # T * R
    assert set(doc["deepep"]) == {
        "supported", "reason", "num_sms", "hidden_bytes", "dispatch_config", "combine_config",
        "num_nvl_bytes", "nvl_bytes_dispatch", "nvl_bytes_combine", "num_rdma_bytes",
        "rdma_bytes_dispatch", "rdma_bytes_combine", "low_latency", "elastic",
    }  # fmt: skip
    assert doc["deepep"]["supported"] is False  # 2 nodes x 2 ranks: DeepEP wants 8 per node
    v2 = doc["deepep"]["elastic"]
    assert set(v2) == {
        "supported", "reason", "mode", "use_fp8_dispatch", "allow_hybrid_mode",
        "allow_multiple_reduction", "num_rdma_ranks", "num_nvl_ranks", "num_scaleout_ranks",
        "num_scaleup_ranks", "scaleup_nvlink", "num_topk", "elem_size", "dispatch_hidden",
        "combine_hidden", "hidden", "dispatch_token_bytes", "combine_token_bytes", "dropless",
        "worst_case",
    }  # fmt: skip
    assert v2["supported"] is True and v2["reason"] == ""  # V2 takes 2 nodes of 2
    assert (v2["mode"], v2["use_fp8_dispatch"], v2["allow_hybrid_mode"]) == ("direct", False, False)
    assert v2["allow_multiple_reduction"] is True
    assert (v2["num_rdma_ranks"], v2["num_nvl_ranks"]) == (2, 2)
    assert v2["num_scaleout_ranks"] == 1 and v2["num_scaleup_ranks"] == 4  # direct: 1 x R
    assert v2["scaleup_nvlink"] is False  # R = 4 spans two NVLink domains
    sizes = {"num_max_tokens_per_rank", "num_bytes", "dispatch_bytes", "combine_bytes"}
    assert set(v2["dropless"]) == sizes
    assert set(v2["worst_case"]) == sizes | {"num_worst_tokens"}
    assert v2["dropless"]["num_max_tokens_per_rank"] == 64
    w2 = v2["worst_case"]
    assert (w2["num_worst_tokens"], w2["num_max_tokens_per_rank"]) == (256, 64)  # W = T*R, M = T
    assert v2["dropless"]["num_bytes"] % (2 << 20) == 0 and v2["dropless"]["num_bytes"] > 0
    # Load and traffic agree: hierarchical RDMA rows are the rows entering the 2 nodes.
    rows_in = round(v["load"]["node_rdma_rows_in"]["mean"] * 2)
    assert t["dispatch"]["total_rdma_bytes"] == rows_in * t["dispatch_row_bytes"] > 0


def test_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*SMALL, "--rdma-gbps", "25", "--nvlink-gbps", "100", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "tiny_cpu on 2 node(s) x 2 ranks = R 4" in out
    assert "NVLink 100 GB/s, RDMA 25 GB/s" in out
    assert "rows of 4 B/elem" in out
    for text in ("Load per routing variant", "hierarchical", "deepep", "worst-case W",
                 "DeepEP buffers", "hottest experts", "(intranode only;"):  # fmt: skip
        assert text in out
    # DeepEP V2: the buffer block and a worst-case line per variant, across nodes.
    assert "DeepEP V2 buffer (ElasticBuffer.get_buffer_size_hint" in out
    assert "logical 1 scale-out x 4 scale-up" in out
    assert "DeepEP V2 (deepep_api='v2') worst-case W >= T*R = 256" in out
    assert "intranode and across nodes" in out
    # fp32 rows: 2H bf16 columns dispatched (tiny_cpu H = 64 -> 128, at least 256), combine 256
    assert "hidden = 256 bf16 columns (dispatch 256, combine 256)" in out
    assert len(out.splitlines()) < 60  # a summary, not one row per rank


def test_config_file_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flexdispatch.config import preset_path

    path = tmp_path / "mine.yaml"
    path.write_text(preset_path("tiny_cpu").read_text())
    assert run(["--config", str(path), "--nodes", "1", "--ranks-per-node", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_ranks"] == 4


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip(
        "matplotlib", reason="--plot needs the optional 'plot' extra (matplotlib), not installed"
    )
    out = tmp_path / "traffic.png"
    assert run([*SMALL, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {out}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(CliError) as info:  # NOTE: before the work, naming --plot
        run([*SMALL, "--plot", str(tmp_path / "x.png")])
    (err,) = format_error("plan", info.value)
    assert err.startswith("flexdispatch plan: error: --plot ") and "matplotlib" in err, err
    assert err.endswith(": pip install 'flexdispatch[plot]'"), err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--preset", "deepseek_v3", "--nodes", "3", "--ranks-per-node", "8"], r"256 .* = 24"),
        (["--preset", "no_such_model", "--nodes", "1", "--ranks-per-node", "8"], "unknown preset"),
        ([*SMALL, "--num-sms", "21"], "even"),
    ],
)
def test_bad_inputs_raise_clear_errors(argv: list[str], match: str) -> None:
    with pytest.raises((ValueError, CliError), match=match):
        run(argv)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--preset", "deepseek_v3", "--nodes", "0", "--ranks-per-node", "8"], "--nodes: must be"),
        ([*SMALL, "--ll-tokens", "0"], "--ll-tokens: must be >= 1"),
        ([*SMALL, "--seed", "-1"], "--seed: must be >= 0"),
        ([*SMALL, "--skew", "-1"], "--skew: must be a finite number >= 0"),
        ([*SMALL, "--rdma-gbps", "0"], "--rdma-gbps: must be a finite number > 0"),
    ],
)
def test_ranges_are_checked_at_parse_time(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2 and match in capsys.readouterr().err


def test_preset_and_config_are_exclusive_and_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--nodes", "1", "--ranks-per-node", "8"])
    with pytest.raises(SystemExit):
        parse(
            ["--preset", "tiny_cpu", "--config", "x.yaml", "--nodes", "1", "--ranks-per-node", "8"]
        )
    assert "--preset" in capsys.readouterr().err
