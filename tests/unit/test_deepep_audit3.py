"""Audit-3 findings that need no process group (``deepep-audit-3.md``, N1, N14, ...).

R ranks · L ranks per node · N = R / L nodes · E experts · k top-k.
"""

from __future__ import annotations

import pytest

from flexdispatch.config import DispatchConfig, load_config


# --------------------------------------------------------------------- N1 / N14: check_world
@pytest.mark.timeout(60)
def test_check_world_takes_the_configured_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = DispatchConfig(backend="deepep", ranks_per_node=8)
    cfg.check_world(16)  # N1: L = 8 from the config, not L = R = 16
    cfg.check_world(16, 8)
    with pytest.raises(ValueError, match="at most 8 ranks, got L=16"):
        DispatchConfig(backend="deepep").check_world(16)  # nothing says otherwise: L = R
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    DispatchConfig(backend="deepep").check_world(16)  # the launcher's L, as the dispatcher


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", [3, 6, 12, 18, 20])
def test_check_world_accepts_every_release_node_count(nodes: int) -> None:
    DispatchConfig(backend="deepep", ranks_per_node=8).check_world(8 * nodes)  # N14


@pytest.mark.timeout(60)
def test_check_world_still_refuses_unsupported_node_counts() -> None:
    with pytest.raises(ValueError, match="nodes, not 5"):
        DispatchConfig(backend="deepep", ranks_per_node=8).check_world(40)


@pytest.mark.timeout(60)
def test_moe_config_check_world_forwards_l() -> None:
    cfg = load_config("tiny_cpu")
    cfg = cfg.model_copy(
        update={
            "router": cfg.router.model_copy(update={"num_experts": 32}),
            "dispatch": cfg.dispatch.model_copy(update={"backend": "deepep", "ranks_per_node": 8}),
        }
    )
    cfg.check_world(16)
    cfg.check_world(16, 8)


# --------------------------------------------------------------------- repeated / out-of-range ids
def _routing(T: int = 6, E: int = 8, k: int = 3, seed: int = 0):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g)
    x = torch.randn(T, 4, generator=g)
    return x, idx, probs


@pytest.mark.timeout(60)
def test_repeated_ids_raise_naming_the_token_with_checks_on() -> None:
    from flexdispatch import FlexDispatcher

    x, idx, p = _routing()
    idx[4] = idx.new_tensor([5, 1, 5])
    d = FlexDispatcher(DispatchConfig(backend="torch", checks=True), num_experts=8)
    with pytest.raises(ValueError, match=r"twice in token 4 \(\[5, 1, 5\]") as info:
        d.dispatch(x, idx, p)
    assert "distinct" in str(info.value) and d.stats.dispatch_calls == 0
    idx[4, 2] = -1
    idx[3, 1:] = -1  # repeated -1 (unused slots) is fine
    d.dispatch(x, idx, p)


@pytest.mark.timeout(60)
def test_repeated_and_out_of_range_ids_are_masked_and_counted_when_deferred(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from flexdispatch import FlexDispatcher
    from flexdispatch._checks import tensors

    monkeypatch.setattr(tensors, "defer_value_checks", lambda device: True)
    x, idx, p = _routing()
    bad = idx.clone()
    bad[1] = bad.new_tensor([2, 2, 2])
    bad[4, 2] = 9
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8)
    # NOTE: the dispatcher's screen of a backend that counts no bad ids itself (DeepEP's path;
    # the torch backend checks no value with checks off)
    d.backend.counts_bad_ids = False  # type: ignore[misc]
    got = d.dispatch(x, bad, p)  # no raise: counted on the device
    clean = bad.clone()
    clean[1, 1:] = -1
    clean[4, 2] = -1
    want = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=8).dispatch(
        x, clean, p.masked_fill(clean < 0, 0)
    )
    assert torch.equal(got.recv_topk_idx, want.recv_topk_idx)
    assert torch.equal(got.recv_topk_probs, want.recv_topk_probs)
    assert torch.equal(got.recv_x, want.recv_x)
    with pytest.raises(ValueError) as info:
        d.check_overflow()
    msg = str(info.value)
    assert "twice in a token 2 time(s)" in msg and "distinct" in msg and "outside [-1, 8)" in msg
    assert d.stats.extra["repeated_expert_ids"] == 2 and d.stats.extra["invalid_expert_ids"] == 1


@pytest.mark.timeout(60)
def test_mask_bad_ids_keeps_the_first_slot() -> None:
    import torch

    from flexdispatch.dispatch.values import mask_bad_ids

    idx = torch.tensor([[3, 3, -1, -1], [7, 1, 7, 12], [0, 1, 2, 3]])
    got, repeats, oob = mask_bad_ids(idx, 8, out_of_range=True)
    assert got.tolist() == [[3, -1, -1, -1], [7, 1, -1, -1], [0, 1, 2, 3]]
    assert int(repeats) == 2 and int(oob) == 1
    got, repeats, oob = mask_bad_ids(idx, 8, out_of_range=False)
    assert got[1].tolist() == [7, 1, -1, 12] and oob is None


# --------------------------------------------------------------------- refusals (pure)
@pytest.mark.timeout(60)
def test_int_max_buffer_bytes_refused_for_internode_normal_kernels() -> None:
    from flexdispatch.backends.deepep import refusals
    from flexdispatch.backends.deepep.sizing import BufferSize

    big = BufferSize(num_nvl_bytes=1 << 20, num_rdma_bytes=2**31)
    refusals.check_normal_buffer_bytes(big, internode=False)  # intranode: no such limit
    refusals.check_normal_buffer_bytes(
        BufferSize(num_nvl_bytes=1 << 20, num_rdma_bytes=2**31 - 128), internode=True
    )
    with pytest.raises(ValueError, match=r"num_rdma_bytes < INT_MAX = 2147483647.*2147483648"):
        refusals.check_normal_buffer_bytes(big, internode=True)


