# ruff: noqa: E501  (NCCL and DeepEP source lines: the texts and needles stay whole)
"""The emulated process's NCCL: its runtime version, what it reports for a communicator, and the
refusals of its device API that DeepEP V2 and V2.5 meet. TEST-ONLY.

A process maps one NCCL runtime, and DeepEP's generations tie themselves to it:

- DeepEP V2 (``sgl-deep-ep`` 0.1.2.post1, DeepEP 2.1.0) was compiled against NCCL 2.30.7 and,
  below NCCL 2.31, asserts that the runtime is the very version it was compiled with (DeepEP main
  ``csrc/kernels/backend/nccl.cu:104``; the wheel's ``deep_ep/_C`` carries that string and
  compares ``ncclGetVersion`` with 23007 before ``ncclDevCommCreate``);
- DeepEP 2.5 (``sgl-deep-ep-v25``) was compiled against NCCL 2.32.3: its import refuses an older
  NCCL (``deep_ep_v25/prerequisites.py``), and NCCL's ``ncclCommQueryProperties`` refuses a caller
  compiled newer than the runtime ("NCCL library is too old", nccl v2.30.7-1
  ``src/dev_runtime.cc:1428``), which its buffer asks at construction (``context.cpp:117``).

``EMU_NCCL`` is that one runtime. Its ``version`` is None by default: each generation then sees
the NCCL of its own image (V2 the ``sgl-deep-ep`` image's 2.30.7, V2.5 the V2.5 image's 2.32.6,
``IMAGES``), so a test of one generation needs no setting; a test that pins it
(``EMU_NCCL.pinned(version)``) runs every generation on that one runtime, as a GPU process does,
and then V2 and V2.5 can never both build (Q1).

``FakeLibNccl`` is what the adapter's ``ctypes`` calls reach on the emulator (``pkg.emu_nccl``):
``ncclGetVersion`` and ``ncclCommQueryProperties`` writing ``ncclCommProperties_t`` at the
offsets NCCL uses on x86-64 (the head of nccl_device/core.h 2.30.7; the tail of the 2.32.3
struct DeepEP 2.5 was compiled with, read from its ``_C``: ``ginMinStride`` +64, ``ginSupport[]``
+72, 152 bytes). What it reports follows NCCL's own rules from the emulated network
(``module.emu_gin``: the GIN type NCCL finds on the fabric, GDAKI support, all-CUDA-P2P) and the
``NCCL_*`` variables of the process:

- the GIN types are filled for a caller version above 2.29.3 (dev_runtime.cc:1483), ``ginSupport``
  for a caller struct that has it (>= 2.31);
- ``NCCL_GIN_TYPE=2`` forces the proxy type (no GDAKI);
- ``deviceApiSupport`` = symmetric-memory support = all CUDA P2P and ``NCCL_WIN_ENABLE`` (default
  1) and cuMem (``NCCL_CUMEM_ENABLE``, default auto = on) and (GIN or one LSA team)
  (init.cc:1674-1675); without it ``ncclDevCommCreate`` fails ("Communicator does not support
  symmetric memory!", dev_runtime.cc:1523), for V2 and V2.5, whatever ``EP_DISABLE_GIN``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EMU_NCCL",
    "FakeLibNccl",
    "GIN_GDAKI",
    "GIN_NONE",
    "GIN_PROXY",
    "IMAGES",
    "NCCL_ROWS",
    "V25_CALLER",
    "V2_CALLER",
    "code",
    "properties",
]

GIN_NONE, GIN_PROXY, GIN_GDAKI, GIN_GPI, GIN_EFA_GDA = 0, 2, 3, 4, 5
IMAGES = {"v2": (2, 30, 7), "v25": (2, 32, 6)}
"""The NCCL runtime of each generation's image: ``docker/Dockerfile.sgl-deep-ep`` (torch's pin,
``nvidia-nccl-cu13==2.30.7``) and ``docker/Dockerfile.deepep-v25`` (2.32.6)."""
V2_CALLER = (2, 30, 7)  # the NCCL the V2 _C was compiled with (its assert's constant, 23007)
V25_CALLER = (2, 32, 3)  # NCCL_COMM_PROPERTIES_INITIALIZER of the V2.5 _C (version 23203)
_MAGIC = 0xCAFEBEEF
_SUCCESS, _INVALID_USAGE = 0, 5

# NCCL's own checks, cited at tag v2.30.7-1 of github:NVIDIA/nccl (limits: release "nccl")
NCCL_ROWS: list[tuple[str, str, str, str, dict[str, tuple[str, int]]]] = [
    (
        "nccl.caller_too_new",
        "host",
        'ncclCommQueryProperties / ncclDevCommCreate: the caller was not compiled against a newer NCCL than the runtime ("NCCL library is too old"; DeepEP\'s NCCL_CHECK raises)',
        'WARN("NCCL library is too old. This application was compiled with NCCL version %s, but is running with NCCL "',
        {"nccl": ("src/dev_runtime.cc", 1428)},
    ),
    (
        "nccl.devcomm_symmetric",
        "host",
        "ncclDevCommCreate: the communicator supports symmetric memory (deviceApiSupport: all CUDA P2P, NCCL_WIN_ENABLE, cuMem on, and GIN or one LSA team), whatever EP_DISABLE_GIN",
        'WARN("Communicator does not support symmetric memory!");',
        {"nccl": ("src/dev_runtime.cc", 1523)},
    ),
]


def code(version: tuple[int, int, int]) -> int:
    """``NCCL_VERSION_CODE`` of ``(major, minor, patch)`` (2.30.7 -> 23007)."""
    major, minor, patch = version
    return major * 10000 + minor * 100 + patch


def _env_int(name: str, default: int) -> int:
    """An ``NCCL_PARAM`` as NCCL reads it (``strtoll``; unset or empty: the default)."""
    text = os.environ.get(name, "").strip()
    try:
        return int(text, 0) if text else default
    except ValueError:
        return default


class EmuNccl:
    """The one NCCL runtime of this (emulated) process."""

    def __init__(self) -> None:
        self.version: tuple[int, int, int] | None = None

    def runtime(self, image: str) -> tuple[int, int, int]:
        """The runtime a generation of ``image`` (``"v2"``, ``"v25"``) sees: the pinned one, else
        its image's."""
        return self.version if self.version is not None else IMAGES[image]

    def set_version(self, version: tuple[int, int, int] | None) -> None:
        self.version = None if version is None else tuple(version)  # type: ignore[assignment]

    @contextlib.contextmanager
    def pinned(self, version: tuple[int, int, int]) -> Iterator[None]:
        """Within the block every generation runs on NCCL ``version``."""
        saved = self.version
        self.set_version(version)
        try:
            yield
        finally:
            self.version = saved


