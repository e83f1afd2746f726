"""The emulated DeepEP runtime's registry of DeepEP's own asserts and traps, and its transport.

What is checked here: the registry is well formed, each check raises the way DeepEP fails (a
host assert is a ``RuntimeError`` naming the source line; a device assert says the GPU would
have trapped), a limit only holds at the releases whose source has it, and the transport's
exchanges move bytes exactly on a real 2-rank gloo group with every collective counted.

What cannot be checked in CI: that each citation is still the line DeepEP has (CI has no DeepEP
source). ``test_citations_match_a_deepep_checkout`` runs that check when
``FLEXDISPATCH_DEEPEP_SRC`` names a DeepEP git checkout (``fetch`` of deepseek-ai/DeepEP) and is
reported as skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.deepep_emu.runtime import limits, transport
from tests.dist.harness import run_group

KINDS = {"host", "device", "behaviour"}


def test_registry_is_well_formed():
    ids = [lim.id for lim in limits._ALL]
    assert len(ids) == len(set(ids)), "duplicate limit ids"
    assert len(ids) >= 60
    for lim in limits.LIMITS.values():
        assert lim.kind in KINDS, lim.id
        assert lim.text and lim.needle, lim.id
        if not lim.sources:  # a hazard DeepEP never checks: must say so
            assert lim.kind != "host" and "no check" in lim.text, lim.id
        for release, (path, line) in lim.sources.items():
            assert release in limits.COMMITS, (lim.id, release)
            assert path and line > 0, lim.id
            assert limits.COMMITS[release][:12] in lim.cite(release)
    assert "not checked" in limits.LIMITS["worst.overflow"].cite("2.1.0")
    assert limits.holds("worst.overflow", "1.2.1") and limits.holds("worst.overflow", "2.1.0")


def test_release_specific_limits_hold_only_where_their_source_has_them():
    # The v1.2.1 intranode combine divergence was fixed after the tag.
    assert limits.holds("combine.v121_divergence", "1.2.1")
    assert not limits.holds("combine.v121_divergence", "2.1.0")
    limits.host_assert(False, "combine.v121_divergence", "2.1.0")  # not checked: no raise
    both = [lim.id for lim in limits.LIMITS.values() if len(lim.sources) == 2]
    assert "dispatch.topk_max" in both


def test_host_assert_raises_like_deepep_and_names_the_source():
    limits.host_assert(True, "dispatch.topk_max", "2.1.0")
    with pytest.raises(RuntimeError, match="Assertion error") as err:
        limits.host_assert(False, "dispatch.topk_max", "2.1.0", "k=40")
    assert isinstance(err.value, limits.DeepEPHostAssert)
    assert "dispatch.topk_max" in str(err.value) and "k=40" in str(err.value)
    assert limits.LIMITS["dispatch.topk_max"].sources["2.1.0"][0] in str(err.value)


def test_device_trap_says_the_gpu_would_have_trapped():
    with pytest.raises(limits.DeviceTrap, match="would have trapped") as err:
        limits.device_trap(False, "worst.overflow", "1.2.1", "W=8 < 12")
    assert "worst.overflow" in str(err.value)


def test_unknown_limit_is_an_error_not_a_pass():
    with pytest.raises(KeyError):
        limits.host_assert(False, "no.such.limit", "2.1.0")


@pytest.mark.skipif(
    not os.environ.get("FLEXDISPATCH_DEEPEP_SRC"),
    reason="needs a DeepEP git checkout in $FLEXDISPATCH_DEEPEP_SRC (not in CI)",
)
def test_citations_match_a_deepep_checkout():
    assert limits._verify(os.environ["FLEXDISPATCH_DEEPEP_SRC"]) == 0


def test_pack_unpack_round_trip_over_mixed_dtypes():
    x = torch.randn(5, 8).to(torch.bfloat16)
    idx = torch.randint(-1, 9, (5, 3), dtype=torch.int64)
    w = torch.rand(5, 3)
    rows = transport.pack([x, idx, w])
    assert rows.dtype == torch.uint8 and rows.shape == (5, 8 * 2 + 3 * 8 + 3 * 4)
    got = transport.unpack(
        rows, [(torch.bfloat16, (8,)), (torch.int64, (3,)), (torch.float32, (3,))]
    )
    for a, b in zip(got, (x, idx, w), strict=True):
        assert torch.equal(a, b)


def _exchange_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    transport.reset()
    g = dist.group.WORLD
    # rank r sends (r + 1) rows to every peer p, row value = 100 * r + p
    counts = [rank + 1] * world
    send = torch.cat(
        [torch.full((rank + 1, 4), 100 * rank + p, dtype=torch.uint8) for p in range(world)]
    )
    with transport.kernel("test_exchange"):
        assert transport.in_runtime()
        recv, got_counts = transport.exchange(send, counts, g)
    assert not transport.in_runtime()
    expect = torch.cat(
        [torch.full((s + 1, 4), 100 * s + rank, dtype=torch.uint8) for s in range(world)]
    )
    return {
        "counts": got_counts,
        "ok": bool(torch.equal(recv, expect)),
        "counters": dict(transport.counters()),
    }


@pytest.mark.timeout(120)
def test_exchange_moves_rows_on_a_real_gloo_group_and_counts_its_collectives():
    out = run_group(_exchange_worker, 2, timeout=90)
    for r, res in enumerate(out):
        assert res["ok"], r
        assert res["counts"] == [1, 2]
        assert res["counters"].get("collectives") == 2
        assert res["counters"].get("test_exchange") == 1


def test_collectives_outside_a_kernel_are_refused():
    with pytest.raises(AssertionError):
        transport.exchange_counts(torch.zeros(2, 1, dtype=torch.int64), None)


def test_every_limit_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "deepep.md").read_text()
    missing = [lid for lid in limits.LIMITS if f"`{lid}`" not in doc]
    assert not missing, f"docs/deepep.md does not list: {missing}"


def test_container_recipes_pin_what_the_tests_use() -> None:
    # the CUDA 13 recipe installs the same DeepEP wheel the test set-up installs --no-deps, with the
    # CUDA 13 torch that wheel pins; the CUDA 12 recipe builds the v1.2.1 tag the limits name
    import re
    from importlib import metadata
    from pathlib import Path

    from tests.deepep_emu.load import WHEEL

    root = Path(__file__).resolve().parents[2]
    sgl = (root / "docker" / "Dockerfile.sgl-deep-ep").read_text()
    version = WHEEL.split("==")[1]
    assert f"ARG SGL_DEEP_EP_VERSION={version}" in sgl
    assert '--no-deps "$deepep_wheel"' in (root / "scripts" / "setup.sh").read_text()
    assert f'deepep_wheel="{WHEEL}"' in (root / "scripts" / "setup.sh").read_text()
    pinned = [r for r in metadata.requires("sgl-deep-ep") or [] if r.startswith("torch")]
    assert pinned, "sgl-deep-ep declares its torch pin"
    want = re.search(r"torch==([0-9.]+)", pinned[0])
    assert want and f"ARG TORCH_VERSION={want.group(1)}" in sgl, (pinned, "Dockerfile.sgl-deep-ep")
    assert "whl/cu130" in sgl and "cuda:13." in sgl
    # the wheel itself never resolves its dependencies (they would pull another torch build)
    installs = [ln for ln in sgl.splitlines() if "pip install" in ln and "sgl-deep-ep" in ln]
    assert installs and all("--no-deps" in ln for ln in installs), installs
    v1 = (root / "Dockerfile").read_text()
    assert "ARG DEEPEP_REF=v1.2.1" in v1 and "cuda:12." in v1
