"""The dispatcher's bad input values: one place decides whether they raise now, or are screened
on the device by one Triton launch, or by torch ops, or are left to the backend, and the log of
the counts a safe point reads.

Shape letters (ARCHITECTURE.md): T tokens on this rank · k top-k · E experts in total.

Ids outside ``[-1, E)``, an expert named twice in one token, and NaN/inf rows or probs
(``screen_dispatch_values``). Checks on (``checks=True`` or ``FLEXDISPATCH_CHECKS=1``, not while
capturing a graph): raise now, on every device. Checks off, no value is checked on any device:
a backend that maps bad ids safely itself (``DispatchBackend.counts_bad_ids``: the torch backend's
rank table sends them nowhere) counts them where it computes counts anyway, into
``stats.pending_bad_values`` (``BadValueLog``: kept without a launch and folded in at the check),
and ``FlexDispatcher.check_overflow`` raises naming them (``bad_input_problems``); a repeated id or
a NaN is not looked at (a wrong answer from wrong input, no memory hazard). The other backends
(DeepEP, whose kernels trap on a repeated id or index past their counters on a bad one) get
their ids screened as before: raised now on CPU, and on CUDA set to -1 on the device and counted
(one Triton launch, or torch ops).
"""

from __future__ import annotations

import math

import torch

from flexdispatch._checks import tensors
from flexdispatch._checks.tensors import check_ids_in_range
from flexdispatch.kernels import screen as _screen
from flexdispatch.types import DispatchStats

__all__ = [
    "BAD_VALUE_SLOTS",
    "BadValueLog",
    "bad_ids_message",
    "bad_input_problems",
    "check_dispatch_values",
    "check_repeated_ids",
    "count_bad_parts",
    "count_bad_values",
    "mask_bad_ids",
    "nonfinite_message",
    "repeated_expert_slots",
    "repeated_ids_message",
    "screen_dispatch_values",
]

_INT64 = torch.iinfo(torch.int64)


def screen_dispatch_values(
    topk_idx: torch.Tensor,
    num_experts: int,
    values: torch.Tensor,
    topk_probs: torch.Tensor,
    *,
    checks: bool | None,
    counts_bad_ids: bool,
    log: BadValueLog,
    stats: DispatchStats,
) -> torch.Tensor:
    """The one decision about a dispatch's values (module docstring): returns the ids the backend
    gets. ``counts_bad_ids``: the backend maps ids outside ``[-1, E)`` safely and counts them
    itself (its ``bad_ids``), so with checks off nothing is looked at here.

    Under CUDA-graph capture the counter accumulates across replays when it already exists (one
    eager dispatch before capturing, as warm-up does); created inside the capture it holds the
    latest replay's counts.
    """
    E = num_experts
    if tensors.checks_enabled(checks):
        check_dispatch_values(topk_idx, E, values, topk_probs)
        return topk_idx
    if counts_bad_ids:
        return topk_idx  # NOTE: checks off: no value checks (the backend counts bad ids)
    if not tensors.defer_value_checks(topk_idx.device):
        check_dispatch_values(topk_idx, E, values, topk_probs)
        return topk_idx
    if _screen.screen_on_device(topk_idx.device):
        # NOTE: one fused launch: every bad id as -1, the counts added into the pending
        # vector in place (no parts kept)
        acc = log.accumulator(stats, topk_idx.device)
        return _screen.screen_inputs(topk_idx, E, values, topk_probs, acc)
    # NOTE: DeepEP V2 would index past its counters on a bad id, and V2 / 2.5 trap on a repeat:
    # both as -1, counted
    idx, repeats, oob = mask_bad_ids(topk_idx, E, out_of_range=True)
    parts = count_bad_parts(topk_idx, E, values, topk_probs, count_ids=False, repeats=repeats)
    assert oob is not None
    log.add(stats, (oob, *parts))
    return idx


BAD_VALUE_SLOTS = (
    "invalid_expert_ids",
    "nonfinite_x",
    "nonfinite_topk_probs",
    "repeated_expert_ids",
)
"""Names of the counters ``count_bad_values`` returns first (also the ``stats.extra`` keys); the
last two entries of its vector are the largest and the smallest bad id seen."""


def bad_ids_message(name: str, count: int, lowest: int, highest: int, upper: int) -> str:
    """Error text for ``count`` expert ids outside ``[-1, upper)`` seen on the device."""
    seen = []
    if lowest < -1:
        seen.append(f"lowest {lowest}")
    if highest >= upper:
        seen.append(f"highest {highest}")
    return (
        f"{name} held {count} id(s) outside [-1, {upper}) ({', '.join(seen)}) since the dispatcher "
        f"was built; they were treated as -1 and their tokens' shares were dropped: expert ids "
        f"must be -1 (dropped) or in [0, {upper}); the dispatcher was built for num_experts="
        f"{upper}: give the router and the dispatcher the same expert count"
    )


