"""A world of one: no process group, or a group of one rank (``bench_gpu.py``'s NCCL group, a
single-GPU run under ``torchrun --nproc-per-node 1``). A group of one receives what it sends, so
the torch backend moves its rows, metadata and counts as with no group: no collective at all,
in dispatch, combine and the backward, on the CPU and the CUDA branch (its torch ops, and its
Triton kernels interpreted: there one launch reads the rows, ids and probs straight from the
inputs in either mode), dropless and worst-case.

Checked against the slow reference of ``tests/dist/reference.py`` (every routing case) and
against the same calls with no group (equal bit for bit, gradients included). Every routing case
but "receives_nothing" (no expert at all in a world of one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist.reference import CASES, expert_fn, make_inputs, ref_combine, ref_dispatch

E, K, H = 8, 2, 16
# NOTE: "receives_nothing" routes to no expert of the last rank, which is every expert here
WORLD_CASES = tuple(c for c in CASES if c != "receives_nothing")


class _Ops(TorchDispatchMode):
    """The ATen and c10d ops of what runs inside it (names only)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _step(
    case: str, W: int, launches: list[str], collectives: bool = False, hidden: int = H
) -> tuple[list[torch.Tensor], list[str]]:
    """Dispatch, the experts of ``expert_fn``, combine and the backward, as a user runs them:
    what comes out, and every op they ran. ``collectives``: the backend's collective paths
    forced on (``distributed``; a group of one rank only); ``hidden``: the row width."""
    from flexdispatch import DispatchConfig, FlexDispatcher

    inp = make_inputs(3, 0, R=1, E=E, k=K, H=hidden, case=case)
    x, probs = inp.x.clone().requires_grad_(), inp.probs.clone().requires_grad_()
    d = FlexDispatcher(
        DispatchConfig(backend="torch", checks=False, num_worst_tokens=W), num_experts=E
    )
    d.backend.distributed = d.backend.distributed or collectives
    ops = _Ops()
    with ops:
        launches.clear()
        res = d.dispatch(x, inp.idx, probs)
        ops.names.append(f"launched {sorted(launches)}")
        y = expert_fn(res.recv_x, res.recv_topk_probs, 0)
        out = d.combine(y, res.handle)
        ops.names.append("combined")
        out.square().sum().backward()
    d.check_overflow()
    d.close()
    seen = (res.recv_x, res.recv_topk_idx, res.recv_topk_probs, res.num_recv_tokens_per_expert)
    return [t.detach() for t in (*seen, out, x.grad, probs.grad)], ops.names


@pytest.mark.timeout(120)
@pytest.mark.parametrize("branch", ["cpu", "cuda", "cuda+kernels"])
@pytest.mark.parametrize("W", [0, 16], ids=["dropless", "worst-case"])
def test_a_group_of_one_rank_runs_no_collective(monkeypatch, branch, W) -> None:  # type: ignore[no-untyped-def]
    import flexdispatch.backends.torch.a2a  # noqa: F401  (loaded before the patch)
    from flexdispatch.kernels import inband
    from flexdispatch.launch import free_port
    from tests.cuda_path import force_cuda_path

    launches: list[str] = []
    if branch != "cpu":  # NOTE: the CUDA branch's torch ops, or its Triton kernels interpreted
        force_cuda_path(monkeypatch.setattr)
        monkeypatch.setattr(inband, "pack_on_device", lambda device: False)
    if branch == "cuda+kernels":
        pytest.importorskip("triton", reason="the kernels need triton (scripts/setup.sh)")
        from tests.cuda_path import force_triton_kernels

        assert force_triton_kernels(lambda name, args: launches.append(name), monkeypatch.setattr)
    alone = {case: _step(case, W, launches) for case in WORLD_CASES}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        grouped = {case: _step(case, W, launches) for case in WORLD_CASES}
    finally:
        dist.destroy_process_group()
    for case in WORLD_CASES:
        (outs, ops), (outs0, _) = grouped[case], alone[case]
        assert [o for o in ops if "c10d" in o] == [], (case, ops)
        assert [torch.equal(a, b) for a, b in zip(outs, outs0, strict=True)] == [True] * 7, case
        inp = make_inputs(3, 0, R=1, E=E, k=K, H=H, case=case)
        ref = ref_dispatch([inp], 0, E)
        M = ref.x.shape[0]
        if branch == "cuda+kernels" and inp.x.shape[0] and (W or M):
            # NOTE: one launch reads the rows, ids and probs from the inputs: no torch gather
            # (and no value screen: checks off, issue 46)
            kernels = ["unpack_blocks"] + (["capped_slots"] if W else [])
            mark = f"launched {sorted(kernels)}"
            assert mark in ops, (case, ops)
            assert not [o for o in ops[: ops.index(mark)] if "index_select" in o], ops
        recv_x, recv_idx, recv_probs, counts, out = outs[:5]
        assert recv_x.shape[0] == (W or M), case
        assert torch.equal(recv_x[:M], ref.x) and torch.equal(recv_idx[:M], ref.idx), case
        assert torch.equal(recv_probs[:M], ref.probs) and torch.equal(counts, ref.counts), case
        assert recv_x[M:].eq(0).all() and recv_idx[M:].eq(-1).all(), case  # the zero tail
        assert torch.equal(out, ref_combine(inp, E, 1)), case


