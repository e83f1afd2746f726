"""Fit ``flexdispatch demo`` to this machine's memory before any rank is spawned.

A published preset at full size does not fit a laptop (DeepSeek-V3's 256 experts alone are 45 GB
of fp32 weights, and the demo holds weights, gradients, results and a single-process reference).
``fit_demo`` keeps the preset's routing (E, k, groups, score function, bias, scaling, shared
experts, activation) and shrinks what must shrink, in this order, until the estimate fits:

1. the hidden size H and the expert sizes F (and the shared experts' F) together, keeping their
   ratio, in multiples of 8, down to ``H = 32`` and ``F = 16`` (never below the preset's);
2. the tokens per rank T, halved, down to 1.

If it does not fit even then, the demo is refused up front with the memory it would need.

The estimate (``estimate_memory``) counts what the demo actually holds, in bytes, for every
process of the tree (R ranks and the parent): a runtime per process (Python, torch, gloo; the demo
measures it in a probe process, ``flexdispatch.cli.demo_machine``, since a CUDA build of torch
holds nearly three times a CPU build's),
the layer's parameters and gradients, upper bounds of the activations (every rank could receive
all R*T tokens), the results the ranks return (both modes' gradients, serialised on the way
back), and in the parent the reference model (all E experts, weights and gradients) beside the
gathered results. It is an upper bound by design, not a prediction; ``tests/dist/test_demo_fit.py``
checks it against the peak resident memory the processes really reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.sysmem import AVAILABLE_ENV, SHARE, format_bytes, parse_size

__all__ = [
    "AVAILABLE_ENV",
    "DEFAULT_MAX_MEMORY",
    "DemoTooBig",
    "FitPlan",
    "MemoryEstimate",
    "available_memory",
    "estimate_memory",
    "fit_demo",
    "format_bytes",
    "memory_limit",
    "parse_size",
    "process_limit",
    "short_reason",
]

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_MAX_MEMORY = 4 * GiB
"""The default of ``--max-memory``: what the demo may use in all, runtime included."""
RUNTIME_BYTES = 400 * MiB
"""The runtime per process ``estimate_memory`` counts when not given one. ``flexdispatch demo``
passes the measured one (``flexdispatch.cli.demo_machine.measure_runtime``): about 250 MiB with a
CPU build of torch 2.13, about 690 MB with a CUDA build."""
MIN_HIDDEN, MIN_FFN = 32, 16


def available_memory(*, tree: bool = True) -> tuple[int | None, str]:
    """Bytes this process tree (``tree=False``: one process of it) can still use, and where the
    number comes from: the one memory model of every size check
    (``flexdispatch._checks.sysmem.available``: ``MemAvailable`` and the room under the cgroup
    limits, for one process also the address space left under ``RLIMIT_AS``, which bounds each
    process on its own; ``$FLEXDISPATCH_MEMORY_AVAILABLE`` replaces them). ``(None, why)`` when
    none can be read."""
    from flexdispatch._checks import sysmem

    return sysmem.available(tree=tree)


def process_limit() -> tuple[int | None, str]:
    """What the demo's largest process may plan for, and why: ``SHARE`` of what one process may
    take, when that is less than what the tree may take (an ``RLIMIT_AS`` below the machine's
    memory); ``(None, "")`` otherwise (the tree's limit bounds every process already)."""
    one, source = available_memory(tree=False)
    whole, _ = available_memory(tree=True)
    if one is None or (whole is not None and one >= whole):
        return None, ""
    return int(SHARE * one), (
        f"{SHARE:.0%} of the {format_bytes(one)} one process may take ({source})"
    )


def memory_limit(max_memory: int | None) -> tuple[int, str]:
    """What the demo may plan for in all: ``--max-memory`` (default ``DEFAULT_MAX_MEMORY``), but
    never more than ``SHARE`` (80 %, the share every size check of flexdispatch keeps:
    ``flexdispatch._checks.sysmem``) of the memory its processes may take together now. Returns
    (bytes, why)."""
    asked = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    why = (
        f"--max-memory {format_bytes(asked)}"
        if max_memory is not None
        else f"the default --max-memory {format_bytes(asked)}"
    )
    avail, source = available_memory()
    if avail is not None and SHARE * avail < asked:
        share = int(SHARE * avail)
        return share, (
            f"{SHARE:.0%} of the {format_bytes(avail)} available ({source}), less than {why}"
        )
    return asked, why


# --------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Upper bounds in bytes: one rank, the parent (or rank 0 under a launcher), and ``ranks``,
    the ranks on this machine (all R when spawned here; ``LOCAL_WORLD_SIZE`` under a launcher)."""

    per_rank: int
    parent: int
    ranks: int
    launcher: bool
    parts: dict[str, int] = field(default_factory=dict)
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        # NOTE: under a launcher rank 0 is the parent (it runs the reference beside its rank).
        return self.ranks * self.per_rank + self.parent

    @property
    def largest(self) -> int:
        """The largest single process: a rank or the parent (under a launcher rank 0, which is
        both)."""
        return self.per_rank + self.parent if self.launcher else max(self.per_rank, self.parent)

    def describe(self) -> str:
        if self.launcher:
            return (
                f"{format_bytes(self.total)} on this machine ({self.ranks} local rank(s) × "
                f"{format_bytes(self.per_rank)} + {format_bytes(self.parent)} for the reference "
                f"on rank 0)"
            )
        return (
            f"{format_bytes(self.total)} ({self.ranks} rank(s) × {format_bytes(self.per_rank)} "
            f"+ parent {format_bytes(self.parent)}, each with "
            f"{format_bytes(self.runtime)} runtime)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_rank": self.per_rank,
            "parent": self.parent,
            "ranks": self.ranks,
            "total": self.total,
            "runtime_per_process": self.runtime,
            "parts": dict(self.parts),
        }


def _sizes(cfg) -> tuple[int, int, int]:
    fs = 0
    if cfg.num_shared_experts > 0:
        fs = cfg.shared_expert_ffn_hidden_size or cfg.num_shared_experts * cfg.ffn_hidden_size
    return cfg.hidden_size, cfg.ffn_hidden_size, fs


def estimate_memory(
    cfg,
    num_ranks: int,
    tokens: int,
    *,
    worst_case: bool,
    launcher: bool = False,
    local_ranks: int | None = None,
    runtime: int = RUNTIME_BYTES,
) -> MemoryEstimate:
    """Peak bytes of ``flexdispatch demo`` running ``cfg`` (a ``MoEConfig``) on ``num_ranks``
    ranks with ``tokens`` tokens per rank (fp32 experts and rows), ``local_ranks`` of them on
    this machine (default all); ``runtime`` is the resident size of one process before its
    tensors (measured by the demo).

    Per rank: runtime + max(run, return) where run = the layer's parameters and gradients + the
    previous mode's results + activations, and return = the results of both modes, three times
    (the tensors, their ``torch.save`` bytes, the copy sent down the pipe with its tag byte:
    ``flexdispatch.launch``). The parent: runtime + every
    rank's results + two in flight + the reference (all experts: weights, gradients and the
    gradient the backward stacks) + the comparison's copies of one weight + its activations.
    Under a launcher every rank also receives every rank's results (all-gather) and rank 0 runs
    the reference, counted as ``parent`` without a runtime of its own.
    """
    from flexdispatch.experts import GATED_ACTIVATIONS

    R, T = num_ranks, tokens
    E, k = cfg.router.num_experts, cfg.router.topk
    e = E // R
    H, F, Fs = _sizes(cfg)
    s = 4  # fp32 weights, rows and gradients
    r = 8 if cfg.router.router_dtype == "fp64" else 4
    n = 3 if cfg.activation in GATED_ACTIVATIONS else 2
    expert = n * H * F + (((n - 1) * F + H) if cfg.expert_mlp_bias else 0)
    shared = n * H * Fs + (H if cfg.shared_expert_gate else 0)
    router = E * H + (E if cfg.router.router_bias else 0)

    params_rank = s * (e * expert + shared) + r * router + 16 * E  # + the expert-bias buffers
    mode_result = params_rank + s * 2 * T * H + 8 * E
    result = 2 * mode_result
    M = R * T  # rows a rank can receive: every token of every rank, at most once each
    P = M * (k if worst_case else min(k, e))  # (token, local expert) pairs fed to the experts
    # NOTE: rows on the way (send, receive, permuted, expert outputs, combined, their gradients,
    # the hierarchical mode's forwarded copies), the expert hidden states and their gradients,
    # the router's [T, E] intermediates, the shared experts' hidden states, every rank's inputs.
    activations = (
        s * (8 * P * H + 8 * P * F + 8 * M * H + 8 * T * Fs + 8 * T * H + 2 * R * T * H)
        + 8 * 8 * T * E
    )
    run = mode_result + 2 * params_rank + activations
    ret = 3 * result
    if launcher:
        # gather_objects: this rank's torch.save bytes and their uint8 tensor, then every rank's
        # bytes and what they load back as (flexdispatch.launch.wire; never a pickle of the object)
        ret = result + 2 * result + 2 * R * result
    per_rank = runtime + max(run, ret)

    full = s * (E * expert + shared) + r * router + 16 * E
    ref_act = s * (8 * T * k * (H + F) + 8 * T * Fs + 6 * R * T * H) + 8 * 8 * T * E
    # Weights, gradients, the backward's stacked gradient in flight; then, per weight, the
    # ranks' gradients concatenated and the difference taken.
    reference = 3 * full + 3 * s * E * H * F + ref_act
    held = (0 if launcher else R + 2) * result
    parent = (0 if launcher else runtime) + held + reference
    parts = {
        "params_per_rank": params_rank,
        "activations_per_rank": activations,
        "results_per_rank": result,
        "reference": reference,
    }
    local = R if local_ranks is None else local_ranks
    return MemoryEstimate(per_rank, parent, local, launcher, parts, runtime)


# --------------------------------------------------------------------------- the fit


class DemoTooBig(InputError):
    """The demo does not fit even at its smallest sizes (``fit_demo``); ``which``: ``"total"``
    (all its processes together exceed the limit) or ``"largest"`` (one process exceeds what one
    process may take: ``RLIMIT_AS``)."""

    def __init__(self, message: str, *, problem: str, which: str) -> None:
        super().__init__(message, problem=problem, detail=message)
        self.which = which


def short_reason(reason: str) -> str:
    """A limit's reason (``memory_limit``, ``process_limit``) in a few words."""
    from flexdispatch._checks.fits import short_source

    for start in ("--max-memory", "the default --max-memory"):
        if reason.startswith(start):
            return start
    if " available (" in reason:
        source = reason.split(" available (", 1)[1].rsplit("), less than", 1)[0]
        return f"{SHARE:.0%} of {short_source(source)}"
    if " may take (" in reason:
        return f"{SHARE:.0%} of {short_source(reason.split(' may take (', 1)[1].rstrip(')'))}"
    return reason if len(reason) <= 40 else reason[:39] + "…"


