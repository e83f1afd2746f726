"""The emulated DeepEP V2 runtime (``_C.ElasticBuffer``) under DeepEP's own ``elastic.py``.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
M = ``num_max_tokens_per_rank`` · a = ``expert_alignment`` · n received rows.

These tests call ``deep_ep.ElasticBuffer`` directly (no flexdispatch adapter) in direct mode
(one NVLink domain): received rows, ids, weights, the ``EPHandle`` fields, expand and
non-expand layouts, with and without the CPU sync, cached dispatch, combine, and the host
asserts / device traps an adapter can reach, each naming its DeepEP 2.1.0 source line.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import all_inputs, ref_dispatch

M, H, K = 16, 256, 3
NUM_SMS = 8


def _error(fn: Any) -> str:
    try:
        fn()
    except (RuntimeError, AssertionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _a(x: int, b: int) -> int:
    return -(-x // b) * b


def _expected_bytes(R: int, M: int, H: int, k: int) -> int:
    """buffer.hpp:586-686, direct case on one NVLink domain (bf16, multiple reduction)."""
    tok_d = _a(H * 2, 32) + _a(k * 8 + (1 + k) * 4, 32)
    tok_c = _a(H * 2, 32) + _a(k * 8, 32)
    return _a(max(R * M * tok_d, min(R, k) * M * tok_c), 2 << 20)


def _expand_ref(ref: Any, e: int, a: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Per local expert: the rows it receives (source order), their weights, aligned counts."""
    xs, ws, counts = [], [], []
    for j in range(e):
        hit = ref.idx == j
        rows = hit.any(1).nonzero().flatten()
        slot = hit[rows].to(torch.int64).argmax(1)
        xs.append(ref.x[rows])
        ws.append(ref.probs[rows, slot])
        counts.append(rows.numel())
    return xs, ws, [_a(c, a) for c in counts]


