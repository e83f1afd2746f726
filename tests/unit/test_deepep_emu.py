"""The DeepEP emulator (tests/deepep_emu) against slow per-token loops, and its quirks.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
M received rows · W worst-case rows.

The emulator is what the adapter is tested on without GPUs, so it must be right and must be as
awkward as DeepEP: each group below runs many checks in one spawned gloo group (spawning costs
seconds); every rank rebuilds every rank's inputs from one seed and knows the answer locally.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.deepep_emu import deep_ep as emu
from tests.dist.harness import run_group

H_NORMAL, H_LL, K = 64, 2048, 3


# --------------------------------------------------------------------- inputs and references
def make(seed: int, rank: int, R: int, E: int, H: int, k: int = K, T: int | None = None) -> dict:
    """Rank ``rank``'s inputs: bf16 ``x [T, H]``, ``idx [T, k]`` (some -1), fp32 ``w [T, k]``."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T = 4 + 3 * rank if T is None else T
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    idx = idx.masked_fill(torch.rand(T, k, generator=g) < 0.2, -1)
    w = torch.rand(T, k, generator=g).masked_fill(idx < 0, 0.0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return {"x": x, "idx": idx, "w": w}


def ref_layout(idx: torch.Tensor, E: int, R: int) -> tuple[list[int], list[int], list[list[bool]]]:
    e = E // R
    per_rank, per_expert = [0] * R, [0] * E
    in_rank = [[False] * R for _ in range(idx.shape[0])]
    for t, row in enumerate(idx.tolist()):
        for i in row:
            if i >= 0:
                per_expert[i] += 1
                in_rank[t][i // e] = True
        for r in range(R):
            per_rank[r] += in_rank[t][r]
    return per_rank, per_expert, in_rank


def ref_receive(inputs: list[dict], me: int, E: int) -> dict:
    """What rank ``me`` receives: rows by source rank then token, local ids, weights, counts."""
    R = len(inputs)
    e = E // R
    xs, ids, ws, counts = [], [], [], [0] * e
    for inp in inputs:
        for t, row in enumerate(inp["idx"].tolist()):
            if not any(i >= 0 and i // e == me for i in row):
                continue
            loc = [i - me * e if i >= 0 and i // e == me else -1 for i in row]
            xs.append(inp["x"][t])
            ids.append(loc)
            ws.append([float(inp["w"][t, j]) if loc[j] >= 0 else 0.0 for j in range(len(row))])
            for j in loc:
                if j >= 0:
                    counts[j] += 1
    k = inputs[0]["idx"].shape[1]
    H = inputs[0]["x"].shape[1]
    return {
        "x": torch.stack(xs) if xs else torch.zeros(0, H, dtype=torch.bfloat16),
        "idx": torch.tensor(ids, dtype=torch.int64).reshape(-1, k),
        "w": torch.tensor(ws, dtype=torch.float32).reshape(-1, k),
        "counts": counts,
    }


def ref_combine_of_x(inp: dict, E: int, R: int, bias: float = 0.0) -> torch.Tensor:
    """combine(recv_x) at the source: each token summed once per destination rank (fp32, then
    ``bias`` added, then one rounding to bf16)."""
    e = E // R
    out = torch.full(inp["x"].shape, bias, dtype=torch.float32)
    for t, row in enumerate(inp["idx"].tolist()):
        for _ in sorted({i // e for i in row if i >= 0}):
            out[t] += inp["x"][t].float()
    return out.to(torch.bfloat16)


def nvl_bytes(R: int, H: int, elem: int = 2) -> int:
    cfgs = (emu.Buffer.get_dispatch_config(R), emu.Buffer.get_combine_config(R))
    return max(c.get_nvl_buffer_size_hint(H * max(elem, 2), R) for c in cfgs)


def layout(buf: Any, inp: dict, E: int) -> dict:
    ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(inp["idx"], E)
    return {
        "num_tokens_per_rank": ntr,
        "num_tokens_per_rdma_rank": ntrr,
        "num_tokens_per_expert": nte,
        "is_token_in_rank": itr,
    }


def raises(exc: type[BaseException], fn: Any, *args: Any, **kw: Any) -> str:
    try:
        fn(*args, **kw)
    except exc as err:
        return str(err)
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


# --------------------------------------------------------------------- normal kernels
def normal_worker(rank: int, R: int, seed: int) -> int:
    import torch.distributed as dist

    group = dist.group.WORLD
    E = 3 * R
    inputs = [make(seed, r, R, E, H_NORMAL) for r in range(R)]
    inp, ref = inputs[rank], ref_receive(inputs, rank, E)
    M = ref["x"].shape[0]
    buf = emu.Buffer(group, nvl_bytes(R, H_NORMAL))
    checked = 0

    # layout equals the per-token loop, with DeepEP's dtypes
    lay = layout(buf, inp, E)
    per_rank, per_expert, in_rank = ref_layout(inp["idx"], E, R)
    assert lay["num_tokens_per_rank"].tolist() == per_rank
    assert lay["num_tokens_per_rank"].dtype == torch.int32
    assert lay["num_tokens_per_expert"].tolist() == per_expert
    assert lay["is_token_in_rank"].tolist() == in_rank
    assert lay["num_tokens_per_rdma_rank"] is None
    checked += 1

    # dropless dispatch: rows by (source rank, token), local ids, weights, per-expert counts
    rx, ridx, rw, counts, handle, event = buf.dispatch(
        inp["x"], topk_idx=inp["idx"], topk_weights=inp["w"], **lay
    )
    assert torch.equal(rx, ref["x"]) and torch.equal(ridx, ref["idx"])
    assert torch.equal(rw, ref["w"]) and counts == ref["counts"]
    assert isinstance(handle, tuple) and event.event is None
    checked += 1

    # combine: unweighted sum over destination ranks, bf16 out; weights summed in fp32
    out, out_w, _ = buf.combine(rx, handle, topk_weights=rw)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_combine_of_x(inp, E, R))
    assert torch.allclose(out_w, inp["w"], atol=1e-6)
    bias = torch.ones_like(inp["x"])
    out_b, _, _ = buf.combine(rx, handle, bias=(bias, bias))
    assert torch.equal(out_b, ref_combine_of_x(inp, E, R, bias=2.0))
    checked += 1

    # cached dispatch re-sends along the handle; expert alignment rounds the count list up
    y = (inp["x"].float() * 3).to(torch.bfloat16)
    cx, n1, n2, n3, n4, _ = buf.dispatch(y, handle=handle)
    assert (n1, n2, n3, n4) == (None, None, None, None)
    assert torch.equal(cx, (ref["x"].float() * 3).to(torch.bfloat16))
    _, _, _, aligned, _, _ = buf.dispatch(
        inp["x"], topk_idx=inp["idx"], topk_weights=inp["w"], expert_alignment=4, **lay
    )
    assert aligned == [-(-c // 4) * 4 for c in ref["counts"]]
    checked += 1

    # fp8 tuple in, tuple out; async events can be waited on, sync ones cannot
    q = inp["x"].float().to(torch.float8_e4m3fn)
    s = torch.rand(q.shape[0], H_NORMAL // 128 + 1)
    (rq, rs), *_ = buf.dispatch(
        (q, s), topk_idx=inp["idx"], topk_weights=inp["w"], async_finish=True, **lay
    )
    ref_q = ref_receive(
        [{**d, "x": d["x"].float().to(torch.float8_e4m3fn)} for d in inputs], rank, E
    )
    assert torch.equal(rq.view(torch.uint8), ref_q["x"].view(torch.uint8))
    assert rs.shape == (M, s.shape[1])
    *_, ev = buf.dispatch(inp["x"], async_finish=True, **lay)
    ev.current_stream_wait()
    with ev:
        pass
    raises(AssertionError, event.current_stream_wait)
    checked += 1

    # worst-case mode: W rows, garbage tails in x and weights, -1 tail in ids, no count list
    W = M + 5
    wx, widx, ww, wcounts, whandle, _ = buf.dispatch(
        inp["x"], topk_idx=inp["idx"], topk_weights=inp["w"], num_worst_tokens=W, **lay
    )
    assert wx.shape == (W, H_NORMAL) and widx.shape == (W, K) and ww.shape == (W, K)
    assert torch.equal(wx[:M], ref["x"]) and torch.equal(widx[:M], ref["idx"])
    assert torch.equal(ww[:M], ref["w"]) and wcounts == []
    assert bool((widx[M:] == -1).all())
    assert bool(torch.isnan(wx[M:].float()).any()) and bool(torch.isnan(ww[M:]).any())
    cw, *_ = buf.dispatch(y, handle=whandle)
    assert cw.shape == (W, H_NORMAL) and bool(torch.isnan(cw[M:].float()).any())
    wout, _, _ = buf.combine(wx, whandle)
    assert torch.equal(wout, ref_combine_of_x(inp, E, R))
    raises(RuntimeError, buf.combine, wx[:M].contiguous(), whandle)  # rows != W
    # more rows than W is an error naming the numbers (real DeepEP would corrupt memory)
    tight = {"topk_idx": inp["idx"], "topk_weights": inp["w"], "num_worst_tokens": 1, **lay}
    if M > 1:
        assert "num_worst_tokens=1" in raises(RuntimeError, buf.dispatch, inp["x"], **tight)
    else:
        buf.dispatch(inp["x"], **tight)
    checked += 1

    # a rank with no tokens sends nothing and still takes part
    none = [make(seed + 1, r, R, E, H_NORMAL, T=0 if r == 1 else None) for r in range(R)]
    ref0 = ref_receive(none, rank, E)
    lay0 = layout(buf, none[rank], E)
    kw0 = {"topk_idx": none[rank]["idx"], "topk_weights": none[rank]["w"], **lay0}
    ex, eidx, _, ecounts, ehandle, _ = buf.dispatch(none[rank]["x"], **kw0)
    assert torch.equal(ex, ref0["x"]) and torch.equal(eidx, ref0["idx"])
    assert ecounts == ref0["counts"]
    eout, _, _ = buf.combine(ex, ehandle)
    assert torch.equal(eout, ref_combine_of_x(none[rank], E, R))
    checked += 1

    # the quirks an adapter must survive
    kw = {"topk_idx": inp["idx"], "topk_weights": inp["w"], **lay}
    raises(RuntimeError, buf.dispatch, inp["x"].float(), **kw)  # fp32 rows
    raises(RuntimeError, buf.dispatch, inp["x"][:, :4].contiguous(), **kw)  # 8 bytes a row
    bad = {**kw, "topk_idx": inp["idx"].to(torch.int32)}
    raises(RuntimeError, buf.dispatch, inp["x"], **bad)  # topk_idx dtype
    raises(RuntimeError, buf.get_dispatch_layout, inp["idx"].to(torch.int32), E)
    bad = {**kw, "topk_weights": inp["w"].double()}
    raises(RuntimeError, buf.dispatch, inp["x"], **bad)
    raises(AssertionError, buf.dispatch, inp["x"], handle=handle, topk_idx=inp["idx"])
    raises(RuntimeError, buf.combine, rx.float(), handle)  # combine is bf16 only
    raises(RuntimeError, buf.dispatch, inp["x"], allocate_on_comm_stream=True, **kw)
    wide = torch.zeros(inp["x"].shape[0], 33, dtype=torch.int64)
    lay33 = layout(buf, {"idx": wide}, E)
    raises(RuntimeError, buf.dispatch, inp["x"], topk_idx=wide, topk_weights=wide.float(), **lay33)
    small = emu.Buffer(group, 128 * 64)  # too small for the call
    raises(RuntimeError, small.dispatch, inp["x"], **kw)
    raises(RuntimeError, emu.Buffer, group, 100)  # not a multiple of 128
    raises(AssertionError, emu.Buffer.set_num_sms, 3)
    raises(AssertionError, buf.destroy)  # explicitly_destroy not set
    gone = emu.Buffer(group, nvl_bytes(R, H_NORMAL), explicitly_destroy=True)
    gone.destroy()
    raises(RuntimeError, gone.dispatch, inp["x"], **kw)
    checked += 1
    dist.barrier()
    return checked


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("R", [2, 4])
def test_normal_kernels(R: int) -> None:
    assert run_group(normal_worker, R, 7, timeout=150) == [8] * R


def test_worker_references_are_not_trivial() -> None:
    inputs = [make(7, r, 2, 6, H_NORMAL) for r in range(2)]
    got = [ref_receive(inputs, r, 6)["x"].shape[0] for r in range(2)]
    assert all(0 < m < sum(i["x"].shape[0] for i in inputs) for m in got)


# --------------------------------------------------------------------- internode emulation
def internode_worker(rank: int, R: int, seed: int) -> int:
    import torch.distributed as dist

    from tests.deepep_emu.deep_ep import _config

    _config.NUM_MAX_NVL_PEERS = 2  # NOTE: this process only: 2 "nodes" of 2 ranks
    E = 2 * R
    inputs = [make(seed, r, R, E, H_NORMAL) for r in range(R)]
    inp, ref = inputs[rank], ref_receive(inputs, rank, E)
    cfgs = (emu.Buffer.get_dispatch_config(R), emu.Buffer.get_combine_config(R))
    nvl = max(c.get_nvl_buffer_size_hint(H_NORMAL * 2, R) for c in cfgs)
    rdma = max(c.get_rdma_buffer_size_hint(H_NORMAL * 2, R) for c in cfgs)
    assert rdma > 0
    no_rdma = emu.Buffer(dist.group.WORLD, nvl)
    kw = {"topk_idx": inp["idx"], "topk_weights": inp["w"], **layout(no_rdma, inp, E)}
    raises(RuntimeError, no_rdma.dispatch, inp["x"], **kw)  # internode kernels need RDMA bytes
    buf = emu.Buffer(dist.group.WORLD, nvl, rdma)
    lay = layout(buf, inp, E)
    per_node = [0, 0]
    for row in ref_layout(inp["idx"], E, R)[2]:
        for n in range(2):
            per_node[n] += any(row[2 * n : 2 * n + 2])
    assert lay["num_tokens_per_rdma_rank"].tolist() == per_node
    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        inp["x"], topk_idx=inp["idx"], topk_weights=inp["w"], **lay
    )
    assert torch.equal(rx, ref["x"]) and torch.equal(ridx, ref["idx"]) and counts == ref["counts"]
    assert torch.equal(rw, ref["w"])
    out, _, _ = buf.combine(rx, handle)
    assert torch.equal(out, ref_combine_of_x(inp, E, R))
    msg = raises(
        AssertionError,
        buf.dispatch,
        inp["x"],
        topk_idx=inp["idx"],
        topk_weights=inp["w"],
        num_worst_tokens=64,
        **lay,
    )
    assert "num_worst_tokens" in msg
    dist.barrier()
    return 4


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_internode_rules() -> None:
    assert run_group(internode_worker, 4, 11, timeout=150) == [4] * 4


# --------------------------------------------------------------------- low-latency kernels
def ll_worker(rank: int, R: int, seed: int) -> int:
    import torch.distributed as dist

    group = dist.group.WORLD
    E, num_max = 2 * R, 6
    e, cap = E // R, R * num_max
    inputs = [make(seed, r, R, E, H_LL, k=2, T=3 + r) for r in range(R)]
    inp = inputs[rank]
    hint = emu.Buffer.get_low_latency_rdma_size_hint(num_max, H_LL, R, E)
    assert hint % 128 == 0
    buf = emu.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=e)
    checked = 0

    # expected expert-major layout: per local expert, by source rank then token
    want: list[list[tuple[int, int]]] = [[] for _ in range(e)]
    for s, other in enumerate(inputs):
        for t, row in enumerate(other["idx"].tolist()):
            for g in row:
                if g >= 0 and g // e == rank:
                    want[g % e].append((s, t))
    rx, count, handle, event, hook = buf.low_latency_dispatch(
        inp["x"], inp["idx"], num_max, E, use_fp8=False, async_finish=True
    )
    event.current_stream_wait()
    rx, count, handle, event, hook = buf.low_latency_dispatch(
        inp["x"], inp["idx"], num_max, E, use_fp8=False
    )
    assert rx.shape == (e, cap, H_LL) and rx.dtype == torch.bfloat16 and hook is None
    assert count.dtype == torch.int32 and count.tolist() == [len(w) for w in want]
    for j in range(e):
        for p, (s, t) in enumerate(want[j]):
            assert torch.equal(rx[j, p], inputs[s]["x"][t])
        assert bool(torch.isnan(rx[j, len(want[j]) :].float()).any()) or len(want[j]) == cap
    checked += 1

    # weighted combine: sum_j w[t, j] * expert(g)(x[t]), expert g scales by (g + 1)
    scale = (torch.arange(e) + rank * e + 1).float()
    y = (rx.float() * scale[:, None, None]).to(torch.bfloat16)
    out, _, _ = buf.low_latency_combine(y, inp["idx"], inp["w"], handle)
    ref = torch.zeros(inp["x"].shape, dtype=torch.float32)
    for t, row in enumerate(inp["idx"].tolist()):
        for j, g in enumerate(row):
            if g >= 0:
                rowg = (inp["x"][t].float() * (g + 1)).to(torch.bfloat16).float()
                ref[t] += float(inp["w"][t, j]) * rowg
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    checked += 1

    # fp8: per-128-channel scales, column-major; values round-trip within fp8 precision
    (q, sc), count8, _, _, _ = buf.low_latency_dispatch(inp["x"], inp["idx"], num_max, E)
    assert q.dtype == torch.float8_e4m3fn and sc.shape == (e, cap, H_LL // 128)
    assert sc.stride(1) == 1
    for j in range(e):
        n = int(count8[j])
        deq = q[j, :n].float().reshape(n, -1, 128) * sc[j, :n, :, None]
        torch.testing.assert_close(deq.reshape(n, H_LL), rx[j, :n].float(), rtol=0.07, atol=1e-3)
    checked += 1

    # recv hook: data lands only when the hook runs; two later launches reuse the buffer
    hx, hc, _, _, h = buf.low_latency_dispatch(
        inp["x"], inp["idx"], num_max, E, use_fp8=False, return_recv_hook=True
    )
    assert int(hc.sum()) > 0
    for j in range(e):  # nothing has landed yet: the rows are still garbage
        assert int(hc[j]) == 0 or bool(torch.isnan(hx[j, : int(hc[j])].float()).any(-1).all())
    h()
    for j in range(e):
        assert torch.equal(hx[j, : int(hc[j])], rx[j, : int(hc[j])])
    sx, sc2, _, _, stale = buf.low_latency_dispatch(
        inp["x"], inp["idx"], num_max, E, use_fp8=False, return_recv_hook=True
    )
    buf.low_latency_dispatch(inp["x"], inp["idx"], num_max, E, use_fp8=False)
    buf.low_latency_dispatch(inp["x"], inp["idx"], num_max, E, use_fp8=False)
    stale()
    for j in range(e):
        assert bool(torch.isnan(sx[j, : int(sc2[j])].float()).all())
    checked += 1

    # checks: hidden size list, top-k limit, token budget, bf16 only, dirty buffer
    raises(
        RuntimeError,
        buf.low_latency_dispatch,
        inp["x"][:, :1024].contiguous(),
        inp["idx"],
        num_max,
        E,
    )
    wide = torch.zeros(inp["x"].shape[0], 12, dtype=torch.int64)
    raises(RuntimeError, buf.low_latency_dispatch, inp["x"], wide, num_max, E)
    raises(RuntimeError, buf.low_latency_dispatch, inp["x"], inp["idx"], 1, E)
    raises(RuntimeError, buf.low_latency_dispatch, inp["x"].float(), inp["idx"], num_max, E)
    small = emu.Buffer(group, 0, 128 * 1024, low_latency_mode=True)
    raises(RuntimeError, small.low_latency_dispatch, inp["x"], inp["idx"], num_max, E)
    normal = emu.Buffer(group, nvl_bytes(R, H_LL), hint, low_latency_mode=True)
    lay = layout(normal, inp, E)
    normal.dispatch(inp["x"], topk_idx=inp["idx"], topk_weights=inp["w"], **lay)
    msg = raises(RuntimeError, normal.low_latency_dispatch, inp["x"], inp["idx"], num_max, E)
    assert "clean_low_latency_buffer" in msg
    normal.clean_low_latency_buffer(num_max, H_LL, E)
    normal.low_latency_dispatch(inp["x"], inp["idx"], num_max, E)
    raises(
        RuntimeError,
        emu.Buffer(group, nvl_bytes(R, H_LL)).low_latency_dispatch,
        inp["x"],
        inp["idx"],
        num_max,
        E,
    )  # not in low-latency mode
    checked += 1
    dist.barrier()
    return checked


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_low_latency_kernels() -> None:
    assert run_group(ll_worker, 2, 5, timeout=150) == [5, 5]


# --------------------------------------------------------------------- static surface
def test_static_surface() -> None:
    assert emu.topk_idx_t == torch.int64
    for R in (2, 4, 8, 16, 32, 64, 128, 144, 160):
        for cfg in (emu.Buffer.get_dispatch_config(R), emu.Buffer.get_combine_config(R)):
            assert cfg.get_nvl_buffer_size_hint(7168 * 2, R) % 128 == 0
            assert cfg.get_rdma_buffer_size_hint(7168 * 2, R) % 128 == 0
            assert (cfg.get_rdma_buffer_size_hint(7168 * 2, R) > 0) == (R > 8)
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks"):
        emu.Buffer.get_dispatch_config(6)
    with pytest.raises(RuntimeError):
        emu.Config(20, 8, 8)  # send tokens must be below recv tokens
    small = emu.Buffer.get_low_latency_rdma_size_hint(8, 2048, 2, 4)
    big = emu.Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 256)
    assert 0 < small < big and small % 128 == 0 and big % 128 == 0
    with pytest.raises(AssertionError):
        emu.EventOverlap().current_stream_wait()
