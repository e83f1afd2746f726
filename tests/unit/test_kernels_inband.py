"""The in-band pack kernel (``kernels.inband.pack_inband``: the send rows of a flat worst-case
dispatch in one launch, the CUDA branch's) against the torch packing it replaces, and the
in-band path through it on four gloo ranks (every routing case of the reference, the CUDA branch
forced, the kernel interpreted) against the reference.

On the ``device`` fixture: CPU tensors under Triton's interpreter (``tests/unit/conftest.py``), or
CUDA tensors and the compiled kernel with ``FLEXDISPATCH_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the kernel tests need triton (scripts/setup.sh installs it)")


@pytest.fixture
def dev(device):  # type: ignore[no-untyped-def]
    from flexdispatch.kernels import interpreting

    if device.type == "cpu" and not interpreting():
        if torch.cuda.is_available():
            pytest.skip(
                "a CUDA machine runs the kernel tests compiled, on CUDA tensors: "
                "FLEXDISPATCH_TEST_DEVICE=cuda (Triton's interpreter stays off there)"
            )
        pytest.fail("the kernel tests on CPU need Triton's interpreter (tests/unit/conftest.py)")
    return device


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


def _cases_worker(rank: int, R: int) -> dict:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: before triton is imported here
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.kernels import inband, interpreting
    from tests.cuda_path import force_cuda_path
    from tests.dist.reference import CASES, all_inputs
    from tests.dist.test_launch_path import SHORT_H, E, K, _check

    assert interpreting(), "a rank imported triton before TRITON_INTERPRET was set"
    force_cuda_path(setattr)
    launches = []
    real = inband.pack_inband
    inband.pack_on_device = lambda device: True  # type: ignore[assignment]
    inband.pack_inband = lambda *a: launches.append(1) or real(*a)  # type: ignore[assignment]
    W = R * (5 + 2 * (R - 1))  # the largest T of make_inputs on every peer: never an overflow
    got = {}
    for case in CASES:
        inputs = all_inputs(11, R=R, E=E, k=K, H=SHORT_H, case=case, dtype=torch.bfloat16)
        d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
        got[case] = [len(_check(d, inputs, rank, R, W)) for _ in "12"]
        d.check()
        d.close()
    return {"collectives": got, "launches": len(launches)}


def test_inband_path_with_the_pack_kernel_on_four_ranks(dev) -> None:  # type: ignore[no-untyped-def]
    from tests.dist.harness import run_group
    from tests.dist.reference import CASES

    if dev.type != "cpu":
        pytest.skip("drives CPU ranks")
    for got in run_group(_cases_worker, 4):
        assert got["collectives"] == {case: [2, 2] for case in CASES}, got
        assert got["launches"] == 2 * len(CASES), got  # every dispatch packed by the kernel
