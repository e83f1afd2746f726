"""Build time of ``MoELayer`` with the ``deepseek_v3`` preset (issue 26 item 6).

Shape letters (ARCHITECTURE.md): H hidden · F expert hidden · E experts · R ranks · e = E / R.

Rows of the table (each timed ``--reps`` times, median and range, bf16 parameters):

- ``meta``: ``MoELayer(deepseek_v3, device="meta")``, the whole layer (E = 256 experts of
  H = 7,168, F = 2,048: 11.3 G parameters) as shapes only;
- ``cpu, one rank's share``: what ``MoELayer`` builds on one rank of an R-rank group (``--ranks``,
  default 32: e = 8 experts, 352 M parameters, 0.7 GB in bf16) — the router, ``GroupedExperts(e,
  first_expert=rank * e)`` and the shared experts, with the same seeds — built directly on the
  CPU. (The whole layer needs 22.5 GB in bf16, more than the development machine has.) Per
  expert it is the whole layer's cost divided by E;
- ``cpu, meta -> to_empty -> reset``: the same share built on meta, then ``to_empty`` and
  ``reset_parameters_from_seed`` (checkpoint-loading path without a checkpoint);
- ``cuda, whole layer``: ``MoELayer(deepseek_v3, device="cuda")`` when a GPU is visible
  (issue 26's goal: <= 10 s on one GPU; it took 59.5 s before, see the H200 measurements).

Runs against older code too (no ``seed=`` on ``GroupedExperts``: the old path, a CPU draw in
``__init__`` then ``reset_parameters_from_seed``), so a before / after pair comes from one script.

Run: ``.venv/bin/python benchmarks/bench_build.py [--reps 3] [--ranks 32] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _timed(fn: Any, reps: int, sync: bool = False) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        obj = fn()
        if sync:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
        del obj
    return out


def _share(cfg: Any, R: int, rank: int, dtype: torch.dtype, device: str, seed: int = 0) -> list:
    """The parameters ``MoELayer`` builds on ``rank`` of ``R`` (router, experts, shared)."""
    from flexdispatch.experts import GroupedExperts, SharedExperts
    from flexdispatch.routing import TopKRouter

    E = cfg.router.num_experts
    e = E // R
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        router = TopKRouter(cfg.router, cfg.hidden_size)
    router.to(device=device)
    kw = dict(
        activation=cfg.activation,
        bias=cfg.expert_mlp_bias,
        dtype=dtype,
        device=device,
        first_expert=rank * e,
    )
    try:
        experts = GroupedExperts(e, cfg.hidden_size, cfg.ffn_hidden_size, seed=seed, **kw)
    except TypeError:  # NOTE: older code: a CPU draw in __init__, then the seeded one
        experts = GroupedExperts(e, cfg.hidden_size, cfg.ffn_hidden_size, **kw)
        experts.reset_parameters_from_seed(seed)
    mods = [router, experts]
    if cfg.num_shared_experts:
        fs = cfg.shared_expert_ffn_hidden_size or cfg.num_shared_experts * cfg.ffn_hidden_size
        try:
            shared = SharedExperts(
                cfg.hidden_size, fs, activation=cfg.activation, dtype=dtype, device=device,
                seed=seed, expert_id=E,
            )  # fmt: skip
        except TypeError:
            shared = SharedExperts(
                cfg.hidden_size, fs, activation=cfg.activation, dtype=dtype, device=device
            )
            shared.reset_parameters_from_seed(seed, E)
        mods.append(shared)
    return mods


def _lazy_share(cfg: Any, R: int, dtype: torch.dtype) -> list:
    mods = _share(cfg, R, 1, dtype, "meta")
    for m in mods:
        m.to_empty(device="cpu")
    mods[1].reset_parameters_from_seed(0)
    if len(mods) > 2:
        mods[2].reset_parameters_from_seed(0, cfg.router.num_experts)
    return mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=32, help="R of the CPU share (e = 256 / R)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--rows",
        default="meta,cpu,lazy,cuda",
        help="which rows to run (older code cannot build the whole layer on meta in 24 GB)",
    )
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from flexdispatch.config import load_config
    from flexdispatch.moe import MoELayer

    cfg = load_config("deepseek_v3")
    dtype = torch.bfloat16
    E, R = cfg.router.num_experts, args.ranks
    rows: list[dict[str, Any]] = []

    def add(name: str, times: list[float], experts: int) -> None:
        med = statistics.median(times)
        rows.append(
            dict(
                what=name,
                experts=experts,
                median_s=med,
                min_s=min(times),
                max_s=max(times),
                per_expert_ms=1e3 * med / experts,
            )
        )

    want = set(args.rows.split(","))
    if "meta" in want:
        MoELayer(load_config("tiny_cpu"), device="meta")  # NOTE: imports off the clock
        add(
            "meta, whole layer",
            _timed(lambda: MoELayer(cfg, dtype=dtype, device="meta"), args.reps),
            E,
        )
    if "cpu" in want:
        add(
            f"cpu, one rank's share (R={R})",
            _timed(lambda: _share(cfg, R, 1, dtype, "cpu"), args.reps),
            E // R,
        )
    try:
        if "lazy" in want:
            add(
                f"cpu, meta -> to_empty -> reset (R={R})",
                _timed(lambda: _lazy_share(cfg, R, dtype), args.reps),
                E // R,
            )
    except (AttributeError, RuntimeError, NotImplementedError) as err:  # older code
        print(f"(meta -> to_empty -> reset not available: {type(err).__name__}: {err})")
    if "cuda" in want and torch.cuda.is_available():
        MoELayer(load_config("tiny_cpu"), device="cuda")  # NOTE: CUDA context off the clock
        torch.cuda.synchronize()
        add(
            "cuda, whole layer",
            _timed(lambda: MoELayer(cfg, dtype=dtype, device="cuda"), args.reps, sync=True),
            E,
        )
    print(f"MoELayer(deepseek_v3) build, bf16, torch {torch.__version__}, {args.reps} reps")
    print("| what | experts | median s | range s | ms per expert |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['what']} | {r['experts']} | {r['median_s']:.3f} | "
            f"{r['min_s']:.3f}–{r['max_s']:.3f} | {r['per_expert_ms']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
