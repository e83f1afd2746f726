"""Sizes refused before anything is allocated: one ValueError naming the argument, the value, the
estimate and the memory available (``flexdispatch._checks.fits``)."""

from __future__ import annotations

import time

import pytest
import torch

from flexdispatch import (
    DispatchConfig,
    FlexDispatcher,
    MoEConfig,
    MoELayer,
    RouterConfig,
    TopKRouter,
    get_dispatch_layout,
    permute,
    unpermute,
)
from flexdispatch._checks import fits
from flexdispatch.types import Permutation

pytestmark = pytest.mark.timeout(60)

HUGE = 10**13  # more than any machine: every estimate below is at least this many bytes
_EST = r"needs about [\d.]+ [KMGTP]i?B .*more than the [\d.]+ [KMGTP]?i?B available on cpu"


def _idx(T: int = 16, k: int = 2, E: int = 8) -> torch.Tensor:
    """``[T, k]`` ids, distinct within each token (the dispatch contract refuses repeats)."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()


def _perm(num_tokens: int) -> Permutation:
    z = torch.zeros(4, dtype=torch.int64)
    return Permutation(
        x=torch.zeros(4, 8),
        probs=None,
        tokens_per_expert=z,
        padded_tokens_per_expert=z,
        row_token=z,
        row_slot=z,
        num_tokens=num_tokens,
    )


CASES = [
    (
        "FlexDispatcher/num_experts",
        lambda: FlexDispatcher(DispatchConfig(backend="torch"), num_experts=HUGE // 8),
        r"FlexDispatcher: num_experts=1250000000000 " + _EST,
    ),
    (
        "FlexDispatcher/num_worst_tokens",
        lambda: FlexDispatcher(
            DispatchConfig(backend="torch", num_worst_tokens=1 << 30, hidden_size=1 << 20),
            num_experts=8,
        ),
        r"FlexDispatcher: num_worst_tokens=1073741824 " + _EST + r".*dropless",
    ),
    (
        "get_dispatch_layout/num_experts",
        lambda: get_dispatch_layout(_idx(), 2 * HUGE, 2),
        r"get_dispatch_layout: num_experts=20000000000000 " + _EST,
    ),
    (
        "get_dispatch_layout/num_ranks",
        lambda: get_dispatch_layout(_idx(), HUGE // 1000, HUGE // 1000),
        r"get_dispatch_layout: num_(experts|ranks)=10000000000 " + _EST,
    ),
    (
        "permute/num_experts",
        lambda: permute(torch.randn(16, 8), _idx(), HUGE),
        r"permute: num_experts=10000000000000 " + _EST,
    ),
    (
        "permute/static_rows",
        lambda: permute(torch.randn(16, 8), _idx(), 8, static_rows=HUGE),
        r"permute: static_rows=10000000000000 " + _EST + r".*static bound",
    ),
    (
        "permute/align",
        lambda: permute(torch.randn(16, 8), _idx(), 8, align=HUGE),
        r"permute: align=10000000000000 " + _EST,
    ),
    (
        "unpermute/num_tokens",
        lambda: unpermute(torch.zeros(4, 8), _perm(HUGE)),
        r"unpermute: perm.num_tokens=10000000000000 " + _EST,
    ),
    (
        "TopKRouter/hidden_size",
        lambda: TopKRouter(RouterConfig(num_experts=1 << 20, topk=2), 1 << 24),
        r"TopKRouter: hidden_size=16777216 " + _EST,
    ),
    (
        "MoELayer/ffn_hidden_size",
        lambda: MoELayer(
            MoEConfig(
                hidden_size=1 << 16,
                ffn_hidden_size=1 << 20,
                router=RouterConfig(num_experts=8, topk=2),
            )
        ),
        r"MoELayer: ffn_hidden_size=1048576 " + _EST,
    ),
    (
        "MoELayer/num_worst_tokens",
        lambda: MoELayer(
            MoEConfig(
                hidden_size=1 << 16,
                ffn_hidden_size=8,
                router=RouterConfig(num_experts=8, topk=2),
                dispatch=DispatchConfig(num_worst_tokens=1 << 20),
            )
        ),
        r"MoELayer: dispatch.num_worst_tokens=1048576 " + _EST,
    ),
    (
        "MoELayer/num_worst_tokens/dispatcher",
        lambda: MoELayer(
            MoEConfig(
                hidden_size=1 << 16,
                ffn_hidden_size=8,
                router=RouterConfig(num_experts=8, topk=2),
                dispatch=DispatchConfig(num_worst_tokens=1 << 30),
            )
        ),
        r"FlexDispatcher: num_worst_tokens=1073741824 " + _EST,
    ),
    (
        "MoELayer/gate",
        lambda: MoELayer(
            MoEConfig(
                hidden_size=1 << 20,
                ffn_hidden_size=1,
                router=RouterConfig(num_experts=1 << 24, topk=2),
            )
        ),
        r"MoELayer: router.num_experts=16777216 " + _EST,
    ),
]


@pytest.mark.parametrize(("fn", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_size_that_cannot_fit_is_refused_up_front(fn, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        fn()
    assert time.perf_counter() - t0 < 5, "the refusal must come before any allocation"


@pytest.mark.parametrize(
    "field",
    ["num_worst_tokens", "num_max_dispatch_tokens_per_rank", "hidden_size", "expert_alignment"],
)
def test_config_size_fields_are_bounded(field):
    with pytest.raises(ValueError, match=rf"{field}\n.*less than or equal to 2147483647"):
        DispatchConfig(**{field: 1 << 31})
    DispatchConfig(**{field: 8})


def test_check_fits_names_everything_and_caches_what_fitted(monkeypatch):
    calls = []

    def fake(device, tree=False):
        calls.append((device, tree))
        return 1 << 30, "a test figure"

    monkeypatch.setattr(fits, "available_bytes", fake)
    monkeypatch.setattr(fits, "_FITTED", {})
    big = fits.SMALL_BYTES
    fits.check_fits("f", "n", 7, big, "cpu")
    fits.check_fits("f", "n", 7, big, "cpu")
    assert len(calls) == 1, "a shape that fitted is not checked again"
    fits.check_fits("f", "n", 7, 1 << 20, "cpu")  # small: nothing queried
    assert len(calls) == 1
    with pytest.raises(ValueError) as info:
        fits.check_fits("f", "n", 9, 3 << 30, "cpu", detail="why", fix="change n")
    assert str(info.value) == (
        "f: n=9 needs about 3.0 GiB (why), more than the 819.2 MiB available on cpu "
        "(80% of 1.0 GiB, a test figure; the rest is headroom): change n"
    )
    # N3: an estimate under the figure but above its 80 % share is refused (headroom)
    with pytest.raises(ValueError, match=r"n=10 needs about 921\.6 MiB, more than the 819\.2 MiB"):
        fits.check_fits("f", "n", 10, int(0.9 * (1 << 30)), "cpu")
    fits.check_fits("f", "n", 11, int(0.79 * (1 << 30)), "cpu")


def test_available_bytes_reads_the_process_limits():
    avail, source = fits.available_bytes("cpu")
    assert avail is not None and avail > 0 and source
    assert fits.available_bytes("meta")[0] is None


def test_ordinary_calls_do_not_query_memory(monkeypatch):
    def boom(device, tree=False):
        raise AssertionError("queried memory on an ordinary call")

    monkeypatch.setattr(fits, "available_bytes", boom)
    x, idx = torch.randn(64, 16), _idx(64, 2, 8)
    get_dispatch_layout(idx, 8, 2)
    perm = permute(x, idx, 8, topk_probs=torch.rand(64, 2))
    unpermute(perm.x, perm, probs=perm.probs)
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=64), num_experts=8)
    res = d.dispatch(x, idx, torch.rand(64, 2))
    d.combine(res.recv_x, res.handle)


def test_worst_case_rows_bounded_at_the_first_dispatch_without_hidden_size():
    # NOTE: without DispatchConfig.hidden_size the constructor bounds W rows of width 1 (fits);
    # the first dispatch knows H and must refuse W x H before the backend allocates it
    W = 1 << 26
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=8)
    x = torch.zeros(2, 1 << 17, dtype=torch.bfloat16)
    msg = r"FlexDispatcher.dispatch: num_worst_tokens=67108864 " + _EST
    with pytest.raises(ValueError, match=msg):
        d.dispatch(x, _idx(2, 2, 8), torch.rand(2, 2))
    assert d.stats.dispatch_calls == 0
    small = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=64), num_experts=8)
    res = small.dispatch(torch.randn(4, 16), _idx(4, 2, 8), torch.rand(4, 2))
    assert res.recv_x.shape == (64, 16)


def test_combine_refuses_a_handle_of_another_dispatcher():
    x, idx, p = torch.randn(4, 8), _idx(4, 2, 8), torch.rand(4, 2)
    a = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8)
    b = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=16)
    c = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8)
    res = a.dispatch(x, idx, p)
    for other in (b, c):
        with pytest.raises(ValueError, match=r"handle was issued by another FlexDispatcher"):
            other.combine(res.recv_x, res.handle)
    with pytest.raises(TypeError, match="must be the DispatchHandle"):
        a.combine(res.recv_x, object())  # type: ignore[arg-type]
    torch.testing.assert_close(a.combine(res.recv_x, res.handle), x * (idx >= 0).any(1, True))
