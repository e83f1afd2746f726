"""Pure helpers of the DeepEP backend (flexdispatch/backends/deepep/sizing.py), on the CPU.

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · N nodes · H hidden · E experts ·
e = E / R · k top-k · W worst-case rows.

Sizing is checked against the emulator's ``Config`` objects and a fake module that records what
it is asked; masks and counts against per-row Python loops; sync-freedom by making every
host-reading tensor method raise while the helpers run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexdispatch.backends.deepep import sizing as S
from tests.deepep_emu.load import emulator_or_skip

emu = emulator_or_skip()  # NOTE: the whole module skips, with the reason, without the wheel


# --------------------------------------------------------------------- sizing
@pytest.mark.parametrize(("n", "want"), [(0, 0), (1, 128), (128, 128), (129, 256), (1000, 1024)])
def test_align_bytes(n: int, want: int) -> None:
    assert S.align_bytes(n) == want
    with pytest.raises(ValueError, match="num_bytes"):
        S.align_bytes(-1)


@pytest.mark.parametrize(("H", "elem", "want"), [(7168, 2, 14336), (7168, 1, 14336), (64, 4, 256)])
def test_hidden_bytes_uses_at_least_two_bytes(H: int, elem: int, want: int) -> None:
    assert S.hidden_bytes(H, elem) == want
    with pytest.raises(ValueError, match="hidden"):
        S.hidden_bytes(0, 2)


@pytest.mark.parametrize("R", [2, 4, 8, 16, 32])
@pytest.mark.parametrize("H", [64, 2048, 7168])
def test_normal_buffer_size_is_max_of_deepep_hints(R: int, H: int) -> None:
    got = S.normal_buffer_size(emu, R, S.hidden_bytes(H, 2))
    cfgs = [emu.Buffer.get_dispatch_config(R), emu.Buffer.get_combine_config(R)]
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in cfgs)
    rdma = max(c.get_rdma_buffer_size_hint(H * 2, R) for c in cfgs)
    assert (got.num_nvl_bytes, got.num_rdma_bytes) == (nvl, rdma)
    assert got.num_nvl_bytes % 128 == 0 and got.num_rdma_bytes % 128 == 0
    assert (got.num_rdma_bytes > 0) == (R > 8)


def test_normal_buffer_size_asks_both_configs_and_aligns() -> None:
    asked: list[tuple[str, int, int]] = []

    def cfg(name: str, nvl: int, rdma: int) -> SimpleNamespace:
        def hint(kind: str, value: int) -> object:
            def f(hidden_bytes: int, num_ranks: int) -> int:
                asked.append((f"{name}.{kind}", hidden_bytes, num_ranks))
                return value

            return f

        return SimpleNamespace(
            get_nvl_buffer_size_hint=hint("nvl", nvl), get_rdma_buffer_size_hint=hint("rdma", rdma)
        )

    fake = SimpleNamespace(
        Buffer=SimpleNamespace(
            get_dispatch_config=lambda R: cfg("dispatch", 1000, 5),
            get_combine_config=lambda R: cfg("combine", 300, 700),
        )
    )
    got = S.normal_buffer_size(fake, 4, 4096)  # type: ignore[arg-type]
    assert got == S.BufferSize(num_nvl_bytes=1024, num_rdma_bytes=768)
    assert sorted(a[0] for a in asked) == [
        "combine.nvl",
        "combine.rdma",
        "dispatch.nvl",
        "dispatch.rdma",
    ]
    assert {a[1:] for a in asked} == {(4096, 4)}


def test_normal_buffer_size_unknown_rank_count() -> None:
    with pytest.raises(ValueError, match="no tuned config for 6 ranks"):
        S.normal_buffer_size(emu, 6, 1024)


def test_low_latency_buffer_size_is_the_hint() -> None:
    got = S.low_latency_buffer_size(
        emu, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=16, num_experts=256
    )
    assert got.num_nvl_bytes == 0
    assert got.num_rdma_bytes == emu.Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 256)


def test_growth_policy_examples() -> None:
    small = S.BufferSize(num_nvl_bytes=1024, num_rdma_bytes=0)
    wide = S.BufferSize(num_nvl_bytes=4096, num_rdma_bytes=0)
    ll = S.BufferSize(num_nvl_bytes=0, num_rdma_bytes=2048)
    assert S.grow_buffer_size(None, small) == small  # first call allocates
    assert S.grow_buffer_size(wide, small) is None  # reuse
    assert S.grow_buffer_size(small, small) is None
    assert S.grow_buffer_size(small, wide) == wide  # hidden size grew
    assert S.grow_buffer_size(wide, ll) == S.BufferSize(num_nvl_bytes=4096, num_rdma_bytes=2048)


sizes = st.builds(
    S.BufferSize,
    num_nvl_bytes=st.integers(0, 10).map(lambda i: 128 * i),
    num_rdma_bytes=st.integers(0, 10).map(lambda i: 128 * i),
)


@settings(max_examples=60, deadline=None)
@given(cur=st.none() | sizes, req=sizes)
def test_growth_policy_properties(cur: S.BufferSize | None, req: S.BufferSize) -> None:
    new = S.grow_buffer_size(cur, req)
    if new is None:
        assert cur is not None and cur.covers(req)
    else:
        assert new.covers(req) and (cur is None or new.covers(cur))
        assert cur is None or not cur.covers(req)


# --------------------------------------------------------------------- support checks
TOPOLOGY_CASES = [
    # (R, L, W, ok, words in the reason)
    (1, 1, 0, False, "at least 2"),
    (2, 2, 0, True, "intranode"),
    (4, 4, 64, True, "intranode"),
    (8, 8, 0, True, "intranode"),
    (6, 6, 0, False, "2/4/8"),
    (3, 3, 0, False, "2/4/8"),
    (4, 2, 0, False, "one NVLink domain"),
    (8, 4, 0, False, "one NVLink domain"),
    (16, 8, 0, True, "internode"),
    (128, 8, 0, True, "internode"),
    (16, 4, 0, False, "rank // 8"),
    (24, 8, 0, False, "not 3"),
    (256, 8, 0, False, "not 32"),
    (16, 8, 128, False, "intranode only"),
    (16, 16, 0, False, "at most 8"),
    (8, 3, 0, False, "not a multiple"),
]


@pytest.mark.parametrize(("R", "L", "W", "ok", "why"), TOPOLOGY_CASES)
def test_check_topology(R: int, L: int, W: int, ok: bool, why: str) -> None:
    got, reason = S.check_topology(R, L, num_worst_tokens=W)
    assert got is ok and why in reason, reason


def test_check_topology_lists_are_arguments() -> None:
    assert S.check_topology(144, 8, internode_node_counts=(18,))[0]
    assert not S.check_topology(144, 8)[0]


@pytest.mark.parametrize(
    ("H", "elem", "ok"), [(64, 2, True), (4, 2, False), (4, 4, True), (7, 4, False)]
)
def test_check_row_bytes(H: int, elem: int, ok: bool) -> None:
    got, reason = S.check_row_bytes(H, elem)
    assert got is ok and (ok or "16 bytes" in reason)


def test_check_low_latency() -> None:
    base = {"hidden": 7168, "topk": 8, "num_experts": 256, "num_ranks": 16}
    assert S.check_low_latency(**base, num_max_dispatch_tokens_per_rank=128)[0]
    bad = [
        ({**base, "hidden": 3072}, "hidden sizes"),
        ({**base, "topk": 12}, "1..11"),
        ({**base, "num_experts": 250}, "divisible"),
    ]
    for kw, why in bad:
        ok, reason = S.check_low_latency(**kw, num_max_dispatch_tokens_per_rank=128)
        assert not ok and why in reason, reason
    for n in (0, 1025):
        assert not S.check_low_latency(**base, num_max_dispatch_tokens_per_rank=n)[0]
    custom = (*S.LOW_LATENCY_HIDDEN_SIZES, 3072)
    assert S.check_low_latency(
        **{**base, "hidden": 3072}, num_max_dispatch_tokens_per_rank=8, hidden_sizes=custom
    )[0]


# --------------------------------------------------------------------- tensor helpers
def worst_case_receive(seed: int, W: int, M: int, k: int, e: int, H: int) -> tuple:
    """A DeepEP-like worst-case receive: M real rows, then garbage (NaN / huge) and -1 ids."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, e, (W, k), generator=g)
    idx[:M, 0] = torch.randint(0, e, (M,), generator=g)  # every real row has a local expert
    idx[M:] = -1
    x = torch.randn(W, H, generator=g)
    x[M:] = float("nan")
    x[M::2] = 3e38
    probs = torch.rand(W, k, generator=g)
    probs[M:] = float("nan")
    return x, idx, probs


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    W=st.integers(0, 12),
    k=st.integers(1, 4),
    e=st.integers(1, 5),
    data=st.data(),
)
def test_mask_worst_case_against_loops(
    seed: int, W: int, k: int, e: int, data: st.DataObject
) -> None:
    M = data.draw(st.integers(0, W))
    x, idx, probs = worst_case_receive(seed, W, M, k, e, 8)
    out = S.mask_worst_case(x.to(torch.bfloat16), idx, probs, e)
    counts = [0] * e
    for r in range(W):
        real = any(i >= 0 for i in idx[r].tolist())
        assert bool(out.valid[r]) is real is (r < M)
        if real:
            assert torch.equal(out.recv_x[r], x[r].to(torch.bfloat16))
        else:
            assert bool((out.recv_x[r] == 0).all())
        for j in range(k):
            i = int(idx[r, j])
            assert float(out.recv_topk_probs[r, j]) == (float(probs[r, j]) if i >= 0 else 0.0)
            if i >= 0:
                counts[i] += 1
    assert out.num_recv_tokens_per_expert.tolist() == counts
    assert out.num_recv_tokens_per_expert.dtype == torch.int64
    assert out.recv_x.dtype == torch.bfloat16 and out.recv_topk_probs.dtype == torch.float32


