"""Decode cost of one dispatch + combine (issue 46): counted with hooks, and timed against the two
bare ``all_to_all_single`` calls of the same bytes, side by side in one run.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
W worst-case rows (``num_worst_tokens``, here ``R * T``) · S rows one rank sends.

R = 2 gloo ranks on 127.0.0.1 (``flexdispatch.launch.spawn_group``, one torch thread each), torch
backend, flat, ``DispatchConfig(checks=False)`` unless ``--checks``, ``FLEXDISPATCH_CHECKS``
unset, ``torch.no_grad()``. Each rank routes its own tokens: ``torch.rand(T, E).argsort(1)[:, :k]``
(k distinct experts, uniform), fp32 probs normalised per token, ``randn(T, H)`` bf16 rows, from a
generator seeded with the rank (at T=8, H=64, E=8 these are ``benchmarks/bench_launch.py``'s
inputs). The expert output is ``recv_x`` itself (no op between dispatch and combine).

Sizes: T in {1, 8, 128} x H in {64, 7168} x E in {8 (k=2), 256 (k=8)} x {worst-case
(``W = R * T``), dropless}: 24 cases. ``--case T,H,E,MODE`` (or the ``--T/--H/--E/--mode``
filters, comma lists) selects some.

What one dispatch + combine is counted for (after 3 warm-up calls, so the in-band path's first
call, which runs the count exchange for the agreement, is not the one counted; two calls are
counted and must agree, else the record says ``"stable": false``):

- **collectives**: ``c10d.*`` ops seen by a ``TorchDispatchMode`` (every
  ``torch.distributed`` collective dispatches one, e.g. ``c10d.alltoall_base_``,
  ``c10d._allgather_base_``); cross-checked against the calls of the public
  ``torch.distributed`` collective functions seen by the Python-call pass (``collectives_api``).
- **compute ops**: every other ATen op the mode sees whose schema is not a view
  (``OpOverload.is_view`` is False: in-place and ``out=`` ops, allocations such as ``empty`` /
  ``zeros`` / ``full``, and ``_local_scalar_dense`` included; this is what the issue's table
  counts). **view ops**: those whose schema returns an alias of an input (``is_view``: ``view``,
  ``slice``, ``select``, ``expand``, ``t``, ``unsqueeze``, ``view.dtype``, ``alias``, ...), free
  of device work. Ops a kernel calls below the Python dispatch key are not seen, nor is work
  inside gloo.
- **host reads**: each operation that is a device-to-host synchronisation when the same code runs
  on CUDA: ``aten._local_scalar_dense`` (``.item()``, ``bool()`` / ``int()`` / ``float()`` of a
  tensor), ``Tensor.tolist()`` and ``Tensor.numpy()`` (no ATen op: counted by wrapping the
  methods while the call runs), and the ops whose output size depends on values (``aten.nonzero``
  without a static size, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size``, ``equal``). ``aten.bincount`` is listed apart (``cpu_branch_sync_ops``): the
  torch backend calls it on its CPU branch only (``rows._bin_counts``; the CUDA branch uses
  ``scatter_add_``), so it is not a read the same code makes on CUDA.
- **allocations**: outputs of non-view ops whose storage is none of the op's inputs' (a new
  ``StorageImpl``, zero-byte ones included; ``set_`` onto a lent storage and ``out=`` / in-place
  ops are not new). Storages made inside gloo are not seen.
- **Python calls**: ``sys.setprofile`` ``'call'`` events (every Python frame entered, generator
  resumptions included: library, ``torch.distributed``, the rest of torch, the standard
  library) while the call runs, in a separate pass with no mode and no wrapper installed;
  frames of this file are not counted. Also broken down by origin and per function (own calls,
  and the inclusive count of calls made under each library function).

The same instrument counts the two bare ``all_to_all_single`` calls (``bare`` in each record).

Times (skip with ``--no-time``): ``--reps`` interleaved blocks of ``--inner`` calls, the case and
the bare pair alternating, each block between two barriers; per call the median block wall time
(``perf_counter``, through the closing barrier) and the calling thread's CPU time
(``time.thread_time``: Python, ATen and issuing the collectives, not gloo's threads). The bare
pair moves the same rows as the dispatch: dropless the real per-peer split sizes, worst-case
``W / R`` rows per peer, there and back, ``[S, H]`` bf16 (the metadata bytes are not in it).
Times depend on load: report the ratios with ``uptime``.

Run:  .venv/bin/python benchmarks/bench_decode.py [--case 8,64,8,worst] [--checks] [--no-time]
      [--json out.json] [--breakdown] [--where]

``decode_counts(T, H, E, k, mode)`` spawns the ranks and returns the deterministic counts of one
case; ``rank_counts(...)`` does the same inside the ranks of a running 2-rank group (for a
test's ``run_group`` worker).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

R = 2
TS, HS, ES = (1, 8, 128), (64, 7168), (8, 256)
TOPK = {8: 2, 256: 8}
MODES = ("worst", "dropless")
WARMUP_CALLS = 3
DETERMINISTIC = ("collectives", "compute_ops", "view_ops", "host_reads", "allocations")

HOST_READ_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.nonzero.out",
        "aten.masked_select.default",
        "aten._unique.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.unique_consecutive.default",
        "aten.equal.default",
    }
)
CPU_BRANCH_SYNC_OPS = frozenset({"aten.bincount.default"})
COLLECTIVE_FUNCS = frozenset(
    {
        "all_to_all_single",
        "all_to_all",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather",
        "all_reduce",
        "reduce_scatter_tensor",
        "broadcast",
        "barrier",
        "gather",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
    }
)
_THIS_FILE = os.path.abspath(__file__)
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One decode shape: ``T`` tokens per rank, ``H`` bf16 columns, ``E`` experts, top-``k``,
    ``mode`` ``"worst"`` (``W = R * T``) or ``"dropless"``, value checks on or off."""

    T: int
    H: int
    E: int
    k: int
    mode: str
    checks: bool = False
    cuda_path: bool = False

    @property
    def label(self) -> str:
        return (
            f"T={self.T} H={self.H} E={self.E} k={self.k} {self.mode}"
            + (" checks" if self.checks else "")
            + (" cuda-path" if self.cuda_path else "")
        )


