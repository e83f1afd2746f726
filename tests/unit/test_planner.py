"""Tests of the cluster planner: row/byte accounting against per-token loops, DeepEP arithmetic
against hand-computed values, and properties of whole plans.

Shape letters: T tokens per rank · E experts · R ranks · e = E / R · k top-k · L ranks per node ·
N nodes · W worst-case rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from flexdispatch.config import MoEConfig, RouterConfig, load_config
from flexdispatch.layout import get_dispatch_layout
from flexdispatch.planner import (
    ClusterPlan,
    combine_config,
    count_rows_batched,
    count_source_rows,
    deepep_elastic_hints,
    deepep_hints,
    deepep_row_format,
    dispatch_config,
    elastic_buffer_size,
    format_plan,
    link_rows,
    low_latency_rdma_size_hint,
    node_limited_group_topk,
    plan_cluster,
    torch_row_format,
)
from flexdispatch.planner import plan as plan_module

# ----------------------------------------------------------------------------- slow references


def random_topk_idx(T: int, k: int, E: int, *, seed: int, drop: float = 0.2) -> torch.Tensor:
    """``[T, k]`` distinct experts per token, some slots ``-1``; many tokens hit a rank twice."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    dropped = torch.rand(T, k, generator=g) < drop
    return torch.where(dropped, torch.full_like(idx, -1), idx)


