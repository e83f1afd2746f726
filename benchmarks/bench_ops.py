"""Count the device operations of one call: non-view ATen ops seen by a ``TorchDispatchMode``.

Every non-view ATen op of the hot path is a kernel launch on a GPU (a few µs of CPU each, on the
critical path in eager training and decode), so their number per call is the figure to keep low.
Counted: every op the mode sees whose schema is not a view (``OpOverload.is_view``), including
allocations (``empty``), host reads (``_local_scalar_dense``) and the collectives
(``c10d.*``); views, reshapes and slicing are free and not counted. Ops that a kernel calls
internally (below the Python dispatch key) are not seen.

Shapes (issue 13): 2 gloo ranks, T=512, E=64, top-8 (uniform random, distinct experts per
token), H=256 bf16, fp32 probs. One warm-up call, then one counted call (rank 0's count; both
ranks run the same code).

Rows:

- ``dispatch + combine``: ``FlexDispatcher.dispatch`` then ``combine`` (forward only), torch
  backend, flat, dropless and worst-case (``W = R*T``); hierarchical with ``LOCAL_WORLD_SIZE=1``
  (2 nodes of one rank) as well.
- ``long rows``: flat, 2 ranks, at the world-of-one rows' shape: rows of 14 KiB (until issue 46
  past the in-band limit of 2 KiB; since then packed with their metadata like short rows, the
  decision taken on the call's bytes: ``backends/torch/plan.py``).
- ``world of one``: dropless and worst-case (``W = T``) on a gloo group of one rank, as
  ``bench_gpu.py``'s NCCL group of one, at its host-time shape (T=128, H=7,168, E=256, k=8).
- ``permute + unpermute``: ``permute(x, idx, E, topk_probs=p)`` then
  ``unpermute(perm.x, perm, probs=perm.probs)`` (exact size, one process).

Code paths: ``cpu`` is what runs on CPU. ``cuda (forced)`` runs the CUDA branch of every
device-dependent choice on CPU: ``flexdispatch._checks.tensors.cuda_code_path`` and
``defer_value_checks`` are forced to True (no CPU memory reuse, synchronous collectives,
``scatter_add_`` instead of ``bincount``; since issue 46 no value check with checks off on any
device), and the Triton kernels CUDA runs when triton imports (the in-band send rows and the
receive side, ``kernels.inband``) run interpreted: the interpreter's own ATen calls are not counted,
each launch counts as one op (without triton, the torch ops). The one CUDA-only
piece that cannot run on CPU is the dropless count copy into pinned host memory on a side stream
(``torch_hops.PendingCounts``): ``copy_`` into the backend's pinned buffer (allocated by the first
call only, with ``empty(pin_memory=True)``) = 1 op, added by hand to
the dropless rows of that column (streams and events are not ATen ops).

Run:  PYTHONPATH=. .venv/bin/python benchmarks/bench_ops.py [--by-op [--where]] [--rows flat]

``--where`` splits each op by the flexdispatch source line that issued it (slow: it walks the
stack on every op); ``--rows TEXT`` keeps the rows whose label contains TEXT.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

T, E, K, H = 512, 64, 8, 256
PINNED_COPY_OPS = 1  # CUDA dropless only: copy_(non_blocking=True) into the kept pinned buffer


class OpCounter(TorchDispatchMode):
    """Counts non-view ATen ops by name (with ``where``: by name and issuing flexdispatch line)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            name = str(func)
            if self.where:
                frames = [f for f in traceback.extract_stack() if "/flexdispatch/" in f.filename]
                last = frames[-1] if frames else None
                name += f" @ {last.filename.split('/')[-1]}:{last.lineno}" if last else " @ ?"
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


ONE = {
    "T": 128,
    "E": 256,
    "K": 8,
    "H": 7168,
}  # the world-of-one rows: bench_gpu.py's host-time shape


def _inputs(
    seed: int, T: int = T, E: int = E, K: int = K, H: int = H
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, generator=g)
    return x, idx, probs


_LAUNCHES = [0]  # Triton launches of the forced CUDA branch (``force_triton_kernels``)


def _dispatch_ops(
    worst: bool, hierarchical: bool, cuda: bool, where: bool, long_rows: bool = False
) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.cuda_path import force_cuda_path, force_triton_kernels

    if cuda:
        force_cuda_path()
        force_triton_kernels(lambda name, args: _LAUNCHES.__setitem__(0, _LAUNCHES[0] + 1))
    R = dist.get_world_size()
    shape = ONE if R == 1 or long_rows else {"T": T, "E": E, "K": K, "H": H}
    x, idx, probs = _inputs(dist.get_rank(), **shape)
    cfg = DispatchConfig(
        backend="torch",
        num_worst_tokens=R * shape["T"] if worst else 0,
        hierarchical=hierarchical,
    )
    d = FlexDispatcher(cfg, num_experts=shape["E"])
    res = d.dispatch(x, idx, probs)
    d.combine(res.recv_x, res.handle)
    before = _LAUNCHES[0]
    with OpCounter(where) as cd:
        res = d.dispatch(x, idx, probs)
    if _LAUNCHES[0] > before:
        cd.ops["triton kernels"] += _LAUNCHES[0] - before
    with OpCounter(where) as cc:
        d.combine(res.recv_x, res.handle)
    return {"dispatch": dict(cd.ops), "combine": dict(cc.ops)}


