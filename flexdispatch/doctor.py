"""Probe this machine for what flexdispatch can use, and say which backend ``auto`` would pick.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R local
experts · k top-k · L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

Everything here runs in one process, without a process group, and never raises for a missing or
broken optional dependency: each probe turns a failure into text. ``would_select`` answers "what
would ``backend=auto`` choose for R ranks with L per node on machines like this one" from the
local facts (``HostFacts``) and the rule backend selection applies (``deepep_support_checks`` in
``flexdispatch.backends.deepep_support``, plus the row-size rule of ``deepep_sizing``), so it
needs no cluster.

``run_doctor`` returns one JSON-ready dict with these stable keys (schema
``flexdispatch.doctor/1``; ``flexdispatch doctor --json`` prints it):

- ``schema``, ``flexdispatch_version``, ``ok`` (the requested backend can work), ``date`` (UTC,
  ISO 8601).
- ``platform``: ``python``, ``executable``, ``system``, ``machine``, ``hostname``, ``cpu_count``.
- ``torch``: ``version``, ``git_version``, ``cuda_build`` (CUDA version torch was built with, or
  null), ``hip_build``.
- ``cuda``: ``available``, ``version`` (runtime torch uses, or null), ``device_count``,
  ``reason``; ``gpus``: list of ``{index, name, total_memory_bytes, compute_capability ("9.0"),
  multi_processor_count}``.
- ``nccl``: ``available`` (``dist.is_nccl_available()``), ``version`` ("2.21.5" or null),
  ``reason``. ``gloo``: ``available``.
- ``deep_ep``: ``importable``, ``usable`` (imports and flexdispatch has its backend), ``reason``
  (the exact import error when it fails), ``version``, ``path``, ``emulator`` (the test emulator).
- ``nvshmem``: ``nvshmem4py`` {``importable``, ``version``, ``error``}, ``initialised`` (always
  false: the doctor never initialises NVSHMEM), ``status`` (``"not installed"``,
  ``"import failed: ..."`` or ``"importable, not initialised"``), ``library_path`` (the
  ``nvidia-nvshmem`` wheel's folder or null), ``nvshmem_dir`` (``$NVSHMEM_DIR`` or null).
- ``launcher``: ``under_launcher``, ``env`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` when set), ``comm_env`` (every set
  ``NCCL_*`` / ``NVSHMEM_*`` / ``GLOO_*`` variable).
- ``selection``: ``requested`` (auto | torch | deepep), ``world_size`` (R), ``ranks_per_node``
  (L), ``nodes`` (N), ``world_size_source`` / ``ranks_per_node_source`` (``"argument"``, the
  environment variable, ``"gpus"`` or ``"default"``), ``hidden`` (H or null), ``backend`` (what
  would run, or null when the request cannot be honoured), ``ok``, ``reason``, ``checks``:
  {``deepep``: [...], ``torch``: [...]}, each a list of ``{name, ok, detail}``.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch.backends.base import Capability

__all__ = [
    "SCHEMA",
    "BACKEND_CHOICES",
    "Check",
    "HostFacts",
    "BackendChoice",
    "deepep_checks",
    "torch_checks",
    "would_select",
    "probe_cuda",
    "probe_nccl",
    "probe_deep_ep",
    "probe_nvshmem",
    "probe_launcher",
    "host_facts",
    "resolve_topology",
    "run_doctor",
    "format_report",
]

SCHEMA = "flexdispatch.doctor/1"
BACKEND_CHOICES = ("auto", "torch", "deepep")
_ROW_ELEMENT_SIZE = 2  # bf16 activations, the dtype DeepEP moves natively
_LAUNCHER_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_COMM_PREFIXES = ("NCCL_", "NVSHMEM_", "GLOO_")


@dataclass(frozen=True, kw_only=True)
class Check:
    """One yes/no fact behind a backend decision.

    Attributes:
        name: short identifier (``"import"``, ``"cuda"``, ``"nccl"``, ``"gpus"``, ``"topology"``,
            ``"row_bytes"``, ``"process_group"``).
        ok: whether it holds.
        detail: why (or why not), in words a user can act on.
    """

    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    """The local facts backend selection depends on (one node's view).

    Attributes:
        cuda_available: ``torch.cuda.is_available()``.
        nccl_available: ``dist.is_nccl_available()``.
        gloo_available: ``dist.is_gloo_available()``.
        num_gpus: visible CUDA devices (0 without CUDA).
        deepep: ``(ok, reason)`` of ``flexdispatch.backends.deepep_available()``.
    """

    cuda_available: bool
    nccl_available: bool
    gloo_available: bool
    num_gpus: int
    deepep: Capability


@dataclass(frozen=True, kw_only=True)
class BackendChoice:
    """What a backend request would turn into on a hypothetical topology.

    Attributes:
        requested: ``"auto"``, ``"torch"`` or ``"deepep"``.
        world_size: R.
        ranks_per_node: L.
        hidden: H, or None when the row-size check was skipped.
        backend: the backend that would run, or None when the request cannot be honoured.
        ok: ``backend is not None``.
        reason: why, in the style of ``FlexDispatcher.backend_reason``.
        deepep: every DeepEP check (all evaluated, not only up to the first failure).
        torch: every torch-backend check.
    """

    requested: str
    world_size: int
    ranks_per_node: int
    hidden: int | None
    backend: str | None
    ok: bool
    reason: str
    deepep: tuple[Check, ...]
    torch: tuple[Check, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "nodes": self.world_size // self.ranks_per_node,
            "hidden": self.hidden,
            "backend": self.backend,
            "ok": self.ok,
            "reason": self.reason,
            "checks": {
                "deepep": [c.as_dict() for c in self.deepep],
                "torch": [c.as_dict() for c in self.torch],
            },
        }


# --------------------------------------------------------------------------- the decision


def deepep_checks(
    world_size: int, ranks_per_node: int, facts: HostFacts, *, hidden: int | None = None
) -> tuple[Check, ...]:
    """Every condition the ``deepep`` backend needs, evaluated for R ranks with L per node.

    DeepEP's own rule comes from ``deepep_support_checks`` (what ``deepep_support_for`` and
    backend selection apply); the doctor adds what only a whole machine can answer: CUDA and NCCL
    separately (together they are the rule's ``nccl_on_cuda``), one GPU per local rank, and the
    row size.

    Args:
        world_size: R.
        ranks_per_node: L.
        facts: this node's facts (every node is assumed to look like it).
        hidden: H; when given, bf16 rows of H elements must be a multiple of 16 bytes.

    Returns:
        Checks named ``import``, ``cuda``, ``nccl``, ``gpus``, ``topology`` and, with ``hidden``,
        ``row_bytes``.
    """
    from flexdispatch.backends.deepep_sizing import check_row_bytes
    from flexdispatch.backends.deepep_support import deepep_support_checks

    R, L = world_size, ranks_per_node
    cuda = Check(
        name="cuda",
        ok=facts.cuda_available,
        detail="CUDA is available" if facts.cuda_available else "CUDA is not available",
    )
    nccl = Check(
        name="nccl",
        ok=facts.nccl_available,
        detail="torch has NCCL"
        if facts.nccl_available
        else "torch was built without NCCL (DeepEP needs an NCCL process group)",
    )
    failing = next((c for c in (cuda, nccl) if not c.ok), None)
    nccl_on_cuda = (True, "NCCL on CUDA") if failing is None else (False, failing.detail)
    rule = {
        name: Check(name=name, ok=ok, detail=why)
        for name, ok, why in deepep_support_checks(
            R, L, imported=facts.deepep, nccl_on_cuda=nccl_on_cuda
        )
    }
    gpus = Check(
        name="gpus",
        ok=facts.num_gpus >= L,
        detail=f"{facts.num_gpus} GPU(s) here for {L} rank(s) per node"
        + ("" if facts.num_gpus >= L else ": DeepEP needs one GPU per rank"),
    )
    checks = [rule["import"], cuda, nccl, gpus, rule["topology"]]
    if hidden is not None:
        ok, why = check_row_bytes(hidden, _ROW_ELEMENT_SIZE)
        checks.append(Check(name="row_bytes", ok=ok, detail=f"bf16 {why}"))
    return tuple(checks)


def torch_checks(world_size: int, ranks_per_node: int, facts: HostFacts) -> tuple[Check, ...]:
    """What the ``torch`` backend needs: a process-group backend (NCCL on CUDA, else gloo).

    Args:
        world_size: R.
        ranks_per_node: L.
        facts: this node's facts.
    """
    if facts.cuda_available and facts.nccl_available:
        pg = Check(name="process_group", ok=True, detail="NCCL on CUDA")
    elif facts.gloo_available:
        pg = Check(name="process_group", ok=True, detail="gloo on CPU")
    else:
        pg = Check(
            name="process_group",
            ok=False,
            detail="neither NCCL on CUDA nor gloo is available in this torch build",
        )
    topo = Check(
        name="topology",
        ok=True,
        detail=f"any world size: {world_size} ranks, {ranks_per_node} per node",
    )
    return pg, topo


def would_select(
    requested: str,
    *,
    world_size: int,
    ranks_per_node: int,
    facts: HostFacts,
    hidden: int | None = None,
) -> BackendChoice:
    """What ``DispatchConfig.backend = requested`` would run on R ranks with L per node.

    The rule of ``flexdispatch.backends.select_backend`` and ARCHITECTURE.md: ``auto`` picks
    ``deepep`` only when it imports, the group can be NCCL on CUDA and DeepEP supports the
    topology (and row size), else ``torch``; ``deepep`` that cannot be honoured is an error.

    Args:
        requested: ``"auto"``, ``"torch"`` or ``"deepep"``.
        world_size: R (>= 1).
        ranks_per_node: L (>= 1, divides R).
        facts: the local facts.
        hidden: H for the row-size check (None skips it).

    Raises:
        ValueError: an unknown ``requested``, or R / L that are not positive or L not dividing R.
    """
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {requested!r}")
    R, L = world_size, ranks_per_node
    if R < 1 or L < 1:
        raise ValueError(f"world size ({R}) and ranks per node ({L}) must be >= 1")
    if R % L:
        raise ValueError(
            f"world size {R} is not a multiple of ranks per node {L}: pass --ranks-per-node with "
            f"a divisor of {R}"
        )
    if hidden is not None and hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    dchecks = deepep_checks(R, L, facts, hidden=hidden)
    tchecks = torch_checks(R, L, facts)
    d_fail = next((c for c in dchecks if not c.ok), None)
    t_fail = next((c for c in tchecks if not c.ok), None)
    backend: str | None
    if requested == "deepep":
        backend = None if d_fail else "deepep"
        reason = (
            f"deepep backend not available: {d_fail.detail}"
            if d_fail
            else "backend='deepep' requested; every DeepEP check passes"
        )
    elif requested == "torch":
        backend = None if t_fail else "torch"
        reason = (
            f"torch backend not usable: {t_fail.detail}" if t_fail else "backend='torch' requested"
        )
    elif d_fail is None:
        backend, reason = "deepep", "auto: deep_ep usable on every rank"
    elif t_fail is None:
        backend, reason = "torch", f"auto: torch fallback ({d_fail.detail})"
    else:
        backend, reason = None, f"auto: nothing usable ({d_fail.detail}; {t_fail.detail})"
    return BackendChoice(
        requested=requested,
        world_size=R,
        ranks_per_node=L,
        hidden=hidden,
        backend=backend,
        ok=backend is not None,
        reason=reason,
        deepep=dchecks,
        torch=tchecks,
    )


# --------------------------------------------------------------------------- probes


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
    from flexdispatch.backends import deepep_available

    try:
        usable, reason = deepep_available()
    except Exception as exc:  # e.g. RuntimeError from a CUDA check at import time
        usable, reason = False, f"import deep_ep failed: {type(exc).__name__}: {exc}"
    module = sys.modules.get("deep_ep")
    out: dict[str, Any] = {
        "importable": module is not None,
        "usable": bool(usable),
        "reason": reason,
        "version": None,
        "path": None,
        "emulator": False,
    }
    if module is not None:
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


def host_facts(
    cuda_report: dict[str, Any], nccl_report: dict[str, Any], deepep: Capability
) -> HostFacts:
    """``HostFacts`` from the probes' answers."""
    return HostFacts(
        cuda_available=bool(cuda_report["available"]),
        nccl_available=bool(nccl_report["available"]),
        gloo_available=bool(dist.is_gloo_available()),
        num_gpus=int(cuda_report["device_count"]),
        deepep=deepep,
    )


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer: fix the environment") from None


def resolve_topology(
    world_size: int | None, ranks_per_node: int | None, num_gpus: int
) -> tuple[int, str, int, str]:
    """R and L for the doctor, and where each came from.

    R: the argument, else ``$WORLD_SIZE``, else the local GPU count, else 1. L: the argument, else
    ``$LOCAL_WORLD_SIZE`` (capped at R), else the local GPU count (capped at R), else R.

    Returns:
        ``(R, R source, L, L source)``.
    """
    if world_size is not None:
        R, r_src = world_size, "argument"
    elif (env := _env_int("WORLD_SIZE")) is not None:
        R, r_src = env, "WORLD_SIZE"
    elif num_gpus > 0:
        R, r_src = num_gpus, "gpus"
    else:
        R, r_src = 1, "default"
    if ranks_per_node is not None:
        L, l_src = ranks_per_node, "argument"
    elif (env := _env_int("LOCAL_WORLD_SIZE")) is not None:
        L, l_src = min(env, R), "LOCAL_WORLD_SIZE"
    elif num_gpus > 0:
        L, l_src = min(num_gpus, R), "gpus"
    else:
        L, l_src = R, "default"
    return R, r_src, L, l_src


def run_doctor(
    *,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    backend: str = "auto",
    hidden: int | None = None,
) -> dict[str, Any]:
    """Probe everything and decide the backend; the JSON-ready report (keys in the module doc).

    Raises:
        ValueError: bad ``backend``, R, L or H (see ``would_select``).
    """
    import flexdispatch

    cuda = probe_cuda()
    nccl = probe_nccl()
    deep = probe_deep_ep()
    facts = host_facts(cuda, nccl, (deep["usable"], deep["reason"]))
    R, r_src, L, l_src = resolve_topology(world_size, ranks_per_node, facts.num_gpus)
    choice = would_select(backend, world_size=R, ranks_per_node=L, facts=facts, hidden=hidden)
    selection = choice.as_dict()
    selection["world_size_source"] = r_src
    selection["ranks_per_node_source"] = l_src
    return {
        "schema": SCHEMA,
        "flexdispatch_version": flexdispatch.__version__,
        "ok": choice.ok,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": {
            "python": platform.python_version(),
            "executable": sys.executable,
            "system": platform.system(),
            "machine": platform.machine(),
            "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count(),
        },
        "torch": {
            "version": torch.__version__,
            "git_version": getattr(torch.version, "git_version", None),
            "cuda_build": torch.version.cuda,
            "hip_build": getattr(torch.version, "hip", None),
        },
        "cuda": {k: v for k, v in cuda.items() if k != "gpus"},
        "gpus": cuda["gpus"],
        "nccl": nccl,
        "gloo": {"available": facts.gloo_available},
        "deep_ep": deep,
        "nvshmem": probe_nvshmem(),
        "launcher": probe_launcher(),
        "selection": selection,
    }


