"""``import flexdispatch`` never imports Megatron-Core or torchtitan, and neither does importing
the integration modules until something of theirs that subclasses the framework is used, and
none of them imports torch._dynamo or triton (checked in a fresh interpreter, where nothing else
has imported them)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
import flexdispatch as fd
fd.MoELayer, fd.FlexDispatcher, fd.routing_map_to_topk  # the layer, the dispatcher, the helper
import flexdispatch.integrations
import flexdispatch.integrations.megatron as fm
import flexdispatch.integrations.torchtitan as ft
fm.uninstall()  # a no-op when not installed: must not import Megatron either
assert fm.installed_config() is None
try:
    fm.install("not a config")
except TypeError:
    pass
frameworks = ("megatron", "torchtitan", "spmd_types")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in frameworks)
print("LOADED", loaded)
# NOTE: nor torch.compile's machinery: torch._dynamo imports triton, which must wait for a CPU
# user's TRITON_INTERPRET (and adds about 2 s)
print("COMPILER", sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_flexdispatch_and_its_integrations_import_no_framework() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout
    assert "COMPILER []" in out.stdout, out.stdout
