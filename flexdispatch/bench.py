"""Timing harness of ``flexdispatch bench``: the MoE pipeline's stages beside bare baselines.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · R ranks · e = E / R
local experts · k top-k · L ranks per node · N = R / L nodes · S rows sent by a rank · M rows
received · P valid (row, slot) pairs received · W worst-case rows.

Each rank (spawned gloo workers on CPU through ``flexdispatch.launch.spawn_group``, or the
processes ``torchrun`` started) builds the same seeded workload: a ``TopKRouter`` (softmax, top-k)
over ``[T, H]`` activations, its ``[T, k]`` routing, the layout, and a ``FlexDispatcher``. Then,
in every round, it runs each selected stage once, each followed by its baseline (interleaved
repetitions; warm-up rounds are discarded):

=========  ==========================================  =========================================
stage      timed                                        baseline (same data, nothing else)
=========  ==========================================  =========================================
router     ``TopKRouter(x)`` (no grad)                  the fp32 gating GEMM ``x @ W.T`` alone
layout     ``get_dispatch_layout(topk_idx, E, R)``      none
permute    ``permute`` of the received rows by local    ``copy_`` of a ``[P, H]`` tensor twice
           expert + ``unpermute`` (probs applied)
dispatch   ``FlexDispatcher.dispatch``                  ``all_to_all_single`` of the ``[S, H]``
                                                        rows with precomputed splits
combine    ``FlexDispatcher.combine``                   ``all_to_all_single`` of ``[M, H]`` back
=========  ==========================================  =========================================

Stages that communicate are timed between two barriers (the slowest rank sets the time); the
others on each rank alone. A stage's time is the median over repetitions on each rank, then the
maximum over ranks; ``ratio`` = stage / baseline.

``summarize`` returns one JSON-ready dict (schema ``flexdispatch.bench/1``):

- ``schema``, ``command`` (the exact command line that reproduces the run), ``wall_s``.
- ``machine``: ``hostname``, ``cpu_count``, ``torch``, ``python``, ``platform``, ``date`` (UTC,
  ISO 8601), ``device`` (``"cpu"`` or the GPU name), ``process_group`` (``gloo`` | ``nccl``),
  ``launcher`` (``spawn`` | ``torchrun``), ``threads_per_rank``.
- ``config``: ``what``, ``world_size`` (R), ``ranks_per_node`` (L), ``nodes`` (N), ``tokens`` (T),
  ``hidden`` (H), ``experts`` (E), ``topk`` (k), ``dtype``, ``reps``, ``warmup``, ``seed``,
  ``backend`` (requested), ``worst_case`` (W = R * T when true).
- ``backend``, ``backend_reason``: what ran and why.
- ``rows``: ``sent_per_rank`` [R] (S, one row per token and destination rank),
  ``received_per_rank`` [R] (M), ``pairs_received_per_rank`` [R] (P),
  ``host_syncs_per_dispatch``.
- ``results``: one entry per stage, in ``what`` order: ``stage``, ``median_ms``,
  ``per_rank_median_ms`` [R], ``min_ms``, ``baseline`` (its name or null), ``baseline_median_ms``
  (or null), ``ratio`` (or null), ``reps``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import torch
import torch.distributed as dist

__all__ = [
    "SCHEMA",
    "STAGES",
    "BASELINES",
    "DTYPES",
    "BenchSpec",
    "Workload",
    "ProgressBar",
    "time_interleaved",
    "make_workload",
    "bench_rank",
    "run_spawned",
    "run_under_launcher",
    "summarize",
    "format_table",
    "command_line",
]

SCHEMA = "flexdispatch.bench/1"
STAGES = ("router", "layout", "permute", "dispatch", "combine")
BASELINES: dict[str, str | None] = {
    "router": "gating GEMM",
    "layout": None,
    "permute": "copy_ x2",
    "dispatch": "all_to_all_single",
    "combine": "all_to_all_single",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COLLECTIVE = frozenset({"dispatch", "combine"})


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """What every rank benchmarks (picklable).

    Attributes:
        what: stages to time, a subset of ``STAGES`` (kept in the order given).
        world_size: R (spawned ranks; under a launcher its world size wins).
        ranks_per_node: L (spawned ranks; under a launcher ``LOCAL_WORLD_SIZE`` wins).
        tokens: T per rank.
        hidden: H.
        experts: E, divisible by R.
        topk: k.
        dtype: activation dtype name, a key of ``DTYPES``.
        reps: timed repetitions.
        warmup: discarded repetitions before them.
        seed: seeds the router weights (same on every rank) and each rank's activations.
        backend: ``DispatchConfig.backend``.
        worst_case: static-shape mode with W = R * T.
        progress: draw a progress bar on rank 0's stderr.
    """

    what: tuple[str, ...] = STAGES
    world_size: int = 2
    ranks_per_node: int | None = None
    tokens: int = 2048
    hidden: int = 1024
    experts: int = 16
    topk: int = 4
    dtype: str = "bf16"
    reps: int = 20
    warmup: int = 2
    seed: int = 0
    backend: str = "auto"
    worst_case: bool = False
    progress: bool = False

    def validate(self, world_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the bad field and the fix."""
        R = self.world_size if world_size is None else world_size
        unknown = [w for w in self.what if w not in STAGES]
        if unknown or not self.what:
            raise ValueError(
                f"--what takes a comma-separated subset of {','.join(STAGES)}, got "
                f"{','.join(self.what) or 'nothing'}"
            )
        for name in ("tokens", "hidden", "experts", "topk", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if R < 1:
            raise ValueError(f"--world-size must be >= 1, got {R}")
        L = self.ranks_per_node or R
        if L < 1 or R % L:
            raise ValueError(f"--ranks-per-node {L} must be a positive divisor of R={R}")
        if self.experts % R:
            raise ValueError(f"--experts {self.experts} must be divisible by the world size {R}")
        if self.topk > self.experts:
            raise ValueError(f"--topk {self.topk} cannot exceed --experts {self.experts}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


class ProgressBar:
    """A one-line progress bar on a stream (redrawn in place; nothing when disabled).

    Args:
        total: steps to completion.
        label: text before the bar.
        stream: where to draw (default ``sys.stderr``).
        enabled: draw at all.
        width: characters of the bar.
    """

    def __init__(
        self,
        total: int,
        *,
        label: str = "bench",
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 30,
    ) -> None:
        self.total = max(1, int(total))
        self.done = 0
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.width = width
        self._t0 = time.perf_counter()

    def render(self) -> str:
        """The current line (without the carriage return)."""
        filled = self.width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self._t0
        return f"[{self.label}] |{bar}| {self.done}/{self.total} {elapsed:5.1f}s"

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            self.stream.write("\r" + self.render())
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    reps: int,
    warmup: int = 0,
    timer: Callable[[str, Callable[[], object]], float] | None = None,
    on_round: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Time every function once per round, in the mapping's order, for ``warmup + reps`` rounds.

    Args:
        fns: name → a callable taking no argument.
        reps: rounds kept.
        warmup: rounds run first and discarded.
        timer: ``timer(name, fn) -> seconds`` (default: ``perf_counter`` around ``fn()``).
        on_round: called after every round (progress bars).

    Returns:
        name → ``reps`` durations in seconds, in round order.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")

    def _plain(name: str, fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    timer = timer or _plain
    out: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(warmup + reps):
        for name, fn in fns.items():
            t = timer(name, fn)
            if rnd >= warmup:
                out[name].append(t)
        if on_round is not None:
            on_round()
    return out


# --------------------------------------------------------------------------- one rank


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One rank's inputs, all from ``BenchSpec.seed``.

    Attributes:
        x: ``[T, H]`` activations in ``spec.dtype``.
        router: the ``TopKRouter`` (weights equal on every rank).
        topk_idx: ``[T, k]`` int64 global expert ids (``-1`` never occurs: no capacity).
        topk_probs: ``[T, k]`` float32.
    """

    x: torch.Tensor
    router: Any
    topk_idx: torch.Tensor
    topk_probs: torch.Tensor


def make_workload(spec: BenchSpec, rank: int, device: torch.device) -> Workload:
    """The seeded workload of ``rank`` (any process can rebuild any rank's)."""
    from flexdispatch.config import RouterConfig
    from flexdispatch.routing import TopKRouter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        router = TopKRouter(RouterConfig(num_experts=spec.experts, topk=spec.topk), spec.hidden)
    router = router.to(device).eval()
    gen = torch.Generator().manual_seed(spec.seed * 1000 + 17 + rank)
    x = torch.randn(spec.tokens, spec.hidden, generator=gen).to(device, DTYPES[spec.dtype])
    with torch.no_grad():
        routing = router(x)
    return Workload(x=x, router=router, topk_idx=routing.topk_idx, topk_probs=routing.topk_probs)


def _device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        # NOTE: whoever started this rank bound its GPU (spawn_group: cuda:rank; a launcher:
        # cuda:LOCAL_RANK).
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bench_rank(spec: BenchSpec) -> dict[str, Any]:
    """Body of one rank (the process group is initialised); returns its samples and counts."""
    from flexdispatch.config import DispatchConfig
    from flexdispatch.dispatch.dispatcher import FlexDispatcher
    from flexdispatch.distributed import (
        all_gather_int64,
        collective_device,
        collective_guard,
        local_world_size,
    )
    from flexdispatch.layout import get_dispatch_layout
    from flexdispatch.permutation import permute, unpermute

    R, rank = dist.get_world_size(), dist.get_rank()
    L = min(local_world_size() or R, R)
    device = _device()
    on_cuda = device.type == "cuda"
    E, T, H = spec.experts, spec.tokens, spec.hidden
    e = E // R
    wl = make_workload(spec, rank, device)
    x, idx, probs = wl.x, wl.topk_idx, wl.topk_probs
    W = R * T if spec.worst_case else 0
    disp = FlexDispatcher(
        DispatchConfig(backend=spec.backend, num_worst_tokens=W, ranks_per_node=L),
        num_experts=E,
    )
    layout = get_dispatch_layout(idx, E, R, ranks_per_node=L)
    res = disp.dispatch(x, idx, probs, layout=layout)
    back = disp.combine(res.recv_x, res.handle)
    del back
    # the bare collectives' splits: DeepEP's rule, one row per (token, destination rank)
    send = layout.num_tokens_per_rank.to(torch.int64)
    counts = all_gather_int64(send.to(collective_device(None))).cpu().tolist()
    s_out = [counts[rank][r] for r in range(R)]
    s_in = [counts[s][rank] for s in range(R)]
    if W:
        s_out = s_in = [W // R] * R
    rows_send = torch.randn(sum(s_out), H).to(device, x.dtype)
    rows_recv = torch.empty(sum(s_in), H, dtype=x.dtype, device=device)
    rows_back = torch.empty(sum(s_out), H, dtype=x.dtype, device=device)
    pairs = int((res.recv_topk_idx >= 0).sum())
    src_P = torch.randn(pairs, H).to(device, x.dtype)
    dst_P = torch.empty_like(src_P)
    w_f32 = wl.router.weight.detach()
    recv_x, recv_idx, recv_probs = res.recv_x, res.recv_topk_idx, res.recv_topk_probs

    def run_permute() -> None:
        perm = permute(recv_x, recv_idx, e, topk_probs=recv_probs)
        unpermute(perm.x, perm, probs=perm.probs)

    def run_copies() -> None:
        dst_P.copy_(src_P)
        src_P.copy_(dst_P)

    stage_fns: dict[str, Callable[[], object]] = {
        "router": lambda: wl.router(x),
        "layout": lambda: get_dispatch_layout(idx, E, R, ranks_per_node=L),
        "permute": run_permute,
        "dispatch": lambda: disp.dispatch(x, idx, probs, layout=layout),
        "combine": lambda: disp.combine(recv_x, res.handle),
    }
    base_fns: dict[str, Callable[[], object]] = {
        "router": lambda: x.float() @ w_f32.t(),
        "permute": run_copies,
        "dispatch": lambda: dist.all_to_all_single(rows_recv, rows_send, s_in, s_out),
        "combine": lambda: dist.all_to_all_single(rows_back, rows_recv, s_out, s_in),
    }
    fns: dict[str, Callable[[], object]] = {}
    for stage in spec.what:
        fns[stage] = stage_fns[stage]
        if stage in base_fns:
            fns[f"{stage}/baseline"] = base_fns[stage]

    def timer(name: str, fn: Callable[[], object]) -> float:
        collective = name.split("/")[0] in _COLLECTIVE
        guard = collective_guard(f"{name} (bench)") if collective else contextlib.nullcontext()
        with guard:
            if collective:
                dist.barrier()
            elif on_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if on_cuda:
                torch.cuda.synchronize()
            if collective:
                dist.barrier()
        return time.perf_counter() - t0

    bar = ProgressBar(
        spec.warmup + spec.reps, label=f"bench R={R}", enabled=spec.progress and rank == 0
    )
    syncs0, calls0 = disp.stats.host_syncs, disp.stats.dispatch_calls
    with torch.no_grad():
        samples = time_interleaved(
            fns, reps=spec.reps, warmup=spec.warmup, timer=timer, on_round=bar.advance
        )
    bar.close()
    d_calls = disp.stats.dispatch_calls - calls0
    out = {
        "rank": rank,
        "world_size": R,
        "ranks_per_node": L,
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "process_group": str(dist.get_backend()),
        "backend": disp.backend_name,
        "backend_reason": disp.backend_reason,
        "rows_sent": int(send.sum()),
        "rows_received": int((res.recv_topk_idx >= 0).any(1).sum()),
        "pairs_received": pairs,
        "host_syncs_per_dispatch": (disp.stats.host_syncs - syncs0) / d_calls if d_calls else None,
        "samples": samples,
    }
    disp.close()
    return out


# --------------------------------------------------------------------------- running


def run_spawned(spec: BenchSpec, *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run ``bench_rank`` on ``spec.world_size`` spawned gloo ranks on this machine."""
    from flexdispatch.launch import spawn_group

    spec.validate()
    return spawn_group(
        bench_rank,
        spec.world_size,
        args=(spec,),
        ranks_per_node=spec.ranks_per_node or spec.world_size,
        timeout_s=timeout_s,
    )


def run_under_launcher(spec: BenchSpec, *, timeout_s: float = 300.0) -> list[dict[str, Any]] | None:
    """Join the launcher's group (NCCL on CUDA, else gloo), run, gather on rank 0.

    Returns:
        Every rank's result on rank 0, None on the other ranks.
    """
    from flexdispatch.distributed import join_launcher_group, launcher_env
    from flexdispatch.launch.devices import plan_devices

    env = launcher_env()  # NOTE: every variable checked, each error naming its variable
    # NOTE: refused here, before the group exists, when the local ranks outnumber the GPUs.
    plan = plan_devices(env["LOCAL_WORLD_SIZE"], ranks_hint="--nproc-per-node {gpus}")
    if plan.uses_gpus:
        torch.cuda.set_device(env["LOCAL_RANK"])
    join_launcher_group(plan.backend, timeout_s)
    try:
        spec.validate(dist.get_world_size())
        mine = bench_rank(spec)
        from flexdispatch.launch import gather_objects

        gathered = gather_objects(mine)  # NOTE: tensors, never unrestricted pickles
        return gathered if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the report


def command_line(spec: BenchSpec, *, json_out: bool = False) -> str:
    """The ``flexdispatch bench`` command that reproduces ``spec`` (every option explicit)."""
    argv = [
        "flexdispatch",
        "bench",
        "--what",
        ",".join(spec.what),
        "--world-size",
        str(spec.world_size),
        "--ranks-per-node",
        str(spec.ranks_per_node or spec.world_size),
        "--tokens",
        str(spec.tokens),
        "--hidden",
        str(spec.hidden),
        "--experts",
        str(spec.experts),
        "--topk",
        str(spec.topk),
        "--dtype",
        spec.dtype,
        "--reps",
        str(spec.reps),
        "--warmup",
        str(spec.warmup),
        "--seed",
        str(spec.seed),
        "--backend",
        spec.backend,
    ]
    if spec.worst_case:
        argv.append("--worst-case")
    if json_out:
        argv.append("--json")
    return shlex.join(argv)


def _median_ms(samples: Sequence[float]) -> float:
    return 1e3 * statistics.median(samples)


def summarize(
    spec: BenchSpec,
    results: list[dict[str, Any]],
    *,
    launcher: str,
    wall_s: float,
    json_out: bool = False,
) -> dict[str, Any]:
    """Fold every rank's samples into the report (keys in the module docstring)."""
    from flexdispatch.launch import threads_per_rank

    R, L = results[0]["world_size"], results[0]["ranks_per_node"]
    spec_run = BenchSpec(**{**asdict(spec), "world_size": R, "ranks_per_node": L})
    rows = []
    for stage in spec.what:
        per_rank = [_median_ms(r["samples"][stage]) for r in results]
        entry: dict[str, Any] = {
            "stage": stage,
            "median_ms": max(per_rank),
            "per_rank_median_ms": per_rank,
            "min_ms": 1e3 * min(min(r["samples"][stage]) for r in results),
            "baseline": BASELINES[stage],
            "baseline_median_ms": None,
            "ratio": None,
            "reps": len(results[0]["samples"][stage]),
        }
        key = f"{stage}/baseline"
        if key in results[0]["samples"]:
            base = max(_median_ms(r["samples"][key]) for r in results)
            entry["baseline_median_ms"] = base
            entry["ratio"] = entry["median_ms"] / base if base > 0 else None
        rows.append(entry)
    config: dict[str, Any] = {"what": list(spec.what), "world_size": R, "ranks_per_node": L}
    config["nodes"] = R // L
    for name in ("tokens", "hidden", "experts", "topk", "dtype", "reps", "warmup", "seed"):
        config[name] = getattr(spec, name)
    config["backend"], config["worst_case"] = spec.backend, spec.worst_case
    return {
        "schema": SCHEMA,
        "command": command_line(spec_run, json_out=json_out),
        "wall_s": round(wall_s, 2),
        "machine": {
            "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": results[0]["device"],
            "process_group": results[0]["process_group"],
            "launcher": launcher,
            "threads_per_rank": threads_per_rank()
            if launcher == "spawn"
            else torch.get_num_threads(),
        },
        "config": config,
        "backend": results[0]["backend"],
        "backend_reason": results[0]["backend_reason"],
        "rows": {
            "sent_per_rank": [r["rows_sent"] for r in results],
            "received_per_rank": [r["rows_received"] for r in results],
            "pairs_received_per_rank": [r["pairs_received"] for r in results],
            "host_syncs_per_dispatch": results[0]["host_syncs_per_dispatch"],
        },
        "results": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table with the command and the machine."""
    c, m = report["config"], report["machine"]
    lines = [
        f"flexdispatch bench — {c['world_size']} rank(s) ({c['nodes']} node(s) x "
        f"{c['ranks_per_node']}), T={c['tokens']} H={c['hidden']} E={c['experts']} "
        f"k={c['topk']} {c['dtype']}" + (", worst-case" if c["worst_case"] else ", dropless"),
        f"backend {report['backend']} ({report['backend_reason']}) over {m['process_group']} on "
        f"{m['device']}; {m['cpu_count']} CPUs, torch {m['torch']}, {m['date']}",
        f"rows sent per rank {report['rows']['sent_per_rank']}, received "
        f"{report['rows']['received_per_rank']}; medians of {c['reps']} interleaved reps "
        f"(slowest rank)",
        f"{'stage':<9} {'ms':>9} {'baseline':<18} {'base ms':>9} {'ratio':>6}",
    ]
    for r in report["results"]:
        base = r["baseline"] or "-"
        bms = f"{r['baseline_median_ms']:.3f}" if r["baseline_median_ms"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"{r['stage']:<9} {r['median_ms']:>9.3f} {base:<18} {bms:>9} {ratio:>6}")
    lines.append(f"command: {report['command']}")
    return "\n".join(lines)