# --------------------------------------------------------------------- semantics
def semantics_worker(rank: int, R: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.deepep_emu.load import load_deep_ep
    from tests.deepep_emu.runtime import elastic as emulated

    # NOTE: token order inside each source group for the exact comparisons below; the
    # atomic (shuffled) slot order DeepEP has on a GPU is checked at the end
    emulated.ATOMIC_ORDER = False
    deep_ep = load_deep_ep(release="2.1.0")
    group = dist.group.WORLD
    E = 2 * R
    e = E // R
    inputs = all_inputs(11, R=R, E=E, k=K, H=H, dtype=torch.bfloat16, exact=False)
    mine = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    n = ref.x.shape[0]
    out: dict[str, Any] = {}
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, M, H, K)
    out["hint"] = hint == _expected_bytes(R, M, H, K)
    buf = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True
    )
    out["domains"] = (
        buf.num_scaleout_ranks == 1
        and buf.num_scaleup_ranks == R
        and deep_ep.get_logical_domain_size(group) == (1, R)
        and buf.num_bytes == hint
    )
    rt = deep_ep.runtime

    def go(**kw: Any) -> Any:
        args: dict[str, Any] = dict(topk_idx=mine.idx, topk_weights=mine.probs, num_experts=E)
        args.setdefault("num_sms", NUM_SMS)
        args.update(kw)
        return buf.dispatch(mine.x, **args)

    # non-expand, CPU sync: rows per (token, destination rank), local ids, the sender's weights
    rt.emu_reset_counters()
    recv_x, recv_idx, recv_w, h, ev = go()
    out["dispatch_collectives"] = rt.emu_counters().get("collectives")
    raw_w = torch.stack([inputs[s].probs[t] for s, t in ref.sources]).reshape(-1, K)
    out["rows"] = torch.equal(recv_x, ref.x) and torch.equal(recv_idx, ref.idx)
    out["weights"] = torch.equal(recv_w, raw_w)
    out["handle"] = (
        h.num_recv_tokens == n
        and h.num_recv_tokens_per_expert_list == ref.counts.tolist()
        and int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) == n
        and h.psum_num_recv_tokens_per_scaleup_rank.dtype == torch.int32
        and h.recv_src_metadata.shape == (n, K + 2)
        and h.recv_src_metadata[:, 0].tolist() == [s * M + t for s, t in ref.sources]
        and tuple(h.dst_buffer_slot_idx.shape) == (mine.x.shape[0], K)
        and h.token_metadata_at_forward is None
        and h.channel_linked_list is None
        and torch.equal(h.num_unaligned_recv_tokens_per_expert, ref.counts.to(torch.int32))
        and torch.equal(h.topk_idx, mine.idx)
        and h.topk_idx is not mine.idx
        and ev.event is None
    )
    # slots: rank * M + slot at the first top-k lane of each destination rank, -1 elsewhere
    dest = torch.where(mine.idx >= 0, mine.idx // e, -1)
    first = [[d >= 0 and d not in row[:j] for j, d in enumerate(row)] for row in dest.tolist()]
    slots = h.dst_buffer_slot_idx
    out["slots"] = (slots >= 0).tolist() == first and bool(
        ((slots[slots >= 0] >= rank * M) & (slots[slots >= 0] < rank * M + M)).all()
    )
    # num_sms = 0: DeepEP's own SM model over the loader's device stand-in
    out["auto_sms"] = go(num_sms=0)[3].num_sms > 0
    # combine: unweighted sum over the receiving ranks, one bf16 rounding; weights back per slot
    y = torch.sin(recv_x.float()).to(torch.bfloat16)
    combined, cw, _ = buf.combine(y, h, topk_weights=recv_w)
    dests = torch.tensor([len({i // e for i in r if i >= 0}) for r in mine.idx.tolist()])
    want = (torch.sin(mine.x.float()).to(torch.bfloat16).float() * dests.view(-1, 1)).to(
        torch.bfloat16
    )
    out["combine"] = torch.equal(combined, want)
    out["combine_w"] = torch.equal(cw, mine.probs * (mine.idx >= 0))
    # cached dispatch along the handle: the same rows, the same handle, no count exchange
    rt.emu_reset_counters()
    again = buf.dispatch(mine.x, handle=h, num_sms=NUM_SMS)
    out["cached"] = (
        torch.equal(again[0], recv_x)
        and again[3] is h
        and rt.emu_counters().get("collectives") == 1
    )
    # no CPU sync: R * M rows, the first n as with sync, garbage tails, no count list
    nx, nidx, nw, nh, _ = go(do_cpu_sync=False)
    out["nosync"] = (
        nx.shape[0] == R * M
        and nh.num_recv_tokens == R * M
        and nh.num_recv_tokens_per_expert_list == []
        and torch.equal(nx[:n], recv_x)
        and torch.equal(nidx[:n], recv_idx)
        and torch.equal(nw[:n], recv_w)
        and bool(torch.isnan(nx[n:].float()).any())
        and int(nh.psum_num_recv_tokens_per_scaleup_rank[-1]) == n
    )
    ny = torch.sin(nx.float()).to(torch.bfloat16)  # NaN tails: combine must not read them
    nc, ncw, _ = buf.combine(ny, nh, topk_weights=nw)
    out["nosync_combine"] = torch.equal(nc, combined) and torch.equal(ncw, cw)
    # expand: one row per (token, local expert), grouped by expert, aligned, zero padding
    a = 4
    ex_ref, ew_ref, aligned = _expand_ref(ref, e, a)
    ex, eidx, ew, eh, _ = go(do_expand=True, expert_alignment=a, do_zero_padding=True)
    ok = eidx is None and ew.dim() == 1 and eh.num_recv_tokens_per_expert_list == aligned
    ok = ok and eh.num_expanded_tokens == sum(aligned) and ex.shape[0] == sum(aligned)
    start = 0
    for j in range(e):
        c = ex_ref[j].shape[0]
        ok = ok and torch.equal(ex[start : start + c], ex_ref[j])
        ok = ok and torch.equal(ew[start : start + c], ew_ref[j])
        ok = ok and bool((ex[start + c : start + aligned[j]] == 0).all())
        ok = ok and int(eh.psum_num_recv_tokens_per_expert[j]) == start + c
        start += aligned[j]
    meta = eh.recv_src_metadata
    slots = meta[:, 2:]
    ok = ok and bool(((slots >= 0) == (ref.idx >= 0)).all())
    ok = ok and torch.equal(ex[slots[slots >= 0].long()], ref.x[(slots >= 0).nonzero()[:, 0]])
    out["expand"] = ok
    # expand combine: each rank sums its slots and rounds to bf16, the source sums the ranks
    ec, ecw, _ = buf.combine(ex, eh, topk_weights=ew)
    want_e = torch.zeros(mine.x.shape, dtype=torch.float32)
    for t, row in enumerate(mine.idx.tolist()):
        for r in sorted({i // e for i in row if i >= 0}):
            c = sum(1 for i in row if i >= 0 and i // e == r)
            want_e[t] += (mine.x[t].float() * c).to(torch.bfloat16).float()
    out["expand_combine"] = torch.equal(ec, want_e.to(torch.bfloat16)) and torch.equal(ecw, cw)
    # expand without sync: the worst case, the used rows as with sync
    wx, _, _, wh, _ = go(do_expand=True, expert_alignment=a, do_cpu_sync=False)
    worst = _a(R * M * min(K, e) + (a - 1) * e, a)
    used = sum(aligned)
    start, same = 0, True
    for j in range(e):
        c = ex_ref[j].shape[0]
        same = same and torch.equal(wx[start : start + c], ex_ref[j])
        start += aligned[j]
    out["expand_nosync"] = (
        wx.shape[0] == worst == wh.num_expanded_tokens
        and wh.num_recv_tokens_per_expert_list == []
        and same
        and bool(torch.isnan(wx[used:].float()).any())
    )
    wc, _, _ = buf.combine(torch.nan_to_num(wx, nan=7.0).contiguous(), wh)
    out["expand_nosync_combine"] = torch.equal(wc, ec)
    # cached expand (the backward of combine): do_expand passed again, weights optional
    cx, _, cwt, ch, _ = buf.dispatch(
        mine.x, handle=eh, do_expand=True, num_sms=NUM_SMS, topk_weights=mine.probs
    )
    rows = slots[slots >= 0].long()  # the padding is not zeroed again: compare the real rows
    out["cached_expand"] = (
        ch is eh and torch.equal(cx[rows], ex[rows]) and torch.equal(cwt[rows], ew[rows])
    )
    # fp8 (x, sf) passes through: bytes and scales land where bf16 rows land
    x8 = mine.x.float().clamp(-400, 400).to(torch.float8_e4m3fn)
    sf = _sf_of(inputs, rank)
    (r8, rsf), _, _, _, _ = buf.dispatch(
        (x8, sf), topk_idx=mine.idx, num_experts=E, num_sms=NUM_SMS
    )
    ref8 = torch.stack([inputs[s].x[t].float().clamp(-400, 400) for s, t in ref.sources])
    refsf = torch.stack([_sf_of(inputs, s)[t] for s, t in ref.sources])
    out["fp8"] = (
        r8.dtype == torch.float8_e4m3fn
        and torch.equal(r8.view(torch.uint8), ref8.to(torch.float8_e4m3fn).view(torch.uint8))
        and torch.equal(rsf, refsf)
    )
    # atomic slot order (as on a GPU): the same rows, shuffled inside each source group; the
    # metadata key src_rank * M + token sorts them back; a cached dispatch keeps the order
    emulated.ATOMIC_ORDER = True
    sx, sidx, _, sh, _ = go()
    key = sh.recv_src_metadata[:, 0].long()
    srt = torch.argsort(key)
    again = buf.dispatch(mine.x, handle=sh, num_sms=NUM_SMS)[0]
    groups = torch.diff(sh.psum_num_recv_tokens_per_scaleup_rank.long(), prepend=key.new_zeros(1))
    src_of = torch.repeat_interleave(torch.arange(R), groups)
    out["atomic_order"] = (
        torch.equal(sx[srt], recv_x)
        and torch.equal(sidx[srt], recv_idx)
        and torch.equal(key // M, src_of)  # still grouped by source rank
        and torch.equal(again, sx)
    )
    out["atomic_shuffled"] = bool((key != key.sort().values).any()) or n < 3
    ssy = torch.sin(sx.float()).to(torch.bfloat16)
    out["atomic_combine"] = torch.equal(buf.combine(ssy, sh)[0], combined)
    rt.emu_reset_counters()
    buf.barrier()
    out["barrier"] = rt.emu_counters() == {"elastic_barrier": 1, "collectives": 1}
    buf.destroy()
    out["destroyed"] = buf.runtime is None
    return out


def _sf_of(inputs: list, s: int) -> torch.Tensor:
    """Rank ``s``'s fp32 scales ``[T, H / 128]``, identical on every process."""
    g = torch.Generator().manual_seed(1000 + s)
    return torch.rand(inputs[s].x.shape[0], H // 128, generator=g)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("R", [2, 4])
def test_elastic_direct_mode_keeps_deepeps_semantics(R: int) -> None:
    for out in run_group(semantics_worker, R, timeout=150):
        bad = [k for k, v in out.items() if k != "dispatch_collectives" and v is not True]
        assert not bad, (bad, out)
        assert out["dispatch_collectives"] == 2, out


# --------------------------------------------------------------------- asserts and traps
def limits_worker(rank: int, R: int) -> dict[str, str]:
    import torch.distributed as dist

    from tests.deepep_emu.load import load_deep_ep

    deep_ep = load_deep_ep(release="2.1.0")
    group = dist.group.WORLD
    E, T = 2 * R, 6
    out: dict[str, str] = {}
    out["buffer_bytes"] = _error(lambda: deep_ep.ElasticBuffer(group, num_bytes=100))
    out["size_args"] = _error(lambda: deep_ep.ElasticBuffer.get_buffer_size_hint(group, 0, H))
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K)
    idx = (torch.arange(T * K).view(T, K) % E).to(torch.int64)
    x = torch.randn(T, H).to(torch.bfloat16)

    def go(x: torch.Tensor = x, idx: torch.Tensor = idx, **kw: Any) -> Any:
        args: dict[str, Any] = dict(topk_idx=idx, num_experts=E, num_sms=NUM_SMS)
        args.update(kw)
        return buf.dispatch(x, **args)

    out["num_max"] = _error(
        lambda: go(torch.zeros(M + 1, H, dtype=torch.bfloat16), torch.zeros(M + 1, K).long())
    )
    wide = torch.full((T, 33), -1, dtype=torch.int64)
    wide[:, 0] = 0
    out["topk_max"] = _error(lambda: go(idx=wide))
    out["local_experts"] = _error(lambda: go(num_experts=2 * R * 257))
    x8 = torch.zeros(T, 16).to(torch.float8_e4m3fn)
    out["fp8_hidden"] = _error(lambda: go((x8, torch.ones(T, 1))))
    out["dispatch_buffer"] = _error(lambda: go(num_max_tokens_per_rank=4096))
    out["zero_padding"] = _error(lambda: go(do_zero_padding=True))
    dup = torch.tensor([[0, 0, -1], [2, 2, -1]], dtype=torch.int64) % E
    out["duplicate"] = _error(lambda: go(x[:2], dup))
    recv_x, _, _, h, _ = go()
    out["combine_hidden"] = _error(lambda: buf.combine(recv_x[:, :128].contiguous(), h))
    out["combine_x"] = _error(lambda: buf.combine(recv_x.float(), h))
    single = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, allow_multiple_reduction=False
    )
    probs = torch.rand(T, K)
    ex, _, ew, eh, _ = single.dispatch(
        x, topk_idx=idx, topk_weights=probs, num_experts=E, num_sms=NUM_SMS, do_expand=True
    )
    out["expand_weights"] = _error(lambda: single.combine(ex, eh, topk_weights=ew))
    # without weights the single-reduction expand combine sums every slot once, in fp32
    sc, _, _ = single.combine(ex, eh)
    want = torch.zeros(T, H)
    for t, row in enumerate(idx.tolist()):
        want[t] = x[t].float() * sum(1 for i in row if i >= 0)
    out["single_reduction"] = "ok" if torch.equal(sc, want.to(torch.bfloat16)) else "differs"
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_elastic_limits_fire_with_their_citation() -> None:
    cases = {
        "buffer_bytes": ("elastic.buffer_bytes", "csrc/elastic/buffer.hpp:98"),
        "size_args": ("elastic.size_args", "csrc/elastic/buffer.hpp:657"),
        "num_max": ("elastic.num_max", "csrc/elastic/buffer.hpp:756"),
        "topk_max": ("elastic.topk_max", "impls/dispatch.cuh:93"),
        "local_experts": ("elastic.local_experts", "common/layout.cuh:40"),
        "fp8_hidden": ("elastic.token_hidden_bytes", "common/layout.cuh:198"),
        "dispatch_buffer": ("elastic.dispatch_buffer", "csrc/elastic/buffer.hpp:963"),
        "zero_padding": ("elastic.zero_padding", "csrc/elastic/buffer.hpp:731"),
        "duplicate": ("elastic.duplicate_experts", "dispatch_copy_epilogue.cuh:107"),
        "combine_hidden": ("elastic.combine_hidden", "impls/combine.cuh:109"),
        "combine_x": ("elastic.combine_x", "csrc/elastic/buffer.hpp:1203"),
        "expand_weights": ("elastic.expand_weights", "impls/combine.cuh:69"),
    }
    device = {"duplicate", "expand_weights"}
    for out in run_group(limits_worker, 2, timeout=100):
        assert out["single_reduction"] == "ok", out
        for key, (lid, where) in cases.items():
            msg = out[key]
            assert lid in msg and where in msg and "dd758caf4518" in msg, (key, msg)
            if key in device:
                assert "GPU would have trapped" in msg, (key, msg)
            else:
                assert "Assertion error" in msg, (key, msg)


# --------------------------------------------------------------------- two emulated nodes
def nodes_worker(rank: int, R: int, L: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.deepep_emu.load import load_deep_ep
    from tests.deepep_emu.runtime import elastic as emulated

    emulated.ATOMIC_ORDER = False  # token order inside each source group (exact comparisons)
    deep_ep = load_deep_ep(nvl_peers=L, release="2.1.0")
    group = dist.group.WORLD
    E = 2 * R
    inputs = all_inputs(13, R=R, E=E, k=K, H=H, dtype=torch.bfloat16, exact=False)
    mine = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    out: dict[str, Any] = {}
    out["hybrid"] = _error(
        lambda: deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H)
    )
    # direct mode over RDMA + NVLink: the send buffers count in the size (buffer.hpp:596-627)
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 512, H, K, allow_hybrid_mode=False)
    tok_d = _a(H * 2, 32) + _a(K * 8 + (1 + K) * 4, 32)
    tok_c = _a(H * 2, 32) + _a(K * 8, 32)
    want = max(512 * tok_d + R * 512 * tok_d, R * 512 * tok_c + min(R, K) * 512 * tok_c)
    out["hint"] = hint == _a(want, 2 << 20)
    buf = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, allow_hybrid_mode=False
    )
    out["domains"] = (buf.num_scaleout_ranks, buf.num_scaleup_ranks) == (1, R) and (
        buf.num_rdma_ranks,
        buf.num_nvlink_ranks,
    ) == (R // L, L)
    recv_x, recv_idx, _, h, _ = buf.dispatch(
        mine.x, topk_idx=mine.idx, num_experts=E, num_sms=NUM_SMS
    )
    out["rows"] = torch.equal(recv_x, ref.x) and torch.equal(recv_idx, ref.idx)
    combined, cw, _ = buf.combine(recv_x, h)
    e = E // R
    dests = torch.tensor([len({i // e for i in r if i >= 0}) for r in mine.idx.tolist()])
    want_c = (mine.x.float() * dests.view(-1, 1)).to(torch.bfloat16)
    out["combine"] = torch.equal(combined, want_c) and cw is None
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_elastic_direct_mode_across_two_emulated_nodes() -> None:
    for out in run_group(nodes_worker, 4, 2, timeout=100):
        # hybrid mode (allow_hybrid_mode=True across nodes) is not emulated: a clear refusal
        assert out["hybrid"].startswith("NotImplementedError") and "hybrid" in out["hybrid"], out
        assert out["hint"] and out["domains"] and out["rows"] and out["combine"], out
