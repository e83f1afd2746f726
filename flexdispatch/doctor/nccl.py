"""``flexdispatch doctor``'s NCCL part (issue 44): what a DeepEP job meets before its first token.

- ``probe_nccl_runtime``: the NCCL runtime of this process (``ncclGetVersion`` of the one mapped
  ``libnccl.so*``, else ``torch.cuda.nccl.version()``), and each DeepEP generation's rule on it
  (``nccl_rules``: V1 none, V2 the exact NCCL its ``_C`` was compiled with, V2.5 >= 2.32.3).
- ``probe_plugins``: the NCCL plugins mapped here now, the ones NCCL would ``dlopen`` at its first
  communicator (``libnccl-<kind>.so`` or ``NCCL_<KIND>_PLUGIN``, resolved as far as
  ``LD_LIBRARY_PATH`` and ``ldconfig -p`` go: approximate, the NCCL library's own RUNPATH is not
  followed), and what importing DeepEP after that communicator gives (DeepEP's import check
  refuses any second ``libnccl*`` file; flexdispatch imports where only plugins sit beside the
  one runtime DeepEP links).
- ``probe_gin``: DeepEP V2 / 2.5's preconditions on NCCL's device API and GIN, as far as they can
  be read without a communicator (the ``NCCL_*`` variables that turn them off, ``EP_DISABLE_GIN``
  across nodes); selection reads NCCL's own report on the group's communicator (unknown here is
  said, not guessed).
- ``probe_side_group``: flexdispatch builds no gloo side group; what any gloo group of the job
  (the user's, a framework's) would bind: ``GLOO_SOCKET_IFNAME``, else the address the hostname
  resolves to (torch's default device), against the local address on the route to the
  rendezvous (``MASTER_ADDR``).

Every probe answers without raising.
"""

from __future__ import annotations

import filecmp
import glob
import os
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

__all__ = ["nccl_rules", "probe_gin", "probe_nccl_runtime", "probe_plugins", "probe_side_group"]


def probe_nccl_runtime() -> dict[str, Any]:
    """``{version ("2.32.6" or null), source, library (the mapped libnccl.so* or null)}``."""
    from flexdispatch.backends.deepep.nccl import classify_maps, read_maps, runtime_version

    runtimes = classify_maps(read_maps())["runtime"]
    version, source = runtime_version()
    return {
        "version": None if version is None else ".".join(map(str, version)),
        "source": source if version is not None else None,
        "library": runtimes[0] if len(runtimes) == 1 else None,
        "detail": source,
    }


def nccl_rules(gens: dict[str, dict[str, Any]], runtime: Mapping[str, Any]) -> None:
    """Add ``nccl_rule`` ``{rule, ok (bool or null: unknown), detail}`` to each generation."""
    from flexdispatch.backends.deepep.nccl import nccl_rule, rule_text, v2_build

    text = runtime.get("version")
    version = tuple(int(v) for v in text.split(".")) if text else None
    for name in ("v1", "v2", "v25"):
        built, build = v2_build() if name == "v2" else (None, "")
        ok, why = nccl_rule(name, version, built=built, build=build)  # type: ignore[arg-type]
        gens[name]["nccl_rule"] = {"rule": rule_text(name, built), "ok": ok, "detail": why}


def _library_dirs(env: Mapping[str, str]) -> list[str]:
    return [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]


def _ldconfig() -> dict[str, str]:
    """``ldconfig -p``'s names -> paths (empty where it cannot run)."""
    try:
        text = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines():
        if "=>" in line:
            name, path = line.split("=>", 1)
            out.setdefault(name.strip().split(" ")[0], path.strip())
    return out


def _resolve(name: str, dirs: list[str], cache: dict[str, str]) -> str | None:
    if "/" in name:
        return name if os.path.exists(name) else None
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
    return cache.get(name)


