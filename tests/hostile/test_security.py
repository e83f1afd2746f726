"""Single-node groups listen on loopback only; results and the config fingerprint exchange come
back without unrestricted pickles (reliability-4 N2: the result unpickler could be led to
``subprocess.Popen`` through a module attribute; ``dist.all_gather_object`` unpickled peer bytes
when fingerprints differed)."""

from __future__ import annotations

import functools
import io
import os
import pickle
import resource
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from flexdispatch.launch import GroupError, spawn_group
from flexdispatch.launch.wire import _dumps, _loads
from flexdispatch.types import DispatchStats

pytestmark = pytest.mark.timeout(120)

_LOOPBACK4 = "0100007F"  # 127.0.0.1 in /proc/net/tcp's little-endian hex
_LOOPBACK6 = "00000000000000000000000001000000"  # ::1


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, local address hex, port) of every listening TCP socket the processes hold."""
    inodes: dict[str, int] = {}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                addr, port = cols[1].split(":")
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    found.append((inodes[cols[9]], addr, int(port, 16)))
    return found


def _fingerprint_exchange(marker: str) -> str:
    """Ranks that disagree on a field: the names and values travel as JSON only. Rank 1 sends a
    pickle that would create ``marker`` in place of its JSON; ``all_gather_object`` (which
    unpickles whatever a peer sends) must not be reached."""
    import json

    import torch.distributed as dist

    from flexdispatch.distributed import check_fingerprint

    rank = dist.get_rank()
    saved_gather, saved_dumps = dist.all_gather_object, json.dumps

    def refuse(*args, **kwargs):
        raise AssertionError("dist.all_gather_object unpickles a peer's bytes without restriction")

    dist.all_gather_object = refuse
    if rank == 1:  # NOTE: a hostile peer: its "JSON" is a protocol-0 pickle running a command
        json.dumps = lambda obj, **kw: f"cos\nsystem\n(S'touch {marker}'\ntR."
    try:
        check_fingerprint({"num_experts": 8 + rank}, what="probe configs", fix="agree")
    except ValueError as exc:
        return str(exc)
    finally:
        dist.all_gather_object, json.dumps = saved_gather, saved_dumps
    return "no error"


def _rank_sockets(marker: str) -> dict:
    import torch.distributed as dist

    from flexdispatch.launch import broadcast_object, gather_objects

    dist.barrier()
    mine = _listening([os.getpid(), os.getppid()])
    dist.barrier()
    fingerprint = _fingerprint_exchange(marker)
    # NOTE: what demo / bench exchange under a launcher: _dumps bytes in uint8 tensors
    rank = dist.get_rank()
    sent = broadcast_object({"from": rank, "stats": DispatchStats()} if rank == 0 else None)
    gathered = gather_objects({"rank": rank, "t": torch.full((rank + 1,), rank)})
    return {
        "listening": mine,
        "fingerprint": fingerprint,
        "stats": DispatchStats(),
        "t": torch.arange(3),
        "broadcast": sent,
        "gathered": gathered,
    }


def _rank_raises() -> None:
    raise ValueError("bad rank")


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_spawned_group_listens_on_loopback_only_and_returns_plain_results(tmp_path):
    marker = tmp_path / "PWNED"
    results = spawn_group(_rank_sockets, 2, args=(str(marker),), timeout_s=90)
    assert not marker.exists(), "a peer's fingerprint bytes were unpickled"
    assert results[0]["fingerprint"] == (
        "probe configs differ across ranks (agree): num_experts: rank 0=8, rank 1=<missing>; "
        "<unreadable>: rank 0=<missing>, rank 1=not a JSON mapping of strings"
    )
    assert results[1]["fingerprint"].startswith("probe configs differ across ranks (agree): ")
    listening = [s for r in results for s in r["listening"]]
    assert listening, "the ranks and their parent listen somewhere (store, gloo pairs)"
    for pid, addr, port in listening:
        assert addr in (_LOOPBACK4, _LOOPBACK6), (pid, addr, port)
    assert isinstance(results[0]["stats"], DispatchStats)
    assert torch.equal(results[1]["t"], torch.arange(3))
    for r in results:
        assert r["broadcast"] == {"from": 0, "stats": DispatchStats()}
        assert [g["rank"] for g in r["gathered"]] == [0, 1]
        assert torch.equal(r["gathered"][1]["t"], torch.tensor([1, 1]))
    with pytest.raises(GroupError, match=r"rank 0: ValueError: bad rank"):
        spawn_group(_rank_raises, 1, timeout_s=60)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_results_are_never_unrestricted_pickles():
    plain = {"a": torch.ones(2), "b": [1, 2.5, "s", None, (True,)]}
    back = _loads(_dumps(plain))
    assert torch.equal(back["a"], plain["a"]) and back["b"] == plain["b"]
    assert _loads(_dumps(DispatchStats())) == DispatchStats()
    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf)
    with pytest.raises(pickle.UnpicklingError, match=r"(posix|os)\.system"):
        _loads(buf.getvalue())
    with pytest.raises(pickle.UnpicklingError):
        _loads(pickle.dumps(_Evil()))


# --------------------------------------------------------------------------- inflating archives


def _inflating(n: int) -> bytes:
    """``torch.save`` layout whose ``data.pkl`` is a DEFLATEd protocol-2 string of ``n`` bytes:
    a few hundred kB that ``torch.load`` would inflate to ``n`` (legal for weights_only)."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    pkl = b"\x80\x02X" + struct.pack("<I", n) + b"a" * n + b"."
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as z:
        for info in zin.infolist():
            if info.filename.endswith("data.pkl"):
                z.writestr(info.filename, pkl, compress_type=zipfile.ZIP_DEFLATED)
            else:
                z.writestr(info, zin.read(info.filename))
    return out.getvalue()


