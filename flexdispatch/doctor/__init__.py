"""Probe this machine for what flexdispatch can use, and say which backend ``auto`` would pick.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R local
experts · k top-k · L ranks per node · N = R / L nodes · M received rows · W worst-case rows.

Everything here runs in one process, without a process group, and never raises for a missing or
broken optional dependency: each probe turns a failure into text. ``would_select`` answers "what
would ``backend=auto`` choose for R ranks with L per node on machines like this one" from the
local facts (``HostFacts``) and the rule backend selection applies (``deepep_support_checks`` in
``flexdispatch.backends.deepep.support``, plus the row-size rule of ``backends.deepep.sizing``), so
it needs no cluster.

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
  ``reason``; ``runtime``: {``version`` (this process's NCCL runtime or null), ``source``,
  ``library`` (the one mapped ``libnccl.so*`` or null), ``detail``}; ``plugins``: {``mapped``
  (NCCL plugins mapped now), ``would_load`` (``[{kind, name, path, source}]``: what NCCL would
  ``dlopen`` at its first communicator, resolved on ``LD_LIBRARY_PATH`` / ``ldconfig -p``),
  ``deepep_import_after_communicator`` (``"no plugin"`` / ``"plugin-tolerant"`` /
  ``"refused"``), ``detail``} (``doctor.nccl``). ``gloo``: ``available``.
- ``deep_ep``: ``importable``, ``usable`` (imports and flexdispatch has its backend), ``reason``
  (the exact import error when it fails), ``version``, ``path``, ``emulator`` (the test emulator),
  ``elastic`` (it has DeepEP V2's ``ElasticBuffer``).
- ``deep_ep_generations``: {``v1``, ``v2``, ``v25``}, each {``ok``, ``api`` (``deep_ep.Buffer``,
  ``deep_ep.ElasticBuffer``, ``deep_ep_v25.EPBuffer``), ``reason``, ``nccl_rule`` {``rule``
  (``"none (NVSHMEM)"``, ``"== 2.30.7"``, ``">= 2.32.3"``, ``"unknown build"``), ``ok`` (null:
  the runtime is unknown here), ``detail``}}; ``v25`` also ``version`` and ``wheel``
  (``doctor.v25.probe_generations``).
- ``gin``: DeepEP V2 / 2.5's NCCL preconditions as the environment shows them: ``source``,
  ``ep_disable_gin``, ``nodes``, ``cumem_enable``, ``win_enable``, ``gin_type_env``,
  ``gin_type``, ``railed_gin_type``, ``gdaki_support``, ``device_api_support``, ``ok_v2``,
  ``ok_v25`` (null where only NCCL's report on a communicator can tell), ``detail``.
- ``side_group``: ``needed`` (false: no gloo side group is built), ``reason``,
  ``gloo_socket_ifname``, ``hostname``, ``hostname_address``, ``hostname_loopback``,
  ``rendezvous_address`` (the local address on the route to ``MASTER_ADDR``), ``warning``.
- ``deep_ep_v25``: DeepEP 2.5's run-time needs, a list of {``name`` (``wheel``, ``torch_cuda``,
  ``nvcc``, ``cxx20``, ``nccl``, ``nccl_loaded``, ``ibstat``, ``nvidia-smi``, ``links``,
  ``gin``), ``ok``,
  ``detail``, ``fix``, ``level`` (``"error"`` / ``"warning"``)} (``doctor.v25.probe_v25_runtime``).
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
  {``deepep``: [...], ``torch``: [...]}, each a list of ``{name, ok, detail}``; ``deepep_api``:
  {``requested`` (auto | v1 | v2 | v25), ``api`` (``"v1"`` / ``"v2"`` / ``"v25"`` when deepep
  would run, else null), ``reason``} (``deepep_api_choice``; with ``v25``, or ``auto`` where
  DeepEP 2.5 imports, DeepEP 2.5's own rules decide the selection). The names before 0.1
  (``legacy``, ``elastic``, ``ep``) are read as these.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch.backends.base import Capability
from flexdispatch.distributed import env_int
from flexdispatch.doctor.nccl import (
    nccl_rules,
    probe_gin,
    probe_nccl_runtime,
    probe_plugins,
    probe_side_group,
)
from flexdispatch.doctor.probe import (
    probe_cuda,
    probe_deep_ep,
    probe_launcher,
    probe_nccl,
    probe_nvshmem,
)
from flexdispatch.doctor.report import format_report
from flexdispatch.doctor.v25 import ep_selection, probe_generations, probe_v25_runtime

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
DEEPEP_API_CHOICES = ("auto", "v1", "v2", "v25")
_ROW_ELEMENT_SIZE = 2  # bf16 activations, the dtype DeepEP moves natively


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
        deepep: ``(ok, reason)`` of ``flexdispatch.dispatch.select.deepep_available()``.
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
    from flexdispatch.backends.deepep.sizing import check_row_bytes
    from flexdispatch.backends.deepep.support import deepep_support_checks

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

    The rule of ``flexdispatch.dispatch.select.select_backend`` and ARCHITECTURE.md: ``auto`` picks
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


def _release(requested: str) -> str:
    """A ``deepep_api`` value before 0.1 (``legacy``, ``elastic``, ``ep``) as its release name."""
    from flexdispatch.config import deepep_release

    return deepep_release(requested)


def deepep_api_choice(
    requested: str,
    *,
    backend: str | None,
    elastic: bool | None,
    num_worst_tokens: int = 0,
    ep: bool | None = None,
) -> dict[str, Any]:
    """Which DeepEP API (``DispatchConfig.deepep_api``) the deepep backend would run, and why.

    The rule of ``flexdispatch.dispatch.select.select_backend``: ``"auto"`` runs V2
    (``deep_ep.ElasticBuffer``) where it exists in worst-case mode (``num_worst_tokens > 0``),
    else V1 ``deep_ep.Buffer`` (``auto_deepep_api``); ``"v2"`` needs ``ElasticBuffer``.

    Args:
        requested: ``"auto"``, ``"v1"``, ``"v2"`` or ``"v25"`` (or a name before 0.1).
        backend: the backend that would run (``would_select``), or None.
        elastic: the importable ``deep_ep`` has ``ElasticBuffer`` (None: it does not import).
        num_worst_tokens: W of the dispatch to report on (0 = dropless).
        ep: DeepEP 2.5 (``deep_ep_v25.EPBuffer``) imports here (None: not asked).
    """
    requested = _release(requested)
    if requested not in DEEPEP_API_CHOICES:
        raise ValueError(
            f"deepep_api must be one of {', '.join(DEEPEP_API_CHOICES)}, got {requested!r}"
        )
    if requested == "v2":
        api: str | None = "v2" if elastic else None
        reason = (
            "deepep_api='v2': DeepEP V2 deep_ep.ElasticBuffer"
            if elastic
            else "deepep_api='v2' needs deep_ep.ElasticBuffer (DeepEP 2.1.0+), "
            + ("absent here" if elastic is False else "and deep_ep does not import")
        )
    elif requested == "v25":
        api = "v25" if ep else None
        reason = (
            "deepep_api='v25': DeepEP 2.5 deep_ep_v25.EPBuffer"
            if ep
            else "deepep_api='v25' needs deep_ep_v25.EPBuffer (pip install --no-deps "
            "sgl-deep-ep-v25), which does not import here"
        )
    elif requested == "v1":
        api, reason = "v1", "deepep_api='v1': DeepEP V1 deep_ep.Buffer"
    else:
        from flexdispatch.config import DispatchConfig
        from flexdispatch.dispatch.select import auto_deepep_api

        has = (
            (True, "deep_ep.ElasticBuffer exists")
            if elastic
            else (
                False,
                "this deep_ep has no ElasticBuffer"
                if elastic is False
                else "deep_ep does not import",
            )
        )
        cfg = DispatchConfig(num_worst_tokens=num_worst_tokens)
        v25 = (True, "deep_ep_v25.EPBuffer exists") if ep else None
        api, why = auto_deepep_api(cfg, has, (backend == "deepep", ""), v25)
        name = {
            "v25": "V2.5 deep_ep_v25.EPBuffer",
            "v2": "V2 deep_ep.ElasticBuffer",
            "v1": "V1 deep_ep.Buffer",
        }[api]
        reason = f"deepep_api='auto': DeepEP {name} ({why})"
    if backend != "deepep":
        api = None
        reason = f"deepep does not run ({reason})"
    return {"requested": requested, "api": api, "reason": reason}


# --------------------------------------------------------------------------- probes


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
    elif (env := env_int("WORLD_SIZE", minimum=1)) is not None:
        R, r_src = env, "WORLD_SIZE"
    elif num_gpus > 0:
        R, r_src = num_gpus, "gpus"
    else:
        R, r_src = 1, "default"
    if ranks_per_node is not None:
        L, l_src = ranks_per_node, "argument"
    elif (env := env_int("LOCAL_WORLD_SIZE", minimum=1)) is not None:
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
    deepep_api: str = "auto",
    num_worst_tokens: int = 0,
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
    elastic = bool(deep.get("elastic")) if deep["importable"] else None
    gens = probe_generations(deep)
    ep_ok = bool(gens["v25"]["ok"])
    deepep_api = _release(deepep_api)
    if deepep_api == "v25" or (
        deepep_api == "auto" and ep_ok and (num_worst_tokens or choice.backend != "deepep")
    ):
        # NOTE: DeepEP 2.5's own rules decide (v25_rules), not V1's topology rules
        ep_backend, ep_why, ep_checks = ep_selection(
            backend, R, L, facts, gens["v25"], num_worst_tokens
        )
        if backend != "torch" and (deepep_api == "v25" or ep_backend == "deepep"):
            choice = dataclasses.replace(choice, backend=ep_backend, ok=ep_backend is not None)
            selection.update(backend=ep_backend, ok=ep_backend is not None, reason=ep_why)
            selection["checks"]["deepep"] = ep_checks
    api = deepep_api_choice(
        deepep_api,
        backend=choice.backend,
        elastic=elastic,
        num_worst_tokens=num_worst_tokens,
        ep=ep_ok,
    )
    ok = choice.ok
    if deepep_api == "v2" and not elastic and choice.backend == "deepep":
        # select_backend: backend='deepep' raises, 'auto' falls back to torch
        if backend == "deepep":
            ok = False
            selection.update(backend=None, ok=False, reason=f"deepep backend: {api['reason']}")
        else:
            selection.update(backend="torch", reason=f"auto: torch fallback ({api['reason']})")
    selection["deepep_api"] = api
    runtime = probe_nccl_runtime()
    nccl_rules(gens, runtime)
    nccl = dict(nccl, runtime=runtime, plugins=probe_plugins())
    return {
        "schema": SCHEMA,
        "flexdispatch_version": flexdispatch.__version__,
        "ok": ok,
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
        "deep_ep_generations": gens,
        "deep_ep_v25": probe_v25_runtime(),
        "nvshmem": probe_nvshmem(),
        "launcher": probe_launcher(),
        "selection": selection,
        "gin": probe_gin(None, world_size=R, ranks_per_node=L),
        "side_group": probe_side_group(),
    }


# --------------------------------------------------------------------------- text output
