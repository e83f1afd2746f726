"""Benchmark ``topk_routing`` against Megatron-Core's unfused router on a DeepSeek-V3 shape (CPU).

Shape letters: T tokens · E experts · k top-k · G expert groups.

Workload: T=4096 tokens, E=256 experts, k=8, 8 groups with 4 kept (node-limited routing),
sigmoid scores with an expert bias, fp32 logits, forward only (no autograd graph).

- flexdispatch: ``topk_routing(...)`` returns ``[T, k]`` ids and probs directly.
- Megatron-Core: ``topk_routing_with_score_function(...)`` returns ``[T, E]`` probs and map, then
  the ``torch.topk(probs, k)`` its DeepEP dispatcher manager runs to get back to ``[T, k]``
  (and, with capacity dropping, ``apply_router_token_dropping`` before it and the ``-1`` mask
  after it).

Repetitions are interleaved (A, B, A, B, ...) and the median is reported. Both paths are also
checked to choose the same expert set for every token (printed as "agreement").

megatron-core is an optional, benchmark-only dependency. Install it into the venv with::

    .venv/bin/pip install numpy packaging
    .venv/bin/pip install --ignore-requires-python --no-deps megatron-core==0.19.2

Without it the script says so, times flexdispatch alone and exits 0.

Run: ``.venv/bin/python benchmarks/bench_routing.py [--reps 20] [--threads 1]``
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable

import torch

from flexdispatch.routing import topk_routing

T, E, K, GROUPS, GROUP_TOPK = 4096, 256, 8, 8, 4


def _import_megatron() -> tuple[dict[str, Callable] | None, str]:
    """Megatron-Core's routing functions, or None and the reason they are unavailable."""
    # NOTE: megatron.core imports Triton kernels (paged stash) at import time; they are not used
    # by the router, so a stub module stands in for them on a machine without Triton.
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            stub = types.ModuleType(name)
            stub.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]

            def _unavailable(*args: object, **kwargs: object) -> None:
                raise RuntimeError("Triton kernels are not available (stubbed by bench_routing)")

            stub.paged_stash_copy_kernel = _unavailable  # type: ignore[attr-defined]
            stub.paged_stash_pop_kernel = _unavailable  # type: ignore[attr-defined]
            sys.modules[name] = stub
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.transformer.moe import moe_utils
        import megatron.core as mc
    except Exception as exc:  # any import failure only disables the comparison
        return None, f"{type(exc).__name__}: {exc}"
    fns = {
        "route": moe_utils.topk_routing_with_score_function,
        "drop": moe_utils.apply_router_token_dropping,
    }
    return fns, f"megatron-core {getattr(mc, '__version__', '?')}"


def _megatron_path(
    fns: dict[str, Callable], logits: torch.Tensor, bias: torch.Tensor, capacity: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    probs_TE, map_TE = fns["route"](
        logits,
        K,
        num_groups=GROUPS,
        group_topk=GROUP_TOPK,
        score_function="sigmoid",
        expert_bias=bias,
    )
    if capacity is not None:
        probs_TE, map_TE = fns["drop"](
            probs_TE, map_TE, router_topk=K, capacity_factor=capacity, drop_policy="probs"
        )
    probs_TK, idx_TK = torch.topk(probs_TE, K, dim=-1)
    if capacity is not None:
        idx_TK = idx_TK.masked_fill(probs_TK == 0, -1)
    return idx_TK, probs_TK


def _ours(
    logits: torch.Tensor, bias: torch.Tensor, capacity: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    res = topk_routing(
        logits,
        topk=K,
        score_function="sigmoid",
        num_groups=GROUPS,
        group_topk=GROUP_TOPK,
        expert_bias=bias,
        capacity_factor=capacity,
        checks=False,
    )
    return res.topk_idx, res.topk_probs


def _agreement(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """(fraction of tokens with the same expert set, max |prob diff| after aligning slots)."""
    ia, order_a = a[0].sort(dim=-1)
    ib, order_b = b[0].sort(dim=-1)
    same = (ia == ib).all(dim=-1)
    pa = a[1].gather(1, order_a)
    pb = b[1].gather(1, order_b)
    diff = float((pa - pb)[same].abs().max()) if bool(same.any()) else float("nan")
    return float(same.float().mean()), diff


def _time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 3):
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    logits = torch.randn(T, E)
    bias = torch.randn(E) * 0.01
    megatron, reason = _import_megatron()
    cmd = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
    print(
        f"# topk_routing vs Megatron-Core, CPU, {args.threads} thread(s): T={T}, E={E}, k={K}, "
        f"{GROUPS} groups / {GROUP_TOPK} kept, sigmoid + expert bias, fp32 logits, forward"
    )
    if megatron is None:
        print(f"megatron-core is not importable ({reason}); timing flexdispatch only.")
        print(
            "Install it: .venv/bin/pip install numpy packaging && .venv/bin/pip install "
            "--ignore-requires-python --no-deps megatron-core==0.19.2"
        )
    else:
        print(f"reference: {reason}")
    print()
    rows = []
    for label, capacity in (("dropless", None), ("capacity_factor=1.0 (probs)", 1.0)):
        fns: dict[str, Callable[[], object]] = {
            "flexdispatch": lambda c=capacity: _ours(logits, bias, c)
        }
        agree = None
        if megatron is not None:
            fns["megatron"] = lambda c=capacity: _megatron_path(megatron, logits, bias, c)
            agree = _agreement(_ours(logits, bias, capacity), fns["megatron"]())
        med = _time_interleaved(fns, args.reps)
        rows.append((label, med, agree))

    if megatron is not None:
        print(
            "| case | flexdispatch (ms) | Megatron-Core + topk (ms) | speed-up | same expert sets "
            "| max abs prob diff |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for label, med, (same, diff) in rows:
            ratio = med["megatron"] / med["flexdispatch"]
            print(
                f"| {label} | {med['flexdispatch']:.2f} | {med['megatron']:.2f} | {ratio:.2f}x "
                f"| {same * 100:.2f}% | {diff:.1e} |"
            )
    else:
        print("| case | flexdispatch (ms) |")
        print("|---|---:|")
        for label, med, _ in rows:
            print(f"| {label} | {med['flexdispatch']:.2f} |")
    print()
    print(f"median of {args.reps} interleaved repetitions after 3 warm-ups")
    print(f"command: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
