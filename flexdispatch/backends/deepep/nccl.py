"""The NCCL under DeepEP: the runtime this process maps, each generation's rule on it, the NCCL
files mapped beside it, and importing DeepEP where its own import check would pass.

**Each generation's NCCL rule** (part of its support check; a generation whose rule fails here is
never selected, suggested or fallen back to):

- V1 (``deep_ep.Buffer``): NVSHMEM and CUDA IPC, no NCCL device API: no rule.
- V2 (``deep_ep.ElasticBuffer``, ``sgl-deep-ep`` 0.1.2.post1 = DeepEP 2.1.0): its ``_C`` was
  compiled against NCCL 2.30.7 and, below NCCL 2.31, asserts that the runtime is that very
  version when it builds its buffer (DeepEP main ``csrc/kernels/backend/nccl.cu:100-104``; the
  wheel's ``_C`` compares ``ncclGetVersion`` with 23007): the runtime must be **2.30.7**
  (``V2_BUILDS``; an unknown build is not checked, DeepEP decides).
- V2.5 (``deep_ep_v25.EPBuffer``, ``sgl-deep-ep-v25``): compiled against NCCL 2.32.3, its import
  refuses an older NCCL (``prerequisites.py``) and NCCL refuses a caller compiled newer than the
  runtime (nccl ``src/dev_runtime.cc:1423-1433``): the runtime must be **>= 2.32.3**.

So V2 and V2.5 never both run in one process: the V2.5 image (NCCL 2.32.6) runs V2.5 and V1.

The runtime is read without a communicator: ``ncclGetVersion`` of the one ``libnccl.so*`` mapped
here (a pure function, nccl ``src/init.cc:175-180``), else ``torch.cuda.nccl.version()`` (torch's
linked NCCL); the test emulator's packages answer for their emulated NCCL (``emu_nccl``).

**Importing DeepEP** (``import_deepep``): both wheels run ``check_nccl_so()`` when imported
(``deep_ep/__init__.py``, ``deep_ep_v25/__init__.py``): every line of ``/proc/self/maps`` containing
``libnccl`` must name one path, byte-equal to ``find_nccl_root()/lib/libnccl.so*``. NCCL dlopens
its plugins (``libnccl-net.so`` by default, ``-gin``, ``-rma``, ``-tuner``, ``-profiler``,
``-env``: nccl ``src/plugin/plugin_open.cc``) when the first communicator is created, after which
that check refuses ("Duplicate NCCL runtime found") although nothing is wrong: the plugins are not
runtimes. So where the maps hold exactly one NCCL runtime, byte-equal to the one DeepEP links,
and otherwise only NCCL plugins (``classify_maps``), the import runs with
``EP_SUPPRESS_NCCL_CHECK=1`` set for the import alone (DeepEP's own switch, read only there) —
exactly what DeepEP's check would have accepted before the plugins were loaded. Two runtimes, or
any other ``libnccl*`` file, are left to DeepEP's check, which refuses them. Every failure becomes
a reason that tells a missing package ("not installed") from a refused one ("installed but
refused to import", with DeepEP's own text); nothing raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import filecmp
import glob
import importlib
import importlib.metadata
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

from flexdispatch.backends.base import Capability

__all__ = [
    "PLUGIN_KINDS",
    "V25_MIN",
    "V2_BUILDS",
    "classify_maps",
    "deepep_nccl_root",
    "import_deepep",
    "nccl_rule",
    "read_maps",
    "rule_text",
    "runtime_version",
    "v2_build",
    "version_text",
]

V25_MIN = (2, 32, 3)
V2_BUILDS = {"0.1.2.post1": (2, 30, 7)}
"""``sgl-deep-ep`` release -> the NCCL its V2 ``_C`` was compiled with (below 2.31: required
exactly at run time)."""
_EMULATED_V2 = {"2.1.0": (2, 30, 7)}  # the test emulator's DeepEP V2 stands for that wheel
PLUGIN_KINDS = {
    "net": "NCCL_NET_PLUGIN",
    "gin": "NCCL_GIN_PLUGIN",
    "rma": "NCCL_RMA_PLUGIN",
    "tuner": "NCCL_TUNER_PLUGIN",
    "profiler": "NCCL_PROFILER_PLUGIN",
    "env": "NCCL_ENV_PLUGIN",
}
"""NCCL's plugin kinds (default file ``libnccl-<kind>.so``) and the variable naming another."""
_IMPORT_LOCK = threading.Lock()


