"""Single-node groups listen on loopback only; results come back without unrestricted pickles."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from flexdispatch.launch import GroupError, _dumps, _loads, spawn_group
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


def _rank_sockets() -> dict:
    import torch.distributed as dist

    from flexdispatch.launch import broadcast_object, gather_objects

    dist.barrier()
    mine = _listening([os.getpid(), os.getppid()])
    dist.barrier()
    # NOTE: what demo / bench exchange under a launcher: _dumps bytes in uint8 tensors
    rank = dist.get_rank()
    sent = broadcast_object({"from": rank, "stats": DispatchStats()} if rank == 0 else None)
    gathered = gather_objects({"rank": rank, "t": torch.full((rank + 1,), rank)})
    return {
        "listening": mine,
        "stats": DispatchStats(),
        "t": torch.arange(3),
        "broadcast": sent,
        "gathered": gathered,
    }


def _rank_raises() -> None:
    raise ValueError("bad rank")


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_spawned_group_listens_on_loopback_only_and_returns_plain_results():
    results = spawn_group(_rank_sockets, 2, timeout_s=90)
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
