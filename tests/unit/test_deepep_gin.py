"""NCCL's report as selection asks it (``backends.deepep.gin``), on stand-in ``libnccl``s.

The stand-ins write ``ncclCommProperties_t`` as NCCL does: the head at its C offsets
(nccl_device/core.h, NCCL 2.29.4-2.30.7: ``deviceApiSupport`` at byte 32, ``ginType`` at 36,
``nLsaTeams`` at 40, ``railedGinType`` at 48) and, for a caller whose struct has it (>= 2.31), the
tail DeepEP 2.5's ``_C`` reads (``ginMinStride`` +64, ``ginSupport[]`` +72: GDAKI at +75; 152
bytes for NCCL 2.32.3, the objdump of its Context constructor). Issue 44 (Q2, Q9): GIN support
is DeepEP 2.5's whole precondition set — a GIN type, GDAKI support, NCCL's device API (symmetric
memory, which V2 needs too, also with EP_DISABLE_GIN) — and EP_DISABLE_GIN across nodes is
refused.
"""

from __future__ import annotations

import ctypes
import io
import types
from typing import Any

import pytest
import torch

from flexdispatch.backends.deepep import gin

_GIN_TYPE, _RAILED_GIN_TYPE, _HEAD = 36, 48, 52  # offsets in NCCL's struct (x86-64)
_MAGIC = 0xCAFEBEEF


class FakeNccl:
    """``ncclGetVersion`` / ``ncclCommQueryProperties`` of one communicator (``0x1234``)."""

    def __init__(self, version: int, gin_type: int, railed: int, tail: bytes = b"") -> None:
        self.version, self.gin_type, self.railed, self.tail = version, gin_type, railed, tail
        self.asked: list[tuple[int, int]] = []

    def ncclGetVersion(self, ref: Any) -> int:
        ref._obj.value = self.version
        return 0

    def ncclCommQueryProperties(self, comm: Any, ref: Any) -> int:
        props = ref._obj
        base = ctypes.addressof(props)
        size = ctypes.c_size_t.from_address(base).value
        magic = ctypes.c_uint.from_address(base + 8).value
        version = ctypes.c_uint.from_address(base + 12).value
        self.asked.append((comm.value, version))
        if magic != _MAGIC or comm.value != 0x1234 or size < _HEAD + len(self.tail):
            return 5  # ncclInvalidUsage
        ctypes.c_int.from_address(base + _GIN_TYPE).value = self.gin_type
        if version > 22903:  # NOTE: NCCL fills the GIN types for a caller version > 2.29.3
            ctypes.c_int.from_address(base + _RAILED_GIN_TYPE).value = self.railed
        ctypes.memmove(base + _HEAD, self.tail, len(self.tail))
        return 0


class _Group:
    def _get_backend(self, device: torch.device) -> Any:
        return types.SimpleNamespace(_comm_ptr=lambda: 0x1234)


def _ask(monkeypatch: pytest.MonkeyPatch, lib: FakeNccl, maps: str) -> Any:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gin.ctypes, "CDLL", lambda path: lib)
    monkeypatch.setattr(gin, "open", lambda *a, **k: io.StringIO(maps), raising=False)
    return gin.nccl_properties(_Group())


ONE = "7f00-7f01 r-xp 0 0:1 2 /usr/lib/libnccl.so.2.32.3\n7f02-7f03 r--p 0 0:1 2 /usr/lib/libc.so\n"
TWO = ONE + "7f04-7f05 r-xp 0 0:1 3 /opt/venv/nvidia/nccl/lib/libnccl.so.2\n"


NONE, PROXY, GDAKI, EFA_GDA = 0, 2, 3, 5
_OFF = {"deviceApiSupport": 32, "ginType": 36, "nLsaTeams": 40, "railedGinType": 48}
_GIN_SUPPORT, _SIZE_2_32 = 72, 152


