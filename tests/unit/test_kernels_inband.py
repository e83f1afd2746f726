"""The flat worst-case kernels (``kernels.inband``): the pack kernel (the send rows of an in-band
dispatch in one launch) against the torch packing it replaces; the flat worst-case paths through
the kernels (the CUDA branch forced, the kernels interpreted) on four gloo ranks (every routing
case of the reference; in band, and the receive side after the count exchange) and in a world of
one, against the reference and the torch ops.

On the ``device`` fixture: CPU tensors under Triton's interpreter (``tests/unit/conftest.py``), or
CUDA tensors and the compiled kernel with ``FLEXDISPATCH_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the kernel tests need triton (scripts/setup.sh installs it)")


def _torch_pack(x, key, probs, index, need, E):  # type: ignore[no-untyped-def]
    """The torch packing: ``[T + 1]`` packed rows (row T: zeros, ids E), gathered."""
    T, k = key.shape
    rb = x.shape[1] * x.element_size()
    xp = torch.zeros(T + 1, rb + 4 * (2 * k + 1), dtype=torch.uint8)
    xp[:T, :rb] = x.contiguous().view(torch.uint8)
    meta = xp[:, rb:].view(torch.int32)
    meta[:T, :k] = key
    meta[:T, k : 2 * k] = probs.view(torch.int32)
    meta[T, :k] = E
    meta[:, 2 * k] = need
    return xp.index_select(0, index)


@pytest.mark.parametrize(
    ("T", "k", "H", "dtype"),
    [
        (7, 2, 64, torch.bfloat16),
        (5, 8, 6, torch.float16),
        (9, 32, 3, torch.float32),
        (3, 3, 1024, torch.bfloat16),
        (0, 2, 8, torch.bfloat16),
    ],
)
def test_pack_matches_the_torch_packing(dev, T, k, H, dtype) -> None:  # type: ignore[no-untyped-def]
    from flexdispatch.kernels.inband import pack_inband

    E, R, cap = 40, 3, T + 1
    g = torch.Generator().manual_seed(T * 7 + k)
    x = torch.randn(T, H, generator=g).to(dtype)
    key = torch.randint(-2, E + 1, (T, k), generator=g)  # ids as the backend keys them
    probs = torch.rand(T, k, generator=g)
    index = torch.randint(0, T + 1, (R * cap,), generator=g)  # T = padding
    index[-1] = T
    need = torch.tensor(17, dtype=torch.int64)
    got = pack_inband(*(t.to(dev) for t in (x, key, probs, index, need)), E)
    assert got.dtype == torch.uint8 and got.shape == (
        R * cap,
        H * x.element_size() + 4 * (2 * k + 1),
    )
    assert torch.equal(got.cpu(), _torch_pack(x, key, probs, index, need, E))


@pytest.mark.parametrize(
    "n,P,cap,layout",
    [
        (12, 3, 5, "slice"),  # rows past the cap dropped
        (12, 3, 16, "slice"),  # every block padded
        (0, 2, 4, "slice"),  # no rows
        (40, 1, 40, "contiguous"),  # a world of one
        (3000, 4, 900, "transposed"),  # overflow
        (9000, 2, 5000, "slice"),  # several chunks per program (4,096 rows each)
        (7, 5, 1, "contiguous"),
    ],
)
def test_capped_slots_match_the_torch_slots(dev, n, P, cap, layout) -> None:  # type: ignore[no-untyped-def]
    """``inband.capped_slots`` (one launch) against ``rows._capped_slots``'s torch ops on masks
    of any strides: the first ``cap`` rows of each participant in row order, then ``n``."""
    from flexdispatch.backends.torch import rows
    from flexdispatch.kernels.inband import capped_slots

    g = torch.Generator().manual_seed(n + P + cap)
    full = torch.rand(n, P + 2, generator=g) < 0.6
    if layout == "slice":
        mask = full[:, :P]
    elif layout == "transposed":
        mask = full[:, :P].t().contiguous().t()
    else:
        mask = full[:, :P].contiguous()
    want = rows._capped_slots(mask, cap)  # on CPU: the torch ops
    got = capped_slots(mask.to(dev), cap)
    assert torch.equal(got.cpu(), want), (got, want)


def test_unpack_reads_metadata_in_every_layout(dev) -> None:  # type: ignore[no-untyped-def]
    """``unpack_blocks`` gives the same outputs whether the ids and probs come packed (int32
    ids, then the probs' bits), packed inside a wider buffer, or apart (int64 ids and fp32
    probs, a world of one's own tensors, read through a row map); the counts per block may be
    a strided column and past ``cap`` (read as ``cap``)."""
    from flexdispatch.kernels.inband import unpack_blocks

    R, cap, k, H, E = 3, 4, 3, 8, 6
    W = R * cap
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(W, H, generator=g).bfloat16()
    ids = torch.randint(-2, E + 1, (W, k), generator=g)  # ``clamp_ids`` values
    probs = torch.rand(W, k, generator=g)
    n = torch.tensor([[2, 7], [9, 7], [0, 7]])[:, 0]  # a strided column; 9 > cap
    want_n = torch.tensor([2, cap, 0])
    packed = torch.cat([ids.to(torch.int32), probs.view(torch.int32)], 1)
    wide = torch.zeros(W, 4 * k, dtype=torch.int32)
    wide[:, : 2 * k] = packed
    order = torch.randperm(W, generator=g)  # send row i is source row order[i]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(W)
    kw = dict(cap=cap, k=k, lo=2, num_local=3)
    base = unpack_blocks(rows.to(dev), packed.to(dev), want_n.to(dev), **kw)
    got = [
        unpack_blocks(rows.to(dev), wide[:, : 2 * k].to(dev), n.to(dev), **kw),
        unpack_blocks(rows.to(dev), ids.to(dev), n.to(dev), probs=probs.to(dev), **kw),
        unpack_blocks(
            rows[inv].to(dev),
            ids[inv].to(dev),
            n.to(dev),
            probs=probs[inv].to(dev),
            row_map=order.to(dev),
            **kw,
        ),
    ]
    for outs in got:
        assert [torch.equal(a, b) for a, b in zip(outs, base, strict=True)] == [True] * 6
    assert base[3].sum() > 0 and base[2].abs().sum() > 0  # some local ids and their probs
    assert base[1][2 + cap :].eq(-1).all()  # the tail: 2 + cap real rows


def _step(d, me, rank):  # type: ignore[no-untyped-def]
    """Dispatch + combine with gradients (x and the probs), everything the user sees."""
    from tests.dist.reference import expert_fn

    x = me.x.clone().requires_grad_()
    probs = me.probs.clone().requires_grad_()
    res = d.dispatch(x, me.idx, probs)
    y = expert_fn(res.recv_x, res.recv_topk_probs, rank)
    out = d.combine(y, res.handle)
    (out.float().square().sum()).backward()
    seen = (res.recv_x, res.recv_topk_idx, res.recv_topk_probs, res.num_recv_tokens_per_expert)
    return [t.detach() for t in (*seen, out, x.grad, probs.grad)]


# the flat worst-case layouts the kernels serve: (H, checks, collectives per dispatch + combine
# of the first two calls, the launches of one dispatch). Since issue 46 every one is in band
# (backends/torch/plan.py): rows over 2 KiB too, and checks on after the first call's count
# exchange (the agreement on the row shape)
LAYOUTS = {
    "in band": ("short", False, [2, 2], ["pack", "unpack"]),  # no count exchange
    "in band, checks on": ("short", True, [3, 2], ["pack", "unpack"]),
    "in band, long rows": ("long", False, [2, 2], ["pack", "unpack"]),
}


def _cases_worker(rank: int, R: int, layout: str) -> dict:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: before triton is imported here
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.kernels import inband, interpreting
    from tests.cuda_path import force_cuda_path
    from tests.dist.reference import CASES, all_inputs
    from tests.dist.test_launch_path import LONG_H, SHORT_H, E, K, _check

    assert interpreting(), "a rank imported triton before TRITON_INTERPRET was set"
    force_cuda_path(setattr)
    rows, checks = LAYOUTS[layout][:2]
    H = SHORT_H if rows == "short" else LONG_H
    launches: list[str] = []
    pack, unpack = inband.pack_inband, inband.unpack_blocks
    inband.pack_inband = lambda *a: launches.append("pack") or pack(*a)  # type: ignore[assignment]
    inband.unpack_blocks = lambda *a, **kw: launches.append("unpack") or unpack(*a, **kw)  # type: ignore[assignment]
    W = R * (5 + 2 * (R - 1))  # the largest T of make_inputs on every peer: never an overflow
    got: dict = {"collectives": {}, "same": {}}
    for case in CASES:
        inputs = all_inputs(11, R=R, E=E, k=K, H=H, case=case, dtype=torch.bfloat16)
        runs = []
        for kernels in (True, False):
            inband.pack_on_device = lambda device, _k=kernels: _k  # type: ignore[assignment]
            cfg = DispatchConfig(backend="torch", num_worst_tokens=W, checks=checks)
            d = FlexDispatcher(cfg, num_experts=E)
            if kernels:  # against the reference, twice (warm caches)
                got["collectives"][case] = [len(_check(d, inputs, rank, R, W)) for _ in "12"]
            runs.append(_step(d, inputs[rank], rank))
            d.check_overflow()
            d.close()
        got["same"][case] = [torch.equal(a, b) for a, b in zip(*runs, strict=True)]
    got["launches"] = launches
    return got


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flat_worst_case_with_the_kernels_on_four_ranks(dev, layout) -> None:  # type: ignore[no-untyped-def]
    """Every routing case of the reference (uneven T, an empty rank, a rank sending or receiving
    nothing) through the kernels, against the reference (the zero tail included) and against
    the torch ops, gradients included: in band (pack + unpack), short and long rows, checks off
    and on."""
    from tests.dist.harness import run_group
    from tests.dist.reference import CASES

    if dev.type != "cpu":
        pytest.skip("drives CPU ranks")
    collectives, one = LAYOUTS[layout][2:]
    for got in run_group(_cases_worker, 4, layout, timeout=240.0):
        assert got["collectives"] == {case: collectives for case in CASES}, got
        assert got["same"] == {case: [True] * 7 for case in CASES}, got["same"]
        # every dispatch through the kernels: 2 checked + 1 with gradients per case, and the
        # backward's dispatch (cached_dispatch) needs neither
        assert got["launches"] == one * 3 * len(CASES), got["launches"]


def _world_of_one_step(d, x, idx, probs, dev):  # type: ignore[no-untyped-def]
    """Dispatch + combine with gradients in a world of one: what the user sees, combine's ops,
    and the overflow error of ``check`` (None without one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.dist.reference import expert_fn

    ops: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    try:
        with Spy():
            res = d.dispatch(xg.to(dev), idx.to(dev), pg.to(dev))
    except ValueError as e:  # NOTE: the CPU branch sees an overflow at once (host counts)
        d.close()
        return None, ops, str(e)
    ops.append("|")  # dispatch's ops | combine's
    y = expert_fn(res.recv_x, res.recv_topk_probs, 0)
    y = y + res.recv_topk_idx.lt(0).all(1, keepdim=True) * 7.0  # the tail must not count
    with Spy():
        out = d.combine(y, res.handle)
    out.float().square().sum().backward()
    seen = (res.recv_x, res.recv_topk_idx, res.recv_topk_probs, res.num_recv_tokens_per_expert)
    try:
        d.check_overflow()
        error = None
    except ValueError as e:
        error = str(e)
    d.close()
    return [t.detach().cpu() for t in (*seen, out, xg.grad, pg.grad)], ops, error


@pytest.fixture(params=["no group", "a group of one rank"])
def world_of_one(request, dev):  # type: ignore[no-untyped-def]
    """A world of one: no process group, or a group of one rank (as ``bench_gpu.py``'s NCCL
    group; gloo for CPU tensors)."""
    import torch.distributed as dist

    if request.param == "no group":
        yield request.param
        return
    from flexdispatch.launch import free_port

    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rows", ["short", "long"])
@pytest.mark.parametrize("W", [12, 8])  # 8: fewer than the 11 rows routed: an overflow
def test_world_of_one_worst_case_on_the_cuda_branch(
    dev, monkeypatch, rows, W, world_of_one
) -> None:  # type: ignore[no-untyped-def]
    """A world of one (no process group, the H200 measurement's setup) in worst-case mode, CUDA
    branch: its output read straight from ``x`` by ``unpack_blocks`` (no send gather, no
    receive buffer, no collective) and its combine without the inverse gather
    (``reduce_compacted``) equal the torch ops and the CPU branch, gradients included; an
    overflow (rows past ``W``) is reported the same way and keeps the same first ``W`` rows."""
    import flexdispatch.backends.torch.a2a  # noqa: F401  (loaded before the patch)
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.kernels import inband
    from tests.cuda_path import force_cuda_path
    from tests.dist.test_launch_path import LONG_H, SHORT_H

    g = torch.Generator().manual_seed(3)
    T, E, k = 12, 8, 2
    H = SHORT_H if rows == "short" else LONG_H
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()
    idx[4] = -1  # a token routed nowhere: 11 rows
    idx[7, 1] = -1
    probs = torch.rand(T, k, generator=g)
    x = torch.randn(T, H, generator=g).bfloat16()
    cfg = DispatchConfig(backend="torch", checks=False, num_worst_tokens=W)
    cpu = torch.device("cpu")
    # the CPU branch's results (not beside an NCCL group, which takes no CPU tensors)
    on_cpu = dev.type == "cpu" or world_of_one == "no group"
    runs = [(None, [], None)]
    if on_cpu:
        runs = [_world_of_one_step(FlexDispatcher(cfg, num_experts=E), x, idx, probs, cpu)]
    force_cuda_path(monkeypatch.setattr)
    calls: list[bool] = []  # whether each launch reads through a row map
    unpack = inband.unpack_blocks
    monkeypatch.setattr(
        inband,
        "unpack_blocks",
        lambda *a, **kw: calls.append(kw.get("row_map") is not None) or unpack(*a, **kw),
    )
    for kernels in (True, False):
        monkeypatch.setattr(inband, "pack_on_device", lambda device, _k=kernels: _k)
        runs.append(_world_of_one_step(FlexDispatcher(cfg, num_experts=E), x, idx, probs, dev))
    assert calls == [True], calls  # the forward dispatch (the backward's needs no receive side)
    (cpu_outs, _, cpu_error), (outs, ops, error), (torch_outs, torch_ops, torch_error) = runs
    assert [torch.equal(a, b) for a, b in zip(outs, torch_outs, strict=True)] == [True] * 7
    sent, combined = " ".join(ops).split("|")
    assert "index_select" not in sent and "index_select" in torch_ops, (sent, torch_ops)
    # no collective at all (a group of one gathers no counts)
    assert not [o for o in sent.split() if "gather" in o or "alltoall" in o], sent
    # combine on the CUDA branch: one sum from zeros, no gather of the W rows
    assert combined.split() == " ".join(torch_ops).split("|")[1].split(), (ops, torch_ops)
    assert "index_select" not in combined and combined.count("index_add_") == 1, ops
    assert error == torch_error
    if W < 11:  # reported by the next check on CUDA (no host sync), at once on CPU
        for e in (error, cpu_error) if on_cpu else (error,):
            assert e is not None and "overflow" in e and "11" in e, e
        assert cpu_outs is None
    else:  # the CPU branch's results; the real rows first, then a zero tail
        if on_cpu:
            assert [torch.equal(a, b) for a, b in zip(outs, cpu_outs, strict=True)] == [True] * 7
        assert error is None is cpu_error
        assert outs[0][11:].eq(0).all() and outs[1][11:].eq(-1).all()
        assert outs[0][:11].abs().sum() > 0


def test_one_count_serves_the_bad_ids_and_the_pairs(dev, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The ``(token, rank)`` pair counts serve a dropless receiver (``num_recv_pairs``) and, with
    checks off, the count of bad ids (issue 46: no value screen, the bad ids land in the rank
    table's spare bin): one ``scatter_add_`` in either mode, and a worst-case dispatch reports
    no pairs (the received rows per expert are counted by the unpack kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import flexdispatch.backends.torch.a2a  # noqa: F401  (loaded before the patch)
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.cuda_path import force_cuda_path, force_triton_kernels

    if dev.type == "cpu":
        force_cuda_path(monkeypatch.setattr)
        assert force_triton_kernels(None, monkeypatch.setattr)
    g = torch.Generator().manual_seed(4)
    T, E, k, H = 12, 8, 2, 64
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()
    idx[3] = -1
    idx[5, 0] = E + 3  # a bad id: sent nowhere, counted
    probs = torch.rand(T, k, generator=g)
    x = torch.randn(T, H, generator=g).bfloat16()
    ops: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    seen = {}
    for W in (T, 0):
        ops.clear()
        d = FlexDispatcher(
            DispatchConfig(backend="torch", checks=False, num_worst_tokens=W), num_experts=E
        )
        with Spy():
            res = d.dispatch(*(t.to(dev) for t in (x, idx, probs)))
        seen[W] = (ops.count("scatter_add_"), res.num_recv_pairs)
        d.close()
    assert seen == {T: (1, None), 0: (1, 21)}, seen