@pytest.mark.timeout(60)
def test_node_span_refuses_past_eight_nodes() -> None:
    import torch

    from flexdispatch.backends.deepep import refusals

    N, E = 16, 16 * 4  # 4 experts per node
    idx = torch.tensor([[4 * n for n in range(10)], [0, 1, 2, 3, 4, 5, 6, 7, 8, -1]])
    assert refusals.node_spans(idx, E, N).tolist() == [10, 3]
    with pytest.raises(ValueError, match=r"token 0 has experts on 10 nodes.*at most 8 nodes"):
        refusals.agree_node_span(idx, E, N, group=None, rank=0)
    assert refusals.agree_node_span(idx[1:], E, N, group=None, rank=0) == 0  # fine, no sync


@pytest.mark.timeout(60)
def test_buffer_creation_and_growth_refused_inside_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    from flexdispatch._checks import tensors
    from flexdispatch.backends.deepep import buffer as deepep_buffer
    from flexdispatch.backends.deepep import refusals
    from flexdispatch.backends.deepep.sizing import BufferSize

    built = []

    class Buffer:
        def __init__(self, *a: object, **kw: object) -> None:
            built.append(kw)

        def destroy(self) -> None:
            pass

    module = types.SimpleNamespace(Buffer=Buffer)
    shared = deepep_buffer.SharedBuffer(deep_ep=module, group=None)
    need = BufferSize(num_nvl_bytes=1 << 20, num_rdma_bytes=0)
    monkeypatch.setattr(tensors, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"created.*inside a CUDA-graph capture.*warmup"):
        shared.ensure(need, low_latency=False, num_qps_per_rank=24)
    assert not built
    monkeypatch.setattr(tensors, "is_capturing", lambda: False)
    shared.ensure(need, low_latency=False, num_qps_per_rank=24)
    monkeypatch.setattr(tensors, "is_capturing", lambda: True)
    shared.ensure(need, low_latency=False, num_qps_per_rank=24)  # no growth: fine
    with pytest.raises(RuntimeError, match="grown"):
        shared.ensure(
            need.union(BufferSize(num_nvl_bytes=2 << 20, num_rdma_bytes=0)),
            low_latency=False,
            num_qps_per_rank=24,
        )
    assert len(built) == 1
    with pytest.raises(RuntimeError, match="compile its dispatch kernel"):
        refusals.first_use(module, ("new",), "dispatch")
    monkeypatch.setattr(tensors, "is_capturing", lambda: False)
    refusals.first_use(module, ("new",), "dispatch")
    monkeypatch.setattr(tensors, "is_capturing", lambda: True)
    refusals.first_use(module, ("new",), "dispatch")  # seen: fine inside the capture


@pytest.mark.timeout(60)
def test_low_latency_graph_then_normal_internode_is_refused() -> None:
    import types

    from flexdispatch.backends.deepep import refusals

    shared = types.SimpleNamespace(low_latency_captured=False)
    refusals.check_low_latency_graph(shared, internode=True)
    shared.low_latency_captured = True
    refusals.check_low_latency_graph(shared, internode=False)  # intranode: no RDMA signals
    with pytest.raises(ValueError, match=r"captured in a CUDA graph.*two process groups"):
        refusals.check_low_latency_graph(shared, internode=True)


# --------------------------------------------------------------------- the emulator's strictness
@pytest.mark.timeout(60)
def test_emulator_traps_what_deepep_traps() -> None:
    import types

    import torch

    from tests.deepep_emu.runtime import limits, strict

    rt = types.SimpleNamespace(release="1.2.1", num_rdma_ranks=16, L=8, num_rdma_bytes=0)
    rt.num_nvl_bytes = 1 << 20
    itr = torch.zeros(2, 16 * 8, dtype=torch.bool)
    itr[0, [8 * n for n in range(9)]] = True  # token 0 on 9 nodes
    with pytest.raises(limits.DeviceTrap, match=r"internode.topk_rdma_ranks"):
        strict.check_node_span(rt, itr)
    strict.check_node_span(rt, itr[1:])
    rt.num_rdma_bytes = 2**31
    with pytest.raises(limits.DeepEPHostAssert, match=r"internode.rdma_bytes_int_max"):
        strict.check_internode_bytes(rt, cached=False)
    with pytest.raises(limits.DeepEPHostAssert, match=r"buffer.rdma_int_max"):
        strict.check_buffer(types.SimpleNamespace(), "2.1.0", 1 << 20, 2**31, False)
    strict.check_buffer(types.SimpleNamespace(), "2.1.0", 1 << 20, 2**31, True)  # LL mode
    mod = types.SimpleNamespace()
    strict.jit(mod, "2.1.0", ("dispatch", 1))
    with strict.emu_capture(mod):
        strict.jit(mod, "2.1.0", ("dispatch", 1))  # compiled already
        with pytest.raises(limits.DeepEPHostAssert, match=r"elastic.jit_capture"):
            strict.jit(mod, "2.1.0", ("dispatch", 2))
        with pytest.raises(limits.DeepEPHostAssert, match=r"capture.buffer_alloc"):
            strict.alloc(mod, "2.1.0", "ElasticBuffer")
    with pytest.raises(limits.DeepEPHostAssert, match=r"elastic.max_experts"):
        strict.check_elastic_ids("2.1.0", torch.zeros(1, 1, dtype=torch.int64), 4096, 8)
    with pytest.raises(limits.DeviceTrap, match=r"elastic.expert_id_range"):
        strict.check_elastic_ids("2.1.0", torch.tensor([[3, 16]]), 16, 8)
