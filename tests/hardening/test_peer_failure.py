"""Peer failure: a rank that raises, exits, is killed or hangs never leaves the others hanging.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k.

Each case spawns a fresh gloo group of R = 3 ranks with a short process-group timeout
(``PG_TIMEOUT`` seconds). Rank 1 fails at a chosen point — while building the dispatcher, inside
dispatch after the count exchange (right before the rows move), inside combine, or right before
backward — in a chosen way: it raises, calls ``os._exit``, sends itself SIGKILL, or stops taking
part without leaving (sleeps past the timeout). Every surviving rank must raise
``flexdispatch.distributed.CollectiveError`` naming the collective and this rank within
``PG_TIMEOUT + MARGIN`` seconds, and the harness must come back well before its own deadline.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.dist.reference import make_inputs
from tests.hardening import spawn_recorded

R, K, H, E_PER_RANK = 3, 2, 4, 2
FAILING = 1
PG_TIMEOUT = 10.0
MARGIN = 7.0
HARNESS_DEADLINE = 90.0


def _fail(how: str) -> None:
    """Make this rank fail the way ``how`` says."""
    if how == "raise":
        raise RuntimeError("injected failure on rank 1")
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        # NOTE: alive, the group not destroyed, but never reaching the collective.
        time.sleep(PG_TIMEOUT + 2.5)
        raise RuntimeError("injected hang on rank 1 is over")
    raise AssertionError(f"unknown failure {how!r}")


def _arm(dispatcher: Any, how: str) -> None:
    """Fail the next time the backend moves rows (after the count exchange of a dispatch)."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        _fail(how)

    dispatcher.backend.all_to_all = broken


def failure_worker(rank: int, world: int, how: str, where: str) -> str:
    from flexdispatch import DispatchConfig, FlexDispatcher

    failing = rank == FAILING
    if failing and where == "construct":
        _fail(how)
    E = E_PER_RANK * world
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    inp = make_inputs(7, rank, R=world, E=E, k=K, H=H, exact=False)
    x = inp.x.clone().requires_grad_(True)
    if failing and where == "dispatch":
        _arm(d, how)
    res = d.dispatch(x, inp.idx, inp.probs)
    if failing and where == "combine":
        _arm(d, how)
    out = d.combine(res.recv_x * 2.0, res.handle)
    if failing and where == "backward":
        _fail(how)
    out.sum().backward()
    return "finished"


# (how rank 1 fails, where, the collective the survivors must name)
CASES = [
    ("exit", "construct", "all_gather (config fingerprint)"),
    ("raise", "dispatch", "all_to_all_single (rows)"),
    ("exit", "dispatch", "all_to_all_single (rows)"),
    ("kill", "combine", "all_to_all_single (rows)"),
    ("kill", "backward", "all_to_all_single (rows)"),
    ("hang", "dispatch", "all_to_all_single (rows)"),
]


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "where", "collective"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_survivors_fail_fast_with_a_clear_error(
    tmp_path: Path, how: str, where: str, collective: str
) -> None:
    records, error, wall = spawn_recorded(
        failure_worker, R, tmp_path, how, where, pg_timeout=PG_TIMEOUT, timeout=HARNESS_DEADLINE
    )
    assert error is not None, "the group should have failed"
    assert wall < HARNESS_DEADLINE - 20, f"harness took {wall:.1f} s"
    # the failing rank: its own error (raise/hang) or its exit code (exit/kill)
    if how in ("exit", "kill"):
        code = 3 if how == "exit" else -signal.SIGKILL
        assert f"exited with code {code}" in error.errors[FAILING]
        assert FAILING not in records
    elif how == "hang" and FAILING not in records:
        # NOTE: spawn_group ends the other ranks FAIL_GRACE_S after the first failure (reliability-5
        # S2): the survivors' timeouts come first, so the hung rank may be ended before it raises
        assert "ended by the parent after rank" in error.errors[FAILING], error.errors
    else:
        assert records[FAILING]["type"] == "RuntimeError"
        assert "injected" in records[FAILING]["message"]
    for rank in range(R):
        if rank == FAILING:
            continue
        rec = records.get(rank)
        assert rec is not None, f"rank {rank} left no record: {error.errors.get(rank)}"
        assert not rec["ok"], f"rank {rank} finished although rank {FAILING} failed"
        assert rec["type"] == "CollectiveError", (rank, rec)
        msg = rec["message"]
        assert msg.startswith(f"flexdispatch: collective {collective} failed on rank {rank} of 3")
        assert f"within {PG_TIMEOUT:g} s" in msg, msg
        assert rec["elapsed"] <= PG_TIMEOUT + MARGIN, (rank, rec["elapsed"])
        if how == "hang":
            # the peer stayed connected: only the process-group timeout can end the wait
            assert rec["elapsed"] >= PG_TIMEOUT - 1.0, (rank, rec["elapsed"])
        assert "CollectiveError" in error.errors[rank]
    if how == "hang":
        # the first survivor to time out leaves; the others may see that instead of their own
        # timeout, but at least one reports gloo's timeout itself
        assert any("Timed out" in rec["message"] for r, rec in records.items() if r != FAILING)


def test_collective_error_is_a_runtime_error_and_chains_the_cause() -> None:
    from flexdispatch.distributed import CollectiveError, collective_guard

    assert issubclass(CollectiveError, RuntimeError)
    # without torch.distributed there is no peer to blame: the original error passes unchanged
    with pytest.raises(RuntimeError, match=r"^plain$") as info, collective_guard("x (test)"):
        raise RuntimeError("plain")
    assert type(info.value) is RuntimeError
    with pytest.raises(ValueError, match="not a collective error"), collective_guard("x (test)"):
        raise ValueError("not a collective error")
