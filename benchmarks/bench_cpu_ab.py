"""CPU A/B of ``topk_routing`` and ``permute`` + ``unpermute``: this checkout against another one,
interleaved in one process (A, B, A, B, ...), so the machine's load hits both alike.

The other checkout's ``flexdispatch/routing/topk.py`` and ``flexdispatch/permutation.py`` are
loaded as separate modules beside this checkout's (their imports resolve to this checkout's
``flexdispatch``, whose ``_validate``, ``_memory`` and ``types`` they share), so run it with a
base close enough for that, e.g. the commit a change starts from:

    git worktree add --detach /tmp/base <base-commit>
    .venv/bin/python benchmarks/bench_cpu_ab.py --base /tmp/base --reps 40

Shapes: T=4,096 tokens, fp32 logits, forward only: DeepSeek-V3 (E=256, k=8, sigmoid + bias, 8
groups / 4, scale 2.5), Qwen3 (E=128, k=8, softmax), Mixtral (E=8, k=2, softmax), DeepSeek-V2
(E=160, k=6, softmax before the top-k, 8 groups / 3 by the max rule, scale 16); permute +
unpermute with probs of T=4,096 bf16 rows, H=2,048, E=64, k=8 (exact, static, align 8).
Reports the minimum and the median of the repetitions, and new / base for each (1 thread).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _time(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, tuple[float, float]]:
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (min(v), statistics.median(v)) for k, v in ts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", required=True, help="root of the other checkout")
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base_root = Path(args.base) / "flexdispatch"
    base_topk = _load("ab_base_topk", base_root / "routing" / "topk.py")
    base_perm = _load("ab_base_permutation", base_root / "permutation.py")
    from flexdispatch import permutation as new_perm
    from flexdispatch.routing import topk as new_topk

    g = torch.Generator().manual_seed(0)
    bias = torch.randn(256, generator=g) * 0.01
    cases = [
        (
            "DeepSeek-V3",
            256,
            {
                "topk": 8,
                "score_function": "sigmoid",
                "num_groups": 8,
                "group_topk": 4,
                "expert_bias": bias,
                "scaling_factor": 2.5,
            },
        ),
        ("Qwen3", 128, {"topk": 8}),
        ("Mixtral", 8, {"topk": 2}),
        (
            "DeepSeek-V2",
            160,
            {
                "topk": 6,
                "use_pre_softmax": True,
                "num_groups": 8,
                "group_topk": 3,
                "group_score": "max",
                "scaling_factor": 16.0,
            },
        ),
    ]
    rows = []
    for name, E, kw in cases:
        x = torch.randn(4096, E, generator=g)
        m = _time(
            {
                "base": lambda x=x, kw=kw: base_topk.topk_routing(x, checks=False, **kw),
                "new": lambda x=x, kw=kw: new_topk.topk_routing(x, checks=False, **kw),
            },
            args.reps,
        )
        rows.append((f"topk_routing {name} (E={E}, k={kw['topk']})", m))
    T, E, k, H = 4096, 64, 8, 2048
    xr = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous()
    p = torch.rand(T, k, generator=g)

    def pu(mod, **kw):  # type: ignore[no-untyped-def]
        def run() -> None:
            perm = mod.permute(xr, idx, E, topk_probs=p, **kw)
            mod.unpermute(perm.x, perm, probs=perm.probs)

        return run

    for label, kw in (
        ("exact", {}),
        ("static", {"static_rows": T * k}),
        ("align 8", {"align": 8}),
    ):
        m = _time({"base": pu(base_perm, **kw), "new": pu(new_perm, **kw)}, args.reps)
        rows.append((f"permute+unpermute {label} (H={H}, E={E}, k={k}, probs)", m))
    print(f"# new = this checkout, base = {args.base}; T=4096, 1 thread, {args.reps} reps")
    print("| case | base min ms | new min ms | new / base (min) | new / base (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, m in rows:
        (bmin, bmed), (nmin, nmed) = m["base"], m["new"]
        print(f"| {name} | {bmin:.2f} | {nmin:.2f} | {nmin / bmin:.3f} | {nmed / bmed:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
