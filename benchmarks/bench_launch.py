"""Launch cost of the torch backend: dispatch + combine of a tiny batch against the two bare
``all_to_all_single`` calls of its rows (issue 26 item 5), on CPU / gloo.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
W worst-case rows.

R = 2 gloo ranks, T = 8, H = 64 bf16, E = 8, top-2 (uniform random, every rank its own),
``torch.set_num_threads(1)``, checks off (``DispatchConfig(checks=False)``, no
``FLEXDISPATCH_CHECKS``). At this size nothing is bandwidth: every millisecond is per-call
overhead (Python, op launches, collectives). Timed side by side in one process, interleaved:

- ``bare``: ``all_to_all_single`` of the dispatch's rows there and back (the real split sizes,
  computed once, buffers pre-built): two collectives and nothing else;
- ``dropless``: ``FlexDispatcher.dispatch`` + ``combine`` (the expert output is ``recv_x``);
- ``worst-case``: the same with ``num_worst_tokens = W = R * T``;
- ``bare+Nus`` (``--host-us``, calibration): the two bare calls after N µs of Python spinning
  on the host, i.e. what *any* dispatch with N µs of host work per call costs on this machine:
  a collective issued after host work waits much longer than one issued back to back (threads
  and virtual CPUs that went idle wake up first), so the ratio grows faster than N;
- ``bare+gather``: the two bare calls after an all-gather of a 12-int64 vector per rank (the
  size of the count exchange at R = 2): the floor of a three-collective step (dropless);
- ``floor`` (calibration): the worst-case step written out by hand for this one shape
  (``_Floor``): the same plan as the in-band path (the CPU value checks, the slot map, one
  packed collective each way, the compaction, the sums), as few torch ops as that plan takes,
  no autograd, no result objects, every buffer and view built once, collectives synchronous.
  Its results are checked equal to the dispatcher's at warm-up. Not a code path of
  flexdispatch: what any implementation of the plan in separate torch ops costs here.

Beside each time the main thread's CPU time per call (``time.thread_time``: Python and ATen op
work plus issuing the collectives, without the gloo threads) is reported.

Each block runs ``--inner`` calls of one mode between two barriers; the blocks of the three
modes alternate ``--reps`` times; the figure is the median block time per call. A run spawns
fresh ranks; ``--runs`` runs (default 3) give the range of each ratio (the machine is shared).
Targets (issue 26): worst-case <= 2x bare, dropless <= 2.5x bare.

``--ranks 1`` runs the same in a gloo group of one rank (a world of one: the bare calls are
copies there, and the dispatcher runs no collective).

Run: ``.venv/bin/python benchmarks/bench_launch.py [--runs 3] [--reps 15] [--inner 40]
[--host-us 100,250,500] [--ranks 2]``
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T, H, E, K = 8, 64, 8, 2
MODES = ("bare", "dropless", "worst-case")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spin(us: int) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class _Floor:
    """The ``floor`` calibration (module docstring): worst-case dispatch + combine, W = R * T."""

    def __init__(self, R: int, me: int, dtype: torch.dtype) -> None:
        W, e = R * T, E // R
        self.R, self.W, self.e = R, W, e
        self.rank_lut = torch.full((E + 1,), R + 1, dtype=torch.int64)  # id -1 reads the last
        self.rank_lut[:E] = torch.arange(E) // e
        self.local_lut = torch.zeros(E + 1, dtype=torch.int64)
        self.local_lut[me * e : (me + 1) * e] = torch.arange(1, e + 1)
        self.base = (torch.arange(R) * T - 1)[None]  # slot of the c-th row to r: r * T + c - 1
        self.spare = torch.arange(W, W + R * T).view(T, R)
        self.rows = torch.arange(T).repeat_interleave(R)
        self.peers = torch.arange(R)
        rb = H * dtype.itemsize
        self.xp = torch.empty(T + 1, rb + 4 * (2 * K + 1), dtype=torch.uint8)
        meta = self.xp[:, rb:].view(torch.int32)
        meta[T, :K] = E  # padding rows read row T: every id dropped
        self.x_in, self.ids_in, self.p_in, self.need_in = (
            self.xp[:T, :rb],
            meta[:T, :K],
            meta[:T, K : 2 * K],
            meta[:, 2 * K],
        )
        self.send = torch.empty(W, self.xp.shape[1], dtype=torch.uint8)
        self.recv = torch.zeros(W + 1, self.xp.shape[1], dtype=torch.uint8)
        rmeta = self.recv[:, rb:].view(torch.int32)
        rmeta[W, :K] = E  # the compaction's dummy row
        self.rx, self.r_ids = self.recv[:, :rb].view(dtype), rmeta[:, :K]
        self.r_p, self.r_need = rmeta[:, K : 2 * K].view(torch.float32), rmeta[:W:T, 2 * K]
        self.zero = torch.zeros(())
        self.splits = [T] * R

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor) -> tuple:
        R, W = self.R, self.W
        lo, hi = (b.tolist() for b in torch.aminmax(idx))
        bounds = [b.tolist() for t in (x, probs) for b in torch.aminmax(t)]
        srt = idx.sort(1).values
        rep = bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any())
        assert lo >= -1 and hi < E and all(map(math.isfinite, bounds)) and not rep
        mask = torch.zeros(T, R + 2, dtype=torch.bool).scatter_(1, self.rank_lut[idx], True)
        count = mask[:, :R].cumsum(0)
        slot = torch.where(mask[:, :R], count + self.base, self.spare)  # W = R * T: no cap
        send_index = torch.full((W + R * T,), T).scatter_(0, slot.view(-1), self.rows)[:W]
        self.x_in.copy_(x.view(torch.uint8))
        self.ids_in.copy_(idx)
        self.p_in.copy_(probs.view(torch.int32))
        self.need_in.copy_(torch.add(self.peers, count[-1], alpha=R).max())
        torch.index_select(self.xp, 0, send_index, out=self.send)
        dist.all_to_all_single(self.recv[:W], self.send, self.splits, self.splits)
        assert max(v // R for v in self.r_need.tolist()) <= T
        local = self.local_lut[self.r_ids]
        real = local[:W].any(1)
        out_index = torch.nonzero_static(real, size=W, fill_value=W)[:, 0]
        in_index = real.cumsum(0).sub_(1).clamp_(min=0)
        loc = local.index_select(0, out_index)
        probs_out = torch.where(loc > 0, self.r_p.index_select(0, out_index), self.zero)
        counts = torch.bincount(loc.view(-1), minlength=self.e + 1)[1:]
        recv_x = self.rx.index_select(0, out_index)
        return recv_x, loc - 1, probs_out, counts, (send_index, in_index)

    def combine(self, y: torch.Tensor, handle: tuple) -> torch.Tensor:
        send_index, in_index = handle
        rows = y.index_select(0, in_index)
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, rows, self.splits, self.splits)
        out = torch.zeros(T + 1, H, dtype=y.dtype)
        for r in range(self.R):
            out.index_add_(0, send_index[r * T : (r + 1) * T], back[r * T : (r + 1) * T])
        return out[:T]


def _body(rank: int, R: int, reps: int, inner: int, host_us: tuple[int, ...]) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.distributed import all_gather_int64

    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, generator=g)
    probs = probs / probs.sum(1, keepdim=True)
    x = torch.randn(T, H, generator=g).bfloat16()
    flex = {
        "dropless": FlexDispatcher(DispatchConfig(backend="torch", checks=False), num_experts=E),
        "worst-case": FlexDispatcher(
            DispatchConfig(backend="torch", checks=False, num_worst_tokens=R * T), num_experts=E
        ),
    }
    e = E // R
    mask = torch.zeros(T, R, dtype=torch.bool).scatter_(1, idx // e, True)
    C = all_gather_int64(mask.sum(0).to(torch.int64)).tolist()
    s_out, s_in = [C[rank][r] for r in range(R)], [C[s][rank] for s in range(R)]
    rows = torch.randn(sum(s_out), H).bfloat16()
    recv = torch.empty(sum(s_in), H, dtype=torch.bfloat16)
    back = torch.empty(sum(s_out), H, dtype=torch.bfloat16)

    floor = _Floor(R, rank, x.dtype)
    want = flex["worst-case"].dispatch(x, idx, probs)
    got = floor.dispatch(x, idx, probs)
    names = ("recv_x", "recv_topk_idx", "recv_topk_probs", "num_recv_tokens_per_expert")
    for name, t in zip(names, got[:4], strict=True):
        assert torch.equal(getattr(want, name), t), f"floor: {name} differs"
    y = want.recv_x * 2
    assert torch.equal(flex["worst-case"].combine(y, want.handle), floor.combine(y, got[4]))

    modes = (*MODES, "floor", "bare+gather", *(f"bare+{u}us" for u in host_us))
    vec = torch.zeros(12, dtype=torch.int64)
    gathered = torch.empty(R * 12, dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def run(mode: str) -> None:
        if mode == "bare+gather":
            gather(gathered, vec)
            mode = "bare"
        elif mode.startswith("bare+"):
            _spin(int(mode[5:-2]))
            mode = "bare"
        if mode == "bare":
            dist.all_to_all_single(recv, rows, s_in, s_out)
            dist.all_to_all_single(back, recv, s_out, s_in)
            return
        if mode == "floor":
            out = floor.dispatch(x, idx, probs)
            floor.combine(out[0], out[4])
            return
        d = flex[mode]
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)

    for mode in modes:  # warm-up: caches, first-call paths
        for _ in range(5):
            run(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        for mode in modes:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                run(mode)
            c1 = time.thread_time()
            dist.barrier()
            times[mode].append((time.perf_counter() - t0) / inner)
            cpu[mode].append((c1 - c0) / inner)
    for d in flex.values():
        d.close()
    out = {m: statistics.median(v) for m, v in times.items()}
    out.update({f"cpu:{m}": statistics.median(v) for m, v in cpu.items()})
    return out


def _worker(
    rank: int, R: int, port: int, reps: int, inner: int, host_us: tuple[int, ...], q: Any
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=R,
            timeout=datetime.timedelta(seconds=300),
        )
        q.put((rank, _body(rank, R, reps, inner, host_us)))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, traceback.format_exc()))


def run_once(reps: int, inner: int, R: int = 2, host_us: tuple[int, ...] = ()) -> dict[str, float]:
    """One run on fresh ranks: ``{mode: seconds per call, "cpu:" + mode: main-thread CPU
    seconds per call}`` of rank 0."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("FLEXDISPATCH_CHECKS", None)
    procs = [
        ctx.Process(target=_worker, args=(r, R, port, reps, inner, host_us, q)) for r in range(R)
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=900) for _ in range(R))
    for p in procs:
        p.join(timeout=30)
    for r, v in got.items():
        if isinstance(v, str):
            raise RuntimeError(f"rank {r} failed:\n{v}")
    return got[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks R (1: a group of one rank)")
    ap.add_argument(
        "--host-us",
        default="100,250,500",
        help="calibration: µs of host spinning before the two bare calls (comma list; '' = none)",
    )
    args = ap.parse_args()
    host_us = tuple(int(u) for u in args.host_us.split(",") if u.strip())
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"torch {torch.__version__}, gloo, R={args.ranks}, T={T}, H={H} bf16, E={E}, top-{K}, "
        f"1 thread, checks off; {args.reps} interleaved blocks of {args.inner} calls per run "
        "(median)\n"
    )
    shown = (
        "dropless",
        "worst-case",
        "floor",
        "bare+gather",
        *(f"bare+{u}us" for u in host_us),
    )
    print("ms per call (main-thread CPU ms per call); each ratio is over `bare` of the same run\n")
    print(
        "| run | bare | "
        + " | ".join(shown)
        + " | "
        + " | ".join(f"{m} / bare" for m in shown)
        + " |"
    )
    print("|---|---:|" + "---:|" * (2 * len(shown)))
    ratios: dict[str, list[float]] = {m: [] for m in shown}
    for i in range(args.runs):
        med = run_once(args.reps, args.inner, R=args.ranks, host_us=host_us)
        b = med["bare"]
        for m in shown:
            ratios[m].append(med[m] / b)
        cells = [f"{med[m] * 1e3:.3f} ({med['cpu:' + m] * 1e3:.3f})" for m in ("bare", *shown)]
        print(
            f"| {i + 1} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{med[m] / b:.2f}x" for m in shown)
            + " |",
            flush=True,
        )
    print()
    for m, v in ratios.items():
        print(f"{m} / bare: {min(v):.2f}x – {max(v):.2f}x over {args.runs} runs")


if __name__ == "__main__":
    main()