def _permute_ops(cuda: bool, where: bool) -> dict[str, Any]:
    from flexdispatch import permute, unpermute
    from tests.cuda_path import force_cuda_path

    if cuda:
        force_cuda_path()
    x, idx, probs = _inputs(0)

    def run() -> None:
        perm = permute(x, idx, E, topk_probs=probs)
        unpermute(perm.x, perm, probs=perm.probs)

    run()
    with OpCounter(where) as c:
        run()
    return {"permute+unpermute": dict(c.ops)}


def _rank0(
    worst: bool, hierarchical: bool, cuda: bool, where: bool, ranks: int = 2, long: bool = False
) -> dict[str, Any]:
    from flexdispatch.launch import spawn_group

    env = {"LOCAL_WORLD_SIZE": "1"} if hierarchical else {}
    if cuda:
        env["TRITON_INTERPRET"] = "1"  # the screen kernel, interpreted: before triton's import
    return spawn_group(
        _dispatch_ops,
        ranks,
        args=(worst, hierarchical, cuda, where, long),
        ranks_per_node=1 if hierarchical else ranks,
        env=env,
        timeout_s=300,
    )[0]


def _permute_in_child(cuda: bool, where: bool) -> dict[str, Any]:
    from flexdispatch.launch import spawn_group

    return spawn_group(_permute_ops, 1, args=(cuda, where), timeout_s=300)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--by-op", action="store_true", help="also list the ops of each row")
    parser.add_argument(
        "--where", action="store_true", help="with --by-op: name the flexdispatch line of each op"
    )
    parser.add_argument(
        "--rows", default="", help="only the rows whose label contains this text (e.g. flat)"
    )
    args = parser.parse_args(argv)
    rows: list[tuple[str, dict[str, dict[str, int]]]] = []
    w = args.where
    one = "T={T} H={H} E={E} k={K}".format(**ONE)
    for label, worst, hier, R, long in (
        ("torch flat dropless", False, False, 2, False),
        ("torch flat worst-case (W=R*T)", True, False, 2, False),
        ("torch hierarchical dropless", False, True, 2, False),
        ("torch hierarchical worst-case", True, True, 2, False),
        (f"torch flat, long rows ({one}) dropless", False, False, 2, True),
        (f"torch flat, long rows ({one}) worst-case (W=R*T)", True, False, 2, True),
        (f"torch world of one ({one}) dropless", False, False, 1, False),
        (f"torch world of one ({one}) worst-case (W=T)", True, False, 1, False),
    ):
        if args.rows not in label:
            continue
        per = {path: _rank0(worst, hier, path == "cuda", w, R, long) for path in ("cpu", "cuda")}
        rows.append((label, per))
    per_p = {"cpu": _permute_in_child(False, w), "cuda": _permute_in_child(True, w)}

    print(
        f"T={T} E={E} k={K} H={H} bf16, 2 gloo ranks (world of one: one gloo rank, the shape "
        f"named), torch {torch.__version__}"
    )
    print("non-view ATen ops per call (rank 0)")
    print()
    print(
        "| call | mode | cpu: dispatch | cpu: combine | cpu: total | cuda (forced): dispatch "
        "| cuda: combine | cuda: total |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, per in rows:
        cells = []
        for path in ("cpu", "cuda"):
            dsp = sum(per[path]["dispatch"].values())
            cmb = sum(per[path]["combine"].values())
            extra = PINNED_COPY_OPS if path == "cuda" and "dropless" in label else 0
            cells += [f"{dsp + extra}", f"{cmb}", f"**{dsp + cmb + extra}**"]
        print(f"| dispatch + combine | {label} | " + " | ".join(cells) + " |")
    pc = sum(per_p["cpu"]["permute+unpermute"].values())
    pg = sum(per_p["cuda"]["permute+unpermute"].values())
    print(f"| permute + unpermute | exact, with probs | | | **{pc}** | | | **{pg}** |")
    if "dropless" in " ".join(r[0] for r in rows):
        print()
        print(
            f"cuda (forced) dropless rows include {PINNED_COPY_OPS} ops added by hand for the "
            "pinned count copy (see the docstring)."
        )
    if args.by_op:
        for label, per in rows:
            for path in ("cpu", "cuda"):
                for what in ("dispatch", "combine"):
                    ops = per[path][what]
                    print(f"\n{label} / {path} / {what}: {sum(ops.values())}")
                    for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])):
                        print(f"  {n:3d}  {op}")
        for path in ("cpu", "cuda"):
            ops = per_p[path]["permute+unpermute"]
            print(f"\npermute + unpermute / {path}: {sum(ops.values())}")
            for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"  {n:3d}  {op}")
    print()
    cmd = " ".join(["python", "benchmarks/bench_ops.py", *(argv or sys.argv[1:])])
    print(f"command: {cmd}")


if __name__ == "__main__":
    main()
