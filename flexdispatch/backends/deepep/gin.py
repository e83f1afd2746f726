"""Whether DeepEP V2 / V2.5 can build its device communicator here: NCCL's device API and GIN.

R ranks.

DeepEP V2 (``ElasticBuffer``, 2.1.0) and V2.5 (``EPBuffer``) build an NCCL device communicator
when they build their buffer (the first dispatch). What they need of NCCL, all of it readable
before the first kernel from NCCL's own report (``ncclCommQueryProperties``, a host function local
to the process: no collective, no kernel), asked as DeepEP asks it:

1. **The device API** (symmetric memory): ``ncclDevCommCreate`` refuses a communicator without it
   ("Communicator does not support symmetric memory!", nccl v2.30.7-1 src/dev_runtime.cc:1521-1524;
   V2 main:csrc/kernels/backend/nccl.cu:108, V2.5 context.cpp:164), for both generations, at any R,
   whatever ``EP_DISABLE_GIN``. NCCL reports it as ``deviceApiSupport``: all CUDA P2P,
   ``NCCL_WIN_ENABLE`` (default 1), cuMem (``NCCL_CUMEM_ENABLE`` not 0) and GIN or one LSA team
   (src/init.cc:1674-1675).
2. **A GIN type**, unless ``EP_DISABLE_GIN`` reads as a non-zero integer: the railed one in hybrid
   mode, the plain one otherwise, is not NONE (V2: nccl.cu:86-90, for R > 1; V2.5:
   deep_ep_v25/csrc/kernels/comm/context.cpp:124-128, also on one node). DeepEP #629 shows NCCL
   reporting none on a single 8 x B300 node.
3. **GDAKI** (V2.5 only, unless ``EP_DISABLE_GIN``): ``ginSupport[NCCL_GIN_TYPE_GDAKI]``
   (context.cpp:129-131); DeepEP 2.5 requests GDAKI and JIT-builds its kernels for GDAKI alone, so
   proxy GIN (a non-mlx5 NIC, ``NCCL_GIN_TYPE=2``) and EFA (``EFA_GDA``) are refused.
4. ``EP_DISABLE_GIN`` **on one node only**: with it DeepEP builds no GIN contexts (context.cpp:
   124-155, nccl.cu:86-99), which its RDMA kernels across nodes need: a group spanning more than
   one RDMA rank (node) is refused with it set.

The report is asked with DeepEP's own caller version and struct (V2.5: NCCL 2.32.3, 23203, the
152-byte struct its ``_C`` passes; V2: 2.30.7, 23007, the 56-byte head), so NCCL's per-version
filters answer what DeepEP will see. The layout (x86-64): the head from nccl_device/core.h
(2.30.7: ``deviceApiSupport`` +32, ``ginType`` +36, ``nLsaTeams`` +40, ``railedGinType`` +48), the
tail from the V2.5 ``_C`` itself (``ginMinStride`` +64, ``ginSupport[]`` +72, so GDAKI = +75,
``sizeof`` 152 for 2.32.3). It goes through ``ctypes`` on the communicator torch's process group
already has (``ProcessGroupNCCL._comm_ptr()``, the one DeepEP reuses); the test emulator's
packages answer for their emulated NCCL (``emu_nccl``). Where NCCL cannot be asked — no loaded
``libnccl``, more than one (a function of one library on another's communicator is undefined
behaviour), an older NCCL, no communicator yet — the answer is "unknown", which does not refuse:
DeepEP's own check then decides. The adapter never sets ``EP_DISABLE_GIN`` (``docs/deepep.md``:
set it yourself for a single node without GIN).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from flexdispatch.backends.base import Capability
from flexdispatch.backends.deepep.nccl import classify_maps

__all__ = [
    "CALLERS",
    "GIN_TYPES",
    "gin_disabled",
    "gin_rule",
    "gin_support",
    "loaded_nccl",
    "nccl_properties",
    "query_properties",
]

GIN_TYPES = {0: "NONE", 2: "PROXY", 3: "GDAKI", 4: "GPI", 5: "EFA_GDA"}
GIN_GDAKI = 3
_API_MAGIC = 0xCAFEBEEF  # NCCL_API_MAGIC (nccl.h)
_GIN_REPORTED = 22904  # NCCL 2.29.4: ginType / railedGinType filled (caller version > 2.29.3)
_TAIL_VERSION = 23100  # NCCL 2.31: the struct has ginSupport[] (and the fields before it)
_ROOM = 4096  # bytes after the 2.32.3 struct a newer NCCL may write (its own, longer struct)
CALLERS = {"v2": (23007, 56), "v25": (23203, 152)}
"""How each generation asks: ``(NCCL version its _C was compiled with, sizeof its struct)``."""


class _Props(ctypes.Structure):
    """``ncclCommProperties_t`` as DeepEP 2.5's ``_C`` has it (NCCL 2.32.3, 152 bytes), then room
    for the fields a newer NCCL writes after it (never read)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("rank", ctypes.c_int),
        ("nRanks", ctypes.c_int),
        ("cudaDev", ctypes.c_int),
        ("nvmlDev", ctypes.c_int),
        ("deviceApiSupport", ctypes.c_bool),
        ("multimemSupport", ctypes.c_bool),
        ("ginType", ctypes.c_int),
        ("nLsaTeams", ctypes.c_int),
        ("hostRmaSupport", ctypes.c_bool),
        ("railedGinType", ctypes.c_int),
        ("commHash", ctypes.c_uint64),
        ("ginMinStride", ctypes.c_int),
        ("ginConnectionType", ctypes.c_int),
        ("ginSupport", ctypes.c_uint8 * 64),
        ("devCommRuntimeVersionSize", ctypes.c_size_t),
        ("_tail", ctypes.c_uint8 * 8),
        ("_room", ctypes.c_uint8 * _ROOM),
    ]


