"""Measure the peak resident memory one call adds, for ``test_estimates.py``.

``python -m tests.hostile.peak_probe CASES_JSON`` runs every case in this process (a world of one
rank) and prints one JSON line per case with its ``peak``: the growth of the resident set from
just before the call to its high-water mark (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` before each call, so what the imports and earlier cases took does not
count). ``measure_rank`` does the same on every rank of a process group.

Every allocation of 64 KiB or more is served by its own ``mmap`` (``mallopt``), so a freed
tensor leaves the resident set at once and the high-water mark is the most the call held at once,
never less (glibc would otherwise reuse freed heap blocks of up to 32 MiB).

A case is a dict: ``kind`` (``dispatch``, ``layer``, ``bench``, or ``gather``: the object
exchange of ``flexdispatch.launch``, ``T`` bytes per rank), ``T``, ``H``, ``k``, ``E``, ``W``,
``dtype`` (``fp32`` or ``bf16``), ``grad``, ``L`` (ranks per node of a hierarchical dispatch; 0
or absent: flat); a layer case also has ``F``.

The warm-ups below load kernels and lazy state through a dispatcher or layer of their own; the
tables a first dispatch builds and keeps (``flexdispatch._pool.cached``: the expert id tables)
are dropped after them, so the measured call builds its own, as a first dispatch does.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import torch

_M_MMAP_THRESHOLD = -3  # <malloc.h>
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # NOTE: resets VmHWM to the current resident size


def _ids(T: int, k: int, E: int, seed: int) -> torch.Tensor:
    """``[T, k]`` distinct experts per token, spread over all E."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, E, (T, 1), generator=g)
    step = torch.randint(1, max(2, E // k), (T, 1), generator=g)
    return (first + step * torch.arange(k)).remainder(E)


def _run(case: dict[str, Any], rank: int) -> int:
    import flexdispatch as fd
    from flexdispatch import _pool
    from flexdispatch._pool import OUTPUT_POOL

    T, H, k, E, W = case["T"], case["H"], case["k"], case["E"], case["W"]
    if case["kind"] == "bench":
        return _bench(case)
    if case["kind"] == "gather":
        return _gather(case)
    dtype, grad = _DTYPES[case["dtype"]], case["grad"]
    L = case.get("L", 0)
    hier = {"hierarchical": True, "ranks_per_node": L} if L else {}
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(dtype)
    if case["kind"] == "layer":
        cfg = fd.MoEConfig(
            hidden_size=H,
            ffn_hidden_size=case["F"],
            router=fd.RouterConfig(num_experts=E, topk=k),
            dispatch=fd.DispatchConfig(backend="torch", num_worst_tokens=W, **hier),
        )
        # NOTE: a full-size step of another layer first: oneDNN's one-time caches of the process
        # (about 40 MB for a first bf16 step with its backward, whatever its size) are runtime,
        # not this call's; the measured layer's own state is still made in the measured call
        warm = fd.MoELayer(cfg, dtype=dtype)
        with torch.set_grad_enabled(grad):
            out = warm(x.clone().requires_grad_(grad)).output
            if grad:
                out.float().sum().backward()
        del warm, out
        _pool._CACHED.clear()
        layer = fd.MoELayer(cfg, dtype=dtype)

        def call() -> None:
            with torch.set_grad_enabled(grad):
                out = layer(x.requires_grad_(grad)).output
                if grad:
                    out.float().sum().backward()

    else:
        idx, probs = _ids(T, k, E, rank), torch.rand(T, k)
        # NOTE: kernels and lazy state loaded by a small dispatcher of its own: the measured one
        # allocates its scratch buffers (kept for the next calls) in the measured call
        warm = fd.FlexDispatcher(
            fd.DispatchConfig(backend="torch", num_worst_tokens=min(W, 64), **hier), num_experts=E
        )
        res = warm.dispatch(x[:4], idx[:4], probs[:4])
        warm.combine(res.recv_x, res.handle)
        del res, warm
        _pool._CACHED.clear()
        d = fd.FlexDispatcher(
            fd.DispatchConfig(backend="torch", num_worst_tokens=W, **hier), num_experts=E
        )

        def call() -> None:
            res = d.dispatch(x.requires_grad_(grad), idx, probs)
            y = d.combine(res.recv_x, res.handle)
            if grad:
                y.float().sum().backward()

    OUTPUT_POOL.release()
    _reset_peak()
    base = _status("VmRSS")
    call()
    peak = _status("VmHWM") - base
    OUTPUT_POOL.release()
    return peak


def _bench(case: dict[str, Any]) -> int:
    """``flexdispatch bench``'s rank body on this process's group (every stage, one rep)."""
    import torch.distributed as dist

    from flexdispatch._pool import OUTPUT_POOL
    from flexdispatch.bench import BenchSpec, bench_rank

    spec = BenchSpec(
        tokens=case["T"],
        hidden=case["H"],
        experts=case["E"],
        topk=case["k"],
        dtype=case["dtype"],
        world_size=dist.get_world_size(),
        worst_case=case["W"] > 0,
        reps=1,
        warmup=0,
        backend="torch",
    )
    small = BenchSpec(**{**spec.__dict__, "tokens": 4})
    bench_rank(small)  # NOTE: kernels and lazy state loaded
    OUTPUT_POOL.release()
    _reset_peak()
    base = _status("VmRSS")
    bench_rank(spec)
    peak = _status("VmHWM") - base
    OUTPUT_POOL.release()
    return peak


def _gather(case: dict[str, Any]) -> int:
    """``flexdispatch.launch.gather_objects`` of a ``T``-byte tensor from every rank."""
    from flexdispatch.launch import gather_objects

    gather_objects(torch.zeros(4, dtype=torch.uint8))  # NOTE: lazy state loaded
    payload = torch.ones(case["T"], dtype=torch.uint8)
    _reset_peak()
    base = _status("VmRSS")
    got = gather_objects(payload)
    peak = _status("VmHWM") - base
    del got
    return peak


def _mmap_everything() -> None:
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 16)


def measure_rank(cases: list[dict[str, Any]]) -> list[int]:
    """Every case's peak on this rank of the process group (a barrier before each)."""
    import torch.distributed as dist

    _mmap_everything()
    torch.set_num_threads(1)
    out = []
    for case in cases:
        dist.barrier()
        out.append(_run(case, dist.get_rank()))
    return out


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    _mmap_everything()
    torch.set_num_threads(1)
    cases = json.loads(argv[0])
    if any(c["kind"] == "bench" for c in cases):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for case in cases:
        print(json.dumps({**case, "peak": _run(case, 0)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
