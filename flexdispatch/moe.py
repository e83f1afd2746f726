"""MoELayer: router + dispatcher + grouped experts, forward and backward.

T tokens on this rank · H hidden · F expert hidden · E experts · R ranks · e = E / R local experts ·
k top-k · M rows received by this rank · W worst-case rows.

The forward path (ARCHITECTURE.md): ``hidden [.., H]`` → router → ``[T, k]`` ids/probs →
dispatch → ``recv_x [M, H]`` → permute by local expert → grouped experts (probs applied inside) →
unpermute (sum per received row) → combine → ``[T, H]`` (on DeepEP V2 / V2.5 the dispatch
delivers the rows grouped by local expert, ``dispatch_expanded``, and the permute / unpermute
steps vanish), plus the shared experts (when the config has them) run locally on all ``T``
tokens and added by the combine (``bias``; inside DeepEP 2.5's reduction). The communication
belongs to the dispatcher, the math to the experts; this class only wires them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexdispatch._checks import fits
from flexdispatch._checks.tensors import check_tensor
from flexdispatch._checks.threads import CallGuard, guarded
from flexdispatch.config import MoEConfig
from flexdispatch.dispatch.dispatcher import FlexDispatcher
from flexdispatch.distributed import check_fingerprint
from flexdispatch.experts import GroupedExperts, SharedExperts
from flexdispatch.experts.init import check_seed
from flexdispatch.permutation import _permute, unpermute
from flexdispatch.routing import TopKRouter
from flexdispatch.types import DispatchResult, ExpandedDispatchResult, RoutingResult

__all__ = ["MoELayer", "MoEOutput"]


@dataclass(frozen=True, kw_only=True)
class MoEOutput:
    """What ``MoELayer.forward`` returns.

    Attributes:
        output: the layer output, same shape and dtype as the input ``hidden``.
        aux_loss: the router's load-balancing loss (already scaled and already wired into the
            gradient of ``output``; report it, do not add it), or None.
        z_loss: the router's z-loss (same rules), or None.
        routing: the routing decision of this rank's tokens.
        dispatch: the dispatch result (received rows and the handle), for inspection: an
            ``ExpandedDispatchResult`` when the layer runs ``dispatch_expanded`` (``expanded``).
    """

    output: torch.Tensor
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None
    routing: RoutingResult
    dispatch: DispatchResult | ExpandedDispatchResult


def _weights_refusal(
    config: MoEConfig, R: int, dtype: torch.dtype, device: torch.device | str | None
) -> str | None:
    """Why this rank's parameters cannot fit on ``device`` (``flexdispatch._checks.fits``), or None:
    the ``[E, H]`` fp32 gate (built on CPU, then moved), the local experts' and the shared
    experts' projections (2 or 3 of ``H x F`` each, in ``dtype``)."""
    c, E, H = config, config.router.num_experts, config.hidden_size
    mats = 3 if c.activation in ("swiglu", "swiglu_oai") else 2
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    shared = c.shared_expert_ffn_hidden_size or c.num_shared_experts * c.ffn_hidden_size
    gate = fits.refusal(
        "MoELayer", "router.num_experts", E, 4 * E * H, "cpu", detail=f"[E, H={H}] fp32 gate"
    )
    W = c.dispatch.num_worst_tokens
    rows = fits.refusal(
        "MoELayer", "dispatch.num_worst_tokens", W, W * H * elem, device,
        detail=f"the [W, H={H}] rows every worst-case dispatch returns, in {dtype}",
        fix="use W = R * T (tokens per rank times ranks) or dropless mode (num_worst_tokens=0)",
    )  # fmt: skip
    nbytes = (max(1, E // max(1, R)) * c.ffn_hidden_size + shared) * mats * H * elem
    return (
        gate
        or rows
        or fits.refusal(
            "MoELayer",
            "ffn_hidden_size",
            c.ffn_hidden_size,
            nbytes,
            device,
            detail=f"{E // max(1, R)} local expert(s) of {mats} x [H={H}, F] in {dtype}, "
            f"shared F={shared}",
            fix="check hidden_size / ffn_hidden_size, or spread the experts over more ranks",
        )
    )


def _check_build_args(seed: object, dtype: object, device: object) -> torch.device | str | None:
    """``MoELayer``'s ``seed``, ``dtype`` and ``device``, checked before anything is built;
    returns ``device`` (None, or a device that exists here)."""
    check_seed(seed)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dtype must be a floating-point torch.dtype such as torch.bfloat16 or "
            f"torch.float32, got {dtype!r}"
        )
    if device is None:
        return None
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(f"device must be a torch.device or a string, got {type(device).__name__}")
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device={device!r} is not a device: use e.g. 'cpu' or 'cuda:0'") from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (where.index is not None and where.index >= count):
            raise ValueError(
                f"device={device!r} but this process sees {count} CUDA device(s) "
                f"(torch.cuda.is_available() is {torch.cuda.is_available()}): use 'cpu' or a "
                f"visible GPU"
            )
    return device


class MoELayer(nn.Module):
    """One expert-parallel MoE layer.

    Every rank of ``group`` builds the same layer; the router weight is replicated and rank ``r``
    holds global experts ``[r·e, (r+1)·e)``. Construction is collective: besides the
    dispatcher's own check, every field of ``config`` that is not dispatch-related (the router,
    the sizes, the activation), ``seed`` and ``dtype`` are compared across the ranks, and every
    rank raises ``ValueError`` naming the fields that differ.

    Parameters are drawn from ``seed`` so that every rank (and a single-process reference on
    the same device) gets the same values: the router weight from ``torch.manual_seed(seed)``
    on the CPU (restored afterwards; ``[E, H]``, small), expert ``g`` from
    ``init_expert_weights(g, seed, device=device)`` (biases too with ``expert_mlp_bias``), the
    shared experts from ``SharedExperts.reset_parameters_from_seed(seed, E)``. The expert
    weights are drawn once, on ``device``, one generator per expert (docs/build.md): a GPU
    layer draws nothing of them on the CPU, and its values are those of the GPU's generator.
    With ``device="meta"`` nothing is drawn (the build takes well under a second at any size);
    ``layer.to_empty(device=...)`` then ``layer.reset_parameters_from_seed()`` materialises it
    with the values a direct build on that device has (or load a checkpoint instead).

    The experts follow ``config.activation`` (with ``swiglu_limit`` / ``swiglu_alpha``),
    ``expert_mlp_bias`` and ``probs_on_input`` (routing weight multiplied into the expert
    input, Llama-4). With ``num_shared_experts > 0``, ``shared_experts`` is one fused dense MLP
    of ``F = shared_expert_ffn_hidden_size`` (default ``num_shared_experts * ffn_hidden_size``)
    with the layer's activation and no bias, replicated on every rank (its gradients are this
    rank's tokens' share, like the router's), gated by ``sigmoid(x @ gate_weight.T)`` when
    ``shared_expert_gate``. ``output = combine(routed) + shared(x)``: the shared output is the
    combine's ``bias``, which DeepEP 2.5 adds inside its reduction (bf16 rows: one rounding of
    the sum, no separate add); other backends add it after the combine.

    Overlap: the shared MLP is issued after the dispatch is issued and before the routed experts
    and ``combine``. On DeepEP 2.5 (``dispatch_expanded_start``, DeepEP's ``defer_epilogue``)
    the rows are still in flight then, so the MLP overlaps the dispatch. The torch backends
    finish their all-to-all before ``dispatch`` returns; with DeepEP V1 and
    ``deepep_async_finish`` (``dispatch_start``) the compute stream waits on the dispatch event
    only after the shared MLP is issued, so the MLP overlaps the dispatch there too.
    Before capturing the layer in a CUDA graph, call ``warmup()`` (DeepEP 2.5 compiles its
    kernels at first use).

    Args:
        config: the layer configuration.
        group: the expert-parallel process group (None: the default group, or a world of one
            when torch.distributed is not initialised).
        seed: parameter seed (>= 0).
        dtype: dtype of the expert weights and of the rows that travel (the router keeps its own
            dtype).
        device: device of the parameters, where they are drawn (``"meta"``: not drawn).
        _deep_ep: a ``deep_ep`` module for the dispatcher (tests: DeepEP's Python layer over the
            emulated runtime; see ``FlexDispatcher``).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        _deep_ep: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        device = _check_build_args(seed, dtype, device)
        self.config = config
        self.dispatcher = FlexDispatcher(
            config.dispatch, num_experts=config.router.num_experts, group=group, _deep_ep=_deep_ep
        )
        R, rank = self.dispatcher.num_ranks, self.dispatcher.rank
        # NOTE: one field per router setting, so that the error names the setting that differs.
        fields: dict[str, object] = {
            k: v
            for k, v in config.model_dump().items()
            if k not in ("router", "dispatch", "name", "source")
        }
        fields.update({f"router.{k}": v for k, v in config.router.model_dump().items()})
        fields.update(seed=seed, dtype=str(dtype))
        too_big = _weights_refusal(config, self.dispatcher.num_ranks, dtype, device)
        fields["fits in memory"] = (
            too_big is None
        )  # NOTE: so a rank that cannot fit makes all raise
        check_fingerprint(
            fields,
            group,
            what="MoELayer configs",
            fix="every rank must build the layer from the same MoEConfig, seed and dtype",
        )
        fits.raise_refusal(too_big)
        # NOTE: the L the dispatcher resolved (config, LOCAL_WORLD_SIZE or R); the
        # dispatcher has checked DeepEP's topology against the deep_ep module it runs already
        config.check_world(R, self.dispatcher.ranks_per_node, check_dispatch=False)
        e = config.router.num_experts // R
        self.num_local_experts = e
        self.seed = seed
        self.router = self._seeded_router(seed)
        self.router.to(device=device)
        self.experts = GroupedExperts(
            e,
            config.hidden_size,
            config.ffn_hidden_size,
            activation=config.activation,
            swiglu_limit=config.swiglu_limit,
            swiglu_alpha=config.swiglu_alpha,
            bias=config.expert_mlp_bias,
            probs_on_input=config.probs_on_input,
            dtype=dtype,
            device=device,
            first_expert=rank * e,
            seed=seed,
        )
        self.shared_experts: SharedExperts | None = None
        if config.num_shared_experts > 0:
            self.shared_experts = SharedExperts(
                config.hidden_size,
                self.shared_ffn_hidden_size,
                activation=config.activation,
                swiglu_limit=config.swiglu_limit,
                swiglu_alpha=config.swiglu_alpha,
                gate=config.shared_expert_gate,
                dtype=dtype,
                device=device,
                seed=seed,
                expert_id=config.router.num_experts,
            )

    def _seeded_router(self, seed: int) -> TopKRouter:
        """A CPU router drawn from ``torch.manual_seed(seed)`` (the global RNG restored)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TopKRouter(self.config.router, self.config.hidden_size)

    @torch.no_grad()
    def reset_parameters_from_seed(self, seed: int | None = None) -> None:
        """Redraw every parameter and reset every buffer from ``seed`` (default: the build's),
        in place on the parameters' device: the values of a layer built directly there.

        For a layer built on ``device="meta"``: ``layer.to_empty(device=d)`` then this. A no-op
        on parameters still on the meta device.
        """
        seed = check_seed(self.seed if seed is None else seed)
        fresh = self._seeded_router(seed)
        for mine, theirs in (
            (dict(self.router.named_parameters()), dict(fresh.named_parameters())),
            (dict(self.router.named_buffers()), dict(fresh.named_buffers())),
        ):
            for name, t in mine.items():
                if t.device.type != "meta":
                    t.copy_(theirs[name])
        self.experts.reset_parameters_from_seed(seed)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters_from_seed(seed, self.config.router.num_experts)

    @property
    def shared_ffn_hidden_size(self) -> int:
        """F of the fused shared-expert MLP (0 without shared experts)."""
        c = self.config
        if c.num_shared_experts == 0:
            return 0
        return c.shared_expert_ffn_hidden_size or c.num_shared_experts * c.ffn_hidden_size

    @property
    def expanded(self) -> bool:
        """The dispatcher delivers rows grouped by local expert (``dispatch_expanded``, DeepEP
        V2), so the layer skips ``permute`` / ``unpermute``."""
        return self.dispatcher.backend.supports_expanded()[0]

    @property
    def backend_name(self) -> str:
        return self.dispatcher.backend_name

    @property
    def _guard(self) -> CallGuard:
        """The dispatcher's guard (``_checks/threads.py``): one thread at a time in the layer and
        its dispatcher."""
        return self.dispatcher._guard

    @guarded("MoELayer.forward")
    def forward(self, hidden: torch.Tensor, *, token_ids: torch.Tensor | None = None) -> MoEOutput:
        """Run the layer on ``hidden`` ``[T, H]`` or ``[S, B, H]`` (dtype of the experts).

        ``token_ids`` (same leading shape, int64) is needed by hash routing only. With
        ``config.dispatch.checks`` (or ``FLEXDISPATCH_CHECKS=1``) the router's logits are checked
        for NaN/inf and the expert ids for range, before any collective.

        Raises:
            TypeError / ValueError: a bad ``hidden`` (dtype, shape, device), before any
                collective; see ``FlexDispatcher.dispatch`` for the errors raised on every rank.
        """
        check_tensor("hidden", hidden, floating=True)
        H = self.config.hidden_size
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != H:
            raise ValueError(
                f"hidden must be [T, {H}] or [S, B, {H}] (hidden_size={H}), got shape "
                f"{tuple(hidden.shape)}"
            )
        if hidden.dtype != self.experts.w1.dtype:
            raise TypeError(
                f"hidden has dtype {hidden.dtype} but the experts hold {self.experts.w1.dtype}: "
                f"build the layer with dtype={hidden.dtype} or cast the input"
            )
        if hidden.device != self.experts.w1.device:
            raise ValueError(
                f"hidden is on {hidden.device} but the layer's parameters are on "
                f"{self.experts.w1.device}: move the input (or the layer, with .to(device))"
            )
        self._check_fits(hidden)
        x_TH = hidden.reshape(-1, H)
        routing = self.router(
            hidden, token_ids=token_ids, checks=self.config.dispatch.checks or None
        )
        res: DispatchResult | ExpandedDispatchResult
        if self.expanded:
            # NOTE: rows arrive grouped by local expert (DeepEP V2 / V2.5 do_expand): no permute;
            # on V2.5 the shared experts run while the rows are in flight (defer_epilogue).
            pending = self.dispatcher.dispatch_expanded_start(
                x_TH, routing.topk_idx, routing.topk_probs
            )
            shared_TH = None if self.shared_experts is None else self.shared_experts(x_TH)
            res = pending.wait()
            y = self.experts(res.recv_x, res.num_recv_tokens_per_expert, res.recv_topk_probs)
            out_TH = self.dispatcher.combine(y, res.handle, bias=shared_TH)
        else:
            # NOTE: the shared experts are issued while the dispatch is in flight where the
            # backend allows it (DeepEP V1 with deepep_async_finish), see the class docstring.
            started = self.dispatcher.dispatch_start(x_TH, routing.topk_idx, routing.topk_probs)
            shared_TH = None if self.shared_experts is None else self.shared_experts(x_TH)
            res = started.wait()
            out_TH = self._routed(res, shared_TH)
        return MoEOutput(
            output=out_TH.reshape(hidden.shape),
            aux_loss=routing.aux_loss,
            z_loss=routing.z_loss,
            routing=routing,
            dispatch=res,
        )

    def _check_fits(self, hidden: torch.Tensor) -> None:
        """Refuse a ``forward`` whose activations cannot fit before anything is allocated
        (``fits.layer_bytes``; host ints, one comparison below ``fits.SMALL_BYTES``). An
        ``expand``ed ``hidden`` of a few bytes counts as the T rows it stands for."""
        c = self.config
        T = hidden.numel() // c.hidden_size
        grad = torch.is_grad_enabled() and (hidden.requires_grad or self.experts.w1.requires_grad)
        Fs = 0
        if c.num_shared_experts:
            Fs = c.shared_expert_ffn_hidden_size or c.num_shared_experts * c.ffn_hidden_size
        nbytes = fits.layer_bytes(
            T=T,
            H=c.hidden_size,
            F=c.ffn_hidden_size,
            Fs=Fs,
            E=c.router.num_experts,
            k=c.router.topk,
            R=self.dispatcher.num_ranks,
            elem=hidden.element_size(),
            W=c.dispatch.num_worst_tokens,
            grad=grad,
            L=self.dispatcher.ranks_per_node if c.dispatch.hierarchical else 0,
        )
        if nbytes >= fits.SMALL_BYTES:
            fits.check_fits(
                "MoELayer.forward",
                "T",
                T,
                nbytes,
                hidden.device,
                detail=f"T={T} tokens of H={c.hidden_size}: the router's "
                f"[T, E={c.router.num_experts}] scores, the dispatch, the experts' hidden states "
                f"(F={c.ffn_hidden_size}) and the combine{', with the backward' if grad else ''}",
                fix="run fewer tokens per call (split the batch)",
            )

    def warmup(self, *, backward: bool = True) -> None:
        """Run every dispatch / combine kernel of this layer once with no tokens, on every rank
        (``FlexDispatcher.warmup``): DeepEP 2.5 compiles its kernels at first use, which a
        CUDA-graph capture cannot contain. Call it before capturing."""
        self.dispatcher.warmup(
            self.config.hidden_size,
            self.config.router.topk,
            dtype=self.experts.w1.dtype,
            expanded=self.expanded,
            backward=backward,
        )

    def _routed(self, res: DispatchResult, shared: torch.Tensor | None = None) -> torch.Tensor:
        """permute -> grouped experts -> unpermute -> combine (+ ``shared``) of one dispatch."""
        M, k = res.recv_topk_idx.shape
        e = self.num_local_experts
        static_rows = None
        if self.config.dispatch.num_worst_tokens > 0:
            # NOTE: a static row count keeps the whole layer free of host syncs (graph capture).
            static_rows = M * k
        # NOTE: the dispatcher made these rows (and checked what it was given): no second check
        perm = _permute(
            res.recv_x,
            res.recv_topk_idx,
            e,
            res.recv_topk_probs,
            static_rows=static_rows,
            # NOTE: dropless backends report the pair count they got with the dispatch's one sync.
            num_rows=None if static_rows is not None else res.num_recv_pairs,
            impl=self.config.impl,
        )
        y = self.experts(perm.x, perm.padded_tokens_per_expert, perm.probs)
        return self.dispatcher.combine(
            unpermute(y, perm, impl=self.config.impl), res.handle, bias=shared
        )