_LEADING_INT = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def gin_disabled(env: Mapping[str, str] | None = None) -> bool:
    """``EP_DISABLE_GIN`` as DeepEP reads it: ``get_env<int>`` is ``sscanf("%d")``, the leading
    integer after white space ("2abc" is 2, "1.5" is 1, " 1" is 1), stored in an ``int`` as
    glibc does (a 64-bit ``long``, saturated, cut to 32 bits: "4294967296" is 0), and DeepEP skips
    its GIN check when it is non-zero. Text with no leading integer leaves DeepEP's value
    uninitialised; it is taken as not set (the GIN check is not skipped)."""
    text = (os.environ if env is None else env).get("EP_DISABLE_GIN")
    m = None if text is None else _LEADING_INT.match(text)
    if m is None:
        return False
    value = max(-(1 << 63), min(int(m.group(1)), (1 << 63) - 1))
    return value & 0xFFFFFFFF != 0


def loaded_nccl(maps: str | None = None) -> tuple[str | None, str]:
    """The one NCCL runtime (``libnccl.so*``) mapped in this process (``maps``: the text of
    ``/proc/self/maps``, read when None), or ``(None, why not)``: none, or more than one (then
    which library torch's communicator belongs to is not known)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError as exc:
            return None, f"/proc/self/maps unreadable ({exc})"
    libs = sorted(classify_maps(maps)["runtime"])
    if not libs:
        return None, "no libnccl loaded in this process"
    if len(libs) > 1:
        return None, f"{len(libs)} libnccl libraries loaded ({', '.join(libs)}): not asked"
    return libs[0], libs[0]


def query_properties(
    lib: Any, comm: int, where: str, generation: str = "v25"
) -> tuple[dict[str, Any] | None, str]:
    """``ncclCommQueryProperties`` of the communicator ``comm`` through ``lib`` (a ``ctypes``
    library or a stand-in), asked as DeepEP ``generation`` asks (``CALLERS``): ``({"version"
    (the runtime's), "ginType", "railedGinType", "deviceApiSupport", "nLsaTeams", "gdaki" (None
    where the struct has no ``ginSupport[]``)}, how)`` or ``(None, why not)``. Never raises."""
    caller, size = CALLERS[generation]
    try:
        version = ctypes.c_int(0)
        lib.ncclGetVersion(ctypes.byref(version))
        if version.value < _GIN_REPORTED:
            return None, f"NCCL {version.value} does not report its GIN type (2.29.4+ does)"
        props = _Props()
        props.size = size
        props.magic = _API_MAGIC
        props.version = caller  # NOTE: NCCL answers per caller version (its compat filters)
        rc = lib.ncclCommQueryProperties(ctypes.c_void_p(comm), ctypes.byref(props))
        if rc != 0:
            return None, f"ncclCommQueryProperties returned {rc}"
    except Exception as exc:  # NOTE: a query must never break selection
        return None, f"NCCL could not be asked ({type(exc).__name__}: {exc})"
    tail = caller >= _TAIL_VERSION and size >= _Props.ginSupport.offset + len(props.ginSupport)
    out = {
        "version": version.value,
        "ginType": int(props.ginType),
        "railedGinType": int(props.railedGinType),
        "deviceApiSupport": bool(props.deviceApiSupport),
        "nLsaTeams": int(props.nLsaTeams),
        "gdaki": bool(props.ginSupport[GIN_GDAKI]) if tail else None,
    }
    return out, f"ncclCommQueryProperties of {where}"


def nccl_properties(group: Any, generation: str = "v25") -> tuple[dict[str, Any] | None, str]:
    """NCCL's report on ``group``'s communicator (``query_properties``), or ``(None, why not)``.
    Never raises."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    lib_path, why = loaded_nccl()
    if lib_path is None:
        return None, why
    try:
        backend = group._get_backend(torch.device("cuda"))
        comm = int(backend._comm_ptr())
        if not comm:
            return None, "the process group has no NCCL communicator yet"
        lib = ctypes.CDLL(lib_path)
    except Exception as exc:  # NOTE: a query must never break selection
        return None, f"NCCL could not be asked ({type(exc).__name__}: {exc})"
    return query_properties(lib, comm, lib_path, generation)