# --------------------------------------------------------------------------- counting hooks


def _origin(filename: str) -> str:
    """Which part of the stack a Python frame belongs to."""
    if filename.startswith("<frozen"):
        return "stdlib"
    if filename.startswith("<"):
        return "generated"  # e.g. a dataclass's __init__ (exec'd from "<string>")
    path = os.path.realpath(filename)
    if "/flexdispatch/" in path:
        return "flexdispatch"
    if "/torch/distributed/" in path:
        return "torch.distributed"
    if "/torch/" in path:
        return "torch"
    if path.startswith(_STDLIB) and "site-packages" not in path:
        return "stdlib"
    return "other"


def _short(filename: str) -> str:
    """``flexdispatch/backends/torch/a2a.py``-style path (from the package root)."""
    if filename.startswith("<"):
        return filename
    path = os.path.realpath(filename)
    for marker in ("/flexdispatch/", "/torch/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :]
    if path.startswith(_STDLIB):
        return "stdlib/" + os.path.relpath(path, _STDLIB)
    return path


def _fd_site(limit: int = 64) -> str:
    """The innermost flexdispatch frame of the current stack, as ``file:function:line``."""
    f = sys._getframe(2)
    for _ in range(limit):
        if f is None:
            break
        if "/flexdispatch/" in f.f_code.co_filename:
            return f"{_short(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "?"


class OpCounter(TorchDispatchMode):
    """Counts, by op name, the collectives, compute ops, views, host reads and new storages of
    the ops dispatched while it is active (module docstring). ``where``: also by the innermost
    flexdispatch frame that issued each op (slow)."""

    def __init__(self, *, where: bool = False) -> None:
        super().__init__()
        self.where = where
        self.collectives: collections.Counter[str] = collections.Counter()
        self.compute: collections.Counter[str] = collections.Counter()
        self.views: collections.Counter[str] = collections.Counter()
        self.host_reads: collections.Counter[str] = collections.Counter()
        self.cpu_branch_syncs: collections.Counter[str] = collections.Counter()
        self.allocations: collections.Counter[str] = collections.Counter()
        self.alloc_bytes = 0
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func)
        if func.namespace == "c10d":
            self.collectives[name] += 1
            return func(*args, **kwargs)
        if func.is_view or torch.Tag.inplace_view in func.tags:
            self.views[name] += 1
            if self.where:
                self.sites[f"(view) {name} @ {_fd_site()}"] += 1
            return func(*args, **kwargs)
        self.compute[name] += 1
        if self.where:
            self.sites[f"{name} @ {_fd_site()}"] += 1
        if name in HOST_READ_OPS or (
            name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None
        ):
            self.host_reads[name] += 1
        if name in CPU_BRANCH_SYNC_OPS:
            self.cpu_branch_syncs[name] += 1
        before = set()
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                before.add(leaf.untyped_storage()._cdata)
            elif isinstance(leaf, torch.UntypedStorage):
                before.add(leaf._cdata)
        out = func(*args, **kwargs)
        seen = set()
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                st = leaf.untyped_storage()
                if st._cdata not in before and st._cdata not in seen:
                    seen.add(st._cdata)
                    self.allocations[name] += 1
                    self.alloc_bytes += st.nbytes()
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "collectives": sum(self.collectives.values()),
            "compute_ops": sum(self.compute.values()),
            "view_ops": sum(self.views.values()),
            "host_reads_ops": sum(self.host_reads.values()),
            "cpu_branch_sync_ops": sum(self.cpu_branch_syncs.values()),
            "allocations": sum(self.allocations.values()),
            "alloc_bytes": self.alloc_bytes,
        }


