"""permute / unpermute against slow per-pair Python loops.

T tokens · H hidden · E experts · k top-k · N rows of a permutation.

The reference comparisons run on the ``device`` fixture (``FLEXDISPATCH_TEST_DEVICE``,
tests/conftest.py); inputs are drawn and references computed on the CPU.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexdispatch import Permutation, permute, unpermute

permute_module = sys.modules[permute.__module__]

# --------------------------------------------------------------------------- slow references


def ref_permute(x, topk_idx, num_experts, topk_probs=None, align=1):
    """Pairs collected one by one, sorted by (expert, token, slot), segments padded with zeros."""
    T, k = topk_idx.shape
    pairs = [
        (int(topk_idx[t, s]), t, s)
        for t in range(T)
        for s in range(k)
        if 0 <= int(topk_idx[t, s]) < num_experts
    ]
    pairs.sort()
    rows_x, row_token, row_slot, probs, counts, padded = [], [], [], [], [], []
    for e in range(num_experts):
        seg = [(t, s) for (ee, t, s) in pairs if ee == e]
        for t, s in seg:
            rows_x.append(x[t].clone())
            row_token.append(t)
            row_slot.append(s)
            probs.append(float(topk_probs[t, s]) if topk_probs is not None else 0.0)
        n_pad = (align - len(seg) % align) % align
        for _ in range(n_pad):
            rows_x.append(torch.zeros_like(x[0]) if T else torch.zeros(x.shape[1], dtype=x.dtype))
            row_token.append(-1)
            row_slot.append(-1)
            probs.append(0.0)
        counts.append(len(seg))
        padded.append(len(seg) + n_pad)
    H = x.shape[1]
    return {
        "x": torch.stack(rows_x) if rows_x else torch.zeros(0, H, dtype=x.dtype),
        "row_token": torch.tensor(row_token, dtype=torch.int64),
        "row_slot": torch.tensor(row_slot, dtype=torch.int64),
        "probs": torch.tensor(probs, dtype=torch.float64),
        "counts": torch.tensor(counts, dtype=torch.int64),
        "padded": torch.tensor(padded, dtype=torch.int64),
    }


def ref_unpermute(y, row_token, num_tokens, probs=None):
    """Token by token, row by row, in float64."""
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float64)
    for r in range(y.shape[0]):
        t = int(row_token[r])
        if t >= 0:
            w = 1.0 if probs is None else float(probs[r])
            out[t] += w * y[r].double()
    return out


def random_routing(T, k, E, *, drop=0.2, distinct=True, generator=None):
    """[T, k] ids, distinct per token when asked, with about ``drop`` of them set to -1."""
    g = generator
    if distinct and k <= E:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else None
        if idx is None:
            idx = torch.zeros(0, k, dtype=torch.int64)
    else:
        idx = torch.randint(0, E, (T, k), generator=g)
    mask = torch.rand(T, k, generator=g) < drop
    return torch.where(mask, torch.full_like(idx, -1), idx)


# --------------------------------------------------------------------------- permute


@pytest.mark.parametrize(
    ("T", "k", "E", "align", "distinct"),
    [
        (1, 1, 1, 1, True),
        (7, 2, 4, 1, True),
        (13, 3, 5, 1, False),
        (16, 4, 8, 4, True),
        (9, 3, 3, 8, False),
        (20, 6, 16, 3, True),
    ],
)
def test_permute_matches_reference(T, k, E, align, distinct, device):
    x = torch.randn(T, 5)
    idx = random_routing(T, k, E, distinct=distinct)
    probs = torch.rand(T, k)
    perm = permute(x.to(device), idx.to(device), E, topk_probs=probs.to(device), align=align)
    ref = ref_permute(x, idx, E, probs, align)
    assert isinstance(perm, Permutation)
    assert perm.num_tokens == T
    assert perm.x.device == device and perm.row_token.device == device
    assert torch.equal(perm.row_token.cpu(), ref["row_token"])
    assert torch.equal(perm.row_slot.cpu(), ref["row_slot"])
    assert torch.equal(perm.x.cpu(), ref["x"])
    assert perm.probs is not None and perm.probs.dtype == torch.float32
    assert torch.equal(perm.probs.cpu().double(), ref["probs"].float().double())
    assert perm.tokens_per_expert.dtype == torch.int64
    assert perm.padded_tokens_per_expert.dtype == torch.int64
    assert torch.equal(perm.tokens_per_expert.cpu(), ref["counts"])
    assert torch.equal(perm.padded_tokens_per_expert.cpu(), ref["padded"])


def test_permute_without_probs_has_none_and_int64_maps():
    x = torch.randn(6, 3)
    idx = random_routing(6, 2, 4)
    perm = permute(x, idx, 4)
    assert perm.probs is None
    assert perm.row_token.dtype == torch.int64 and perm.row_slot.dtype == torch.int64


def test_align_padding_layout():
    T, k, E, align = 11, 3, 4, 4
    idx = random_routing(T, k, E)
    x = torch.randn(T, 2) + 10.0  # no real row is zero
    perm = permute(x, idx, E, topk_probs=torch.rand(T, k), align=align)
    padded = perm.padded_tokens_per_expert.tolist()
    counts = perm.tokens_per_expert.tolist()
    start = 0
    for e in range(E):
        assert padded[e] % align == 0 and counts[e] <= padded[e] < counts[e] + align
        seg_tok = perm.row_token[start : start + padded[e]]
        assert (seg_tok[: counts[e]] >= 0).all() and (seg_tok[counts[e] :] == -1).all()
        assert (idx[seg_tok[: counts[e]], perm.row_slot[start : start + counts[e]]] == e).all()
        pad = slice(start + counts[e], start + padded[e])
        assert (perm.x[pad] == 0).all() and (perm.probs[pad] == 0).all()
        assert (perm.row_slot[pad] == -1).all()
        start += padded[e]
    assert start == perm.x.shape[0]


def _forbid_host_sync(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("host sync in static mode")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)


@pytest.mark.parametrize("align", [1, 4])
def test_static_mode_prefix_tail_and_no_sync(monkeypatch, align):
    T, k, E = 10, 3, 5
    idx = random_routing(T, k, E)
    x = torch.randn(T, 4)
    probs = torch.rand(T, k)
    exact = permute(x, idx, E, topk_probs=probs, align=align)
    bound = T * k + E * (align - 1)
    n = exact.x.shape[0]
    for extra in (0, 7):
        with monkeypatch.context() as m:
            _forbid_host_sync(m)
            static = permute(x, idx, E, topk_probs=probs, align=align, static_rows=bound + extra)
        assert static.x.shape == (bound + extra, 4)
        assert torch.equal(static.x[:n], exact.x)
        assert torch.equal(static.row_token[:n], exact.row_token)
        assert torch.equal(static.row_slot[:n], exact.row_slot)
        assert torch.equal(static.probs[:n], exact.probs)
        assert (static.x[n:] == 0).all() and (static.probs[n:] == 0).all()
        assert (static.row_token[n:] == -1).all() and (static.row_slot[n:] == -1).all()
        assert torch.equal(static.tokens_per_expert, exact.tokens_per_expert)
        assert torch.equal(static.padded_tokens_per_expert, exact.padded_tokens_per_expert)
        with monkeypatch.context() as m:
            _forbid_host_sync(m)
            back = unpermute(static.x, static, probs=static.probs)
        assert torch.equal(back, unpermute(exact.x, exact, probs=exact.probs))


def test_static_mode_runs_on_meta():
    T, k, E, H, align = 8, 2, 4, 16, 2
    x = torch.empty(T, H, device="meta")
    idx = torch.empty(T, k, dtype=torch.int64, device="meta")
    probs = torch.empty(T, k, device="meta")
    rows = T * k + E * (align - 1)
    perm = permute(x, idx, E, topk_probs=probs, align=align, static_rows=rows)
    assert perm.x.shape == (rows, H) and perm.x.device.type == "meta"
    assert perm.probs.shape == (rows,)
    out = unpermute(perm.x, perm, probs=perm.probs)
    assert out.shape == (T, H) and out.device.type == "meta"


def test_static_mode_rejects_rows_below_bound():
    T, k, E, align = 6, 2, 3, 4
    idx = random_routing(T, k, E)
    x = torch.randn(T, 2)
    bound = T * k + E * (align - 1)
    permute(x, idx, E, align=align, static_rows=bound)
    with pytest.raises(ValueError, match=rf"static_rows={bound - 1}.*{bound}"):
        permute(x, idx, E, align=align, static_rows=bound - 1)


def test_empty_and_all_dropped():
    x = torch.randn(0, 4)
    idx = torch.zeros(0, 3, dtype=torch.int64)
    perm = permute(x, idx, 5, topk_probs=torch.zeros(0, 3))
    assert perm.x.shape == (0, 4) and perm.probs.shape == (0,)
    assert torch.equal(perm.tokens_per_expert, torch.zeros(5, dtype=torch.int64))
    assert unpermute(perm.x, perm).shape == (0, 4)
    static = permute(x, idx, 5, align=2, static_rows=5)
    assert static.x.shape == (5, 4) and (static.x == 0).all() and (static.row_token == -1).all()
    assert unpermute(static.x, static).shape == (0, 4)

    x = torch.randn(4, 3)
    idx = torch.full((4, 2), -1, dtype=torch.int64)
    perm = permute(x, idx, 3, topk_probs=torch.zeros(4, 2), align=4)
    assert perm.x.shape == (0, 3)
    assert torch.equal(unpermute(perm.x, perm), torch.zeros(4, 3))
    static = permute(x, idx, 3, align=4, static_rows=20)
    assert (static.x == 0).all() and (static.row_token == -1).all()
    assert torch.equal(unpermute(static.x, static), torch.zeros(4, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_rows_are_copied_bit_exactly(dtype):
    T, k, E = 12, 4, 6
    x = torch.randn(T, 8).to(dtype)
    idx = random_routing(T, k, E)
    perm = permute(x, idx, E, align=2)
    ref = ref_permute(x, idx, E, None, 2)
    assert perm.x.dtype == dtype
    assert torch.equal(perm.x, ref["x"])


def test_out_of_range_ids_are_dropped_without_checks_and_caught_with():
    x = torch.randn(3, 2)
    idx = torch.tensor([[0, 5], [-3, 1], [2, -1]])
    perm = permute(x, idx, 3, checks=False)
    assert perm.tokens_per_expert.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="topk_idx"):
        permute(x, idx, 3, checks=True)


# --------------------------------------------------------------------------- unpermute


@pytest.mark.parametrize("align", [1, 3])
@pytest.mark.parametrize("static", [False, True])
def test_unpermute_matches_reference_and_ignores_padding(align, static, device):
    T, k, E, H = 14, 3, 5, 6
    idx = random_routing(T, k, E, distinct=False)
    perm = permute(
        torch.randn(T, H).to(device),
        idx.to(device),
        E,
        align=align,
        static_rows=T * k + E * (align - 1) + 2 if static else None,
    )
    N = perm.x.shape[0]
    row_token = perm.row_token.cpu()
    y = torch.randn(N, H, dtype=torch.float64)
    y[row_token < 0] = float("nan")  # padding rows must not leak into any token
    probs = torch.rand(N, dtype=torch.float64)
    out = unpermute(y.to(device), perm)
    assert out.device == device
    assert out.dtype == torch.float64 and not out.isnan().any()
    torch.testing.assert_close(out.cpu(), ref_unpermute(y, row_token, T))
    out_w = unpermute(y.to(device), perm, probs=probs.to(device))
    torch.testing.assert_close(out_w.cpu(), ref_unpermute(y, row_token, T, probs))


def test_unpermute_bf16_accumulates_in_fp32():
    # One token, 9 rows: 256 + 8 * 1 = 264 is a bf16 number, but a bf16 running sum stays at 256.
    k = 9
    x = torch.zeros(1, 1, dtype=torch.bfloat16)
    idx = torch.arange(k).view(1, k)
    perm = permute(x, idx, k)
    y = torch.ones(k, 1, dtype=torch.bfloat16)
    y[0] = 256.0
    assert unpermute(y, perm).item() == 264.0
    probs = torch.full((k,), 0.5)
    probs[0] = 1.0
    out_w = unpermute(y, perm, probs=probs)
    assert out_w.dtype == torch.bfloat16 and out_w.item() == 260.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpermute_16bit_matches_fp64_reference(dtype, device):
    T, k, E, H = 16, 4, 8, 32
    idx = random_routing(T, k, E)
    perm = permute(
        torch.randn(T, H).to(device, dtype),
        idx.to(device),
        E,
        topk_probs=torch.rand(T, k).to(device),
        align=2,
    )
    y = torch.randn(perm.x.shape[0], H).to(dtype)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for probs in (None, perm.probs):
        out = unpermute(y.to(device), perm, probs=probs)
        assert out.dtype == dtype and out.device == device
        ref_probs = None if probs is None else probs.cpu()
        ref = ref_unpermute(y, perm.row_token.cpu(), T, ref_probs).to(dtype)
        torch.testing.assert_close(out.cpu(), ref, atol=1e-3, rtol=ulp)


def test_unpermute_bf16_probs_keep_fp32_precision():
    # Rounding the probs to bf16 before weighting agrees with the exact result on ~60% of the
    # entries; weighting with fp32 probs and accumulating in fp32 agrees on nearly all.
    T, k, E, H = 64, 8, 8, 64
    idx = random_routing(T, k, E, drop=0.0)
    perm = permute(torch.zeros(T, H).bfloat16(), idx, E, topk_probs=torch.rand(T, k))
    y = torch.randn(perm.x.shape[0], H).bfloat16()
    exact = ref_unpermute(y, perm.row_token, T, perm.probs).bfloat16()
    out = unpermute(y, perm, probs=perm.probs)
    assert (out == exact).double().mean() > 0.99
    torch.testing.assert_close(out, exact, atol=0, rtol=2**-7)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(0, 12),
    k=st.integers(1, 4),
    E=st.integers(1, 6),
    align=st.integers(1, 4),
    static=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(T, k, E, align, static, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 3, dtype=torch.float64, generator=g)
    idx = random_routing(T, k, E, distinct=False, drop=0.3, generator=g)
    probs = torch.rand(T, k, dtype=torch.float64, generator=g)
    rows = T * k + E * (align - 1) if static else None
    perm = permute(x, idx, E, topk_probs=probs, align=align, static_rows=rows)
    valid = (idx >= 0).double()
    torch.testing.assert_close(
        unpermute(perm.x, perm, probs=perm.probs), x * (probs * valid).sum(1, keepdim=True)
    )
    torch.testing.assert_close(unpermute(perm.x, perm), x * valid.sum(1, keepdim=True))
    assert int(perm.tokens_per_expert.sum()) == int((idx >= 0).sum())


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize(("align", "static"), [(1, False), (3, False), (2, True)])
def test_gradcheck_permute(align, static):
    T, k, E = 5, 3, 4
    idx = random_routing(T, k, E, distinct=False)
    x = torch.randn(T, 3, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    rows = T * k + E * (align - 1) + 1 if static else None

    def fn(x, probs):
        perm = permute(x, idx, E, topk_probs=probs, align=align, static_rows=rows)
        return perm.x, perm.probs

    assert torch.autograd.gradcheck(fn, (x, probs))


@pytest.mark.parametrize("chunk_elements", [None, 7])
@pytest.mark.parametrize("align", [1, 2])
def test_gradcheck_unpermute(align, chunk_elements, monkeypatch):
    if chunk_elements is not None:  # several chunks in the weighted backward
        monkeypatch.setattr(permute_module, "_BACKWARD_CHUNK_ELEMENTS", chunk_elements)
    T, k, E = 5, 3, 4
    idx = random_routing(T, k, E, distinct=False)
    perm = permute(torch.randn(T, 3, dtype=torch.float64), idx, E, align=align)
    N = perm.x.shape[0]
    y = torch.randn(N, 3, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(N, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, p: unpermute(y, perm, probs=p), (y, probs))
    assert torch.autograd.gradcheck(lambda y: unpermute(y, perm), (y,))


@pytest.mark.parametrize("chunk_elements", [None, 11])
def test_end_to_end_gradient_matches_reference(chunk_elements, monkeypatch, device):
    if chunk_elements is not None:
        monkeypatch.setattr(permute_module, "_BACKWARD_CHUNK_ELEMENTS", chunk_elements)
    T, k, E, H = 9, 3, 4, 5
    idx = random_routing(T, k, E)
    x = torch.randn(T, H, dtype=torch.float64, device=device, requires_grad=True)
    probs = torch.rand(T, k, dtype=torch.float64, device=device, requires_grad=True)
    perm = permute(x, idx.to(device), E, topk_probs=probs, align=2)
    scale = torch.arange(1, perm.x.shape[0] + 1, dtype=torch.float64, device=device).unsqueeze(1)
    out = unpermute(perm.x * scale, perm, probs=perm.probs)
    out.square().sum().backward()
    # Reference: the same function written per token, on the CPU.
    x2 = x.detach().cpu().requires_grad_(True)
    p2 = probs.detach().cpu().requires_grad_(True)
    rows = {
        (int(t), int(s)): r
        for r, (t, s) in enumerate(
            zip(perm.row_token.tolist(), perm.row_slot.tolist(), strict=True)
        )
    }
    ref = []
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float64)
        for s in range(k):
            if (t, s) in rows:
                acc = acc + p2[t, s] * x2[t] * float(rows[(t, s)] + 1)
        ref.append(acc)
    torch.stack(ref).square().sum().backward()
    assert x.grad.device == device
    torch.testing.assert_close(x.grad.cpu(), x2.grad)
    torch.testing.assert_close(probs.grad.cpu(), p2.grad)


def test_bf16_gradients_accumulate_in_fp32():
    # dL/dx[0] = sum of 9 row gradients 256, 1, ..., 1 = 264 (a bf16 running sum would say 256).
    k = 9
    x = torch.zeros(1, 1, dtype=torch.bfloat16, requires_grad=True)
    perm = permute(x, torch.arange(k).view(1, k), k)
    w = torch.ones(k, 1, dtype=torch.bfloat16)
    w[0] = 256.0
    (perm.x * w).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.item() == 264.0


# --------------------------------------------------------------------------- determinism


def test_two_runs_are_bit_identical():
    T, k, E, H = 64, 4, 8, 16

    def run():
        torch.manual_seed(1)
        idx = random_routing(T, k, E, distinct=False)
        x = torch.randn(T, H, requires_grad=True)
        probs = torch.rand(T, k, requires_grad=True)
        perm = permute(x, idx, E, topk_probs=probs, align=4)
        y = perm.x * 1.5
        out = unpermute(y, perm, probs=perm.probs)
        out.sum().backward()
        return perm.x, perm.probs, out, x.grad, probs.grad

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- bad inputs


def _good():
    return {
        "x": torch.randn(4, 3),
        "topk_idx": torch.zeros(4, 2, dtype=torch.int64),
        "num_experts": 2,
    }


@pytest.mark.parametrize(
    ("change", "error", "needle"),
    [
        ({"x": torch.randn(4)}, ValueError, "x must be 2-D"),
        ({"x": torch.ones(4, 3, dtype=torch.int64)}, TypeError, "x must be a floating"),
        ({"x": [[1.0]]}, TypeError, "x must be a torch.Tensor"),
        ({"topk_idx": torch.zeros(4, 2, dtype=torch.int32)}, TypeError, "topk_idx must have"),
        ({"topk_idx": torch.zeros(4, dtype=torch.int64)}, ValueError, "topk_idx must be 2-D"),
        ({"topk_idx": torch.zeros(5, 2, dtype=torch.int64)}, ValueError, "topk_idx has 5 rows"),
        ({"topk_probs": torch.rand(4, 3)}, ValueError, "topk_probs has shape"),
        ({"topk_probs": torch.ones(4, 2, dtype=torch.int64)}, TypeError, "topk_probs must be"),
        ({"num_experts": 0}, ValueError, "num_experts must be >= 1"),
        ({"num_experts": 2.0}, TypeError, "num_experts must be an int"),
        ({"align": 0}, ValueError, "align must be >= 1"),
        ({"static_rows": -1}, ValueError, "static_rows must be >= 0"),
        ({"static_rows": 7}, ValueError, "static_rows=7"),
        ({"topk_idx": torch.zeros(4, 2, dtype=torch.int64, device="meta")}, ValueError, "device"),
    ],
)
def test_permute_bad_inputs(change, error, needle):
    kwargs = _good()
    kwargs.update(change)
    with pytest.raises(error, match=needle):
        permute(**kwargs)


def test_unpermute_bad_inputs():
    perm = permute(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.int64), 2)
    N = perm.x.shape[0]
    with pytest.raises(TypeError, match="perm must be"):
        unpermute(torch.randn(N, 3), "perm")
    with pytest.raises(ValueError, match="y has 7 rows"):
        unpermute(torch.randn(7, 3), perm)
    with pytest.raises(ValueError, match="hidden size 4"):
        unpermute(torch.randn(N, 4), perm)
    with pytest.raises(TypeError, match="y must be a floating"):
        unpermute(torch.ones(N, 3, dtype=torch.int64), perm)
    with pytest.raises(ValueError, match="probs has shape"):
        unpermute(torch.randn(N, 3), perm, probs=torch.rand(N + 1))
    with pytest.raises(ValueError, match="probs must be 1-D"):
        unpermute(torch.randn(N, 3), perm, probs=torch.rand(N, 1))
    with pytest.raises(TypeError, match="probs must be a floating"):
        unpermute(torch.randn(N, 3), perm, probs=torch.ones(N, dtype=torch.int64))


def test_num_rows_skips_the_host_sync(monkeypatch):
    x = torch.randn(10, 8)
    idx = torch.randint(-1, 5, (10, 3))
    probs = torch.rand(10, 3)
    want = permute(x, idx, 5, topk_probs=probs)
    n = int((idx >= 0).sum())

    def no_item(self):
        raise AssertionError("permute(num_rows=...) must not read a value on the host")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    got = permute(x, idx, 5, topk_probs=probs, num_rows=n, checks=False)
    monkeypatch.undo()
    assert torch.equal(got.x, want.x) and torch.equal(got.probs, want.probs)
    assert torch.equal(got.row_token, want.row_token)
    with pytest.raises(ValueError, match=f"num_rows={n + 1} but the routing holds {n} rows"):
        permute(x, idx, 5, num_rows=n + 1, checks=True)
    with pytest.raises(ValueError, match="not both"):
        permute(x, idx, 5, num_rows=n, static_rows=30)
    with pytest.raises(ValueError, match="num_rows"):
        permute(x, idx, 5, num_rows=-1)


# --------------------------------------------------------------------------- memory and op count


@pytest.mark.parametrize("static", [False, True])
def test_out_buffer_receives_the_rows(static):
    x = torch.randn(12, 16, requires_grad=True)
    idx = torch.randint(-1, 6, (12, 3))
    probs = torch.rand(12, 3)
    kw = {"static_rows": 36} if static else {}
    want = permute(x, idx, 6, topk_probs=probs, **kw)
    buf = torch.full(tuple(want.x.shape), float("nan"))
    got = permute(x, idx, 6, topk_probs=probs, out=buf, **kw)
    assert got.x.data_ptr() == buf.data_ptr()
    assert torch.equal(got.x, want.x) and torch.equal(got.row_token, want.row_token)
    # gradients flow through the rows written into ``out``
    (got.x * torch.arange(got.x.shape[0]).unsqueeze(1)).sum().backward()
    g1 = x.grad.clone()
    x.grad = None
    (want.x * torch.arange(want.x.shape[0]).unsqueeze(1)).sum().backward()
    assert torch.equal(g1, x.grad)


def test_out_buffer_is_checked():
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [1, 2], [2, -1], [0, 0]])
    with pytest.raises(ValueError, match=r"out must be a \[7, 8\] float32"):
        permute(x, idx, 3, out=torch.empty(8, 8))
    with pytest.raises(ValueError, match="out must be a"):
        permute(x, idx, 3, out=torch.empty(7, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        permute(x, idx, 3, out=torch.empty(8, 7).t())
    with pytest.raises(ValueError, match="require grad"):
        permute(x, idx, 3, out=torch.empty(7, 8, requires_grad=True))


def test_cpu_rows_come_from_the_output_pool_and_are_never_overwritten_while_held():
    from flexdispatch._pool import MIN_BYTES, OUTPUT_POOL

    if not OUTPUT_POOL.enabled:
        pytest.skip("this torch has no storage use count: nothing is pooled")
    H = 256
    T = MIN_BYTES // (H * 4) + 1  # x rows (k = 1) just above the pool's threshold
    x = torch.randn(T, H)
    idx = torch.zeros(T, 1, dtype=torch.int64)
    first = permute(x, idx, 1)
    ptr = first.x.data_ptr()
    held = first.x.clone()
    second = permute(x * 2, idx, 1)  # ``first`` still holds its rows: new memory
    assert second.x.data_ptr() != ptr
    assert torch.equal(first.x, held)
    del first, held
    reused = OUTPUT_POOL.reused
    third = permute(x * 3, idx, 1)
    assert third.x.data_ptr() == ptr  # the dropped output's memory is lent again
    assert OUTPUT_POOL.reused == reused + 1
    assert torch.equal(third.x, x * 3)


def test_arange_cache_grows_and_is_not_written():
    from flexdispatch import _pool

    a = _pool.arange(5, torch.device("cpu"))
    assert torch.equal(a, torch.arange(5))
    b = _pool.arange(1000, torch.device("cpu"))
    assert torch.equal(b, torch.arange(1000))
    assert torch.equal(_pool.arange(3, torch.device("cpu")), torch.arange(3))
    with torch.inference_mode():
        c = _pool.arange(5000, torch.device("cpu"))
    assert not c.is_inference() and torch.equal(c, torch.arange(5000))


def _count_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_permute_unpermute_op_count():
    """Non-view ATen ops of exact permute + weighted unpermute (the issue-13 shape, smaller H):
    71 before the lean path; each one is a kernel launch on a GPU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g).bfloat16()
    idx = torch.rand(512, 64, generator=g).argsort(1)[:, :8].contiguous()
    probs = torch.rand(512, 8, generator=g)

    def run():
        perm = permute(x, idx, 64, topk_probs=probs)
        unpermute(perm.x, perm, probs=perm.probs)

    run()
    assert _count_ops(run) <= 25


def test_num_out_rows_is_the_old_name_of_static_rows():
    x, idx = torch.randn(3, 4), torch.tensor([[0, 1], [1, -1], [2, 0]])
    with pytest.warns(DeprecationWarning, match=r"permute\(static_rows=\.\.\.\)"):
        old = permute(x, idx, 3, num_out_rows=8)
    new = permute(x, idx, 3, static_rows=8)
    assert torch.equal(old.x, new.x) and torch.equal(old.row_token, new.row_token)
    with pytest.raises(TypeError, match="not both"), pytest.warns(DeprecationWarning):
        permute(x, idx, 3, num_out_rows=8, static_rows=8)