# --------------------------------------------------------------------------- text output


def _mark(ok: bool) -> str:
    return "ok " if ok else "NO "


def format_report(report: dict[str, Any]) -> str:
    """The report as a short human-readable text (what ``flexdispatch doctor`` prints)."""
    p, t, c, n = report["platform"], report["torch"], report["cuda"], report["nccl"]
    lines = [
        f"flexdispatch {report['flexdispatch_version']} doctor — {p['hostname']}, "
        f"{p['cpu_count']} CPUs, Python {p['python']} ({p['system']} {p['machine']})",
        f"torch      {t['version']} (built with CUDA {t['cuda_build'] or 'none'})",
        f"cuda       {_mark(c['available'])}{c['reason']}"
        + (f", runtime {c['version']}" if c["available"] else ""),
    ]
    for g in report["gpus"]:
        lines.append(
            f"  gpu {g['index']}    {g['name']}, {g['total_memory_bytes'] / 2**30:.1f} GiB, "
            f"sm_{g['compute_capability'].replace('.', '')}, {g['multi_processor_count']} SMs"
        )
    lines.append(
        f"nccl       {_mark(n['available'])}"
        + (f"version {n['version']}" if n["version"] else n["reason"])
    )
    lines.append(
        f"gloo       {_mark(report['gloo']['available'])}"
        + ("available" if report["gloo"]["available"] else "not built")
    )
    d = report["deep_ep"]
    detail = d["reason"]
    if d["importable"]:
        detail += f" (version {d['version'] or '?'}, {d['path']})" + (
            " [test emulator]" if d["emulator"] else ""
        )
    lines.append(f"deep_ep    {_mark(d['usable'])}{detail}")
    nv = report["nvshmem"]
    lines.append(
        f"nvshmem    {_mark(nv['nvshmem4py']['importable'])}nvshmem4py {nv['status']}"
        + (f" (version {nv['nvshmem4py']['version']})" if nv["nvshmem4py"]["version"] else "")
        + (f"; library {nv['library_path']}" if nv["library_path"] else "")
    )
    la = report["launcher"]
    if la["under_launcher"]:
        env = " ".join(f"{k}={v}" for k, v in la["env"].items())
        lines.append(f"launcher   {env}")
    s = report["selection"]
    lines.append(
        f"backend    requested {s['requested']!r} for {s['world_size']} rank(s) = {s['nodes']} "
        f"node(s) x {s['ranks_per_node']}"
        + (f", H={s['hidden']}" if s["hidden"] is not None else "")
        + f": {s['backend'] or 'NOT USABLE'}"
    )
    lines.append(f"           {s['reason']}")
    for name in ("deepep", "torch"):
        for chk in s["checks"][name]:
            lines.append(f"  {name:<7} {_mark(chk['ok'])}{chk['name']}: {chk['detail']}")
    return "\n".join(lines)