@contextlib.contextmanager
def _count_method_reads(counter: collections.Counter[str]) -> Iterator[None]:
    """Wrap ``Tensor.tolist`` / ``Tensor.numpy`` (host reads that dispatch no ATen op) while the
    block runs; each call is counted by name."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy")}
    base = {name: getattr(torch.Tensor, name) for name in saved}

    def make(name: str) -> Callable[..., Any]:
        orig = base[name]

        def wrapper(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            counter[f"Tensor.{name}"] += 1
            return orig(self, *a, **kw)

        return wrapper

    for name in saved:
        setattr(torch.Tensor, name, make(name))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


class PyCallCounter:
    """``sys.setprofile`` counter of Python calls (``'call'`` events) while ``run`` runs: per code
    object (own calls) and, for every code object on the stack at a call, inclusively. Frames of
    this file are neither counted nor kept on the stack."""

    def __init__(self) -> None:
        self.own: collections.Counter[Any] = collections.Counter()
        self.inclusive: collections.Counter[Any] = collections.Counter()
        self._stack: list[Any] = []

    def _profile(self, frame: Any, event: str, _arg: Any) -> None:
        code = frame.f_code
        if code.co_filename == _THIS_FILE:
            return
        if event == "call":
            self.own[code] += 1
            for c in set(self._stack):
                self.inclusive[c] += 1
            self._stack.append(code)
        elif event == "return" and self._stack:
            self._stack.pop()

    def run(self, fn: Callable[[], Any]) -> Any:
        sys.setprofile(self._profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    @property
    def total(self) -> int:
        return sum(self.own.values())

    def by_origin(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for code, n in self.own.items():
            out[_origin(code.co_filename)] += n
        return dict(out.most_common())

    def collectives_api(self) -> dict[str, int]:
        """Calls of the public ``torch.distributed`` collective functions."""
        out: collections.Counter[str] = collections.Counter()
        for code, n in self.own.items():
            fn = code.co_filename.replace(os.sep, "/")
            if fn.endswith("torch/distributed/distributed_c10d.py") and (
                code.co_name in COLLECTIVE_FUNCS
            ):
                out[code.co_name] += n
        return dict(out)

    def table(self, which: str, top: int) -> list[tuple[str, int]]:
        counts = self.own if which == "own" else self.inclusive
        rows = [
            (f"{_short(c.co_filename)}:{c.co_name}:{c.co_firstlineno}", n)
            for c, n in counts.most_common()
            if which == "own" or "/flexdispatch/" in c.co_filename
        ]
        return rows[:top]


def count_call(
    fn: Callable[[], Any], *, where: bool = False, top: int = 40, collect: bool = True
) -> dict[str, Any]:
    """Every count of the module docstring for one run of ``fn`` (two passes: ops, then Python
    calls; ``fn`` runs once in each). Garbage collection is off while ``fn`` runs (``collect``:
    a full collection before each pass, ~0.3 s with torch loaded: the test skips it)."""
    if collect:
        gc.collect()
    gc.disable()
    try:
        reads: collections.Counter[str] = collections.Counter()
        mode = OpCounter(where=where)
        with _count_method_reads(reads), mode:
            fn()
        if collect:
            gc.collect()
        prof = PyCallCounter()
        prof.run(fn)
    finally:
        gc.enable()
    host = collections.Counter(mode.host_reads)
    host.update(reads)
    out = mode.summary()
    out.update(
        host_reads=sum(host.values()),
        host_reads_by_kind=dict(host),
        python_calls=prof.total,
        python_calls_by_origin=prof.by_origin(),
        collectives_api=prof.collectives_api(),
        collectives_by_name=dict(mode.collectives),
        compute_by_op=dict(mode.compute.most_common()),
        views_by_op=dict(mode.views.most_common()),
        allocations_by_op=dict(mode.allocations.most_common()),
        cpu_branch_syncs_by_op=dict(mode.cpu_branch_syncs),
        python_calls_own_top=prof.table("own", top),
        python_calls_inclusive_flexdispatch=prof.table("inclusive", top),
    )
    if where:
        out["ops_by_site"] = dict(mode.sites.most_common())
    return out


# --------------------------------------------------------------------------- the ranks


def case_inputs(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [T, H] bf16, topk_idx [T, k] int64, topk_probs [T, k] fp32)`` of ``rank``."""
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(case.T, case.E, generator=g).argsort(1)[:, : case.k].contiguous()
    probs = torch.rand(case.T, case.k, generator=g)
    probs = probs / probs.sum(1, keepdim=True)
    x = torch.randn(case.T, case.H, generator=g).bfloat16()
    return x, idx, probs


