"""Nothing dropped silently: expert ids outside ``[-1, E)`` and NaN/inf inputs of ``dispatch``.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · k top-k.

Three paths (``flexdispatch.dispatch.values.screen_dispatch_values``):

- checks on (any device): ``dispatch`` raises at once, before any collective;
- checks off, torch backend (any device, issue 46): no value is checked; the backend sends bad ids
  nowhere and counts them from the counts it computes anyway, and ``check_overflow()`` raises
  naming them (a NaN is moved like any value, not looked at);
- checks off, a backend that does not count bad ids (DeepEP, whose kernels must not see them):
  raised at once on CPU; on CUDA the bad values are counted on the device (no sync) into
  ``stats.pending_bad_values`` and ``check_overflow()`` raises naming them. Driven here through
  the torch backend with its ``counts_bad_ids`` switched off (``_screened``) and
  ``defer_value_checks`` forced (the ``deferred_value_checks`` fixture in tests/conftest.py; inside
  spawned ranks, by setting the module attribute).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexdispatch import DispatchConfig, FlexDispatcher
from flexdispatch._checks import tensors
from flexdispatch.dispatch import values as bad_values
from tests.dist.harness import run_group
from tests.dist.reference import Inputs, all_inputs, ref_dispatch

E, K, H = 8, 2, 4


def _inputs(T: int = 6, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inp = all_inputs(seed, R=1, E=E, k=K, H=H)[0]
    return inp.x[:T].clone(), inp.idx[:T].clone(), inp.probs[:T].clone()


def _disp(**kw: Any) -> FlexDispatcher:
    return FlexDispatcher(DispatchConfig(backend="torch", **kw), num_experts=E)


def _screened(d: FlexDispatcher) -> FlexDispatcher:
    """``d`` with the dispatcher's screen of a backend that counts no bad ids (DeepEP's path)."""
    d.backend.counts_bad_ids = False  # type: ignore[misc]
    return d


def test_defer_value_checks_follows_the_device() -> None:
    assert tensors.defer_value_checks(torch.device("cuda")) is True
    assert tensors.defer_value_checks(torch.device("cuda", 1)) is True
    assert tensors.defer_value_checks(torch.device("cpu")) is False


# --------------------------------------------------------------------------- checks on: raise now


def test_bad_ids_raise_in_dispatch_with_checks_on() -> None:
    x, idx, p = _inputs()
    idx[0, 0], idx[2, 1], idx[4, 0] = 2 * E, -3, 2 * E  # e.g. a router built for 2E experts
    d = _disp(checks=True)
    assert d.config.checks is True
    with pytest.raises(ValueError) as info:
        d.dispatch(x, idx, p)
    msg = str(info.value)
    assert "topk_idx holds 3 id(s) outside [-1, 8)" in msg
    assert "distinct bad ids [-3, 16]" in msg
    assert "built for num_experts=8" in msg and "same expert count" in msg
    assert d.stats.dispatch_calls == 0 and d.stats.pending_bad_values is None


@pytest.mark.parametrize("what", ["x", "topk_probs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_inputs_raise_in_dispatch_with_checks_on(what: str, value: float) -> None:
    x, idx, p = _inputs()
    (x if what == "x" else p)[1, 0] = value
    (x if what == "x" else p)[3, 1] = value
    with pytest.raises(ValueError, match=rf"^{what} holds 2 NaN/inf value\(s\): check"):
        _disp(checks=True).dispatch(x, idx, p)


# --------------------------------------------------------------------------- checks off: counted


def test_checks_off_bad_ids_are_counted_and_raised_at_the_safe_point(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """CPU, nothing forced: no value check in ``dispatch`` (no scalar read); the bad ids go
    nowhere, their count is folded at ``check_overflow``; a NaN is not looked at."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def no_check(*args: Any) -> None:
        raise AssertionError("a value check ran with checks off")

    monkeypatch.setattr(bad_values, "check_dispatch_values", no_check)
    x, idx, p = _inputs()
    clean_idx = idx.clone()
    idx[0, 0], idx[4, 1] = 2 * E, -7
    x[2, 0] = float("nan")
    reads: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.__name__.startswith("_local_scalar_dense"):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    for W in (0, 16):
        d = _disp(num_worst_tokens=W)
        with Reads():
            res = d.dispatch(x, idx, p)
        assert reads == [], reads
        cleaned = torch.where((idx >= 0) & (idx < E), idx, -1)
        ref = ref_dispatch([Inputs(x=x, idx=cleaned, probs=p.masked_fill(cleaned < 0, 0))], 0, E)
        M = ref.x.shape[0]
        assert torch.equal(res.recv_topk_idx[:M], ref.idx) and not torch.equal(cleaned, clean_idx)
        assert torch.equal(res.recv_x[:M].nan_to_num(), ref.x.nan_to_num())
        with pytest.raises(ValueError) as info:
            d.check_overflow()
        msg = str(info.value)
        assert "topk_idx held 2 id(s) outside [-1, 8) (lowest -7, highest 16)" in msg, msg
        assert "NaN" not in msg and "nonfinite_x" not in d.stats.extra
        assert d.stats.extra["invalid_expert_ids"] == 2


