"""Layers built where they run (issue 26 item 6): expert weights drawn on the parameters' device,
one generator per expert, nothing drawn on meta, ``to_empty`` + ``reset_parameters_from_seed``."""

from __future__ import annotations

import time

import pytest
import torch

from flexdispatch.config import load_config
from flexdispatch.experts import GroupedExperts, SharedExperts, init_expert_weights
from flexdispatch.moe import MoELayer

pytestmark = pytest.mark.timeout(120)

H, F = 16, 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("gelu", False)])
def test_any_expert_split_gives_the_same_weights(dtype, activation, bias):
    E, seed = 6, 9
    kw = dict(activation=activation, bias=bias, dtype=dtype, seed=seed)
    full = GroupedExperts(E, H, F, **kw)
    names = [n for n, _ in full.named_parameters()]
    want_names = {"swiglu": ["w1", "w2", "w3", "b1", "b2", "b3"], "gelu": ["w1", "w2"]}
    assert names == want_names[activation]
    for e in (1, 2, 3):
        for r in range(E // e):
            shard = GroupedExperts(e, H, F, first_expert=r * e, **kw)
            for name in names:
                got, want = getattr(shard, name), getattr(full, name)[r * e : (r + 1) * e]
                assert torch.equal(got, want), (e, r, name)
    # the construction-time draw is the per-expert one, and the per-expert function agrees
    for g in (0, E - 1):
        ew = init_expert_weights(
            g,
            seed,
            hidden_size=H,
            ffn_hidden_size=F,
            activation=activation,
            bias=bias,
            dtype=dtype,
        )
        for name in names:
            assert torch.equal(getattr(full, name)[g], getattr(ew, name)), (g, name)
    # not a constant: experts differ from each other and from another seed's
    assert not torch.equal(full.w1[0], full.w1[1])
    assert not torch.equal(GroupedExperts(E, H, F, **{**kw, "seed": seed + 1}).w1, full.w1)


def test_a_seeded_build_draws_nothing_from_the_global_rng():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    GroupedExperts(3, H, F, seed=4, dtype=torch.bfloat16)
    SharedExperts(H, F, gate=True, seed=4, expert_id=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    # without a seed the documented global-RNG draw is kept (one stream, so it moves the RNG)
    GroupedExperts(3, H, F)
    assert not torch.equal(torch.random.get_rng_state(), before)


def test_shared_experts_seed_at_construction_equals_a_later_reset():
    a = SharedExperts(H, F, gate=True, seed=7, expert_id=5, dtype=torch.bfloat16)
    b = SharedExperts(H, F, gate=True, dtype=torch.bfloat16)
    assert not torch.equal(a.w1, b.w1)
    b.reset_parameters_from_seed(7, 5)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na


def test_meta_build_of_deepseek_v3_is_fast_and_draws_nothing():
    cfg = load_config("deepseek_v3")
    MoELayer(load_config("tiny_cpu"), device="meta")  # NOTE: imports and caches off the clock
    t0 = time.perf_counter()
    layer = MoELayer(cfg, dtype=torch.bfloat16, device="meta")
    took = time.perf_counter() - t0
    E, Hd, Fd = cfg.router.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
    assert layer.experts.w1.shape == (E, Hd, Fd) and layer.experts.w1.is_meta
    assert all(p.is_meta for p in layer.parameters())
    assert took < 1.0, f"MoELayer(deepseek_v3) on meta took {took:.2f} s (goal: well under 1 s)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_empty_then_reset_equals_a_direct_build(dtype):
    base = load_config("tiny_cpu")
    cfg = base.model_copy(
        update={"num_shared_experts": 1, "shared_expert_gate": True, "expert_mlp_bias": True}
    )
    direct = MoELayer(cfg, seed=3, dtype=dtype)
    lazy = MoELayer(cfg, seed=3, dtype=dtype, device="meta")
    lazy.to_empty(device="cpu")
    for t in lazy.state_dict().values():  # garbage, so that a missed tensor shows
        if t.is_floating_point():
            t.fill_(float("nan"))
    lazy.reset_parameters_from_seed()
    want = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    got = {**dict(lazy.named_parameters()), **dict(lazy.named_buffers())}
    assert set(got) == set(want) and any(n.startswith("shared_experts.") for n in got)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # another seed gives other values; the build's seed is the default
    lazy.reset_parameters_from_seed(4)
    assert not torch.equal(lazy.experts.w1, direct.experts.w1)
    with pytest.raises(ValueError, match="seed"):
        lazy.reset_parameters_from_seed(-1)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, "):
        lazy.reset_parameters_from_seed(2**70)  # the build's own bound (was an OverflowError)
