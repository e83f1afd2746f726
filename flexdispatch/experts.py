"""Grouped experts: the MLPs of the experts this rank holds, run over expert-major rows.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · F expert hidden
(``ffn_hidden_size``) · E experts in total · R ranks · e = E / R local experts · k top-k ·
M rows received by this rank. ``N`` here is the number of rows fed to the experts (the rows of a
``Permutation``), not the node count.

Two interchangeable paths compute the same thing:

- ``torch._grouped_mm`` (one call per weight for all experts, no host sync; segment ends are the
  int32 cumulative sum of ``tokens_per_expert``), used where the dtype, device and strides allow;
- a per-expert loop of plain matmuls, which needs the segment sizes on the host: exactly one
  ``tokens_per_expert.tolist()`` per forward (a device-to-host sync on an accelerator).

Weights are a pure function of a seed and the *global* expert id (``init_expert_weights``), so a
rank holding experts ``[r*e, (r+1)*e)`` and a single-process reference holding all E experts get
bit-identical weights.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flexdispatch._validate import check_tensor, checks_enabled, is_capturing

__all__ = [
    "ACTIVATIONS",
    "ExpertWeights",
    "GroupedExperts",
    "GroupedMMSupport",
    "expert_seed",
    "grouped_mm_support",
    "init_expert_weights",
]

ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu", "relu", "silu")
"""Names accepted for ``activation``: ``swiglu`` is ``silu(x @ w1) * (x @ w3) @ w2``; the others
are ``act(x @ w1) @ w2`` (``gelu`` is the exact, erf-based GELU)."""

_SEED_STRIDE = 1_000_003
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")


# --------------------------------------------------------------------------- initialisation


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    """The weights of one expert.

    Attributes:
        w1: ``[H, F]`` input projection (the gate for swiglu).
        w2: ``[F, H]`` output projection.
        w3: ``[H, F]`` up projection for swiglu, None for the other activations.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor | None


def expert_seed(global_expert_id: int, seed: int) -> int:
    """The generator seed of one expert: ``seed * 1_000_003 + global_expert_id``."""
    if global_expert_id < 0 or seed < 0:
        raise ValueError(
            f"global_expert_id ({global_expert_id}) and seed ({seed}) must be non-negative"
        )
    return seed * _SEED_STRIDE + global_expert_id


def _uniform(
    shape: tuple[int, ...], bound: float, generator: torch.Generator | None
) -> torch.Tensor:
    # NOTE: always drawn in fp32 on the CPU, then cast/moved by the caller, so the values do not
    # depend on the target device or dtype.
    return torch.rand(shape, generator=generator, dtype=torch.float32).mul_(2 * bound).sub_(bound)


def init_expert_weights(
    global_expert_id: int,
    seed: int,
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    activation: str = "swiglu",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ExpertWeights:
    """Weights of global expert ``g`` drawn from ``torch.Generator().manual_seed(seed * 1_000_003
    + g)``, independent of which rank holds the expert.

    Scheme: ``w1`` (then ``w2``, then ``w3`` for swiglu) drawn in that order, in fp32 on the CPU,
    uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` with ``fan_in = H`` for ``w1``/``w3`` and
    ``F`` for ``w2`` (``nn.Linear``'s default bound), then cast to ``dtype`` and moved to
    ``device``. ``w1`` and ``w2`` are the same for every activation given the same seed.

    Args:
        global_expert_id: g, the expert's id among all E experts (>= 0).
        seed: the model-wide seed (>= 0).
        hidden_size: H.
        ffn_hidden_size: F.
        activation: one of ``ACTIVATIONS``; only swiglu gets a ``w3``.
        dtype: dtype of the returned tensors.
        device: device of the returned tensors (default CPU).

    Returns:
        ``ExpertWeights`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3`` ``[H, F]`` or None.
    """
    _check_activation(activation)
    if hidden_size <= 0 or ffn_hidden_size <= 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) and ffn_hidden_size ({ffn_hidden_size}) must be positive"
        )
    gen = torch.Generator().manual_seed(expert_seed(global_expert_id, seed))
    H, F_ = hidden_size, ffn_hidden_size
    w1 = _uniform((H, F_), 1 / math.sqrt(H), gen)
    w2 = _uniform((F_, H), 1 / math.sqrt(F_), gen)
    w3 = _uniform((H, F_), 1 / math.sqrt(H), gen) if activation == "swiglu" else None
    return ExpertWeights(
        w1=w1.to(device=device, dtype=dtype),
        w2=w2.to(device=device, dtype=dtype),
        w3=None if w3 is None else w3.to(device=device, dtype=dtype),
    )


# --------------------------------------------------------------------------- grouped_mm support


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


# --------------------------------------------------------------------------- the module


