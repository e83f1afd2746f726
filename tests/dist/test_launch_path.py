"""The torch backend's launch path (issue 26 items 4 and 5, issue 46 item 1).

- Rows of every width travel with their metadata in one ``all_to_all_single`` while the call is
  small (``plan.PACK_MAX_CALL_BYTES``, decided on the call's bytes, not the row width): a flat
  dropless dispatch + combine issues 3 collectives (count exchange, rows + metadata, rows back),
  short and long rows alike; both give the reference's results exactly, on the CPU and the CUDA
  branch.
- Worst-case rows carry their counts in band (``backends/torch/plan.py``): 2 collectives, after
  one dispatch with the exchange per row shape on CPU or with checks on (the agreement check),
  from the first on the CUDA branch with checks off. A worst-case overflow found in band raises
  the same error on every rank at ``check_overflow`` (checks off) or in dispatch (checks on).
- A world of one gathers its rows straight into the receive buffer and (CUDA branch) sums the
  returning rows straight from the expert output: results equal the reference
  (``flat.packs_meta`` packs its short rows with their metadata).
"""

from __future__ import annotations

import pytest
import torch

from flexdispatch import DispatchConfig, FlexDispatcher
from flexdispatch.backends.torch.flat import PACK_MAX_ROW_BYTES, packs_meta
from tests.cuda_path import force_cuda_path
from tests.dist.harness import run_group
from tests.dist.reference import CASES, all_inputs, expert_fn, ref_combine, ref_dispatch

pytestmark = pytest.mark.timeout(300)

E, K, T = 8, 2, 12
SHORT_H, LONG_H = 8, PACK_MAX_ROW_BYTES // 2 + 4  # bf16 rows: 16 B (packed), 2,056 B (not)


