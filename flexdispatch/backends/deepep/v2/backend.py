"""The ``deepep`` backend over DeepEP V2 (``deep_ep.ElasticBuffer``), behind the dispatch contract.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · M = ``num_max_tokens_per_rank`` · W worst-case rows ·
X any row width · Xw wire width (bf16 columns).

Selected with ``DispatchConfig.deepep_api="v2"``, and by ``"auto"`` where every rank has
``ElasticBuffer`` in worst-case mode or with ``num_max_dispatch_tokens_per_rank`` set
(``dispatch.select.auto_deepep_api``). How the contract maps onto ``ElasticBuffer``:

- **Direct mode only** (``allow_hybrid_mode=False``): one logical scale-up domain of R ranks, inside
  a node and across nodes. ``dispatch``: non-expand layout (``do_expand=False``), one row per
  (token, destination rank), in (source rank, token) order, ids local (``0..e-1``) or ``-1``.
- **Expanded** (``dispatch_expanded``, what ``MoELayer`` runs here): ``do_expand=True`` with
  ``expert_alignment=1``, one row per (token, local expert) grouped by expert, the row's weight
  ``[N]``; ``combine`` sums a token's rows on each rank and then across ranks (one bf16 rounding
  per rank, DeepEP's ``allow_multiple_reduction``); the weights' gradient comes back through
  combine's fp32 weights channel (``combine_slot_weights``).
- **One buffer per process and group** (``buffer.SharedV2Buffer``), sized with
  ``ElasticBuffer.get_buffer_size_hint`` for the largest (M, Xw, k) seen.
- Rows travel as bf16 bit views (``sizing.WireFormat``), padded to the 32-byte rows the
  V2 token layout takes; combine rows are padded to a multiple of 256 bf16 columns (the V2
  combine kernel's rule). fp8 ``(x, scales)`` tuples pass through.
- **Dropless** (``num_worst_tokens=0``): ``do_cpu_sync=True`` with
  ``M = DispatchConfig.num_max_dispatch_tokens_per_rank`` at first, a bound every rank shares and
  grows to the bucket (``v25.support.token_bucket``) of the largest T a rank dispatches
  (``bounded``).
- **Worst-case** (``num_worst_tokens = W``, W a multiple of R): ``do_cpu_sync=False`` with
  ``M = W / R``: DeepEP returns ``R * M = W`` rows, the first ones equal to the dropless rows; the
  real row count is ``psum_num_recv_tokens_per_scaleup_rank[-1]`` on the device. Intranode and
  across nodes alike; the token bound and the receive order as ``bounded`` describes them.
- Weights: V2 returns the sender's weights in every slot; the contract wants 0 where the id is
  not local, so they are masked.
- **Combine**: V2 sums unweighted, as the contract wants, in bf16 (wider fp32/fp16 rows are
  reduced in bf16: use bf16 activations); narrow fp32/fp16 rows exactly (``bounded``).
- **Cached dispatch** (the backward of combine) re-sends along the ``EPHandle``: no host sync.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch.backends.base import Capability
from flexdispatch.backends.deepep import buffer as deepep_buffer
from flexdispatch.backends.deepep import refusals, sizing
from flexdispatch.backends.deepep.bounded import COMBINE_COLS, BoundedBackend, BoundedState, Launch
from flexdispatch.backends.deepep.support import nvl_peers, require_deep_ep
from flexdispatch.backends.deepep.v25.support import token_bucket
from flexdispatch.types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    ExpandedDispatchResult,
)

__all__ = ["DeepEPV2Backend", "v2_available"]

DEFAULT_NUM_SMS = 20  # V1 Buffer.num_sms; passed explicitly (num_sms=0 runs DeepEP's SM model)
_DISPATCH_COL_MULTIPLE = 16  # 32-byte token rows (layout.cuh:198)


def v2_available(module: ModuleType | None) -> Capability:
    """Whether ``module`` offers DeepEP's V2 API (``deep_ep.ElasticBuffer``)."""
    if module is None:
        return False, "deep_ep does not import"
    if getattr(module, "ElasticBuffer", None) is None:
        version = getattr(module, "__version__", "?")
        return False, (
            f"deep_ep {version} has no ElasticBuffer (DeepEP's V2 API, 2.1.0+): install "
            "sgl-deep-ep / DeepEP 2.1.0, or set deepep_api='v1'"
        )
    return True, "deep_ep.ElasticBuffer exists"


