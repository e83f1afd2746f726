"""Benchmark FlexDispatcher's torch backend against bare ``all_to_all_single`` calls (gloo, CPU).

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
L ranks per node · N = R / L nodes · S rows sent · M rows received · W worst-case rows.

Part 1 (R = 2 gloo ranks, one node): T=4096, k=8, E=64, H=2048 bf16, uniform random top-8 routing.
Each repetition runs ``dispatch`` + ``combine`` (the expert output is ``recv_x`` itself) and, in
the same loop (interleaved), the bare collectives that move the same data: the pre-computed split
sizes, pre-built buffers, rows (bf16 ``[S, H]``) and the same int32 ``[S, 2k]`` metadata forward,
rows back. Dropless and worst-case (W = R * T, DeepEP's choice: W/R rows per peer) are timed side
by side; the table gives medians and the ratio (target: <= 1.25x the bare collectives). A third
timing, "local copies alone", runs only the memory copies that any implementation adds on this
rank (the gather of the send buffer, the per-token sum of the returning rows and, in worst-case
mode, the compaction and its inverse), without communication: on CPU these copies cost about as
much as gloo's loopback transfers, which bounds the achievable ratio. A fourth timing, "own
collectives alone", runs exactly the collectives flexdispatch issues (the count all-gather, the
peers' rows without this rank's own, the metadata, the peers' rows back) on pre-built buffers
with no local work: the floor of any implementation built on these collectives.

Part 2 (R = 4 gloo ranks, 2 nodes x 2 ranks via LOCAL_WORLD_SIZE=2): uniform top-8 routing over
32 experts; inter-node bytes of one hierarchical dispatch + combine over those of the flat one, from
``FlexDispatcher.stats`` (target <= 0.6).

Run: ``.venv/bin/python benchmarks/bench_dispatch.py [--reps 15] [--tokens 4096]``
"""

from __future__ import annotations

import argparse
import datetime
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _routing(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()
    probs = torch.rand(T, k, generator=g)
    return idx, probs / probs.sum(1, keepdim=True)


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _part1(rank: int, R: int, T: int, reps: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from flexdispatch.distributed import all_gather_int64

    E, k, H = 64, 8, 2048
    idx, probs = _routing(T, E, k, seed=rank)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank)).bfloat16()
    W = R * T
    flex = {
        "dropless": FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E),
        "worst-case": FlexDispatcher(
            DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E
        ),
    }
    # bare collectives: the same split sizes, computed once, and pre-built buffers
    e = E // R
    mask = torch.zeros(T, R, dtype=torch.bool).scatter_(1, idx // e, True)
    send = mask.sum(0)
    C = all_gather_int64(send.to(torch.int64)).tolist()
    splits = {
        "dropless": ([C[rank][r] for r in range(R)], [C[s][rank] for s in range(R)]),
        "worst-case": ([W // R] * R, [W // R] * R),
    }
    bufs = {}
    for mode, (s_out, s_in) in splits.items():
        S, M = sum(s_out), sum(s_in)
        bufs[mode] = (
            torch.randn(S, H).bfloat16(),
            torch.zeros(S, 2 * k, dtype=torch.int32),
            torch.empty(M, H, dtype=torch.bfloat16),
            torch.empty(M, 2 * k, dtype=torch.int32),
            torch.empty(S, H, dtype=torch.bfloat16),
        )

    def run_flex(mode: str) -> None:
        d = flex[mode]
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)

    def run_bare(mode: str) -> None:
        s_out, s_in = splits[mode]
        rows, meta, recv_rows, recv_meta, back = bufs[mode]
        dist.all_to_all_single(recv_rows, rows, s_in, s_out)
        dist.all_to_all_single(recv_meta, meta, s_in, s_out)
        dist.all_to_all_single(back, recv_rows, s_out, s_in)

    # the local copies any implementation adds to the bare collectives: the send buffer (a gather
    # of x in destination order), the sum of the returning rows per token, and in worst-case mode
    # the device-side compaction of the padded receive buffer and its inverse in combine
    tok_S = mask.t().nonzero()[:, 1]
    seg = [int(n) for n in send]
    back_rows = torch.randn(tok_S.numel(), H).bfloat16()
    perm_S = torch.randperm(tok_S.numel())

    def run_copies(mode: str) -> None:
        x.index_select(0, tok_S)
        if mode == "worst-case":
            back_rows.index_select(0, perm_S)
            back_rows.index_select(0, perm_S)
        out = torch.zeros(T, H, dtype=x.dtype)
        lo = 0
        for n in seg:
            out.index_add_(0, tok_S[lo : lo + n], back_rows[lo : lo + n])
            lo += n

    # the collectives flexdispatch issues, on pre-built buffers, without any local work: a rank's
    # rows to itself skip gloo (split 0), the metadata goes to every rank
    floor_bufs = {}
    for mode, (s_out, s_in) in splits.items():
        peer_out = [0 if r == rank else n for r, n in enumerate(s_out)]
        peer_in = [0 if r == rank else n for r, n in enumerate(s_in)]
        floor_bufs[mode] = (
            peer_out,
            peer_in,
            torch.randn(sum(peer_out), H).bfloat16(),
            torch.empty(sum(peer_in), H, dtype=torch.bfloat16),
            torch.empty(sum(peer_out), H, dtype=torch.bfloat16),
        )
    counts = torch.zeros(3 * R + 4, dtype=torch.int64)  # the [2R + N + 4] count vector

    def run_floor(mode: str) -> None:
        s_out, s_in = splits[mode]
        _, meta, _, recv_meta, _ = bufs[mode]
        peer_out, peer_in, rows, recv_rows, back = floor_bufs[mode]
        all_gather_int64(counts)
        dist.all_to_all_single(recv_rows, rows, peer_in, peer_out)
        dist.all_to_all_single(recv_meta, meta, s_in, s_out)
        dist.all_to_all_single(back, recv_rows, peer_out, peer_in)

    times: dict[str, list[float]] = {}
    for rep in range(reps + 2):
        for mode in ("dropless", "worst-case"):
            kinds = (("flex", run_flex), ("bare", run_bare), ("copies", run_copies))
            for kind, fn in (*kinds, ("floor", run_floor)):
                t = _timed(lambda fn=fn, mode=mode: fn(mode))
                if rep >= 2:  # warm-up
                    times.setdefault(f"{kind}|{mode}", []).append(t)
    med = {key: statistics.median(v) for key, v in times.items()}
    return {
        "median": med,
        "rows": {m: (sum(s[0]), sum(s[1])) for m, s in splits.items()},
        "syncs": {m: flex[m].stats.host_syncs for m in flex},
        "calls": reps + 2,
    }


def _part2(rank: int, R: int, T: int, reps: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    E, k, H = 32, 8, 256
    idx, probs = _routing(T, E, k, seed=rank)
    x = torch.randn(T, H).bfloat16()
    out: dict[str, Any] = {}
    for name, hier in (("flat", False), ("hierarchical", True)):
        d = FlexDispatcher(DispatchConfig(backend="torch", hierarchical=hier), num_experts=E)
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)
        out[name] = d.stats.as_dict()
        out["L"] = d.ranks_per_node
    return out


def _worker(rank: int, R: int, port: int, part: str, T: int, reps: int, q: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=R,
            timeout=datetime.timedelta(seconds=300),
        )
        fn = _part1 if part == "1" else _part2
        q.put((rank, fn(rank, R, T, reps)))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, traceback.format_exc()))


