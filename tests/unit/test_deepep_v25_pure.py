"""DeepEP 2.5 (``deepep_api="v25"``) without a process group: the limits registry checked against
the installed wheel's source, the rules, the JIT buckets, the id guard, the traffic counts, the
token layouts, the loader, the config fields.

Shape letters: T tokens · E experts · R ranks · e = E / R · k top-k · L ranks per node.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

from flexdispatch import DispatchConfig
from flexdispatch.backends.deepep.v25.rows import (
    V25Traffic,
    combine_row_bytes,
    dispatch_row_bytes,
    guard_ids,
    traffic_rows,
)
from flexdispatch.backends.deepep.v25.support import split_hook, token_bucket, v25_rules
from tests.deepep_emu.runtime import ep_layout, ep_limits, limits

_WHEEL = importlib.util.find_spec("deep_ep_v25") is not None


@pytest.mark.skipif(not _WHEEL, reason=f"{ep_limits.WHEEL} is not installed (scripts/setup.sh)")
def test_every_v25_citation_is_the_line_of_the_installed_wheel() -> None:
    assert ep_limits.verify_wheel() == []
    # a wrong line is caught: shift one citation by a line and it misses
    rows = list(ep_limits.EP_ROWS)
    lid, kind, text, needle, path, line = rows[0]
    ep_limits.EP_ROWS[0] = (lid, kind, text, needle, path, line + 1)
    try:
        assert ep_limits.verify_wheel() == [
            f"{lid} {path}:{line + 1}: "
            + repr((ep_limits.wheel_root() / path).read_text().splitlines()[line].strip())
        ]
    finally:
        ep_limits.EP_ROWS[:] = rows


def test_v25_limits_join_the_registry_for_their_release_only() -> None:
    ids = [row[0] for row in ep_limits.EP_ROWS]
    assert len(ids) == len(set(ids)) and len(ids) >= 70
    for lid in ids:
        lim = limits.LIMITS[lid]
        assert set(lim.sources) == {"2.5.0"} and lid.startswith("ep."), lid
        assert limits.holds(lid, "2.5.0") and not limits.holds(lid, "2.1.0"), lid
        assert "@ sgl-deep-ep-v25==0.1.0rc0 (DeepEP 2.5.0)" in lim.cite("2.5.0")
    # V1 / V2 limits do not hold at 2.5.0 (its package has no Buffer / ElasticBuffer)
    assert not limits.holds("dispatch.topk_max", "2.5.0")
    with pytest.raises(RuntimeError, match=r"ep\.num_max: csrc/buffers/ep\.hpp:344"):
        limits.host_assert(False, "ep.num_max", "2.5.0")


def test_token_buckets_are_powers_of_two_from_16() -> None:
    got = {n: token_bucket(n) for n in (1, 15, 16, 17, 32, 33, 100, 128, 129, 4096, 4097)}
    assert got == {
        1: 16,
        15: 16,
        16: 16,
        17: 32,
        32: 32,
        33: 64,
        100: 128,
        128: 128,
        129: 256,
        4096: 4096,
        4097: 8192,
    }
    assert len({token_bucket(n) for n in range(1, 513)}) == 6  # 16 .. 512
    with pytest.raises(ValueError, match="positive"):
        token_bucket(0)


def test_ep_rules_name_each_limit() -> None:
    assert v25_rules(8, 8, 256) == (True, "DeepEP 2.5 over one NVLink domain of 8 rank(s)", False)
    ok, why, hybrid = v25_rules(16, 8, 256)
    assert ok and hybrid and "hybrid mode over 2 nodes of 8" in why
    ok, why, hybrid = v25_rules(16, 4, 256)  # 4 GPUs per node: V1 refuses, V2.5 does not
    assert ok and hybrid, why
    ok, why, hybrid = v25_rules(16, 8, 256, hybrid=False)
    assert ok and not hybrid and "direct mode" in why
    ok, why, hybrid = v25_rules(4, 2, 4 * 127)  # L + e = 2 + 127 > 128: direct mode
    assert ok and not hybrid and "L + e = 2 + 127" in why
    assert not v25_rules(4, 2, 4 * 127, hybrid=True)[0]
    assert "64" in v25_rules(130, 65, 130, hybrid=True)[1]
    assert "32" in v25_rules(66, 2, 66, hybrid=True)[1]
    for args, text in (
        ((2048, 8, 2048), "1024 ranks"),
        ((12, 8, 96), "multiple of the NVLink domain"),
        ((8, 8, 12), "not divisible"),
        ((8, 8, 4096), "2048 experts"),
        ((2, 2, 2 * 513), "513 local experts"),
    ):
        ok, why, _ = v25_rules(*args)
        assert not ok and text in why, (args, why)
    assert "multiple of R=4" in v25_rules(4, 4, 16, num_worst_tokens=6)[1]


def test_guard_ids_keeps_kernels_in_bounds() -> None:
    idx = torch.tensor([[0, 3, 3, -1], [7, 8, -5, 1], [2, 2, 2, 2], [-1, -1, -1, -1]])
    got = guard_ids(idx, 8, raise_now=False)
    assert got.tolist() == [[0, 3, -1, -1], [7, -1, -1, 1], [2, -1, -1, -1], [-1, -1, -1, -1]]
    with pytest.raises(ValueError, match=r"twice in 2 token\(s\) \(token 0: \[0, 3, 3, -1\]\)"):
        guard_ids(idx, 8, raise_now=True)
    assert guard_ids(torch.tensor([[9], [1]]), 8, raise_now=True).tolist() == [[-1], [1]]


@pytest.mark.parametrize("hybrid", [False, True])
def test_traffic_rows_match_a_per_token_loop(hybrid: bool) -> None:
    R, L, e, k = 8, 4, 3, 4
    g = torch.Generator().manual_seed(1)
    idx = torch.rand(20, R * e, generator=g).argsort(1)[:, :k]
    idx[torch.rand(20, k, generator=g) < 0.3] = -1
    for me in (0, 5):
        t = V25Traffic.of(me, R, L, hybrid, "cpu")
        sent = intra = inter = 0
        for row in idx.tolist():
            ranks = {i // e for i in row if i >= 0}
            sent += len(ranks)
            if hybrid:
                intra += sum(g % L != me % L for g in ranks)
                inter += len({g // L for g in ranks} - {me // L})
            else:
                intra += sum(g // L == me // L and g != me for g in ranks)
                inter += sum(g // L != me // L for g in ranks)
        assert traffic_rows(idx, e, t).tolist() == [sent, intra, inter], (me, hybrid)


def test_row_bytes_are_the_emulated_token_layouts() -> None:
    for hidden_bytes, packs, k in ((512, 0, 8), (14336, 0, 8), (7168, 56, 8), (32, 0, 1)):
        lay = ep_layout.token_bytes(hidden_bytes, packs * 4, k, True, False)
        assert dispatch_row_bytes(hidden_bytes, packs, k) == lay
    assert combine_row_bytes(7168, 8) == ep_layout.token_bytes(2 * 7168, 0, 8, False, False)


def test_the_loader_gives_the_wheels_epbuffer_and_leaves_no_import_behind() -> None:
    if not _WHEEL:
        pytest.skip(f"{ep_limits.WHEEL} is not installed (scripts/setup.sh)")
    from tests.deepep_emu.load import emulator_or_skip

    had = {m for m in ("deep_ep_v25", "torch._dynamo") if m in sys.modules}
    pkg = emulator_or_skip(nvl_peers=2, release="2.5.0")
    assert pkg.__version__ == "2.5.0" and pkg.IS_EMULATOR and pkg.num_max_nvl_peers() == 2
    assert pkg.EPBuffer.__module__ == "deep_ep_v25.buffers.ep"
    assert pkg.ep.__file__ == str(ep_limits.wheel_root() / "buffers" / "ep.py")
    assert not hasattr(pkg, "Buffer") and not hasattr(pkg, "ElasticBuffer")
    # the loader imports neither (an earlier test in the same process may have)
    assert {m for m in ("deep_ep_v25", "torch._dynamo") if m in sys.modules} <= had
    assert split_hook(pkg) == (None, pkg, True)
    assert split_hook({"deep_ep_v25": pkg}) == (None, pkg, True)


def test_config_takes_the_ep_api_and_its_fields() -> None:
    cfg = DispatchConfig(
        backend="deepep", deepep_api="v25", num_worst_tokens=32, expert_alignment=8
    )
    assert cfg.deepep_hybrid is None and cfg.expert_alignment == 8
    cfg.check_world(16, 4)  # V2.5 takes 4 GPUs per node across nodes (V1 does not)
    with pytest.raises(ValueError, match="4 ranks per node"):
        DispatchConfig(backend="deepep", deepep_api="v1").check_world(16, 4)
    with pytest.raises(ValueError, match="expert_alignment"):
        DispatchConfig(expert_alignment=0)


def test_v25_container_recipe_and_setup_pin_what_the_tests_use() -> None:
    # the V2.5 image installs the wheel the test set-up installs, --no-deps, over the CUDA 13
    # torch it pins, with what DeepEP 2.5 needs at run time: nvcc >= 13.1, g++ (C++20), NCCL
    import re
    from importlib import metadata
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    recipe = (root / "docker" / "Dockerfile.deepep-v25").read_text()
    setup = (root / "scripts" / "setup.sh").read_text()
    version = ep_limits.WHEEL.split("==")[1]
    assert f"ARG SGL_DEEP_EP_V25_VERSION={version}" in recipe
    assert f'deepep_v25_wheel="{ep_limits.WHEEL}"' in setup
    assert '--no-deps "$deepep_v25_wheel"' in setup
    installs = [ln for ln in recipe.splitlines() if "pip install" in ln and "deep-ep" in ln]
    assert len(installs) == 2 and all("--no-deps" in ln for ln in installs), installs
    m = re.search(r"cuda:(\d+)\.(\d+)\.\d+-cudnn-devel", recipe)
    assert m and (int(m.group(1)), int(m.group(2))) >= (13, 1), "a CUDA 13.1+ devel base (nvcc)"
    nccl = re.search(r"ARG NCCL_VERSION=(\d+)\.(\d+)\.(\d+)", recipe)
    assert nccl and tuple(map(int, nccl.groups())) >= (2, 32, 3)
    assert " g++ " in recipe and "infiniband-diags" in recipe
    if _WHEEL:
        pinned = [r for r in metadata.requires("sgl-deep-ep-v25") or [] if r.startswith("torch")]
        want = re.search(r"torch==([0-9.]+)", pinned[0]) if pinned else None
        assert want and f"ARG TORCH_VERSION={want.group(1)}" in recipe, pinned
    assert "whl/cu130" in recipe


def test_an_epilogue_run_early_on_another_stream_is_joined_by_the_waiter(monkeypatch) -> None:
    """Audit-4 P2's early epilogue: another call on the buffer runs a pending deferred dispatch's
    epilogue on its own stream (B); the waiter (stream A) then waits for it through an event and
    records the rows as used on A. CUDA streams stand in as objects here (no GPU)."""
    from flexdispatch.backends.deepep.v25 import rows as v25_rows

    log: list[tuple[str, ...]] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, event: Any) -> None:
            log.append((self.name, "waits for", event.on))

    class Event:
        def record(self, stream: Stream) -> None:
            self.on = stream.name
            log.append(("event on", stream.name))

    class Rows(torch.Tensor):  # NOTE: a CPU tensor that says it lives on the GPU
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        def record_stream(self, stream: Any) -> None:  # type: ignore[override]
            log.append(("rows used on", stream.name))

    def rows() -> Rows:
        return torch.zeros(1).as_subclass(Rows)  # type: ignore[return-value]

    class Overlap:
        def current_stream_wait(self) -> tuple[Any, ...]:
            log.append(("epilogue on", now[0].name))
            return (rows(), (rows(), rows()), rows(), "handle")

    now = [Stream("B")]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "Event", Event)

    def pending() -> v25_rows.PendingExpanded:
        return v25_rows.PendingExpanded(Overlap(), None, 0)

    p = pending()
    assert p.settle(early=True) and not p.settle(early=True)  # runs once
    now[0] = Stream("A")
    p.join()
    assert log == [
        ("epilogue on", "B"),
        ("event on", "B"),
        ("A", "waits for", "B"),
        *[("rows used on", "A")] * 4,
    ], log
    log.clear()
    p = pending()  # run early, but on the waiter's own stream: nothing to join
    p.settle(early=True)
    p.join()
    assert log == [("epilogue on", "A"), ("event on", "A")], log
    log.clear()
    p = pending()  # run by its own wait(): no event at all
    p.settle()
    p.join()
    assert log == [("epilogue on", "A")], log