@pytest.mark.timeout(120)
@pytest.mark.parametrize("branch", ["cpu", "cuda", "cuda+kernels"])
@pytest.mark.parametrize("W", [0, 16], ids=["dropless", "worst-case"])
@pytest.mark.parametrize("rows", ["short", "long"])
def test_the_collective_paths_forced_on_a_group_of_one_give_the_same(
    monkeypatch, branch, W, rows
) -> None:  # type: ignore[no-untyped-def]
    """``TorchA2ABackend.distributed`` set on a group of one rank runs the paths of R ranks with
    R = 1 (rows through ``all_to_all_single``; on the CUDA branch with kernels the send blocks
    and the receive buffer): what the GPU tests do to put NCCL under a CUDA graph on one GPU.
    They must give what the world of one gives; short rows (worst-case counts in band) and long
    rows (the count exchange)."""
    import flexdispatch.backends.torch.a2a  # noqa: F401  (loaded before the patch)
    from flexdispatch.kernels import inband
    from flexdispatch.launch import free_port
    from tests.cuda_path import force_cuda_path
    from tests.dist.test_launch_path import LONG_H

    hidden = H if rows == "short" else LONG_H
    launches: list[str] = []
    if branch != "cpu":
        force_cuda_path(monkeypatch.setattr)
        monkeypatch.setattr(inband, "pack_on_device", lambda device: False)
    if branch == "cuda+kernels":
        pytest.importorskip("triton", reason="the kernels need triton (scripts/setup.sh)")
        from tests.cuda_path import force_triton_kernels

        assert force_triton_kernels(lambda name, args: launches.append(name), monkeypatch.setattr)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        runs = {
            forced: {case: _step(case, W, launches, forced, hidden) for case in WORLD_CASES}
            for forced in (False, True)
        }
    finally:
        dist.destroy_process_group()
    for case in WORLD_CASES:
        (outs, ops), (outs0, ops0) = runs[True][case], runs[False][case]
        assert [torch.equal(a, b) for a, b in zip(outs, outs0, strict=True)] == [True] * 7, case
        assert [o for o in ops0 if "c10d" in o] == [], case
        sent = make_inputs(3, 0, R=1, E=E, k=K, H=H, case=case).idx.ge(0).any(1).any()
        if W or sent:  # NOTE: rows through a collective of one rank (dropless: when any)
            at = [o.startswith("launched") for o in ops].index(True)
            dispatched, combined = ops[:at], ops[at : ops.index("combined")]
            assert [o for o in dispatched if "alltoall" in o], (case, ops)
            assert [o for o in combined if "alltoall" in o], (case, ops)
