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
