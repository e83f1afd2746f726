"""Where ``torch._grouped_mm`` runs, and without a host sync (``grouped_mm_support``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@dataclass(frozen=True, kw_only=True)
class GroupedMMSupport:
    """Whether ``torch._grouped_mm`` can serve a configuration.

    Attributes:
        runs: the op accepts this dtype/device/shape (``use_grouped_mm=True`` is allowed).
        host_sync_free: it runs without a device-to-host sync (what ``use_grouped_mm=None``
            requires before it picks the grouped path).
        reason: why, in words.
    """

    runs: bool
    host_sync_free: bool
    reason: str


def grouped_mm_support(
    dtype: torch.dtype, device: torch.device | str, hidden_size: int, ffn_hidden_size: int
) -> GroupedMMSupport:
    """What ``torch._grouped_mm`` offers for expert weights ``[e, H, F]`` / ``[e, F, H]``.

    Rules (checked on torch 2.13 CPU; CUDA rules from PyTorch's dispatch code): fp32, bf16 and
    fp16 only; every row stride a multiple of 16 bytes, i.e. ``H`` and ``F`` multiples of 4 (fp32)
    or 8 (bf16/fp16). CPU runs a per-group matmul loop inside the op (torch >= 2.9). CUDA runs
    the CUTLASS kernel, with no host sync, for bf16 on compute capability 9.x/10.x (not ROCm, not
    Windows); other dtypes or GPUs (sm80+, torch >= 2.9) take torch's fallback, which copies the
    offsets to the host.
    """
    device = torch.device(device)
    if getattr(torch, "_grouped_mm", None) is None:
        return GroupedMMSupport(
            runs=False,
            host_sync_free=False,
            reason=f"torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8)",
        )
    if dtype not in _GROUPED_MM_DTYPES:
        return GroupedMMSupport(
            runs=False,
            host_sync_free=False,
            reason=f"torch._grouped_mm takes fp32, bf16 or fp16, not {dtype}",
        )
    size = torch.empty((), dtype=dtype).element_size()
    if (hidden_size * size) % 16 or (ffn_hidden_size * size) % 16:
        return GroupedMMSupport(
            runs=False,
            host_sync_free=False,
            reason=(
                f"torch._grouped_mm needs 16-byte row strides: hidden_size={hidden_size} and "
                f"ffn_hidden_size={ffn_hidden_size} must be multiples of {16 // size} for {dtype}"
            ),
        )
    version = _torch_version()
    if device.type == "cpu":
        if version < (2, 9):
            return GroupedMMSupport(
                runs=False,
                host_sync_free=False,
                reason=f"torch {torch.__version__} has no CPU torch._grouped_mm (torch >= 2.9)",
            )
        return GroupedMMSupport(
            runs=True, host_sync_free=True, reason="CPU: torch._grouped_mm's per-group loop"
        )
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        fast = (
            dtype == torch.bfloat16
            and major in (9, 10)
            and torch.version.hip is None
            and sys.platform != "win32"
        )
        if fast:
            return GroupedMMSupport(
                runs=True,
                host_sync_free=True,
                reason=f"CUDA sm{major}{minor} bf16: CUTLASS grouped GEMM, no host sync",
            )
        if version >= (2, 9) and major >= 8:
            return GroupedMMSupport(
                runs=True,
                host_sync_free=False,
                reason=(
                    f"CUDA sm{major}{minor} {dtype}: torch's grouped_mm fallback copies the "
                    f"offsets to the host (the fast kernel needs bf16 on sm90/sm100)"
                ),
            )
        return GroupedMMSupport(
            runs=False,
            host_sync_free=False,
            reason=f"torch {torch.__version__} has no grouped_mm for sm{major}{minor} {dtype}",
        )
    return GroupedMMSupport(
        runs=False,
        host_sync_free=False,
        reason=f"torch._grouped_mm is not used on device type {device.type!r}",
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``_grouped_mm``'s backward
    rejects the stride-0 gradients that ``.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()
