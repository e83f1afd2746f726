"""``permute`` / ``unpermute`` with ``impl="triton"`` against the torch path, forward and backward:
alignment padding, the static ``static_rows`` mode, probs on and off, dropped (-1) slots, empty
inputs; the ``impl`` switch through ``MoELayer``.

On the ``device`` fixture: CPU tensors under Triton's interpreter (``tests/unit/conftest.py``), or
CUDA tensors and compiled kernels with ``FLEXDISPATCH_TEST_DEVICE=cuda``. Shapes stay small: the
interpreter runs every program (one per row or token) in Python.
"""

from __future__ import annotations

import pytest
import torch

from flexdispatch import permute, unpermute

pytest.importorskip("triton", reason="the kernel tests need triton (scripts/setup.sh installs it)")


def _routing(T, E, k, *, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous()
    if drop:
        idx[torch.rand(T, k, generator=gen) < 0.3] = -1
        if T:
            idx[0] = -1  # a token that goes nowhere
    return idx, torch.rand(T, k, generator=gen)


def _run(impl, x, idx, E, probs, dev, *, align, static_rows, weights):
    """permute -> a row-wise non-linear map -> unpermute, forward and backward."""
    xx = x.to(dev).requires_grad_(True)
    pp = None if probs is None else probs.to(dev).requires_grad_(True)
    perm = permute(
        xx, idx.to(dev), E, topk_probs=pp, align=align, static_rows=static_rows, impl=impl
    )
    y = (perm.x.float() * (1.5 + perm.x.float().tanh())).to(x.dtype)
    out = unpermute(y, perm, probs=perm.probs if weights else None, impl=impl)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dev, x.dtype)
    if out.numel():
        (out.float() * g.float()).sum().backward()
    cpu = {
        name: getattr(perm, name).cpu()
        for name in ("x", "row_token", "row_slot", "tokens_per_expert", "padded_tokens_per_expert")
    }
    cpu["probs"] = None if perm.probs is None else perm.probs.detach().cpu()
    cpu["out"] = out.detach().cpu()
    cpu["grad_x"] = None if xx.grad is None else xx.grad.cpu()
    cpu["grad_probs"] = None if pp is None or pp.grad is None else pp.grad.cpu()
    return perm, cpu