@dataclass(frozen=True)
class FitPlan:
    """The sizes the demo runs, what was shrunk, the estimate and the limit it fits."""

    hidden_size: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int | None
    tokens: int
    shrunk: dict[str, tuple[int, int]]
    estimate: MemoryEstimate
    limit: int
    limit_reason: str

    def shrink_line(self, cfg) -> str:
        """One line: what was shrunk from what to what (or that nothing was), the routing kept."""
        r = cfg.router
        kept = [f"E={r.num_experts}", f"k={r.topk}", r.score_function]
        if r.num_groups:
            kept.append(f"{r.group_topk}/{r.num_groups} groups ({r.group_score})")
        if r.enable_expert_bias:
            kept.append("expert bias")
        if r.scaling_factor:
            kept.append(f"x{r.scaling_factor:g}")
        if cfg.num_shared_experts:
            kept.append(f"{cfg.num_shared_experts} shared")
        kept.append(cfg.activation)
        routing = f"routing kept: {', '.join(kept)}"
        fits = f"estimated peak {self.estimate.describe()}"
        if not self.shrunk:
            return (
                f"sizes: preset's own (H={self.hidden_size}, F={self.ffn_hidden_size}), fits "
                f"{format_bytes(self.limit)} ({self.limit_reason}); {fits}"
            )
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.shrunk.items())
        return (
            f"shrunk to fit {format_bytes(self.limit)} ({self.limit_reason}): {what}; "
            f"{routing}; {fits}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "shared_expert_ffn_hidden_size": self.shared_expert_ffn_hidden_size,
            "tokens_per_rank": self.tokens,
            "shrunk": {k: {"from": a, "to": b} for k, (a, b) in self.shrunk.items()},
            "limit": self.limit,
            "limit_reason": self.limit_reason,
            "estimate": self.estimate.as_dict(),
        }


