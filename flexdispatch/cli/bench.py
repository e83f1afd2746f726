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
import sys
import time

from flexdispatch.cli._common import int_range, json_text, timeout_seconds

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
    one = int_range(1)
    p.add_argument("--world-size", type=int_range(1, 4096), default=d.world_size, help="R ranks")
    p.add_argument("--ranks-per-node", type=one, default=None, help="L (default R: one node)")
    p.add_argument("--tokens", type=one, default=d.tokens, help="T per rank")
    p.add_argument("--hidden", type=one, default=d.hidden, help="H")
    p.add_argument("--experts", type=one, default=d.experts, help="E")
    p.add_argument("--topk", type=int_range(1, 32), default=d.topk, help="k (at most 32)")
    p.add_argument("--dtype", default=d.dtype, choices=("bf16", "fp16", "fp32"))
    p.add_argument("--reps", type=one, default=d.reps, help="timed repetitions")
    p.add_argument("--warmup", type=int_range(0), default=d.warmup, help="discarded repetitions")
    p.add_argument("--seed", type=int_range(0), default=d.seed, help="random seed, >= 0")
    p.add_argument("--backend", default=d.backend, choices=("auto", "torch", "deepep"))
    p.add_argument(
        "--worst-case", action="store_true", help="static-shape mode, W = R * T rows received"
    )
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=300.0,
        help="seconds before giving up (0.001 to 2147483)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def bench_rank_bytes(*, T: int, H: int, E: int, k: int, R: int, elem: int, worst_case: bool) -> int:
    """Peak bytes one bench rank allocates besides its runtime (compared with the measured peak
    of ``bench_rank`` in ``tests/hostile/test_estimates.py``).

    What every stage keeps: ``x``, the received rows of the kept dispatch (M), the baselines'
    rows (S sent, M received, S back, P pairs twice) and the ``[E, H]`` fp32 gate. On top, the
    dispatch and combine being timed (``fits.dispatch_bytes``) and the largest other
    temporary: the permute of the P received pairs, the router's fp32 copy of x and its
    ``[T, E]`` scores, or a baseline's rows drawn in fp32. S = T * min(k, R) rows sent,
    M = W = R * T received in worst-case mode (else S), P = T * k pairs.
    """
    from flexdispatch._checks import fits

    S = T * min(k, R)
    M = R * T if worst_case else S
    P = T * k
    kept = (T + M + 2 * S + M + 2 * P) * H * elem + 4 * E * H
    timed = fits.dispatch_bytes(T=T, H=H, elem=elem, k=k, R=R, E=E, W=M if worst_case else 0)
    other = max(P * (2 * H * elem + 64), T * H * 4 + 3 * 4 * T * E, max(S, P) * H * 4)
    return int(kept + timed + other)


def _tree_bytes(
    R: int, T: int, H: int, E: int, k: int, elem: int, worst: bool, runtime: int
) -> int:
    """What the R spawned ranks and their parent hold together (``bench_rank_bytes`` each, and
    each process its ``runtime``)."""
    rank = bench_rank_bytes(T=T, H=H, E=E, k=k, R=R, elem=elem, worst_case=worst)
    return R * rank + (R + 1) * runtime