def nonfinite_message(name: str, count: int, *, past: bool = False) -> str:
    """Error text for ``count`` NaN/inf values in ``name`` (``x`` or ``topk_probs``)."""
    held = "held" if past else "holds"
    since = " since the dispatcher was built" if past else ""
    fix = (
        "check the layer that feeds the MoE block (NaN hidden states route to arbitrary experts)"
        if name.startswith("x")
        else "check the router's logits and its inputs"
    )
    return f"{name} {held} {count} NaN/inf value(s){since}: {fix}"


def check_dispatch_values(
    topk_idx: torch.Tensor, num_experts: int, x: torch.Tensor, topk_probs: torch.Tensor
) -> None:
    """Raise ValueError for expert ids outside ``[-1, E)`` or NaN/inf in ``x`` / ``topk_probs``
    (reads values: free on CPU, a host sync on CUDA).

    Cheap on the good path: one ``aminmax`` per tensor (a float tensor's min and max are both
    finite exactly when all of its values are: NaN and inf propagate), read with one host copy;
    only when those look bad do the exact checks run, which name the bad values. (An fp32 sum of a
    bf16 ``[4096, 2048]`` tensor took 12 ms on 2 CPU threads, its ``aminmax`` 0.3 ms.)
    """
    named = [(name, t) for name, t in (("x", x), ("topk_probs", topk_probs)) if t.numel()]
    parts = [t for _, t in named]
    if topk_idx.numel():
        parts.insert(0, topk_idx)
    if not parts:
        return
    # One stack of every min/max: ids and values promote to one float dtype, monotonically, so an
    # id's range test survives (ids beyond 2**24 may round, but never across -1 or E).
    if parts[0].device.type == "cpu":
        # NOTE: on CPU each bound is read where it lies (``tolist`` of a 0-dim tensor is no ATen
        # op): a third of the time of the stack, which promotes six mixed-dtype scalars
        bounds = [b.tolist() for t in parts for b in torch.aminmax(t)]
    else:
        bounds = torch.stack([b for t in parts for b in torch.aminmax(t)]).tolist()
    if topk_idx.numel():
        lo, hi = bounds[:2]
        bounds = bounds[2:]
        if lo < -1 or hi >= num_experts:
            check_ids_in_range(
                "topk_idx",
                topk_idx,
                num_experts,
                hint=(
                    f"; the dispatcher was built for num_experts={num_experts}: give the router "
                    f"and the dispatcher the same expert count"
                ),
            )
    for i, (name, t) in enumerate(named):
        if not (math.isfinite(bounds[2 * i]) and math.isfinite(bounds[2 * i + 1])):
            bad = int((~torch.isfinite(t)).sum().item())
            raise ValueError(nonfinite_message(name, bad))
    check_repeated_ids(topk_idx)


def repeated_expert_slots(topk_idx: torch.Tensor, *, include_unused: bool = False) -> torch.Tensor:
    """``[T, k]`` bool: the slots whose expert id a lower slot of the same token names already
    (the first slot of a repeated id is kept). No host read: 3 device ops (one ``[T, k, k]``
    bool comparison), 5 without ``include_unused`` (which also marks repeated -1 slots, harmless
    when they are only set to -1)."""
    same = (topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)).triu_(1)  # [t, i, j]: i < j
    rep = same.any(1)
    return rep if include_unused else rep & (topk_idx >= 0)


def repeated_ids_message(count: int, *, token: int | None = None, ids: list | None = None) -> str:
    """Error text for ``count`` repeated expert ids (naming the first token when known)."""
    if token is not None:
        what = f"topk_idx names one expert twice in token {token} ({ids}; {count} repeat(s))"
    else:
        what = (
            f"topk_idx named one expert twice in a token {count} time(s) since the dispatcher "
            f"was built; the repeats were sent as -1"
        )
    return (
        f"{what}: a token's k expert ids must be distinct on every backend (DeepEP V2 / 2.5 "
        f"trap on a repeat: ep.duplicate_experts, elastic.duplicate_experts): route each token "
        f"to k distinct experts, or mark unused slots with -1"
    )