def _bare_pair(case: Case, idx: torch.Tensor, rank: int) -> Callable[[], None]:
    """The two bare ``all_to_all_single`` calls moving the dispatch's rows there and back."""
    from flexdispatch.distributed import all_gather_int64

    e = case.E // R
    if case.mode == "worst":
        s_out = s_in = [case.T] * R  # W / R rows per peer, as the worst-case path sends
    else:
        mask = torch.zeros(case.T, R, dtype=torch.bool)
        mask.scatter_(1, idx // e, True)
        C = all_gather_int64(mask.sum(0).to(torch.int64)).view(R, R).tolist()
        s_out, s_in = [C[rank][r] for r in range(R)], [C[s][rank] for s in range(R)]
    rows = torch.randn(sum(s_out), case.H).bfloat16()
    recv = torch.empty(sum(s_in), case.H, dtype=torch.bfloat16)
    back = torch.empty(sum(s_out), case.H, dtype=torch.bfloat16)

    def bare() -> None:
        dist.all_to_all_single(recv, rows, s_in, s_out)
        dist.all_to_all_single(back, recv, s_out, s_in)

    return bare


def _time(
    modes: dict[str, Callable[[], Any]], reps: int, inner: int
) -> dict[str, dict[str, float]]:
    """Median wall / thread-CPU seconds per call of each mode, interleaved blocks (docstring)."""
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        for m, fn in modes.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                fn()
            c1 = time.thread_time()
            dist.barrier()
            wall[m].append((time.perf_counter() - t0) / inner)
            cpu[m].append((c1 - c0) / inner)
    return {
        m: {"wall_s": statistics.median(wall[m]), "cpu_s": statistics.median(cpu[m])} for m in modes
    }


def _one_case(case: Case, opts: dict[str, Any]) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    rank = dist.get_rank()
    x, idx, probs = case_inputs(case, rank)
    W = R * case.T if case.mode == "worst" else 0
    cfg = DispatchConfig(backend="torch", checks=case.checks, num_worst_tokens=W)
    d = FlexDispatcher(cfg, num_experts=case.E)
    with_bare = opts.get("bare", True) or opts["time"]
    bare = _bare_pair(case, idx, rank) if with_bare else None

    def step() -> None:
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)

    import flexdispatch

    # NOTE: which tree the rank imported (a baseline run sets PYTHONPATH to another checkout)
    rec: dict[str, Any] = {"rank": rank, "flexdispatch": os.path.dirname(flexdispatch.__file__)}
    with torch.no_grad():
        for _ in range(WARMUP_CALLS):
            step()
            if bare is not None:
                bare()
        syncs0 = d.stats.host_syncs
        collect = opts.get("collect", True)
        counts = [
            count_call(step, where=opts["where"], top=opts["top"], collect=collect)
            for _ in range(2)
        ]
        syncs = (d.stats.host_syncs - syncs0) / 4  # 2 counted calls x 2 passes
        keys = (*DETERMINISTIC, "python_calls")
        rec["stable"] = all(counts[0][k] == counts[1][k] for k in keys)
        if not rec["stable"]:
            rec["second_call"] = {k: counts[1][k] for k in keys}
        rec.update(counts[0])
        rec["stats_host_syncs_per_call"] = syncs
        if bare is not None and opts.get("bare", True):
            keep = (*DETERMINISTIC, "python_calls", "host_reads_by_kind", "collectives_by_name")
            got = count_call(bare, top=opts["top"], collect=collect)
            rec["bare"] = {k: v for k, v in got.items() if k in keep}
        if opts["time"]:
            rec["time"] = _time({"call": step, "bare": bare}, opts["reps"], opts["inner"])
    d.close()
    return rec


