"""An importable ``deep_ep_v25`` that imports as the wheel does: DeepEP's own NCCL check over the
real ``/proc/self/maps``, then the emulated package. TEST-ONLY.

The ``sgl-deep-ep`` and ``sgl-deep-ep-v25`` wheels run ``check_nccl_so()`` when they are imported
(``deep_ep_v25/__init__.py``, called before anything else of the package): every line of
``/proc/self/maps`` containing ``libnccl`` must name one path, and that file must be byte-equal
to ``find_nccl_root()/lib/libnccl.so*`` (``EP_NCCL_ROOT_DIR`` first). NCCL maps its plugins
(``libnccl-net.so`` and the others) when its first communicator is created, after which that
check refuses ("Duplicate NCCL runtime found"). ``load.load_deep_ep`` never runs that check: it
assembles the package without its ``__init__``.

``write_nccl_site(tmp)`` lays out what a GPU host has, with stand-in libraries (copies of the
system's ``libz`` / ``libm``: real shared objects, so ``ctypes.CDLL`` maps them and
``/proc/self/maps`` is the real one):

- ``nccl/lib/libnccl.so.2`` (+ ``include/nccl.h``): the NCCL runtime DeepEP links
  (``EP_NCCL_ROOT_DIR``);
- ``hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so``: an NCCL net plugin (HPC-X's SHARP ships one);
- ``other/lib/libnccl.so.2``: a second, different NCCL runtime;
- ``site/deep_ep_v25/__init__.py``: the shim — ``check_nccl_so``'s source taken unchanged from the
  installed wheel's ``__init__.py`` (by ``ast``), run as the wheel runs it (it reads
  ``EP_SUPPRESS_NCCL_CHECK`` itself), then the names of ``load_v25.load_v25(8)``.

A process with ``site`` first on ``sys.path`` imports ``deep_ep_v25`` as on a GPU host as far as
NCCL goes: the adapter's own import path (``backends.deepep.nccl.import_deepep``) runs unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["SHIM", "stand_in_libraries", "write_nccl_site"]

_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")

SHIM = '''"""TEST SHIM (tests/deepep_emu/shim.py): DeepEP 2.5's import check, then the emulator."""
import ast, filecmp, glob, os
import importlib.metadata as _md
from pathlib import Path

_init = Path(str(_md.distribution("sgl-deep-ep-v25").locate_file("deep_ep_v25"))) / "__init__.py"
_tree = ast.parse(_init.read_text())
_fn = next(n for n in _tree.body if isinstance(n, ast.FunctionDef) and n.name == "check_nccl_so")
_ns = {"os": os, "glob": glob, "filecmp": filecmp,
       "find_nccl_root": lambda *a, **k: os.environ["EP_NCCL_ROOT_DIR"]}
exec(compile(ast.Module([_fn], []), str(_init), "exec"), _ns)
_ns["check_nccl_so"]()  # as deep_ep_v25/__init__.py runs it, before anything else

from tests.deepep_emu.load_v25 import load_v25 as _load

globals().update({k: v for k, v in vars(_load(8)).items() if not k.startswith("__")})
'''


def stand_in_libraries() -> tuple[str, str] | None:
    """Two different real shared objects of this system (``libz``, ``libm``), or None."""
    found = []
    for names in (("libz.so.1",), ("libm.so.6",)):
        for folder in _LIB_DIRS:
            path = Path(folder) / names[0]
            if path.exists():
                found.append(str(path))
                break
    return (found[0], found[1]) if len(found) == 2 else None


def write_nccl_site(tmp: Path) -> dict[str, str]:
    """The layout of the module docstring under ``tmp``: its paths (``root``, ``main``,
    ``plugin``, ``other``, ``site``)."""
    libs = stand_in_libraries()
    if libs is None:
        raise FileNotFoundError("no libz / libm to stand in for NCCL's libraries")
    main_lib, other_lib = libs
    root = tmp / "nccl"
    (root / "lib").mkdir(parents=True)
    (root / "include").mkdir()
    shutil.copy(main_lib, root / "lib" / "libnccl.so.2")
    (root / "include" / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 32\n#define NCCL_PATCH 6\n"
    )
    plugins = tmp / "hpcx" / "nccl_rdma_sharp_plugin" / "lib"
    plugins.mkdir(parents=True)
    shutil.copy(main_lib, plugins / "libnccl-net.so")
    other = tmp / "other" / "lib"
    other.mkdir(parents=True)
    shutil.copy(other_lib, other / "libnccl.so.2")
    site = tmp / "site" / "deep_ep_v25"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(SHIM)
    return {
        "root": str(root),
        "main": str(root / "lib" / "libnccl.so.2"),
        "plugin": str(plugins / "libnccl-net.so"),
        "other": str(other / "libnccl.so.2"),
        "site": str(tmp / "site"),
    }