def test_a_compressed_member_is_refused_before_inflating():
    # NOTE: reliability-5 S4: a 1.5 MB payload inflated to 4.3 GB before the unpickler saw it
    data = _inflating(100_000_000)
    assert len(data) < 1_000_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(pickle.UnpicklingError, match=r"compressed member .*data\.pkl"):
        _loads(data)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB


def test_a_member_larger_than_the_bytes_received_is_refused():
    data = bytearray(_dumps({"a": torch.arange(4)}))
    raw, pos = bytes(data), 0
    while (pos := raw.find(b"PK\x01\x02", pos)) >= 0:  # NOTE: each central-directory record
        name_len = struct.unpack_from("<H", raw, pos + 28)[0]
        if raw[pos + 46 : pos + 46 + name_len].endswith(b"data.pkl"):
            struct.pack_into("<I", data, pos + 24, 1 << 31)  # its uncompressed size
        pos += 4
    with pytest.raises(pickle.UnpicklingError, match=r"states 2147483648 bytes for member"):
        _loads(bytes(data))
    with zipfile.ZipFile(io.BytesIO(_dumps({"a": torch.arange(10)}))) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}


# --------------------------------------------------------------------------- hostile result bytes


def _archive(pickle_bytes: bytes) -> bytes:
    """``torch.save`` bytes whose pickle is replaced by ``pickle_bytes`` (what a hostile rank, or
    a peer under a launcher, could send back)."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as z:
        for item in zin.infolist():
            data = pickle_bytes if item.filename.endswith("data.pkl") else zin.read(item.filename)
            z.writestr(item, data)
    return out.getvalue()


def _call(module: str, name: str, *args: str, proto: int = 0) -> bytes:
    """A pickle that calls ``module.name(*args)`` (GLOBAL + REDUCE; protocol 0 or 2)."""
    head = b"\x80\x02" if proto >= 2 else b""
    strs = b"".join(b"V" + a.encode() + b"\n" for a in args)
    return head + b"c" + f"{module}\n{name}\n".encode() + b"(" + strs + b"tR."


def _payloads(marker: Path) -> dict[str, bytes]:
    touch = f"touch {marker}"
    argv_list = b"((lp0\nVtouch\np1\naV" + str(marker).encode() + b"\np2\natR."
    return {
        # the N2 reproduction: a class reached through a module attribute of flexdispatch
        "demo_machine.subprocess.Popen": b"cflexdispatch.cli.demo_machine\nsubprocess.Popen\n"
        + argv_list,
        "launch.subprocess.Popen (not imported there)": b"cflexdispatch.launch\nsubprocess.Popen\n"
        + argv_list,
        "launch.os.system": _call("flexdispatch.launch", "os.system", touch),
        "launch.torch.load": _call("flexdispatch.launch", "torch.load", str(marker)),
        "os.system": _call("os", "system", touch),
        "posix.system": _call("posix", "system", touch, proto=2),
        "subprocess.Popen": b"csubprocess\nPopen\n" + argv_list,
        "builtins.eval": _call("builtins", "eval", f"__import__('os').system('{touch}')"),
        "builtins.exec": _call("builtins", "exec", f"import os; os.system('{touch}')"),
        "builtins.getattr": _call("builtins", "getattr", "x", "y"),
        "importlib.import_module": _call("importlib", "import_module", "subprocess"),
        "functools.partial": _call("functools", "partial", "x"),
        # a class of flexdispatch that is not plain data
        "FlexDispatcher": _call("flexdispatch.dispatch.dispatcher", "FlexDispatcher", "x"),
        "GroupError": _call("flexdispatch.launch", "GroupError", "x"),
        # a class imported into a flexdispatch module from elsewhere
        "demo_machine.Path": _call("flexdispatch.cli.demo_machine", "Path", str(marker)),
        # a function of flexdispatch
        "spawn_group": _call("flexdispatch.launch", "spawn_group", "x"),
        "_dumps": _call("flexdispatch.launch", "_dumps", "x"),
        # a global named through the stack (protocol 4), which torch.save never writes
        "STACK_GLOBAL os.system": b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c"
        + bytes([len(touch)])
        + touch.encode()
        + b"\x94\x85\x94R\x94.",
    }


@pytest.mark.parametrize("name", list(_payloads(Path("/x"))))
def test_a_hostile_result_raises_and_runs_nothing(tmp_path, name):
    import flexdispatch.cli.demo_machine
    import flexdispatch.dispatch.dispatcher

    # NOTE: the modules the payloads name are imported, as in the demo's parent
    assert flexdispatch.cli.demo_machine.subprocess
    assert flexdispatch.dispatch.dispatcher.FlexDispatcher
    marker = tmp_path / "PWNED"
    data = _archive(_payloads(marker)[name])
    with pytest.raises(pickle.UnpicklingError) as info:
        _loads(data)
    assert not marker.exists()
    if name != "STACK_GLOBAL os.system":
        assert "does not unpickle" in str(info.value) or "not allowed" in str(info.value)
    if name.startswith("demo_machine.subprocess"):
        assert "subprocess.Popen" in str(info.value)  # named, as docs/security.md says


def test_only_plain_values_and_data_classes_come_back():
    from flexdispatch.cli.demo import DemoSpec
    from flexdispatch.config import RouterConfig

    spec = DemoSpec(preset="tiny_cpu", backend="torch", tokens=2, seed=0, iters=1, worst_case=False)
    value = {
        "spec": spec,
        "stats": DispatchStats(rows_sent=3),
        "router": RouterConfig(num_experts=8, topk=2),
        "t": torch.arange(3),
        "plain": [1, 2.5, "s", None, (True,), {"k": b"bytes"}],
    }
    back = _loads(_dumps(value))
    assert back["spec"] == spec and back["stats"] == DispatchStats(rows_sent=3)
    assert back["router"] == value["router"] and torch.equal(back["t"], value["t"])
    assert back["plain"] == value["plain"]
    # NOTE: as _wire / docs/security.md say: BaseModel.__setstate__ assigns, nothing re-validates
    bad = RouterConfig.model_construct(num_experts=-5, topk=2)
    assert _loads(_dumps(bad)).num_experts == -5
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Identity()), buf)
    with pytest.raises(pickle.UnpicklingError, match=r"not torch\.save bytes.*TorchScript"):
        _loads(buf.getvalue())  # NOTE: never handed to torch.jit.load


# --------------------------------------------------------------------------- what _wire trusts


def test_a_third_party_tests_package_is_not_trusted(tmp_path, monkeypatch):
    # NOTE: wheels ship top-level `tests` packages; only this repository's own is trusted
    import importlib.util
    import sys

    from flexdispatch.launch import wire
    from tests.hostile import peak_probe  # NOTE: a module of this repository's tests

    assert wire._trusted("tests.hostile.peak_probe") and wire._trusted("flexdispatch.types")
    fake = tmp_path / "tests"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "evil.py").write_text(
        "import dataclasses\n@dataclasses.dataclass\nclass Evil:\n    x: int = 0\n"
        "    def __post_init__(self):\n        raise SystemExit('ran')\n"
    )
    spec = importlib.util.spec_from_file_location(
        "tests", fake / "__init__.py", submodule_search_locations=[str(fake)]
    )
    package = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tests", package)
    evil_spec = importlib.util.spec_from_file_location("tests.evil", fake / "evil.py")
    evil = importlib.util.module_from_spec(evil_spec)
    monkeypatch.setitem(sys.modules, "tests.evil", evil)
    evil_spec.loader.exec_module(evil)
    assert wire._data_class("tests.evil", "Evil") is None
    assert not wire._trusted("tests.hostile.peak_probe")  # NOTE: another `tests` is loaded
    with pytest.raises(pickle.UnpicklingError, match=r"refers to 'tests.evil.Evil'"):
        _loads(_archive(_call("tests.evil", "Evil")))
    # an installed wheel: flexdispatch and a third-party `tests` side by side in site-packages
    site = tmp_path / "site-packages"
    (site / "flexdispatch").mkdir(parents=True)
    fake.rename(site / "tests")
    package.__path__[:] = [str(site / "tests")]
    monkeypatch.setattr(wire, "__file__", str(site / "flexdispatch" / "launch" / "wire.py"))
    assert not wire._trusted("tests.evil") and wire._data_class("tests.evil", "Evil") is None
    (site / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert not wire._trusted("tests.evil")  # NOTE: a pyproject.toml, not this project's
    assert peak_probe


_HOOKS = ("__post_init__", "__setstate__", "__new__", "__del__", "_missing_")
_PLUGINS = "flexdispatch.integrations"  # NOTE: never admitted (their configs check themselves)


def test_the_data_classes_wire_admits_define_no_hook_unpickling_calls():
    # NOTE: torch's weights_only REDUCE / BUILD call a class with the payload's values: its
    # __new__, __init__ (a dataclass's generated one only assigns), __post_init__, __setstate__,
    # an Enum's _missing_; __del__ runs later. None may be code of this project.
    import importlib
    import pkgutil

    import flexdispatch
    from flexdispatch.launch import wire
    from flexdispatch.launch.wire import _is_data_class

    # NOTE: the plug-ins import Megatron-Core / torchtitan: not imported here, and not admitted
    for name in (_PLUGINS, f"{_PLUGINS}._torchtitan", f"{_PLUGINS}._megatron", f"{_PLUGINS}.hf"):
        assert not wire._trusted(name), name
    checked, found = 0, []
    for info in pkgutil.walk_packages(flexdispatch.__path__, "flexdispatch."):
        if info.name.endswith("__main__") or info.name.startswith(_PLUGINS):
            continue
        module = importlib.import_module(info.name)
        for cls in [v for v in vars(module).values() if isinstance(v, type)]:
            if cls.__module__ != info.name or not _is_data_class(cls):
                continue
            checked += 1
            for base in cls.__mro__:
                if base.__module__.startswith("flexdispatch"):
                    found += [f"{base.__qualname__}.{h}" for h in _HOOKS if h in vars(base)]
    assert checked > 20, checked  # NOTE: the configs, results, handles, stats, enums
    assert not found, found


def _world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_peer_announcing_a_huge_or_negative_size_is_refused_before_allocating(monkeypatch):
    import json as real_json
    import types

    import torch.distributed as dist

    from flexdispatch import distributed
    from flexdispatch._checks import fits
    from flexdispatch.distributed import CollectiveError, all_gather_json
    from flexdispatch.launch import wire

    monkeypatch.setenv("FLEXDISPATCH_MEMORY_AVAILABLE", "1GiB")
    monkeypatch.setattr(fits, "_FITTED", {})
    _world_of_one()
    try:
        real = dist.all_gather
        for size, match in ((1 << 50, r"rank 0's object=\d+ bytes needs about"), (-5, "-5 bytes")):

            def lying(sizes, n, group=None, size=size):
                real(sizes, n, group=group)
                sizes[0].fill_(size)

            monkeypatch.setattr(wire.dist, "all_gather", lying)
            with pytest.raises(CollectiveError, match=match):
                wire.gather_objects({"a": 1})
            monkeypatch.setattr(wire.dist, "all_gather", real)
        real_bc = dist.broadcast

        def lying_bc(t, src, group=None):
            real_bc(t, src=src, group=group)
            t.fill_(1 << 50)

        monkeypatch.setattr(wire.dist, "broadcast", lying_bc)
        with pytest.raises(CollectiveError, match=r"broadcast_object: .* needs about"):
            wire.broadcast_object({"a": 1})
        monkeypatch.setattr(wire.dist, "broadcast", real_bc)
        monkeypatch.setattr(
            distributed,
            "all_gather_int64",
            lambda n, group, name: torch.tensor([[1 << 40]]),
        )
        with pytest.raises(CollectiveError, match=r"rank 0 announced 1099511627776 bytes of JSON"):
            all_gather_json({"a": "b"})
        monkeypatch.undo()
        # a peer's JSON nested past the parser's stack reads as unreadable, never RecursionError
        deep = "[" * 100_000 + "]" * 100_000
        fake = types.SimpleNamespace(dumps=lambda obj: deep, loads=real_json.loads)
        monkeypatch.setattr(distributed, "json", fake)
        assert all_gather_json({"a": "b"}) == [{"<unreadable>": "not a JSON mapping of strings"}]
        assert wire.gather_objects({"a": 1}) == [{"a": 1}]  # NOTE: the ordinary path still works
        for src in (1, -1, True):  # NOTE: on every rank, before any collective
            with pytest.raises(
                ValueError, match=r"broadcast_object: src must be a rank in \[0, 1\)"
            ):
                wire.broadcast_object({"a": 1}, src=src)
    finally:
        dist.destroy_process_group()


def _one_rank_refuses_the_sizes() -> list[str]:
    """Rank 1's memory figure is tiny (and no size too small to check): it refuses what its
    peer takes."""
    import torch.distributed as dist

    from flexdispatch._checks import fits
    from flexdispatch.distributed import CollectiveError
    from flexdispatch.launch import wire

    saved = fits.SMALL_BYTES, fits.available_bytes
    if dist.get_rank() == 1:
        fits.SMALL_BYTES = 0
        fits.available_bytes = lambda device, tree=False: (1, "a test's figure")
        fits._FITTED.clear()
    said = []
    from_1 = functools.partial(wire.broadcast_object, src=1)
    for exchange in (wire.gather_objects, wire.broadcast_object, from_1):
        try:
            exchange({"rank": dist.get_rank()})
            said.append("no error")
        except CollectiveError as exc:
            said.append(str(exc))
    fits.SMALL_BYTES, fits.available_bytes = saved
    assert wire.gather_objects(dist.get_rank()) == [0, 1]  # NOTE: the group is still in step
    return said


def test_a_size_one_rank_refuses_is_refused_on_every_rank():
    # NOTE: the refusal comes from each rank's own free memory: a rank that raised alone left its
    # peers waiting in the next all_gather until the timeout
    from tests.dist.harness import spawn_group

    said = spawn_group(_one_rank_refuses_the_sizes, 2, timeout_s=60, pg_timeout_s=20)
    for i, (what, src) in enumerate((("gather_objects", 0), ("broadcast_object", 0),
                                     ("broadcast_object", 1))):  # fmt: skip
        peer, refusing = said[0][i], said[1][i]
        assert refusing.startswith(f"{what}: rank {src}'s object="), refusing
        assert "a test's figure" in refusing, refusing
        assert refusing.endswith("(refused on rank 1; every rank raises)")
        assert peer.startswith(f"{what}: rank(s) 1 cannot hold the objects"), peer
