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
- **One buffer per process and group** (``deepep_buffer.SharedElasticBuffer``), sized with
  ``ElasticBuffer.get_buffer_size_hint`` for the largest (M, Xw, k) seen.
- Rows travel as bf16 bit views (``deepep_sizing.WireFormat``), padded to the 32-byte rows the
  V2 token layout takes; combine rows are padded to a multiple of 256 bf16 columns (the V2
  combine kernel's rule). fp8 ``(x, scales)`` tuples pass through.
- **Dropless** (``num_worst_tokens=0``): ``do_cpu_sync=True`` with
  ``M = DispatchConfig.num_max_dispatch_tokens_per_rank`` at first, a bound every rank shares (the
  buffer is sized for it). Every token is sent (audit-4 P3): every rank's T is agreed on the
  host first (five ints gathered over gloo, ``distributed.host_gather_int64``: no device
  collective, no host sync), and when a rank has more than M every rank raises M to that T's
  bucket (``ep_support.token_bucket``; the buffer grows with it). One host sync (counted):
  DeepEP's CPU wait for the counts. Not capturable (refused inside a CUDA graph).
- **Worst-case** (``num_worst_tokens = W``, W a multiple of R): ``do_cpu_sync=False`` with
  ``M = W / R``: DeepEP returns ``R * M = W`` rows, the first ones equal to the dropless rows; the
  real row count is ``psum_num_recv_tokens_per_scaleup_rank[-1]`` on the device, from which the
  tails of rows, ids and weights are masked (zero / -1 / 0) without a host sync. Each rank owns
  M receive slots on every rank, so a rank with ``T > W / R`` tokens could overflow: it raises
  before any collective, naming the numbers. Intranode and across nodes alike.
- Weights: V2 returns the sender's weights in every slot; the contract wants 0 where the id is
  not local, so they are masked.
- **Combine**: V2 sums unweighted, as the contract wants, in bf16 (wider fp32/fp16 rows are
  reduced in bf16: use bf16 activations). fp32/fp16 rows of at most 32 columns (the probs
  gradient, narrow test rows) are summed exactly in fp32 through combine's ``topk_weights``
  channel, one combine per column (``_combine_fp32``).
- **Cached dispatch** (the backward of combine) re-sends along the ``EPHandle``: no host sync.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexdispatch._checks.tensors import checks_enabled
from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.counts import agree_tokens
from flexdispatch.backends.deepep import buffer as deepep_buffer
from flexdispatch.backends.deepep import refusals, sizing
from flexdispatch.backends.deepep.counters import TrafficCounters
from flexdispatch.backends.deepep.support import load_deep_ep, nvl_peers
from flexdispatch.backends.deepep.v2.combine import (
    _COMBINE_COL_MULTIPLE,
    ElasticCombineMixin,
    V2DispatchState,
)
from flexdispatch.backends.deepep.v25.support import token_bucket
from flexdispatch.distributed import collective_device, group_rank, group_size
from flexdispatch.types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    DispatchStats,
    ExpandedDispatchResult,
)

if TYPE_CHECKING:
    from flexdispatch.config import DispatchConfig

__all__ = ["DeepEPV2Backend", "V2DispatchState", "v2_available"]

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


