"""The deferred value checks of a dispatch as one Triton launch (``_screen_src.screen_inputs``).

On CUDA without checks the dispatcher may not read values on the host (a sync), so it counts the
bad ones on the device and raises at the safe point (``check_overflow``). In torch ops that is
about 16 launches per dispatch (``dispatch.values.mask_bad_ids`` and ``count_bad_parts``: a ``[T, k,
k]`` comparison, ``x - x`` over all of ``x`` and its NaN test, sums, ``aminmax``) and a stack or
a fold of the counts later; the kernel reads the ids, the probs and the values once and adds its
counts straight into the dispatcher's pending vector (``BadValueLog.accumulator``), so a
CUDA-graph replay accumulates like an eager call.
"""

from __future__ import annotations

import torch

from flexdispatch.kernels._triton import Kernel, dispatch_kernels, next_pow2

__all__ = ["screen_inputs", "screen_on_device"]

_KERNEL: Kernel | None = None
_TILE = 4096  # values per program and chunk (BLOCK_T x BLOCK_V)


def screen_on_device(device: torch.device) -> bool:
    """Whether the dispatcher's deferred value checks on ``device`` run as this kernel rather
    than as torch ops: on CUDA when ``triton`` imports (the backend then gets ids that are clean
    already), unless ``FLEXDISPATCH_DISPATCH_KERNELS=0`` (``_triton.dispatch_kernels``)."""
    return device.type == "cuda" and dispatch_kernels()


def screen_inputs(
    topk_idx: torch.Tensor,
    num_experts: int,
    values: torch.Tensor,
    topk_probs: torch.Tensor,
    acc: torch.Tensor,
) -> torch.Tensor:
    """``dispatch.values.mask_bad_ids(topk_idx, E, out_of_range=True)``'s ids, with the dispatcher's
    deferred counts (``dispatch.values.count_bad_parts`` with the repeats of ids in ``[0, E)``, the
    ``BadValueLog`` layout) added into ``acc`` in place (``[6]`` int64 on the ids' device: counts
    added, the largest id by max, the smallest by min), in one launch and without a host read.

    Args:
        topk_idx: ``[T, k]`` int64 ids. values: ``[T, V]`` floating rows (``x``, or the fp8
            scales). topk_probs: ``[T, k]`` float32. All on one device.

    Returns:
        ``[T, k]`` int64: a new tensor, every id that is repeated within its token (after its
        first slot) or outside ``[-1, E)`` set to -1.
    """
    global _KERNEL
    T, k = topk_idx.shape
    out = torch.empty((T, k), dtype=torch.int64, device=topk_idx.device)
    if T == 0:
        return out
    idx, probs, vals = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (topk_idx, topk_probs, values)
    )
    V = vals.shape[1]
    k_pad = next_pow2(k)
    block_t = max(1, min(16, 1024 // (k_pad * k_pad)))
    block_v = max(16, min(next_pow2(V), _TILE // block_t))
    if _KERNEL is None:
        from flexdispatch.kernels import _screen_src

        _KERNEL = Kernel(_screen_src.screen_inputs)
    _KERNEL.get()[(-(-T // block_t),)](
        idx,
        probs,
        vals,
        out,
        acc,
        T,
        num_experts,
        idx.stride(0),
        probs.stride(0),
        vals.stride(0),
        K=k,
        K_PAD=k_pad,
        V=V,
        BLOCK_T=block_t,
        BLOCK_V=block_v,
    )
    return out
