"""The classes behind ``flexdispatch.integrations.vllm`` (this module imports vLLM).

T tokens on this rank · H hidden · E experts · R ranks of vLLM's EP group · e = E / R local
experts · k top-k · M received rows · B the engine's per-rank token bound inside a CUDA graph ·
W = R · B worst-case rows · C = R · B rows per local expert (batched format).

Two Prepare/Finalize classes, each a ``FusedMoEPrepareAndFinalizeModular`` that vLLM composes with
its experts into a ``FusedMoEKernel``:

- ``FlexdispatchPrepareAndFinalize`` (Standard format, ``[M, H]`` rows): a dropless
  ``FlexDispatcher`` for eager calls (prefill; one late host sync) and a worst-case one
  (``num_worst_tokens = R · B``, static ``[W, H]`` rows, no host sync) for calls inside a CUDA
  graph, chosen per call from vLLM's forward context. Both give the same first rows bit for bit
  (the dispatch contract), so the choice never changes a result. The experts get *global* ids
  with DeepEP-HT's sentinel in the slots of other ranks' experts (``E - 1`` on rank 0, ``0``
  elsewhere: ids that vLLM's ``expert_map`` maps to ``-1``) and a device
  ``ExpertTokensMetadata`` (no host list), as vLLM's Standard expert kernels expect.
- ``FlexdispatchBatchedPrepareAndFinalize`` (BatchedExperts format, ``[e, C, H]`` plus
  ``expert_num_tokens``): a ``DecodeDispatcher`` (DeepEP's low-latency kernels in
  ``mode="low_latency"`` on the deepep backend, the worst-case dispatch elsewhere), for the batched
  expert kernels vLLM pairs with DeepEP low-latency. Weighted in the combine.

vLLM's interface keeps the dispatch's handle on the P/F between ``prepare`` and ``finalize`` (as
its DeepEP P/Fs do), so one P/F serves one micro-batch at a time: ``supports_async()`` is False and
DBO is refused when the P/F is built.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)

from flexdispatch import DispatchConfig, FlexDispatcher
from flexdispatch.distributed import group_size
from flexdispatch.integrations._engines import decode_dispatcher, updated_config

__all__ = [
    "FlexdispatchBatchedPrepareAndFinalize",
    "FlexdispatchPrepareAndFinalize",
    "in_cuda_graph",
    "make_prepare_finalize",
    "refusal",
]


def in_cuda_graph() -> bool:
    """Whether the MoE layer runs inside a CUDA graph now: a capture on the current stream, or
    vLLM's forward context running a graph mode (``cudagraph_runtime_mode`` FULL or PIECEWISE;
    vLLM agrees on it across DP ranks and pads them to one token count)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    if not is_forward_context_available():
        return False
    return get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


def _weigh_input(
    a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, on_input: bool
) -> torch.Tensor:
    """``a1`` times its router weight when vLLM applies it on the input (top-1 only)."""
    if not on_input:
        return a1
    if topk_ids.shape[1] != 1:
        raise ValueError("apply_router_weight_on_input is implemented for top-k = 1 only")
    return a1 * topk_weights.to(a1.dtype)