def _dominant(spec, elem: int, runtime: int, flags: tuple[str, ...], tree: bool) -> tuple[str, int]:
    """The flag whose halving lowers the estimate most (the one the refusal names), and its
    value: ``--world-size``, ``--tokens``, ``--hidden`` or ``--experts`` (host arithmetic, one
    estimate per flag)."""
    sizes = {
        "--world-size": spec.world_size,
        "--tokens": spec.tokens,
        "--hidden": spec.hidden,
        "--experts": spec.experts,
    }

    def estimate(values: dict[str, int]) -> int:
        R, T, H, E = (values[f] for f in ("--world-size", "--tokens", "--hidden", "--experts"))
        if tree:
            return _tree_bytes(R, T, H, E, spec.topk, elem, spec.worst_case, runtime)
        return bench_rank_bytes(
            T=T, H=H, E=E, k=spec.topk, R=R, elem=elem, worst_case=spec.worst_case
        )

    def lowered(flag: str) -> int:
        return estimate({**sizes, flag: max(1, sizes[flag] // 2)})

    # NOTE: a flag the user set (not at its default) is named when halving it lowers the estimate
    # by a quarter or more, even where halving a default one would lower it a little more
    # (`--tokens 2147483632` at the default --world-size 2 names --tokens); ties: the first
    from flexdispatch.bench import BenchSpec

    default = BenchSpec()
    changed = [f for f in flags if sizes[f] != getattr(default, _FIELDS[f])]
    base = estimate(sizes)
    flag = min(flags, key=lowered)
    if changed and flag not in changed:
        mine = min(changed, key=lowered)
        if 4 * (base - lowered(mine)) >= base:
            flag = mine
    return flag, sizes[flag]


_FIELDS = {
    "--world-size": "world_size",
    "--tokens": "tokens",
    "--hidden": "hidden",
    "--experts": "experts",
}


def _refuse(flag: str, value: object, nbytes: int, detail: str, tree: bool, fix: str = "") -> None:
    """``fits.check_fits`` for an estimate driven by ``flag=value``: the refusal (a
    ``MemoryRefusal``) names ``flag`` as the option at fault."""
    from flexdispatch._checks import fits

    err = fits.refusal_error(
        "", flag, value, nbytes, "cpu", detail=detail, fix=fix or f"lower {flag}", tree=tree
    )
    if err is not None:
        err.option = flag
        raise err


def check_bench_memory(spec, runtime: int | None = None, runtime_source: str = "") -> None:
    """Refuse sizes whose spawned ranks cannot fit in this machine's memory (before spawning).

    R ranks and the parent run here: each holds a runtime (Python, torch, its process group:
    ``runtime``, else measured as ``flexdispatch demo`` does, ``demo_machine.measure_runtime``)
    and each rank ``bench_rank_bytes``. Their sum is compared with what the tree of processes can
    take (``sysmem.available(tree=True)``: ``MemAvailable``, the cgroup limits), one rank with
    what one process can take (``RLIMIT_AS`` too: it bounds each process on its own). The probe
    process runs only when needed: not when the ranks' rows alone already do not fit, nor when
    everything fits with the largest runtime allowance (``demo_machine.FALLBACK_BYTES``). The
    refusal (a ``MemoryRefusal``) names the flag whose halving lowers the estimate most
    (``_dominant``).
    """
    from flexdispatch._checks import fits, sysmem
    from flexdispatch.bench import DTYPES
    from flexdispatch.cli import demo_machine

    R, T, H, E = spec.world_size, spec.tokens, spec.hidden, spec.experts
    elem = DTYPES[spec.dtype].itemsize
    rank = bench_rank_bytes(T=T, H=H, E=E, k=spec.topk, R=R, elem=elem, worst_case=spec.worst_case)
    if runtime is None:
        usable, _ = sysmem.usable(tree=True)
        if usable is not None and R * rank > usable:
            runtime, runtime_source = 0, "not counted: the rows alone do not fit"
        elif usable is None or R * rank + (R + 1) * demo_machine.FALLBACK_BYTES <= usable:
            # NOTE: fits with the largest runtime allowance: nothing to measure
            _check_one_rank(spec, elem, rank, demo_machine.FALLBACK_BYTES)
            return
        else:
            runtime, _measured, runtime_source = demo_machine.measure_runtime("cpu")
    processes = (
        f" and the parent, each with {fits.format_bytes(runtime)} runtime ({runtime_source})"
        if runtime
        else f" (runtime {runtime_source})"
    )
    flags = ("--world-size", "--tokens", "--hidden", "--experts")
    flag, value = _dominant(spec, elem, runtime, flags, tree=True)
    _refuse(
        flag,
        value,
        R * rank + (R + 1) * runtime,
        f"R={R} spawned ranks{processes}; each rank with T={T} x H={H} {spec.dtype} rows, their "
        f"dispatch, combine and baselines, and an [E={E}, H] fp32 gate",
        tree=True,
    )
    _check_one_rank(spec, elem, rank, runtime)


def _check_one_rank(spec, elem: int, rank: int, runtime: int) -> None:
    """One spawned rank (``rank`` bytes and ``runtime``) against what one process may take (this
    process's ``RLIMIT_AS``, which every rank inherits, counts here). When the runtime alone is
    most of it, the limit is at fault (``ulimit -v``), not a size."""
    from flexdispatch._checks import fits

    T, H, E = spec.tokens, spec.hidden, spec.experts
    detail = (
        f"one spawned rank: T={T} x H={H} {spec.dtype} rows, their dispatch, combine and "
        f"baselines, an [E={E}, H] fp32 gate, and its runtime"
    )
    if runtime >= rank:
        err = fits.refusal_error(
            "",
            "runtime",
            fits.format_bytes(runtime),
            runtime + rank,
            "cpu",
            detail=detail,
            fix="raise the address-space limit (ulimit -v unlimited)",
        )
        if err is not None and "RLIMIT_AS" in err.source:
            import resource

            err.option = "ulimit -v"
            err.value = fits.format_bytes(resource.getrlimit(resource.RLIMIT_AS)[0]).replace(
                " ", ""
            )
            raise err
    flag, value = _dominant(spec, elem, runtime, ("--tokens", "--hidden", "--experts"), tree=False)
    _refuse(flag, value, runtime + rank, detail, tree=False)


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
    from flexdispatch.cli._common import check_backend, group_failure
    from flexdispatch.launch import GroupError, threads_per_rank, under_launcher

    spec = spec_from_args(args)
    t0 = time.perf_counter()
    if under_launcher():
        results = run_under_launcher(spec, timeout_s=args.timeout)
        if results is None:
            return 0
        launcher = "torchrun"
    else:
        spec.validate()
        threads_per_rank()  # NOTE: a bad $FLEXDISPATCH_THREADS is named before spawning
        check_backend(spec.backend)
        check_bench_memory(spec)
        try:
            results = run_spawned(spec, timeout_s=args.timeout)
        except GroupError as exc:
            phase = "timing the stages on the spawned ranks"
            raise group_failure(exc, phase=phase, timeout_s=args.timeout) from exc
        launcher = "spawn"
    report = summarize(
        spec, results, launcher=launcher, wall_s=time.perf_counter() - t0, json_out=args.json
    )
    if args.json:
        print(json_text(report))
    else:
        print(format_table(report))
        print(f"wall time {report['wall_s']:.1f} s")
    return 0
