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
    "GATED_ACTIVATIONS",
    "SharedExperts",
    "apply_activation",
    "ExpertWeights",
    "GroupedExperts",
    "GroupedMMSupport",
    "expert_seed",
    "grouped_mm_support",
    "init_expert_weights",
]

ACTIVATIONS: tuple[str, ...] = ("swiglu", "swiglu_oai", "gelu", "relu", "relu2", "silu")
"""Names accepted for ``activation``. With ``a = x @ w1 (+ b1)`` (the gate) and ``b = x @ w3
(+ b3)`` (the up projection) the expert is ``act(a, b) @ w2 (+ b2)`` where ``act`` is:

- ``swiglu``: ``silu(a) * b``; with ``swiglu_limit`` L, ``a`` is first clamped to ``<= L`` and
  ``b`` to ``[-L, L]``;
- ``swiglu_oai`` (gpt-oss): ``a' = min(a, L)``, ``b' = clamp(b, -L, L)``,
  ``a' * sigmoid(alpha * a') * (b' + 1)`` (``swiglu_limit`` L required, ``swiglu_alpha``
  default 1.702);
- ``gelu`` (exact, erf-based), ``relu``, ``silu``: ``act(a)``; ``relu2``: ``relu(a) ** 2``.

Only the two gated ones (``GATED_ACTIVATIONS``) have ``w3``."""

GATED_ACTIVATIONS: tuple[str, ...] = ("swiglu", "swiglu_oai")
_OAI_DEFAULT_ALPHA = 1.702

_SEED_STRIDE = 1_000_003
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _check_activation(
    activation: str, swiglu_limit: float | None = None, swiglu_alpha: float | None = None
) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
    if swiglu_limit is not None:
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"swiglu_limit={swiglu_limit} applies to {GATED_ACTIVATIONS}, not "
                f"activation={activation!r}"
            )
        if not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {swiglu_limit}")
    if activation == "swiglu_oai" and swiglu_limit is None:
        raise ValueError("activation='swiglu_oai' needs swiglu_limit (gpt-oss: 7.0)")
    if swiglu_alpha is not None:
        if activation != "swiglu_oai":
            raise ValueError(
                f"swiglu_alpha={swiglu_alpha} belongs to activation='swiglu_oai', not "
                f"{activation!r}"
            )
        if not swiglu_alpha > 0:
            raise ValueError(f"swiglu_alpha must be positive, got {swiglu_alpha}")


