"""The dispatcher behind ``flexdispatch.integrations.sglang`` (this module imports SGLang).

T tokens on this rank · H hidden · E experts · R ranks of the group · e = E / R local experts ·
k top-k · M received rows · B = the per-rank decode bound (SGLang's
``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK``) · C = R · B rows per local expert.

``FlexSGLangDispatcher`` is an SGLang ``BaseDispatcher`` shaped like SGLang's own
``DeepEPDispatcher``: ``dispatch`` = ``dispatch_a`` + the DeepEP dispatch hooks + ``dispatch_b``,
``combine`` = ``combine_a`` + ``combine_b``, the mode chosen per call by SGLang's
``DeepEPMode.resolve(get_is_extend_in_batch())`` (``--deepep-mode auto``: normal for extend /
prefill batches, low-latency for decode batches, which SGLang captures in CUDA graphs):

- normal: a dropless ``FlexDispatcher`` (``dispatch_start`` in ``dispatch_a``, ``.wait()`` in
  ``dispatch_b``), returning ``DeepEPNormalDispatchOutput`` (local ids, ``-1`` elsewhere; the
  per-expert counts as a host list, as DeepEP's normal dispatch gives them) or, with
  ``normal_format="standard"``, ``StandardDispatchOutput`` (what SGLang's ``StandardDispatcher``
  gives the Triton runner under EP: local ids, ``-1`` elsewhere). Combine takes the runner's
  weighted rows and sums them at their source (``DeepEPNormalCombineInput`` /
  ``StandardCombineInput``);
- low-latency: a ``DecodeDispatcher`` (DeepEP's low-latency kernels with
  ``DispatchConfig(backend="deepep", mode="low_latency")``, the worst-case dispatch W = R · B
  elsewhere), returning ``DeepEPLLDispatchOutput`` (``[e, C, H]``, ``masked_m`` = the per-expert
  counts on the device, ``expected_m`` DeepEP's host estimate from the shapes alone). Combine
  takes the unweighted ``[e, C, H]`` outputs and weights them (``DeepEPLLCombineInput``).

Two-batch overlap calls the halves with ``tbo_subbatch_index``: each sub-batch has its own
dispatchers and state, as SGLang's ``MaybeTboDeepEPDispatcher`` keeps one DeepEP dispatcher per
sub-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from sglang.srt.layers.dp_attention import get_is_extend_in_batch
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
from sglang.srt.layers.moe.token_dispatcher.deepep import (
    DeepEPLLDispatchOutput,
    DeepEPNormalDispatchOutput,
    DeepEPPDispatchHooks,
)
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang.srt.layers.moe.utils import DeepEPMode

from flexdispatch import DispatchConfig, FlexDispatcher
from flexdispatch.dispatch.decode import DecodeDispatcher
from flexdispatch.distributed import group_size
from flexdispatch.integrations._engines import decode_dispatcher, updated_config

__all__ = ["FlexSGLangDispatcher", "NormalFormat"]

NormalFormat = Literal["deepep", "standard"]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class _Slot:
    """One sub-batch's dispatchers and the call in flight (SGLang's interface keeps it on the
    dispatcher between the halves, as its DeepEP dispatcher does)."""

    normal: FlexDispatcher | None
    decode: DecodeDispatcher | None
    stage: str = "initial"
    mode: DeepEPMode | None = None
    pending: Any = None  # normal: a PendingDispatch, then its handle; LL: the ExpertMajorResult
    combined: torch.Tensor | None = None


class FlexSGLangDispatcher(BaseDispatcher):
    """SGLang's ``BaseDispatcher`` over flexdispatch, in DeepEP's formats.

    Args:
        dispatch_config: the flexdispatch config (``mode="low_latency"`` with ``backend="deepep"``
            runs DeepEP's low-latency kernels for decode).
        group: the process group (SGLang's ``get_parallel().tp_group.device_group``, the group
            DeepEP uses); None = WORLD. Experts are sharded contiguously over it.
        num_experts: E (routed experts; ``num_local_experts`` must be E / R).
        num_local_experts: e.
        router_topk: k.
        hidden_size: H.
        params_dtype: the rows' dtype (for the decode warm-up).
        deepep_mode: SGLang's ``DeepEPMode`` (normal, low_latency or auto).
        num_max_dispatch_tokens_per_rank: B for the low-latency (decode) path.
        normal_format: ``"deepep"`` (``DeepEPNormalDispatchOutput``) or ``"standard"``
            (``StandardDispatchOutput``) for the normal path.
        num_subbatches: 2 with two-batch overlap (one set of dispatchers per sub-batch), else 1.

    Construction is collective over ``group``.

    Raises:
        ValueError: experts not split evenly, B not positive, or a decode configuration that
            cannot be captured.
    """

    def __init__(
        self,
        dispatch_config: DispatchConfig,
        *,
        group: dist.ProcessGroup | None,
        num_experts: int,
        num_local_experts: int,
        router_topk: int,
        hidden_size: int,
        params_dtype: torch.dtype | None = None,
        deepep_mode: DeepEPMode = DeepEPMode.AUTO,
        num_max_dispatch_tokens_per_rank: int = 128,
        normal_format: NormalFormat = "deepep",
        num_subbatches: int = 1,
    ) -> None:
        super().__init__()
        R = group_size(group)
        if num_experts % R or num_local_experts != num_experts // R:
            raise ValueError(
                f"flexdispatch's SGLang dispatcher needs E={num_experts} routed experts split "
                f"evenly over the group (R={R}, {num_local_experts} local experts here; fused "
                f"shared experts are not supported)"
            )
        if normal_format not in ("deepep", "standard"):
            raise ValueError(f"normal_format must be 'deepep' or 'standard', got {normal_format!r}")
        self.deepep_mode = deepep_mode
        self.normal_format = normal_format
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.router_topk = router_topk
        self.hidden_size = hidden_size
        self.num_ranks = R
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.expert_mask_gpu = None  # NOTE: read by SGLang's AITER path; DeepEP's is None too
        self._deepep_dispatch_hooks = DeepEPPDispatchHooks()
        slots = []
        for _ in range(num_subbatches):
            normal = decode = None
            if deepep_mode.enable_normal():
                normal = FlexDispatcher(
                    updated_config(
                        dispatch_config, mode="normal", num_worst_tokens=0, cuda_graph=False
                    ),
                    num_experts=num_experts,
                    group=group,
                )
            if deepep_mode.enable_low_latency():
                decode = decode_dispatcher(
                    dispatch_config,
                    num_experts=num_experts,
                    group=group,
                    max_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                    hidden_size=hidden_size,
                    topk=router_topk,
                    dtype=params_dtype,
                )
            slots.append(_Slot(normal=normal, decode=decode))
        self._slots = slots

    # ----------------------------------------------------------------- helpers
    def _slot(self, tbo_subbatch_index: int | None) -> _Slot:
        return self._slots[tbo_subbatch_index or 0]

    def _resolve(self) -> DeepEPMode:
        mode = self.deepep_mode.resolve(get_is_extend_in_batch())
        if mode == DeepEPMode.NORMAL and _capturing():
            raise RuntimeError(
                "flexdispatch's SGLang dispatcher is being captured in a CUDA graph in normal "
                "mode (a dropless dispatch reads its counts on the host): capture decode batches "
                "only (--deepep-mode auto or low_latency)"
            )
        return mode

    @staticmethod
    def _stage(slot: _Slot, old: str, new: str) -> None:
        if slot.stage != old:
            raise RuntimeError(
                f"dispatcher call out of order: expected stage {old}, at {slot.stage}"
            )
        slot.stage = new

    # ----------------------------------------------------------------- dispatch
    def dispatch(
        self, hidden_states: torch.Tensor, topk_output: Any, tbo_subbatch_index: int | None = None
    ) -> Any:
        """``dispatch_a``, SGLang's DeepEP dispatch hooks, ``dispatch_b``."""
        self.dispatch_a(hidden_states, topk_output, tbo_subbatch_index=tbo_subbatch_index)
        self._deepep_dispatch_hooks(self)
        return self.dispatch_b(tbo_subbatch_index=tbo_subbatch_index)

    def dispatch_a(
        self, hidden_states: torch.Tensor, topk_output: Any, tbo_subbatch_index: int | None = None
    ) -> None:
        """Start the dispatch of ``hidden_states`` ``[T, H]`` by ``topk_output`` (SGLang's
        ``StandardTopKOutput``: ``topk_ids`` ``[T, k]`` global ids, ``-1`` = none;
        ``topk_weights`` ``[T, k]``)."""
        slot = self._slot(tbo_subbatch_index)
        self._stage(slot, "initial", "dispatched_a")
        mode = self._resolve()
        ids = topk_output.topk_ids.to(torch.int64)
        weights = topk_output.topk_weights.to(torch.float32)
        slot.mode = mode
        if mode == DeepEPMode.NORMAL:
            if slot.normal is None:
                raise RuntimeError(
                    f"normal mode resolved, but this dispatcher is {self.deepep_mode}"
                )
            slot.pending = slot.normal.dispatch_start(hidden_states, ids, weights)
            return
        if slot.decode is None:
            raise RuntimeError(
                f"low-latency mode resolved, but this dispatcher is {self.deepep_mode}"
            )
        res = slot.decode.dispatch(hidden_states, ids, weights)
        # NOTE: DeepEP's estimate of rows per local expert, from the shapes alone (no device read)
        T, k, E = hidden_states.shape[0], ids.shape[1], self.num_experts
        slot.pending = (res, ids, weights, (T * self.num_ranks * k + E) // E)

    def dispatch_b(self, tbo_subbatch_index: int | None = None) -> Any:
        """Finish the dispatch: ``DeepEPNormalDispatchOutput`` / ``StandardDispatchOutput``
        (normal) or ``DeepEPLLDispatchOutput`` (low-latency)."""
        slot = self._slot(tbo_subbatch_index)
        self._stage(slot, "dispatched_a", "dispatched_b")
        if slot.mode == DeepEPMode.NORMAL:
            res = slot.pending.wait()
            slot.pending = res.handle
            if self.normal_format == "standard":
                return StandardDispatchOutput(
                    hidden_states=res.recv_x,
                    hidden_states_scale=None,
                    topk_output=StandardTopKOutput(
                        topk_weights=res.recv_topk_probs,
                        topk_ids=res.recv_topk_idx.to(torch.int32),
                        router_logits=None,
                    ),
                )
            return DeepEPNormalDispatchOutput(
                res.recv_x,
                None,
                res.recv_topk_idx,
                res.recv_topk_probs,
                # NOTE: a host list, as DeepEP's normal dispatch returns it (after the one host
                # sync of a dropless dispatch; normal mode is never captured)
                res.num_recv_tokens_per_expert.tolist(),
            )
        res, ids, weights, expected_m = slot.pending
        slot.pending = res.handle
        return DeepEPLLDispatchOutput(
            res.recv_x,
            res.recv_scales,
            ids,
            weights,
            res.num_recv_tokens_per_expert.to(torch.int32),
            expected_m,
        )

    # ----------------------------------------------------------------- combine
    def combine(self, combine_input: Any, tbo_subbatch_index: int | None = None) -> torch.Tensor:
        """``combine_a`` + ``combine_b``: ``[T, H]`` at the tokens' source."""
        self.combine_a(combine_input, tbo_subbatch_index=tbo_subbatch_index)
        return self.combine_b(tbo_subbatch_index=tbo_subbatch_index)

    def combine_a(self, combine_input: Any, tbo_subbatch_index: int | None = None) -> None:
        """Send the expert outputs back: ``DeepEPNormalCombineInput`` / ``StandardCombineInput``
        (``[M, H]`` rows the runner weighted and summed) or ``DeepEPLLCombineInput`` (unweighted
        ``[e, C, H]``; weighted here by the dispatched weights)."""
        slot = self._slot(tbo_subbatch_index)
        self._stage(slot, "dispatched_b", "combined_a")
        handle, slot.pending = slot.pending, None
        y = combine_input.hidden_states
        if slot.mode == DeepEPMode.NORMAL:
            slot.combined = slot.normal.combine(y, handle)
        else:
            slot.combined = slot.decode.combine(y, handle)

    def combine_b(self, tbo_subbatch_index: int | None = None) -> torch.Tensor:
        """The combined ``[T, H]``."""
        slot = self._slot(tbo_subbatch_index)
        self._stage(slot, "combined_a", "initial")
        out, slot.combined = slot.combined, None
        return out

    # ----------------------------------------------------------------- SGLang's extras
    def register_deepep_dispatch_hook(self, hook: Any) -> Any:
        """A hook run between ``dispatch_a`` and ``dispatch_b`` (as SGLang's DeepEP dispatcher)."""
        return self._deepep_dispatch_hooks.register_hook(hook)

    def set_overlap_args(self, combine_overlap_args: Any, meta_overlap_args: dict) -> None:
        raise ValueError(
            "flexdispatch's SGLang dispatcher does not run single-batch overlap "
            "(--enable-single-batch-overlap): run without it, or unset FLEXDISPATCH_SGLANG"
        )

    @property
    def dispatchers(self) -> list[FlexDispatcher]:
        """Every ``FlexDispatcher`` this dispatcher runs (for ``stats``)."""
        out = []
        for slot in self._slots:
            if slot.normal is not None:
                out.append(slot.normal)
            if slot.decode is not None:
                out.append(slot.decode.dispatcher)
        return out
