"""What ``flexdispatch doctor`` reads from this machine: CUDA, NCCL, ``deep_ep``, NVSHMEM and
the launcher's environment. Each probe answers a JSON-ready dict and never raises; the package
decides from them."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["probe_cuda", "probe_nccl", "probe_deep_ep", "probe_nvshmem", "probe_launcher"]


_LAUNCHER_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_COMM_PREFIXES = ("NCCL_", "NVSHMEM_", "GLOO_")


def probe_cuda(cuda: Any = None) -> dict[str, Any]:
    """CUDA availability, runtime version and every visible GPU.

    Args:
        cuda: the ``torch.cuda`` module, or a stand-in with the same functions (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    out: dict[str, Any] = {
        "available": False,
        "version": torch.version.cuda,
        "device_count": 0,
        "gpus": [],
        "reason": "",
    }
    try:
        available = bool(cuda.is_available())
    except Exception as exc:  # a broken driver must not break the doctor
        out["reason"] = f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"
        return out
    if not available:
        out["reason"] = (
            "torch was built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
        )
        return out
    out["available"] = True
    try:
        count = int(cuda.device_count())
        for i in range(count):
            props = cuda.get_device_properties(i)
            out["gpus"].append(
                {
                    "index": i,
                    "name": str(props.name),
                    "total_memory_bytes": int(props.total_memory),
                    "compute_capability": f"{props.major}.{props.minor}",
                    "multi_processor_count": int(props.multi_processor_count),
                }
            )
        out["device_count"] = count
        out["reason"] = f"{count} device(s)"
    except Exception as exc:
        out["reason"] = f"listing devices failed: {type(exc).__name__}: {exc}"
    return out


def probe_nccl(cuda: Any = None, *, built: bool | None = None) -> dict[str, Any]:
    """Whether torch has NCCL and which version (``torch.cuda.nccl.version()``, guarded).

    Args:
        cuda: the ``torch.cuda`` module, or a stand-in (tests).
        built: whether torch has NCCL (default ``dist.is_nccl_available()``).
    """
    cuda = torch.cuda if cuda is None else cuda
    built = dist.is_nccl_available() if built is None else built
    out: dict[str, Any] = {"available": bool(built), "version": None}
    if not out["available"]:
        out["reason"] = "torch was built without NCCL"
        return out
    try:
        if not cuda.is_available():
            out["reason"] = "built with NCCL; no CUDA device to ask for its version"
            return out
        version = cuda.nccl.version()
    except Exception as exc:
        out["reason"] = f"torch.cuda.nccl.version() raised {type(exc).__name__}: {exc}"
        return out
    if isinstance(version, tuple):
        out["version"] = ".".join(str(v) for v in version)
    else:  # older torch: one int, major*1000 + minor*100 + patch (or *10000 from 2.9 on)
        v = int(version)
        major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
        out["version"] = f"{major}.{rest // 100}.{rest % 100}"
    out["reason"] = "NCCL available"
    return out


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def probe_deep_ep() -> dict[str, Any]:
    """Whether ``deep_ep`` imports (through the backends' guarded import) and is usable."""
    from flexdispatch.dispatch.select import deepep_available

    try:
        usable, reason = deepep_available()
    except Exception as exc:  # e.g. RuntimeError from a CUDA check at import time
        usable, reason = (
            False,
            f"deep_ep is installed but refused to import ({type(exc).__name__}: {exc})",
        )
    module = sys.modules.get("deep_ep")
    out: dict[str, Any] = {
        "importable": module is not None,
        "usable": bool(usable),
        "reason": reason,
        "version": None,
        "path": None,
        "emulator": False,
        "elastic": False,
    }
    if module is not None:
        out["elastic"] = getattr(module, "ElasticBuffer", None) is not None
        out["version"] = getattr(module, "__version__", None) or _dist_version("deep_ep", "deep-ep")
        out["path"] = getattr(module, "__file__", None)
        out["emulator"] = getattr(module, "IS_EMULATOR", False) is True
    return out


def probe_nvshmem() -> dict[str, Any]:
    """NVSHMEM through nvshmem4py (``nvshmem.core``); imported, never initialised."""
    py: dict[str, Any] = {"importable": False, "version": None, "error": None}
    try:
        found = importlib.util.find_spec("nvshmem") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        status = "not installed"
        py["error"] = "No module named 'nvshmem' (pip install nvshmem4py-cu12)"
    else:
        try:
            core = importlib.import_module("nvshmem.core")
        except Exception as exc:  # ImportError, OSError (missing libnvshmem), RuntimeError
            py["error"] = f"{type(exc).__name__}: {exc}"
            status = f"import failed: {py['error']}"
        else:
            py["importable"] = True
            parent = sys.modules.get("nvshmem")
            py["version"] = (
                _dist_version("nvshmem4py-cu12", "nvshmem4py-cu13", "nvshmem4py")
                or getattr(parent, "__version__", None)
                or getattr(core, "__version__", None)
            )
            status = "importable, not initialised"
    library = None
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
        if spec is not None and spec.submodule_search_locations:
            library = next(iter(spec.submodule_search_locations))
    except (ImportError, ValueError):
        library = None
    return {
        "nvshmem4py": py,
        "initialised": False,
        "status": status,
        "library_path": library,
        "nvshmem_dir": os.environ.get("NVSHMEM_DIR"),
    }


def probe_launcher() -> dict[str, Any]:
    """The launcher's environment (torchrun, Slurm wrappers) and communication variables."""
    from flexdispatch.launch import under_launcher

    return {
        "under_launcher": under_launcher(),
        "env": {k: os.environ[k] for k in _LAUNCHER_KEYS if k in os.environ},
        "comm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_COMM_PREFIXES)},
    }