def _resized(cfg, H: int):
    """``cfg`` with hidden size ``H`` and the expert sizes scaled by ``H / cfg.hidden_size``."""
    H0, F0, _ = _sizes(cfg)
    if H == H0:
        return cfg

    def scale(f: int) -> int:
        return min(f, max(min(f, MIN_FFN), 8 * round(f * H / H0 / 8)))

    data = cfg.model_dump()
    data["hidden_size"] = H
    data["ffn_hidden_size"] = scale(F0)
    if cfg.shared_expert_ffn_hidden_size is not None:
        data["shared_expert_ffn_hidden_size"] = scale(cfg.shared_expert_ffn_hidden_size)
    if cfg.dispatch.hidden_size is not None:
        data["dispatch"]["hidden_size"] = H
    return type(cfg).model_validate(data)


def fit_demo(
    cfg,
    num_ranks: int,
    tokens: int,
    *,
    worst_case: bool,
    limit: int,
    limit_reason: str,
    launcher: bool = False,
    local_ranks: int | None = None,
    runtime: int = RUNTIME_BYTES,
    largest_limit: int | None = None,
    largest_reason: str = "",
) -> FitPlan:
    """The largest sizes (see the module docstring) at which the demo's estimate fits ``limit``
    in all and, when given, ``largest_limit`` in its largest process (``process_limit``: each
    process's own ``RLIMIT_AS``).

    Raises:
        ValueError: it does not fit even at the smallest sizes; the message gives the memory it
            would need there and the limit.
    """

    def est(c, t: int) -> MemoryEstimate:
        return estimate_memory(
            c,
            num_ranks,
            t,
            worst_case=worst_case,
            launcher=launcher,
            local_ranks=local_ranks,
            runtime=runtime,
        )

    def over(m: MemoryEstimate) -> bool:
        return m.total > limit or (largest_limit is not None and m.largest > largest_limit)

    H0 = cfg.hidden_size
    h_min = min(H0, MIN_HIDDEN)
    chosen, T = cfg, tokens
    if over(est(cfg, T)):
        # Candidates: multiples of 8 below H0 down to h_min; the estimate grows with H.
        lo, hi = max(1, math.ceil(h_min / 8)), (H0 - 1) // 8
        smallest = _resized(cfg, 8 * lo if 8 * lo < H0 else H0)
        if over(est(smallest, T)):
            chosen = smallest
            while T > 1 and over(est(chosen, T)):
                T //= 2
            need = est(chosen, T)
            shrunk = (
                f"preset {cfg.name!r} on {num_ranks} rank(s) does not fit: even shrunk to "
                f"hidden_size={chosen.hidden_size}, ffn_hidden_size={chosen.ffn_hidden_size}"
                f" and {T} token(s) per rank"
            )
            if need.total > limit:
                raise DemoTooBig(
                    f"{shrunk} it would need {need.describe()}, more than "
                    f"{format_bytes(limit)} ({limit_reason}); use fewer ranks (--nodes, "
                    f"--ranks-per-node) or a larger --max-memory if the machine has it",
                    problem=f"{num_ranks} rank(s) need ~{format_bytes(need.total)}, "
                    f"{format_bytes(limit)} allowed ({short_reason(limit_reason)})",
                    which="total",
                )
            if over(need):
                raise DemoTooBig(
                    f"{shrunk} its largest process would need "
                    f"{format_bytes(need.largest)}, more than {format_bytes(largest_limit or 0)}"
                    f" ({largest_reason}); raise the address-space limit (ulimit -v)",
                    problem=f"one process needs ~{format_bytes(need.largest)}, "
                    f"{format_bytes(largest_limit or 0)} allowed ({short_reason(largest_reason)})",
                    which="largest",
                )
        else:
            while lo < hi:  # the largest multiple of 8 in [8*lo, 8*hi] that fits
                mid = (lo + hi + 1) // 2
                if not over(est(_resized(cfg, 8 * mid), T)):
                    lo = mid
                else:
                    hi = mid - 1
            chosen = _resized(cfg, 8 * lo)
    H1, F1, _ = _sizes(chosen)
    shrunk: dict[str, tuple[int, int]] = {}
    for name, before, after in (
        ("hidden_size", H0, H1),
        ("ffn_hidden_size", cfg.ffn_hidden_size, F1),
        (
            "shared_expert_ffn_hidden_size",
            cfg.shared_expert_ffn_hidden_size,
            chosen.shared_expert_ffn_hidden_size,
        ),
        ("tokens_per_rank", tokens, T),
    ):
        if before is not None and after is not None and before != after:
            shrunk[name] = (before, after)
    return FitPlan(
        hidden_size=H1,
        ffn_hidden_size=F1,
        shared_expert_ffn_hidden_size=chosen.shared_expert_ffn_hidden_size,
        tokens=T,
        shrunk=shrunk,
        estimate=est(chosen, T),
        limit=limit,
        limit_reason=limit_reason,
    )
