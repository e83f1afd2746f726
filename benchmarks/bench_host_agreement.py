"""Per-dispatch agreement cost of a dropless DeepEP V2 / V2.5 dispatch (issue 44, Q4 / Q5), on R
gloo ranks over loopback: 1aba7f0's host agreement against this one, side by side in one run.

R ranks. Run from a flexdispatch checkout with its venv:

    nice -n 10 .venv/bin/python benchmarks/bench_host_agreement.py --ranks 2 4 8 --calls 300

Modes, each call timed back to back (consecutive MoE layers' dispatches), the step cost taken as
each call's maximum over the ranks (the step waits for the slowest), median and p90:

- ``none``: the loop alone.
- ``before_side``: 1aba7f0's path on an NCCL group (``distributed.host_gather_int64``): five ints
  all-gathered on a gloo side group of the ranks, built at the first call — inside the first
  training step, on the interface the hostname resolves to, with the group's timeout (its build
  is timed apart, ``first``) — and read before DeepEP's kernel could be launched. Rebuilt here
  as it was (a ``ProcessGroupGloo`` on a prefix of the default store; 1aba7f0 gathered with it in
  ``counts.agree_tokens``).
- ``before_group``: 1aba7f0's path on a CPU group (the emulator's): the same all-gather on the
  group itself, read at once.
- ``after``: this change (``backends.deepep.agreement.Agreement``): the same five ints
  all-gathered on the group itself, started before the dispatch and read after DeepEP's CPU wait.
  Here nothing runs between start and read, so the whole collective is timed; on an NCCL group
  it is a device collective whose result is there by the time DeepEP's CPU wait returns (no
  host wait of its own, no side group), which loopback cannot show.

Loopback gloo is not a cluster: ``before_side`` across hosts is R - 1 sequential TCP hops (a gloo
ring) per MoE layer, ``after`` one NCCL collective on the GPUs. The deterministic facts — gloo
groups built inside a step (1 -> 0), adapter reads before DeepEP's kernel per dropless dispatch of
an agreed row shape (1 -> 0) — are checked in ``tests/dist/test_deepep_issue44.py``. On a shared
machine record the load (printed before and after).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("none", "before_group", "before_side", "after")
_SHAPE = (7168, 8, torch.bfloat16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_calls(fn: Any, calls: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _side_group(rank: int, R: int) -> Any:
    """1aba7f0's ``distributed._side_group``: a gloo backend of the ranks on the default store."""
    store = dist.PrefixStore(
        "flexdispatch/host_ints/bench/0", dist.distributed_c10d._get_default_store()
    )
    return dist.ProcessGroupGloo(store, rank, R, datetime.timedelta(seconds=300))


def _rank(rank: int, R: int, port: int, modes: list[str], calls: int, warmup: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=R)
    from flexdispatch.backends.deepep.agreement import Agreement, pinned_buffers

    T = 64 + rank  # different T per rank, as in a real dropless step
    vals = Agreement.values(T, _SHAPE, False)
    pinned = pinned_buffers(torch.device("cpu"))
    results: dict[str, Any] = {}
    for mode in modes:
        dist.barrier()
        first_ms = None
        if mode == "none":
            fn = lambda: None  # noqa: E731
        elif mode == "before_group":

            def fn() -> None:
                out = torch.empty(R * len(vals), dtype=torch.int64)
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather(out, torch.tensor(vals, dtype=torch.int64))
                out.tolist()

        elif mode == "before_side":
            t0 = time.perf_counter_ns()
            side = _side_group(rank, R)
            first_ms = (time.perf_counter_ns() - t0) / 1e6

            def fn(side: Any = side) -> None:
                flat = torch.tensor(vals, dtype=torch.int64)
                out = torch.empty(R, flat.numel(), dtype=torch.int64)
                side.allgather([list(out.unbind(0))], [flat]).wait()
                out.tolist()

        else:

            def fn() -> None:
                Agreement(None, torch.device("cpu"), pinned).start(vals, "bench").rows()

        times = _time_calls(fn, calls, warmup)
        results[mode] = {"times": times, "first_ms": first_ms}
    dist.barrier()
    q.put((rank, results))
    dist.destroy_process_group()


def run(R: int, modes: list[str], calls: int, warmup: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, R, port, modes, calls, warmup, q)) for r in range(R)
    ]
    for p in procs:
        p.start()
    got = {}
    deadline = time.time() + 600
    while len(got) < R and time.time() < deadline:
        rank, res = q.get(timeout=max(1.0, deadline - time.time()))
        got[rank] = res
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    summary: dict[str, Any] = {"R": R, "calls": calls}
    for mode in modes:
        per_rank = [got[r][mode]["times"] for r in range(R)]
        worst = sorted(max(ts[i] for ts in per_rank) for i in range(calls))
        firsts = [got[r][mode]["first_ms"] for r in range(R)]
        summary[mode] = {
            "median_ms": round(statistics.median(worst), 4),
            "p90_ms": round(worst[int(0.9 * (calls - 1))], 4),
            "first_ms": None if firsts[0] is None else round(max(firsts), 2),
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--json", action="store_true", help="one JSON object per R")
    args = ap.parse_args()
    print(f"# load before: {os.getloadavg()}  cpus: {os.cpu_count()}  torch {torch.__version__}")
    for R in args.ranks:
        s = run(R, args.modes, args.calls, args.warmup)
        if args.json:
            print(json.dumps(s))
            continue
        for mode in args.modes:
            m = s[mode]
            first = f"  build {m['first_ms']:.1f} ms" if m["first_ms"] is not None else ""
            print(
                f"R={R:<2d} {mode:<13s} median {m['median_ms']:8.3f} ms  "
                f"p90 {m['p90_ms']:8.3f} ms{first}"
            )
        sys.stdout.flush()
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
