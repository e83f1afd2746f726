"""How a rank's life is tied to its parent's, and what a failing rank may do to other processes.

- ``die_with_parent``: a spawned rank or a torchrun worker ends when the process that started it
  ends, by any signal (Linux ``prctl(PR_SET_PDEATHSIG)``; a polling thread elsewhere);
- ``die_with_agent``: the same for a torchrun worker (``torchrun_worker``), armed by the command
  line as its first statement, before anything imports torch; it also finds an agent that ended
  before the worker could arm;
- ``Reaper``: a tiny process ``spawn_group`` starts before its ranks, holding a pipe from the
  parent: when the parent ends, however, the kernel closes the pipe and the reaper SIGKILLs the
  ranks it was told about, whatever they are doing (importing torch, unpickling, stopped);
- ``end_stopped_local_peers``: a torchrun worker whose collective failed ends the stopped workers
  of its own job, so that torchrun does not wait its grace for them.

Nothing here imports torch (the command line imports this module before anything else).
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = [
    "LAUNCHER_PID_ENV",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "WORKER_ENV",
    "Agent",
    "Reaper",
    "check_timeout",
    "die_with_agent",
    "die_with_parent",
    "end_stopped_local_peers",
    "launcher_pid",
    "torchrun_worker",
]

MIN_TIMEOUT_S = 0.001
"""Shortest timeout or deadline (one millisecond: the process group counts whole milliseconds)."""

MAX_TIMEOUT_S = 2_147_483.0
"""Longest timeout or deadline, about 24.8 days: c10d's store waits on its sockets with
``poll()``, whose timeout is an ``int`` of milliseconds, so a longer one wraps (measured with
torch 2.13: 4294968 s made every wait return after about 0.7 s, retried with a warning each
time; 1e10 s failed to connect at once). ``spawn_group``'s ``timeout_s`` / ``pg_timeout_s`` and
the command line's ``--timeout`` take this one range."""


def check_timeout(name: str, value: object) -> float:
    """``value`` seconds as a float in ``[MIN_TIMEOUT_S, MAX_TIMEOUT_S]``.

    Raises:
        TypeError: not a number (a bool is not one).
        ValueError: not finite, or outside the range; naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name} must be a finite number of seconds in [{MIN_TIMEOUT_S:g}, "
            f"{MAX_TIMEOUT_S:.0f}], got {value!r}"
        )
    return float(value)


LAUNCHER_PID_ENV = "FLEXDISPATCH_LAUNCHER_PID"
"""The torchrun agent's pid, recorded by the launch recipes at spawn (``exec torchrun`` keeps the
recipe's own pid, ``$$``): what a worker's parent was before it could be re-parented."""

WORKER_ENV = (
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)
"""The variables torchrun's agent sets for every worker it starts. Anything a worker starts
inherits them, so they alone never make a process a worker (``torchrun_worker``)."""

_TORCHRUN_MODULES = (b"torch.distributed.run", b"torch.distributed.launch")


@dataclass(frozen=True)
class Agent:
    """The torchrun agent this process is a worker of: its pid and the run's id."""

    pid: int
    run_id: str


