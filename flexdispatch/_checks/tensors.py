"""The tensor arguments of every public entry point: one vocabulary for their checks.

Checks on metadata (dtype, rank, shape, device: ``check_tensor``, ``check_routing`` for the
``(x, topk_idx, topk_probs)`` triplet) are free and always run. Checks on values (id ranges, NaN)
need a device-to-host sync on CUDA, so there they run only when enabled (``checks=True`` or the
environment variable ``FLEXDISPATCH_CHECKS=1``) and never while a CUDA graph is being captured
(``checks_enabled``). With checks off the dispatcher checks no value on any device
(``flexdispatch.dispatch.values``): the torch backend maps bad ids safely and counts them on the
device, and a safe point reads the count (``FlexDispatcher.check_overflow``); the DeepEP backends,
whose kernels must not see a bad id, get their ids screened, raising now on CPU and counted on the
device on CUDA. ``defer_value_checks`` picks that path from the tensor's device (tests force it to
drive the CUDA path on CPU).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

__all__ = [
    "check_tensor",
    "check_routing",
    "check_same_device",
    "checks_enabled",
    "checks_flag",
    "is_capturing",
    "check_ids_in_range",
    "check_finite",
    "defer_value_checks",
    "cuda_code_path",
    "check_fp8_rows",
]

_MAX_NAMED_IDS = 8


def is_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False on CPU-only builds)."""
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def checks_flag(flag: bool | None = None) -> bool:
    """``flag``, or where it is None ``FLEXDISPATCH_CHECKS`` (read now): whether value checks are
    asked for, before the capture test of ``checks_enabled``. A dispatcher reads it once, when it
    is built (its hot path then reads no environment)."""
    if flag is None:
        flag = os.environ.get("FLEXDISPATCH_CHECKS", "").strip().lower() in ("1", "true", "yes")
    return bool(flag)


def checks_enabled(flag: bool | None = None) -> bool:
    """Whether value checks (host syncs) may run: ``flag`` or ``FLEXDISPATCH_CHECKS``, never
    during CUDA-graph capture."""
    return checks_flag(flag) and not is_capturing()


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


def check_same_device(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise ValueError when ``value`` is not on ``ref``'s device."""
    if value.device != ref.device:
        raise ValueError(
            f"{name} is on {value.device} but {ref_name} is on {ref.device}: move both to the "
            f"same device"
        )


def check_routing(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_probs: torch.Tensor | None,
    *,
    any_float_probs: bool = False,
    needs_topk: bool = False,
) -> None:
    """The routing triplet every entry point takes: ``x`` ``[T, H]`` floating, ``topk_idx``
    ``[T, k]`` int64, ``topk_probs`` ``[T, k]`` float32 (any floating dtype with
    ``any_float_probs``; None allowed), all on ``x``'s device, and with ``needs_topk`` at least
    one column. Metadata only: no value is read."""
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    check_same_device("topk_idx", topk_idx, "x", x)
    T = x.shape[0]
    if topk_idx.shape[0] != T:
        raise ValueError(
            f"topk_idx has {topk_idx.shape[0]} rows but x has {T}: one row of expert ids per token"
        )
    if topk_probs is not None:
        dtypes = None if any_float_probs else (torch.float32,)
        check_tensor("topk_probs", topk_probs, dtypes=dtypes, ndim=2, floating=any_float_probs)
        check_same_device("topk_probs", topk_probs, "x", x)
        if topk_probs.shape != topk_idx.shape:
            raise ValueError(
                f"topk_probs has shape {tuple(topk_probs.shape)} but topk_idx has "
                f"{tuple(topk_idx.shape)}: pass the [T, k] probs that belong to topk_idx"
            )
    if needs_topk and topk_idx.shape[1] == 0:
        raise ValueError("topk_idx must have at least one column (k >= 1)")


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


def cuda_code_path(device: torch.device) -> bool:
    """Whether the hot path takes its CUDA branch on ``device`` (no host reads of values,
    synchronous collectives, no CPU memory reuse): True on CUDA. The op-count benchmark
    (``benchmarks/bench_ops.py``) and tests force it to run that branch on CPU."""
    return device.type == "cuda"


def defer_value_checks(device: torch.device) -> bool:
    """Whether value checks on ``device`` must be deferred (counted on the device, read at a safe
    point) because an immediate one would sync the host: True on CUDA, False on CPU."""
    return device.type == "cuda"


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