EMU_NCCL = EmuNccl()


def properties(
    network: dict[str, Any], *, num_ranks: int, nvl_peers: int, caller: tuple[int, int, int]
) -> dict[str, Any]:
    """What NCCL reports for a communicator of ``num_ranks`` (LSA teams of ``nvl_peers``) on the
    emulated ``network`` (``module.emu_gin``), asked by a caller compiled with ``caller``."""
    teams = max(1, -(-num_ranks // max(nvl_peers, 1)))
    gin, railed, gdaki = int(network["ginType"]), int(network["railedGinType"]), network["gdaki"]
    if _env_int("NCCL_GIN_TYPE", -1) == GIN_PROXY:  # forced proxy GIN: no GDAKI
        gin = GIN_PROXY if gin != GIN_NONE else gin
        railed = GIN_PROXY if railed != GIN_NONE else railed
        gdaki = False
    cumem = _env_int("NCCL_CUMEM_ENABLE", -2) != 0  # -2: auto-detect (VMM present here)
    win = _env_int("NCCL_WIN_ENABLE", 1) != 0
    p2p = bool(network.get("all_p2p", True))
    symmetric = p2p and win and cumem and (gin != GIN_NONE or teams == 1)
    new = code(caller) > 22903  # the GIN fields are filled for a caller > 2.29.3
    support = [0] * 64
    if gdaki and gin != GIN_NONE:
        support[GIN_GDAKI] = 1
    if gin not in (GIN_NONE, GIN_GDAKI):
        support[gin] = 1
    return {
        "nRanks": num_ranks,
        "deviceApiSupport": symmetric,
        "ginType": gin if new else 0,
        "railedGinType": railed if new else 0,
        "nLsaTeams": teams if new else 0,
        "ginSupport": support if code(caller) >= 23100 else None,
    }


class FakeLibNccl:
    """``ncclGetVersion`` and ``ncclCommQueryProperties`` of the emulated NCCL for one runtime
    module, called as ``ctypes`` calls them (``byref`` arguments)."""

    def __init__(self, module: Any, image: str) -> None:
        self.module = module
        self.image = image
        self._comms: dict[int, int] = {}  # handle -> R

    def version(self) -> tuple[int, int, int]:
        return EMU_NCCL.runtime(self.image)

    def communicator(self, num_ranks: int) -> int:
        """A handle for a communicator of ``num_ranks`` (what ``_comm_ptr()`` gives)."""
        handle = 0x5000 + len(self._comms)
        self._comms[handle] = num_ranks
        return handle

    def ncclGetVersion(self, ref: Any) -> int:
        ctypes.c_int.from_address(ctypes.addressof(ref._obj)).value = code(self.version())
        return _SUCCESS

    def query(self, num_ranks: int, caller: tuple[int, int, int]) -> dict[str, Any] | None:
        """The report for a caller compiled with ``caller``, or None where NCCL refuses it."""
        if code(caller) > code(self.version()):
            return None
        return properties(
            self.module.emu_gin,
            num_ranks=num_ranks,
            nvl_peers=self.module.NUM_MAX_NVL_PEERS,
            caller=caller,
        )

    def ncclCommQueryProperties(self, comm: Any, ref: Any) -> int:
        base = ctypes.addressof(ref._obj)
        size = ctypes.c_size_t.from_address(base).value
        magic = ctypes.c_uint.from_address(base + 8).value
        version = ctypes.c_uint.from_address(base + 12).value
        handle = comm.value if hasattr(comm, "value") else int(comm)
        if magic != _MAGIC or handle not in self._comms:
            return _INVALID_USAGE
        caller = (version // 10000, version // 100 % 100, version % 100)
        got = self.query(self._comms[handle], caller)
        if got is None:
            return _INVALID_USAGE
        ctypes.c_int.from_address(base + 20).value = got["nRanks"]
        ctypes.c_bool.from_address(base + 32).value = got["deviceApiSupport"]
        ctypes.c_int.from_address(base + 36).value = got["ginType"]
        ctypes.c_int.from_address(base + 40).value = got["nLsaTeams"]
        ctypes.c_int.from_address(base + 48).value = got["railedGinType"]
        if got["ginSupport"] is not None and size >= 136:
            for t, v in enumerate(got["ginSupport"]):
                ctypes.c_uint8.from_address(base + 72 + t).value = v
        return _SUCCESS
