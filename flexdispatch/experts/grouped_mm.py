"""Where ``torch._grouped_mm`` runs, and without a host sync (``grouped_mm_support``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

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


# NOTE: torch 2.13's fake (meta) rule of ``torch._grouped_mm`` accepts bf16 only, although the CPU
# op runs fp32 and fp16 too; so ``torch.compile`` cannot trace an fp32 call. For those dtypes
# the experts call ``flexdispatch::grouped_mm`` while compiling: the same op inside, opaque to
# dynamo, with a fake rule of its own and the same backward (docs/compile.md).
@torch.library.custom_op("flexdispatch::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: ``[N, K] x [G, K, F] -> [N, F]`` (a row block
    per group), or ``[K, N] x [N, F] -> [G, K, F]`` (the weight gradient). Contiguous, as the
    fake rule describes it: on a CUDA build torch pads the output's rows to 16 bytes (an fp32
    F % 4 != 0 would otherwise differ from what the compiler planned)."""
    out = torch._grouped_mm(a, b, offs=offs)
    return out if out.is_contiguous() else out.contiguous()


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """The rules of ``torch._grouped_mm``'s own backward for ``[N, K] x [G, K, F]``:
    ``grad a = grad @ b^T`` per group, ``grad b[g] = a_g^T @ grad_g``."""
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = torch.ops.flexdispatch.grouped_mm(grad, b.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:
        gb = torch.ops.flexdispatch.grouped_mm(a.transpose(0, 1), grad, offs)
    return ga, gb, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``, through ``flexdispatch::grouped_mm`` where
    ``torch.compile`` cannot trace it (not bf16)."""
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return _grouped_mm_op(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)