def ref_source_rows(idx: torch.Tensor, E: int, R: int, L: int) -> dict[str, list[int]]:
    e = E // R
    rows_R, rows_N, pairs_R, per_E = [0] * R, [0] * (R // L), [0] * R, [0] * E
    for token in idx.tolist():
        ranks, nodes = set(), set()
        for x in token:
            if x < 0:
                continue
            ranks.add(x // e)
            nodes.add(x // e // L)
            pairs_R[x // e] += 1
            per_E[x] += 1
        for r in ranks:
            rows_R[r] += 1
        for n in nodes:
            rows_N[n] += 1
    return {"rows_R": rows_R, "rows_N": rows_N, "pairs_R": pairs_R, "per_E": per_E}


def ref_link_rows(idx_per_rank: list[torch.Tensor], E: int, L: int, mode: str) -> dict:
    """Walk every token of every source and record each message (sender, receiver)."""
    R = len(idx_per_rank)
    e = E // R
    out = {key: [0] * R for key in ("d_intra", "d_inter", "c_intra", "c_inter")}

    def send(direction: str, src: int, dst: int) -> None:
        if src == dst:
            return
        kind = "intra" if src // L == dst // L else "inter"
        out[f"{direction}_{kind}"][src] += 1

    for s, idx in enumerate(idx_per_rank):
        for token in idx.tolist():
            ranks = sorted({x // e for x in token if x >= 0})
            if mode == "flat":
                for g in ranks:
                    send("d", s, g)
                    send("c", g, s)
                continue
            for n in sorted({g // L for g in ranks}):
                f = n * L + s % L  # the forwarder with the source's local index
                send("d", s, f)
                send("c", f, s)
                for g in ranks:
                    if g // L == n:
                        send("d", f, g)
                        send("c", g, f)
    return out


def tiny_moe(**router: object) -> MoEConfig:
    base = {"num_experts": 16, "topk": 4, "score_function": "sigmoid"}
    base.update(router)
    return MoEConfig(hidden_size=256, ffn_hidden_size=64, router=RouterConfig(**base))


# ----------------------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    ("E", "R", "L", "k"), [(16, 4, 2, 4), (32, 8, 4, 6), (24, 8, 8, 3), (24, 6, 3, 5)]
)
def test_count_source_rows_matches_per_token_loop(E: int, R: int, L: int, k: int) -> None:
    idx = random_topk_idx(97, k, E, seed=E + R + L + k)
    got = count_source_rows(idx, num_experts=E, num_ranks=R, ranks_per_node=L)
    ref = ref_source_rows(idx, E, R, L)
    assert got.rows_per_rank.tolist() == ref["rows_R"]
    assert got.rows_per_node.tolist() == ref["rows_N"]
    assert got.pairs_per_rank.tolist() == ref["pairs_R"]
    assert got.tokens_per_expert.tolist() == ref["per_E"]
    assert got.num_tokens == 97
    layout = get_dispatch_layout(idx, E, R, ranks_per_node=L)
    assert got.rows_per_rank.tolist() == layout.num_tokens_per_rank.tolist()


def test_count_source_rows_empty_and_all_dropped() -> None:
    empty = count_source_rows(
        torch.empty(0, 3, dtype=torch.int64), num_experts=8, num_ranks=4, ranks_per_node=2
    )
    assert empty.rows_per_rank.tolist() == [0] * 4 and empty.rows_per_node.tolist() == [0, 0]
    dropped = count_source_rows(
        torch.full((5, 2), -1, dtype=torch.int64), num_experts=8, num_ranks=4, ranks_per_node=2
    )
    assert dropped.rows_per_rank.sum() == 0 and dropped.tokens_per_expert.sum() == 0


def test_count_rows_batched_equals_per_source_calls() -> None:
    E, R, L = 32, 8, 4
    idx = torch.stack([random_topk_idx(50, 4, E, seed=s) for s in range(3)])
    C, D, P, X = count_rows_batched(idx, num_experts=E, num_ranks=R, ranks_per_node=L)
    for s in range(3):
        one = count_source_rows(idx[s], num_experts=E, num_ranks=R, ranks_per_node=L)
        assert C[s].tolist() == one.rows_per_rank.tolist()
        assert D[s].tolist() == one.rows_per_node.tolist()
        assert P[s].tolist() == one.pairs_per_rank.tolist()
    assert X.tolist() == ref_source_rows(idx.reshape(-1, 4), E, R, L)["per_E"]


@pytest.mark.parametrize("mode", ["flat", "hierarchical"])
@pytest.mark.parametrize(("E", "R", "L"), [(16, 4, 2), (32, 8, 4), (32, 8, 2), (16, 8, 8)])
def test_link_rows_match_message_walk(mode: str, E: int, R: int, L: int) -> None:
    per_rank = [random_topk_idx(40, 4, E, seed=100 * s + R + L) for s in range(R)]
    counts = [count_source_rows(i, num_experts=E, num_ranks=R, ranks_per_node=L) for i in per_rank]
    C = torch.stack([c.rows_per_rank for c in counts])
    D = torch.stack([c.rows_per_node for c in counts])
    got = link_rows(C, D, ranks_per_node=L, mode=mode)
    ref = ref_link_rows(per_rank, E, L, mode)
    assert got.mode == mode
    assert got.dispatch_intra.tolist() == ref["d_intra"]
    assert got.dispatch_inter.tolist() == ref["d_inter"]
    assert got.combine_intra.tolist() == ref["c_intra"]
    assert got.combine_inter.tolist() == ref["c_inter"]


def test_hierarchical_never_sends_more_inter_node_rows_than_flat() -> None:
    E, R, L = 64, 16, 4
    per_rank = [random_topk_idx(60, 8, E, seed=s, drop=0.0) for s in range(R)]
    counts = [count_source_rows(i, num_experts=E, num_ranks=R, ranks_per_node=L) for i in per_rank]
    C = torch.stack([c.rows_per_rank for c in counts])
    D = torch.stack([c.rows_per_node for c in counts])
    flat = link_rows(C, D, ranks_per_node=L, mode="flat")
    hier = link_rows(C, D, ranks_per_node=L, mode="hierarchical")
    assert hier.dispatch_inter.sum() < flat.dispatch_inter.sum()
    # Every row still reaches its rank: total deliveries are the same.
    assert hier.dispatch_intra.sum() + hier.dispatch_inter.sum() >= flat.dispatch_inter.sum()


def test_link_rows_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="rows_SR"):
        link_rows(torch.zeros(4, 4), torch.zeros(4, 3), ranks_per_node=2, mode="flat")
    with pytest.raises(ValueError, match="mode"):
        link_rows(torch.zeros(4, 4), torch.zeros(4, 2), ranks_per_node=2, mode="ring")


def test_row_formats() -> None:
    torch_fmt = torch_row_format(hidden=7168, topk=8, elem_size=2)
    assert (torch_fmt.dispatch_bytes, torch_fmt.combine_bytes) == (7168 * 2 + 8 * 8, 7168 * 2)
    inter = deepep_row_format(hidden=7168, topk=8, internode=True)
    # fp8 7168 + SourceMeta 8 + 56 scales * 4 + 8 int32 ids + 8 fp32 weights = 7464 -> 7472
    assert inter.dispatch_bytes == 7472
    # bf16 14336 + 8 + 8 * 4 = 14376 -> 14384
    assert inter.combine_bytes == 14384
    intra = deepep_row_format(hidden=7168, topk=8, internode=False)
    # fp8 7168 + 4 src idx + 224 scales + 8 * 8 int64 ids + 8 * 4 weights
    assert (intra.dispatch_bytes, intra.combine_bytes) == (7168 + 4 + 224 + 96, 14336 + 4 + 32)


# ----------------------------------------------------------------------------- DeepEP arithmetic


def test_deepep_configs_round_rdma_recv_up() -> None:
    # get_dispatch_config(16) = Config(20, 36, 288, 20, 128); 128 -> multiple of 20 = 140.
    assert dispatch_config(16).as_tuple() == (20, 36, 288, 20, 140)
    # get_combine_config(16) = Config(20, 4, 288, 12, 128); 128 -> multiple of 12 = 132.
    assert combine_config(16).as_tuple() == (20, 4, 288, 12, 132)
    # get_dispatch_config(8) = Config(num_sms, 6, 256, 6, 128); 128 -> multiple of 6 = 132.
    assert dispatch_config(8, num_sms=24).as_tuple() == (24, 6, 256, 6, 132)
    with pytest.raises(ValueError, match="256 ranks"):
        dispatch_config(256)


def test_deepep_nvl_hint_by_hand() -> None:
    # R=16 dispatch, hidden_bytes = 7168 * 2 = 14336: 10 channels x 8 NVL peers = 80 slots,
    #   counters 80 * (2 * 2 RDMA ranks + 3) * 4 B = 2240
    #   tokens   80 * 288 = 23040, each 14336 + 8 meta + 128*8 ids + 128*4 weights + 128*4 scales
    #            = 16392 B -> 377,671,680
    #   total 377,673,920 -> rounded up to 128: 377,673,984
    assert dispatch_config(16).nvl_buffer_size_hint(14336, 16) == 377_673_984
    # R=8 (one node): 1 RDMA rank, counters 80 * 5 * 4 = 1600; 80 * 256 = 20480 tokens * 16392
    #   = 335,708,160; total 335,709,760 = 2,622,732.5 * 128 -> 335,709,824
    assert dispatch_config(8).nvl_buffer_size_hint(14336, 8) == 335_709_824


def test_deepep_rdma_hint_by_hand() -> None:
    # R=16 dispatch: 10 channels x 2 RDMA ranks = 20 slots,
    #   counters 20 * (8 * 2 + 2) * 2 * 4 B = 2880
    #   tokens 20 * 140 = 2800, each 2 x (14336 + 8 + 1024 + 512 + 512 + 16) = 32816 B
    #   -> 91,884,800; total 91,887,680 = 717,872.5 * 128 -> 91,887,744
    assert dispatch_config(16).rdma_buffer_size_hint(14336, 16) == 91_887_744
    # combine: 20 * 132 = 2640 tokens * 32816 = 86,634,240 + 2880 = 86,637,120 -> 86,637,184
    assert combine_config(16).rdma_buffer_size_hint(14336, 16) == 86_637_184
    assert dispatch_config(8).rdma_buffer_size_hint(14336, 8) == 0  # intranode: no RDMA buffer
    hints = deepep_hints(hidden=7168, num_experts=256, num_ranks=16, ranks_per_node=8)
    assert hints.supported and hints.reason == ""
    assert hints.num_rdma_bytes == 91_887_744
    assert hints.num_nvl_bytes == max(hints.nvl_bytes_dispatch, hints.nvl_bytes_combine)


def test_deepep_low_latency_hint_by_hand() -> None:
    # W=128, H=7168, E=256: 56 scales; dispatch msg 16 + max(14336, 7168 + 224) = 14352;
    # combine msg 56 * 4 + 14336 = 14560; send = max(128 * 14352, 256 * 128 * 14560)
    # = 477,102,080; recv = 256 * 128 * max(14352, 14560) = 477,102,080; signalling
    # align128(256 * 4) = 1024; total 2 * (2 * 477,102,080 + 1024) = 1,908,410,368, a multiple
    # of 128, so the hint adds one more block: 1,908,410,496.
    assert low_latency_rdma_size_hint(128, 7168, 16, 256) == 1_908_410_496
    with pytest.raises(ValueError, match="positive"):
        low_latency_rdma_size_hint(0, 7168, 16, 256)


@pytest.mark.parametrize(
    ("R", "L", "reason"),
    [
        (256, 8, "at most 20 nodes"),
        (16, 4, "8 ranks per node"),
        (1, 1, "2, 4 or 8 ranks"),
        (48, 8, "no tuned DeepEP config"),
    ],
)
def test_deepep_unsupported_topologies_say_why(R: int, L: int, reason: str) -> None:
    hints = deepep_hints(hidden=7168, num_experts=768, num_ranks=R, ranks_per_node=L)
    assert not hints.supported
    assert reason in hints.reason
    assert hints.ll_rdma_bytes > 0  # the low-latency hint is pure arithmetic


def test_deepep_hints_reject_odd_sms() -> None:
    with pytest.raises(ValueError, match="num_sms"):
        deepep_hints(hidden=7168, num_experts=256, num_ranks=16, ranks_per_node=8, num_sms=21)


# ----------------------------------------------------------------------------- whole plans


def check_plan_consistency(plan: ClusterPlan) -> None:
    R, N, L, T = plan.num_ranks, plan.nodes, plan.ranks_per_node, plan.tokens_per_rank
    for v in plan.variants:
        C, D = v.rows_SR, v.rows_SN
        assert sum(v.recv_rows) == int(C.sum())
        rdma_in = [sum(int(D[s, n]) for s in range(R) if s // L != n) for n in range(N)]
        assert list(v.node_rdma_rows_in) == rdma_in
        assert list(v.node_recv_rows) == torch.tensor(v.recv_rows).view(N, L).sum(1).tolist()
        assert sum(v.recv_pairs) == sum(v.tokens_per_expert) <= T * R * plan.topk
        flat = v.mode("flat")
        off_diag = int(C.sum() - C.diagonal().sum())
        sent = sum(flat.dispatch.nvlink_bytes) + sum(flat.dispatch.rdma_bytes)
        assert sent == off_diag * flat.row_format.dispatch_bytes
        hier = v.mode("hierarchical")
        assert sum(hier.dispatch.rdma_bytes) == sum(v.node_rdma_rows_in) * (
            hier.row_format.dispatch_bytes
        )
        for m in v.traffic:  # combine mirrors dispatch, row for row
            assert (
                sum(m.combine.rdma_bytes) * m.row_format.dispatch_bytes
                == sum(m.dispatch.rdma_bytes) * m.row_format.combine_bytes
            )
        assert v.worst_case.observed_max_recv_rows == max(v.recv_rows)
        assert v.worst_case.deepep_w % R == 0 and v.worst_case.torch_hier_w % R == 0
        assert v.worst_case.deepep_v2_w == T * R == plan.deepep_elastic.worst_case_w


def test_small_plan_is_consistent_and_deterministic() -> None:
    cfg = tiny_moe(num_groups=4, group_topk=2)
    a = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=64, seed=3)
    b = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=64, seed=3)
    c = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=64, seed=4)
    check_plan_consistency(a)
    assert [v.name for v in a.variants] == ["preset", "ungrouped", "node_limited"]
    assert torch.equal(a.variants[0].rows_SR, b.variants[0].rows_SR)
    assert not torch.equal(a.variants[0].rows_SR, c.variants[0].rows_SR)
    # node_limited = 2 groups (one per node), 2 kept = every group: same as ungrouped.
    assert a.variant("node_limited").same_as == "ungrouped"


def test_plan_does_not_depend_on_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_moe(num_groups=4, group_topk=2)
    whole = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=96, seed=1)
    monkeypatch.setattr(plan_module, "_BLOCK_ELEMS", 16 * 96 * 2 + 1)  # two ranks per block
    two = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=96, seed=1)
    for v, w in zip(whole.variants, two.variants, strict=True):
        assert torch.equal(v.rows_SR, w.rows_SR) and torch.equal(v.rows_SN, w.rows_SN)


def test_plan_rows_equal_counting_its_own_routing() -> None:
    """Reproduce the plan's logits for R=4 by hand and recount with the per-token loop."""
    from flexdispatch.routing import topk_routing

    cfg = tiny_moe()
    T, R, L, skew, seed = 48, 4, 2, 0.7, 5
    plan = plan_cluster(cfg, nodes=2, ranks_per_node=L, tokens=T, skew=skew, seed=seed)
    offsets = plan_module.popularity_offsets(16, seed)
    for s in range(R):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + s)
        logits = torch.randn(T, 16, generator=gen) + skew * offsets
        idx = topk_routing(logits, topk=4, score_function="sigmoid").topk_idx
        ref = ref_source_rows(idx, 16, R, L)
        assert plan.variant("preset").rows_SR[s].tolist() == ref["rows_R"]
        assert plan.variant("preset").rows_SN[s].tolist() == ref["rows_N"]


def test_node_limited_routing_cuts_rdma_bytes() -> None:
    cfg = load_config("deepseek_v3")  # 256 experts, top-8, 8 groups (nodes), 4 kept
    plan = plan_cluster(cfg, nodes=8, ranks_per_node=2, tokens=128, seed=0)
    check_plan_consistency(plan)
    preset, free = plan.variant("preset"), plan.variant("ungrouped")
    assert plan.variant("node_limited").same_as == "preset"  # 8 nodes: groups are nodes
    assert preset.avg_nodes_per_token <= 4.0 < free.avg_nodes_per_token
    assert int(preset.rows_SN.sum(1).max()) <= 4 * 128  # at most 4 nodes per token
    for mode in ("flat", "hierarchical", "deepep"):
        limited = sum(preset.mode(mode).dispatch.rdma_bytes)
        unlimited = sum(free.mode(mode).dispatch.rdma_bytes)
        assert limited < unlimited, mode
        assert preset.mode(mode).dispatch.time_us < free.mode(mode).dispatch.time_us
    # Hierarchical crosses each node boundary once per token: fewer RDMA bytes than flat.
    assert sum(preset.mode("hierarchical").dispatch.rdma_bytes) < sum(
        preset.mode("flat").dispatch.rdma_bytes
    )


def test_node_limited_group_topk_choice() -> None:
    qwen = load_config("qwen3_moe").router  # k=8, no groups: target min(4, N)
    assert node_limited_group_topk(qwen, 3) == (2, "group_topk 3 is invalid here, using 2")
    assert node_limited_group_topk(qwen, 8) == (4, "")
    v2 = load_config("deepseek_v2").router  # group_score max, group_topk 3
    assert node_limited_group_topk(v2, 4)[0] == 3
    assert node_limited_group_topk(v2, 2)[0] == 2  # capped at N
    tight = RouterConfig(num_experts=4, topk=3, score_function="sigmoid")
    # 4 groups of 1 expert: target 4 does not divide k=3, 3 does and holds 3 experts.
    assert node_limited_group_topk(tight, 4) == (3, "group_topk 4 is invalid here, using 3")
    # 2 groups of 2: g=2 does not divide 3, g=1 holds 2 < 3 experts: nothing works.
    g, note = node_limited_group_topk(tight, 2)
    assert g is None and "no group_topk is valid" in note


def test_skew_raises_imbalance() -> None:
    cfg = tiny_moe()
    flat = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=512, skew=0.0, variants=("preset",))
    hot = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=512, skew=2.0, variants=("preset",))

    def imbalance(values: tuple[int, ...]) -> float:
        return max(values) / (sum(values) / len(values))

    v0, v2 = flat.variant("preset"), hot.variant("preset")
    assert imbalance(v2.tokens_per_expert) > imbalance(v0.tokens_per_expert) + 0.5
    assert imbalance(v2.recv_pairs) > imbalance(v0.recv_pairs)
    assert imbalance(v0.tokens_per_expert) < 1.3  # uniform routing is nearly balanced
    assert v2.worst_case.observed_max_recv_rows > v0.worst_case.observed_max_recv_rows