def test_zero_invalid_rows_any_dtype_and_rank() -> None:
    valid = torch.tensor([True, False, True])
    x8 = torch.full((3, 16), float("nan")).to(torch.float8_e4m3fn)
    out = S.zero_invalid_rows(x8, valid)
    assert out.dtype == torch.float8_e4m3fn
    assert bool((out[1].float() == 0).all()) and bool(torch.isnan(out[0].float()).all())
    x3 = torch.full((3, 2, 5), float("inf"))
    assert torch.equal(S.zero_invalid_rows(x3, valid)[1], torch.zeros(2, 5))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000), rows=st.integers(0, 30), k=st.integers(1, 6), e=st.integers(1, 7)
)
def test_count_local_experts_against_loop(seed: int, rows: int, k: int, e: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, e, (rows, k), generator=g)
    want = [0] * e
    for i in idx.flatten().tolist():
        if i >= 0:
            want[i] += 1
    assert S.count_local_experts(idx, e).tolist() == want
    assert S.count_local_experts(idx.to(torch.int32), e).tolist() == want


def test_expert_major_valid_mask_against_loop() -> None:
    count = torch.tensor([0, 3, 5, 1], dtype=torch.int32)
    mask = S.expert_major_valid_mask(count, 5)
    assert mask.tolist() == [[i < int(c) for i in range(5)] for c in count]


