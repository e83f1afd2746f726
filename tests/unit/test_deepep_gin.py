"""NCCL's GIN report as selection asks it (``backends.deepep.gin``), on a stand-in ``libnccl``.

The stand-in writes ``ncclCommProperties_t`` as NCCL does: the head at its C offsets
(nccl_device/core.h, NCCL 2.29.4-2.30.7: ``ginType`` at byte 36, ``railedGinType`` at 48), and,
like a newer NCCL, its own longer struct after it (here bytes DeepEP 2.5 reads and the adapter must
not: ``ginSupport[]`` and the other fields of NCCL >= 2.32, whose offsets are not verified).
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


def test_only_the_gin_types_are_read_and_later_fields_never_refuse(monkeypatch) -> None:
    """NONE in ginType refuses direct mode, not hybrid mode (railedGinType); a newer NCCL's
    fields after the head (zeros: no GDAKI in ginSupport[] where the old guess read it) are not
    read, so V2.5 is not refused on them (DeepEP's own GDAKI assert decides)."""
    lib = FakeNccl(23203, gin_type=0, railed=3, tail=bytes(1024))
    props, how = _ask(monkeypatch, lib, ONE)
    assert props == {"version": 23203, "ginType": 0, "railedGinType": 3}, props
    assert "libnccl.so.2.32.3" in how and lib.asked == [(0x1234, 23203)]
    ok, why = gin.gin_rule(props, hybrid=False, generation="v25")
    assert not ok and "ginType = NONE" in why and "EP_DISABLE_GIN=1" in why, why
    assert gin.gin_rule(props, hybrid=True, generation="v25")[0]
    lib = FakeNccl(23203, gin_type=3, railed=3, tail=bytes(1024))
    props, _ = _ask(monkeypatch, lib, ONE)
    assert gin.gin_rule(props, hybrid=False, generation="v25") == (True, "NCCL GIN GDAKI")
    got = gin.gin_support(None, _Group(), hybrid=False, generation="v25", num_ranks=8, env={})
    assert got == (True, "NCCL GIN GDAKI"), got


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