def test_capacity_dropping_is_per_rank_batch() -> None:
    cfg = tiny_moe(capacity_factor=1.0)
    plan = plan_cluster(cfg, nodes=1, ranks_per_node=4, tokens=64, skew=2.0, variants=("preset",))
    v = plan.variant("preset")
    capacity = math.ceil(64 * 4 / 16 * 1.0)
    assert max(v.tokens_per_expert) <= capacity * 4  # each of the 4 source batches caps it
    assert sum(v.tokens_per_expert) < 64 * 4 * 4  # and something was dropped


def test_hash_router_plan() -> None:
    cfg = tiny_moe(router_type="hash", score_function="sigmoid")
    plan = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=200)
    assert [v.name for v in plan.variants] == ["preset"]
    assert sum(plan.variant("preset").tokens_per_expert) == 200 * 4 * 4
    check_plan_consistency(plan)


def test_single_node_deepep_uses_intranode_rows() -> None:
    plan = plan_cluster(tiny_moe(), nodes=1, ranks_per_node=4, tokens=32, variants=("preset",))
    v = plan.variant("preset")
    deepep = v.mode("deepep")
    assert deepep.rows.mode == "flat"
    assert deepep.row_format == deepep_row_format(hidden=256, topk=4, internode=False)
    assert sum(deepep.dispatch.rdma_bytes) == 0 and sum(v.mode("flat").dispatch.rdma_bytes) == 0
    assert plan.deepep.supported and plan.deepep.num_rdma_bytes == 0
    v2 = plan.deepep_elastic.dropless
    assert v2.scaleup_nvlink and (v2.num_rdma_ranks, v2.num_scaleup_ranks) == (1, 4)


