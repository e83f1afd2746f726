"""Input validation shared by every public entry point.

Checks on metadata (dtype, rank, shape, device) are free and always run. Checks on values (id
ranges, NaN) need a device-to-host sync on CUDA, so there they run only when enabled
(``checks=True`` or the environment variable ``FLEXDISPATCH_CHECKS=1``) and never while a CUDA graph
is being captured. On CPU a value check costs no sync, so the dispatcher runs it always; on CUDA
without checks it counts the bad values on the device instead (``count_bad_values``) and a safe
point reads the count (``FlexDispatcher.check_overflow``). ``defer_value_checks`` picks the path
from the tensor's device (tests force it to drive the CUDA path on CPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "check_tensor",
    "checks_enabled",
    "is_capturing",
    "check_ids_in_range",
    "check_finite",
    "defer_value_checks",
    "cuda_code_path",
    "check_dispatch_values",
    "count_bad_values",
    "count_bad_parts",
    "repeated_expert_slots",
    "mask_bad_ids",
    "check_repeated_ids",
    "repeated_ids_message",
    "BadValueLog",
    "BAD_VALUE_SLOTS",
    "bad_ids_message",
    "bad_input_problems",
    "nonfinite_message",
    "check_fp8_rows",
]

_MAX_NAMED_IDS = 8
_INT64 = torch.iinfo(torch.int64)

BAD_VALUE_SLOTS = (
    "invalid_expert_ids",
    "nonfinite_x",
    "nonfinite_topk_probs",
    "repeated_expert_ids",
)
"""Names of the counters ``count_bad_values`` returns first (also the ``stats.extra`` keys); the
last two entries of its vector are the largest and the smallest bad id seen."""


def is_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False on CPU-only builds)."""
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def checks_enabled(flag: bool | None = None) -> bool:
    """Whether value checks (host syncs) may run: ``flag`` or ``FLEXDISPATCH_CHECKS``, never
    during CUDA-graph capture."""
    if flag is None:
        flag = os.environ.get("FLEXDISPATCH_CHECKS", "").strip().lower() in ("1", "true", "yes")
    return bool(flag) and not is_capturing()


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    floating: bool = False,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` when ``value`` is not a suitable tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_nested or value.layout != torch.strided:
        what = "a nested tensor" if value.is_nested else f"layout {value.layout}"
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got {what}: convert it with "
            f".to_dense() (or torch.nested.to_padded_tensor)"
        )
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(
            f"{name} must have dtype {_dtype_names(dtypes)}, got "
            f"{str(value.dtype).replace('torch.', '')}: convert it with .to(...)"
        )
    if floating and not value.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got {str(value.dtype).replace('torch.', '')}"
        )
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(value.shape)}")
    return value


def check_ids_in_range(name: str, ids: torch.Tensor, upper: int, *, hint: str = "") -> None:
    """Host-syncing check that every id is ``-1`` or in ``[0, upper)``; ``hint`` ends the
    message (the fix, in the caller's words)."""
    if ids.numel() == 0:
        return
    bad = (ids < -1) | (ids >= upper)
    if bool(bad.any()):
        first = ids[bad].flatten()[0].item()
        count = int(bad.sum().item())
        named = torch.unique(ids[bad])[:_MAX_NAMED_IDS].tolist()
        raise ValueError(
            f"{name} holds {count} id(s) outside [-1, {upper}) (first: {first}), distinct bad "
            f"ids {named}{' ...' if len(named) == _MAX_NAMED_IDS else ''}: expert ids must be -1 "
            f"(dropped) or in [0, {upper}){hint}"
        )


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


def cuda_code_path(device: torch.device) -> bool:
    """Whether the hot path takes its CUDA branch on ``device`` (no host reads of values,
    synchronous collectives, no CPU memory reuse): True on CUDA. The op-count benchmark
    (``benchmarks/bench_ops.py``) and tests force it to run that branch on CPU."""
    return device.type == "cuda"


def defer_value_checks(device: torch.device) -> bool:
    """Whether value checks on ``device`` must be deferred (counted on the device, read at a safe
    point) because an immediate one would sync the host: True on CUDA, False on CPU."""
    return device.type == "cuda"


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
    ``count_ids=False`` the last five only (the caller has the count of bad ids already: the
    torch backend's pair counts hold it, ``TorchA2ABackend.bad_ids``). ``repeats``: the count of
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

    def add(self, stats: Any, parts: tuple[torch.Tensor, ...]) -> None:
        """Count one dispatch's ``count_bad_parts`` into ``stats.pending_bad_values``."""
        acc = stats.pending_bad_values
        if acc is None:
            stats.pending_bad_values = torch.stack(parts)
            return
        if not is_capturing():
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

    def read(self, stats: Any) -> None:
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

    def accumulator(self, stats: Any, device: torch.device) -> torch.Tensor:
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

    def fold(self, stats: Any) -> None:
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


def check_finite(name: str, value: torch.Tensor) -> None:
    """Host-syncing check that ``value`` holds no NaN or inf."""
    if value.numel() and not bool(torch.isfinite(value).all()):
        n = int((~torch.isfinite(value)).sum().item())
        raise ValueError(f"{name} holds {n} NaN/inf value(s): check the inputs of the router")


_FP8_SCALE_BLOCK = 128  # DeepEP: one float32 scale per 128 channels of an fp8 row


def check_fp8_rows(x: tuple, backend_name: str) -> torch.Tensor:
    """Validate DeepEP's ``(x_fp8 [T, H], scales [T, ceil(H / 128)])`` tuple; return x_fp8."""
    if backend_name != "deepep":
        raise TypeError(
            f"x is an (fp8 rows, scales) tuple, which only the deepep backend takes, but this "
            f"dispatcher runs the {backend_name!r} backend: pass x as [T, H] bfloat16, "
            f"float16 or float32 rows (dequantize the fp8 rows first), or build the "
            f"dispatcher with DispatchConfig(backend='deepep')"
        )
    if len(x) != 2:
        raise TypeError(
            f"x as a tuple must be (x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H / 128)] "
            f"float32), got {len(x)} items"
        )
    rows, scales = x
    check_tensor("x[0] (fp8 rows)", rows, dtypes=(torch.float8_e4m3fn,), ndim=2)
    check_tensor("x[1] (fp8 scales)", scales, dtypes=(torch.float32,), ndim=2)
    T, H = rows.shape
    if H % 16:
        raise ValueError(
            f"x[0] has H={H} fp8 columns, but DeepEP moves rows in 16-byte units: pad the "
            f"hidden size to a multiple of 16"
        )
    n_scales = -(-H // _FP8_SCALE_BLOCK)
    if tuple(scales.shape) != (T, n_scales):
        raise ValueError(
            f"x[1] (fp8 scales) must have shape [{T}, {n_scales}] (one float32 scale per "
            f"{_FP8_SCALE_BLOCK} channels of each of the T={T} rows, ceil(H / "
            f"{_FP8_SCALE_BLOCK})), got {tuple(scales.shape)}"
        )
    if scales.device != rows.device:
        raise ValueError(
            f"x[1] (fp8 scales) is on {scales.device} but x[0] is on {rows.device}: move "
            f"them to one device"
        )
    if rows.requires_grad or scales.requires_grad:
        raise ValueError(
            "x is an (fp8 rows, scales) tuple that requires grad, but fp8 dispatch is "
            "forward-only (recv_x carries no gradient): pass (x[0].detach(), x[1].detach()), "
            "or dispatch bf16 rows to train through the dispatch"
        )
    return rows