class FakeNccl232:
    """``ncclGetVersion`` / ``ncclCommQueryProperties`` of NCCL 2.32.6 for one communicator."""

    def __init__(
        self,
        *,
        gin_type: int,
        railed: int,
        support: tuple[int, ...],
        device_api: bool,
        teams: int = 1,
        version: int = 23206,
    ) -> None:
        self.version, self.gin_type, self.railed = version, gin_type, railed
        self.support, self.device_api, self.teams = support, device_api, teams
        self.asked: list[tuple[int, int]] = []  # (caller version, caller size)

    def ncclGetVersion(self, ref: Any) -> int:
        ref._obj.value = self.version
        return 0

    def ncclCommQueryProperties(self, comm: Any, ref: Any) -> int:
        base = ctypes.addressof(ref._obj)
        size = ctypes.c_size_t.from_address(base).value
        magic = ctypes.c_uint.from_address(base + 8).value
        version = ctypes.c_uint.from_address(base + 12).value
        self.asked.append((version, size))
        if magic != _MAGIC or comm.value != 0x1234 or version > self.version:
            return 5  # ncclInvalidUsage ("NCCL library is too old": dev_runtime.cc:1428)
        ctypes.c_bool.from_address(base + _OFF["deviceApiSupport"]).value = self.device_api
        ctypes.c_int.from_address(base + _OFF["ginType"]).value = self.gin_type
        ctypes.c_int.from_address(base + _OFF["nLsaTeams"]).value = self.teams
        ctypes.c_int.from_address(base + _OFF["railedGinType"]).value = self.railed
        if version >= 23100 and size >= _GIN_SUPPORT + 64:  # the tail of a >= 2.31 struct
            for t in range(64):
                ctypes.c_uint8.from_address(base + _GIN_SUPPORT + t).value = int(t in self.support)
        return 0


def _support(
    monkeypatch: pytest.MonkeyPatch,
    lib: FakeNccl232,
    *,
    generation: str,
    hybrid: bool = False,
    env: dict[str, str] | None = None,
    nodes: int = 1,
) -> tuple[bool, str]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gin.ctypes, "CDLL", lambda path: lib)
    monkeypatch.setattr(gin, "open", lambda *a, **k: io.StringIO(ONE), raising=False)
    return gin.gin_support(
        None,
        _Group(),
        hybrid=hybrid,
        generation=generation,
        num_ranks=8,
        nodes=nodes,
        env=env or {},
    )


def test_the_whole_report_is_read_as_deepep_asks_it(monkeypatch) -> None:
    """Asked as DeepEP 2.5 asks (its caller version 23203 and its 152-byte struct; V2: 23007 and
    the 56-byte head), the tail read at the offsets the V2.5 ``_C`` reads: NONE in ginType refuses
    direct mode, not hybrid mode (railedGinType)."""
    lib = FakeNccl232(gin_type=NONE, railed=GDAKI, support=(GDAKI,), device_api=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gin.ctypes, "CDLL", lambda path: lib)
    monkeypatch.setattr(gin, "open", lambda *a, **k: io.StringIO(ONE), raising=False)
    props, how = gin.nccl_properties(_Group())
    assert props == {
        "version": 23206,
        "ginType": NONE,
        "railedGinType": GDAKI,
        "deviceApiSupport": True,
        "nLsaTeams": 1,
        "gdaki": True,
    }, props
    assert "libnccl.so.2.32.3" in how and lib.asked == [(23203, _SIZE_2_32)], lib.asked
    ok, why = gin.gin_rule(props, hybrid=False, generation="v25")
    assert not ok and "ginType = NONE" in why and "EP_DISABLE_GIN=1" in why, why
    assert gin.gin_rule(props, hybrid=True, generation="v25") == (True, "NCCL GIN GDAKI")
    v2, _ = gin.nccl_properties(_Group(), "v2")
    assert lib.asked[-1] == (23007, 56) and v2 is not None and v2["gdaki"] is None, lib.asked


def test_proxy_gin_passes_v2_and_is_refused_for_v25(monkeypatch) -> None:
    """``ginType = PROXY`` (a non-mlx5 NIC, no GPUDirect RDMA for GDAKI, NCCL_GIN_TYPE=2): V2
    asserts only the type; V2.5 asserts GDAKI support (context.cpp:129-131) and is refused."""
    lib = FakeNccl232(gin_type=PROXY, railed=PROXY, support=(PROXY,), device_api=True)
    ok, why = _support(monkeypatch, lib, generation="v25")
    assert not ok and "GDAKI" in why and "PROXY" in why, why
    assert _support(monkeypatch, lib, generation="v2")[0]


def test_efa_gda_is_refused_for_v25(monkeypatch) -> None:
    """EFA reports ``EFA_GDA`` (5); DeepEP 2.5's kernels are built for GDAKI only."""
    lib = FakeNccl232(gin_type=EFA_GDA, railed=EFA_GDA, support=(EFA_GDA,), device_api=True)
    ok, why = _support(monkeypatch, lib, generation="v25", hybrid=True)
    assert not ok and "GDAKI" in why and "EFA_GDA" in why, why


