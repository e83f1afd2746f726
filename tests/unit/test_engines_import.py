"""Importing the serving-engine plug-ins (``flexdispatch.integrations.vllm`` / ``.sglang``)
imports neither engine; with their switch off, ``register()`` (what the engines' entry points
call) and ``uninstall()`` import nothing either, and a bad config in the environment is refused
before the engine is touched (checked in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import os, sys
import flexdispatch.integrations.vllm as fv
import flexdispatch.integrations.sglang as fs
for m in (fv, fs):
    m.register()  # switched off: nothing to do
    m.uninstall()
    assert m.installed_config() is None
    try:
        m.install("not a config")
    except TypeError:
        pass
    else:
        raise AssertionError("install() took a string")
os.environ["FLEXDISPATCH_VLLM"] = "1"
os.environ["FLEXDISPATCH_VLLM_CONFIG"] = '{"backend": "nccl"}'
os.environ["FLEXDISPATCH_SGLANG"] = "1"
os.environ["FLEXDISPATCH_SGLANG_CONFIG"] = '{"num_worst_tokens": -3}'
for m, var in ((fv, "FLEXDISPATCH_VLLM_CONFIG"), (fs, "FLEXDISPATCH_SGLANG_CONFIG")):
    try:
        m.register()
    except ValueError as exc:
        print("REFUSED", var in str(exc))
os.environ["FLEXDISPATCH_SGLANG_CONFIG"] = "{}"
os.environ["FLEXDISPATCH_SGLANG_NORMAL_FORMAT"] = "expanded"
try:
    fs.register()
except ValueError as exc:
    print("REFUSED", "FLEXDISPATCH_SGLANG_NORMAL_FORMAT" in str(exc))
print("LOADED", sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "sglang"}))
"""


def test_engine_plugins_import_no_engine() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXDISPATCH_")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("REFUSED True") == 3, out.stdout
    assert "LOADED []" in out.stdout, out.stdout