def rank_counts(
    T: int, H: int, E: int, k: int, mode: str, *, checks: bool = False
) -> dict[str, Any]:
    """Inside a rank of an initialised 2-rank group (e.g. a test's ``run_group`` worker, every
    rank calling it alike): the deterministic counts of one dispatch + combine of this rank
    (``decode_counts``'s keys). No timing, no count of the bare pair, no full garbage collection
    before the counted passes (the counts do not depend on it: ``stable`` says so)."""
    if dist.get_world_size() != R:
        raise ValueError(f"rank_counts needs a group of {R} ranks, got {dist.get_world_size()}")
    case = Case(T=T, H=H, E=E, k=k, mode=mode, checks=checks)
    os.environ.pop("FLEXDISPATCH_CHECKS", None)
    opts = {"time": False, "where": False, "top": 0, "bare": False, "collect": False}
    rec = _one_case(case, opts)
    return {key: rec[key] for key in (*DETERMINISTIC, "python_calls", "stable")}


def force_cuda_path() -> None:
    """Make every device-dependent branch of the loaded flexdispatch modules take its CUDA side
    on CPU tensors, for good (this process): each module's ``cuda_code_path`` and
    ``defer_value_checks`` answer True (what ``tests/cuda_path.py`` does for the tests). The
    Triton kernels stay off (no ``TRITON_INTERPRET``): the CUDA branch's torch ops run. The one
    CUDA-only step that cannot run on CPU is the dropless count copy into pinned memory on a
    side stream (``PendingCounts``: a ``copy_``, not counted here)."""
    from flexdispatch import FlexDispatcher  # noqa: F401 - load the hot path before patching

    def yes(device: torch.device) -> bool:
        return True

    for name, mod in list(sys.modules.items()):
        if name.startswith("flexdispatch"):
            for attr in ("cuda_code_path", "defer_value_checks"):
                if callable(getattr(mod, attr, None)):
                    setattr(mod, attr, yes)


