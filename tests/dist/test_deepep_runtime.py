"""The emulated DeepEP runtime under DeepEP's own ``legacy.py``, against slow references.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks of one emulated NVLink domain · N = R / L nodes · M received rows · W worst-case rows.

These tests call ``deep_ep.Buffer`` directly (no flexdispatch adapter): the handle tuples DeepEP
returns must hold DeepEP's tensors with DeepEP's meanings, the kernels must move rows as DeepEP
does, and DeepEP's host asserts and device traps must fire for the release being emulated — the
adapter tests (``test_deepep_real.py``) then show flexdispatch never reaches them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import all_inputs, ref_dispatch


def _buffer(deep_ep: Any, R: int, *, rdma: bool, H: int = 256) -> Any:
    """A buffer sized by DeepEP's own hints for rows of up to ``H`` fp32 values."""
    import torch.distributed as dist

    cfg = deep_ep.Buffer.get_dispatch_config(R)
    nvl = cfg.get_nvl_buffer_size_hint(H * 4, R)
    rdma_bytes = cfg.get_rdma_buffer_size_hint(H * 4, R) if rdma else 0
    return deep_ep.Buffer(
        dist.group.WORLD, nvl, rdma_bytes, num_qps_per_rank=24, explicitly_destroy=True
    )


