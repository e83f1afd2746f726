"""Audit-3 findings that need no process group (``deepep-audit-3.md``, N1, N14, ...).

R ranks · L ranks per node · N = R / L nodes · E experts · k top-k.
"""

from __future__ import annotations

import pytest

from flexdispatch.config import DispatchConfig, load_config


# --------------------------------------------------------------------- N1 / N14: check_world
@pytest.mark.timeout(60)
def test_check_world_takes_the_configured_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = DispatchConfig(backend="deepep", ranks_per_node=8)
    cfg.check_world(16)  # N1: L = 8 from the config, not L = R = 16
    cfg.check_world(16, 8)
    with pytest.raises(ValueError, match="at most 8 ranks, got L=16"):
        DispatchConfig(backend="deepep").check_world(16)  # nothing says otherwise: L = R
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    DispatchConfig(backend="deepep").check_world(16)  # the launcher's L, as the dispatcher


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", [3, 6, 12, 18, 20])
def test_check_world_accepts_every_release_node_count(nodes: int) -> None:
    DispatchConfig(backend="deepep", ranks_per_node=8).check_world(8 * nodes)  # N14


@pytest.mark.timeout(60)
def test_check_world_still_refuses_unsupported_node_counts() -> None:
    with pytest.raises(ValueError, match="nodes, not 5"):
        DispatchConfig(backend="deepep", ranks_per_node=8).check_world(40)


@pytest.mark.timeout(60)
def test_moe_config_check_world_forwards_l() -> None:
    cfg = load_config("tiny_cpu")
    cfg = cfg.model_copy(
        update={
            "router": cfg.router.model_copy(update={"num_experts": 32}),
            "dispatch": cfg.dispatch.model_copy(update={"backend": "deepep", "ranks_per_node": 8}),
        }
    )
    cfg.check_world(16)
    cfg.check_world(16, 8)


# --------------------------------------------------------------------- repeated / out-of-range ids
def _routing(T: int = 6, E: int = 8, k: int = 3, seed: int = 0):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g)
    x = torch.randn(T, 4, generator=g)
    return x, idx, probs


@pytest.mark.timeout(60)
def test_repeated_ids_raise_naming_the_token_on_cpu() -> None:
    from flexdispatch import FlexDispatcher

    x, idx, p = _routing()
    idx[4] = idx.new_tensor([5, 1, 5])
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8)
    with pytest.raises(ValueError, match=r"twice in token 4 \(\[5, 1, 5\]") as info:
        d.dispatch(x, idx, p)
    assert "distinct" in str(info.value) and d.stats.dispatch_calls == 0
    idx[4, 2] = -1
    idx[3, 1:] = -1  # repeated -1 (unused slots) is fine
    d.dispatch(x, idx, p)


@pytest.mark.timeout(60)
def test_repeated_and_out_of_range_ids_are_masked_and_counted_when_deferred(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from flexdispatch import FlexDispatcher, _validate

    monkeypatch.setattr(_validate, "defer_value_checks", lambda device: True)
    x, idx, p = _routing()
    bad = idx.clone()
    bad[1] = bad.new_tensor([2, 2, 2])
    bad[4, 2] = 9
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8)
    got = d.dispatch(x, bad, p)  # no raise: counted on the device
    clean = bad.clone()
    clean[1, 1:] = -1
    clean[4, 2] = -1
    want = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8).dispatch(
        x, clean, p.masked_fill(clean < 0, 0)
    )
    assert torch.equal(got.recv_topk_idx, want.recv_topk_idx)
    assert torch.equal(got.recv_topk_probs, want.recv_topk_probs)
    assert torch.equal(got.recv_x, want.recv_x)
    with pytest.raises(ValueError) as info:
        d.check_overflow()
    msg = str(info.value)
    assert "twice in a token 2 time(s)" in msg and "distinct" in msg and "outside [-1, 8)" in msg
    assert d.stats.extra["repeated_expert_ids"] == 2 and d.stats.extra["invalid_expert_ids"] == 1


@pytest.mark.timeout(60)
def test_mask_bad_ids_keeps_the_first_slot() -> None:
    import torch

    from flexdispatch._validate import mask_bad_ids

    idx = torch.tensor([[3, 3, -1, -1], [7, 1, 7, 12], [0, 1, 2, 3]])
    got, repeats, oob = mask_bad_ids(idx, 8, out_of_range=True)
    assert got.tolist() == [[3, -1, -1, -1], [7, 1, -1, -1], [0, 1, 2, 3]]
    assert int(repeats) == 2 and int(oob) == 1
    got, repeats, oob = mask_bad_ids(idx, 8, out_of_range=False)
    assert got[1].tolist() == [7, 1, -1, 12] and oob is None