def test_cpu_valid_inputs_unchanged() -> None:
    inp = all_inputs(3, R=1, E=E, k=K, H=H)
    ref = ref_dispatch(inp, 0, E)
    d = _disp()
    res = d.dispatch(inp[0].x, inp[0].idx, inp[0].probs)
    assert torch.equal(res.recv_x, ref.x) and torch.equal(res.recv_topk_idx, ref.idx)
    d.check_overflow()
    d.check_overflow()
    assert d.stats.pending_bad_values is None
    assert set(d.stats.as_dict()) == set(type(d.stats)().as_dict())  # no new counters


def test_minus_one_is_not_a_bad_id() -> None:
    x, idx, p = _inputs()
    idx[0] = -1
    p[0] = 0.0
    _disp().dispatch(x, idx, p)


# --------------------------------------------------------------------------- CUDA path, forced


def test_deferred_path_counts_and_the_safe_point_raises(deferred_value_checks: None) -> None:
    x, idx, p = _inputs()
    clean_idx = idx.clone()
    idx[0, 0], idx[4, 1] = 2 * E, -7
    d = _disp()
    res = d.dispatch(x, idx, p)  # no raise: the CUDA path may not sync
    assert d.stats.host_syncs == 1  # the dropless dispatch's own sync, nothing for the check
    pending = d.stats.pending_bad_values
    assert pending is not None and pending.dtype == torch.int64 and pending.device == x.device
    # the bad ids were treated as -1: the result is that of the cleaned routing
    cleaned = torch.where((idx >= 0) & (idx < E), idx, -1)
    pc = p.masked_fill(cleaned < 0, 0.0)
    ref = ref_dispatch([Inputs(x=x, idx=cleaned, probs=pc)], 0, E)
    assert torch.equal(res.recv_x, ref.x) and torch.equal(res.recv_topk_idx, ref.idx)
    assert not torch.equal(cleaned, clean_idx)
    with pytest.raises(ValueError) as info:
        d.check_overflow()
    msg = str(info.value)
    assert "topk_idx held 2 id(s) outside [-1, 8) (lowest -7, highest 16)" in msg
    assert "built for num_experts=8" in msg and "same expert count" in msg
    assert d.stats.pending_bad_values is None
    assert d.stats.extra["invalid_expert_ids"] == 2
    assert "nonfinite_x" not in d.stats.extra
    # cumulative since construction: later dispatches add, and every check raises again
    idx2 = clean_idx.clone()
    idx2[1, 0] = 100
    d.dispatch(x, idx2, p)
    d.dispatch(x, clean_idx, p)
    with pytest.raises(
        ValueError, match=r"held 3 id\(s\) outside \[-1, 8\) \(lowest -7, highest 100\)"
    ):
        d.check_overflow()
    assert d.stats.as_dict()["invalid_expert_ids"] == 3
    with pytest.raises(ValueError, match=r"held 3 id\(s\)"):
        d.check_overflow()