_DEVICE_API_FIX = (
    "needs CUDA P2P between all ranks, NCCL_CUMEM_ENABLE not 0, NCCL_WIN_ENABLE not 0, and GIN or "
    "one NVLink domain: unset NCCL_CUMEM_ENABLE=0 / NCCL_WIN_ENABLE=0 where they are set"
)
_SINGLE_NODE = "on one node EP_DISABLE_GIN=1 lets DeepEP run without GIN"


def gin_rule(
    props: Mapping[str, Any],
    *,
    hybrid: bool,
    generation: str,
    disabled: bool = False,
    num_ranks: int = 2,
) -> Capability:
    """DeepEP's preconditions on NCCL's report (module docstring, 1-3): the device API always
    (where reported); unless ``disabled`` (EP_DISABLE_GIN), the GIN type (V2: for R > 1) and, for
    V2.5, GDAKI support (where reported)."""
    name = "DeepEP 2.5" if generation == "v25" else "DeepEP V2"
    if props.get("deviceApiSupport") is False:
        return False, (
            f"{name} builds an NCCL device communicator, and NCCL reports no device API "
            f"(symmetric memory) for this communicator (deviceApiSupport=false; ncclDevCommCreate "
            f"refuses it, also with EP_DISABLE_GIN): it {_DEVICE_API_FIX}"
        )
    if disabled:
        return True, "EP_DISABLE_GIN set: DeepEP skips its GIN checks (NCCL's device API present)"
    if generation == "v2" and num_ranks <= 1:
        return True, "one rank: DeepEP V2 needs no GIN"
    key = "railedGinType" if hybrid else "ginType"
    kind = GIN_TYPES.get(int(props[key]), str(props[key]))
    where = "deep_ep_v25 context.cpp:124-128" if generation == "v25" else "V2 nccl.cu:86-90"
    if int(props[key]) == 0:
        return False, (
            f"NCCL reports {key} = NONE, which {name} asserts against ({where}): across nodes "
            f"fix the NCCL network (GIN with GDAKI: an mlx5 NIC with GPUDirect RDMA); "
            f"{_SINGLE_NODE}"
        )
    gdaki = props.get("gdaki")
    if generation == "v25" and (gdaki is False or (gdaki is None and int(props[key]) != GIN_GDAKI)):
        return False, (
            f"DeepEP 2.5 needs NCCL GIN with GDAKI (context.cpp:129-131; its kernels are built "
            f"for GDAKI only), but NCCL reports {key} = {kind}"
            + (" and no GDAKI support" if gdaki is False else "")
            + " for this communicator: fix GDAKI (an mlx5 NIC with GPUDirect RDMA, NCCL_GIN_TYPE "
            f"unset); {_SINGLE_NODE}"
        )
    return True, f"NCCL GIN {kind}"


def _emulated_properties(module: Any, num_ranks: int, generation: str) -> Any:
    """The test emulator's report (its ``emu_nccl`` stand-in library), or None."""
    lib = getattr(module, "emu_nccl", None)
    if lib is not None and getattr(module, "IS_EMULATOR", False) is True:
        return query_properties(lib, lib.communicator(num_ranks), "the emulated NCCL", generation)
    query = getattr(module, "emu_nccl_properties", None)  # NOTE: a test's fixed report
    return (query(), "the emulated NCCL") if callable(query) else None


def gin_support(
    module: ModuleType | None,
    group: Any,
    *,
    hybrid: bool,
    generation: str,
    num_ranks: int,
    nodes: int = 1,
    env: Mapping[str, str] | None = None,
) -> Capability:
    """Whether DeepEP ``generation`` ("v2" or "v25") can build its device communicator here
    (module docstring); ``nodes``: the RDMA ranks (nodes) of the group, where known; unknown
    answers count as yes (DeepEP's own check then decides). Local: no collective."""
    disabled = gin_disabled(env)
    across = (
        f"EP_DISABLE_GIN is set on a group across {nodes} nodes: DeepEP then builds no GIN "
        f"contexts, which its RDMA kernels across nodes need (EP_DISABLE_GIN is its single-node "
        f"recipe): unset EP_DISABLE_GIN"
    )
    if disabled and nodes > 1:
        return False, across
    got = _emulated_properties(module, num_ranks, generation)
    props, how = got if got is not None else nccl_properties(group, generation)
    if props is None:
        if disabled:
            return True, f"EP_DISABLE_GIN set: DeepEP skips its GIN checks ({how})"
        if generation == "v2" and num_ranks <= 1:
            return True, "one rank: DeepEP V2 needs no GIN"
        return True, f"GIN not checked ({how})"
    teams = int(props.get("nLsaTeams") or 0)
    if disabled and teams > 1:
        return False, across.replace(f"{nodes} nodes", f"{teams} NVLink domains")
    return gin_rule(
        props, hybrid=hybrid, generation=generation, disabled=disabled, num_ranks=num_ranks
    )
