"""Decode cost of one dispatch + combine through the DeepEP backends (issue 46, item H), counted
per origin: what flexdispatch's own frames spend, apart from DeepEP's Python layer and from the
emulated runtime that stands in for DeepEP's C++/CUDA here.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
W worst-case rows (``num_worst_tokens``, here ``R * T``).

DeepEP cannot run on this machine: its own Python layer (``deep_ep`` 2.1.0 for V1 ``Buffer`` and
V2 ``ElasticBuffer``, ``deep_ep_v25`` for V2.5 ``EPBuffer``) runs over ``tests/deepep_emu``'s
emulated runtime (``FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)``), R = 2 gloo ranks on
127.0.0.1 (``flexdispatch.launch.spawn_group``, one torch thread each), one NVLink domain
(intranode), ``checks=False``, ``FLEXDISPATCH_CHECKS`` unset, ``torch.no_grad()``. Inputs are
``benchmarks/bench_decode.py``'s (``case_inputs``). The emulator's kernels, ops and collectives
are not DeepEP's and say nothing of its speed: nothing here is timed.

By default each case also runs on the CUDA code path forced on CPU (``--branch cuda``, what a GPU
runs: ``bench_decode.force_cuda_path``); ``--branch cpu`` is the CPU branch only, ``both`` both.

What one dispatch + combine is counted for (after ``WARMUP_CALLS`` calls; two counted calls must
agree, ``stable``), with ``bench_decode``'s hooks, each event attributed to an **owner**: the
innermost frame on the stack that belongs to flexdispatch (``fd``), DeepEP's Python layer
(``deepep``: the ``deep_ep`` / ``deep_ep_v25`` packages) or the emulator (``emu``:
``tests/deepep_emu``); torch and standard-library frames are skipped over when looking for it:

- **ops** (``TorchDispatchMode``): collectives (``c10d.*``), compute ops (non-view ATen ops),
  host reads (``bench_decode.HOST_READ_OPS`` plus ``Tensor.tolist`` / ``numpy`` calls), per
  owner. Only the ``fd`` ones are flexdispatch's; the ``emu`` ones stand in for DeepEP's kernels.
- **Python calls** (``sys.setprofile`` ``'call'`` events): per origin of the called frame itself
  (``fd`` split into the deepep backends ``fd.deepep`` and the rest ``fd.other``: the front end,
  checks, types; ``deepep``; ``emu``; ``torch``; ``torch.distributed``; ``stdlib``; ``generated``:
  e.g. a dataclass's ``__init__``) and, for the frames of no owner (torch, stdlib, generated),
  by the owner that called them (``under.fd`` ...). ``fd_calls`` = flexdispatch's own frames,
  ``fd_reach`` = those plus the torch / stdlib / generated calls made directly under them: both
  are what flexdispatch can remove.

Run:  .venv/bin/python benchmarks/bench_decode_deepep.py [--backend deepep-v1,deepep-v2,deepep-v25]
      [--H 64,7168] [--mode worst,dropless] [--branch cuda|cpu|both] [--breakdown] [--json F]

``rank_counts(api, T, H, E, k, mode)`` counts one case inside the ranks of a running 2-rank group
(a test's ``run_group`` worker).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
if str(_ROOT) not in sys.path:  # NOTE: tests.deepep_emu (the emulated runtime) in the ranks
    sys.path.insert(0, str(_ROOT))


def _load_bench_decode() -> Any:
    """``benchmarks/bench_decode.py`` (benchmarks/ is not a package), imported once by path."""
    mod = sys.modules.get("fd_bench_decode")
    if mod is None:
        spec = importlib.util.spec_from_file_location("fd_bench_decode", _HERE / "bench_decode.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fd_bench_decode"] = mod
        spec.loader.exec_module(mod)
    return mod


bd = _load_bench_decode()

R = 2
APIS = ("v1", "v2", "v25")
SHAPES = ((64, 8, 2), (7168, 256, 8))  # (H, E, k)
MODES = ("worst", "dropless")
WARMUP_CALLS = 3
OWNERS = ("fd", "deepep", "emu")
_SKIP_FILES = {os.path.abspath(__file__), bd._THIS_FILE}


def _fd_root() -> str:
    import flexdispatch

    return os.path.realpath(os.path.dirname(flexdispatch.__file__)) + os.sep


_FD = _fd_root()
_FD_DEEPEP = _FD + os.path.join("backends", "deepep") + os.sep
_EMU = os.path.realpath(_ROOT / "tests" / "deepep_emu") + os.sep

_KIND: dict[str, str] = {}


def kind_of(filename: str) -> str:
    """``fd.deepep`` / ``fd.other`` / ``deepep`` / ``emu`` / ``bench`` (owners) or ``torch`` /
    ``torch.distributed`` / ``stdlib`` / ``generated`` / ``other`` (no owner)."""
    got = _KIND.get(filename)
    if got is not None:
        return got
    if filename in _SKIP_FILES:
        got = "bench"
    elif filename.startswith("<"):
        got = "stdlib" if filename.startswith("<frozen") else "generated"
    else:
        path = os.path.realpath(filename)
        if path.startswith(_FD_DEEPEP):
            got = "fd.deepep"
        elif path.startswith(_FD):
            got = "fd.other"
        elif path.startswith(_EMU):
            got = "emu"
        elif "/deep_ep/" in path or "/deep_ep_v25/" in path:
            got = "deepep"
        else:
            got = bd._origin(filename)
            got = got if got in ("torch", "torch.distributed", "stdlib") else "other"
    _KIND[filename] = got
    return got


def _owner(kind: str) -> str | None:
    if kind.startswith("fd."):
        return "fd"
    return kind if kind in ("deepep", "emu", "bench") else None


def owner_of_stack(depth: int = 2, limit: int = 200) -> str:
    """The owner of the innermost owned frame of the current stack (``bench`` if none)."""
    f = sys._getframe(depth)
    for _ in range(limit):
        if f is None:
            break
        o = _owner(kind_of(f.f_code.co_filename))
        if o is not None:
            return o
        f = f.f_back
    return "bench"


class OwnedOps(bd.OpCounter):
    """``bench_decode.OpCounter`` whose collectives, compute ops and host reads are also counted
    per owner (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_owner: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.fd_ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        owner = owner_of_stack()
        if func.namespace == "c10d":
            self.by_owner[owner]["collectives"] += 1
        elif func.is_view or torch.Tag.inplace_view in func.tags:
            self.by_owner[owner]["views"] += 1
        else:
            self.by_owner[owner]["compute"] += 1
            if owner == "fd":
                self.fd_ops[name] += 1
            if name in bd.HOST_READ_OPS or (
                name == "aten.repeat_interleave.Tensor"
                and (kwargs or {}).get("output_size") is None
            ):
                self.by_owner[owner]["host_reads"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class OwnedCalls:
    """``sys.setprofile`` counter of Python calls by the called frame's kind and, for frames of
    no owner, by the owner that called them; per flexdispatch function too."""

    def __init__(self) -> None:
        self.kinds: collections.Counter[str] = collections.Counter()
        self.under: collections.Counter[str] = collections.Counter()
        self.fd_funcs: collections.Counter[str] = collections.Counter()
        self.fd_reach_funcs: collections.Counter[str] = collections.Counter()
        self._stack: list[tuple[str, str]] = []  # (owner of the frame, its fd function name)

    def _profile(self, frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            kind = kind_of(code.co_filename)
            if kind == "bench":
                return
            owner = _owner(kind)
            parent, parent_fn = self._stack[-1] if self._stack else ("bench", "")
            self.kinds[kind] += 1
            label = f"{bd._short(code.co_filename)}:{code.co_name}"
            if owner is None:
                self.under[parent] += 1
                if parent == "fd":
                    self.fd_reach_funcs[f"{parent_fn} -> {label}"] += 1
                self._stack.append((parent, parent_fn))
            else:
                if owner == "fd":
                    self.fd_funcs[label] += 1
                self._stack.append((owner, label))
        elif event == "return" and self._stack and kind_of(frame.f_code.co_filename) != "bench":
            self._stack.pop()

    def run(self, fn: Callable[[], Any]) -> Any:
        sys.setprofile(self._profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)


def count_call(fn: Callable[[], Any], *, collect: bool = True) -> dict[str, Any]:
    """The owned counts of one run of ``fn`` (two passes, as ``bench_decode.count_call``)."""
    if collect:
        gc.collect()
    gc.disable()
    try:
        reads: collections.Counter[str] = collections.Counter()
        mode = OwnedOps()
        with OwnedMethodReads(reads), mode:
            fn()
        if collect:
            gc.collect()
        prof = OwnedCalls()
        prof.run(fn)
    finally:
        gc.enable()
    out: dict[str, Any] = {}
    for o in (*OWNERS, "bench"):
        c = mode.by_owner.get(o, collections.Counter())
        out[f"{o}_collectives"] = c["collectives"]
        out[f"{o}_ops"] = c["compute"]
        out[f"{o}_views"] = c["views"]
        out[f"{o}_host_reads"] = c["host_reads"] + reads[o]
    fd_calls = prof.kinds["fd.deepep"] + prof.kinds["fd.other"]
    out.update(
        fd_calls=fd_calls,
        fd_deepep_calls=prof.kinds["fd.deepep"],
        fd_other_calls=prof.kinds["fd.other"],
        fd_reach=fd_calls + prof.under["fd"],
        deepep_calls=prof.kinds["deepep"],
        emu_calls=prof.kinds["emu"],
        python_calls=sum(prof.kinds.values()),
        calls_by_kind=dict(prof.kinds.most_common()),
        calls_under_owner=dict(prof.under.most_common()),
        fd_funcs=prof.fd_funcs.most_common(),
        fd_reach_funcs=prof.fd_reach_funcs.most_common(),
        fd_ops_by_name=dict(mode.fd_ops.most_common()),
        host_read_methods=dict(reads),
    )
    return out


class OwnedMethodReads:
    """``Tensor.tolist`` / ``Tensor.numpy`` calls while the block runs, counted per owner."""

    def __init__(self, counter: collections.Counter[str]) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.saved = {n: torch.Tensor.__dict__.get(n) for n in ("tolist", "numpy")}
        base = {n: getattr(torch.Tensor, n) for n in self.saved}
        counter = self.counter

        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
                counter[owner_of_stack()] += 1
                return orig(self, *a, **kw)

            return wrapper

        for n in self.saved:
            setattr(torch.Tensor, n, make(base[n]))

    def __exit__(self, *exc: Any) -> None:
        for n, value in self.saved.items():
            if value is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, value)


# --------------------------------------------------------------------------- the ranks


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    api: str
    T: int
    H: int
    E: int
    k: int
    mode: str
    cuda_path: bool = True

    @property
    def label(self) -> str:
        return (
            f"deepep-{self.api} T={self.T} H={self.H} E={self.E} k={self.k} {self.mode} "
            f"{'cuda-path' if self.cuda_path else 'cpu-path'}"
        )


def emulator(api: str) -> Any:
    """DeepEP's Python layer over the emulated runtime, one NVLink domain of 8 (intranode)."""
    from tests.deepep_emu.load import load_deep_ep

    return load_deep_ep(nvl_peers=8, release="2.5.0" if api == "v25" else "2.1.0")


def one_case(case: Case, *, collect: bool = True) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    rank = dist.get_rank()
    bcase = bd.Case(T=case.T, H=case.H, E=case.E, k=case.k, mode=case.mode)
    x, idx, probs = bd.case_inputs(bcase, rank)
    W = R * case.T if case.mode == "worst" else 0
    cfg = DispatchConfig(
        backend="deepep",
        deepep_api=case.api,
        checks=False,
        num_worst_tokens=W,
        ranks_per_node=R,
    )
    d = FlexDispatcher(cfg, num_experts=case.E, _deep_ep=emulator(case.api))

    def step() -> None:
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)

    rec: dict[str, Any] = {"rank": rank, "backend": type(d.backend).__name__}
    with torch.no_grad():
        for _ in range(WARMUP_CALLS):
            step()
        counts = [count_call(step, collect=collect) for _ in range(2)]
    keys = [k for k, v in counts[0].items() if isinstance(v, int)]
    rec["stable"] = all(counts[0][k] == counts[1][k] for k in keys)
    if not rec["stable"]:
        rec["second_call"] = {k: counts[1][k] for k in keys}
    rec.update(counts[0])
    d.close()
    return rec


def rank_counts(api: str, T: int, H: int, E: int, k: int, mode: str) -> dict[str, Any]:
    """Inside a rank of a running 2-rank gloo group: one case's integer counts (the branch the
    loaded modules take: call ``bench_decode.force_cuda_path()`` first for the CUDA one)."""
    if dist.get_world_size() != R:
        raise ValueError(f"rank_counts needs a group of {R} ranks, got {dist.get_world_size()}")
    os.environ.pop("FLEXDISPATCH_CHECKS", None)
    rec = one_case(Case(api=api, T=T, H=H, E=E, k=k, mode=mode), collect=False)
    return {key: v for key, v in rec.items() if isinstance(v, (int, bool))}


def _rank_body(cases: list[Case]) -> list[dict[str, Any]]:
    """Every case on every spawned rank, the CPU branch first (the forced CUDA branch cannot be
    undone)."""
    os.environ.pop("FLEXDISPATCH_CHECKS", None)
    out: dict[int, dict[str, Any]] = {}
    for i, c in enumerate(cases):
        if not c.cuda_path:
            out[i] = one_case(c)
    if any(c.cuda_path for c in cases):
        bd.force_cuda_path()
        for i, c in enumerate(cases):
            if c.cuda_path:
                out[i] = one_case(c)
    return [out[i] for i in range(len(cases))]


def run_cases(cases: list[Case], *, timeout_s: float = 900.0) -> list[dict[str, Any]]:
    from flexdispatch.launch import spawn_group

    env = {"FLEXDISPATCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    got = spawn_group(_rank_body, R, args=(cases,), timeout_s=timeout_s, env=env)
    return [
        {"case": dataclasses.asdict(c), "label": c.label, "ranks": [got[r][i] for r in range(R)]}
        for i, c in enumerate(cases)
    ]


# --------------------------------------------------------------------------- command line

COLUMNS = (
    ("fd Py", "fd_calls"),
    ("fd reach", "fd_reach"),
    ("fd ops", "fd_ops"),
    ("fd reads", "fd_host_reads"),
    ("fd coll", "fd_collectives"),
    ("DeepEP Py", "deepep_calls"),
    ("DeepEP ops", "deepep_ops"),
    ("emu Py", "emu_calls"),
    ("emu ops", "emu_ops"),
    ("emu coll", "emu_collectives"),
    ("all Py", "python_calls"),
)


def print_table(records: list[dict[str, Any]], rank: int = 0) -> None:
    print(f"rank {rank}, per dispatch + combine\n")
    print("| case | " + " | ".join(h for h, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for rec in records:
        r = rec["ranks"][rank]
        flag = "" if r["stable"] else " (unstable)"
        other = rec["ranks"][1 - rank]
        diff = [h for h, k in COLUMNS if other[k] != r[k]]
        note = f" [rank {1 - rank} differs: {', '.join(diff)}]" if diff else ""
        cells = " | ".join(str(r[k]) for _, k in COLUMNS)
        print(f"| {rec['label']}{flag}{note} | {cells} |")


def print_breakdown(records: list[dict[str, Any]], rank: int, top: int) -> None:
    for rec in records:
        r = rec["ranks"][rank]
        print(f"\n### {rec['label']} (rank {rank})\n")
        print(f"Python calls by kind: {r['calls_by_kind']}")
        print(f"calls of torch / stdlib / generated frames by caller: {r['calls_under_owner']}")
        print(
            f"flexdispatch's ops: {r['fd_ops_by_name']}  "
            f"(host-read methods by owner: {r['host_read_methods']})"
        )
        print(f"\nflexdispatch functions, calls, top {top}:")
        for k, n in r["fd_funcs"][:top]:
            print(f"  {n:3d}  {k}")
        print(f"\ntorch / stdlib / generated calls made by flexdispatch frames, top {top}:")
        for k, n in r["fd_reach_funcs"][:top]:
            print(f"  {n:3d}  {k}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="deepep-v1,deepep-v2,deepep-v25", help="comma list")
    ap.add_argument("--T", type=int, default=8, help="tokens per rank")
    ap.add_argument("--H", default="64,7168", help="hidden sizes (64: E=8 k=2; 7168: E=256 k=8)")
    ap.add_argument("--mode", default="worst,dropless", help="worst, dropless or both")
    ap.add_argument("--branch", default="cuda", choices=("cuda", "cpu", "both"))
    ap.add_argument("--breakdown", action="store_true", help="per-function tables")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--rank", type=int, default=0, choices=range(R))
    ap.add_argument("--json", help="write every record here")
    args = ap.parse_args(argv)
    apis = [b.strip().removeprefix("deepep-") for b in args.backend.split(",") if b.strip()]
    for a in apis:
        if a not in APIS:
            raise SystemExit(f"unknown backend deepep-{a}: one of deepep-v1, deepep-v2, deepep-v25")
    Hs = {int(h) for h in args.H.split(",")}
    modes = [m for m in args.mode.split(",") if m]
    branches = {"cuda": (True,), "cpu": (False,), "both": (False, True)}[args.branch]
    cases = [
        Case(api=a, T=args.T, H=H, E=E, k=k, mode=m, cuda_path=cp)
        for cp in branches
        for a in apis
        for H, E, k in SHAPES
        if H in Hs
        for m in modes
    ]
    if not cases:
        raise SystemExit("no case matches the selection")
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    print(f"command: {command}")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, gloo, R={R}, checks off, "
        "no_grad, DeepEP's Python layer over tests/deepep_emu (nothing of DeepEP's kernels ran)\n"
    )
    records = run_cases(cases)
    print_table(records, args.rank)
    if args.breakdown:
        print_breakdown(records, args.rank, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
