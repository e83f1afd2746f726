"""``flexdispatch bench``: time router, layout, permute, dispatch and combine beside baselines.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
L ranks per node · N = R / L nodes.

Usage::

    flexdispatch bench [--what router,layout,permute,dispatch,combine] [--world-size R]
        [--ranks-per-node L] [--tokens T] [--hidden H] [--experts E] [--topk k]
        [--dtype bf16|fp16|fp32] [--reps N] [--warmup N] [--seed S]
        [--backend auto|torch|deepep] [--worst-case] [--json] [--no-progress]

Without a launcher it spawns R gloo ranks on this machine (one thread each); under ``torchrun``
it joins the launcher's group (NCCL on GPUs, gloo otherwise) and rank 0 prints. Every stage is
timed in interleaved repetitions beside its baseline (the bare ``all_to_all_single`` moving the
same rows for dispatch and combine); the table gives medians over repetitions (slowest rank) and
ratios, and ends with the exact command. ``--json`` prints ``flexdispatch.bench.summarize``'s
report (schema ``flexdispatch.bench/1``, keys in that module's docstring and docs/cli.md).
The defaults finish in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["register", "run", "spec_from_args"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` sub-command to ``sub``."""
    from flexdispatch.bench import STAGES, BenchSpec

    d = BenchSpec()
    p = sub.add_parser(
        "bench",
        help="time router/layout/permute/dispatch/combine beside bare all_to_all_single",
        description="Time the MoE dispatch pipeline's stages on this machine's backend, "
        "interleaved with their baselines, and print medians and ratios.",
    )
    p.add_argument(
        "--what",
        default=",".join(STAGES),
        help=f"comma-separated stages (default {','.join(STAGES)})",
    )
    p.add_argument("--world-size", type=int, default=d.world_size, help="R spawned ranks")
    p.add_argument("--ranks-per-node", type=int, default=None, help="L (default R: one node)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="T per rank")
    p.add_argument("--hidden", type=int, default=d.hidden, help="H")
    p.add_argument("--experts", type=int, default=d.experts, help="E")
    p.add_argument("--topk", type=int, default=d.topk, help="k")
    p.add_argument("--dtype", default=d.dtype, choices=("bf16", "fp16", "fp32"))
    p.add_argument("--reps", type=int, default=d.reps, help="timed repetitions")
    p.add_argument("--warmup", type=int, default=d.warmup, help="discarded repetitions")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", default=d.backend, choices=("auto", "torch", "deepep"))
    p.add_argument(
        "--worst-case", action="store_true", help="static-shape mode, W = R * T rows received"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace):
    """The ``BenchSpec`` the arguments describe (validated for the spawned world size)."""
    from flexdispatch.bench import BenchSpec

    what = tuple(w.strip() for w in args.what.split(",") if w.strip())
    spec = BenchSpec(
        what=what,
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        dtype=args.dtype,
        reps=args.reps,
        warmup=args.warmup,
        seed=args.seed,
        backend=args.backend,
        worst_case=args.worst_case,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    return spec


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the table or JSON (rank 0 only under a launcher)."""
    from flexdispatch.bench import format_table, run_spawned, run_under_launcher, summarize
    from flexdispatch.launch import under_launcher

    spec = spec_from_args(args)
    t0 = time.perf_counter()
    if under_launcher():
        results = run_under_launcher(spec, timeout_s=args.timeout)
        if results is None:
            return 0
        launcher = "torchrun"
    else:
        spec.validate()
        results = run_spawned(spec, timeout_s=args.timeout)
        launcher = "spawn"
    report = summarize(
        spec, results, launcher=launcher, wall_s=time.perf_counter() - t0, json_out=args.json
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
        print(f"wall time {report['wall_s']:.1f} s")
    return 0
