"""The fourth DeepEP audit's findings (issue 39) that need no process group: DeepEP 2.5's thread,
channel and GIN rules as the adapter applies them, the link probes, the low-latency topology rule,
the hosts of a group and what ``flexdispatch doctor`` says.

Shape letters (ARCHITECTURE.md): H hidden · E experts · R ranks · e = E / R · k top-k · L ranks per
node.
"""

from __future__ import annotations

import types

import pytest
import torch

from flexdispatch import DispatchConfig
from flexdispatch.backends.deepep import gin
from flexdispatch.backends.deepep.support import deepep_support_checks
from flexdispatch.backends.deepep.v25 import links as v25_links
from flexdispatch.backends.deepep.v25.support import (
    direct_thread_rule,
    direct_threads,
    hybrid_row_rule,
    v25_rules,
)
from flexdispatch.distributed import ranks_per_host
from flexdispatch.doctor.v25 import probe_v25_runtime
from tests.deepep_emu.runtime import ep_layout as emu

OK = (True, "ok")


def test_low_latency_decode_is_not_refused_by_the_normal_node_counts() -> None:
    """P8: 256 ranks (32 nodes of 8) run DeepEP's low-latency kernels; the normal kernels keep
    their node-count list."""
    kw = {"imported": OK, "nccl_on_cuda": OK, "num_experts": 256, "hidden_size": 7168}
    ll = deepep_support_checks(256, 8, mode="low_latency", **kw)
    assert all(ok for _, ok, _ in ll), ll
    normal = dict((name, why) for name, ok, why in deepep_support_checks(256, 8, **kw) if not ok)
    assert "32" in normal["topology"], normal
    bad = deepep_support_checks(256, 4, mode="low_latency", **kw)  # node = rank // 8 still holds
    assert not dict((n, ok) for n, ok, _ in bad)["topology"]
    DispatchConfig(backend="deepep", mode="low_latency", ranks_per_node=8).check_world(256)
    with pytest.raises(ValueError, match="not 32"):
        DispatchConfig(backend="deepep", ranks_per_node=8).check_world(256)


@pytest.mark.parametrize(
    ("R", "E", "row", "packs", "k", "cached"),
    [(576, 1152, 14336, 0, 8, False), (576, 1152, 7168, 56, 8, True), (64, 128, 4096, 0, 2, True)],
)
def test_direct_threads_are_the_emulated_kernels(R, E, row, packs, k, cached) -> None:
    forward, back = direct_threads(R, E, row, packs, k, emu.DEVICE_SMEM)
    warps = emu.dispatch_warps(R, E, row, packs, k, cached)
    assert (back if cached else forward) == (warps + (0 if cached else emu.NOTIFY_WARPS)) * 32


def test_direct_mode_thread_rule_refuses_before_the_backward() -> None:
    """P10: bf16 H = 7168 gives 608 forward threads but 512 cached: R = 576 passed the forward and
    failed to compile at the first backward; now ``v25_rules`` (with H) and every dispatch
    refuse."""
    ok, why, hybrid = v25_rules(576, 8, 1152, hybrid=False, hidden=7168)
    assert not ok and not hybrid and "512" in why and "608" in why, why
    assert v25_rules(512, 8, 1024, hybrid=False, hidden=7168)[0]
    assert v25_rules(576, 8, 1152, hybrid=False)[0]  # H unknown: the dispatch checks its rows
    why = direct_thread_rule(
        576, 1152, row_bytes=7168, scale_packs=56, topk=8, backward_row_bytes=14336
    )
    assert why and "backward" in why, why  # fp8 forward fits, its bf16 backward does not


def test_row_refusal_takes_the_gradients_width_and_any_rank_count() -> None:
    """P10 follow-up: the backward's gradient travels as its own bit view, so an fp32 one is
    twice a bf16 one (fp32 H = 7168, k = 8: 352 forward threads, 256 cached; a bf16-width guess
    said 512 and passed R = 300); rows too wide for one dispatch warp are refused at any R (the
    forward keeps its 128 notify threads but sends nothing; the emulated kernel traps)."""
    from flexdispatch.backends.deepep.v25.layout import row_refusal

    cpu = torch.device("cpu")
    kw = {"X": 7168, "hidden": 14336, "elem": 2, "packs": 0, "k": 8, "device": cpu}
    why = row_refusal(False, 300, 300, grad_elem=4, **kw)
    assert why and "256" in why and "352" in why and "R=300" in why, why
    assert row_refusal(False, 300, 300, grad_elem=2, **kw) is None  # a bf16 gradient fits
    wide = {"X": 120000, "hidden": 120000, "elem": 2, "packs": 0, "k": 2, "device": cpu}
    why = row_refusal(False, 8, 8, grad_elem=2, **wide)
    assert why and "no dispatch warp" in why and "240000-byte" in why, why
    assert emu.dispatch_warps(8, 8, 240000, 0, 2, False) == 0  # the emulator's kernel: none


def test_hybrid_row_rule_is_the_emulated_channel_count() -> None:
    """EV5 / EV6: the adapter's hybrid rules agree with the emulated runtime's channel count."""
    for row, packs, k in ((14336, 0, 8), (7168, 56, 8), (512, 0, 2)):
        C = emu.hybrid_channels(
            16, 256, row // (1 if packs else 2), 1 if packs else 2, packs, k, 1, True
        )
        assert C > 0
    # 16-padded H = 7184 bf16 rows choose 8 channels, too many for the 7424-column combine
    why = hybrid_row_rule(
        4, 16, row_bytes=2 * 7184, scale_packs=0, topk=2, dispatch_cols=7184, combine_cols=7424
    )
    assert why and "combine.hpp:56" in why, why
    assert (
        hybrid_row_rule(
            4,
            16,
            row_bytes=2 * 7424,
            scale_packs=0,
            topk=2,
            dispatch_cols=7424,
            combine_cols=7424,
        )
        is None
    )
    wide = hybrid_row_rule(
        4,
        16,
        row_bytes=2 * 65536,
        scale_packs=0,
        topk=2,
        dispatch_cols=65536,
        combine_cols=65536,
    )
    assert wide and "0 channels" in wide, wide
    assert emu.hybrid_channels(4, 16, 65536, 2, 0, 2, 8, True) == 0