def _error(fn: Any) -> str:
    try:
        fn()
    except (RuntimeError, AssertionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


# --------------------------------------------------------------------- intranode semantics
def intranode_worker(rank: int, R: int, release: str) -> dict[str, Any]:
    from tests.deepep_emu.load import load_deep_ep

    deep_ep = load_deep_ep(release=release)
    E, k, H = 2 * R, 3, 256
    inputs = all_inputs(7, R=R, E=E, k=k, H=H, dtype=torch.bfloat16, exact=False)
    mine = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    buf = _buffer(deep_ep, R, rdma=False, H=H)
    ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(mine.idx, E)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        mine.x,
        num_tokens_per_rank=ntr,
        num_tokens_per_rdma_rank=ntrr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=mine.idx,
        topk_weights=mine.probs,
    )
    rpm, chan_prefix, recv_chan_prefix, src_idx, itr_h, send_head = handle
    out: dict[str, Any] = {}
    out["rows"] = torch.equal(recv_x, ref.x)
    out["ids"] = torch.equal(recv_idx, ref.idx) and torch.equal(recv_w, ref.probs)
    out["counts"] = counts == ref.counts.tolist()
    out["shapes"] = [
        (tuple(t.shape), str(t.dtype)) for t in (rpm, chan_prefix, recv_chan_prefix, src_idx)
    ]
    C = buf.get_dispatch_config(R).num_sms // 2
    out["C"] = C
    # rank_prefix_matrix[i, j] = tokens ranks 0..i send to j
    sent = [[0] * R for _ in range(R)]
    for s, inp in enumerate(inputs):
        for row in inp.idx.tolist():
            for g in sorted({i // 2 for i in row if i >= 0}):
                sent[s][g] += 1
    want_rpm = torch.tensor(sent).cumsum(0).to(torch.int32)
    out["rpm"] = torch.equal(rpm, want_rpm)
    out["src_idx"] = src_idx.tolist() == [t for _, t in ref.sources]
    out["send_head"] = torch.equal(send_head >= 0, itr) and itr_h is itr
    out["event_none"] = event.event is None
    # combine: unweighted sum over the receiving ranks, one bf16 rounding
    y = torch.sin(recv_x.float()).to(torch.bfloat16)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    dests = itr.sum(1, keepdim=True).float()
    out["combine"] = (
        float(
            (combined.float() - torch.sin(mine.x.float()).to(torch.bfloat16).float() * dests)
            .abs()
            .max()
        )
        if combined.numel()
        else 0.0
    )
    out["combine_w"] = bool(torch.allclose(combined_w, mine.probs * (mine.idx >= 0), atol=0))
    # cached dispatch along the handle: the same rows, no counts
    again = buf.dispatch(mine.x, handle=handle)
    out["cached"] = torch.equal(again[0], recv_x) and again[3] is None
    # worst case: W rows, garbage tails (not zero), -1 id tails, an empty count list
    W = 4 * mine.x.shape[0] * R
    wx, widx, ww, wcounts, _, _ = buf.dispatch(
        mine.x,
        num_tokens_per_rank=ntr,
        num_tokens_per_rdma_rank=ntrr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=mine.idx,
        topk_weights=mine.probs,
        num_worst_tokens=W,
    )
    M = ref.x.shape[0]
    out["worst"] = (
        wx.shape[0] == W
        and torch.equal(wx[:M], ref.x)
        and bool((widx[M:] == -1).all())
        and wcounts == []
        and bool(torch.isnan(ww[M:].float()).any() or (ww[M:] != 0).any())
    )
    buf.destroy()
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("release", ["1.2.1", "2.1.0"])
def test_intranode_kernels_keep_deepeps_semantics(release: str) -> None:
    for out in run_group(intranode_worker, 2, release, timeout=100):
        assert out["rows"] and out["ids"] and out["counts"], out
        C = out["C"]
        assert out["shapes"] == [
            ((2, 2), "torch.int32"),
            ((2, C), "torch.int32"),
            ((2, C), "torch.int32"),
            (out["shapes"][3][0], "torch.int32"),
        ]
        assert out["rpm"] and out["src_idx"] and out["send_head"] and out["event_none"], out
        assert out["combine"] <= 2**-7 * 2, out
        assert out["combine_w"] and out["cached"] and out["worst"], out


# --------------------------------------------------------------------- internode semantics
def internode_worker(rank: int, R: int, L: int) -> dict[str, Any]:
    from tests.deepep_emu.load import load_deep_ep

    deep_ep = load_deep_ep(nvl_peers=L, release="1.2.1")
    E, k, H = 2 * R, 3, 256
    inputs = all_inputs(9, R=R, E=E, k=k, H=H, dtype=torch.bfloat16, exact=False)
    mine = inputs[rank]
    ref = ref_dispatch(inputs, rank, E)
    buf = _buffer(deep_ep, R, rdma=True, H=H)
    ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(mine.idx, E)
    recv_x, recv_idx, _recv_w, counts, handle, _ = buf.dispatch(
        mine.x,
        num_tokens_per_rank=ntr,
        num_tokens_per_rdma_rank=ntrr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=mine.idx,
        topk_weights=mine.probs,
    )
    out: dict[str, Any] = {"len": len(handle)}
    out["rows"] = torch.equal(recv_x, ref.x) and torch.equal(recv_idx, ref.idx)
    out["counts"] = counts == ref.counts.tolist()
    N = R // L
    out["ntrr"] = torch.equal(ntrr, itr.view(-1, N, L).any(-1).sum(0).to(torch.int32))
    gsum = handle[6]
    out["gbl_sum"] = int(gsum[-1]) == ref.x.shape[0] and gsum.dtype == torch.int32
    src_meta = handle[7]
    out["src_meta"] = (tuple(src_meta.shape[1:]), str(src_meta.dtype))
    out["nvl_head_cols"] = handle[9].shape[1]
    # two bf16 roundings: per destination node (the forwarder's sum), then across nodes
    y = (recv_x.float() * 1.001).to(torch.bfloat16)
    combined, _, _ = buf.combine(y, handle)
    e = E // R
    want = torch.zeros_like(mine.x, dtype=torch.float32)
    for t, row in enumerate(mine.idx.tolist()):
        ranks = sorted({i // e for i in row if i >= 0})
        nodes: dict[int, float | torch.Tensor] = {}
        for g in ranks:
            part = (mine.x[t].float() * 1.001).to(torch.bfloat16).float()
            nodes[g // L] = nodes.get(g // L, 0) + part
        for n in sorted(nodes):
            want[t] += torch.as_tensor(nodes[n]).to(torch.bfloat16).float()
    out["two_roundings"] = torch.equal(combined, want.to(torch.bfloat16))
    again = buf.dispatch(mine.x, handle=handle)
    out["cached"] = torch.equal(again[0], recv_x)
    # what only the internode kernels refuse
    out["worst"] = _error(
        lambda: buf.dispatch(
            mine.x,
            num_tokens_per_rank=ntr,
            num_tokens_per_rdma_rank=ntrr,
            is_token_in_rank=itr,
            num_tokens_per_expert=nte,
            topk_idx=mine.idx,
            topk_weights=mine.probs,
            num_worst_tokens=64,
        )
    )
    narrow = torch.zeros(recv_x.shape[0], 128, dtype=torch.bfloat16)
    out["combine_hidden"] = _error(lambda: buf.combine(narrow, handle))
    buf.destroy()
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_internode_kernels_two_stage_and_handle() -> None:
    for out in run_group(internode_worker, 4, 2, timeout=100):
        assert out["len"] == 10 and out["rows"] and out["counts"] and out["ntrr"], out
        assert out["gbl_sum"] and out["src_meta"] == ((8,), "torch.uint8"), out
        assert out["nvl_head_cols"] == 2 and out["two_roundings"] and out["cached"], out
        assert "does not support `num_worst_tokens > 0`" in out["worst"], out
        assert "GPU would have trapped" in out["combine_hidden"], out
        assert "internode.combine_hidden" in out["combine_hidden"], out
        assert "internode.cu" in out["combine_hidden"], out


# --------------------------------------------------------------------- asserts and traps
def limits_worker(rank: int, R: int, release: str) -> dict[str, str]:
    import torch.distributed as dist

    from tests.deepep_emu.load import load_deep_ep

    deep_ep = load_deep_ep(release=release)
    E, k = 2 * R, 2
    out: dict[str, str] = {}
    out["bytes_aligned"] = _error(lambda: deep_ep.Buffer(dist.group.WORLD, 100, 0))
    buf = _buffer(deep_ep, R, rdma=False, H=8192)

    def dispatch(x: torch.Tensor, idx: torch.Tensor, **kw: Any) -> Any:
        ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(idx, E)
        probs = torch.rand(idx.shape, dtype=torch.float32)
        return buf.dispatch(
            x,
            num_tokens_per_rank=ntr,
            num_tokens_per_rdma_rank=ntrr,
            is_token_in_rank=itr,
            num_tokens_per_expert=nte,
            topk_idx=idx,
            topk_weights=probs,
            **kw,
        )

    T = 6
    idx = torch.arange(T * k).view(T, k) % E
    out["tma_row"] = _error(lambda: dispatch(torch.zeros(T, 8192, dtype=torch.bfloat16), idx))
    out["row_int4"] = _error(lambda: dispatch(torch.zeros(T, 12, dtype=torch.bfloat16), idx))
    out["topk_dtype"] = _error(
        lambda: dispatch(torch.zeros(T, 64, dtype=torch.bfloat16), idx.int())
    )
    res = dispatch(torch.zeros(T, 64, dtype=torch.bfloat16), idx)
    M = res[0].shape[0]
    out["divergence"] = _error(
        lambda: buf.combine(torch.zeros(M, 64, dtype=torch.bfloat16), res[4])
    )
    out["combine_dtype"] = _error(lambda: buf.combine(torch.zeros(M, 64), res[4]))
    out["overflow"] = _error(
        lambda: dispatch(torch.zeros(T, 64, dtype=torch.bfloat16), idx, num_worst_tokens=2)
    )
    out["sms"] = _error(lambda: deep_ep.Buffer.set_num_sms(7))
    buf.destroy()
    plain = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    out["destroy_flag"] = _error(plain.destroy)
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("release", ["1.2.1", "2.1.0"])
def test_kernel_limits_fire_as_in_deepep(release: str) -> None:
    commit = {"1.2.1": "9af0e0d0e74f", "2.1.0": "dd758caf4518"}[release]
    for out in run_group(limits_worker, 2, release, timeout=100):
        assert "buffer.bytes_aligned" in out["bytes_aligned"], out
        trap = out["tma_row"]
        assert "GPU would have trapped" in trap and "dispatch.tma_row" in trap, out
        assert commit in trap and f"DeepEP {release}" in trap, out
        assert "dispatch.row_int4" in out["row_int4"], out
        assert "Long" in out["topk_dtype"], out
        if release == "1.2.1":  # the combine loop of v1.2.1 diverges below 256 columns
            assert "combine.v121_divergence" in out["divergence"], out
        else:
            assert out["divergence"] == "", out
        assert "combine.dtype" in out["combine_dtype"], out
        assert "worst.overflow" in out["overflow"], out
        assert "The SM count must be even" in out["sms"], out
        assert "`explicitly_destroy` flag must be set" in out["destroy_flag"], out