def test_screened_deferred_path_counts_nonfinite_values(deferred_value_checks: None) -> None:
    x, idx, p = _inputs()
    x[0, 0] = float("nan")
    x[1, :] = float("inf")
    p[2, 1] = float("nan")
    d = _screened(_disp())
    d.dispatch(x, idx, p)
    d.dispatch(x, idx, p)
    with pytest.raises(ValueError) as info:
        d.check_overflow()
    msg = str(info.value)
    assert f"x held {2 * (1 + H)} NaN/inf value(s) since the dispatcher was built" in msg
    assert "topk_probs held 2 NaN/inf value(s)" in msg and "router's logits" in msg
    assert "id(s)" not in msg
    assert d.stats.extra["nonfinite_x"] == 2 * (1 + H)
    assert d.stats.extra["nonfinite_topk_probs"] == 2


def test_close_folds_the_device_counts(deferred_value_checks: None) -> None:
    x, idx, p = _inputs()
    idx[1, 1] = E
    d = _disp()
    d.dispatch(x, idx, p)
    d.close()
    assert d.stats.pending_bad_values is None
    assert d.stats.extra["invalid_expert_ids"] == 1
    assert d.stats.extra["invalid_expert_id_highest"] == E


def test_deferred_path_valid_inputs_stay_quiet(deferred_value_checks: None) -> None:
    inp = all_inputs(4, R=1, E=E, k=K, H=H)
    ref = ref_dispatch(inp, 0, E)
    for W in (0, 16):
        d = _disp(num_worst_tokens=W)
        res = d.dispatch(inp[0].x, inp[0].idx, inp[0].probs)
        M = ref.x.shape[0]
        assert torch.equal(res.recv_x[:M], ref.x)
        d.check_overflow()
        assert d.stats.extra == {} and d.stats.pending_bad_values is None


def test_deferred_path_empty_tokens(deferred_value_checks: None) -> None:
    d = _disp()
    d.dispatch(torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K))
    d.check_overflow()


def test_checks_on_still_raise_in_dispatch(deferred_value_checks: None) -> None:
    x, idx, p = _inputs()
    idx[0, 0] = E
    with pytest.raises(
        ValueError, match=r"topk_idx holds 1 id\(s\) outside \[-1, 8\) \(first: 8\)"
    ):
        _disp(checks=True).dispatch(x, idx, p)
    x, idx, p = _inputs()
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"x holds 1 NaN/inf"):
        _disp(checks=True).dispatch(x, idx, p)


def test_count_bad_values_vector() -> None:
    idx = torch.tensor([[0, 8], [-1, -2], [3, 12]])
    x = torch.tensor([[1.0, float("nan")], [0.0, 0.0], [float("inf"), 1.0]])
    p = torch.tensor([[0.5, float("-inf")], [0.0, 0.0], [1.0, 0.0]])
    got = bad_values.count_bad_values(idx, 8, x, p).tolist()
    assert got == [3, 2, 1, 0, 12, -2]
    none = bad_values.count_bad_values(idx.clamp(-1, 7), 8, x.nan_to_num(), p.nan_to_num())
    assert none.tolist()[:3] == [0, 0, 0]
    empty = bad_values.count_bad_values(
        torch.zeros(0, 2, dtype=torch.int64), 8, torch.zeros(0, 3), torch.zeros(0, 2)
    )
    assert empty.tolist()[:3] == [0, 0, 0]


# --------------------------------------------------------------------------- 2 gloo ranks

R2 = 2


def _rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inp = all_inputs(11, R=R2, E=E, k=K, H=H)[rank]
    x, idx, p = inp.x.clone(), inp.idx.clone(), inp.probs.clone()
    if rank == 1:  # rank 1's router was built for 2E experts; one of its rows is NaN
        idx[0, 0], idx[2, 1] = E + 3, 2 * E - 1
        idx[1, 0], p[1, 0] = E - 1, 0.5  # token 1 goes somewhere, with a NaN row
        x[1, 0] = float("nan")
    return x, idx, p