def _a32(n: int) -> int:
    return -(-n // 32) * 32


class DeepEPV2Backend(BoundedBackend):
    """Dispatch/combine over ``deep_ep.ElasticBuffer`` (direct mode, non-expand layout).

    Args:
        group: the process group (None = WORLD); NCCL on CUDA.
        num_experts: E, divisible by R.
        ranks_per_node: L as launched.
        num_worst_tokens: W (0 = dropless), a multiple of R; intranode and internode.
        hierarchical: accepted; DeepEP routes across nodes itself.
        checks: in worst-case mode, every rank's token count and row shape (H, k, dtype) agreed
            on the host before the dispatch, so that a rank over M, or ranks that disagree on the
            shape, make every rank raise (dropless mode always agrees them).
        stats: counters to add to.
        num_sms: SMs per kernel (default 20), passed explicitly to every call.
        num_max_tokens_per_rank: M for dropless dispatch, shared by every rank (the first one: it
            grows to the largest T the ranks dispatch).
        _deep_ep: a ``deep_ep`` module to use instead of importing one (tests: the emulator).

    Raises:
        ValueError: no ``ElasticBuffer``, W not a multiple of R, E not divisible by R.
    """

    api = "v2"
    release = "DeepEP V2"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_sms: int | None = None,
        num_max_tokens_per_rank: int = 128,
        _deep_ep: ModuleType | None = None,
        **common: Any,
    ) -> None:
        module = require_deep_ep(_deep_ep)
        ok, why = v2_available(module)
        if not ok:
            raise ValueError(f"deepep_api='v2' cannot run: {why}")
        super().__init__(group, **common)
        R, num_experts, num_worst_tokens = self.num_ranks, self.num_experts, self.num_worst_tokens
        if num_experts % R:
            raise ValueError(f"num_experts={num_experts} is not divisible by R={R}")
        if num_worst_tokens % R:
            raise ValueError(
                f"num_worst_tokens={num_worst_tokens} must be a multiple of R={R} on the V2 "
                f"path (it becomes num_max_tokens_per_rank = W / R)"
            )
        if num_max_tokens_per_rank <= 0:
            raise ValueError(
                f"num_max_tokens_per_rank must be positive, got {num_max_tokens_per_rank}"
            )
        self.num_sms = DEFAULT_NUM_SMS if num_sms is None else num_sms
        if self.num_sms <= 0:
            raise ValueError(f"deepep num_sms must be positive, got {self.num_sms}")
        bound = num_worst_tokens // R if num_worst_tokens else num_max_tokens_per_rank
        self._setup(module, max_tokens=bound)
        self._shared = deepep_buffer.acquire_v2(module, self.group, id(self))
        # NOTE: the decode path's per-shape plans (issue 46): (T, X, dtype, k, expand, M) ->
        # (Launch, padded width, row bytes); combine's row bytes per kernel key
        self._plans: dict[tuple, tuple[Launch, int, int]] = {}
        self._combine_bytes: dict[tuple, int] = {}

    # ----------------------------------------------------------------- capabilities
    def supports_worst_case(self) -> Capability:
        return True, (
            "deepep v2: num_worst_tokens = W -> do_cpu_sync=False with "
            "num_max_tokens_per_rank = W / R (intranode and internode), tails masked on the device"
        )

    def supports_hierarchical(self) -> Capability:
        return True, "deepep v2: DeepEP routes across nodes itself"

    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        peers = min(nvl_peers(self.deep_ep), num_ranks)
        if num_ranks % peers:
            return False, f"R={num_ranks} is not a multiple of DeepEP's NVLink domain {peers}"
        return True, f"deepep v2 direct mode over {num_ranks // peers} NVLink domain(s)"

    # ----------------------------------------------------------------- the token bound
    def _grown(self, need: int) -> tuple[int, int]:
        bound = token_bucket(need)
        return bound, bound

    def _tokens_message(self, rank: int | str, T: int) -> str:
        M, R = self.max_tokens, self.num_ranks
        if self.worst_case:
            W = self.num_worst_tokens
            return (
                f"rank {rank} dispatches {T} tokens but num_worst_tokens W={W} allows W/R = "
                f"{W}/{R} = {M} per rank on DeepEP's V2 path (num_max_tokens_per_rank = W/R): "
                f"raise DispatchConfig.num_worst_tokens to at least {T * R} (or, intranode, "
                f"deepep_api='v1': V1 caps W / R rows per destination instead)"
            )
        return (
            f"rank {rank} dispatches {T} tokens but DeepEP's V2 dispatch takes at most "
            f"num_max_tokens_per_rank = {M} per rank: raise "
            f"DispatchConfig.num_max_dispatch_tokens_per_rank to at least {T} (on every rank)"
        )

    # ----------------------------------------------------------------- statistics
    def _account(self, kind: str, h: Any, row_bytes: int) -> None:
        """Record a call's traffic, computed from the ``EPHandle`` later (at once while a CUDA
        graph is captured) and summed on the device: no host read on the hot path
        (``counters.TrafficCounters``).

        Direct mode sends every row straight to its rank: a dispatch sends one row per (token,
        destination rank) — the ``dst_buffer_slot_idx >= 0`` entries, at each destination's
        first top-k slot — and a combine one row back per received row (expanded rows are summed
        on their rank first), to the source ranks of ``psum_num_recv_tokens_per_scaleup_rank``.
        Bytes are DeepEP's token layouts; rows to this rank itself are not counted as traffic.
        """

        def values() -> tuple[Any, ...]:
            ps = h.psum_num_recv_tokens_per_scaleup_rank.to(torch.int64)
            if kind == "combine":
                rows = torch.diff(ps, prepend=ps.new_zeros(1))
            else:
                rows = self._sent_rows(h)
            R, L, me = self.num_ranks, self.ranks_per_node, self.rank
            node = torch.arange(R, device=rows.device) // L
            same = (node == me // L) & (torch.arange(R, device=rows.device) != me)
            intra = (rows * same).sum() * row_bytes
            inter = (rows * (node != me // L)).sum() * row_bytes
            if kind == "dispatch":
                return intra, inter, rows.sum(), ps[-1]
            return intra, inter, 0, 0

        self._counters.record(values)

    def _sent_rows(self, h: Any) -> torch.Tensor:
        """``[R]`` int64 rows one dispatch sent to each rank (on the device, no host read)."""
        R = self.num_ranks
        idx = h.topk_idx.to(torch.int64)
        first = (h.dst_buffer_slot_idx >= 0) & (idx >= 0)
        dest = torch.where(first, idx // self.num_local_experts, R).flatten()
        hits = torch.zeros(R + 1, dtype=torch.int64, device=idx.device)
        return hits.scatter_add_(0, dest, torch.ones_like(dest))[:R]

    @staticmethod
    def _dispatch_row_bytes(row_bytes: int, scales: int, k: int) -> int:
        """``TokenLayout`` bytes of a dispatched row: the row, the scales, ids and weights."""
        return _a32(row_bytes) + _a32(4 * scales) + _a32(8 * k + 4 * (1 + k))

    @staticmethod
    def _combine_row_bytes(columns: int, k: int) -> int:
        """``TokenLayout`` bytes of a combined row: bf16 columns and the weights channel."""
        return _a32(2 * columns) + _a32(8 * k)

    # ----------------------------------------------------------------- dispatch
    def _launch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        expand: bool,
        *,
        plan: bool = True,
    ) -> tuple[Any, ...]:
        """Checks, padding and the one ``ElasticBuffer.dispatch`` call of both layouts:
        ``(recv, recv_idx, recv_w, handle, recv_scales, Launch)`` (dropless over the bound:
        dispatched again, every rank, once the bound grew: ``bounded``)."""
        if plan and not isinstance(x, tuple):
            # NOTE: a planned row shape (the decode path): what it fixes comes from its first
            # call (every check ran there)
            key = (x.shape[0], x.shape[1], x.dtype, topk_idx.shape[1], expand)
            planned = self._plans.get((*key, self.num_max_tokens_per_rank))
            if planned is not None:
                return self._planned_launch(planned, x, topk_idx, topk_probs, expand)
        given = (x, topk_idx, topk_probs)
        x, scales, wire = sizing.split_rows(x, fp8_multiple=32)
        T, X = x.shape
        num_scales = 0 if scales is None else scales.shape[1]
        k = topk_idx.shape[1]
        sizing.check_topk(k, "V2 kernels")
        if not self.worst_case:
            refusals.check_dropless_capture("DeepEP V2")
        sent, agreement = self._check_tokens(T, (X, k, x.dtype))
        if sent < T:  # NOTE: checks off, over M: the first M (_check_tokens)
            x, topk_idx, topk_probs = x[:sent], topk_idx[:sent], topk_probs[:sent]
            scales = None if scales is None else scales[:sent]
        if scales is not None:
            send: Any = (x.contiguous(), scales.contiguous())
            # NOTE: the buffer is sized as bf16 rows: X bf16 columns hold X fp8 bytes + scales
            hidden = X
        else:
            w = sizing.pad_cols(wire.send(x), _DISPATCH_COL_MULTIPLE)
            send, hidden = w, w.shape[1]
        buffer = self._buffer(max(hidden, COMBINE_COLS), k)
        idx = (
            topk_idx if topk_idx.dtype == self.topk_idx_dtype else topk_idx.to(self.topk_idx_dtype)
        )
        probs = topk_probs if topk_probs.dtype == torch.float32 else topk_probs.float()
        M = self.num_max_tokens_per_rank
        row_bytes = hidden * (1 if scales is not None else 2)  # fp8 bytes, or bf16 wire columns
        fields = (not self.worst_case, row_bytes, num_scales, M, k, expand)
        refusals.first_use(
            self.deep_ep, ("dispatch", self.num_experts, self.num_sms, *fields), "dispatch"
        )
        recv, recv_idx, recv_w, handle, _ = buffer.dispatch(
            send,
            topk_idx=idx.contiguous(),
            topk_weights=probs.contiguous(),
            num_experts=self.num_experts,
            num_max_tokens_per_rank=self.num_max_tokens_per_rank,
            expert_alignment=1,
            num_sms=self.num_sms,
            do_cpu_sync=not self.worst_case,
            do_expand=expand,
        )
        recv_scales = None
        if scales is not None:
            recv, recv_scales = recv
            row = self._dispatch_row_bytes(x.shape[1] * x.element_size(), scales.shape[1], k)
        else:
            row = self._dispatch_row_bytes(2 * hidden, 0, k)
        self._account("dispatch", handle, row)
        if self._agreed(agreement):  # NOTE: a rank was over M: M grew on every rank, again
            return self._launch(*given, expand)
        launch = Launch(wire=wire, fp8=scales is not None, T=T, X=X, k=k, sms=self.num_sms)
        if scales is None and sent == T:  # NOTE: plan this row shape (``_planned_launch``)
            plans = self._plans
            if len(plans) >= 16:
                del plans[next(iter(plans))]
            plans[(T, X, x.dtype, k, expand, M)] = (launch, hidden, row)
        return recv, recv_idx, recv_w, handle, recv_scales, launch

    def _planned_launch(
        self,
        plan: tuple[Launch, int, int],
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        expand: bool,
    ) -> tuple[Any, ...]:
        """``_launch`` of a row shape planned by its first call: the wire format, the padded
        width, the row bytes and the ``Launch`` record (immutable, shared by the calls) are the
        plan's; the token bound, the buffer and DeepEP's dispatch run as in ``_launch``."""
        launch, hidden, row = plan
        T, k = launch.T, launch.k
        if self._worst and not self._checks_flag and self.max_tokens >= T:
            agreement = None  # NOTE: what _check_tokens answers here, without a call
        else:
            if not self._worst:
                refusals.check_dropless_capture("DeepEP V2")
            sent, agreement = self._check_tokens(T, (launch.X, k, x.dtype))
            if sent < T:  # NOTE: over M (checks off): the unplanned path cuts the rows
                return self._launch(x, topk_idx, topk_probs, expand, plan=False)
        w = sizing.pad_cols(launch.wire.send(x), _DISPATCH_COL_MULTIPLE)
        buffer = self._buffer(max(hidden, COMBINE_COLS), k)
        idx = (
            topk_idx if topk_idx.dtype == self.topk_idx_dtype else topk_idx.to(self.topk_idx_dtype)
        )
        probs = topk_probs if topk_probs.dtype == torch.float32 else topk_probs.float()
        recv, recv_idx, recv_w, handle, _ = buffer.dispatch(
            w,
            topk_idx=idx.contiguous(),
            topk_weights=probs.contiguous(),
            num_experts=self.num_experts,
            num_max_tokens_per_rank=self.num_max_tokens_per_rank,
            expert_alignment=1,
            num_sms=self.num_sms,
            do_cpu_sync=not self._worst,
            do_expand=expand,
        )
        self._account("dispatch", handle, row)
        if agreement is not None and self._agreed(agreement):  # NOTE: M grew everywhere: again
            return self._launch(x, topk_idx, topk_probs, expand)
        return recv, recv_idx, recv_w, handle, None, launch

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """``ElasticBuffer.dispatch`` mapped to the contract (see the module docstring).

        ``layout`` is ignored: V2 computes its layout inside the dispatch kernel.
        """
        recv, recv_idx, recv_w, handle, recv_scales, launch = self._launch(
            x, topk_idx, topk_probs, expand=False
        )
        wire = launch.wire
        cols = recv.shape[1] if launch.fp8 else launch.X * wire.dtype.itemsize // 2
        return self._received(recv, recv_idx, recv_w, recv_scales, handle, launch, cols=cols)

    def dispatch_expanded(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> ExpandedDispatchResult:
        """``ElasticBuffer.dispatch(do_expand=True, expert_alignment=1)``: one row per (token,
        local expert), expert ``j``'s rows contiguous after expert ``j - 1``'s
        (``BoundedBackend._received_expanded``)."""
        recv, _, recv_w, handle, recv_scales, launch = self._launch(
            x, topk_idx, topk_probs, expand=True
        )
        return self._received_expanded(recv, recv_w, recv_scales, handle, launch)

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Re-send ``[T, X]`` rows along a dispatch's ``EPHandle`` (no host sync)."""
        state: BoundedState = handle.state
        h = state.handle
        x = x[: int(h.topk_idx.shape[0])]  # NOTE: the tokens the dispatch sent
        wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        w = sizing.pad_cols(wire.send(x), _DISPATCH_COL_MULTIPLE)
        buffer = self._buffer(max(w.shape[1], COMBINE_COLS), state.topk)
        key = ("cached", 2 * w.shape[1], state.topk, h.num_max_tokens_per_rank, h.num_sms)
        key = (*key, self.num_experts, self.worst_case)
        refusals.first_use(self.deep_ep, (*key, bool(h.do_expand)), "cached dispatch")
        got, *_ = buffer.dispatch(w, handle=h, do_expand=h.do_expand, num_sms=h.num_sms)
        self._account("cached", h, self._dispatch_row_bytes(2 * w.shape[1], 0, state.topk))
        if state.order is not None:
            # NOTE: one gather of only the caller's columns, tails zeroed in that copy
            got = got[:, : wire.width * wire.dtype.itemsize // 2].index_select(0, state.order)
        if state.valid is not None:
            got = sizing.zero_invalid_rows_(got, state.valid)
        return wire.recv(got)

    # ----------------------------------------------------------------- combine
    def _combine_call(
        self,
        part: torch.Tensor,
        state: BoundedState,
        weights: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ``ElasticBuffer.combine`` (V2 adds no bias: ``supports_combine_bias``)."""
        h, k = state.handle, state.topk
        buffer = self._buffer(part.shape[1], k)
        key = ("combine", part.shape[1], k, h.num_max_tokens_per_rank, self.num_sms)
        key = (*key, weights is not None, bool(h.do_expand))
        row = self._combine_bytes.get(key)
        if row is None:  # NOTE: a first use, refused inside a capture; its bytes kept
            refusals.first_use(self.deep_ep, key, "combine")
            row = self._combine_bytes[key] = self._combine_row_bytes(part.shape[1], k)
        if weights is None:
            out, out_w, _ = buffer.combine(part, h, num_sms=self.num_sms)
        else:
            out, out_w, _ = buffer.combine(part, h, topk_weights=weights, num_sms=self.num_sms)
        self._account("combine", h, row)
        return out, (out_w if weights is not None else None)

    def _combine_rows(self, y: torch.Tensor, state: BoundedState) -> torch.Tensor:
        """``y`` as DeepEP's combine input in one pass over the rows: the un-sort scatters
        straight into the padded bf16 buffer (no un-sorted copy followed by a padded copy)."""
        yb = y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)
        if state.order is None:
            return sizing.pad_cols(yb, COMBINE_COLS)
        rows, X = yb.shape
        padded = -(-X // COMBINE_COLS) * COMBINE_COLS
        part = torch.empty(rows, padded, dtype=torch.bfloat16, device=yb.device)
        if padded > X:
            part[:, X:].zero_()
        part[:, :X].index_copy_(0, state.order, yb)
        return part