CASES = [
    # (T, E, k, H, align, static, probs, weights, drops, dtype)
    (9, 6, 3, 40, 1, False, True, True, False, torch.float32),
    (9, 6, 3, 40, 4, False, True, True, True, torch.float32),
    (9, 6, 3, 40, 1, True, True, True, True, torch.bfloat16),
    (9, 6, 2, 24, 3, True, False, False, True, torch.float32),
    (7, 4, 2, 16, 2, False, True, False, False, torch.float64),
    (5, 8, 4, 1100, 1, False, True, True, True, torch.bfloat16),  # H past one 1,024 block
    (0, 4, 2, 8, 2, False, True, True, False, torch.float32),  # no tokens
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-a{c[4]}-s{int(c[5])}-{c[9]}")
def test_same_rows_maps_and_sums_as_the_torch_path(case, dev):
    T, E, k, H, align, static, with_probs, weights, drops, dtype = case
    idx, probs = _routing(T, E, k, drop=drops, seed=T + H)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    static_rows = T * k + E * (align - 1) + 3 if static else None
    kw = {"align": align, "static_rows": static_rows, "weights": weights and with_probs}
    p = probs if with_probs else None
    _, a = _run("torch", x, idx, E, p, dev, **kw)
    perm, b = _run("triton", x, idx, E, p, dev, **kw)
    for name in ("x", "row_token", "row_slot", "tokens_per_expert", "padded_tokens_per_expert"):
        assert torch.equal(a[name], b[name]), name  # copies and maps: bit for bit
    if with_probs:
        assert torch.equal(a["probs"], b["probs"])
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(b["out"], a["out"], **tol)
    if T:
        torch.testing.assert_close(b["grad_x"], a["grad_x"], **tol)
        if with_probs and weights:
            torch.testing.assert_close(b["grad_probs"], a["grad_probs"], rtol=1e-5, atol=1e-5)
    # pair_rows is the inverse of (row_token, row_slot) on the real rows
    pair_rows = perm.pair_rows.cpu()
    real = b["row_token"] >= 0
    rows = torch.arange(b["row_token"].shape[0])[real]
    assert torch.equal(pair_rows[b["row_token"][real], b["row_slot"][real]], rows)
    assert int((pair_rows >= 0).sum()) == int(real.sum())


def test_sums_are_deterministic_and_follow_the_row_order(dev):
    """fp32 sums run in ascending row order: the same bits on every run, and equal to a loop that
    adds each token's rows in that order."""
    T, E, k, H = 6, 5, 3, 33
    idx, probs = _routing(T, E, k, drop=True, seed=4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    perm = permute(x.to(dev), idx.to(dev), E, topk_probs=probs.to(dev), impl="triton")
    outs = [unpermute(perm.x, perm, probs=perm.probs, impl="triton").cpu() for _ in range(2)]
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    row_token, rows_x, w = perm.row_token.cpu(), perm.x.cpu(), perm.probs.cpu()
    want = torch.zeros(T, H)
    for r in range(row_token.shape[0]):
        if row_token[r] >= 0:
            want[row_token[r]] += rows_x[r] * w[r]
    torch.testing.assert_close(outs[0], want, rtol=1e-6, atol=1e-6)


def test_exact_size_from_the_caller_and_out_buffer(dev):
    T, E, k, H = 8, 4, 2, 16
    idx, _ = _routing(T, E, k, drop=True, seed=3)
    x = torch.randn(T, H).to(dev)
    n = int((idx >= 0).sum())
    buf = torch.empty(n, H, device=dev)
    perm = permute(x, idx.to(dev), E, num_rows=n, out=buf, checks=True, impl="triton")
    assert perm.x.data_ptr() == buf.data_ptr() and perm.dense
    ref = permute(x, idx.to(dev), E, impl="torch")
    assert torch.equal(perm.x, ref.x) and torch.equal(perm.row_token, ref.row_token)
    with pytest.raises(ValueError, match="num_rows"):
        permute(x, idx.to(dev), E, num_rows=n + 1, checks=True, impl="triton")


def test_all_slots_dropped(dev):
    T, E, k, H = 4, 3, 2, 8
    idx = torch.full((T, k), -1)
    x = torch.randn(T, H, requires_grad=True)
    perm = permute(x.to(dev), idx.to(dev), E, static_rows=T * k, impl="triton")
    assert perm.x.abs().sum() == 0 and bool((perm.row_token == -1).all())
    out = unpermute(perm.x, perm, impl="triton")
    assert out.shape == (T, H) and out.abs().sum() == 0
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(T, H))


def test_impl_switch_and_errors(dev):
    T, E, k, H = 4, 4, 2, 8
    idx, _ = _routing(T, E, k, drop=False, seed=0)
    x = torch.randn(T, H)
    assert permute(x, idx, E).pair_rows is None  # auto on CPU: the torch path
    perm_t = permute(x.to(dev), idx.to(dev), E, impl="torch")
    with pytest.raises(ValueError, match="pair_rows"):
        unpermute(perm_t.x, perm_t, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        permute(x, idx, E, impl="fast")
    # a Triton permutation unpermuted by the torch path (and back) gives the same rows
    perm_k = permute(x.to(dev), idx.to(dev), E, impl="triton")
    torch.testing.assert_close(
        unpermute(perm_k.x, perm_k, impl="torch"), unpermute(perm_k.x, perm_k, impl="triton")
    )


def test_moe_layer_passes_impl_through(dev):
    import flexdispatch as fd

    cfg = fd.load_config("tiny_cpu")
    assert cfg.impl == "auto" and cfg.router.impl == "auto"
    with pytest.raises(ValueError, match="impl"):
        fd.MoEConfig.model_validate({**cfg.model_dump(), "impl": "cuda"})
    outs = []
    for impl in ("torch", "triton"):
        c = cfg.model_copy(
            update={"impl": impl, "router": cfg.router.model_copy(update={"impl": impl})}
        )
        layer = fd.MoELayer(c, device=dev)
        h = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        h = h.to(dev).requires_grad_(True)
        out = layer(h)
        out.output.sum().backward()
        outs.append((out.output.detach().cpu(), h.grad.cpu(), layer.router.weight.grad.cpu()))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