def test_plan_carries_the_v2_buffer_flexdispatch_would_build() -> None:
    # 2 nodes x 4 ranks, H = 256 bf16, k = 4, T = 48: the V2 path pads combine rows to 256 columns
    # and asks at least 256 for dispatch, so hidden = 256; direct mode over 2 NVLink domains of 4.
    plan = plan_cluster(tiny_moe(), nodes=2, ranks_per_node=4, tokens=48, variants=("preset",))
    v2 = plan.deepep_elastic
    assert v2 == deepep_elastic_hints(
        hidden=256, num_experts=16, num_ranks=8, ranks_per_node=4, topk=4, tokens=48
    )
    assert (v2.dispatch_hidden, v2.combine_hidden, v2.hidden) == (256, 256, 256)
    assert v2.dropless == elastic_buffer_size(
        num_ranks=8, num_nvl_ranks=4, num_max_tokens_per_rank=48, hidden=256, num_topk=4
    )
    # slots: a(512) + a(4 * 8 + 5 * 4 = 52) = 576 and a(512) + a(32) = 544;
    # dispatch (1 + 8) * 48 * 576 = 248,832; combine 8 * 48 * 544 + 4 * 48 * 544 = 313,344
    assert (v2.dropless.dispatch_bytes, v2.dropless.combine_bytes) == (248_832, 313_344)
    assert v2.dropless.num_bytes == 2 * 1024 * 1024
    assert (v2.dropless.num_rdma_ranks, v2.dropless.num_nvl_ranks) == (2, 4)
    assert not v2.dropless.scaleup_nvlink
    assert v2.worst_case_w == 48 * 8 and v2.worst_case.num_max_tokens_per_rank == 48
    assert plan.as_dict()["deepep"]["elastic"]["dropless"]["num_bytes"] == 2 * 1024 * 1024
    assert plan.variant("preset").worst_case.as_dict()["deepep_v2_w"] == 48 * 8
    text = format_plan(plan)
    assert "DeepEP V2 buffer (ElasticBuffer.get_buffer_size_hint" in text
    assert "physical 2 x 4 (NVLink domains x ranks), logical 1 scale-out x 8 scale-up" in text
    assert "dropless (M = num_max_dispatch_tokens_per_rank = T = 48): num_bytes = 2,097,152" in text
    assert "worst-case (num_worst_tokens = T*R = 384, M = W/R = 48; intranode and across" in text
    assert "DeepEP V2 (deepep_api='v2') worst-case W >= T*R = 384" in text
    assert "(intranode only; its test uses T*R = 384)" in text  # the V1 line is unchanged