def test_failed_probes_take_documented_defaults_and_never_win() -> None:
    """P5: DeepEP's probes answer 0 when nvidia-smi / ibstat fail; the adapter uses its defaults
    then, and a probe that raises counts as failed."""
    links = v25_links.choose_links(0.0, 0.0, False, hybrid=True, rdma=True)
    assert (links.nvlink_gbs, links.rdma_gbs, links.num_allocated_qps) == (430.0, 50.0, 129)
    assert "default" in links.detail
    measured = v25_links.choose_links(300.0, float("inf"), True, hybrid=True, rdma=True)
    assert (measured.nvlink_gbs, measured.rdma_gbs, measured.num_allocated_qps) == (300.0, 50.0, 65)
    assert v25_links.choose_links(0.0, 0.0, True, hybrid=False, rdma=False).num_allocated_qps == 17

    def boom() -> float:
        raise RuntimeError("nvidia-smi: not found")

    def init(self) -> None:  # the namespace EPBuffer looks its probes up in
        pass

    init.__globals__["get_nvlink_gbs"] = boom  # type: ignore[index]
    try:
        fake = types.SimpleNamespace(EPBuffer=type("EPBuffer", (), {"__init__": init}))
        assert v25_links.probe_links(fake, rdma=False) == (0.0, 0.0, False)  # type: ignore[arg-type]
        assert v25_links.agree_links(fake, None, hybrid=False, rdma=False).nvlink_gbs == 430.0  # type: ignore[arg-type]
    finally:
        del init.__globals__["get_nvlink_gbs"]  # type: ignore[attr-defined]


def test_gin_rule_follows_deepep() -> None:
    """P6: V2.5 asserts the (railed, in hybrid mode) GIN type and GDAKI support (issue 44, Q2:
    the GDAKI field's offset is verified from the V2.5 ``_C``); V2 the GIN type for R > 1;
    ``EP_DISABLE_GIN`` (a non-zero integer) waives both; unknown does not refuse."""
    none = {"ginType": 0, "railedGinType": 3, "gdaki": True}
    assert not gin.gin_rule(none, hybrid=False, generation="v25")[0]
    assert gin.gin_rule(none, hybrid=True, generation="v25")[0]
    no_gdaki = {"ginType": 2, "railedGinType": 2, "gdaki": False}
    assert not gin.gin_rule(no_gdaki, hybrid=False, generation="v25")[0]
    assert gin.gin_rule(no_gdaki, hybrid=False, generation="v2")[0]
    fake = types.SimpleNamespace(emu_nccl_properties=lambda: dict(none))
    ok, why = gin.gin_support(fake, None, hybrid=False, generation="v25", num_ranks=8, env={})
    assert not ok and "EP_DISABLE_GIN=1" in why, why
    for env, want in (({"EP_DISABLE_GIN": "1"}, True), ({"EP_DISABLE_GIN": "0"}, False)):
        got = gin.gin_support(fake, None, hybrid=False, generation="v25", num_ranks=8, env=env)
        assert got[0] is want, got
    assert gin.gin_support(fake, None, hybrid=False, generation="v2", num_ranks=1, env={})[0]
    assert gin.gin_disabled({"EP_DISABLE_GIN": "yes"}) is False  # DeepEP's get_env<int>
    unknown = types.SimpleNamespace()
    ok, why = gin.gin_support(unknown, None, hybrid=False, generation="v25", num_ranks=8, env={})
    assert ok and "not checked" in why, why


@pytest.mark.parametrize(
    ("hosts", "L"),
    [("AAAABBBB", 4), ("AABBCCDD", 2), ("ABABABAB", 1), ("AAAAAAAA", 8), ("AAAABBCC", 2)],
)
def test_ranks_per_host_is_the_largest_block_on_one_host(hosts: str, L: int) -> None:
    """P9: a strided EP group's ranks are not NVLink peers of each other."""
    assert ranks_per_host([ord(h) for h in hosts]) == L


def test_doctor_says_what_was_probed_and_chosen_and_about_gin() -> None:
    """P5 / P6: ``flexdispatch doctor`` names the probes' values and the defaults used, and GIN."""
    checks = probe_v25_runtime(
        env={}, which=lambda name: None, maps="/nonexistent", links=lambda: (0.0, 0.0, False)
    )
    got = {c["name"]: c for c in checks}
    links = got["links"]
    assert not links["ok"] and links["level"] == "warning", links
    assert "probed NVLink 0 GB/s" in links["detail"] and "430" in links["detail"], links
    assert "deepep_num_sms" in links["fix"], links
    assert "ncclCommQueryProperties" in got["gin"]["detail"], got["gin"]
    off = probe_v25_runtime(
        env={"EP_DISABLE_GIN": "1"},
        which=lambda name: None,
        maps="/nonexistent",
        links=lambda: None,
    )
    off = {c["name"]: c for c in off}
    assert off["gin"]["ok"] and "EP_DISABLE_GIN" in off["gin"]["detail"]
    assert "not probed" in off["links"]["detail"]