def test_no_symmetric_memory_refuses_v2_and_v25_also_with_disable_gin(monkeypatch) -> None:
    """GDAKI reported but ``deviceApiSupport`` false (NCCL_CUMEM_ENABLE=0, NCCL_WIN_ENABLE=0, not
    all-P2P): NCCL's ``ncclDevCommCreate`` refuses both generations' device communicator
    (dev_runtime.cc:1521-1524), whatever EP_DISABLE_GIN (it skips DeepEP's GIN asserts only)."""
    lib = FakeNccl232(gin_type=GDAKI, railed=GDAKI, support=(PROXY, GDAKI), device_api=False)
    for generation in ("v25", "v2"):
        for env in ({}, {"EP_DISABLE_GIN": "1"}):
            ok, why = _support(monkeypatch, lib, generation=generation, env=env)
            assert not ok and "symmetric memory" in why, (generation, env, why)
            assert "NCCL_CUMEM_ENABLE" in why, why


def test_the_whole_set_holds(monkeypatch) -> None:
    """GDAKI type, GDAKI support and the device API: V2.5 and V2 both pass."""
    lib = FakeNccl232(gin_type=GDAKI, railed=GDAKI, support=(PROXY, GDAKI), device_api=True)
    assert _support(monkeypatch, lib, generation="v25", hybrid=True) == (True, "NCCL GIN GDAKI")
    assert _support(monkeypatch, lib, generation="v2")[0]


@pytest.mark.parametrize("value", ["1", " 2abc"])
def test_disable_gin_across_nodes_is_refused(monkeypatch, value: str) -> None:
    """Q9: with EP_DISABLE_GIN DeepEP builds its device communicator without GIN contexts
    (context.cpp:124-155, nccl.cu:86-99) and nothing guards a group that spans nodes: refused,
    for V2.5 and V2, where the group has more than one RDMA rank (the caller's physical domain,
    or NCCL's ``nLsaTeams``), naming EP_DISABLE_GIN; one node is DeepEP's own recipe."""
    env = {"EP_DISABLE_GIN": value}
    lib = FakeNccl232(gin_type=GDAKI, railed=GDAKI, support=(GDAKI,), device_api=True, teams=2)
    for generation in ("v25", "v2"):
        ok, why = _support(monkeypatch, lib, generation=generation, hybrid=True, env=env)
        assert not ok and "EP_DISABLE_GIN" in why, why
    one = FakeNccl232(gin_type=NONE, railed=NONE, support=(), device_api=True)
    ok, why = _support(monkeypatch, one, generation="v25", env=env, nodes=2)
    assert not ok and "across 2 nodes" in why, why
    assert _support(monkeypatch, one, generation="v25", env=env)[0]


def test_unknown_answers_never_refuse(monkeypatch) -> None:
    """Two libnccl mapped (which one owns torch's communicator is not known), an NCCL too old to
    report, a failed query: "not checked", which does not refuse."""
    lib = FakeNccl(23203, gin_type=0, railed=0)
    props, how = _ask(monkeypatch, lib, TWO)
    assert props is None and "2 libnccl" in how and lib.asked == [], how
    ok, why = gin.gin_support(None, _Group(), hybrid=False, generation="v25", num_ranks=8, env={})
    assert ok and "not checked" in why and "2 libnccl" in why, why
    for old, want in ((22903, "does not report"), (23203, "returned 5")):
        lib = FakeNccl(old, gin_type=0, railed=0, tail=bytes(8192))  # 8 KiB: more than the room
        props, how = _ask(monkeypatch, lib, ONE)
        assert props is None and want in how, how
    props, how = _ask(monkeypatch, FakeNccl(23203, 0, 0), "7f00-7f01 r--p 0 0:1 2 /lib/libc.so\n")
    assert props is None and "no libnccl" in how


@pytest.mark.parametrize(
    ("text", "disabled"),
    [
        ("1", True),
        ("2abc", True),
        ("1.5", True),
        (" \t1", True),
        ("-1", True),
        ("+3", True),
        ("0", False),
        ("0x1", False),
        ("abc", False),
        ("", False),
        ("4294967296", False),
        ("4294967297", True),
    ],
)
def test_ep_disable_gin_reads_as_deepeps_sscanf(text: str, disabled: bool) -> None:
    """DeepEP's ``get_env<int>`` is ``sscanf("%d")``: the leading integer, into an int."""
    assert gin.gin_disabled({"EP_DISABLE_GIN": text}) is disabled
    assert gin.gin_disabled({}) is False
