"""Processes that end with their parent, and ``spawn_group``'s arguments checked up front
(reliability-4 N20, N22).

The parent-death tests start real parents (a tiny ``spawn_group`` of one rank each, the three
signals at once, so the interpreters start in parallel) and end each with SIGTERM, SIGHUP or
SIGKILL: its rank and multiprocessing's resource tracker must be gone seconds later.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexdispatch._checks import fits, sysmem
from flexdispatch.launch import spawn_group
from tests.hostile import ROOT

pytestmark = pytest.mark.timeout(180)


def _hang(path: str) -> None:
    """A rank that says it is running, then never returns."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, path)
    while True:
        time.sleep(1)


# --------------------------------------------------------------------------- arguments (N20)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _children() -> set[int]:
    return set(_children_of(os.getpid()))


def _local():
    def work() -> int:
        return 0

    return work


BAD_ARGS = [
    ({"world_size": 2.0}, TypeError, r"world_size must be an int, got float"),
    ({"world_size": True}, TypeError, r"world_size must be an int, got bool"),
    ({"world_size": 0}, ValueError, r"world_size must be positive, got 0"),
    ({"world_size": -1}, ValueError, r"world_size must be positive, got -1"),
    ({"world_size": 10**6}, ValueError, r"world_size=1000000 needs about"),
    ({"world_size": 2**31}, ValueError, r"world_size=2147483648 needs about"),
    ({"timeout_s": 0}, ValueError, r"timeout_s must be a finite number of seconds in \[0.001, "),
    ({"timeout_s": -5}, ValueError, r"timeout_s must be .* got -5"),
    ({"timeout_s": math.inf}, ValueError, r"timeout_s must be .* got inf"),
    ({"timeout_s": math.nan}, ValueError, r"timeout_s must be .* got nan"),
    ({"timeout_s": 1e300}, ValueError, r"timeout_s must be .* got 1e\+300"),
    # NOTE: one range with the command line's --timeout (c10d's store polls with int ms)
    ({"timeout_s": 3e6}, ValueError, r"timeout_s must be .* in \[0.001, 2147483\], got 3000000"),
    ({"timeout_s": "5"}, TypeError, r"timeout_s must be a number of seconds, got str"),
    ({"pg_timeout_s": 1e-9}, ValueError, r"pg_timeout_s must be .* got 1e-09"),
    ({"backend": "mpi-bogus"}, ValueError, r"backend must be 'gloo' .* got 'mpi-bogus'"),
    ({"fn": lambda: 0}, TypeError, r"fn must be picklable .* got <lambda>: a lambda"),
    ({"fn": functools.partial(lambda x: x, 1)}, TypeError, r"fn must be picklable .*<lambda>"),
    ({"fn": _local()}, TypeError, r"got _local.<locals>.work: a function defined inside"),
    ({"fn": 3}, TypeError, r"fn must be a function, got int"),
    ({"args": [1]}, TypeError, r"args must be a tuple, got list"),
    ({"env": {"A": 1}}, TypeError, r"env must be a dict of str to str"),
    # NOTE: each rank reads it first: a rank that raised on it died "before reporting"
    ({"env": {"FLEXDISPATCH_THREADS": "abc"}}, ValueError, r"FLEXDISPATCH_THREADS='abc', which"),
    ({"env": {"FLEXDISPATCH_THREADS": "0"}}, ValueError, r"FLEXDISPATCH_THREADS='0', which is"),
    ({"ranks_per_node": 3}, ValueError, r"world_size=2 is not a multiple of ranks_per_node=3"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"), BAD_ARGS, ids=[str(k)[:40] for k, *_ in BAD_ARGS]
)
def test_spawn_group_checks_its_arguments_before_anything_exists(kwargs, error, match):
    call = {"fn": os.getpid, "world_size": 2, "timeout_s": 20.0, **kwargs}
    fn, R = call.pop("fn"), call.pop("world_size")
    fds, children = _open_fds(), _children()
    t0 = time.process_time()  # NOTE: CPU time: the work done, whatever else loads the machine
    with pytest.raises(error, match=match):
        spawn_group(fn, R, **call)
    assert time.process_time() - t0 < 2
    assert _open_fds() == fds, "no store, pipe or socket was left open"
    assert _children() == children, "no process was started"


def test_a_bad_thread_count_in_the_environment_is_named_before_spawning(monkeypatch):
    monkeypatch.setenv("FLEXDISPATCH_THREADS", "abc")
    children = _children()
    with pytest.raises(ValueError, match=r"\$FLEXDISPATCH_THREADS='abc' is not an integer"):
        spawn_group(os.getpid, 1, timeout_s=20.0)
    assert _children() == children, "no process was started"


def _set(event) -> int:
    event.set()
    return 1


def test_what_the_spawning_context_can_send_is_not_refused_up_front():
    # NOTE: a multiprocessing Event pickles only while a process is being spawned: a plain
    # pickle.dumps of partial(work, event) raised TypeError, while args=(event,) worked
    from flexdispatch.launch.spawn import _check_spawn_args

    event = mp.get_context("spawn").Event()
    for fn in (functools.partial(_set, event), functools.partial(functools.partial(_set), event)):
        _check_spawn_args(fn, 2, (), None, 20.0, None, "gloo", None)


def test_spawn_group_counts_each_rank_runtime(monkeypatch):
    monkeypatch.setenv(sysmem.AVAILABLE_ENV, "2GiB")
    monkeypatch.setattr(fits, "_FITTED", {})
    with pytest.raises(ValueError, match=r"spawn_group: world_size=16 needs about 2.5 GiB .*"):
        spawn_group(os.getpid, 16, timeout_s=20)


# --------------------------------------------------------------------------- parent death (N22)


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # NOTE: a zombie has ended (reaped by init later)


_PARENT = (
    "import sys\n"
    "from flexdispatch.launch import spawn_group\n"
    "from tests.hostile.test_processes import _hang\n"
    "spawn_group(_hang, 1, args=(sys.argv[1],), timeout_s=150)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_and_the_resource_tracker_end_with_their_parent(tmp_path):
    signals = (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parents: dict[signal.Signals, tuple[subprocess.Popen, Path]] = {}
    family: dict[signal.Signals, list[int]] = {}
    for sig in signals:
        path = tmp_path / f"{sig.name}.pid"
        parents[sig] = (
            subprocess.Popen(
                [sys.executable, "-c", _PARENT, str(path)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # NOTE: the signal goes to the parent alone
            ),
            path,
        )
    try:
        deadline = time.monotonic() + 120
        for sig, (proc, path) in parents.items():
            while not path.exists():
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, f"{sig.name}: the rank never started"
                time.sleep(0.1)
        for sig, (proc, path) in parents.items():
            rank = int(Path(path).read_text())
            kids = _children_of(proc.pid)
            assert rank in kids, (rank, kids)
            # NOTE: the rank, the resource tracker and spawn_group's reaper (lifetime.Reaper)
            assert len(kids) == 3, f"the rank, the resource tracker and the reaper, got {kids}"
            family[sig] = kids
            os.kill(proc.pid, sig)
        for sig, (proc, _) in parents.items():
            assert proc.wait(timeout=30) == -sig
        time.sleep(0.5)
        deadline = time.monotonic() + 10
        left = {sig: [p for p in kids if _alive(p)] for sig, kids in family.items()}
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            left = {sig: [p for p in kids if _alive(p)] for sig, kids in family.items()}
        assert not any(left.values()), f"still running after their parent ended: {left}"
    finally:
        for proc, _ in parents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in [p for kids in family.values() for p in kids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
