"""Bytes and ops one dispatch + combine touches, worst-case against dropless (issue 26 item 4).

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · k top-k · R ranks · S rows
sent · W worst-case rows.

The GPU goal (worst-case <= 1.3x dropless at T=16,384, H=7,168) cannot be timed on a CPU; what
decides it is how many bytes each path moves through memory, counted here: a
``TorchDispatchMode`` sees every non-view ATen op of one forward ``dispatch`` + ``combine``
(after one warm-up call) and adds, per op, the bytes it writes (its outputs; for ``index_add_``
the rows it adds to) and reads (its tensor inputs; for ``index_select`` / ``index_add_`` only
the rows the index names, which is what a GPU kernel reads). Allocations, views and ``set_``
move no data and are not counted. ``--path cuda`` (the default) runs the CUDA branch of every
device-dependent choice on CPU, as ``tests/dist/test_lean_path.py`` does: the ops a GPU runs.
The torch backend in a world of one (no process group), as in the H200 measurement (E=256,
k=8, H=7,168 bf16, W = T * k), at a T that fits this machine (``--tokens``, default 2,048;
every figure is linear in T; ``--w-per-token 1`` for W = R * T, the size ``bench_gpu.py`` and
DeepEP use). The last column lists the ops that touch at least W rows (T for
dropless): the passes over the whole buffer. On the CUDA path the value checks run as the one
Triton launch CUDA makes when triton imports (``kernels.screen``), and the worst-case receive
side as its one launch (``kernels.inband.unpack_blocks``), interpreted here and counted by what
they read and write (``_kernel_bytes``); without triton, as torch ops.

Run: ``.venv/bin/python benchmarks/bench_worst_bytes.py [--tokens 2048] [--path cuda|cpu]
[--w-per-token 8]``
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

E, K, H = 256, 8, 7168


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Bytes(TorchDispatchMode):
    def __init__(self, big_rows: int) -> None:
        super().__init__()
        self.read = self.written = self.ops = 0
        self.big_rows = big_rows
        self.passes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.__name__.startswith(("set_", "empty")):
            return out  # NOTE: views, set_ and allocations move no data
        self.ops += 1
        name = func.__name__
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if name.startswith("index_select"):
            src, index = args[0], args[2]
            row = _nbytes(src) // max(1, src.shape[0])
            read = index.numel() * row + _nbytes(index)
        elif name.startswith("index_add"):
            src, index = args[3], args[2]
            row = _nbytes(src) // max(1, src.shape[0])
            read = _nbytes(src) + _nbytes(index) + index.numel() * row  # + the target rows
        else:
            read = sum(_nbytes(a) for a in ins if a.numel() and a.dim() > 0)
        written = sum(_nbytes(o) for o in outs)
        if name.startswith("index_add"):  # NOTE: in place: only the indexed rows change
            written = args[2].numel() * (_nbytes(args[3]) // max(1, args[3].shape[0]))
        self.read += read
        self.written += written
        rows = max((o.shape[0] for o in outs if o.dim() == 2 and o.shape[1] >= H), default=0)
        if name.startswith("index_add"):
            rows = args[3].shape[0]
        if rows >= self.big_rows:
            self.passes[name] += 1
        return out


_ACTIVE: list[_Bytes] = []  # the mode counting the current step (for the Triton launches)


def _kernel_bytes(name: str, args: tuple) -> None:
    """One Triton launch (``tests.cuda_path.force_triton_kernels``) as one op: what it reads and
    writes. The value screen reads the ids, the probs and all of ``x`` and writes the ids; the
    worst-case receive side (``unpack_blocks``) reads the real rows and writes all ``W``; the
    send slots (``capped_slots``) read the mask and write the send index; the in-band send rows
    (``pack_inband``) read the real rows and write every send row, padding included."""
    if not _ACTIVE:
        return
    m = _ACTIVE[-1]
    m.ops += 1
    if name == "screen_inputs":
        idx, probs, vals, out = args[:4]
        m.read += _nbytes(idx) + _nbytes(probs) + _nbytes(vals)
        m.written += _nbytes(out)
        if vals.shape[0] >= m.big_rows and vals.shape[1] >= H:
            m.passes["screen kernel (reads)"] += 1
    elif name == "capped_slots":  # reads the [T, R] mask, writes the [W] send index
        _, out, n, _, _, cap = args[:6]
        m.read += n * (out.numel() // cap)  # one byte per row and participant
        m.written += _nbytes(out)
    elif name == "pack_inband":  # reads the real rows, writes every send row
        words, key, _, index = args[:4]
        T = words.shape[0]
        real = int((index < T).sum())  # padding rows read nothing
        row = words.shape[1] * 4 if T else 0
        m.read += _nbytes(index) + real * (row + key.shape[1] * 12)
        m.written += index.numel() * (row + key.shape[1] * 8)  # padding rows too
    elif name == "unpack_blocks":
        rows, _, _, _, n_R, *outs = args[:11]
        real = int(n_R.sum())  # the rows it reads: the real ones (their bytes and metadata)
        k = outs[1].shape[1]
        m.read += _nbytes(n_R) + real * (rows.shape[1] * rows.element_size() + 8 * k)
        m.written += sum(_nbytes(o) for o in outs)  # every output row (the tail: zeros)
        if outs[0].shape[0] >= m.big_rows and outs[0].shape[1] * 4 >= 2 * H:
            m.passes["unpack kernel (writes)"] += 1
    else:
        raise NotImplementedError(f"bench_worst_bytes: no byte count for kernel {name}")


def _count(worst: bool, T: int, wf: int, R: int = 1, rank: int = 0) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).bfloat16()
    W = R * T * wf if worst else 0
    d = FlexDispatcher(
        DispatchConfig(backend="torch", checks=False, num_worst_tokens=W), num_experts=E
    )

    def step() -> None:
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)

    step()
    mode = _Bytes(big_rows=W if worst else T)
    _ACTIVE.append(mode)
    with mode:
        step()
    _ACTIVE.clear()
    return {
        "read": mode.read,
        "written": mode.written,
        "ops": mode.ops,
        "passes": dict(mode.passes),
        "rows": W if worst else T,
    }


def _setup(path: str) -> bool:
    """The code path to count (``--path``); True when the Triton kernels run (interpreted)."""
    if path == "cuda":  # NOTE: before triton is first imported (the screen kernel)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import flexdispatch.backends.torch.a2a  # noqa: F401  (loaded before the patch)

    if path != "cuda":
        return False
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/
    from tests.cuda_path import force_cuda_path, force_triton_kernels

    force_cuda_path()
    return force_triton_kernels(_kernel_bytes)


def _rank_count(path: str, T: int, wf: int) -> list[dict[str, Any]]:
    """``--ranks R``: both modes counted on this rank of a gloo group (every rank runs them)."""
    import torch.distributed as dist

    _setup(path)
    torch.set_num_threads(1)
    R, rank = dist.get_world_size(), dist.get_rank()
    return [_count(worst, T, wf, R, rank) for worst in (False, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--path", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--w-per-token",
        type=int,
        default=K,
        help="W = T x this (default k, as the H200 measurement; 1 = R x T in a world of one, "
        "what bench_gpu.py and DeepEP use)",
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="R > 1: R gloo ranks, each with T tokens, W = R x T x --w-per-token; rank 0's "
        "counts (default 1: a world of one, no process group)",
    )
    args = ap.parse_args()
    R = args.ranks
    results = None
    if R > 1:
        from flexdispatch.launch import spawn_group

        env = {"TRITON_INTERPRET": "1"} if args.path == "cuda" else {}
        got = spawn_group(
            _rank_count,
            R,
            args=(args.path, args.tokens, args.w_per_token),
            env=env,
            timeout_s=1800,
        )
        results = got[0]
        screened = args.path == "cuda"
    else:
        screened = _setup(args.path)
    torch.set_num_threads(1)
    T = args.tokens
    rows = T * H * 2
    screen = (
        " (Triton: the value screen, the worst-case receive side)"
        if args.path == "cuda" and screened
        else ""
    )
    world = "world of one" if R == 1 else f"{R} gloo ranks (rank 0's counts)"
    print(
        f"{args.path} code path{screen}, {world}, T={T}, H={H} bf16, E={E}, k={K}; one "
        f"pass over T rows = {rows / 2**20:.1f} MiB\n"
    )
    print(
        "| path | rows of the big buffers | ops | read MiB | written MiB | "
        "read + written, in T-row passes | ops over all of those rows |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for i, worst in enumerate((False, True)):
        r = results[i] if results is not None else _count(worst, T, args.w_per_token)
        rw = r["read"] + r["written"]
        passes = ", ".join(f"{v} {k}" for k, v in sorted(r["passes"].items()))
        print(
            f"| {f'worst-case (W = {args.w_per_token * R}T)' if worst else 'dropless'} | "
            f"{r['rows']} | "
            f"{r['ops']} | "
            f"{r['read'] / 2**20:.0f} | {r['written'] / 2**20:.0f} | {rw / rows:.1f} | "
            f"{passes} |"
        )
    print(f"\n(bytes of the [T, H] input itself: {math.prod((T, H)) * 2 / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