def _spawn(part: str, R: int, T: int, reps: int, env: dict[str, str]) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # NOTE: inherited by the spawned ranks; restored below
    try:
        procs = [ctx.Process(target=_worker, args=(r, R, port, part, T, reps, q)) for r in range(R)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=900) for _ in range(R))
        for p in procs:
            p.join(timeout=30)
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    for r, v in got.items():
        if isinstance(v, str):
            raise RuntimeError(f"rank {r} failed:\n{v}")
    return [got[r] for r in range(R)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, gloo on CPU, 1 thread per rank, {args.reps} reps (median)\n")

    r1 = _spawn("1", 2, args.tokens, args.reps, {"OMP_NUM_THREADS": "1"})[0]
    print(f"## dispatch + combine, R=2, T={args.tokens}, k=8, E=64, H=2048 bf16\n")
    print(
        "| mode | rows sent / received | flexdispatch (ms) | bare all_to_all_single (ms) "
        "| ratio | own collectives alone (ms) | local copies alone (ms) | host syncs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("dropless", "worst-case"):
        med = r1["median"]
        flex, bare, cp = med[f"flex|{mode}"], med[f"bare|{mode}"], med[f"copies|{mode}"]
        floor = med[f"floor|{mode}"]
        s, m = r1["rows"][mode]
        syncs = r1["syncs"][mode] / r1["calls"]
        print(
            f"| {mode} | {s} / {m} | {flex * 1e3:.1f} | {bare * 1e3:.1f} | {flex / bare:.2f}x | "
            f"{floor * 1e3:.1f} ({floor / bare:.2f}x) | {cp * 1e3:.1f} | {syncs:g} per dispatch |"
        )

    r2 = _spawn("2", 4, args.tokens, 1, {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"})
    flat = sum(r["flat"]["bytes_sent_inter_node"] for r in r2)
    hier = sum(r["hierarchical"]["bytes_sent_inter_node"] for r in r2)
    flat_in = sum(r["flat"]["bytes_sent_intra_node"] for r in r2)
    hier_in = sum(r["hierarchical"]["bytes_sent_intra_node"] for r in r2)
    print(
        f"\n## inter-node bytes, R=4 (N=2 x L={r2[0]['L']}), T={args.tokens}, uniform top-8 of "
        f"32 experts, H=256 bf16, one dispatch + combine\n"
    )
    print("| mode | inter-node bytes (all ranks) | intra-node bytes (all ranks) |")
    print("|---|---|---|")
    print(f"| flat | {flat} | {flat_in} |")
    print(f"| hierarchical | {hier} | {hier_in} |")
    print(f"\nhierarchical / flat inter-node bytes: {hier / flat:.3f} (target <= 0.6)")


if __name__ == "__main__":
    main()