@pytest.mark.timeout(120)
def test_ep256_plan_finishes() -> None:
    """32 nodes x 8 ranks, T = 4096 per rank (~1M tokens), DeepSeek-V3 routing."""
    cfg = load_config("deepseek_v3")
    plan = plan_cluster(cfg, nodes=32, ranks_per_node=8, tokens=4096, variants=("preset",))
    v = plan.variant("preset")
    assert plan.num_ranks == 256 and plan.total_tokens == 4096 * 256
    assert sum(v.tokens_per_expert) == 4096 * 256 * 8  # dropless
    # 8 groups of 32 experts = 4 nodes each; 4 groups kept: at most 16 of the 32 nodes.
    assert int(v.rows_SN.sum(1).max()) <= 16 * 4096
    check_plan_consistency(plan)
    assert not plan.deepep.supported and "20 nodes" in plan.deepep.reason
    assert plan.deepep_elastic.supported  # V2 has no 20-node limit
    assert plan.wall_s > 0  # reported; the time bound is the test's timeout (a shared machine)


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nodes": 3, "ranks_per_node": 8}, r"num_experts=256 .* 3 x 8 = 24"),
        ({"nodes": 0, "ranks_per_node": 8}, "nodes must be an int >= 1"),
        ({"nodes": 2, "ranks_per_node": -1}, "ranks_per_node must be an int >= 1"),
        ({"nodes": 2, "ranks_per_node": 8, "tokens": 0}, "tokens must be an int >= 1"),
        ({"nodes": 2, "ranks_per_node": 8, "skew": -1.0}, "skew"),
        ({"nodes": 2, "ranks_per_node": 8, "rdma_gbps": 0.0}, "rdma_gbps"),
        ({"nodes": 2, "ranks_per_node": 8, "variants": ("best",)}, "unknown routing variant"),
    ],
)
def test_bad_inputs_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_cluster(load_config("deepseek_v3"), **kwargs)


def test_unknown_variant_lookup() -> None:
    plan = plan_cluster(tiny_moe(), nodes=1, ranks_per_node=2, tokens=8, variants=("preset",))
    with pytest.raises(ValueError, match="no routing variant"):
        plan.variant("ungrouped")
    with pytest.raises(ValueError, match="no transport"):
        plan.variant("preset").mode("nccl")