def launcher_pid() -> int | None:
    """``$FLEXDISPATCH_LAUNCHER_PID`` as a pid, or None: unset, or not 1 to 10 ASCII digits (a
    value such as ``'²'``, which ``str.isdigit`` accepts and ``int`` refuses, is ignored: it only
    ever selects what a worker does to itself)."""
    text = os.environ.get(LAUNCHER_PID_ENV, "").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 10):
        return None
    pid = int(text)
    return pid if pid > 0 else None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, start time in clock ticks)`` of ``pid`` from ``/proc``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> list[bytes] | None:
    """The argument vector of ``pid`` (``/proc/<pid>/cmdline``), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rstrip(b"\0").split(b"\0") if raw else []


def _is_torchrun(argv: list[bytes] | None) -> bool:
    """``argv`` is torchrun's: ``torchrun ...``, ``python .../torchrun ...`` or ``python -m
    torch.distributed.run`` (or ``.launch``)."""
    if not argv:
        return False
    if any(os.path.basename(a) == b"torchrun" for a in argv[:2]):
        return True
    return any(a == b"-m" and b in _TORCHRUN_MODULES for a, b in itertools.pairwise(argv))


def torchrun_worker() -> Agent | None:
    """This process's torchrun agent when this process provably is one of its workers, else None.

    A worker has every variable of ``WORKER_ENV`` and its parent is the agent: the pid the launch
    recipes record (``launcher_pid``), or a process whose command line is torchrun's. A process
    that merely inherited the variables (a shell, a notebook, a tool started by a worker) has
    another parent and is no worker: nothing here ties it to anything or lets it act on others.
    """
    if not all(os.environ.get(k) for k in WORKER_ENV):
        return None
    parent = os.getppid()
    if parent <= 1:
        return None
    if parent != launcher_pid() and not _is_torchrun(_cmdline(parent)):
        return None
    return Agent(pid=parent, run_id=os.environ["TORCHELASTIC_RUN_ID"])


def _flexdispatch_worker(argv: list[bytes] | None) -> bool:
    """``argv`` runs the flexdispatch command line: ``python -m flexdispatch.cli ...`` (what the
    recipes start) or a script named ``flexdispatch``."""
    if not argv:
        return False
    if any(a == b"-m" and b == b"flexdispatch.cli" for a, b in itertools.pairwise(argv)):
        return True
    return any(os.path.basename(a) == b"flexdispatch" for a in argv[:3])


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False  # NOTE: not ours to read (another user): never a peer


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def end_stopped_local_peers() -> list[int]:
    """A torchrun worker whose collective failed: SIGKILL the stopped workers of its job here.

    A worker stopped by SIGSTOP (or a debugger) cannot act on the SIGTERM torchrun sends when
    another worker fails, so torchrun waits its full grace (30 s, hard-coded for a failed worker
    group whatever ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says) before its SIGKILL: a hung peer would
    end the job only at ``--timeout`` + 30 s. The command line calls this only when it fails in a
    collective (``CollectiveError``), never for bad input, just before it exits.

    Acts only when this process is a worker (``torchrun_worker``), and only on processes of the
    same user that are stopped (state ``T``/``t``), children of the same agent, and either a
    flexdispatch worker of the same run (``-m flexdispatch.cli`` in their command line and the
    same ``TORCHELASTIC_RUN_ID`` in their environment) or a fork of the agent stopped before it
    could exec its worker (the agent's executable and command line). Linux only (``/proc``);
    returns the pids ended.
    """
    agent = torchrun_worker()
    if agent is None or not os.path.isdir("/proc"):
        return []
    me, uid = os.getpid(), os.getuid()
    run = f"TORCHELASTIC_RUN_ID={agent.run_id}".encode()
    agent_argv, agent_exe = _cmdline(agent.pid), _exe(agent.pid)
    ended = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        stat = _stat(pid)
        if stat is None or stat[1] != agent.pid or stat[0] not in ("T", "t"):
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        argv = _cmdline(pid)
        worker = _flexdispatch_worker(argv) and _environ_has(pid, run)
        unexeced = argv is not None and argv == agent_argv and _exe(pid) == agent_exe
        if not (worker or unexeced):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
        except OSError:
            continue  # NOTE: gone meanwhile
    return ended


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """End this process when its parent ends, by any signal (SIGKILL included).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process when the *thread*
    that started it ends (``spawn_group`` starts its ranks from the thread that waits for them,
    so that thread outlives them). The parent may have ended before the call: then this process
    has been handed to another parent already and exits at once. Elsewhere (no ``prctl``) a
    daemon thread polls ``os.getppid()`` twice a second and exits the process when it changes.
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        os._exit(1)  # NOTE: the parent is gone already: nobody waits for this rank
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    import threading

    threading.Thread(target=watch, name="flexdispatch-parent-watch", daemon=True).start()


def _gone(pid: int) -> bool:
    """``pid`` no longer runs: no such process, or a zombie its parent has not reaped yet (a
    SIGKILLed torchrun stays one until its shell waits for it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        pass  # NOTE: no /proc here: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def die_with_agent() -> None:
    """A torchrun worker: end with the agent that started it, however the agent ends.

    The command line calls this as its first statement, before anything imports torch, so that
    the window in which a worker can outlive its agent is the interpreter's own start. Only a
    worker (``torchrun_worker``: the worker variables set and the parent the agent) is tied to
    its parent; a process that merely inherited the variables is left alone.

    ``die_with_parent(os.getppid())`` alone cannot see an agent that ended before the worker
    armed its parent-death signal: by then the worker has been re-parented, and ``getppid()``
    names its new parent. The launch recipes record the agent's pid at spawn
    (``LAUNCHER_PID_ENV``): a process with the worker variables whose parent is not that process
    while that process is gone says so on stderr and exits 1. (Started by torchrun without the
    recipes the variable is unset, and only the signal ties the worker to its agent.)
    """
    if not all(os.environ.get(k) for k in WORKER_ENV):
        return
    recorded, parent = launcher_pid(), os.getppid()
    if recorded is not None and recorded != parent and _gone(recorded):
        sys.stderr.write(
            f"flexdispatch: the torchrun agent (pid {recorded}, ${LAUNCHER_PID_ENV}) ended before "
            f"this worker started: exiting\n"
        )
        sys.stderr.flush()
        os._exit(1)
    agent = torchrun_worker()
    if agent is not None:
        die_with_parent(agent.pid)


# NOTE: run as `python -S -I -c REAPER_SOURCE`: the standard library only, no site, no
# environment; a signal to the caller's process group (Ctrl-C) must not end it before the ranks
_REAPER_SOURCE = """\
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
def start(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None
ranks, done = [], False
for line in sys.stdin.buffer:
    words = line.split()
    if words == [b"done"]:
        done = True
    elif len(words) == 2 and words[0].isdigit() and words[1].isdigit():
        ranks.append((int(words[0]), int(words[1])))
if not done:
    for pid, started in ranks:
        if start(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
"""


class Reaper:
    """A small process that SIGKILLs the ranks it was told about when its owner ends, however.

    ``spawn_group`` starts one before its ranks and tells it each rank's pid as the rank starts
    (``track``). The owner holds the only write end of the reaper's input pipe: when the owner
    ends (SIGKILL included) the kernel closes it, the reaper reads end of file without the word
    ``done`` (``close``), and SIGKILLs each recorded rank whose start time still matches (never
    a pid the kernel gave to another process since), then exits. It works while a rank imports
    torch, unpickles its function, runs, hangs in C or is stopped: no code of the rank has to run.
    It ignores SIGINT / SIGTERM / SIGHUP / SIGQUIT, so a signal to the whole process group does
    not end it before its owner. Linux only (``/proc``); elsewhere it is not started and
    ``track`` / ``close`` do nothing.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        if not os.path.isdir("/proc"):
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-I", "-c", _REAPER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )

    def track(self, pid: int) -> None:
        """Kill ``pid`` (a rank just started) if this process ends before ``close``."""
        stat = _stat(pid)
        if self._proc is None or self._proc.stdin is None or stat is None:
            return
        try:
            self._proc.stdin.write(f"{pid} {stat[2]}\n".encode())
            self._proc.stdin.flush()
        except OSError:
            pass  # NOTE: the reaper is gone: the ranks' own parent-death signal remains

    def close(self) -> None:
        """The ranks are over (ended and reaped): let the reaper exit without acting."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(b"done\n")
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
