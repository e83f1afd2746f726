"""The screen kernel (``kernels.screen.screen_inputs``, the deferred value checks in one launch)
against the torch ops it replaces: ``bad_values.mask_bad_ids`` (out of range too) for the ids and
``bad_values.count_bad_parts`` (repeats of ids in ``[0, E)``, as the dispatcher counts them) for the
counts, on clean and adversarial inputs (repeats of good,
dropped and bad ids, ids below -1 and at or past E, NaN and inf in the values and the probs, k up
to 32, E up to 512, every row dtype, strided inputs, no tokens), and the accumulation of two
calls into one vector.

On the ``device`` fixture: CPU tensors under Triton's interpreter (``tests/unit/conftest.py``), or
CUDA tensors and the compiled kernel with ``FLEXDISPATCH_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch

from flexdispatch._checks import tensors
from flexdispatch.dispatch import values as bad_values

pytest.importorskip("triton", reason="the kernel tests need triton (scripts/setup.sh installs it)")

_I64 = torch.iinfo(torch.int64)

# NOTE: the interpreter computes inf - inf with NumPy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _neutral(device: torch.device) -> torch.Tensor:
    return torch.tensor([0, 0, 0, 0, _I64.min, _I64.max], dtype=torch.int64, device=device)


def _want(idx: torch.Tensor, E: int, vals: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The dispatcher's deferred counts in torch ops: repeats of ids in [0, E) only
    (``mask_bad_ids``), as ``FlexDispatcher._check_values`` counts them."""
    repeats = bad_values.mask_bad_ids(idx, E, out_of_range=True)[1]
    return torch.stack(bad_values.count_bad_parts(idx, E, vals, probs, repeats=repeats))


