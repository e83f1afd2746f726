"""Count the device operations the deepep adapter issues around DeepEP's own calls.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
W worst-case rows.

R = 2 gloo ranks, T=512, E=64, k=8, H=256 bf16 (the shape of the torch backend's op counts in
BENCHMARKS.md). The deepep backend runs through DeepEP's own Python layer (``deep_ep.Buffer`` of
the ``sgl-deep-ep`` wheel) over the emulated runtime of ``tests/deepep_emu`` — the same adapter
code that runs on GPUs. A ``TorchDispatchMode`` counts every non-view ATen op issued during one
``dispatch`` + ``combine`` (each one a kernel launch on a GPU), except those issued inside a
method of the emulated ``deep_ep._C.Buffer`` (they stand for DeepEP's fused kernels, which a GPU
runs as DeepEP's own launches). Dropless and worst-case (W = R * T); ``--checks`` also counts the
checks-on path. Target: at most 10 per dispatch + combine. The adapter's ops are the same on CUDA
except where noted in the output (statistics stay on the device there instead of being read on
the host, which adds no op).

The dispatcher's input value checks (expert ids in range, finite rows and probs; every backend)
are part of the count: on CPU they read the values (``--where`` names their lines in
``tensors.py``), on CUDA they are counted on the device instead (``--cuda-path`` runs that
code on CPU to count its ops).

``--api elastic`` counts the V2 path (``deep_ep.ElasticBuffer``; the emulated ``_C.ElasticBuffer``
methods stand for DeepEP's kernels) and its expanded layout (``dispatch_expanded`` + ``combine``).

Run: ``.venv/bin/python benchmarks/bench_deepep_ops.py [--api legacy|elastic] [--cuda-path]
[--checks] [--where]``
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T, E, K, H = 512, 64, 8, 256
_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "alias",
    "as_strided",
    "slice",
    "select",
    "t",
    "transpose",
    "expand",
    "unsqueeze",
    "squeeze",
    "permute",
    "detach",
    "split",
    "unbind",
    "narrow",
    "reshape",
    "view_as",
    "_reshape_alias",
    "lift_fresh",
}


class _Count(TorchDispatchMode):
    def __init__(self, skip: list[int]) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str, str]] = Counter()
        self.skip = skip

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self.skip[0] and name not in _VIEW_OPS:
            import traceback

            # the innermost flexdispatch line that issued it
            frames = [f for f in traceback.extract_stack() if "/flexdispatch/" in f.filename]
            where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}" if frames else "?"
            checks = where.startswith("_validate.py") or where.startswith("dispatcher.py")
            self.ops[("value checks" if checks else "adapter", name, where)] += 1
        return func(*args, **(kwargs or {}))


def _wrap_runtime(runtime_cls: type, skip: list[int]) -> None:
    """Mark every public method of the emulated ``_C.Buffer`` as DeepEP's own."""
    for name in dir(runtime_cls):
        if name.startswith("_"):
            continue
        fn = getattr(runtime_cls, name)
        if not callable(fn):
            continue

        def wrapped(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
            skip[0] += 1
            try:
                return _fn(*a, **kw)
            finally:
                skip[0] -= 1

        functools.update_wrapper(wrapped, fn)
        setattr(runtime_cls, name, wrapped)


def _worker(
    rank: int,
    R: int,
    port: int,
    checks: bool,
    where: bool,
    cuda_path: bool,
    api: str,
    queue: Any,
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=R)
    torch.set_num_threads(1)
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.load import load_deep_ep
    from tests.deepep_emu.runtime.elastic import ElasticRuntime
    from tests.deepep_emu.runtime.normal import Runtime

    if cuda_path:
        # the dispatcher's value checks as they run on CUDA: counted on the device, no host read
        from flexdispatch._checks import tensors

        tensors.defer_value_checks = lambda device: True
    skip = [0]
    _wrap_runtime(Runtime, skip)
    _wrap_runtime(ElasticRuntime, skip)
    deep_ep = load_deep_ep()
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out: dict[str, dict[str, int]] = {}
    modes: list[tuple[str, int, bool]] = [("dropless", 0, False), ("worst-case", R * T, False)]
    if api == "elastic":
        modes += [("dropless, expanded", 0, True), ("worst-case, expanded", R * T, True)]
    for mode, W, expanded in modes:
        cfg = DispatchConfig(
            backend="deepep",
            deepep_api=api,
            ranks_per_node=R,
            num_worst_tokens=W,
            checks=checks,
            num_max_dispatch_tokens_per_rank=T,
        )
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=deep_ep)
        for step in range(2):  # the first call sizes the shared buffer
            counter = _Count(skip)
            with counter:
                if expanded:
                    rx = d.dispatch_expanded(x, idx, probs)
                    d.combine(rx.recv_x, rx.handle)
                else:
                    res = d.dispatch(x, idx, probs)
                    d.combine(res.recv_x, res.handle)
            if step == 1:
                out[mode] = {"|".join(key): n for key, n in counter.ops.items()}
        d.close()
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checks", action="store_true", help="count the checks-on path too")
    ap.add_argument("--where", action="store_true", help="name the source line of each op")
    ap.add_argument(
        "--cuda-path",
        action="store_true",
        help="run the dispatcher's value checks the CUDA way (counted on the device)",
    )
    ap.add_argument(
        "--api",
        choices=("legacy", "elastic"),
        default="legacy",
        help="DispatchConfig.deepep_api: V1 Buffer (default) or V2 ElasticBuffer (also counts "
        "dispatch_expanded + combine)",
    )
    args = ap.parse_args()
    R = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, R, port, args.checks, args.where, args.cuda_path, args.api, queue),
        )
        for r in range(R)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    print(
        f"deepep ({args.api}) ops per dispatch + combine, R={R} T={T} E={E} k={K} H={H} bf16, "
        f"rank 0"
    )
    checks = "on" if args.checks else "off"
    values = "CUDA path (on the device)" if args.cuda_path else "CPU path (read on the host)"
    print(f"checks={checks}; dispatcher value checks: {values}")
    print("| mode | adapter around DeepEP | dispatcher value checks | total | adapter ops |")
    print("|---|---:|---:|---:|---|")
    for mode, ops in results[0].items():
        part: Counter[str] = Counter()
        names: Counter[str] = Counter()
        for key, n in ops.items():
            kind, name, where = key.split("|")
            part[kind] += n
            if kind == "adapter":
                names[f"{name}@{where}" if args.where else name] += n
        detail = ", ".join(f"{n} {c}" for n, c in names.most_common()) or "none"
        total = part["adapter"] + part["value checks"]
        print(f"| {mode} | {part['adapter']} | {part['value checks']} | {total} | {detail} |")


if __name__ == "__main__":
    main()