def deferred_worker(rank: int, world: int) -> dict[str, Any]:
    tensors.defer_value_checks = lambda device: True  # the CUDA-without-checks path
    x, idx, p = _rank_inputs(rank)
    out: dict[str, Any] = {}
    for W in (0, 32):
        for screened in (True, False):  # DeepEP's screen, or the torch backend's own count
            d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
            if screened:
                _screened(d)
            res = d.dispatch(x, idx, p)
            y = d.combine(res.recv_x, res.handle)
            try:
                d.check_overflow()
                msg = None
            except ValueError as exc:
                msg = str(exc)
            out[(W, screened)] = {
                "msg": msg,
                "extra": dict(d.stats.extra),
                "recv_idx": res.recv_topk_idx.tolist(),
                "rows": int((res.recv_topk_idx >= 0).any(1).sum()),
                "finite_out": torch.isfinite(y).all(1).tolist(),
            }
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_ranks_deferred_path_reports_on_the_rank_that_sent_them() -> None:
    results = run_group(deferred_worker, R2, timeout=90)
    cleaned = []
    for r in range(R2):
        x, idx, p = _rank_inputs(r)
        ok = (idx >= 0) & (idx < E)
        cleaned.append(Inputs(x=x, idx=torch.where(ok, idx, -1), probs=p.masked_fill(~ok, 0.0)))
    for W in (0, 32):
        for screened in (True, False):
            r0, r1 = results[0][(W, screened)], results[1][(W, screened)]
            assert r0["msg"] is None and r0["extra"] == {}, r0["msg"]
            assert r1["msg"] is not None
            assert f"topk_idx held 2 id(s) outside [-1, {E}) (highest {2 * E - 1})" in r1["msg"]
            assert r1["extra"]["invalid_expert_ids"] == 2
            if screened:
                assert "x held 1 NaN/inf value(s)" in r1["msg"]
                assert r1["extra"]["nonfinite_x"] == 1
            else:  # checks off: a NaN is moved, not looked at
                assert "NaN" not in r1["msg"] and "nonfinite_x" not in r1["extra"]
            for r in range(R2):  # the valid pairs arrived, the bad ones were dropped
                ref = ref_dispatch(cleaned, r, E)
                M = ref.x.shape[0]
                assert results[r][(W, screened)]["rows"] == M
                assert results[r][(W, screened)]["recv_idx"][:M] == ref.idx.tolist()
            # only rank 1's NaN token comes back non-finite
            assert all(results[0][(W, screened)]["finite_out"])
            n = len(r1["finite_out"])
            assert r1["finite_out"] == [t != 1 for t in range(n)]


def cpu_worker(rank: int, world: int) -> str:
    x, idx, p = _rank_inputs(0)
    idx[0, 0] = 2 * E  # every rank passes a bad id: all raise before any collective
    d = FlexDispatcher(DispatchConfig(backend="torch", checks=True), num_experts=E)
    try:
        d.dispatch(x, idx, p)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_ranks_checks_on_raise_in_dispatch() -> None:
    for msg in run_group(cpu_worker, R2, timeout=90):
        assert msg.startswith(f"topk_idx holds 1 id(s) outside [-1, {E}) (first: {2 * E})"), msg


def test_bad_value_log_folds_what_it_kept() -> None:
    from flexdispatch.types import DispatchStats

    stats = DispatchStats()
    log = bad_values.BadValueLog(max_kept=3)
    rows = [
        [1, 0, 2, 0, 9, -3],
        [0, 0, 0, 1, 5, 0],
        [2, 1, 0, 0, 12, -1],
        [0, 4, 0, 2, 3, -7],
        [1, 0, 1, 0, 8, 2],
    ]
    for i, row in enumerate(rows):
        log.add(stats, tuple(torch.tensor(v) for v in row))
        if i == 0:
            first = stats.pending_bad_values
    assert stats.pending_bad_values is first  # folded in place (a captured graph keeps it)
    log.fold(stats)
    assert stats.pending_bad_values.tolist() == [4, 5, 3, 3, 12, -7]
    log.fold(stats)  # nothing kept: unchanged
    assert stats.pending_bad_values.tolist() == [4, 5, 3, 3, 12, -7]
