"""Issue 44, Q10 / X1 / EW7: DeepEP loads wherever its own import check passes — also after NCCL
mapped its plugins — and a refused import is told apart from a missing one.

Both sgl wheels run ``check_nccl_so()`` when imported: every ``/proc/self/maps`` line containing
``libnccl`` must name one path, byte-equal to ``find_nccl_root()/lib/libnccl.so*``. NCCL dlopens
its plugins (``libnccl-net.so`` by default; nccl v2.30.7-1 src/plugin/plugin_open.cc,
src/plugin/net.cc:256) when its first communicator is created (src/init.cc:475-477), and the
adapter imported DeepEP only in backend selection, after the dispatcher's first collective: on
any cluster with an NCCL net plugin (HPC-X SHARP, aws-ofi-nccl, GCP's) DeepEP "did not import".

One real process (``tests/deepep_emu/shim.py``: stand-in libraries mapped with ``ctypes``, so the
maps are the real ones; a ``deep_ep_v25`` that runs the wheel's own ``check_nccl_so``) goes
through the cases in the order a process can (mappings only grow; the package is forgotten between
cases): no NCCL mapped at all (DeepEP's check raises TypeError: X1), NCCL's runtime alone, the
runtime and a net plugin (the Q10 case), a second NCCL runtime, a missing package, and the real
wheel on this CPU torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.deepep_emu.shim import stand_in_libraries, write_nccl_site

_SCRIPT = """
import ctypes, json, sys
from flexdispatch.backends.deepep.nccl import import_deepep

P = json.loads(sys.argv[1])
out = {}

def case(name, package="deep_ep_v25"):
    module, why = import_deepep(package)
    out[name] = {"ok": module is not None, "why": why,
                 "emulated": getattr(module, "IS_EMULATOR", False)}
    for n in [n for n in sys.modules if n.split(".")[0] == package]:
        del sys.modules[n]

case("nothing_mapped")                 # X1: DeepEP's own check raises TypeError here
ctypes.CDLL(P["main"])                 # torch's NCCL (a CUDA torch maps it at import torch)
case("runtime_only")
ctypes.CDLL(P["plugin"])               # the first communicator: NCCL maps libnccl-net.so
case("after_plugin")
case("real_wheel", "deep_ep")          # the installed sgl-deep-ep on this CPU torch

class _Hide:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "deep_ep_v25":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _Hide)
case("missing")
sys.meta_path.remove(_Hide)
ctypes.CDLL(P["other"])                # a second, different NCCL runtime
case("second_runtime")
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(stand_in_libraries() is None, reason="no libz / libm to map")
@pytest.mark.timeout(300)
def test_deepep_imports_where_its_own_check_passes(tmp_path: Path) -> None:
    paths = write_nccl_site(tmp_path)
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["EP_NCCL_ROOT_DIR"] = paths["root"]
    env["PYTHONPATH"] = os.pathsep.join([paths["site"], repo])
    env.pop("EP_SUPPRESS_NCCL_CHECK", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), json.dumps(paths)],
        env=env,
        cwd=repo,
        text=True,
        capture_output=True,
        timeout=240,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout + done.stderr
    got = json.loads(line[len("RESULT ") :])
    refused = "is installed but refused to import"
    # X1: no NCCL mapped: DeepEP's check fails with a TypeError, a refusal, not a crash
    assert not got["nothing_mapped"]["ok"] and refused in got["nothing_mapped"]["why"], got
    assert "TypeError" in got["nothing_mapped"]["why"], got
    # the runtime alone: DeepEP's own check passes, nothing suppressed
    assert got["runtime_only"]["ok"] and got["runtime_only"]["emulated"], got
    assert "EP_SUPPRESS_NCCL_CHECK" not in got["runtime_only"]["why"], got
    # Q10: a net plugin beside that runtime: still imports, and says how
    after = got["after_plugin"]
    assert after["ok"] and after["emulated"], got
    assert "libnccl-net.so" in after["why"] and "EP_SUPPRESS_NCCL_CHECK=1" in after["why"], got
    # a genuine second runtime: refused, as DeepEP refuses it, naming the file and the fix
    second = got["second_runtime"]
    assert not second["ok"] and refused in second["why"] and paths["other"] in second["why"], got
    assert "Duplicate NCCL runtime" in second["why"] and "load one NCCL runtime" in second["why"]
    # a missing package is "not installed", never "refused"
    missing = got["missing"]["why"]
    assert not got["missing"]["ok"] and "not installed" in missing and "refused" not in missing
    # the real wheel's host check on this CPU torch: refused, naming DeepEP's reason
    real = got["real_wheel"]["why"]
    assert not got["real_wheel"]["ok"] and refused in real and "does not provide CUDA" in real
    assert "EP_SUPPRESS_NCCL_CHECK" not in os.environ  # the switch never leaks out of an import
