"""Whether DeepEP V2 / V2.5 can build its buffer here: NCCL's GPU-initiated networking (GIN).

R ranks.

DeepEP V2 (``ElasticBuffer``, 2.1.0) and V2.5 (``EPBuffer``) create an NCCL device communicator
and assert, unless ``EP_DISABLE_GIN`` reads as a non-zero integer, that NCCL reports a GIN type for
the communicator — the railed one in hybrid mode, the plain one otherwise (V2.5:
deep_ep_v25/csrc/kernels/comm/context.cpp:124-131, also on one node, and then GDAKI support; V2:
main:csrc/kernels/backend/nccl.cu:86-90, for R > 1). DeepEP #629 shows NCCL reporting no GIN on a
single 8 x B300 node, and EFA clusters have none either: the buffer build, at the first dispatch,
then raises instead of ``auto`` choosing another DeepEP generation.

``gin_support`` answers before the choice, from what NCCL itself reports: the host function
``ncclCommQueryProperties`` (local to the process: no collective, no GPU kernel), called through
``ctypes`` on the communicator torch's process group already has (``ProcessGroupNCCL.
_comm_ptr()``, the one DeepEP reuses). Only the head of ``ncclCommProperties_t`` is read, the
fields through ``railedGinType``, whose layout is the same from NCCL 2.29.4 (the first release
that fills the GIN types, for a caller version > 2.29.3) to 2.30.7 (nccl_device/core.h); the
fields after it (``ginSupport[]`` and the others DeepEP 2.5 reads from NCCL >= 2.32.3) are not
read, so GDAKI support is left to DeepEP's own assert. On the test emulator the emulated
communicator's properties answer. Where NCCL cannot be asked — no loaded ``libnccl``, more than
one (a function of one library on another's communicator is undefined behaviour), an older
NCCL, no communicator yet — the answer is "unknown", which does not refuse: DeepEP's own check
then decides, as before. The adapter never sets ``EP_DISABLE_GIN`` (``docs/deepep.md``: set it
yourself for a single node without GIN).
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

__all__ = [
    "GIN_TYPES",
    "gin_disabled",
    "gin_rule",
    "gin_support",
    "loaded_nccl",
    "nccl_properties",
    "query_properties",
]

GIN_TYPES = {0: "NONE", 2: "PROXY", 3: "GDAKI", 4: "GPI", 5: "EFA_GDA"}
_API_MAGIC = 0xCAFEBEEF  # NCCL_API_MAGIC (nccl.h)
_GIN_REPORTED = 22904  # NCCL 2.29.4: ginType / railedGinType filled (caller version > 2.29.3)
_ROOM = 4096  # bytes after railedGinType a newer NCCL may write (its own, longer struct)


class _Props(ctypes.Structure):
    """The head of ``ncclCommProperties_t`` (nccl_device/core.h, NCCL 2.29.4 to 2.30.7), then room
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
    """The one ``libnccl`` mapped in this process (``maps``: the text of ``/proc/self/maps``, read
    when None), or ``(None, why not)``: none, or more than one (then which library torch's
    communicator belongs to is not known)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError as exc:
            return None, f"/proc/self/maps unreadable ({exc})"
    libs = sorted({ln.split()[-1] for ln in maps.splitlines() if "libnccl.so" in ln})
    if not libs:
        return None, "no libnccl loaded in this process"
    if len(libs) > 1:
        return None, f"{len(libs)} libnccl libraries loaded ({', '.join(libs)}): not asked"
    return libs[0], libs[0]


def query_properties(lib: Any, comm: int, where: str) -> tuple[dict[str, Any] | None, str]:
    """``ncclCommQueryProperties`` of the communicator ``comm`` through ``lib`` (a ``ctypes``
    library or a stand-in): ``({"version", "ginType", "railedGinType"}, how)`` or ``(None, why
    not)``. Never raises."""
    try:
        version = ctypes.c_int(0)
        lib.ncclGetVersion(ctypes.byref(version))
        if version.value < _GIN_REPORTED:
            return None, f"NCCL {version.value} does not report its GIN type (2.29.4+ does)"
        props = _Props()
        props.size = ctypes.sizeof(_Props)
        props.magic = _API_MAGIC
        props.version = version.value  # NOTE: NCCL fills the GIN types for a version > 2.29.3
        rc = lib.ncclCommQueryProperties(ctypes.c_void_p(comm), ctypes.byref(props))
        if rc != 0:
            return None, f"ncclCommQueryProperties returned {rc}"
    except Exception as exc:  # NOTE: a query must never break selection
        return None, f"NCCL could not be asked ({type(exc).__name__}: {exc})"
    out = {
        "version": version.value,
        "ginType": int(props.ginType),
        "railedGinType": int(props.railedGinType),
    }
    return out, f"ncclCommQueryProperties of {where}"


def nccl_properties(group: Any) -> tuple[dict[str, Any] | None, str]:
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
    return query_properties(lib, comm, lib_path)


def gin_rule(props: Mapping[str, Any], *, hybrid: bool, generation: str) -> Capability:
    """DeepEP's assert on NCCL's GIN types: the railed one in hybrid mode, the plain one otherwise,
    is not NONE. (V2.5 also asserts GDAKI support, a field not read here: DeepEP's own assert
    decides that one.)"""
    key = "railedGinType" if hybrid else "ginType"
    kind = GIN_TYPES.get(int(props[key]), str(props[key]))
    where = "deep_ep_v25 context.cpp:124-131" if generation == "v25" else "V2 nccl.cu:86-90"
    fix = (
        "on one node set EP_DISABLE_GIN=1 (DeepEP then runs without GIN); across nodes fix the "
        "NCCL network (GIN / GDAKI plugin), or use deepep_api='v1' / backend='torch'"
    )
    if int(props[key]) == 0:
        return False, f"NCCL reports {key} = NONE, which DeepEP asserts against ({where}): {fix}"
    return True, f"NCCL GIN {kind}"


def gin_support(
    module: ModuleType | None,
    group: Any,
    *,
    hybrid: bool,
    generation: str,
    num_ranks: int,
    env: Mapping[str, str] | None = None,
) -> Capability:
    """Whether DeepEP ``generation`` ("v2" or "v25") can build its buffer here as far as GIN
    goes; unknown counts as yes (DeepEP's own check then decides). Local: no collective."""
    if gin_disabled(env):
        return True, "EP_DISABLE_GIN set: DeepEP skips its GIN check"
    if generation == "v2" and num_ranks <= 1:
        return True, "one rank: DeepEP V2 needs no GIN"
    query = getattr(module, "emu_nccl_properties", None)
    props, how = (query(), "the emulated NCCL") if callable(query) else nccl_properties(group)
    if props is None:
        return True, f"GIN not checked ({how})"
    return gin_rule(props, hybrid=hybrid, generation=generation)
