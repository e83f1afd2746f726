"""``tests/dist/pool.py``: a pooled group runs successive calls in the same processes, puts back
what a call changed (environment, patched module globals, seed), answers plain data only, and a
failing or late call kills the group so that the next call gets a fresh one.

R = 2 ranks; three groups are spawned in all.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from flexdispatch.launch import GroupError
from tests.dist import harness
from tests.dist.pool import GroupPool, fn_reference


def _state(tag: str) -> dict:
    import torch.distributed as dist

    from flexdispatch._checks import tensors
    from flexdispatch.backends.deepep import buffer

    before = {
        "pid": os.getpid(),
        "rank": dist.get_rank(),
        "env": os.environ.get("POOL_TEST_VAR", ""),
        "parent": os.environ.get("POOL_TEST_PARENT", ""),
        "local": (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "patched": tensors.defer_value_checks(torch.device("cpu")),
        "dtype": str(torch.get_default_dtype()),
        "rand": torch.rand(4),
        "left": os.environ.get("POOL_TEST_LEFT", ""),
        "registry": sorted(buffer._BUFFERS),
    }
    # what a careless test leaves behind
    os.environ["POOL_TEST_LEFT"] = tag
    tensors.defer_value_checks = lambda device: True
    buffer._BUFFERS[(-1, -1)] = tag  # a process-wide registry entry
    torch.set_default_dtype(torch.float64)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    before["sum"] = float(t)
    return before


def _fail_on(rank_to_fail: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"rank {rank_to_fail} fails on purpose")
    return dist.get_rank()


def _not_plain() -> object:
    return object()


def _sleep(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def _local() -> None:  # pragma: no cover - never called
    pass


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_pool_reuses_the_group_and_puts_back_what_a_call_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = GroupPool(2)
    try:
        monkeypatch.delenv("POOL_TEST_PARENT", raising=False)
        a = pool.run(_state, ("first",), env={"POOL_TEST_VAR": "x"}, ranks_per_node=1)
        monkeypatch.setenv("POOL_TEST_PARENT", "p")  # what the parent's environment is now
        b = pool.run(_state, ("second",))
        assert pool.spawns == 1 and pool.calls == 2
        for r in range(2):
            assert a[r]["pid"] == b[r]["pid"] and a[r]["rank"] == b[r]["rank"] == r
            assert a[r]["env"] == "x" and b[r]["env"] == ""  # the call's env, then gone
            assert (a[r]["parent"], b[r]["parent"]) == ("", "p")
            assert a[r]["local"] == ("0", "1") and b[r]["local"] == (str(r), "2")
            assert b[r]["left"] == ""  # a variable the first call set was removed
            assert a[r]["cuda_visible"] == b[r]["cuda_visible"] == ""
            assert not b[r]["patched"]  # the patched module global was put back
            assert a[r]["registry"] == b[r]["registry"] == []  # the registry emptied again
            assert b[r]["dtype"] == "torch.float32"
            assert a[r]["sum"] == b[r]["sum"] == 3.0
            assert not torch.equal(a[r]["rand"], b[r]["rand"])  # a fresh seed per call
        assert not torch.equal(a[0]["rand"], a[1]["rand"])
        # one rank raises: GroupError with its traceback, and the group is gone
        with pytest.raises(GroupError, match="rank 1 fails on purpose") as info:
            pool.run(_fail_on, (1,))
        assert set(info.value.errors) == {1} and not pool.alive
        assert pool.run(_fail_on, (-1,)) == [0, 1] and pool.spawns == 2
        # past the deadline: killed, GroupError, and nothing is left running
        procs = list(pool._procs)
        with pytest.raises(GroupError, match="timed out"):
            pool.run(_sleep, (60.0,), timeout_s=3.0)
        assert not pool.alive and not any(p.is_alive() for p in procs)
        # a result that is not plain data is refused (torch.load(weights_only=True))
        with pytest.raises(GroupError, match="return plain tensors"):
            pool.run(_not_plain)
        assert pool.spawns == 3 and not pool.alive
    finally:
        pool.close(kill=True)


def test_functions_go_by_reference_and_the_switches_are_read() -> None:
    assert fn_reference(_state) == ("tests.dist.test_pool", "_state")

    def inner() -> None:
        pass

    with pytest.raises(ValueError, match="module-level function"):
        fn_reference(inner)
    with pytest.raises(ValueError, match="module-level function"):
        fn_reference(lambda: None)
    assert harness.pooling() is (os.environ.get(harness.FRESH_ENV, "") != "1")


@pytest.mark.fresh_groups
def test_the_fresh_groups_marker_turns_pooling_off() -> None:
    assert not harness.pooling()
