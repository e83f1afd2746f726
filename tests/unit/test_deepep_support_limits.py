"""DeepEP's limits in the support check: ``auto`` falls back with the reason, ``deepep`` refuses.

R ranks · L ranks per node · N = R / L nodes · E experts · e = E / R · n low-latency tokens.

These run without a process group: ``deepep_support_for`` takes a ``deep_ep`` module and the world
shape. The module here is a stand-in that only names its release and NVLink domain (what the
support rule reads); the kernels themselves are exercised under DeepEP's own Python layer in
``tests/dist/test_deepep_real.py``.
"""

from __future__ import annotations

import types

import pytest

from flexdispatch.backends.deepep.support import deepep_support_for


def _module(release: str, nvl_peers: int = 8) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        IS_EMULATOR=True, EMULATED_RELEASE=release, NUM_MAX_NVL_PEERS=nvl_peers, Buffer=object
    )


def _support(release: str, R: int, L: int, **kw: object) -> tuple[bool, str]:
    return deepep_support_for(R, L, nccl_on_cuda=(False, "no CUDA"), deep_ep=_module(release), **kw)


@pytest.mark.parametrize("release", ["1.2.1", "2.1.0"])
def test_local_experts_intranode(release: str) -> None:
    ok, why = _support(release, 8, 8, num_experts=8 * 128)
    assert ok, why
    ok, why = _support(release, 8, 8, num_experts=8 * 129)
    assert not ok and "129 local experts" in why and "128" in why and release in why


@pytest.mark.parametrize("release", ["1.2.1", "2.1.0"])
def test_experts_per_node_internode(release: str) -> None:
    ok, why = _support(release, 16, 8, num_experts=1024)  # 512 experts per node
    assert ok, why
    ok, why = _support(release, 16, 8, num_experts=1040)  # 520 per node
    assert not ok and "520 experts per node" in why and "512" in why


def test_node_counts_per_release() -> None:
    for nodes in (18, 20):
        for release in ("1.2.1", "2.1.0"):
            ok, why = _support(release, 8 * nodes, 8, num_experts=8 * nodes)
            assert ok, why
    ok, why = _support("1.2.1", 24, 8, num_experts=24)
    assert not ok and "not 3" in why
    ok, why = _support("2.1.0", 24, 8, num_experts=24)
    assert ok, why


def test_low_latency_token_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    ok, why = _support(
        "2.1.0", 2, 2, num_experts=4, mode="low_latency", num_max_dispatch_tokens_per_rank=3
    )
    assert not ok and "multiple of 4" in why
    ok, why = _support(
        "2.1.0", 2, 2, num_experts=4, mode="low_latency", num_max_dispatch_tokens_per_rank=128
    )
    assert ok, why
    # the default QP depth (1024) holds 2 * (n + 1) work requests only up to n = 511
    ok, why = _support(
        "2.1.0", 2, 2, num_experts=4, mode="low_latency", num_max_dispatch_tokens_per_rank=512
    )
    assert not ok and "NVSHMEM_QP_DEPTH=1024" in why and "1026" in why
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "2048")
    ok, why = _support(
        "2.1.0", 2, 2, num_experts=4, mode="low_latency", num_max_dispatch_tokens_per_rank=512
    )
    assert ok, why


def test_low_latency_hidden_sizes_per_release() -> None:
    ok, why = _support("1.2.1", 2, 2, num_experts=4, mode="low_latency", hidden_size=3072)
    assert not ok and "3072" in why
    ok, why = _support("2.1.0", 2, 2, num_experts=4, mode="low_latency", hidden_size=3072)
    assert ok, why