def version_text(version: tuple[int, ...] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def read_maps() -> str | None:
    """This process's ``/proc/self/maps`` (None where it cannot be read)."""
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return None


def classify_maps(text: str | None) -> dict[str, list[str]]:
    """The mapped files DeepEP's import check looks at (every maps line containing ``libnccl``,
    its last field), sorted into ``runtime`` (``libnccl.so*``), ``plugin`` (an NCCL plugin:
    ``libnccl-<kind>*``) and ``other``."""
    out: dict[str, list[str]] = {"runtime": [], "plugin": [], "other": []}
    for line in (text or "").splitlines():
        if "libnccl" not in line:
            continue
        path = line.strip().split(" ")[-1]
        base = os.path.basename(path)
        if base.startswith("libnccl.so"):
            kind = "runtime"
        elif any(base.startswith(f"libnccl-{k}") for k in PLUGIN_KINDS):
            kind = "plugin"
        else:
            kind = "other"
        if path not in out[kind]:
            out[kind].append(path)
    return out


def _emulated(module: Any) -> bool:
    return getattr(module, "IS_EMULATOR", False) is True


def runtime_version(module: Any = None) -> tuple[tuple[int, int, int] | None, str]:
    """The NCCL runtime of this process, ``((major, minor, patch) or None, where from)``; for the
    test emulator's ``module`` its emulated NCCL. Never raises."""
    lib = getattr(module, "emu_nccl", None) if module is not None else None
    if _emulated(module) and lib is not None:
        return tuple(lib.version()), "the emulated NCCL"  # type: ignore[return-value]
    runtimes = classify_maps(read_maps())["runtime"]
    if len(runtimes) == 1:
        try:
            got = ctypes.c_int(0)
            if ctypes.CDLL(runtimes[0]).ncclGetVersion(ctypes.byref(got)) == 0 and got.value:
                v = got.value
                return (v // 10000, v // 100 % 100, v % 100), f"ncclGetVersion({runtimes[0]})"
        except Exception:  # NOTE: a broken library must not break selection
            pass
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            if isinstance(v, tuple) and len(v) >= 3:
                return (int(v[0]), int(v[1]), int(v[2])), "torch.cuda.nccl.version()"
        except Exception:  # NOTE: a torch without NCCL
            pass
    return None, "no NCCL runtime mapped and no CUDA"


def v2_build(module: Any = None) -> tuple[tuple[int, int, int] | None, str]:
    """The NCCL the installed DeepEP V2 was compiled with, and which build that is."""
    if _emulated(module):
        release = str(getattr(module, "EMULATED_RELEASE", ""))
        return _EMULATED_V2.get(release), f"the emulated DeepEP {release}"
    try:
        dist = importlib.metadata.version("sgl-deep-ep")
    except importlib.metadata.PackageNotFoundError:
        return None, "deep_ep not from the sgl-deep-ep wheel"
    return V2_BUILDS.get(dist), f"sgl-deep-ep {dist}"


def rule_text(generation: str, built: tuple[int, int, int] | None = None) -> str:
    """The NCCL rule of ``generation`` as the doctor shows it."""
    if generation == "v1":
        return "none (NVSHMEM)"
    if generation == "v2":
        return f"== {version_text(built)}" if built else "unknown build"
    return f">= {version_text(V25_MIN)}"


def nccl_rule(
    generation: str,
    runtime: tuple[int, int, int] | None,
    *,
    built: tuple[int, int, int] | None = None,
    build: str = "",
) -> tuple[bool | None, str]:
    """Whether ``generation`` (``"v1"``, ``"v2"``, ``"v25"``) can run on NCCL ``runtime``:
    ``(True / False, why)``, or ``(None, why)`` where it cannot be known (no runtime read, an
    unknown V2 build: DeepEP's own check then decides)."""
    if generation == "v1":
        return True, "DeepEP V1 needs no NCCL device API (NVSHMEM)"
    have = version_text(runtime)
    if generation == "v2":
        if built is None:
            return None, f"NCCL rule of DeepEP V2 not checked ({build or 'unknown build'})"
        if runtime is None:
            return None, "NCCL rule of DeepEP V2 not checked (NCCL runtime unknown)"
        need = version_text(built)
        if runtime != built:
            return False, (
                f"DeepEP V2 ({build}) needs NCCL {need} at run time (its _C was compiled "
                f"against {need} and, below NCCL 2.31, asserts the runtime is that version when "
                f"it builds its buffer), but this process runs NCCL {have}: run V2 in an image "
                f"with nvidia-nccl-cu13=={need} (the sgl-deep-ep image)"
            )
        return True, f"NCCL {have} (DeepEP V2 was compiled against it)"
    if runtime is None:
        return None, "NCCL rule of DeepEP 2.5 not checked (NCCL runtime unknown)"
    if runtime < V25_MIN:
        need = version_text(V25_MIN)
        return False, (
            f"DeepEP 2.5 needs NCCL >= {need} at run time (compiled against {need}; NCCL "
            f"refuses a caller newer than the runtime), but this process runs NCCL {have}: "
            f'install "nvidia-nccl-cu13>={need}" with --no-deps (the V2.5 image)'
        )
    return True, f"NCCL {have} (DeepEP 2.5 needs >= {version_text(V25_MIN)})"


def generation_rule(generation: str, module: Any = None) -> Capability:
    """``nccl_rule`` of ``generation`` on this process's runtime: unknown counts as yes."""
    runtime, _ = runtime_version(module)
    built, build = v2_build(module) if generation == "v2" else (None, "")
    ok, why = nccl_rule(generation, runtime, built=built, build=build)
    return ok is not False, why


# ------------------------------------------------------------------------------ importing DeepEP
def _find_pkg_root(name: str, lib_name: str, env: Mapping[str, str]) -> str | None:
    """DeepEP's ``utils/find_pkgs.find_pkg_root``: ``EP_<NAME>_ROOT_DIR``, ``<NAME>_DIR``, else
    the ``nvidia-<name>`` distribution holding ``lib_name`` that comes first on ``sys.path``."""
    upper = name.upper()
    for key in (f"EP_{upper}_ROOT_DIR", f"{upper}_DIR"):
        if key in env:
            return env[key]
    priority = {p: i for i, p in enumerate(sys.path)}
    best, best_priority = None, len(sys.path)
    for dist in importlib.metadata.distributions():
        dist_name = (dist.metadata["Name"] or "").lower()
        if f"nvidia-{name}" not in dist_name and f"nvidia_{name}" not in dist_name:
            continue
        site = str(dist.locate_file(""))
        rank = priority.get(site.rstrip("/"), priority.get(site, len(sys.path)))
        if rank > best_priority:
            continue
        for f in dist.files or []:
            if lib_name in str(f):
                lib_dir = os.path.dirname(str(f.locate()))
                root = os.path.dirname(lib_dir) if os.path.basename(lib_dir) == "lib" else lib_dir
                best, best_priority = root, rank
                break
    return best


def deepep_nccl_root(env: Mapping[str, str] | None = None) -> str | None:
    """The NCCL root DeepEP links and compiles against (``find_nccl_root``), or None."""
    try:
        return _find_pkg_root("nccl", "libnccl.so", os.environ if env is None else env)
    except Exception:  # NOTE: broken metadata must not break selection
        return None


def _plugin_tolerant(maps: dict[str, list[str]]) -> str | None:
    """Why DeepEP's import check would refuse only because of NCCL plugins (then the import may
    skip it), or None: no plugin mapped, or anything else is wrong (DeepEP decides)."""
    runtimes, plugins = maps["runtime"], maps["plugin"]
    if not plugins or maps["other"] or len(runtimes) != 1:
        return None
    root = deepep_nccl_root()
    linked = sorted(glob.glob(f"{root}/lib/libnccl.so*")) if root else []
    try:
        same = bool(linked) and filecmp.cmp(runtimes[0], linked[0], shallow=False)
    except OSError:
        same = False
    if not same:
        return None
    return (
        f"NCCL plugins mapped beside the one NCCL runtime {runtimes[0]} (the one DeepEP links): "
        f"{', '.join(plugins)}; imported with DeepEP's EP_SUPPRESS_NCCL_CHECK=1"
    )


@contextlib.contextmanager
def _suppressed_check() -> Iterator[None]:
    saved = os.environ.get("EP_SUPPRESS_NCCL_CHECK")
    os.environ["EP_SUPPRESS_NCCL_CHECK"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("EP_SUPPRESS_NCCL_CHECK", None)
        else:
            os.environ["EP_SUPPRESS_NCCL_CHECK"] = saved


def _refusal_hint(text: str) -> str:
    if "Duplicate NCCL runtime" in text:
        return (
            ": two different NCCL files are mapped in this process; load one NCCL runtime "
            "(LD_LIBRARY_PATH, or one nvidia-nccl wheel)"
        )
    if "Invalid NCCL versions" in text:
        return (
            ": the NCCL torch loaded is not the one DeepEP links (point EP_NCCL_ROOT_DIR at the "
            "loaded one, or install that NCCL with --no-deps)"
        )
    return ""


def import_deepep(name: str) -> tuple[ModuleType | None, str]:
    """Import DeepEP's package ``name`` (``"deep_ep"`` or ``"deep_ep_v25"``) where its own import
    check would pass (module docstring); never raises.

    Returns:
        ``(module, how)``, or ``(None, reason)``: "``name`` is not installed ..." or "``name`` is
        installed but refused to import (<its error>)" with a hint for DeepEP's NCCL texts.
    """
    if name in sys.modules and sys.modules[name] is not None:
        return sys.modules[name], f"{name} imports"
    with _IMPORT_LOCK:
        tolerant = _plugin_tolerant(classify_maps(read_maps()))
        try:
            with _suppressed_check() if tolerant else contextlib.nullcontext():
                module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                return None, f"{name} is not installed (ModuleNotFoundError: {exc})"
            text = f"{type(exc).__name__}: {exc}"
            return None, f"{name} is installed but refused to import ({text})"
        except Exception as exc:  # NOTE: DeepEP's checks raise ImportError, AssertionError,
            # RuntimeError, OSError, and TypeError / ValueError on odd maps or env (X1)
            text = f"{type(exc).__name__}: {exc}"
            return None, f"{name} is installed but refused to import ({text}){_refusal_hint(text)}"
    how = f"{name} imports" + (f" ({tolerant})" if tolerant else "")
    return module, how
