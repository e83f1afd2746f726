"""How a rank's life is tied to its parent's: ``die_with_parent`` (a spawned rank, a torchrun
worker ends when the process that started it ends, by any signal), ``die_with_agent`` (the same
for a torchrun worker, which also finds its agent gone before it could arm) and
``end_stopped_local_peers`` (a failing torchrun worker ends its job's stopped workers, so that
torchrun does not wait its grace for them). Linux ``prctl`` / ``/proc``; a polling thread
elsewhere.
"""

from __future__ import annotations

import math
import os
import sys
import time

__all__ = [
    "LAUNCHER_PID_ENV",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "check_timeout",
    "die_with_agent",
    "die_with_parent",
    "end_stopped_local_peers",
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


def end_stopped_local_peers() -> list[int]:
    """Under torchrun: SIGKILL the other workers of this job on this machine that are stopped.

    A worker stopped by SIGSTOP (or a debugger) cannot act on the SIGTERM torchrun sends when
    another worker fails, so torchrun waits its full grace (30 s, whatever
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says for a failed worker group) before its SIGKILL: a hung
    peer would end the job only at twice ``--timeout``. The command line calls this when it fails
    under a launcher (a peer that hung makes this rank's collective time out), just before it
    exits: the job is over either way.

    Only processes with the same parent (the torchrun agent) and the same
    ``TORCHELASTIC_RUN_ID`` in their environment, in state ``T``/``t``, are ended. Linux only
    (``/proc``); returns the pids ended.
    """
    import signal

    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or not os.path.isdir("/proc"):
        return []
    me, parent = os.getpid(), os.getppid()
    ended = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if int(ppid) != parent or state not in ("T", "t"):
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            if f"TORCHELASTIC_RUN_ID={run_id}".encode() not in environ:
                continue
            os.kill(int(entry), signal.SIGKILL)
            ended.append(int(entry))
        except (OSError, ValueError):
            continue  # NOTE: gone meanwhile, or not ours to read
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
    import signal

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

    ``die_with_parent(os.getppid())`` alone cannot see an agent that ended before the worker
    armed its parent-death signal: by then the worker has been re-parented, and ``getppid()``
    names its new parent. The launch recipes record the agent's pid at spawn
    (``LAUNCHER_PID_ENV``): a worker whose parent is not that process while that process is
    gone says so on stderr and exits 1. (Started by torchrun without the recipes the variable is
    unset, and only the signal, armed from here on, ties the worker to its parent; a parent that
    is not the recorded pid but that still runs, a wrapper between them, is the one watched.)
    """
    parent = os.getppid()
    text = os.environ.get(LAUNCHER_PID_ENV, "").strip()
    agent = int(text) if text.isdigit() else None
    if agent is not None and agent != parent and _gone(agent):
        sys.stderr.write(
            f"flexdispatch: the torchrun agent (pid {agent}, ${LAUNCHER_PID_ENV}) ended before "
            f"this worker started: exiting\n"
        )
        sys.stderr.flush()
        os._exit(1)
    die_with_parent(parent)