def _rank_body(cases: list[Case], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs on every spawned rank: each case in turn (the same order everywhere). Cases on the
    forced CUDA branch run after the others (the patch cannot be undone)."""
    os.environ.pop("FLEXDISPATCH_CHECKS", None)
    out = {}
    for i, c in enumerate(cases):
        if not c.cuda_path:
            out[i] = _one_case(c, opts)
    if any(c.cuda_path for c in cases):
        force_cuda_path()
        for i, c in enumerate(cases):
            if c.cuda_path:
                out[i] = _one_case(c, opts)
    return [out[i] for i in range(len(cases))]


def run_cases(
    cases: list[Case],
    *,
    time_it: bool = True,
    reps: int = 7,
    inner: int = 20,
    where: bool = False,
    top: int = 40,
    timeout_s: float = 900.0,
) -> list[dict[str, Any]]:
    """Spawn ``R`` gloo ranks and measure ``cases``; one record per case: ``{"case", "ranks":
    [rank 0's record, rank 1's]}``."""
    from flexdispatch.launch import spawn_group

    opts = {"time": time_it, "reps": reps, "inner": inner, "where": where, "top": top}
    env = {"FLEXDISPATCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    got = spawn_group(_rank_body, R, args=(cases, opts), timeout_s=timeout_s, env=env)
    return [
        {"case": dataclasses.asdict(c), "label": c.label, "ranks": [got[r][i] for r in range(R)]}
        for i, c in enumerate(cases)
    ]


def decode_counts(
    T: int,
    H: int,
    E: int,
    k: int,
    mode: str,
    *,
    checks: bool = False,
    timeout_s: float = 240.0,
) -> list[dict[str, int]]:
    """The deterministic counts of one dispatch + combine (2 gloo ranks, module docstring), per
    rank: ``collectives``, ``compute_ops``, ``view_ops``, ``host_reads``, ``allocations`` and
    ``python_calls`` (which depends on the Python and torch versions: pin it with a ceiling),
    plus ``stable`` (two counted calls agreed). No timing."""
    case = Case(T=T, H=H, E=E, k=k, mode=mode, checks=checks)
    rec = run_cases([case], time_it=False, timeout_s=timeout_s)[0]
    keys = (*DETERMINISTIC, "python_calls", "stable")
    return [{key: r[key] for key in keys} for r in rec["ranks"]]


# --------------------------------------------------------------------------- command line


def all_cases(checks: bool = False, cuda_path: bool = False) -> list[Case]:
    return [
        Case(T=T, H=H, E=E, k=TOPK[E], mode=m, checks=checks, cuda_path=cuda_path)
        for H in HS
        for E in ES
        for T in TS
        for m in MODES
    ]


def _ints(text: str | None) -> set[int] | None:
    return None if text is None else {int(v) for v in text.split(",") if v.strip()}


def select_cases(args: argparse.Namespace) -> list[Case]:
    cases = all_cases(args.checks, args.cuda_path)
    Ts, Hs, Es = _ints(args.T), _ints(args.H), _ints(args.E)
    modes = None if args.mode is None else set(args.mode.split(","))
    if args.case:
        t, h, e, m = args.case.split(",")
        Ts, Hs, Es, modes = {int(t)}, {int(h)}, {int(e)}, {m}
    picked = [
        c
        for c in cases
        if (Ts is None or c.T in Ts)
        and (Hs is None or c.H in Hs)
        and (Es is None or c.E in Es)
        and (modes is None or c.mode in modes)
    ]
    if args.k is not None:
        picked = [dataclasses.replace(c, k=args.k) for c in picked]
    if not picked:
        raise SystemExit("no case matches the selection")
    return picked


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def print_table(records: list[dict[str, Any]], rank: int = 0) -> None:
    print(
        f"rank {rank}, per dispatch + combine: compute ops (+ views); ms per call "
        "wall (thread CPU)\n"
    )
    head = "| case | collectives | compute (+views) | host reads | Python calls | allocations |"
    sep = "|---|---:|---:|---:|---:|---:|"
    timed = "time" in records[0]["ranks"][rank]
    if timed:
        head += " call ms | bare ms | wall call/bare | CPU call/bare |"
        sep += "---:|---:|---:|---:|"
    print(head)
    print(sep)
    for rec in records:
        r = rec["ranks"][rank]
        flag = "" if r["stable"] else " (unstable)"
        other = rec["ranks"][1 - rank]
        diff = [k for k in (*DETERMINISTIC, "python_calls") if other[k] != r[k]]
        note = f" [rank {1 - rank} differs: {', '.join(diff)}]" if diff else ""
        row = (
            f"| {rec['label']}{flag}{note} | {r['collectives']} | {r['compute_ops']} "
            f"(+{r['view_ops']}) | {r['host_reads']} | {r['python_calls']} | "
            f"{r['allocations']} |"
        )
        if timed:
            t = r["time"]
            c, b = t["call"], t["bare"]
            row += (
                f" {_ms(c['wall_s'])} ({_ms(c['cpu_s'])}) | {_ms(b['wall_s'])} "
                f"({_ms(b['cpu_s'])}) | {c['wall_s'] / b['wall_s']:.2f}x | "
                f"{c['cpu_s'] / b['cpu_s']:.2f}x |"
            )
        print(row)
    b = records[0]["ranks"][rank]["bare"]
    print(
        f"\nbare pair (two all_to_all_single): {b['collectives']} collectives, "
        f"{b['compute_ops']} (+{b['view_ops']}) ops, {b['host_reads']} host reads, "
        f"{b['python_calls']} Python calls, {b['allocations']} allocations"
    )


def print_breakdown(records: list[dict[str, Any]], rank: int, top: int) -> None:
    for rec in records:
        r = rec["ranks"][rank]
        print(f"\n### {rec['label']} (rank {rank})\n")
        print(f"collectives: {r['collectives_by_name']}  (Python API: {r['collectives_api']})")
        print(
            f"host reads: {r['host_reads_by_kind']}  cpu-branch syncs: "
            f"{r['cpu_branch_syncs_by_op']}"
        )
        print(f"Python calls by origin: {r['python_calls_by_origin']}")
        print(f"compute ops: {r['compute_by_op']}")
        print(f"view ops: {r['views_by_op']}")
        print(f"allocations: {r['allocations_by_op']}")
        if "ops_by_site" in r:
            print("\nops by issuing flexdispatch frame:")
            for k, n in r["ops_by_site"].items():
                print(f"  {n:3d}  {k}")
        print(f"\nPython calls, own, top {top}:")
        for k, n in r["python_calls_own_top"][:top]:
            print(f"  {n:3d}  {k}")
        print(f"\nPython calls made under each flexdispatch function (inclusive), top {top}:")
        for k, n in r["python_calls_inclusive_flexdispatch"][:top]:
            print(f"  {n:3d}  {k}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", help="one case: T,H,E,MODE (e.g. 8,7168,256,worst)")
    ap.add_argument("--T", help="token counts to keep (comma list)")
    ap.add_argument("--H", help="hidden sizes to keep (comma list)")
    ap.add_argument("--E", help="expert counts to keep (comma list)")
    ap.add_argument("--mode", help="worst, dropless or both (comma list)")
    ap.add_argument("--k", type=int, help="top-k (default: 2 for E=8, 8 for E=256)")
    ap.add_argument("--checks", action="store_true", help="DispatchConfig(checks=True)")
    ap.add_argument(
        "--cuda-path",
        action="store_true",
        help="run the CUDA branch of every device-dependent choice on CPU (force_cuda_path)",
    )
    ap.add_argument("--no-time", action="store_true", help="counts only")
    ap.add_argument("--reps", type=int, default=7, help="interleaved blocks per mode")
    ap.add_argument("--inner", type=int, default=20, help="calls per block")
    ap.add_argument("--json", help="write every record here")
    ap.add_argument("--breakdown", action="store_true", help="per-op and per-function tables")
    ap.add_argument("--where", action="store_true", help="ops by issuing flexdispatch frame")
    ap.add_argument("--top", type=int, default=40, help="rows of the per-function tables")
    ap.add_argument("--rank", type=int, default=0, choices=range(R), help="rank shown")
    args = ap.parse_args(argv)
    cases = select_cases(args)
    load = os.getloadavg()
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    print(f"command: {command}")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, gloo, R={R}, 1 thread "
        f"per rank, checks {'on' if args.checks else 'off'}"
        f"{', CUDA branch forced' if args.cuda_path else ''}, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
    )
    records = run_cases(
        cases,
        time_it=not args.no_time,
        reps=args.reps,
        inner=args.inner,
        where=args.where,
        top=args.top,
    )
    trees = {r["flexdispatch"] for rec in records for r in rec["ranks"]}
    print(f"\nthe ranks imported flexdispatch from: {', '.join(sorted(trees))}\n")
    print_table(records, args.rank)
    if args.breakdown or args.where:
        print_breakdown(records, args.rank, args.top)
    if args.json:
        doc = {
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_before": load,
            "loadavg_after": os.getloadavg(),
            "ranks": R,
            "records": records,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return records


if __name__ == "__main__":
    main()
