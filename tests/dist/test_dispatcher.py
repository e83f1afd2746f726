"""FlexDispatcher API: validation, backend selection, world of one, group helpers.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · k top-k ·
L ranks per node · W worst-case rows.

Most tests run in this process as a world of one (no torch.distributed); one spawned gloo group
checks the errors that depend on the world size and the "auto" selection on every rank.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

from flexdispatch import DispatchConfig, FlexDispatcher, get_dispatch_layout
from flexdispatch.distributed import resolve_ranks_per_node, stable_hash
from tests.dist.harness import run_group
from tests.dist.reference import all_inputs, expert_fn, ref_combine, ref_dispatch

E, K, H = 6, 2, 4


def _inputs(T: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inp = all_inputs(3, R=1, E=E, k=K, H=H)[0]
    return inp.x[:T], inp.idx[:T], inp.probs[:T]


@pytest.mark.parametrize("hier", [False, True])
@pytest.mark.parametrize("W", [0, 16])
def test_world_of_one_matches_reference(hier: bool, W: int) -> None:
    inputs = all_inputs(3, R=1, E=E, k=K, H=H)
    ref = ref_dispatch(inputs, 0, E)
    d = FlexDispatcher(DispatchConfig(hierarchical=hier, num_worst_tokens=W), num_experts=E)
    assert (d.num_ranks, d.rank, d.ranks_per_node, d.num_local_experts) == (1, 0, 1, E)
    inp = inputs[0]
    res = d.dispatch(inp.x, inp.idx, inp.probs)
    M = ref.x.shape[0]
    assert res.recv_x.shape[0] == (W or M)
    assert torch.equal(res.recv_x[:M], ref.x) and torch.equal(res.recv_topk_idx[:M], ref.idx)
    assert torch.equal(res.recv_topk_probs[:M], ref.probs)
    assert torch.equal(res.num_recv_tokens_per_expert, ref.counts)
    out = d.combine(expert_fn(res.recv_x, res.recv_topk_probs, 0), res.handle)
    torch.testing.assert_close(out, ref_combine(inp, E, 1), rtol=1e-6, atol=0)
    assert d.stats.host_syncs == (0 if W else 1)
    assert d.stats.bytes_sent_intra_node == d.stats.bytes_sent_inter_node == 0


def test_layout_argument_gives_the_same_result() -> None:
    x, idx, p = _inputs()
    d = FlexDispatcher(DispatchConfig(), num_experts=E)
    a = d.dispatch(x, idx, p)
    b = d.dispatch(x, idx, p, layout=get_dispatch_layout(idx, E, 1))
    assert torch.equal(a.recv_x, b.recv_x) and torch.equal(a.recv_topk_idx, b.recv_topk_idx)
    assert d.stats.dispatch_calls == 2 and d.stats.host_syncs == 2


def test_backend_selection_and_capabilities() -> None:
    d = FlexDispatcher(DispatchConfig(), num_experts=E)
    assert d.backend_name == "torch" and "auto" in d.backend_reason
    assert "deep_ep" in d.backend_reason
    for answer in (
        d.backend.supports_worst_case(),
        d.backend.supports_hierarchical(),
        d.backend.supports_cuda_graph(),
        d.backend.supports_world(4, 3),
    ):
        assert isinstance(answer, tuple) and isinstance(answer[0], bool) and answer[1]
    assert d.backend.supports_cuda_graph()[0] is False
    assert d.backend.supports_world(4, 3)[0] is False
    w = FlexDispatcher(DispatchConfig(num_worst_tokens=8), num_experts=E)
    assert w.backend.supports_cuda_graph()[0] is True
    w.check_overflow()  # CPU: nothing recorded, nothing raised
    assert "backend='torch'" in repr(w) and "W=8" in repr(w)


def test_deepep_unavailable_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="deepep backend not available"):
        FlexDispatcher(DispatchConfig(backend="deepep"), num_experts=E)


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda x, i, p: (x[0], i, p), ValueError, "x must be 2-D"),
        (lambda x, i, p: (x.long(), i, p), TypeError, "x must be a floating-point"),
        (lambda x, i, p: (x.double(), i, p), TypeError, "bfloat16, float16 or float32"),
        (lambda x, i, p: (x, i.int(), p), TypeError, "topk_idx must have dtype int64"),
        (lambda x, i, p: (x, i, p.double()), TypeError, r"topk_probs must have dtype float32.*to"),
        (lambda x, i, p: (x[:3], i, p), ValueError, "topk_idx has 5 rows but x has 3"),
        (lambda x, i, p: (x, i, p[:, :1]), ValueError, "topk_probs has shape"),
        (lambda x, i, p: (x, i[:, :0], p[:, :0]), ValueError, "at least one column"),
        (lambda x, i, p: (x, [[0]], p), TypeError, "topk_idx must be a torch.Tensor"),
    ],
)
def test_input_validation(change: Any, exc: type, match: str) -> None:
    d = FlexDispatcher(DispatchConfig(), num_experts=E)
    with pytest.raises(exc, match=match):
        d.dispatch(*change(*_inputs()))
    assert d.stats.dispatch_calls == 0


def test_id_range_check_only_with_checks() -> None:
    x, idx, p = _inputs()
    bad = idx.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match=r"outside \[-1, 6\)"):
        FlexDispatcher(DispatchConfig(checks=True), num_experts=E).dispatch(x, bad, p)


def test_layout_and_combine_validation() -> None:
    x, idx, p = _inputs()
    d = FlexDispatcher(DispatchConfig(), num_experts=E)
    layout = get_dispatch_layout(idx[:2], E, 1)
    with pytest.raises(ValueError, match=r"layout\.is_token_in_rank"):
        d.dispatch(x, idx, p, layout=layout)
    res = d.dispatch(x, idx, p)
    with pytest.raises(ValueError, match="y must have shape"):
        d.combine(res.recv_x[:-1], res.handle)
    with pytest.raises(TypeError, match="handle"):
        d.combine(res.recv_x, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="y must be a floating-point"):
        d.combine(res.recv_x.long(), res.handle)


def test_resolve_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_ranks_per_node(None, 8) == (8, "world")
    assert resolve_ranks_per_node(2, 8) == (2, "config")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_ranks_per_node(None, 8) == (4, "LOCAL_WORLD_SIZE")
    assert resolve_ranks_per_node(None, 2) == (2, "LOCAL_WORLD_SIZE")  # EP inside one node
    with pytest.raises(ValueError, match="not a multiple of ranks_per_node=3"):
        resolve_ranks_per_node(3, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x'"):
        resolve_ranks_per_node(None, 8)
    # NOTE: one parser (distributed.env_int): a value is quoted short, the bound named
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "S3CR3T" * 10)
    with pytest.raises(
        ValueError, match=r"LOCAL_WORLD_SIZE='S3CR3TS3CR3T'… is not an integer"
    ) as e:
        resolve_ranks_per_node(None, 8)
    assert "S3CR3T" * 3 not in str(e.value) and "DispatchConfig.ranks_per_node" in str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=0 must be >= 1"):
        resolve_ranks_per_node(None, 8)


def test_stable_hash_is_not_salted() -> None:
    assert stable_hash(("a", 1)) == stable_hash(("a", 1)) != stable_hash(("a", 2))
    assert stable_hash("x") == zlib.crc32(b"'x'")  # the same in every process, unlike hash()


def group_worker(rank: int, R: int) -> dict[str, str]:
    """World-size errors and the auto selection, on every rank."""
    out: dict[str, str] = {}
    d = FlexDispatcher(DispatchConfig(), num_experts=4)
    out["auto"] = f"{d.backend_name}|{d.backend_reason}|{d.ranks_per_node}"
    for key, cfg, experts in (
        ("W", DispatchConfig(num_worst_tokens=3), 4),
        ("L", DispatchConfig(ranks_per_node=3), 6),
        ("E", DispatchConfig(), 5),
    ):
        try:
            FlexDispatcher(cfg, num_experts=experts)
            out[key] = ""
        except ValueError as exc:
            out[key] = str(exc)
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_group_errors_and_auto_selection() -> None:
    results = run_group(group_worker, 2, timeout=100, env={"LOCAL_WORLD_SIZE": "1"})
    for msgs in results:
        assert msgs["auto"].startswith("torch|auto: torch fallback") and msgs["auto"].endswith("|1")
        assert "num_worst_tokens=3" in msgs["W"] and "round it up to 4" in msgs["W"]
        assert "ranks_per_node=3" in msgs["L"]
        assert "num_experts=5" in msgs["E"] and "world size R=2" in msgs["E"]