class GroupedExperts(nn.Module):
    """The ``e`` experts of one rank, applied to rows grouped expert-major.

    Local expert ``j`` is global expert ``first_expert + j`` (``rank * e + j`` under contiguous
    sharding). Parameters: ``w1`` ``[e, H, F]``, ``w2`` ``[e, F, H]`` and, for swiglu, ``w3``
    ``[e, H, F]`` (``w3`` is None otherwise).

    Args:
        num_local_experts: e.
        hidden_size: H.
        ffn_hidden_size: F.
        activation: one of ``ACTIVATIONS``.
        dtype: parameter dtype; inputs must have the same dtype.
        device: parameter device.
        first_expert: global id of local expert 0.
        use_grouped_mm: None = ``torch._grouped_mm`` when it runs without a host sync for the
            input's dtype/device (see ``grouped_mm_support``), else the loop; True = always
            grouped_mm (raises when it cannot run); False = always the loop.

    Initialisation (``reset_parameters``): one stream from ``generator`` (default: the global
    torch RNG), drawn in fp32 on the CPU in the order ``w1`` ``[e, H, F]``, ``w2`` ``[e, F, H]``,
    ``w3`` ``[e, H, F]``, uniform in ``±1/sqrt(fan_in)``. ``reset_parameters_from_seed(seed)``
    instead gives every expert the weights of ``init_expert_weights(first_expert + j, seed)``.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        first_expert: int = 0,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__()
        _check_activation(activation)
        for name, value in (
            ("num_local_experts", num_local_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(first_expert, int) or first_expert < 0:
            raise ValueError(f"first_expert must be a non-negative int, got {first_expert!r}")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        if use_grouped_mm not in (None, True, False):
            raise TypeError(f"use_grouped_mm must be None, True or False, got {use_grouped_mm!r}")
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.first_expert = first_expert
        self.use_grouped_mm = use_grouped_mm
        e, H, F_ = num_local_experts, hidden_size, ffn_hidden_size
        kw = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(e, H, F_, **kw))
        self.w2 = nn.Parameter(torch.empty(e, F_, H, **kw))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(e, H, F_, **kw))
        else:
            self.register_parameter("w3", None)
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, "
            f"first_expert={self.first_expert}, use_grouped_mm={self.use_grouped_mm}"
        )

    @property
    def global_expert_ids(self) -> range:
        """Global ids of the local experts, ``first_expert .. first_expert + e - 1``."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def _weights(self) -> list[torch.Tensor]:
        return [w for w in (self.w1, self.w2, self.w3) if w is not None]

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Redraw all weights from ``generator`` (a CPU generator; default: the global RNG).

        Deterministic for a given generator state, whatever the parameter device or dtype.
        """
        H, F_ = self.hidden_size, self.ffn_hidden_size
        for w, fan_in in zip(self._weights(), (H, F_, H), strict=False):
            w.copy_(_uniform(tuple(w.shape), 1 / math.sqrt(fan_in), generator))

    @torch.no_grad()
    def reset_parameters_from_seed(self, seed: int) -> None:
        """Set local expert ``j`` to ``init_expert_weights(first_expert + j, seed)``: the same
        values that a process holding all experts gets for that global expert."""
        for j, g in enumerate(self.global_expert_ids):
            ew = init_expert_weights(
                g,
                seed,
                hidden_size=self.hidden_size,
                ffn_hidden_size=self.ffn_hidden_size,
                activation=self.activation,
            )
            self.w1[j].copy_(ew.w1)
            self.w2[j].copy_(ew.w2)
            if self.w3 is not None and ew.w3 is not None:
                self.w3[j].copy_(ew.w3)

    def grouped_mm_support(self, x: torch.Tensor) -> GroupedMMSupport:
        """``grouped_mm_support`` for this module's shapes and ``x``'s dtype and device."""
        return grouped_mm_support(x.dtype, x.device, self.hidden_size, self.ffn_hidden_size)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is False:
            return False
        support = self.grouped_mm_support(x)
        if self.use_grouped_mm is None:
            return support.runs and support.host_sync_free
        if not support.runs:
            raise RuntimeError(
                f"use_grouped_mm=True but {support.reason}; pass use_grouped_mm=None (auto) or "
                f"False to use the per-expert loop"
            )
        return True

    # ----------------------------------------------------------------------- forward

    def _validate(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor | None
    ) -> None:
        check_tensor("x", x, ndim=2, floating=True)
        if x.shape[1] != self.hidden_size:
            raise ValueError(
                f"x has {x.shape[1]} columns but the experts were built with hidden_size="
                f"{self.hidden_size}: pass rows of shape [N, {self.hidden_size}]"
            )
        if x.dtype != self.w1.dtype or x.device != self.w1.device:
            raise TypeError(
                f"x is {x.dtype} on {x.device} but the expert weights are {self.w1.dtype} on "
                f"{self.w1.device}: convert x with .to(...) or move the module"
            )
        check_tensor(
            "tokens_per_expert", tokens_per_expert, dtypes=(torch.int32, torch.int64), ndim=1
        )
        if tokens_per_expert.shape[0] != self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert.shape[0]} entries but there are "
                f"{self.num_local_experts} local experts: pass one row count per local expert"
            )
        if probs is not None:
            check_tensor("probs", probs, ndim=1, floating=True)
            if probs.shape[0] != x.shape[0]:
                raise ValueError(
                    f"probs has {probs.shape[0]} entries but x has {x.shape[0]} rows: pass one "
                    f"routing weight per row of x"
                )
            if probs.device != x.device:
                raise ValueError(
                    f"probs is on {probs.device} but x is on {x.device}: move probs to x's device"
                )

    @staticmethod
    def _check_sizes(sizes: list[int], num_rows: int) -> None:
        if any(n < 0 for n in sizes) or sum(sizes) > num_rows:
            raise ValueError(
                f"tokens_per_expert={sizes} must be non-negative and sum to at most the "
                f"{num_rows} rows of x: pass the (padded) segment sizes of the permuted rows"
            )

    def _act(self, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.activation == "swiglu":
            return F.silu(a) * b
        if self.activation == "silu":
            return F.silu(a)
        if self.activation == "gelu":
            return F.gelu(a)
        return F.relu(a)

    def _forward_loop(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if is_capturing():
            raise RuntimeError(
                "the per-expert loop reads tokens_per_expert on the host, which a CUDA graph "
                "cannot capture: use bf16 on an sm90/sm100 GPU with use_grouped_mm=None or True"
            )
        sizes = tokens_per_expert.tolist()  # NOTE: the loop path's one host sync.
        N = x.shape[0]
        self._check_sizes(sizes, N)
        w1s, w2s = self.w1.unbind(0), self.w2.unbind(0)
        w3s = self.w3.unbind(0) if self.w3 is not None else [None] * self.num_local_experts
        outs = []
        start = 0
        # NOTE: empty experts still run (a [0, H] matmul) so every weight takes part in autograd.
        for n, w1, w2, w3 in zip(sizes, w1s, w2s, w3s, strict=True):
            seg = x[start : start + n]
            outs.append(self._act(seg @ w1, None if w3 is None else seg @ w3) @ w2)
            start += n
        if start < N:
            outs.append(x.new_zeros(N - start, self.hidden_size))
        return torch.cat(outs)

    def _forward_grouped(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        N = x.shape[0]
        if x.data_ptr() % 16:
            x = x.clone()  # NOTE: the CUDA kernel needs a 16-byte aligned base pointer.
        x = x.contiguous()
        # NOTE: clamped so that a bad sum can never make the op read past x (checks mode reports
        # it); no host sync.
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32).clamp_(max=N)
        # NOTE: _grouped_mm leaves rows past offs[-1] (outputs and input grads) uninitialised;
        # `where` (not a multiply) discards them, NaN included.
        valid = (torch.arange(N, device=x.device) < offs[-1]).unsqueeze(1)
        x = torch.where(valid, x, 0)
        a = torch._grouped_mm(x, self.w1, offs=offs)
        b = torch._grouped_mm(x, self.w3, offs=offs) if self.w3 is not None else None
        y = torch._grouped_mm(self._act(a, b), self.w2, offs=offs)
        return torch.where(valid, _ContiguousGrad.apply(y), 0)

    def forward(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        probs: torch.Tensor | None = None,
        *,
        checks: bool | None = None,
    ) -> torch.Tensor:
        """Run each local expert on its segment of rows.

        Args:
            x: ``[N, H]`` rows grouped expert-major (``Permutation.x``), dtype and device of the
                weights.
            tokens_per_expert: ``[e]`` int32/int64 segment sizes (``padded_tokens_per_expert``);
                expert ``j`` owns rows ``[sum(sizes[:j]), sum(sizes[:j+1]))``. The sum may be
                below N: trailing rows are ignored and their output is 0. The loop path reads
                it on the host once (one sync); the grouped path never does.
            probs: ``[N]`` floating routing weight of each row, or None. Applied inside the
                expert path, ``y = prob * expert(x_row)``, in fp32 (fp64 for fp64 inputs), then
                cast to ``x``'s dtype; ``probs`` gets its gradient here.
            checks: run the host-syncing value checks of the grouped path (non-negative sizes,
                sum <= N); default ``FLEXDISPATCH_CHECKS``. The loop path always checks.

        Returns:
            ``[N, H]`` expert outputs in ``x``'s dtype, 0 on rows past the last segment.
        """
        self._validate(x, tokens_per_expert, probs)
        if self._use_grouped(x):
            if checks_enabled(checks):
                self._check_sizes(tokens_per_expert.tolist(), x.shape[0])
            y = self._forward_grouped(x, tokens_per_expert)
        else:
            y = self._forward_loop(x, tokens_per_expert)
        if probs is None:
            return y
        compute = torch.promote_types(torch.promote_types(torch.float32, x.dtype), probs.dtype)
        return (y.to(compute) * probs.to(compute).unsqueeze(1)).to(x.dtype)