def apply_activation(
    a: torch.Tensor,
    b: torch.Tensor | None,
    activation: str,
    *,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """``act(a, b)`` of ``ACTIVATIONS``: ``a`` the gate projection, ``b`` the up projection
    (gated activations only, else None). Shapes are equal; the result has their shape."""
    if activation in GATED_ACTIVATIONS:
        if b is None:
            raise ValueError(f"activation {activation!r} needs the up projection (w3)")
        if swiglu_limit is not None:
            a = a.clamp(max=swiglu_limit)
            b = b.clamp(min=-swiglu_limit, max=swiglu_limit)
        if activation == "swiglu":
            return F.silu(a) * b
        if swiglu_limit is None:
            raise ValueError("activation='swiglu_oai' needs swiglu_limit")
        alpha = _OAI_DEFAULT_ALPHA if swiglu_alpha is None else swiglu_alpha
        return a * torch.sigmoid(alpha * a) * (b + 1)
    if activation == "silu":
        return F.silu(a)
    if activation == "gelu":
        return F.gelu(a)
    if activation == "relu":
        return F.relu(a)
    if activation == "relu2":
        return F.relu(a).square()
    raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")


# --------------------------------------------------------------------------- initialisation


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    """The weights of one expert.

    Attributes:
        w1: ``[H, F]`` input projection (the gate for swiglu).
        w2: ``[F, H]`` output projection.
        w3: ``[H, F]`` up projection for the gated activations, None for the others.
        b1, b2, b3: biases ``[F]``, ``[H]``, ``[F]`` of the three projections (``bias=True``;
            ``b3`` only with ``w3``), else None.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor | None
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    b3: torch.Tensor | None = None


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
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ExpertWeights:
    """Weights of global expert ``g`` drawn from ``torch.Generator().manual_seed(seed * 1_000_003
    + g)``, independent of which rank holds the expert.

    Scheme: ``w1`` (then ``w2``, then ``w3`` for a gated activation) drawn in that order, then
    with ``bias`` ``b1``, ``b2``, ``b3`` (same bounds as their weights), in fp32 on the CPU,
    uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` with ``fan_in = H`` for ``w1``/``w3`` and
    ``F`` for ``w2`` (``nn.Linear``'s default bound), then cast to ``dtype`` and moved to
    ``device``. ``w1`` and ``w2`` are the same for every activation given the same seed.

    Args:
        global_expert_id: g, the expert's id among all E experts (>= 0).
        seed: the model-wide seed (>= 0).
        hidden_size: H.
        ffn_hidden_size: F.
        activation: one of ``ACTIVATIONS``; only the gated ones get a ``w3``.
        bias: also draw the projection biases (after the weights, which are unchanged).
        dtype: dtype of the returned tensors.
        device: device of the returned tensors (default CPU).

    Returns:
        ``ExpertWeights`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3`` ``[H, F]`` or None.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
    if hidden_size <= 0 or ffn_hidden_size <= 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) and ffn_hidden_size ({ffn_hidden_size}) must be positive"
        )
    gen = torch.Generator().manual_seed(expert_seed(global_expert_id, seed))
    H, F_ = hidden_size, ffn_hidden_size
    w1 = _uniform((H, F_), 1 / math.sqrt(H), gen)
    w2 = _uniform((F_, H), 1 / math.sqrt(F_), gen)
    gated = activation in GATED_ACTIVATIONS
    w3 = _uniform((H, F_), 1 / math.sqrt(H), gen) if gated else None
    b1 = b2 = b3 = None
    if bias:
        b1 = _uniform((F_,), 1 / math.sqrt(H), gen)
        b2 = _uniform((H,), 1 / math.sqrt(F_), gen)
        b3 = _uniform((F_,), 1 / math.sqrt(H), gen) if gated else None

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype)

    return ExpertWeights(
        w1=w1.to(device=device, dtype=dtype),
        w2=w2.to(device=device, dtype=dtype),
        w3=cast(w3),
        b1=cast(b1),
        b2=cast(b2),
        b3=cast(b3),
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
    sharding). Parameters: ``w1`` ``[e, H, F]``, ``w2`` ``[e, F, H]`` and, for a gated activation,
    ``w3`` ``[e, H, F]`` (``w3`` is None otherwise); with ``bias`` also ``b1`` ``[e, F]``, ``b2``
    ``[e, H]`` and (gated) ``b3`` ``[e, F]`` (None otherwise).

    Args:
        num_local_experts: e.
        hidden_size: H.
        ffn_hidden_size: F.
        activation: one of ``ACTIVATIONS``.
        swiglu_limit: clamp of a gated activation (see ``ACTIVATIONS``); required by
            ``swiglu_oai``.
        swiglu_alpha: ``swiglu_oai``'s sigmoid slope (default 1.702).
        bias: the three projections carry biases (gpt-oss).
        probs_on_input: ``forward``'s ``probs`` scale each row's *input* (``expert(p * x)``,
            Llama-4) instead of its output.
        dtype: parameter dtype; inputs must have the same dtype.
        device: parameter device.
        first_expert: global id of local expert 0.
        use_grouped_mm: None = ``torch._grouped_mm`` when it runs without a host sync for the
            input's dtype/device (see ``grouped_mm_support``), else the loop; True = always
            grouped_mm (raises when it cannot run); False = always the loop.

    Initialisation (``reset_parameters``): one stream from ``generator`` (default: the global
    torch RNG), drawn in fp32 on the CPU in the order ``w1`` ``[e, H, F]``, ``w2`` ``[e, F, H]``,
    ``w3`` ``[e, H, F]``, then ``b1``, ``b2``, ``b3``, uniform in ``±1/sqrt(fan_in)``.
    ``reset_parameters_from_seed(seed)`` instead gives every expert the weights of
    ``init_expert_weights(first_expert + j, seed)``.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        swiglu_limit: float | None = None,
        swiglu_alpha: float | None = None,
        bias: bool = False,
        probs_on_input: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        first_expert: int = 0,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__()
        _check_activation(activation, swiglu_limit, swiglu_alpha)
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
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.bias = bool(bias)
        self.probs_on_input = bool(probs_on_input)
        self.first_expert = first_expert
        self.use_grouped_mm = use_grouped_mm
        e, H, F_ = num_local_experts, hidden_size, ffn_hidden_size
        kw = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(e, H, F_, **kw))
        self.w2 = nn.Parameter(torch.empty(e, F_, H, **kw))
        gated = activation in GATED_ACTIVATIONS
        if gated:
            self.w3 = nn.Parameter(torch.empty(e, H, F_, **kw))
        else:
            self.register_parameter("w3", None)
        for name, shape, present in (
            ("b1", (e, F_), bias),
            ("b2", (e, H), bias),
            ("b3", (e, F_), bias and gated),
        ):
            if present:
                self.register_parameter(name, nn.Parameter(torch.empty(*shape, **kw)))
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, "
            f"swiglu_limit={self.swiglu_limit}, swiglu_alpha={self.swiglu_alpha}, "
            f"bias={self.bias}, probs_on_input={self.probs_on_input}, "
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
        for b, fan_in in ((self.b1, H), (self.b2, F_), (self.b3, H)):
            if b is not None:
                b.copy_(_uniform(tuple(b.shape), 1 / math.sqrt(fan_in), generator))

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
                bias=self.bias,
            )
            for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
                mine, theirs = getattr(self, name), getattr(ew, name)
                if mine is not None and theirs is not None:
                    mine[j].copy_(theirs)

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
        return apply_activation(
            a,
            b,
            self.activation,
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
        )

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
        none = [None] * self.num_local_experts

        def split(t: torch.Tensor | None) -> list:
            return list(t.unbind(0)) if t is not None else none

        w3s, b1s, b2s, b3s = split(self.w3), split(self.b1), split(self.b2), split(self.b3)
        outs = []
        start = 0
        # NOTE: empty experts still run (a [0, H] matmul) so every weight takes part in autograd.
        for n, w1, w2, w3, b1, b2, b3 in zip(sizes, w1s, w2s, w3s, b1s, b2s, b3s, strict=True):
            seg = x[start : start + n]
            a = seg @ w1 if b1 is None else seg @ w1 + b1
            b = None if w3 is None else (seg @ w3 if b3 is None else seg @ w3 + b3)
            y = self._act(a, b) @ w2
            outs.append(y if b2 is None else y + b2)
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
        if self.b1 is not None:
            # NOTE: each row's local expert from the segment ends, on the device (no host sync).
            # Rows past offs[-1] take no bias: the op's gradient there is uninitialised, and
            # `where` keeps it out of the biases' gradients (NaN included).
            row_expert = torch.searchsorted(
                offs, torch.arange(N, device=x.device, dtype=torch.int32), right=True
            ).clamp_(max=self.num_local_experts - 1)
            a = a + torch.where(valid, self.b1[row_expert], 0)
            if b is not None and self.b3 is not None:
                b = b + torch.where(valid, self.b3[row_expert], 0)
        y = torch._grouped_mm(self._act(a, b), self.w2, offs=offs)
        if self.b2 is not None:
            y = y + self.b2[row_expert]
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
                expert path, ``y = prob * expert(x_row)`` (``expert(prob * x_row)`` with
                ``probs_on_input``), in fp32 (fp64 for fp64 inputs), then cast to ``x``'s
                dtype; ``probs`` gets its gradient here.
            checks: run the host-syncing value checks of the grouped path (non-negative sizes,
                sum <= N); default ``FLEXDISPATCH_CHECKS``. The loop path always checks.

        Returns:
            ``[N, H]`` expert outputs in ``x``'s dtype, 0 on rows past the last segment.
        """
        self._validate(x, tokens_per_expert, probs)
        if probs is not None and self.probs_on_input:
            compute = torch.promote_types(torch.promote_types(torch.float32, x.dtype), probs.dtype)
            x = (x.to(compute) * probs.to(compute).unsqueeze(1)).to(x.dtype)
            probs = None
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


# --------------------------------------------------------------------------- shared experts


class SharedExperts(nn.Module):
    """The shared experts of a layer, fused into one dense MLP that every token goes through.

    ``y = act(x @ w1, x @ w3) @ w2`` with ``w1`` ``[H, F]``, ``w2`` ``[F, H]``, ``w3`` ``[H, F]``
    (gated activations only), F the fused hidden size (``num_shared_experts`` experts of F_s
    concatenated along F are this one MLP of ``F = num_shared_experts * F_s``). With ``gate``,
    a ``Linear(H, 1)`` without bias scales the output: ``y * sigmoid(x @ gate_weight.T)``
    (Qwen2-MoE's ``shared_expert_gate``); the gate is computed in fp32.

    Weights come from ``reset_parameters_from_seed(seed, expert_id)``: the MLP weights are
    ``init_expert_weights(expert_id, seed, ffn_hidden_size=F)`` (``MoELayer`` passes
    ``expert_id = E``, the id after the routed experts, so no routed expert shares a stream) and
    the gate weight is drawn uniform in ``±1/sqrt(H)`` from ``expert_seed(expert_id + 1, seed)``.

    Args:
        hidden_size: H.
        ffn_hidden_size: F of the fused MLP.
        activation, swiglu_limit, swiglu_alpha: as ``GroupedExperts``.
        gate: add the sigmoid gate.
        dtype, device: of the parameters (inputs must match).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        swiglu_limit: float | None = None,
        swiglu_alpha: float | None = None,
        gate: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _check_activation(activation, swiglu_limit, swiglu_alpha)
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        kw = {"dtype": dtype, "device": device}
        H, F_ = hidden_size, ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(H, F_, **kw))
        self.w2 = nn.Parameter(torch.empty(F_, H, **kw))
        if activation in GATED_ACTIVATIONS:
            self.w3 = nn.Parameter(torch.empty(H, F_, **kw))
        else:
            self.register_parameter("w3", None)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, H, **kw))
        else:
            self.register_parameter("gate_weight", None)
        self.reset_parameters_from_seed(0, 0)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation!r}, gate={self.gate_weight is not None}"
        )

    @torch.no_grad()
    def reset_parameters_from_seed(self, seed: int, expert_id: int) -> None:
        """Set the weights from ``seed`` and ``expert_id`` (see the class docstring)."""
        ew = init_expert_weights(
            expert_id,
            seed,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            activation=self.activation,
        )
        self.w1.copy_(ew.w1)
        self.w2.copy_(ew.w2)
        if self.w3 is not None and ew.w3 is not None:
            self.w3.copy_(ew.w3)
        if self.gate_weight is not None:
            gen = torch.Generator().manual_seed(expert_seed(expert_id + 1, seed))
            self.gate_weight.copy_(
                _uniform(tuple(self.gate_weight.shape), 1 / math.sqrt(self.hidden_size), gen)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` → ``[T, H]`` in ``x``'s dtype."""
        check_tensor("x", x, ndim=2, floating=True)
        if x.shape[1] != self.hidden_size:
            raise ValueError(
                f"x has {x.shape[1]} columns but the shared experts were built with "
                f"hidden_size={self.hidden_size}"
            )
        b = None if self.w3 is None else x @ self.w3
        a = x @ self.w1
        y = apply_activation(
            a, b, self.activation, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha
        )
        y = y @ self.w2
        if self.gate_weight is None:
            return y
        g = torch.sigmoid(x.float() @ self.gate_weight.float().t())
        return (y.float() * g).to(x.dtype)