def check_repeated_ids(topk_idx: torch.Tensor) -> None:
    """Host-reading check that no token names one expert twice (raises ValueError naming the
    first such token and its ids)."""
    if topk_idx.numel() == 0 or topk_idx.shape[1] < 2:
        return
    rep = repeated_expert_slots(topk_idx)
    if bool(rep.any()):
        t = int(rep.any(1).nonzero()[0, 0])
        raise ValueError(repeated_ids_message(int(rep.sum()), token=t, ids=topk_idx[t].tolist()))


def mask_bad_ids(
    topk_idx: torch.Tensor, num_experts: int, *, out_of_range: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Ids no backend kernel may see, as -1, without a host read: the repeats of an id in one
    token (``repeated_expert_slots``) and, with ``out_of_range``, ids outside ``[-1, E)``.

    Returns:
        ``(ids [T, k], repeats, out_of_range)``: a new tensor (or ``topk_idx`` when nothing can be
        bad), the 0-dim int64 number of repeats (None for k = 1) and of ids outside
        ``[-1, E)`` (None without ``out_of_range``).
    """
    bad = repeats = oob_count = None
    if topk_idx.shape[1] >= 2:
        rep = repeated_expert_slots(topk_idx, include_unused=True)
        # NOTE: only repeats of ids in [0, E) are counted and, where a backend counts the bad ids
        # itself, set to -1 (it must still see every bad id); a repeated bad id or -1 is set to
        # -1 below anyway (or changes nothing)
        valid_rep = rep & (topk_idx >= 0) & (topk_idx < num_experts)
        repeats = valid_rep.sum(dtype=torch.int64)
        bad = rep if out_of_range else valid_rep
    if out_of_range:
        oob = (topk_idx < -1) | (topk_idx >= num_experts)
        oob_count = oob.sum(dtype=torch.int64)
        bad = oob if bad is None else bad | oob
    if bad is None:
        return topk_idx, repeats, oob_count
    return topk_idx.masked_fill(bad, -1), repeats, oob_count


def _count_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 number of NaN/inf values: ``t - t`` is NaN exactly there (3 ops)."""
    return torch.isnan(t - t).sum(dtype=torch.int64)


def count_bad_parts(
    topk_idx: torch.Tensor,
    num_experts: int,
    x: torch.Tensor,
    topk_probs: torch.Tensor,
    *,
    count_ids: bool = True,
    repeats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``count_bad_values`` as six 0-dim int64 device tensors (not stacked); with
    ``count_ids=False`` the last five only (the caller has the count of bad ids already:
    ``mask_bad_ids``). ``repeats``: the count of
    repeated ids when the caller has it (``mask_bad_ids``), else it is counted here."""
    device = topk_idx.device
    if repeats is None:
        if topk_idx.shape[1] >= 2:
            repeats = repeated_expert_slots(topk_idx).sum(dtype=torch.int64)
        else:
            repeats = torch.zeros((), dtype=torch.int64, device=device)
    parts = [
        _count_nonfinite(x).to(device),
        _count_nonfinite(topk_probs),
        repeats,
    ]
    if count_ids:
        parts.insert(0, topk_idx.clamp(-1, num_experts - 1).ne(topk_idx).sum(dtype=torch.int64))
    if topk_idx.numel():
        lo, hi = torch.aminmax(topk_idx)
        parts += [hi, lo]
    else:
        parts.append(torch.full((), _INT64.min, dtype=torch.int64, device=device))
        parts.append(torch.full((), _INT64.max, dtype=torch.int64, device=device))
    return tuple(parts)


def count_bad_values(
    topk_idx: torch.Tensor, num_experts: int, x: torch.Tensor, topk_probs: torch.Tensor
) -> torch.Tensor:
    """Sync-free ``[6]`` int64 device vector: ids outside ``[-1, E)``, NaN/inf values in ``x``,
    NaN/inf values in ``topk_probs``, repeated ids in one token (``BAD_VALUE_SLOTS``), then the
    largest and the smallest id (int64 min / max when there is none). When the first count is
    not zero, the largest id is the highest bad one if it is ``>= E`` and the smallest the
    lowest bad one if it is ``< -1`` (``bad_ids_message`` names only those)."""
    return torch.stack(count_bad_parts(topk_idx, num_experts, x, topk_probs))


def _fold_vectors(vectors: torch.Tensor) -> torch.Tensor:
    """``[n, 6]`` ``count_bad_values`` vectors -> one: counts summed, largest id max, smallest
    id min."""
    n = len(BAD_VALUE_SLOTS)
    return torch.cat(
        [vectors[:, :n].sum(0), vectors[:, n : n + 1].amax(0), vectors[:, n + 1 :].amin(0)]
    )


class BadValueLog:
    """Accumulates the device counts of bad dispatch inputs into ``stats.pending_bad_values``
    without a launch per dispatch.

    The first dispatch's ``count_bad_parts`` become ``stats.pending_bad_values`` (one stack);
    later ones are only kept (a list of 0-dim device tensors, no launch) and folded into it on
    the device every ``max_kept`` dispatches (a few launches, once) and before the counts are
    read (``fold``, at the safe point, which syncs anyway). While a CUDA graph is being captured
    they are added in place instead (``add_`` / ``maximum`` / ``minimum``: a kept list would
    hold one replay's tensors, replays must accumulate).
    """

    def __init__(self, max_kept: int = 64) -> None:
        self.max_kept = max_kept
        self._kept: list[tuple[torch.Tensor, ...]] = []

    def add(self, stats: DispatchStats, parts: tuple[torch.Tensor, ...]) -> None:
        """Count one dispatch's ``count_bad_parts`` into ``stats.pending_bad_values``."""
        acc = stats.pending_bad_values
        if acc is None:
            stats.pending_bad_values = torch.stack(parts)
            return
        if not (parts[0].is_cuda and tensors.is_capturing()):
            self._kept.append(parts)  # NOTE: no launch; folded later
            if len(self._kept) >= self.max_kept:
                self.fold(stats)
            return
        # NOTE: the kept counts stay out of the graph (folded eagerly later, into ``acc`` in place)
        counts = torch.stack(parts)
        n = len(BAD_VALUE_SLOTS)
        acc[:n].add_(counts[:n])
        torch.maximum(acc[n], counts[n], out=acc[n])
        torch.minimum(acc[n + 1], counts[n + 1], out=acc[n + 1])

    def read(self, stats: DispatchStats) -> None:
        """Move the device counts into ``stats.extra`` (one host sync; the safe point)."""
        self.fold(stats)
        acc = stats.pending_bad_values
        if acc is None:
            return
        vals = acc.tolist()
        stats.pending_bad_values = None
        extra = stats.extra
        n = len(BAD_VALUE_SLOTS)
        for key, v in zip(BAD_VALUE_SLOTS, vals[:n], strict=True):
            if v:
                extra[key] = extra.get(key, 0) + v
        if vals[0]:
            hi, lo = vals[n], vals[n + 1]
            extra["invalid_expert_id_highest"] = max(extra.get("invalid_expert_id_highest", hi), hi)
            extra["invalid_expert_id_lowest"] = min(extra.get("invalid_expert_id_lowest", lo), lo)

    def accumulator(self, stats: DispatchStats, device: torch.device) -> torch.Tensor:
        """``stats.pending_bad_values``, for a kernel that adds one dispatch's counts into it in
        place (``kernels.screen``); made neutral (zero counts, the int64 min / max as the largest
        / smallest id) when there is none yet. Kept counts are folded in later, as ever."""
        acc = stats.pending_bad_values
        if acc is None:
            acc = torch.zeros(len(BAD_VALUE_SLOTS) + 2, dtype=torch.int64, device=device)
            acc[-2].fill_(_INT64.min)
            acc[-1].fill_(_INT64.max)
            stats.pending_bad_values = acc
        return acc

    def fold(self, stats: DispatchStats) -> None:
        """Fold the kept counts into ``stats.pending_bad_values`` (on the device, no sync; in
        place, so that a captured graph keeps writing into the same tensor)."""
        if not self._kept:
            return
        acc = stats.pending_bad_values
        flat = [t for parts in self._kept for t in parts]
        self._kept.clear()
        rows = torch.stack(flat if acc is None else [*acc.unbind(), *flat])
        folded = _fold_vectors(rows.view(-1, len(BAD_VALUE_SLOTS) + 2))
        if acc is None:
            stats.pending_bad_values = folded
        else:
            acc.copy_(folded)


def bad_input_problems(extra: dict, num_experts: int) -> list[str]:
    """The error texts of the bad inputs ``BadValueLog.read`` moved into ``stats.extra``."""
    problems = []
    if extra.get("invalid_expert_ids", 0):
        problems.append(
            bad_ids_message(
                "topk_idx",
                extra["invalid_expert_ids"],
                extra["invalid_expert_id_lowest"],
                extra["invalid_expert_id_highest"],
                num_experts,
            )
        )
    for key, name in (("nonfinite_x", "x"), ("nonfinite_topk_probs", "topk_probs")):
        if extra.get(key, 0):
            problems.append(nonfinite_message(name, extra[key], past=True))
    if extra.get("repeated_expert_ids", 0):
        problems.append(repeated_ids_message(extra["repeated_expert_ids"]))
    return problems
