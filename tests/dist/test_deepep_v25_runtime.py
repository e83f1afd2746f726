"""The emulated DeepEP 2.5 runtime (``tests/deepep_emu/runtime/ep.py``) under DeepEP's own
``deep_ep_v25/buffers/ep.py``, against slow references, on 4 gloo ranks as 2 emulated nodes of 2.

Shape letters: T tokens · H hidden · E experts · R ranks · e = E / R · k top-k · M =
``num_max_tokens_per_rank`` · U scale-up ranks (R direct, the NVLink domain hybrid).

One group checks both modes on the same ranks (a direct and a hybrid ``EPBuffer``): the receive
layout (groups per scale-up peer, ``recv_src_metadata``), CPU-sync and worst-case sizes with
uninitialised tails, the expanded layout with ``expert_alignment`` and ``do_zero_padding``,
cached dispatch, combine (bf16 roundings per rank and, hybrid, per node; biases; the weights
channel), ``defer_epilogue``, the JIT at first use, and a set of host asserts and device traps
raised with their DeepEP 2.5 source lines.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_group

R, L, E, K, H, M = 4, 2, 16, 3, 256, 16
e = E // R


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + rank)
    T = 3 + 2 * rank
    x = (rank * 100 + torch.arange(T)[:, None] + torch.arange(H)[None, :] / 256).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    return x, idx, torch.rand(T, K, generator=g)


def _raises(fn: Any) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return ""


def layout_checks(buf: Any, rank: int, hybrid: bool) -> dict[str, Any]:
    ins = [_inputs(r) for r in range(R)]
    x, idx, w = ins[rank]
    out: dict[str, Any] = {}
    rx, ridx, rw, h, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=M, num_sms=8
    )
    n = rx.shape[0]
    key = h.recv_src_metadata[:, 0].to(torch.int64)
    src, tok = key // M, key % M
    # one row per (token, rank), grouped by scale-up peer: the source rank (direct) or the
    # forwarder with the source's local index (hybrid)
    want = sorted(
        (s, t)
        for s in range(R)
        for t in range(ins[s][0].shape[0])
        if any(i >= 0 and i // e == rank for i in ins[s][1][t].tolist())
    )
    out["rows"] = sorted(zip(src.tolist(), tok.tolist(), strict=True)) == want
    group = src % L if hybrid else src
    psum = h.psum_num_recv_tokens_per_scaleup_rank.to(torch.int64)
    bounds = torch.bucketize(torch.arange(n), psum, right=True)
    out["groups"] = bool(torch.equal(bounds, group)) and psum.numel() == (L if hybrid else R)
    out["x"] = all(
        torch.equal(rx[i], ins[s][0][t])
        for i, (s, t) in enumerate(zip(src.tolist(), tok.tolist(), strict=True))
    )
    local = torch.stack([ins[s][1][t] for s, t in zip(src.tolist(), tok.tolist(), strict=True)])
    mine = (local >= rank * e) & (local < (rank + 1) * e)
    out["ids"] = bool(torch.equal(ridx, torch.where(mine, local - rank * e, -1)))
    out["weights"] = all(
        torch.equal(rw[i], ins[s][2][t])
        for i, (s, t) in enumerate(zip(src.tolist(), tok.tolist(), strict=True))
    )
    # cached dispatch: the same rows in the same places
    c, *_ = buf.dispatch(x * 2, handle=h, num_sms=8)
    out["cached"] = bool(torch.equal(c, rx * 2))
    # combine: one row back per received row, the source adds them with the biases in fp32 and
    # rounds once; slot j's weight as its expert's rank sent it
    b0 = torch.full((x.shape[0], H), 0.5, dtype=torch.bfloat16)
    y, cw, _ = buf.combine(rx, h, topk_weights=rw, bias=(b0, b0))
    n_dest = torch.tensor([len({i // e for i in row if i >= 0}) for row in idx.tolist()])
    out["combine"] = bool(torch.equal(y, (x.float() * n_dest[:, None] + 1.0).to(torch.bfloat16)))
    out["combine_weights"] = bool(torch.equal(cw, torch.where(idx >= 0, w, 0.0)))
    # worst case: R * M rows, uninitialised past the real ones
    wx, _widx, _, wh, _ = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_experts=E,
        num_max_tokens_per_rank=M,
        num_sms=8,
        do_cpu_sync=False,
    )
    used = int(wh.psum_num_recv_tokens_per_scaleup_rank[-1])
    out["worst"] = (
        wx.shape[0],
        used,
        bool(torch.isnan(wx[used:].float()).any()) or used == R * M,
        wh.num_recv_tokens_per_expert_list,
    )
    out["worst_prefix"] = sorted(wh.recv_src_metadata[:used, 0].tolist()) == sorted(key.tolist())
    # expanded, aligned to 4, zero padding: expert j at [start_j, start_j + count_j)
    for sync in (True, False):
        ex, _, ew, eh, _ = buf.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            num_experts=E,
            num_max_tokens_per_rank=M,
            num_sms=8,
            do_expand=True,
            expert_alignment=4,
            do_zero_padding=True,
            do_cpu_sync=sync,
        )
        cnt = eh.num_unaligned_recv_tokens_per_expert.to(torch.int64)
        aligned = (cnt + 3) // 4 * 4
        starts = torch.cumsum(aligned, 0) - aligned
        ok = torch.equal(eh.psum_num_recv_tokens_per_expert.to(torch.int64), starts + cnt)
        want_cnt = [sum(int((ins[s][1] == rank * e + j).sum()) for s in range(R)) for j in range(e)]
        ok &= cnt.tolist() == want_cnt
        for j in range(e):
            mid, hi = int(starts[j] + cnt[j]), int(starts[j] + aligned[j])
            ok &= bool((ex[mid:hi] == 0).all() and (ew[mid:hi] == 0).all())
        # each slot's row: its token's row and the slot's weight, inside its expert's segment
        meta = eh.recv_src_metadata.to(torch.int64)
        used = int(eh.psum_num_recv_tokens_per_scaleup_rank[-1])
        for i in range(used):
            s_, t_ = int(meta[i, 0]) // M, int(meta[i, 0]) % M
            for lane in range(K):
                slot, j = int(meta[i, 2 + lane]), int(ins[s_][1][t_, lane]) - rank * e
                if slot < 0:
                    ok &= not 0 <= j < e
                    continue
                ok &= bool(torch.equal(ex[slot], ins[s_][0][t_]))
                ok &= bool(ew[slot] == ins[s_][2][t_, lane])
                ok &= int(starts[j]) <= slot < int(starts[j] + cnt[j])
        if sync:
            ok &= eh.num_recv_tokens_per_expert_list == aligned.tolist()
            ok &= ex.shape[0] == int(aligned.sum())
        else:
            ok &= ex.shape[0] == -(-(R * M * min(K, e) + 3 * e) // 4) * 4
        out[f"expand_{sync}"] = bool(ok)
        # expanded combine: each rank sums a token's slots (one bf16 rounding), then the source
        ey, _, _ = buf.combine(ex, eh)
        slots = torch.tensor([[int(i >= 0) for i in row] for row in idx.tolist()]).sum(1)
        out[f"expand_combine_{sync}"] = bool(
            torch.equal(ey, (x.float() * slots[:, None]).to(torch.bfloat16))
        )
    # defer_epilogue: the same rows, built at current_stream_wait()
    ev = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_experts=E,
        num_max_tokens_per_rank=M,
        num_sms=8,
        async_with_compute_stream=True,
        defer_epilogue=True,
    )
    _dx, _didx, _dw, dh = ev.current_stream_wait()
    out["defer"] = sorted(dh.recv_src_metadata[:, 0].tolist()) == sorted(key.tolist())
    return out


def hybrid_rounding(buf: Any, rank: int) -> bool:
    """Hybrid mode with ``allow_multiple_reduction`` rounds each destination node's sum to bf16
    (at the forwarder) before the source adds the nodes: checked against that reference."""
    g = torch.Generator().manual_seed(3)
    T = 4
    idx = torch.tensor([[0, 4, 8], [1, 5, 12], [2, 9, 13], [3, 6, 14]])  # ranks 0,1 | 2,3 mixed
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    _rx, _, _, h, _ = buf.dispatch(
        x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=M, num_sms=8
    )
    key = h.recv_src_metadata[:, 0].to(torch.int64)
    vals = torch.randn(R, R, T, H, generator=g).to(torch.bfloat16)  # [dst rank, src, t]
    y = torch.stack([vals[rank, int(k) // M, int(k) % M] for k in key])
    out, _, _ = buf.combine(y.contiguous(), h)
    ref = torch.zeros(T, H)
    for t in range(T):
        ranks = sorted({int(i) // e for i in idx[t]})
        for node in (0, 1):
            part = [vals[r, rank, t].float() for r in ranks if r // L == node]
            if part:
                s = torch.stack(part).sum(0)
                ref[t] += s.to(torch.bfloat16).float() if len(part) > 1 else s
    return bool(torch.equal(out, ref.to(torch.bfloat16)))


def limit_checks(v25: Any, direct: Any, hybrid: Any, rank: int) -> dict[str, str]:
    x, idx, _w = _inputs(rank)
    kw = {"num_experts": E, "num_max_tokens_per_rank": M, "num_sms": 8}

    def d(**extra: Any) -> str:
        return _raises(lambda: direct.dispatch(x, **{"topk_idx": idx, **kw, **extra}))

    out = {
        "num_max": d(num_max_tokens_per_rank=2),
        "zero_padding": d(do_zero_padding=True),
        "defer": d(defer_epilogue=True),
        "duplicate": d(topk_idx=idx[:, [0, 0, 1]].contiguous()),
        "id_range": d(topk_idx=(idx.abs() + E).contiguous()),
    }
    rx, _, _, h, _ = direct.dispatch(x, topk_idx=idx, **kw)
    out["combine_hidden"] = _raises(lambda: direct.combine(rx[:, :128].contiguous(), h))
    out["combine_bias"] = _raises(lambda: direct.combine(rx, h, bias=rx[:1].contiguous()))
    out["combine_dtype"] = _raises(lambda: direct.combine(rx.float(), h))
    # hybrid mode: at most 128 notify threads for U + e (U = 2 here: e = 127 is too many)
    big = 2 * R * 127
    out["hybrid_notify"] = _raises(
        lambda: hybrid.dispatch(
            x, topk_idx=idx, num_experts=big, num_max_tokens_per_rank=M, num_sms=8
        )
    )
    return out


def worker(rank: int, world: int) -> dict[str, Any]:
    from tests.deepep_emu.load import load_deep_ep

    v25 = load_deep_ep(nvl_peers=L, release="2.5.0")
    group = dist.group.WORLD
    jit = v25.runtime.emu_jit_compiles
    before = sum(jit.values())
    direct = v25.EPBuffer(
        group,
        num_max_tokens_per_rank=M,
        hidden=H,
        num_topk=K,
        allow_hybrid_mode=False,
        explicitly_destroy=True,
    )
    hybrid = v25.EPBuffer(
        group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True
    )
    out: dict[str, Any] = {
        "domains": (
            direct.get_logical_domain_size(),
            hybrid.get_logical_domain_size(),
            hybrid.get_physical_domain_size(),
        ),
        "direct": layout_checks(direct, rank, False),
        "hybrid": layout_checks(hybrid, rank, True),
        "hybrid_rounding": hybrid_rounding(hybrid, rank),
    }
    out["jit"] = sum(jit.values()) - before
    again = sum(jit.values())
    layout_checks(direct, rank, False)
    out["jit_again"] = sum(jit.values()) - again
    out["limits"] = limit_checks(v25, direct, hybrid, rank)
    direct.destroy()
    hybrid.destroy()
    out["destroy_twice"] = _raises(direct.runtime.destroy if direct.runtime else lambda: None)
    return out


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_emulated_ep_runtime_direct_and_hybrid() -> None:
    for rank, out in enumerate(run_group(worker, R, timeout=160)):
        assert out["domains"] == ((1, R), (R // L, L), (R // L, L)), out["domains"]
        for mode in ("direct", "hybrid"):
            c = out[mode]
            for key in (
                "rows",
                "groups",
                "x",
                "ids",
                "weights",
                "cached",
                "combine",
                "combine_weights",
                "worst_prefix",
                "expand_True",
                "expand_False",
                "expand_combine_True",
                "expand_combine_False",
                "defer",
            ):
                assert c[key] is True, (rank, mode, key, c)
            rows, used, garbage, count_list = c["worst"]
            assert rows == R * M and used <= rows and garbage and count_list == [], c["worst"]
        assert out["hybrid_rounding"], rank
        assert out["jit"] > 0 and out["jit_again"] == 0, out
        lim = out["limits"]
        for key, lid in (
            ("num_max", "ep.num_max"),
            ("zero_padding", "ep.zero_padding"),
            ("defer", "ep.defer_dispatch"),
            ("combine_hidden", "ep.combine_hidden"),
            ("combine_bias", "ep.combine_bias"),
            ("combine_dtype", "ep.combine_dtype"),
            ("hybrid_notify", "ep.hybrid_notify"),
        ):
            assert "Assertion error" in lim[key] and lid in lim[key], (key, lim[key])
            assert "@ sgl-deep-ep-v25==0.1.0rc0" in lim[key], lim[key]
        for key, lid in (("duplicate", "ep.duplicate_experts"), ("id_range", "ep.expert_id_range")):
            assert "would have trapped" in lim[key] and lid in lim[key], (key, lim[key])