def _check(d: FlexDispatcher, inputs, rank: int, R: int, W: int) -> list[str]:  # type: ignore[no-untyped-def]
    """One dispatch + combine against the reference; the collectives it issued, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if str(func).startswith("c10d."):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    me = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    with Spy():
        res = d.dispatch(me.x, me.idx, me.probs)
        y = expert_fn(res.recv_x, res.recv_topk_probs, rank)
        back = d.combine(y, res.handle)
    M = ref.x.shape[0]
    assert res.recv_x.shape[0] == (W or M) and res.recv_x.is_contiguous()
    assert torch.equal(res.recv_x[:M], ref.x)
    assert torch.equal(res.recv_topk_idx[:M], ref.idx)
    assert torch.equal(res.recv_topk_probs[:M], ref.probs)
    assert torch.equal(res.num_recv_tokens_per_expert, ref.counts)
    if W:
        assert res.recv_x[M:].eq(0).all() and res.recv_topk_idx[M:].eq(-1).all()
        assert res.recv_topk_probs[M:].eq(0).all()
    assert torch.equal(back, ref_combine(me, E, R))
    return seen


def test_packing_rule() -> None:
    assert packs_meta(SHORT_H * 4) and packs_meta(PACK_MAX_ROW_BYTES)
    assert not packs_meta(LONG_H * 2) and not packs_meta(PACK_MAX_ROW_BYTES + 4)
    assert not packs_meta(6)  # an odd bf16 width: the metadata would not be int32-aligned


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-path", "cuda-path"])
@pytest.mark.parametrize("W", [0, 32], ids=["dropless", "worst"])
@pytest.mark.parametrize("H", [SHORT_H, LONG_H], ids=["short", "long"])
def test_world_of_one_matches_the_reference(cuda: bool, W: int, H: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if cuda:
        force_cuda_path(monkeypatch.setattr)
    inputs = all_inputs(4, R=1, E=E, k=K, H=H)
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
    for _ in range(2):  # the second call runs on warm caches and reused buffers
        assert _check(d, inputs, 0, 1, W) == []
    d.check_overflow()


@pytest.mark.parametrize("W", [0, 32], ids=["dropless", "worst"])
def test_autograd_function_only_where_a_gradient_is_recorded(W: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Inputs that need no gradient (or ``no_grad``) skip the autograd Functions (host time per
    call); the results are the same either way and gradients still flow where asked for."""
    from flexdispatch.dispatch import autograd

    applied: list[str] = []
    for fn in (autograd.DispatchFunction, autograd.CombineFunction):
        orig = fn.apply
        monkeypatch.setattr(
            fn, "apply", lambda *a, _o=orig, _n=fn.__name__: applied.append(_n) or _o(*a)
        )
    me = all_inputs(4, R=1, E=E, k=K, H=SHORT_H)[0]
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
    x, probs = me.x.clone().requires_grad_(), me.probs.clone().requires_grad_()
    plain = d.dispatch(me.x, me.idx, me.probs)
    graded = d.dispatch(x, me.idx, probs)
    with torch.no_grad():
        quiet = d.dispatch(x, me.idx, probs)
    assert plain.recv_x.grad_fn is None and quiet.recv_x.grad_fn is None
    assert graded.recv_x.grad_fn is not None and graded.recv_topk_probs.grad_fn is not None
    for res in (graded, quiet):
        for name in ("recv_x", "recv_topk_idx", "recv_topk_probs", "num_recv_tokens_per_expert"):
            assert torch.equal(getattr(res, name), getattr(plain, name)), name
    y = plain.recv_x.float() * 2
    back = d.combine(y, plain.handle)
    assert back.grad_fn is None
    y_g = y.clone().requires_grad_()
    back_g = d.combine(y_g, plain.handle)
    assert back_g.grad_fn is not None and torch.equal(back_g, back)
    out = d.combine(graded.recv_x, graded.handle)
    (out.float().sum() + graded.recv_topk_probs.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and probs.grad is not None
    # the graded dispatch, the combine of y_g and the combine of the graded rows
    assert applied == ["DispatchFunction", "CombineFunction", "CombineFunction"], applied


def _worker(rank: int, R: int, cuda: bool) -> dict:
    if cuda:
        force_cuda_path(setattr)
    got = {}
    for H in (SHORT_H, LONG_H):
        for W in (0, R * T):
            for dtype, checks in ((torch.float32, False), (torch.bfloat16, False), (None, True)):
                dtype = dtype or torch.bfloat16
                inputs = all_inputs(5, R=R, E=E, k=K, H=H, dtype=dtype)
                cfg = DispatchConfig(backend="torch", num_worst_tokens=W, checks=checks)
                d = FlexDispatcher(cfg, num_experts=E)
                got[(H, W, str(dtype), checks)] = [
                    len(_check(d, inputs, rank, R, W)) for _ in "123"
                ]
                d.check_overflow()
                d.close()
    return got


def _expected(H: int, W: int, checks: bool, cuda: bool) -> list[int]:
    # NOTE: H does not matter any more (issue 46): long rows pack as short ones do
    if not W:
        return [3, 3, 3]
    return [2, 2, 2] if cuda and not checks else [3, 2, 2]


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-path", "cuda-path"])
def test_short_rows_take_fewer_collectives_and_match_the_reference(cuda: bool) -> None:
    for got in run_group(_worker, 2, cuda):
        assert len(got) == 12
        for (H, W, _, checks), n in got.items():
            assert n == _expected(H, W, checks, cuda), got


def _overflow_worker(rank: int, R: int, cuda: bool, checks: bool) -> tuple[str, str]:
    if cuda:
        force_cuda_path(setattr)
    cfg = DispatchConfig(backend="torch", num_worst_tokens=R * 2, checks=checks)
    d = FlexDispatcher(cfg, num_experts=E)
    x = torch.randn(T, SHORT_H)
    good = torch.tensor([[rank * 4, rank * 4 + 1]]).repeat(T, 1)  # my own experts only
    d.dispatch(x[:2], good[:2], torch.rand(2, K))  # the exchange's call (agreement)
    # rank 1 sends all T tokens to rank 0 (cap = 2): the overflow
    idx = torch.tensor([[0, 1]]).repeat(T, 1) if rank == 1 else good
    try:
        res = d.dispatch(x, idx, torch.rand(T, K))
    except ValueError as exc:
        return "dispatch", str(exc)
    d.combine(res.recv_x, res.handle)
    try:
        d.check_overflow()
    except ValueError as exc:
        return "check", str(exc)
    return "none", ""


@pytest.mark.parametrize("checks", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-path", "cuda-path"])
def test_inband_overflow_is_raised_on_every_rank(cuda: bool, checks: bool) -> None:
    got = run_group(_overflow_worker, 2, cuda, checks)
    for w, msg in got:
        # NOTE: checks off: no host read in dispatch, the safe point raises (issue 46)
        assert w == ("dispatch" if checks else "check"), got
        assert "rank 1 sending to rank 0 needs 12 rows" in msg, msg
        assert "num_worst_tokens" in msg and "24" in msg, msg


def _cases_worker(rank: int, R: int, cuda: bool) -> dict:
    if cuda:
        force_cuda_path(setattr)
    W = R * (5 + 2 * (R - 1))  # the largest T of make_inputs on every peer: never an overflow
    got = {}
    for case in CASES:
        inputs = all_inputs(11, R=R, E=E, k=K, H=SHORT_H, case=case, dtype=torch.bfloat16)
        cfg = DispatchConfig(backend="torch", num_worst_tokens=W, checks=False)
        d = FlexDispatcher(cfg, num_experts=E)
        got[case] = [len(_check(d, inputs, rank, R, W)) for _ in "123"]
        d.check_overflow()
        d.close()
    return got


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-path", "cuda-path"])
def test_inband_path_serves_every_routing_case_on_four_ranks(cuda: bool) -> None:
    """Counts in band with uneven T, an empty rank, a rank sending nothing, a rank receiving
    nothing, and R = 4 (ranks whose own rows sit inside the buffers, not at one end)."""
    want = [2, 2, 2] if cuda else [3, 2, 2]
    for got in run_group(_cases_worker, 4, cuda):
        assert got == {case: want for case in CASES}, got
