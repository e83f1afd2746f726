"""Time permute + unpermute against plain copies of the same bytes.

T tokens · k top-k · H hidden · E experts. Random top-k routing (distinct experts per token, no
drops), bf16 rows. Variants, timed interleaved (one repetition of each per round), median:

- ``copy_ x2``: the baseline, ``dst.copy_(src)`` of a ``[T*k, H]`` bf16 tensor into a
  preallocated ``dst``, twice (once per direction). No allocation, no indexing.
- ``clone x2``: ``src.clone()`` of the same tensor twice: the same bytes plus a fresh allocation,
  as permute/unpermute must allocate their outputs (on CPU that means page faults; on CUDA the
  caching allocator makes it nearly free).
- ``exact``: ``permute(x, idx, E)`` (one host sync) then ``unpermute(perm.x, perm)``.
- ``static``: the same with ``static_rows = T*k`` (no host sync).
- ``exact+probs``: ``permute(..., topk_probs=p)`` then ``unpermute(..., probs=perm.probs)``.
- ``exact+probs out=``: the same with ``permute(..., out=buf)`` into a preallocated ``buf``.

On CPU ``permute`` lends its output from the process's output pool (``flexdispatch._pool``):
each repetition drops the previous one's result, so its memory is reused (no page faults), as in
a training loop that drops a step's activations before the next one.

Run:  .venv/bin/python benchmarks/bench_permute.py [--device cuda] [--reps 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from flexdispatch import permute, unpermute


def _sync(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda asked for, but torch.cuda.is_available() is False")

    T, k, H, E = args.tokens, args.topk, args.hidden, args.experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(device, torch.bfloat16)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous().to(device)
    probs = torch.rand(T, k, generator=gen).to(device)
    src = torch.randn(T * k, H, generator=gen).to(device, torch.bfloat16)
    dst = torch.empty_like(src)

    def copy2() -> None:
        dst.copy_(src)
        dst.copy_(src)

    def clone2() -> None:
        src.clone()
        src.clone()

    def exact() -> None:
        perm = permute(x, idx, E)
        unpermute(perm.x, perm)

    def static() -> None:
        perm = permute(x, idx, E, static_rows=T * k)
        unpermute(perm.x, perm)

    def exact_probs() -> None:
        perm = permute(x, idx, E, topk_probs=probs)
        unpermute(perm.x, perm, probs=perm.probs)

    buf = torch.empty(T * k, H, dtype=torch.bfloat16, device=device)

    def exact_probs_out() -> None:
        perm = permute(x, idx, E, topk_probs=probs, out=buf)
        unpermute(perm.x, perm, probs=perm.probs)

    variants: dict[str, Callable[[], None]] = {
        "copy_ x2 (baseline)": copy2,
        "clone x2": clone2,
        "permute+unpermute exact": exact,
        "permute+unpermute static": static,
        "permute+unpermute exact+probs": exact_probs,
        "permute+unpermute exact+probs out=": exact_probs_out,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.warmup + args.reps):
        for name, fn in variants.items():
            elapsed = _time(fn, device)
            if rep >= args.warmup:
                times[name].append(elapsed)

    base = statistics.median(times["copy_ x2 (baseline)"])
    moved = 2 * 2 * T * k * H * 2  # two directions, read + write, bf16
    print(
        f"T={T} k={k} H={H} E={E} bf16, device={device}, threads={torch.get_num_threads()}, "
        f"{args.reps} interleaved reps (median), torch {torch.__version__}"
    )
    print()
    print(
        "| variant | median ms | vs copy_ x2 | copies' share of its time | "
        "GB/s (2 x read+write of [T*k,H]) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"| {name} | {med * 1e3:.2f} | {med / base:.2f}x | {base / med:.2f} | "
            f"{moved / med / 1e9:.1f} |"
        )
    print()
    cmd = " ".join(["python", "benchmarks/bench_permute.py", *(argv or sys.argv[1:])])
    print(f"command: {cmd}")


if __name__ == "__main__":
    main()