def probe_plugins(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{mapped, would_load, deepep_import_after_communicator, detail}`` (module docstring)."""
    from flexdispatch.backends.deepep.nccl import (
        PLUGIN_KINDS,
        classify_maps,
        deepep_nccl_root,
        read_maps,
    )

    env = os.environ if env is None else env
    maps = classify_maps(read_maps())
    dirs, cache = _library_dirs(env), _ldconfig()
    would = []
    for kind, var in PLUGIN_KINDS.items():
        given = env.get(var)
        if given is not None and given.strip().lower() == "none":
            continue
        names = (
            [n for v in given.split(",") if v.strip() for n in (f"libnccl-{kind}-{v}.so", v)]
            if given
            else [f"libnccl-{kind}.so"]
        )
        for name in names:
            path = _resolve(name.strip(), dirs, cache)
            if path is not None:
                source = var if given else "default"
                would.append({"kind": kind, "name": name, "path": path, "source": source})
                break
    plugins = sorted({*maps["plugin"], *(w["path"] for w in would)})
    root = deepep_nccl_root(env)
    linked = sorted(glob.glob(f"{root}/lib/libnccl.so*")) if root else []
    if not plugins and not maps["other"]:
        state, detail = "no plugin", "no NCCL plugin mapped or on the library path"
    elif maps["other"] or len(maps["runtime"]) > 1 or not linked:
        state = "refused"
        detail = (
            f"DeepEP's import check would refuse: mapped {maps['runtime'] + maps['other']}, "
            f"DeepEP's NCCL root {root or 'not found'}"
        )
    else:
        same = True
        if maps["runtime"]:
            try:
                same = filecmp.cmp(maps["runtime"][0], linked[0], shallow=False)
            except OSError:
                same = False
        state = "plugin-tolerant" if same else "refused"
        detail = (
            f"NCCL maps {', '.join(plugins)} at its first communicator; DeepEP's own import "
            f"check refuses any second libnccl* file, so flexdispatch imports DeepEP with "
            f"EP_SUPPRESS_NCCL_CHECK=1 where only plugins sit beside the one runtime it links "
            f"({linked[0]})"
            if same
            else f"the NCCL runtime mapped here is not the one DeepEP links ({linked[0]})"
        )
    return {
        "mapped": maps["plugin"],
        "would_load": would,
        "deepep_import_after_communicator": state,
        "detail": detail,
    }


def probe_gin(env: Mapping[str, str] | None, *, world_size: int, ranks_per_node: int) -> dict:
    """DeepEP V2 / 2.5's NCCL preconditions as the environment shows them (``ok_*`` null where
    only NCCL's report on a communicator can tell; selection reads that report)."""
    from flexdispatch.backends.deepep.gin import gin_disabled

    env = os.environ if env is None else env
    nodes = max(1, world_size // max(ranks_per_node, 1))
    cumem, win, gin_type = (
        env.get("NCCL_CUMEM_ENABLE"),
        env.get("NCCL_WIN_ENABLE"),
        env.get("NCCL_GIN_TYPE"),
    )
    disabled = gin_disabled(env)
    off = [f"{k}={v}" for k, v in (("NCCL_CUMEM_ENABLE", cumem), ("NCCL_WIN_ENABLE", win))
           if v is not None and v.strip() == "0"]  # fmt: skip
    device_api = False if off else None
    gdaki = False if gin_type is not None and gin_type.strip() == "2" else None
    reasons = []
    ok_v2: bool | None = None
    ok_v25: bool | None = None
    if off:
        ok_v2 = ok_v25 = False
        reasons.append(
            f"{' and '.join(off)} turn NCCL's symmetric memory off: ncclDevCommCreate refuses "
            f"V2's and V2.5's device communicator (also with EP_DISABLE_GIN); unset them"
        )
    if disabled and nodes > 1:
        ok_v2 = ok_v25 = False
        reasons.append(
            f"EP_DISABLE_GIN across {nodes} nodes: DeepEP builds no GIN contexts, which its RDMA "
            f"kernels need; it is the single-node recipe"
        )
    if gdaki is False and not disabled:
        ok_v25 = False
        reasons.append("NCCL_GIN_TYPE=2 forces proxy GIN: DeepEP 2.5 needs GDAKI")
    if not reasons:
        reasons.append(
            "no environment setting turns the preconditions off; the GIN type, GDAKI support and "
            "the device API are NCCL's report on the group's communicator, read at selection"
        )
    return {
        "source": "environment",
        "ep_disable_gin": disabled,
        "nodes": nodes,
        "cumem_enable": cumem,
        "win_enable": win,
        "gin_type_env": gin_type,
        "gin_type": None,
        "railed_gin_type": None,
        "gdaki_support": gdaki,
        "device_api_support": device_api,
        "ok_v2": ok_v2,
        "ok_v25": ok_v25,
        "detail": "; ".join(reasons),
    }


def _route_address(host: str, port: int) -> str | None:
    """The local address on the route to ``host`` (a UDP connect: no packet sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return None


def probe_side_group(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{needed, reason, gloo_socket_ifname, hostname, hostname_address, hostname_loopback,
    rendezvous_address, warning}`` (module docstring)."""
    env = os.environ if env is None else env
    hostname = socket.gethostname()
    try:
        address: str | None = socket.gethostbyname(hostname)
    except OSError:
        address = None
    loopback = address is not None and address.startswith("127.")
    master = env.get("MASTER_ADDR")
    try:
        port = int(env.get("MASTER_PORT", "29500"))
    except ValueError:
        port = 29500
    route = _route_address(master, port) if master else None
    ifname = env.get("GLOO_SOCKET_IFNAME")
    warning = None
    if ifname is None and address is not None and route is not None and address != route:
        warning = (
            f"a gloo group would bind {address} (what {hostname} resolves to), not {route} (the "
            f"route to MASTER_ADDR {master}): across hosts set GLOO_SOCKET_IFNAME to the "
            f"interface that reaches MASTER_ADDR"
        )
    return {
        "needed": False,
        "reason": (
            "flexdispatch builds no gloo side group: DeepEP's agreements run on the dispatcher's "
            "own group (issue 44)"
        ),
        "gloo_socket_ifname": ifname,
        "hostname": hostname,
        "hostname_address": address,
        "hostname_loopback": loopback,
        "rendezvous_address": route,
        "warning": warning,
    }