def _quantize(
    x: torch.Tensor, quant_config: Any, defer_input_quant: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize received rows for the experts, as vLLM's DeepEP-HT P/F does after its dispatch
    (rows travel unquantized: per-token and per-block scales are row-local)."""
    if quant_config is None or quant_config.quant_dtype is None or defer_input_quant:
        return x, None
    if x.numel() == 0:
        return x, None
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    return moe_kernel_quantize_input(
        x,
        quant_config.a1_scale,
        quant_dtype=quant_config.quant_dtype,
        per_act_token_quant=quant_config.per_act_token_quant,
        block_shape=quant_config.block_shape,
    )


class FlexdispatchPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """Standard-format P/F over ``FlexDispatcher``: dropless eagerly, worst-case inside graphs.

    Args:
        dispatch_config: the dispatchers' ``DispatchConfig`` (``mode="normal"``). Its
            ``num_worst_tokens``, when > 0, is the graph path's W (at least ``R · B``).
        num_experts: E, divisible by R; experts are sharded contiguously (rank r holds
            ``[r·e, (r+1)·e)``), vLLM's linear placement.
        group: vLLM's EP group (``get_ep_group().device_group``); None = WORLD.
        graph_tokens_per_rank: B, the most tokens a rank runs inside a CUDA graph (vLLM pads
            every DP rank to one capture size, at most ``max_cudagraph_capture_size``); None =
            no graph path (a call inside a graph is then refused).
        hidden_size, topk, dtype: the layer's H, k and activation dtype; given with B, the graph
            path is warmed up at once (``FlexDispatcher.warmup``, before any capture).

    Construction is collective over ``group`` (every rank builds its layers in the same order).

    Raises:
        ValueError: a configuration that cannot be captured (``cuda_graph=True`` is checked by
            the dispatcher), W < R · B, or ``mode="low_latency"`` (use the batched P/F).
    """

    def __init__(
        self,
        dispatch_config: DispatchConfig,
        *,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        graph_tokens_per_rank: int | None = None,
        hidden_size: int | None = None,
        topk: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dispatch_config.mode != "normal":
            raise ValueError(
                "FlexdispatchPrepareAndFinalize is the Standard-format P/F (mode='normal'); "
                "mode='low_latency' is served by FlexdispatchBatchedPrepareAndFinalize"
            )
        self.dropless = FlexDispatcher(
            updated_config(dispatch_config, num_worst_tokens=0, cuda_graph=False),
            num_experts=num_experts,
            group=group,
        )
        R = self.dropless.num_ranks
        self.num_experts = num_experts
        self.rank = self.dropless.rank
        self.num_local_experts = num_experts // R
        # NOTE: the id other ranks' slots get: a global id of another rank, which expert_map
        # maps to -1 (vLLM's DeepEP-HT convention)
        self.sentinel = num_experts - 1 if self.rank == 0 else 0
        self.graph_tokens_per_rank = graph_tokens_per_rank
        self.static: FlexDispatcher | None = None
        if graph_tokens_per_rank is not None:
            B = graph_tokens_per_rank
            if B <= 0:
                raise ValueError(f"graph_tokens_per_rank must be positive, got {B}")
            W = dispatch_config.num_worst_tokens or R * B
            if W < R * B:
                raise ValueError(
                    f"num_worst_tokens={W} is below R x B = {R} x {B} = {R * B}: a graph of B "
                    f"tokens per rank could overflow it; set num_worst_tokens >= {R * B} or 0"
                )
            self.static = FlexDispatcher(
                updated_config(dispatch_config, num_worst_tokens=W, cuda_graph=True),
                num_experts=num_experts,
                group=group,
            )
            if hidden_size is not None and topk is not None:
                self.warmup(hidden_size, topk, dtype or torch.bfloat16)
        # NOTE: vLLM's P/F interface has no handle between prepare and finalize (its DeepEP P/Fs
        # keep theirs on self too): one call in flight, DBO refused at build time
        self._inflight: tuple[FlexDispatcher, Any] | None = None

    def warmup(self, hidden_size: int, topk: int, dtype: torch.dtype) -> None:
        """Run the graph path's kernels once (collective), before the first CUDA-graph capture."""
        if self.static is not None:
            self.static.warmup(hidden_size, topk, dtype=dtype, backward=False)

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return self.dropless.num_ranks

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return False

    def _dispatcher_for(self, num_tokens: int) -> FlexDispatcher:
        if not in_cuda_graph():
            return self.dropless
        if self.static is None:
            raise RuntimeError(
                "flexdispatch's vLLM P/F runs inside a CUDA graph but was built without a graph "
                "token bound (graph_tokens_per_rank / max_cudagraph_capture_size): its dropless "
                "dispatch reads counts on the host and cannot be captured"
            )
        B = self.graph_tokens_per_rank or 0
        if num_tokens > B:
            raise ValueError(
                f"{num_tokens} tokens on this rank inside a CUDA graph exceed the graph bound "
                f"B={B} the worst-case dispatch was sized for (W = R x B)"
            )
        return self.static

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: Any,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        """Dispatch ``a1`` ``[T, H]`` to the ranks of its experts.

        Returns:
            rows ``[M, H]`` (``[W, H]`` inside a graph; quantized when the experts want it), their
            scales or None, ``ExpertTokensMetadata`` with device counts ``[e]`` int32, global ids
            ``[M, k]`` int64 (the sentinel where the slot's expert is on another rank) and
            weights ``[M, k]`` float32 (0 there).
        """
        if num_experts != self.num_experts:
            raise ValueError(
                f"the kernel runs {num_experts} experts, the P/F was built for {self.num_experts}"
            )
        a1 = _weigh_input(a1, topk_weights, topk_ids, apply_router_weight_on_input)
        dispatcher = self._dispatcher_for(a1.shape[0])
        res = dispatcher.dispatch(a1, topk_ids.to(torch.int64), topk_weights.to(torch.float32))
        self._inflight = (dispatcher, res.handle)
        local = res.recv_topk_idx
        offset = self.rank * self.num_local_experts
        global_ids = torch.where(local < 0, self.sentinel, local + offset)
        meta = mk.ExpertTokensMetadata(
            expert_num_tokens=res.num_recv_tokens_per_expert.to(torch.int32),
            expert_num_tokens_cpu=None,
        )
        x, scale = _quantize(res.recv_x, quant_config, defer_input_quant)
        return x, scale, meta, global_ids, res.recv_topk_probs

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        """Weight and reduce each row's expert outputs (unless the experts did), send the rows
        back and sum them at their source token, into ``output`` ``[T, H]``."""
        if self._inflight is None:
            raise RuntimeError("finalize() without a prepare() before it")
        dispatcher, handle = self._inflight
        self._inflight = None
        if isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            weight_and_reduce_impl = TopKWeightAndReduceContiguous()
        rows = fused_expert_output
        if rows.numel() != 0:
            rows = weight_and_reduce_impl.apply(
                output=None,
                fused_expert_output=rows,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
        rows = rows.reshape(-1, output.shape[-1])
        output.copy_(dispatcher.combine(rows.to(output.dtype), handle))


class FlexdispatchBatchedPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """BatchedExperts-format P/F over ``DecodeDispatcher``: ``[e, C, H]`` rows, C = R · B.

    Args:
        dispatch_config: the dispatcher's ``DispatchConfig`` (``mode="low_latency"`` runs
            DeepEP's low-latency kernels on the deepep backend; other backends decode through
            the worst-case dispatch, W = R · B, set here).
        num_experts: E, divisible by R.
        group: vLLM's EP group; None = WORLD.
        max_tokens_per_rank: B, the most tokens a rank dispatches in one call (every call, eager
            or captured: the shapes are static).
        hidden_size, topk, dtype: given, the worst-case path is warmed up at once.

    Raises:
        ValueError: B not positive, or a configuration that cannot be captured.
    """

    def __init__(
        self,
        dispatch_config: DispatchConfig,
        *,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        max_tokens_per_rank: int,
        hidden_size: int | None = None,
        topk: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.decoder = decode_dispatcher(
            dispatch_config,
            num_experts=num_experts,
            group=group,
            max_tokens_per_rank=max_tokens_per_rank,
            hidden_size=hidden_size,
            topk=topk,
            dtype=dtype,
        )
        self.dispatcher = self.decoder.dispatcher
        self.max_tokens_per_rank = max_tokens_per_rank
        self._inflight: Any = None

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int | None:
        return self.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.dispatcher.num_ranks

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return False

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: Any,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        """Send each ``(token, expert)`` pair of ``a1`` ``[T, H]`` (T <= B) to its expert.

        Returns:
            rows ``[e, C, H]``, their scales or None, ``ExpertTokensMetadata`` with
            ``expert_num_tokens`` ``[e]`` int32 on the device, and None, None (the experts keep
            the source's ids and weights).
        """
        if defer_input_quant:
            raise ValueError(
                "flexdispatch's batched P/F quantizes the received rows itself "
                "(defer_input_quant=True): pick experts that take quantized inputs"
            )
        a1 = _weigh_input(a1, topk_weights, topk_ids, apply_router_weight_on_input)
        if apply_router_weight_on_input:
            weights = torch.ones_like(topk_weights, dtype=torch.float32)
        else:
            weights = topk_weights.to(torch.float32)
        res = self.decoder.dispatch(a1, topk_ids.to(torch.int64), weights)
        self._inflight = res.handle
        meta = mk.ExpertTokensMetadata(
            expert_num_tokens=res.num_recv_tokens_per_expert.to(torch.int32),
            expert_num_tokens_cpu=None,
        )
        x = res.recv_x
        scale = None
        if quant_config is not None and quant_config.quant_dtype is not None:
            from vllm.model_executor.layers.fused_moe.utils import normalize_batched_scales_shape

            e, C, H = x.shape
            flat, scale = _quantize(x.view(-1, H), quant_config, False)
            x = flat.view(e, C, H)
            if scale is not None:
                scale = normalize_batched_scales_shape(scale, e)
        return x, scale, meta, None, None

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        """Weighted sum of every pair's expert output ``[e, C, H]`` at its source token, into
        ``output`` ``[T, H]`` (the weights travelled with the dispatch)."""
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise ValueError(
                "flexdispatch's batched P/F weights and reduces in its combine: the experts must "
                f"leave it to the P/F (TopKWeightAndReduceDelegate), not "
                f"{type(weight_and_reduce_impl).__name__}"
            )
        if self._inflight is None:
            raise RuntimeError("finalize() without a prepare() before it")
        handle, self._inflight = self._inflight, None
        output.copy_(self.decoder.combine(fused_expert_output, handle))


def refusal(
    moe: Any,
    quant_config: Any,
    *,
    routing_tables: Any = None,
    use_monolithic: bool = False,
    vllm_config: Any = None,
) -> str | None:
    """Why the plug-in cannot serve this MoE layer, in one line, or None."""
    par = moe.moe_parallel_config
    if use_monolithic:
        return (
            "flexdispatch's vLLM plug-in serves modular experts only (the selected experts are "
            "monolithic: they route inside the kernel and need the router logits dispatched)"
        )
    if routing_tables is not None or getattr(par, "enable_eplb", False):
        return (
            "flexdispatch's vLLM plug-in does not map EPLB / round-robin expert routing tables: "
            "run without --enable-eplb (and with linear expert placement), or unset "
            "FLEXDISPATCH_VLLM"
        )
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and getattr(pc, "use_ubatching", False):
        return (
            "flexdispatch's vLLM plug-in does not run dual-batch overlap (DBO / micro-batching, "
            "supports_async() is False): run without --enable-dbo / --ubatch-size, or unset "
            "FLEXDISPATCH_VLLM"
        )
    qdt = getattr(quant_config, "quant_dtype", None) if quant_config is not None else None
    if isinstance(qdt, str):
        return (
            f"flexdispatch's vLLM plug-in does not dispatch {qdt} activations (packed scales): "
            f"unset FLEXDISPATCH_VLLM for this model"
        )
    R = par.ep_size
    if moe.num_experts % R or moe.num_local_experts != moe.num_experts // R:
        return (
            f"flexdispatch's vLLM plug-in needs E={moe.num_experts} experts split evenly over "
            f"the EP group (R={R}, {moe.num_local_experts} local experts here; fused shared "
            f"experts are not supported)"
        )
    return None


def make_prepare_finalize(
    moe: Any,
    quant_config: Any,
    dispatch_config: DispatchConfig,
    *,
    group: dist.ProcessGroup | None = None,
    routing_tables: Any = None,
    use_monolithic: bool = False,
) -> FlexdispatchPrepareAndFinalize | FlexdispatchBatchedPrepareAndFinalize:
    """A flexdispatch P/F for a vLLM MoE layer (what the plug-in's wrapped
    ``maybe_make_prepare_finalize`` returns).

    ``dispatch_config.mode == "low_latency"``: the BatchedExperts P/F with B =
    ``num_max_dispatch_tokens_per_rank`` when the config sets it, else ``moe.max_num_tokens``.
    Otherwise the Standard P/F, with a graph path of B = ``moe.max_capture_size`` when vLLM
    captures CUDA graphs (> 0), or W / R when the config sets ``num_worst_tokens = W``.

    Args:
        moe: vLLM's ``FusedMoEConfig``.
        quant_config: its ``FusedMoEQuantConfig`` (or None).
        dispatch_config: the flexdispatch config (``hidden_size`` is filled from ``moe`` when
            unset).
        group: the EP group; None = vLLM's (``get_ep_group().device_group``).
        routing_tables, use_monolithic: as vLLM passes them (refused when set).

    Raises:
        ValueError: a layer the plug-in does not serve (``refusal``), in one line.
    """
    from vllm.config import get_current_vllm_config_or_none

    why = refusal(
        moe,
        quant_config,
        routing_tables=routing_tables,
        use_monolithic=use_monolithic,
        vllm_config=get_current_vllm_config_or_none(),
    )
    if why is not None:
        raise ValueError(why)
    if group is None:
        from vllm.distributed import get_ep_group

        group = get_ep_group().device_group
    R = group_size(group)
    if moe.moe_parallel_config.ep_size != R:
        raise ValueError(f"the EP group has {R} ranks, the layer's ep_size is {moe.ep_size}")
    config = dispatch_config
    if config.hidden_size is None:
        config = updated_config(config, hidden_size=moe.hidden_dim)
    common: dict[str, Any] = {
        "num_experts": moe.num_experts,
        "group": group,
        "hidden_size": moe.hidden_dim,
        "topk": moe.experts_per_token,
        "dtype": moe.in_dtype,
    }
    if config.mode == "low_latency":
        if "num_max_dispatch_tokens_per_rank" in dispatch_config.model_fields_set:
            B = dispatch_config.num_max_dispatch_tokens_per_rank
        else:
            B = moe.max_num_tokens
        return FlexdispatchBatchedPrepareAndFinalize(config, max_tokens_per_rank=B, **common)
    if config.num_worst_tokens > 0:
        B = config.num_worst_tokens // R
    else:
        B = getattr(moe, "max_capture_size", 0) or None
    return FlexdispatchPrepareAndFinalize(config, graph_tokens_per_rank=B, **common)
