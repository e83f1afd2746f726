"""Whether DeepEP V2 / V2.5 can build its buffer here: NCCL's GPU-initiated networking (GIN).

R ranks.

DeepEP V2 (``ElasticBuffer``, 2.1.0) and V2.5 (``EPBuffer``) create an NCCL device communicator
and assert, unless the environment sets ``EP_DISABLE_GIN`` to a non-zero integer, that NCCL
reports a GIN type for the communicator — the railed one in hybrid mode, the plain one otherwise
(V2.5: deep_ep_v25/csrc/kernels/comm/context.cpp:124-131, also on one node, and GDAKI support;
V2: main:csrc/kernels/backend/nccl.cu:86-90, for R > 1). DeepEP #629 shows NCCL reporting no GIN
on a single 8 x B300 node, and EFA clusters have none either: the buffer build, at the first
dispatch, then raises instead of ``auto`` choosing another DeepEP generation.

``gin_support`` answers before the choice, from what NCCL itself reports: the host function
``ncclCommQueryProperties`` (NCCL >= 2.29.4 fills ``ginType`` / ``railedGinType``; 2.32.3 also
``ginSupport``), called through ``ctypes`` on the communicator torch's process group already has
(``ProcessGroupNCCL._comm_ptr()``, the one DeepEP reuses) — no GPU kernel, no new communicator. On
the test emulator the emulated communicator's properties answer. Where NCCL cannot be asked
(no loaded ``libnccl``, an older NCCL, no communicator yet) the answer is "unknown", which does not
refuse: DeepEP's own check then decides, as before. The adapter never sets ``EP_DISABLE_GIN``
(``docs/deepep.md``: set it yourself for a single node without GIN).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from flexdispatch.backends.base import Capability

__all__ = ["GIN_TYPES", "gin_disabled", "gin_rule", "gin_support", "nccl_properties"]

GIN_TYPES = {0: "NONE", 2: "PROXY", 3: "GDAKI", 4: "GPI", 5: "EFA_GDA"}
_GDAKI = 3
_API_MAGIC = 0xCAFEBEEF  # NCCL_API_MAGIC (nccl.h)
_GIN_REPORTED = 22904  # NCCL 2.29.4: ginType / railedGinType filled (version > 2.29.3)
_GIN_SUPPORT_LIST = 23203  # NCCL 2.32.3, DeepEP 2.5's minimum: ginSupport[] present


class _Props(ctypes.Structure):
    """``ncclCommProperties_t`` (nccl.h, NCCL 2.32), with room for fields added later."""

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
        ("ginSupport", ctypes.c_bool * 64),
        ("devCommRuntimeVersionSize", ctypes.c_size_t),
        ("_spare", ctypes.c_uint8 * 1024),
    ]


def gin_disabled(env: Mapping[str, str] | None = None) -> bool:
    """``EP_DISABLE_GIN`` as DeepEP reads it (``get_env<int>``: a non-zero integer)."""
    text = (os.environ if env is None else env).get("EP_DISABLE_GIN", "").strip()
    try:
        return int(text) != 0
    except ValueError:
        return False


def _loaded_nccl() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "libnccl.so" in ln})
    except OSError:
        return None
    return libs[0] if libs else None


def nccl_properties(group: Any) -> tuple[dict[str, Any] | None, str]:
    """NCCL's ``ncclCommQueryProperties`` of ``group``'s communicator: ``({"version",
    "ginType", "railedGinType", "gdaki" (None before 2.32.3)}, how)`` or ``(None, why not)``.
    Never raises."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    lib_path = _loaded_nccl()
    if lib_path is None:
        return None, "no libnccl loaded in this process"
    try:
        backend = group._get_backend(torch.device("cuda"))
        comm = int(backend._comm_ptr())
        if not comm:
            return None, "the process group has no NCCL communicator yet"
        lib = ctypes.CDLL(lib_path)
        version = ctypes.c_int(0)
        lib.ncclGetVersion(ctypes.byref(version))
        if version.value < _GIN_REPORTED:
            return None, f"NCCL {version.value} does not report its GIN type (2.29.4+ does)"
        props = _Props()
        props.size = _Props._spare.offset
        props.magic = _API_MAGIC
        props.version = version.value
        rc = lib.ncclCommQueryProperties(ctypes.c_void_p(comm), ctypes.byref(props))
        if rc != 0:
            return None, f"ncclCommQueryProperties returned {rc}"
    except Exception as exc:  # NOTE: a query must never break selection
        return None, f"NCCL could not be asked ({type(exc).__name__}: {exc})"
    gdaki = bool(props.ginSupport[_GDAKI]) if version.value >= _GIN_SUPPORT_LIST else None
    out = {
        "version": version.value,
        "ginType": int(props.ginType),
        "railedGinType": int(props.railedGinType),
        "gdaki": gdaki,
    }
    return out, f"ncclCommQueryProperties of {lib_path}"


def gin_rule(props: Mapping[str, Any], *, hybrid: bool, generation: str) -> Capability:
    """DeepEP's assert on NCCL's properties: the (railed, in hybrid mode) GIN type is not NONE
    and, on V2.5 (``generation="v25"``), GDAKI is supported."""
    key = "railedGinType" if hybrid else "ginType"
    kind = GIN_TYPES.get(int(props[key]), str(props[key]))
    where = "deep_ep_v25 context.cpp:124-131" if generation == "v25" else "V2 nccl.cu:86-90"
    fix = (
        "on one node set EP_DISABLE_GIN=1 (DeepEP then runs without GIN); across nodes fix the "
        "NCCL network (GIN / GDAKI plugin), or use deepep_api='legacy' / backend='torch'"
    )
    if int(props[key]) == 0:
        return False, f"NCCL reports {key} = NONE, which DeepEP asserts against ({where}): {fix}"
    if generation == "v25" and props.get("gdaki") is False:
        return False, f"NCCL reports no GDAKI support, which DeepEP 2.5 asserts ({where}): {fix}"
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
    goes; unknown counts as yes (DeepEP's own check then decides)."""
    if gin_disabled(env):
        return True, "EP_DISABLE_GIN set: DeepEP skips its GIN check"
    if generation == "v2" and num_ranks <= 1:
        return True, "one rank: DeepEP V2 needs no GIN"
    query = getattr(module, "emu_nccl_properties", None)
    props, how = (query(), "the emulated NCCL") if callable(query) else nccl_properties(group)
    if props is None:
        return True, f"GIN not checked ({how})"
    return gin_rule(props, hybrid=hybrid, generation=generation)