def _case(T: int, k: int, E: int, V: int, dtype: torch.dtype, seed: int, bad: bool):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()  # distinct per token
    idx[torch.rand(T, k, generator=g) < 0.2] = -1  # some dropped slots (-1 may repeat)
    probs = torch.rand(T, k, generator=g)
    vals = torch.randn(T, V, generator=g).to(dtype)
    if bad and T:
        assert T >= 2
        if k >= 2:
            idx[0, 0] = idx[0, -1] = 1  # a repeated good id
            idx[T - 1, 1] = idx[T - 1, -1] = -1  # a repeated dropped id (not counted)
        idx[T - 1, 0] = -7  # ids outside [-1, E), one repeated (counted as bad, not as repeat)
        idx[T // 2, -1] = E + 3
        if k >= 3:
            idx[T // 2, 1] = E + 3
        vals[0, V // 2] = float("nan")
        vals[T - 1, 0] = float("-inf")
        probs[T - 1, k - 1] = float("inf")
        probs[0, 0] = float("nan")
    return idx, vals, probs


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "bad"])
@pytest.mark.parametrize(
    ("T", "k", "E", "V", "dtype"),
    [
        (37, 2, 8, 64, torch.bfloat16),
        (5, 1, 8, 16, torch.float32),
        (19, 8, 256, 100, torch.float16),
        (9, 32, 512, 48, torch.bfloat16),
        (3, 3, 4, 1, torch.float32),
        (0, 4, 8, 32, torch.bfloat16),
    ],
)
def test_screen_matches_the_torch_checks(dev, T, k, E, V, dtype, bad) -> None:  # type: ignore[no-untyped-def]
    from flexdispatch.kernels.screen import screen_inputs

    idx, vals, probs = (t.to(dev) for t in _case(T, k, E, V, dtype, seed=T * 31 + k, bad=bad))
    acc = _neutral(dev)
    got = screen_inputs(idx, E, vals, probs, acc)
    want_ids, _, _ = bad_values.mask_bad_ids(idx, E, out_of_range=True)
    assert torch.equal(got, want_ids)
    assert torch.equal(acc, _want(idx, E, vals, probs))
    if bad and T:
        kinds = acc[:4] if k > 1 else acc[:3]  # every kind of bad value was injected
        assert kinds.gt(0).all(), acc
    else:
        assert acc[:4].eq(0).all(), acc


def test_screen_accumulates_and_reads_strided_inputs(dev) -> None:  # type: ignore[no-untyped-def]
    from flexdispatch.kernels.screen import screen_inputs

    E = 16
    a = _case(23, 4, E, 40, torch.bfloat16, seed=1, bad=True)
    b = _case(11, 4, E, 40, torch.bfloat16, seed=2, bad=True)
    acc = _neutral(dev)
    wide = torch.full((11, 9), 5, dtype=torch.int64)
    wide[:, 2:6] = b[0]  # a strided [11, 4] view: rows 9 ids apart
    b_idx = wide.to(dev)[:, 2:6]
    got_a = screen_inputs(a[0].to(dev), E, a[1].to(dev), a[2].to(dev), acc)
    got_b = screen_inputs(b_idx, E, b[1].to(dev), b[2].to(dev), acc)
    assert torch.equal(got_b, bad_values.mask_bad_ids(b[0], E, out_of_range=True)[0].to(dev))
    assert torch.equal(got_a, bad_values.mask_bad_ids(a[0], E, out_of_range=True)[0].to(dev))
    va, vb = _want(a[0], E, a[1], a[2]), _want(b[0], E, b[1], b[2])
    want = torch.cat(
        [va[:4] + vb[:4], torch.maximum(va[4:5], vb[4:5]), torch.minimum(va[5:], vb[5:])]
    )
    assert torch.equal(acc.cpu(), want)


def _dispatch_log(monkeypatch, screen: bool, cuda: bool) -> dict:  # type: ignore[no-untyped-def]
    """Three deferred dispatches + combines in a world of one (bad ids, a repeat, NaN/inf, then
    clean inputs), with the screen kernel or the torch ops; what the user sees, and the ATen ops
    of the second dispatch (the first also makes the pending vector). The torch backend's
    ``counts_bad_ids`` is switched off: the dispatcher then screens the values as it does for
    DeepEP (the torch backend itself checks no value with checks off)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.kernels import screen as screen_mod
    from tests.cuda_path import force_cuda_path, force_triton_kernels

    monkeypatch.setattr(tensors, "defer_value_checks", lambda device: True)
    monkeypatch.setattr(screen_mod, "screen_on_device", lambda device: False)
    if screen:  # the kernel's interpreter is no launch: one marker per launch instead
        mark = lambda name, args: logging and ops.append(f"<{name}>")  # noqa: E731
        assert force_triton_kernels(mark, monkeypatch.setattr)
    if cuda:
        force_cuda_path(monkeypatch.setattr)
    E, T, k, H = 8, 6, 3, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()
    probs = torch.rand(T, k, generator=g)
    bad_idx, bad_x, bad_p = idx.clone(), x.clone(), probs.clone()
    bad_idx[0, 0], bad_idx[3, 2] = -4, E + 1
    bad_idx[1, 2] = bad_idx[1, 0]  # a repeat
    bad_x[2, 5], bad_p[4, 1] = float("nan"), float("inf")
    ops: list[str] = []
    logging: list[bool] = []  # non-empty while the dispatch is logged

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    out: dict = {"results": []}
    for W in (0, 2 * T):
        d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
        d.backend.counts_bad_ids = False  # type: ignore[misc]  # NOTE: the screen DeepEP gets
        for i, (xx, ii, pp) in enumerate(
            ((bad_x, bad_idx, bad_p), (x, bad_idx, probs), (x, idx, probs))
        ):
            if i == 1 and W == 0:
                logging.append(True)
                with Log():
                    res = d.dispatch(xx, ii, pp)
                logging.clear()
            else:
                res = d.dispatch(xx, ii, pp)
            back = d.combine(res.recv_x.nan_to_num() * 2, res.handle)
            out["results"].append(
                (
                    res.recv_x.nan_to_num(),
                    res.recv_topk_idx,
                    res.recv_topk_probs.nan_to_num(posinf=7.0),
                    res.num_recv_tokens_per_expert,
                    back,
                )
            )
        with pytest.raises(ValueError) as info:
            d.check_overflow()
        out.setdefault("messages", []).append(str(info.value))
        out.setdefault("extra", []).append(dict(d.stats.extra))
    out["ops"] = ops
    return out


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-path", "cuda-path"])
def test_dispatcher_screen_kernel_gives_what_the_torch_ops_give(dev, monkeypatch, cuda) -> None:  # type: ignore[no-untyped-def]
    """Through ``FlexDispatcher`` (deferred checks forced on CPU): the same results, the same
    error at the safe point and the same counts with the kernel as with the torch ops, and the
    validation's torch ops gone from the dispatch."""
    if dev.type != "cpu":
        pytest.skip("drives the CPU tensors of a world of one")
    torch_ops = _dispatch_log(monkeypatch, screen=False, cuda=cuda)
    kernel = _dispatch_log(monkeypatch, screen=True, cuda=cuda)
    for a, b in zip(torch_ops["results"], kernel["results"], strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)
    assert kernel["messages"] == torch_ops["messages"]
    assert "held 4 id(s) outside [-1, 8) (lowest -4, highest 9)" in kernel["messages"][0]
    assert "twice in a token 2 time(s)" in kernel["messages"][0]
    assert "x held 1 NaN/inf" in kernel["messages"][0]
    assert "topk_probs held 1 NaN/inf" in kernel["messages"][0]
    assert kernel["extra"] == torch_ops["extra"]
    saved = len(torch_ops["ops"]) - len(kernel["ops"])
    assert saved >= 10, (saved, torch_ops["ops"], kernel["ops"])


def _ranks_worker(rank: int, R: int) -> dict:
    """The CUDA branch with the screen kernel on two gloo ranks (interpreted on CPU): the in-band
    worst-case path and the dropless one, bad ids and a repeat on every rank."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.cuda_path import force_cuda_path
    from tests.dist.reference import Inputs, all_inputs, ref_dispatch

    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: before triton is imported here
    force_cuda_path(setattr)
    from flexdispatch.kernels import interpreting
    from flexdispatch.kernels import screen as screen_mod

    assert interpreting(), "a rank imported triton before TRITON_INTERPRET was set"
    screen_mod.screen_on_device = lambda device: True  # type: ignore[assignment]
    E, k, H = 8, 2, 8
    inputs = all_inputs(4, R=R, E=E, k=k, H=H, dtype=torch.bfloat16)
    for i, inp in enumerate(inputs):  # every rank's ids, made bad the same way
        inp.idx[0, 0], inp.idx[1, 1] = -5, E + i
        inp.idx[2, 0] = inp.idx[2, 1] = 3  # a repeated good id
    cleaned = [
        Inputs(
            x=inp.x,
            idx=bad_values.mask_bad_ids(inp.idx, E, out_of_range=True)[0],
            probs=inp.probs,
        )
        for inp in inputs
    ]
    ref = ref_dispatch(cleaned, rank, E)
    M = ref.x.shape[0]
    out: dict = {}
    for W in (0, R * 16):
        d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
        d.backend.counts_bad_ids = False  # type: ignore[misc]  # NOTE: the screen DeepEP gets
        me = inputs[rank]
        res = d.dispatch(me.x, me.idx, me.probs)
        ok = torch.equal(res.recv_x[:M], ref.x) and torch.equal(res.recv_topk_idx[:M], ref.idx)
        d.combine(res.recv_x, res.handle)
        try:
            d.check_overflow()
            out[W] = (ok, "")
        except ValueError as exc:
            out[W] = (ok, str(exc))
    return out


def test_screen_kernel_on_two_ranks_in_band_and_dropless() -> None:
    from tests.dist.harness import run_group

    for rank, got in enumerate(run_group(_ranks_worker, 2)):
        assert sorted(got) == [0, 32]
        for W, (ok, msg) in got.items():
            assert ok, W  # the results of the cleaned routing
            assert f"held 2 id(s) outside [-1, 8) (lowest -5, highest {8 + rank})" in msg, msg
            assert "twice in a token 1 time(s)" in msg, msg


def test_dispatch_kernels_run_on_cuda_tensors_unless_turned_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from flexdispatch.kernels import _triton, inband
    from flexdispatch.kernels import screen as screen_mod

    cuda = torch.device("cuda", 0)
    for env, on in (("", True), ("1", True), ("0", False), ("no", False)):
        monkeypatch.setenv("FLEXDISPATCH_DISPATCH_KERNELS", env)
        monkeypatch.setattr(_triton, "_DISPATCH_KERNELS", None)  # read once per process
        assert screen_mod.screen_on_device(cuda) is on and inband.pack_on_device(cuda) is on
        assert not screen_mod.screen_on_device(torch.device("cpu"))
        assert not inband.pack_on_device(torch.device("cpu"))
    monkeypatch.setenv("FLEXDISPATCH_DISPATCH_KERNELS", "")
    monkeypatch.setattr(_triton, "_DISPATCH_KERNELS", None)
    monkeypatch.setattr(_triton, "_STATUS", (False, "triton is not importable (test)"))
    assert not screen_mod.screen_on_device(cuda) and not inband.pack_on_device(cuda)
