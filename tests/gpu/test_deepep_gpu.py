"""The deepep backend against real DeepEP, and against the torch backend on the same inputs.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
M received rows · W worst-case rows · C = R * num_max rows per local expert.

Skipped unless ``deep_ep`` imports and at least two GPUs are visible. One NCCL group of R = 2, 4
or 8 GPUs (one node) runs, per case of the shared contract inputs (``tests/dist/reference.py``,
bf16 rows, moved to the GPU):

- the contract points against the slow references: rows, order, local ids, probs, device counts,
  the worst-case tail (zero / -1 / 0), host syncs (1 dropless, 0 worst-case), and the same seen
  by the spin detector (``tests/gpu/sync_detector.py``) on dispatch + combine of both backends:
  it fires on the dropless step and stays silent on the worst-case one;
- ``recv_x`` of deepep equal bit for bit to the torch backend's, and the combines close (DeepEP
  sums in fp32 and rounds once; the torch backend adds bf16 rows);
- autograd through deepep equal (to bf16 precision) to the torch backend's gradients;
- low-latency decode (needs DeepEP built with NVSHMEM; skipped with the reason otherwise) against
  the torch backend's worst-case decode layout;
- the kernel limits the adapter works around (``deepep_rules``): fp32 rows at H = 4096 / 7168 and
  bf16 rows at H = 8192 (wider than the SM90 TMA row cap, so split into several DeepEP calls),
  the probs-gradient combine, ``Buffer.get_dispatch_layout`` equal to flexdispatch's layout, and
  one shared buffer for every dispatcher on the group.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.gpu.common import gpu_world, rel_err, to_device


def _deep_ep_reason() -> str:
    try:
        importlib.import_module("deep_ep")
    except (ImportError, OSError, AssertionError, RuntimeError) as exc:
        return f"deep_ep does not import: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs at least 2 GPUs"
    return ""


_REASON = _deep_ep_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_REASON), reason=_REASON or "ok")]

K, H, E_PER_RANK = 4, 256, 4


def contract_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.dist.reference import CASES, all_inputs, ref_dispatch
    from tests.gpu.sync_detector import cuda_detector

    rank, R = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    E = E_PER_RANK * R
    report: dict[str, Any] = {"checked": 0, "combine_err": 0.0, "grad_err": 0.0, "synced": {}}
    det = cuda_detector()
    for case in CASES:
        inputs = all_inputs(7, case=case, R=R, E=E, k=K, H=H, dtype=torch.bfloat16, exact=False)
        mine = to_device(inputs[rank], dev)
        ref = ref_dispatch(inputs, rank, E)
        M = ref.x.shape[0]
        W = max(ref_dispatch(inputs, g, E).x.shape[0] for g in range(R))  # most rows received
        for worst in (False, True):
            where = f"rank {rank} {case} worst={worst}"
            w = W + 8 if worst else 0
            ds = {
                b: FlexDispatcher(
                    DispatchConfig(
                        backend=b,
                        num_worst_tokens=w * (R if b == "torch" else 1),
                        deepep_api="v1",  # V1 here; V2: test_deepep_v2_gpu.py
                    ),
                    num_experts=E,
                )
                for b in ("deepep", "torch")
            }
            assert ds["deepep"].backend_name == "deepep", ds["deepep"].backend_reason
            res = {b: d.dispatch(mine.x, mine.idx, mine.probs) for b, d in ds.items()}
            r = res["deepep"]
            rows = w if worst else M
            assert r.recv_x.shape == (rows, H) and r.recv_x.dtype == torch.bfloat16, where
            assert torch.equal(r.recv_x[:M].cpu(), ref.x), where
            assert torch.equal(r.recv_topk_idx[:M].cpu(), ref.idx), where
            assert torch.equal(r.recv_topk_probs[:M].cpu(), ref.probs), where
            assert r.num_recv_tokens_per_expert.device == dev
            assert torch.equal(r.num_recv_tokens_per_expert.cpu(), ref.counts), where
            if worst:
                assert bool((r.recv_x[M:] == 0).all()), f"{where}: garbage tail left"
                assert bool((r.recv_topk_idx[M:] == -1).all()) and bool(
                    (r.recv_topk_probs[M:] == 0).all()
                ), where
            t = res["torch"]
            assert torch.equal(r.recv_x[:M], t.recv_x[:M]), f"{where}: deepep != torch rows"
            outs = {b: ds[b].combine(res[b].recv_x, res[b].handle) for b in ds}
            err = rel_err(outs["deepep"], outs["torch"])
            report["combine_err"] = max(report["combine_err"], err)
            assert ds["deepep"].stats.host_syncs == (0 if worst else 1), where
            for b, d in ds.items():  # NOTE: every rank runs the same steps (collectives)

                def step(d: Any = d, m: Any = mine) -> Any:
                    rr = d.dispatch(m.x, m.idx, m.probs)
                    return d.combine(rr.recv_x, rr.handle)

                key = f"{b} {'worst' if worst else 'dropless'}"
                report["synced"][key] = report["synced"].get(key, False) or det.check(step).synced
            # autograd: grads of x and probs agree with the torch backend's
            grads = {}
            for b, d in ds.items():
                x = mine.x.clone().requires_grad_()
                p = mine.probs.clone().requires_grad_()
                rr = d.dispatch(x, mine.idx, p)
                y = rr.recv_x * (1 + rr.recv_topk_probs.sum(1, keepdim=True)).to(torch.bfloat16)
                d.combine(y, rr.handle).float().sum().backward()
                grads[b] = (x.grad.float(), p.grad.float())
            for a, b in zip(grads["deepep"], grads["torch"], strict=True):
                report["grad_err"] = max(report["grad_err"], rel_err(a, b))
            for d in ds.values():
                d.close()
            report["checked"] += 1
    return report


def low_latency_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.dispatch.decode import DecodeDispatcher

    rank, R = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    E, Hl, num_max, k = 4 * R, 2048, 16, 4
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(num_max, Hl, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(num_max, E, generator=g).argsort(1)[:, :k].to(dev)
    probs = torch.rand(num_max, k, generator=g).to(dev)
    try:
        ll = FlexDispatcher(
            DispatchConfig(
                backend="deepep", mode="low_latency", num_max_dispatch_tokens_per_rank=num_max
            ),
            num_experts=E,
        )
        dec_ll = DecodeDispatcher(ll, num_max_dispatch_tokens_per_rank=num_max)
        r_ll = dec_ll.dispatch(x, idx, probs)
    except (RuntimeError, AssertionError) as exc:
        return {"skip": f"low-latency kernels unavailable: {type(exc).__name__}: {exc}"}
    tw = FlexDispatcher(
        DispatchConfig(backend="torch", num_worst_tokens=R * R * num_max), num_experts=E
    )
    dec_t = DecodeDispatcher(tw, num_max_dispatch_tokens_per_rank=num_max)
    r_t = dec_t.dispatch(x, idx, probs)
    same_counts = bool(torch.equal(r_ll.num_recv_tokens_per_expert, r_t.num_recv_tokens_per_expert))
    out_ll = dec_ll.combine(r_ll.recv_x, r_ll.handle)
    out_t = dec_t.combine(r_t.recv_x, r_t.handle)
    ref = x.float() * probs.sum(1, keepdim=True)
    return {
        "skip": "",
        "same_counts": same_counts,
        "err_ll": rel_err(out_ll, ref),
        "err_torch": rel_err(out_t, ref),
    }


def limits_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from flexdispatch import DispatchConfig, FlexDispatcher, get_dispatch_layout
    from flexdispatch.backends.deepep import buffer as deepep_buffer

    rank, R = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    E, k = 4 * R, 4
    g = torch.Generator().manual_seed(100 + rank)
    T = 64
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].to(dev)
    probs = torch.rand(T, k, generator=g).to(dev)
    report: dict[str, Any] = {"rows_equal": [], "combine_err": 0.0}
    ds = {
        b: FlexDispatcher(DispatchConfig(backend=b, deepep_api="v1"), num_experts=E)
        for b in ("deepep", "torch")
    }
    deep = ds["deepep"]
    # DeepEP's layout kernel and flexdispatch's pure-torch layout agree
    buf = deep.backend._ensure_buffer(deep.backend._required_size(512))
    got = buf.get_dispatch_layout(idx, E)[:4]
    want = get_dispatch_layout(idx, E, R)
    report["layout_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(
            (got[0], got[2], got[3]),
            (want.num_tokens_per_rank, want.num_tokens_per_expert, want.is_token_in_rank),
            strict=True,
        )
    )
    for H, dtype in ((4096, torch.float32), (7168, torch.float32), (8192, torch.bfloat16)):
        x = torch.randn(T, H, generator=g).to(dtype).to(dev)
        res = {b: d.dispatch(x, idx, probs) for b, d in ds.items()}
        report["rows_equal"].append(bool(torch.equal(res["deepep"].recv_x, res["torch"].recv_x)))
        outs = {b: ds[b].combine(res[b].recv_x, res[b].handle) for b in ds}
        report["combine_err"] = max(report["combine_err"], rel_err(outs["deepep"], outs["torch"]))
        # the probs gradient path: an fp32 combine of k columns, summed exactly
        narrow = deep.backend.combine(res["deepep"].recv_topk_probs, res["deepep"].handle)
        report.setdefault("narrow_err", 0.0)
        report["narrow_err"] = max(
            report["narrow_err"],
            rel_err(
                narrow,
                ds["torch"].backend.combine(res["torch"].recv_topk_probs, res["torch"].handle),
            ),
        )
    other = FlexDispatcher(DispatchConfig(backend="deepep", deepep_api="v1"), num_experts=E)
    other.dispatch(torch.randn(T, 256, device=dev, dtype=torch.bfloat16), idx, probs)
    report["live_buffers"] = deepep_buffer.live_buffers()
    for d in (*ds.values(), other):
        d.close()
    report["live_after_close"] = deepep_buffer.live_buffers()
    return report


def _run(fn: Any) -> list[Any]:
    from flexdispatch.launch import spawn_group

    return spawn_group(fn, gpu_world(), backend="nccl", timeout_s=280)


@pytest.mark.timeout(300)
def test_deepep_contract_and_bit_equal_to_torch() -> None:
    from tests.dist.reference import CASES

    for report in _run(contract_worker):
        assert report["checked"] == 2 * len(CASES)
        synced = report["synced"]
        assert not synced["deepep worst"] and not synced["torch worst"], synced
        assert synced["deepep dropless"] and synced["torch dropless"], synced  # the check is live
        # relative to the largest value: bf16 rounding of sums of a few terms
        assert report["combine_err"] < 2e-2, report
        assert report["grad_err"] < 2e-2, report


@pytest.mark.timeout(300)
def test_deepep_low_latency_decode_matches_torch() -> None:
    reports = _run(low_latency_worker)
    if reports[0]["skip"]:
        pytest.skip(reports[0]["skip"])
    for r in reports:
        assert r["same_counts"] and r["err_ll"] < 2e-2 and r["err_torch"] < 2e-2, r


@pytest.mark.timeout(300)
def test_deepep_kernel_limits_on_gpu() -> None:
    for r in _run(limits_worker):
        assert r["layout_equal"], r
        assert all(r["rows_equal"]), r
        assert r["combine_err"] < 2e-2 and r["narrow_err"] < 1e-6, r
        assert r["live_buffers"] == 1 and r["live_after_close"] == 0, r
