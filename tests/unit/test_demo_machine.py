"""The demo's runtime allowance is measured on this machine, and the estimate built on it bounds
what a process of the demo holds before its tensors (``flexdispatch.cli.demo_machine``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flexdispatch.cli import demo_fit, demo_machine
from flexdispatch.config import load_config

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def _fresh_rank_like_rss() -> int:
    """VmHWM of a fresh process that imports torch and flexdispatch's layer and runs one tiny
    layer step: a floor of what any demo rank holds, measured independently of the probe."""
    code = (
        "import torch\n"
        "from flexdispatch.config import load_config\n"
        "from flexdispatch.moe import MoELayer\n"
        "cfg = load_config('tiny_cpu')\n"
        "MoELayer(cfg)(torch.randn(4, cfg.hidden_size)).output.sum().backward()\n"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1]) * 1024


@pytest.mark.skipif(sys.platform != "linux", reason="the probe reads /proc (Linux)")
def test_probe_measures_and_the_estimate_bounds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(demo_machine.RUNTIME_ENV, raising=False)
    demo_machine._measure.cache_clear()
    heard: list[str] = []
    allowance, measured, source = demo_machine.measure_runtime("cpu", progress=heard.append)
    assert measured is not None and "probe process (cpu)" in source, source
    assert len(heard) == 2 and source in heard[1]
    floor = _fresh_rank_like_rss()
    # the probe holds at least what a bare layer step holds (it also joins a process group)
    assert measured >= 0.9 * floor, (measured, floor)
    assert allowance == demo_machine.runtime_allowance(measured) >= measured
    est = demo_fit.estimate_memory(
        load_config("tiny_cpu"), 2, 8, worst_case=False, runtime=allowance
    )
    assert est.per_rank >= measured and est.parent >= measured
    assert est.as_dict()["runtime_per_process"] == allowance
    assert demo_machine.measure_runtime("cpu")[1] == measured  # cached: probed once


def test_an_override_is_not_kept_once_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """$FLEXDISPATCH_RUNTIME_BYTES decides only while it is set: the cache does not keep it for
    the calls after it is unset (a test that set it decided later demos' runtime)."""
    demo_machine._measure.cache_clear()
    monkeypatch.setenv(demo_machine.RUNTIME_ENV, "400MiB")
    assert demo_machine.measure_runtime("cpu")[2] == "$FLEXDISPATCH_RUNTIME_BYTES"
    monkeypatch.delenv(demo_machine.RUNTIME_ENV)
    monkeypatch.setattr(demo_machine.sys, "executable", "/nonexistent/python")  # no real probe
    assert demo_machine.measure_runtime("cpu")[2].startswith("fixed allowance (the probe failed")
    demo_machine._measure.cache_clear()


def test_override_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    demo_machine._measure.cache_clear()
    monkeypatch.setenv(demo_machine.RUNTIME_ENV, "1GiB")
    assert demo_machine.measure_runtime("cpu") == (1 << 30, None, "$FLEXDISPATCH_RUNTIME_BYTES")
    demo_machine._measure.cache_clear()
    monkeypatch.delenv(demo_machine.RUNTIME_ENV)
    monkeypatch.setattr(demo_machine.sys, "executable", "/nonexistent/python")
    allowance, measured, source = demo_machine.measure_runtime("cpu")
    demo_machine._measure.cache_clear()
    assert (allowance, measured) == (demo_machine.FALLBACK_BYTES, None)
    assert source.startswith("fixed allowance (the probe failed")
    # the fallback is above what a CUDA build of torch holds (~690 MB measured on an H200 box)
    assert demo_machine.FALLBACK_BYTES > 690 * 10**6