def _token_order(
    handle: Any, rows: int, used: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The permutation putting DeepEP's received rows in (source rank, source token) order.

    DeepEP fills a sender's receive slots in ``atomicAdd`` order (I/dispatch.cuh:344-349), not
    token order; ``recv_src_metadata[:, 0] = src_rank * M + token`` is the contract's order key
    (the sort DeepEP's own ``deterministic=True`` epilogue does, here without its host-syncing
    boolean indexing). Rows past ``used`` (worst-case tails, uninitialised) sort last.

    Returns:
        ``(order, live)``: ``live`` the ``[rows]`` bool ``arange < used`` (None dropless), which
        marks the real rows before and after the sort alike.
    """
    key = handle.recv_src_metadata[:rows, 0]
    live = None
    if used is not None:
        live = torch.arange(rows, device=key.device) < used
        key = torch.where(live, key, torch.iinfo(key.dtype).max)
    return torch.argsort(key), live


def _a32(n: int) -> int:
    return -(-n // 32) * 32


class DeepEPV2Backend(ElasticCombineMixin, DispatchBackend):
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

    name = "deepep"
    api = "v2"

    @classmethod
    def config_options(cls, config: DispatchConfig) -> dict[str, Any]:
        return {
            "num_sms": config.deepep_num_sms,
            "num_max_tokens_per_rank": config.num_max_dispatch_tokens_per_rank,
        }

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_experts: int,
        ranks_per_node: int,
        num_worst_tokens: int = 0,
        hierarchical: bool = False,
        checks: bool | None = None,
        stats: DispatchStats | None = None,
        num_sms: int | None = None,
        num_max_tokens_per_rank: int = 128,
        _deep_ep: ModuleType | None = None,
    ) -> None:
        module = _deep_ep
        if module is None:
            module, why = load_deep_ep()
            if module is None:
                raise ValueError(f"deepep backend not available: {why}")
        ok, why = v2_available(module)
        if not ok:
            raise ValueError(f"deepep_api='v2' cannot run: {why}")
        self.group = group if group is not None else dist.group.WORLD
        self.num_ranks = R = group_size(group)
        self.rank = group_rank(group)
        self.ranks_per_node = ranks_per_node
        self.num_experts = num_experts
        if num_experts % R:
            raise ValueError(f"num_experts={num_experts} is not divisible by R={R}")
        if num_worst_tokens % R:
            raise ValueError(
                f"num_worst_tokens={num_worst_tokens} must be a multiple of R={R} on the elastic "
                f"path (it becomes num_max_tokens_per_rank = W / R)"
            )
        if num_max_tokens_per_rank <= 0:
            raise ValueError(
                f"num_max_tokens_per_rank must be positive, got {num_max_tokens_per_rank}"
            )
        self.num_worst_tokens = num_worst_tokens
        self.hierarchical = hierarchical
        self.checks = checks
        self._stats = stats if stats is not None else DispatchStats()
        self.num_sms = DEFAULT_NUM_SMS if num_sms is None else num_sms
        if self.num_sms <= 0:
            raise ValueError(f"deepep num_sms must be positive, got {self.num_sms}")
        self.num_max_tokens_per_rank = (
            num_worst_tokens // R if num_worst_tokens else num_max_tokens_per_rank
        )
        self.deep_ep = module
        self.topk_idx_dtype: torch.dtype = getattr(module, "topk_idx_t", torch.int64)
        self._shared = deepep_buffer.acquire_elastic(module, self.group, id(self))
        self._traffic = TrafficCounters(collective_device(self.group))  # no host read in calls
        self._need_tokens = 0  # most tokens a rank had to dispatch, when over M (checks off)
        self._peak_tokens = 0  # dropless: the largest T the ranks agreed on so far
        self._grown_from: int | None = None  # M before a growth not yet built
        self._closed = False

    # ----------------------------------------------------------------- capabilities
    @property
    def worst_case(self) -> bool:
        return self.num_worst_tokens > 0

    def supports_worst_case(self) -> Capability:
        return True, (
            "deepep elastic: num_worst_tokens = W -> do_cpu_sync=False with "
            "num_max_tokens_per_rank = W / R (intranode and internode), tails masked on the device"
        )

    def supports_cuda_graph(self) -> Capability:
        if not self.worst_case:
            return False, (
                "DeepEP's dropless elastic dispatch waits on the CPU for the receive counts: set "
                "num_worst_tokens for a capturable dispatch"
            )
        return True, "deepep elastic worst-case dispatch: static shapes, no host sync"

    def supports_hierarchical(self) -> Capability:
        return True, "deepep elastic: DeepEP routes across nodes itself"

    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        peers = min(nvl_peers(self.deep_ep), num_ranks)
        if num_ranks % peers:
            return False, f"R={num_ranks} is not a multiple of DeepEP's NVLink domain {peers}"
        return True, f"deepep elastic direct mode over {num_ranks // peers} NVLink domain(s)"

    @property
    def stats(self) -> DispatchStats:
        """Cumulative counters (the traffic of past calls folded in first)."""
        self.flush_stats()
        return self._stats

    @stats.setter
    def stats(self, value: DispatchStats) -> None:
        self._stats = value

    # ----------------------------------------------------------------- statistics
    def _account(self, kind: str, h: Any, row_bytes: int) -> None:
        """Record a call's traffic, computed from the ``EPHandle`` later (at once while a CUDA
        graph is captured) and summed on the device: no host read on the hot path (audit-3 N2;
        ``counters.TrafficCounters``).

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

        self._traffic.record(values)

    def flush_stats(self) -> None:
        """Add the traffic counted so far to ``stats`` (the safe point: one host read on CUDA)."""
        self._traffic.drain(self._stats)

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

    # ----------------------------------------------------------------- helpers
    def _buffer(self, hidden: int, topk: int) -> Any:
        if self._closed:
            raise RuntimeError("this deepep backend was closed")
        before = self._shared.allocations
        need = deepep_buffer.ElasticSize(self.num_max_tokens_per_rank, hidden, max(topk, 1))
        try:
            buffer = self._shared.ensure(
                need, tokens=self._peak_tokens, worst=self.num_worst_tokens
            )
        except ValueError:  # NOTE: it does not fit on some rank: every rank keeps its old M
            if self._grown_from is not None:
                self.num_max_tokens_per_rank = self._grown_from
            self._grown_from = None
            raise
        self._grown_from = None
        if self._shared.allocations != before:
            extra = self._stats.extra
            extra["deepep_buffer_allocations"] = extra.get("deepep_buffer_allocations", 0) + 1
        return buffer

    def _check_tokens(self, T: int, shape: tuple[int, int, torch.dtype]) -> int:
        """The tokens this rank sends, after every rank agreed on M (audit-4 P3).

        Dropless: nothing is dropped. Every rank's T and row shape ``shape`` = ``(X, k, dtype)``
        are agreed on the host first (``counts.agree_tokens``: a gloo all-gather, no host sync);
        when a rank has more than M, every rank raises M to that T's bucket at this same call
        (``_grow_bound``; the buffer grows with it: DeepEP needs one M on every rank), as V1's
        buffers grow.

        Worst-case: a rank may dispatch at most M = W / R tokens (its receive slots on every
        rank). With checks on, the same agreement makes every rank raise for the worst rank, and
        for ranks that disagree on the row shape. With checks off a rank over M sends its first
        M tokens (the others get nothing, their combine rows are zero) and ``check_overflow``
        raises: raising on that rank alone would leave its peers in DeepEP's GPU barrier until
        its 100 s timeout (audit-3 N7).
        """
        M, R = self.num_max_tokens_per_rank, self.num_ranks
        if not self.worst_case:
            self._grow_bound(max(agree_tokens(T, shape, self.group, name="elastic token count")))
            return T
        if checks_enabled(self.checks):
            counts = agree_tokens(T, shape, self.group, name="elastic token count")
            worst = max(range(R), key=counts.__getitem__)
            if counts[worst] > M:
                raise ValueError(self._tokens_message(worst, counts[worst]))
            return T
        if T > M:
            self._need_tokens = max(self._need_tokens, T)
            return M
        return T

    def _grow_bound(self, need: int) -> None:
        """Dropless: raise M to ``bucket(need)`` (every rank at the same call: ``need`` is the
        agreed maximum); the shared buffer is rebuilt for it at this call's ``_buffer``, once
        every rank agreed it fits (else every rank raises and keeps its old M)."""
        self._peak_tokens = max(self._peak_tokens, need)
        if need <= self.num_max_tokens_per_rank:
            return
        if self._grown_from is None:
            self._grown_from = self.num_max_tokens_per_rank
        self.num_max_tokens_per_rank = token_bucket(need)
        self._stats.extra["deepep_token_bound"] = self.num_max_tokens_per_rank

    def _tokens_message(self, rank: int | str, T: int) -> str:
        M, R = self.num_max_tokens_per_rank, self.num_ranks
        if self.worst_case:
            W = self.num_worst_tokens
            return (
                f"rank {rank} dispatches {T} tokens but num_worst_tokens W={W} allows W/R = "
                f"{W}/{R} = {M} per rank on DeepEP's elastic path (num_max_tokens_per_rank = W/R): "
                f"raise DispatchConfig.num_worst_tokens to at least {T * R} (or, intranode, "
                f"deepep_api='v1': V1 caps W / R rows per destination instead)"
            )
        return (
            f"rank {rank} dispatches {T} tokens but DeepEP's elastic dispatch takes at most "
            f"num_max_tokens_per_rank = {M} per rank: raise "
            f"DispatchConfig.num_max_dispatch_tokens_per_rank to at least {T} (on every rank)"
        )

    def check_overflow(self) -> None:
        """Raise if a rank was over M = W / R tokens with checks off in worst-case mode (it sent
        its first M only; a dropless M grows instead)."""
        self.flush_stats()
        if self._need_tokens:
            raise ValueError(
                self._tokens_message("this", self._need_tokens)
                + f"; tokens past the first {self.num_max_tokens_per_rank} were not dispatched"
            )

    # ----------------------------------------------------------------- dispatch
    def _launch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        expand: bool,
    ) -> tuple[Any, ...]:
        """Checks, padding and the one ``ElasticBuffer.dispatch`` call of both layouts."""
        x, scales, wire = sizing.split_rows(x, fp8_multiple=32)
        T, X = x.shape
        num_scales = 0 if scales is None else scales.shape[1]
        k = topk_idx.shape[1]
        sizing.check_topk(k, "elastic kernels")
        if not self.worst_case:
            refusals.check_dropless_capture("DeepEP V2")
        sent = self._check_tokens(T, (X, k, x.dtype))
        if sent < T:  # NOTE: worst-case, checks off, over M = W / R: the first M (_check_tokens)
            x, topk_idx, topk_probs = x[:sent], topk_idx[:sent], topk_probs[:sent]
            scales = None if scales is None else scales[:sent]
        if scales is not None:
            send: Any = (x.contiguous(), scales.contiguous())
            # NOTE: the buffer is sized as bf16 rows: X bf16 columns hold X fp8 bytes + scales
            hidden = X
        else:
            w = sizing.pad_cols(wire.send(x), _DISPATCH_COL_MULTIPLE)
            send, hidden = w, w.shape[1]
        buffer = self._buffer(max(hidden, _COMBINE_COL_MULTIPLE), k)
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
        return recv, recv_idx, recv_w, handle, recv_scales, wire, scales is not None, T, X, k

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
        recv, recv_idx, recv_w, handle, recv_scales, wire, fp8, T, X, k = self._launch(
            x, topk_idx, topk_probs, expand=False
        )
        e = self.num_local_experts
        valid = None
        pairs = None
        n = None
        if self.worst_case:
            n = handle.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
        order, live = _token_order(handle, recv.shape[0], n)
        if not fp8:
            # N11: one gather of only the columns the caller gets (no wire padding copied)
            recv = recv[:, : X * wire.dtype.itemsize // 2]
        recv, recv_idx, recv_w = (
            recv.index_select(0, order),
            recv_idx[order].to(torch.int64),
            recv_w[order],
        )
        if recv_scales is not None:
            recv_scales = recv_scales[order]
        local = recv_idx >= 0
        if live is not None:
            # NOTE: the real rows sort first, so `live` (arange < n) also marks them after the
            # sort; DeepEP's tails are uninitialised (ids and weights too)
            valid = live
            local &= live[:, None]
            recv_idx = torch.where(local, recv_idx, -1)
            recv = sizing.zero_invalid_rows_(recv, live)  # the gather's own copy (N21)
            counts = sizing.count_valid(recv_idx.reshape(-1), local.reshape(-1), e)
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales, live)
        else:
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            count_list = handle.num_recv_tokens_per_expert_list
            pairs = int(sum(count_list))
            counts = torch.tensor(count_list, dtype=torch.int64, device=recv_idx.device)
        recv_w = torch.where(local, recv_w.float(), 0.0)
        state = V2DispatchState(
            handle=handle,
            wire=wire,
            topk=k,
            local=local,
            valid=valid,
            recv_scales=recv_scales,
            order=order,
        )
        recv_x = recv if fp8 else wire.recv(recv)
        return DispatchResult(
            recv_x=recv_x,
            recv_topk_idx=recv_idx,
            recv_topk_probs=recv_w,
            num_recv_tokens_per_expert=counts,
            handle=DispatchHandle(
                backend=self.name,
                num_tokens=T,
                hidden=X,
                num_recv_rows=recv.shape[0],
                state=state,
            ),
            num_recv_pairs=pairs,
        )

    # ----------------------------------------------------------------- expanded
    def supports_expanded(self) -> Capability:
        return True, "deepep elastic: do_expand=True, rows grouped by local expert"

    def dispatch_expanded(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> ExpandedDispatchResult:
        """``ElasticBuffer.dispatch(do_expand=True, expert_alignment=1)``: one row per (token,
        local expert), expert ``j``'s rows contiguous after expert ``j - 1``'s.

        Dropless: the exact row count and per-expert sizes from DeepEP's one CPU wait.
        Worst-case: DeepEP's static ``align(R * M * min(k, e), 1)`` rows; the used extent is
        ``psum_num_recv_tokens_per_expert[-1]`` on the device, past which rows and weights
        (uninitialised in DeepEP) are zeroed without a host sync.
        """
        recv, _, recv_w, handle, recv_scales, wire, fp8, T, X, k = self._launch(
            x, topk_idx, topk_probs, expand=True
        )
        N = recv.shape[0]
        valid = None
        if self.worst_case:
            counts = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64)
            used = handle.psum_num_recv_tokens_per_expert[-1].to(torch.int64)
            valid = torch.arange(N, device=recv.device) < used
            recv = sizing.zero_invalid_rows_(recv, valid)  # DeepEP's fresh output (N21)
            recv_w = torch.where(valid, recv_w, 0.0)
            if recv_scales is not None:
                recv_scales = sizing.zero_invalid_rows_(recv_scales, valid)
        else:
            self._stats.host_syncs += 1  # DeepEP's CPU wait for the receive counts
            counts = torch.tensor(
                handle.num_recv_tokens_per_expert_list, dtype=torch.int64, device=recv.device
            )
        state = V2DispatchState(
            handle=handle, wire=wire, topk=k, local=None, valid=valid, recv_scales=recv_scales
        )
        return ExpandedDispatchResult(
            recv_x=recv if fp8 else wire.recv(recv),
            recv_probs=recv_w.float(),
            tokens_per_expert=counts,
            handle=DispatchHandle(
                backend=self.name, num_tokens=T, hidden=X, num_recv_rows=N, state=state
            ),
        )

    @staticmethod
    def _num_tokens(h: Any) -> int:
        return int(h.topk_idx.shape[0])

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Re-send ``[T, X]`` rows along a dispatch's ``EPHandle`` (no host sync)."""
        state: V2DispatchState = handle.state
        h = state.handle
        x = x[: self._num_tokens(h)]  # NOTE: the tokens the dispatch sent (N7)
        wire = sizing.WireFormat.of(x.dtype, x.shape[1])
        w = sizing.pad_cols(wire.send(x), _DISPATCH_COL_MULTIPLE)
        buffer = self._buffer(max(w.shape[1], _COMBINE_COL_MULTIPLE), state.topk)
        key = ("cached", 2 * w.shape[1], state.topk, h.num_max_tokens_per_rank, h.num_sms)
        key = (*key, self.num_experts, self.worst_case)
        refusals.first_use(self.deep_ep, (*key, bool(h.do_expand)), "cached dispatch")
        got, *_ = buffer.dispatch(w, handle=h, do_expand=h.do_expand, num_sms=h.num_sms)
        self._account("cached", h, self._dispatch_row_bytes(2 * w.shape[1], 0, state.topk))
        if state.order is not None:
            # one gather of only the caller's columns, tails zeroed in that copy (N11, N21)
            got = got[:, : wire.width * wire.dtype.itemsize // 2].index_select(0, state.order)
        if state.valid is not None:
            got = sizing.zero_invalid_rows_(got, state.valid)
        return wire.recv(got)

    def close(self) -> None:
        """Leave the shared ``ElasticBuffer`` (the recorded traffic is folded into ``stats``)."""
        if not self._closed:
            self.flush_stats()
            self._closed = True
            self._shared.leave(id(self))
