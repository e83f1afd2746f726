"""``GroupedExperts``: the MLPs of this rank's experts over expert-major rows."""

from __future__ import annotations

import math

import torch
from torch import nn

from flexdispatch._checks.tensors import check_tensor, checks_enabled, is_capturing
from flexdispatch.experts.activations import GATED_ACTIVATIONS, _check_activation, apply_activation
from flexdispatch.experts.grouped_mm import (
    GroupedMMSupport,
    _ContiguousGrad,
    grouped_mm,
    grouped_mm_support,
)
from flexdispatch.experts.init import _uniform, draw_into, expert_draws, expert_generator


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
        device: parameter device; the weights are drawn there (``"meta"``: shapes only,
            nothing drawn; materialise with ``to_empty(device=...)`` then
            ``reset_parameters_from_seed(seed)``).
        first_expert: global id of local expert 0.
        seed: draw the weights with ``reset_parameters_from_seed(seed)`` on ``device`` (what
            ``MoELayer`` does); None = ``reset_parameters()`` from torch's global CPU RNG.
        use_grouped_mm: None = ``torch._grouped_mm`` when it runs without a host sync for the
            input's dtype/device (see ``grouped_mm_support``), else the loop; True = always
            grouped_mm (raises when it cannot run); False = always the loop.

    Initialisation with ``seed`` (``reset_parameters_from_seed``): every expert gets the weights
    of ``init_expert_weights(first_expert + j, seed, device=device)``, drawn on the parameters'
    device by one generator per expert, straight into the parameters (fp32) or through one
    reused fp32 buffer per shape (other dtypes): any expert split gives the same values on the
    same device. Without it (``reset_parameters``): one stream from ``generator`` (default: the
    global torch RNG), drawn in fp32 on the CPU in the order ``w1`` ``[e, H, F]``, ``w2``
    ``[e, F, H]``, ``w3`` ``[e, H, F]``, then ``b1``, ``b2``, ``b3``, uniform in
    ``±1/sqrt(fan_in)``. On ``device="meta"`` neither draws anything.
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
        seed: int | None = None,
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
        if seed is not None:
            self.reset_parameters_from_seed(seed)
        else:
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

        Deterministic for a given generator state, whatever the parameter device or dtype. A
        no-op on the meta device.
        """
        if self.w1.device.type == "meta":
            return
        H, F_ = self.hidden_size, self.ffn_hidden_size
        for w, fan_in in zip(self._weights(), (H, F_, H), strict=False):
            w.copy_(_uniform(tuple(w.shape), 1 / math.sqrt(fan_in), generator))
        for b, fan_in in ((self.b1, H), (self.b2, F_), (self.b3, H)):
            if b is not None:
                b.copy_(_uniform(tuple(b.shape), 1 / math.sqrt(fan_in), generator))

    @torch.no_grad()
    def reset_parameters_from_seed(self, seed: int) -> None:
        """Set local expert ``j`` to ``init_expert_weights(first_expert + j, seed)`` drawn on the
        parameters' device: the values a process holding all experts on that device gets for
        that global expert. A no-op on the meta device (nothing to draw)."""
        device = self.w1.device
        if device.type == "meta":
            return
        draws = expert_draws(
            self.hidden_size,
            self.ffn_hidden_size,
            gated=self.w3 is not None,
            bias=self.bias,
        )
        scratch: dict[tuple[int, ...], torch.Tensor] = {}
        for j, g in enumerate(self.global_expert_ids):
            gen = expert_generator(g, seed, device)
            for name, _, bound in draws:
                draw_into(getattr(self, name)[j], bound, gen, scratch)

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
        if not torch.compiler.is_compiling() and x.data_ptr() % 16:
            # NOTE: the CUDA kernel needs a 16-byte aligned base pointer. (torch.compile cannot
            # read a pointer; there the ``where`` below hands the op a new, aligned tensor.)
            x = x.clone()
        x = x.contiguous()
        # NOTE: clamped so that a bad sum can never make the op read past x (checks mode reports
        # it); no host sync.
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32).clamp_(max=N)
        # NOTE: _grouped_mm leaves rows past offs[-1] (outputs and input grads) uninitialised;
        # `where` (not a multiply) discards them, NaN included.
        valid = (torch.arange(N, device=x.device) < offs[-1]).unsqueeze(1)
        x = torch.where(valid, x, 0)
        a = grouped_mm(x, self.w1, offs=offs)
        b = grouped_mm(x, self.w3, offs=offs) if self.w3 is not None else None
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
        y = grouped_mm(self._act(a, b), self.w2, offs=offs)
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