def test_helpers_never_read_values_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    x, idx, probs = worst_case_receive(3, 9, 5, 3, 4, 8)
    count = torch.tensor([1, 2, 0, 3])

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("host read of a tensor value (a device sync on CUDA)")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "bincount", boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    out = S.mask_worst_case(x, idx, probs, 4)
    S.expert_major_valid_mask(count, 6)
    S.count_local_experts(idx, 4)
    monkeypatch.undo()
    assert out.num_recv_tokens_per_expert.sum().item() == int((idx >= 0).sum())


# --------------------------------------------------------------------- wire format
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("X", [1, 3, 8, 13, 64])
def test_wire_format_moves_bits(dtype: torch.dtype, X: int) -> None:
    wire = S.WireFormat.of(dtype, X)
    assert wire.row_bytes % 16 == 0 and wire.wire_width % 8 == 0
    assert wire.row_bytes >= X * torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(0, 2**15, (5, X * torch.empty(0, dtype=dtype).element_size() // 2))
    x = bits.to(torch.int16).view(torch.bfloat16).contiguous().view(dtype)  # NaNs included
    w = wire.send(x)
    assert w.dtype == torch.bfloat16 and w.shape == (5, wire.wire_width) and w.is_contiguous()
    back = wire.recv(w)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    # a received block that is a view at an odd offset still comes back intact
    shifted = torch.cat([torch.zeros(1, wire.wire_width, dtype=torch.bfloat16), w])[1:]
    assert torch.equal(wire.recv(shifted).view(torch.uint8), x.view(torch.uint8))
    assert wire.recv(w[:0]).shape == (0, X)


def test_wire_format_refuses_fp8() -> None:
    with pytest.raises(ValueError, match="tuple"):
        S.WireFormat.of(torch.float8_e4m3fn, 16)


# --------------------------------------------------------------------- config rules
def test_dispatch_config_graph_and_deepep_rules() -> None:
    from flexdispatch import DispatchConfig

    with pytest.raises(ValueError, match="cuda_graph=True with a dropless"):
        DispatchConfig(cuda_graph=True)
    DispatchConfig(cuda_graph=True, num_worst_tokens=64)
    DispatchConfig(cuda_graph=True, mode="low_latency")
    with pytest.raises(ValueError, match="must be even"):
        DispatchConfig(deepep_num_sms=23)
    with pytest.raises(ValueError, match="low-latency hidden sizes"):
        DispatchConfig(backend="deepep", mode="low_latency", hidden_size=3000)
    DispatchConfig(backend="auto", mode="low_latency", hidden_size=3000)  # torch can decode it
    with pytest.raises(ValueError, match="1024"):
        DispatchConfig(backend="deepep", mode="low_latency", num_max_dispatch_tokens_per_rank=2048)
    cfg = DispatchConfig(backend="deepep", num_worst_tokens=256, cuda_graph=True, deepep_api="v1")
    cfg.check_world(8, 8)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs it.*intranode only"):
        cfg.check_world(16, 8)
    with pytest.raises(ValueError, match="rank // 8"):
        DispatchConfig(backend="deepep").check_world(16, 4)
    DispatchConfig(backend="torch", num_worst_tokens=256).check_world(16, 4)
