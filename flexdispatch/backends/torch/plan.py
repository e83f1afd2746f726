"""The flat dispatch of the ``torch`` backend across ranks, planned once per shape (issue 46).

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · W worst-case rows · S rows this rank sends
· B rows it receives · X any row width.

A decode step pays one dispatch and one combine per MoE layer with a few tokens per rank: every
op, host read, collective and Python call counts. What a call's ``(T, H, k, dtype, device,
checks)`` fixes is worked out once, at the first call of that key, into a ``FlatPlan``: the
device branch, the splits as ready lists, the byte accounting, the rank and local-id tables, the
send-slot tables, the buffers of a packed row (with their spare rows written once, CPU) and the
views into them. Each later call runs straight-line torch ops against it (``benchmarks/
bench_decode.py`` counts them; ``tests/dist/test_decode_counts.py`` pins the counts).

Collectives, the fewest at every row width (each row travels with its metadata, 4-aligned past
the row's bytes: ``[row bytes | k int32 ids | k fp32 probs (| worst count)]``):

- worst-case (``num_worst_tokens = W``): one ``all_to_all_single`` each way. Every peer gets
  ``cap = W / R`` rows from every rank, so the receiver tells the real rows by their ids (a
  padding row is the sender's spare row ``T``, whose ids are all dropped), and every rank's
  largest send count rides in one int32 column (``count * R + destination``, the same in every row
  a rank sends). The count exchange runs only at the first call of a row shape (H, k, dtype) on
  the CPU branch or with checks on: the agreement that every rank sends rows of that shape (a
  rank that later changes its shape alone breaks the collective, as with DeepEP, which checks
  nothing). An overflow (a rank sending more than ``cap`` rows to one peer) raises in dispatch on
  every rank with checks on (one host read), and is recorded on the device with checks off
  (``TorchA2ABackend.check_overflow`` raises it on every rank alike: every rank received every
  rank's worst count);
- dropless: the count exchange (an ``all_gather``, the one host read: receivers size their
  buffers from it), then one ``all_to_all_single`` each way. Rows and metadata travel in one
  collective while the largest receive fits ``PACK_MAX_CALL_BYTES`` (decided from the gathered
  counts, alike on every rank), else in two (prefill-sized calls, where packing would copy the
  rows once more).

Bad ids (checks off): clamped to ``-2`` / ``E`` (``rows.clamp_ids``), they land in the rank
table's sentinel bucket ``R`` (``-1`` in ``R + 1``), which selects no destination; the receiver's
local table maps them to "not mine". Their count is the pair counts' bin ``R`` (free in dropless,
one ``bincount`` in worst-case) plus one ``aminmax`` for the lowest and highest id
(``TorchA2ABackend.bad_ids``).

Combine sums the returning rows per node group from zeros, one ``index_add_`` per peer in rank
order (the order every torch path uses, docs/determinism.md). Buffers that never leave a call are
the plan's on the CPU branch (fresh buffers over 32 MiB are page-faulted on every call) and
``torch.empty`` on the CUDA branch (the caching allocator, safe across streams). Nothing a
handle or a result holds lives in a plan buffer.

One error boundary per call: the backend names the collective in flight
(``TorchA2ABackend.in_flight``) and turns a failing collective's ``RuntimeError`` into a
``CollectiveError`` naming it, instead of one ``collective_guard`` per collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flexdispatch import _pool
from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch.backends.counts import DTYPE_CODES, EXCHANGE_NAME, check_agreement
from flexdispatch.backends.torch.hops import A2AHost, first_rows, make_result
from flexdispatch.backends.torch.rows import overflow_message, slot_tables
from flexdispatch.kernels import inband as _inband
from flexdispatch.types import DispatchResult

__all__ = ["PACK_MAX_CALL_BYTES", "FlatPlan", "FlatState"]

PACK_MAX_CALL_BYTES = 4 << 20
"""A dropless call packs rows and metadata into one collective while the largest receive of any
rank is at most this many bytes (measured with ``benchmarks/bench_decode.py``: every decode case
up to T = 128 at H = 7168 packs)."""

META = "all_to_all_single (metadata)"

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# NOTE: torch >= 2.13 renames all_gather_into_tensor to all_gather_single (distributed.py)


class FlatState:
    """The torch backend's part of a ``DispatchHandle`` of a planned flat dispatch.

    Attributes:
        plan: the ``FlatPlan`` that made it.
        send_index: ``[S]`` int64, the input row of each send row (worst-case: ``[W]``, ``T`` on
            padding rows).
        out_index: worst-case: ``[W]`` int64, the receive-buffer row of each returned row (``W``,
            the zero spare row, on the tail); dropless: None (rows returned as they came).
        send_splits, recv_splits: ``[R]`` host lists (the same list object in worst-case).
    """

    __slots__ = ("out_index", "plan", "recv_splits", "send_index", "send_splits")

    def __init__(
        self,
        plan: FlatPlan,
        send_index: torch.Tensor,
        out_index: torch.Tensor | None,
        send_splits: list[int],
        recv_splits: list[int],
    ) -> None:
        self.plan = plan
        self.send_index = send_index
        self.out_index = out_index
        self.send_splits = send_splits
        self.recv_splits = recv_splits

    @property
    def worst_case(self) -> bool:
        return self.out_index is not None


class FlatPlan:
    """Everything a flat dispatch of one ``(T, H, k, dtype, device, checks)`` key fixes, and its
    dispatch, combine and cached dispatch (module docstring).

    Args:
        be: the backend (distributed, flat).
        T, H, k, dtype, device: the call's shape.
        checks: value checks on for these calls (resolved, not capturing).
    """

    def __init__(
        self,
        be: A2AHost,
        T: int,
        H: int,
        k: int,
        dtype: torch.dtype,
        device: torch.device,
        checks: bool,
    ) -> None:
        self.be = be
        self.group = be.group
        self.stats = be._stats
        R, me, E, e = be.num_ranks, be.rank, be.num_experts, be.num_local_experts
        self.R, self.me, self.E, self.e = R, me, E, e
        self.T, self.H, self.k, self.dtype, self.device = T, H, k, dtype, device
        self.checks = checks
        self.count_bad = not checks and be.counts_bad_ids
        self.shape = (H, k, dtype)
        self.cuda = cuda_code_path(device)
        self.reuse = not self.cuda  # NOTE: plan-owned buffers (CPU branch), else torch.empty
        self.rank_lut = be.rank_lut(device)
        self.local_lut = be.local_lut(device)
        self.node_groups = be.node_groups()
        L = be.ranks_per_node
        self.peers_intra = [r for r in range(R) if r != me and r // L == me // L]
        self.peers_inter = [r for r in range(R) if r // L != me // L]
        self.one_node = not self.peers_inter
        rb = H * dtype.itemsize
        self.rb = rb
        self.mo = -(-rb // 4) * 4  # NOTE: the metadata's byte offset, 4-aligned
        self.worst = be.worst_case
        ncol = 2 * k + int(self.worst)
        self.rowb = self.mo + 4 * ncol
        # NOTE: the bytes a row's payload counts in ``stats`` (rows, ids, probs): neither the
        # alignment nor the worst-count column, which stands in for the count exchange
        self.payload = rb + 8 * k
        self.bufs: dict[tuple, torch.Tensor] = {}
        # NOTE: a Python 0.0 would be wrapped into a tensor by every ``where`` (one op)
        self.zero = _pool.scalar(0.0, torch.float32, device)
        self.one: torch.Tensor | None = None
        if self.cuda:  # NOTE: the bincount of the CUDA branch (no host read of the maximum)
            self.one = torch.ones((), dtype=torch.int64, device=device)
        if self.worst:
            self._plan_worst()
        else:
            self._plan_dropless()

    # ----------------------------------------------------------------- planning
    def _plan_worst(self) -> None:
        be, T, k, R, E = self.be, self.T, self.k, self.R, self.E
        W = be.num_worst_tokens
        cap = W // R
        self.W, self.cap = W, cap
        self.splits = [cap] * R
        self.capped = cap < T  # NOTE: W >= R * T (the decode config): no send can overflow
        self.kernels = self.rb % 4 == 0 and _inband.pack_on_device(self.device)
        self.tables = None if self.kernels else slot_tables(T, R, cap, self.device)
        self.peer_arange = _pool.arange(R, self.device)
        self.no_need = torch.zeros((), dtype=torch.int64, device=self.device)
        rowb, mo = self.rowb, self.mo
        # the spare rows: a send row whose ids are all dropped (what padding reads), and the
        # receive buffer's zero row that the compaction's tail reads (ids dropped, probs 0)
        spare = torch.zeros(rowb, dtype=torch.uint8, device=self.device)
        spare[mo:].view(torch.int32)[:k].fill_(E)
        self.spare_row = spare
        if self.reuse:
            pack = torch.zeros((T + 1, rowb), dtype=torch.uint8, device=self.device)
            pack[T].copy_(spare)
            self.pack = pack
            self.pack_views = self._pack_views(pack)
            self.send = torch.empty((W, rowb), dtype=torch.uint8, device=self.device)
            recv = torch.empty((W + 1, rowb), dtype=torch.uint8, device=self.device)
            recv[W].copy_(spare)
            self.recv = recv
        self.acc = be.inband_worst(self.device)
        self.worst_R_col = 2 * k

    def _plan_dropless(self) -> None:
        be, R, T, device = self.be, self.R, self.T, self.device
        N = be.num_nodes
        n = 2 * R + N + 4
        self.pairs_col = n - R + self.me
        self.info_col = R + N
        info = torch.tensor(
            [0] * N + [self.H, self.k, DTYPE_CODES[self.dtype], T], dtype=torch.int64
        ).to(device)
        self.info = info
        if self.reuse:
            vec = torch.empty(n, dtype=torch.int64, device=device)
            vec[R : R + N + 4].copy_(info)
            self.vec = vec
            self.G = torch.empty((R, n), dtype=torch.int64, device=device)
            self.pack = torch.empty((T, self.rowb), dtype=torch.uint8, device=device)
            self.pack_views = self._pack_views(self.pack)

    # ----------------------------------------------------------------- buffers
    def _pack_views(self, pack: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of a send buffer ``[T (+ 1 spare), row]`` bytes: the ``[T, H]`` rows as the
        rows' dtype, the ``[T, k]`` int32 ids, the ``[T, k]`` probs as float32 and (worst-case)
        the ``[T + 1]`` int32 worst-count column."""
        T, k, mo = self.T, self.k, self.mo
        meta = pack[:, mo:].view(torch.int32)
        probs = meta[:T, k : 2 * k].view(torch.float32)
        need = meta[:, 2 * k] if self.worst else None
        return pack[:T, : self.rb].view(self.dtype), meta[:T, :k], probs, need

    def buffer(self, name: str, rows: int, width: tuple[int, ...], dtype: torch.dtype) -> Any:
        """``[rows, *width]`` of ``dtype`` that never leaves the call: the plan's (grown as
        needed, CPU branch) or ``torch.empty``."""
        if not self.reuse:
            return torch.empty((rows, *width), dtype=dtype, device=self.device)
        key = (name, width, dtype)
        buf = self.bufs.get(key)
        if buf is None or buf.shape[0] < rows:
            with torch.inference_mode(False):  # NOTE: written in place by later calls
                buf = torch.empty((max(rows, 1), *width), dtype=dtype, device=self.device)
            self.bufs[key] = buf
        return buf[:rows]

    # ----------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        mask_TR: torch.Tensor | None,
    ) -> DispatchResult:
        """One flat dispatch of contiguous inputs of this plan's shape."""
        be, R, T = self.be, self.R, self.T
        key_TK = topk_idx.clamp(-2, self.E)  # NOTE: bad ids -> the sentinel buckets
        rank_TK = self.rank_lut[key_TK]
        if mask_TR is None:
            mask = torch.zeros((T, R + 2), dtype=torch.bool, device=self.device)
            mask_TR = mask.scatter_(1, rank_TK, True)[:, :R]
        pairs = None
        if self.count_bad or not self.worst:
            pairs = self._bincount(rank_TK.view(-1), R + 2)
        if self.count_bad:
            if T:
                lowest, highest = torch.aminmax(topk_idx)
                be.bad_ids = (pairs[R], lowest, highest)
            else:
                be.bad_ids = (pairs[R], pairs[R], pairs[R])
        else:
            be.bad_ids = None
        if self.worst:
            return self._dispatch_worst(x, key_TK, topk_probs, mask_TR)
        return self._dispatch_dropless(x, key_TK, topk_probs, mask_TR, pairs)

    def _bincount(self, values: torch.Tensor, n: int) -> torch.Tensor:
        if self.one is None:
            return torch.bincount(values, minlength=n)  # 3x faster than scatter_add_ on CPU
        out = torch.zeros(n, dtype=torch.int64, device=self.device)
        return out.scatter_add_(0, values, self.one.expand(values.shape[0]))

    def _dispatch_worst(
        self,
        x: torch.Tensor,
        key_TK: torch.Tensor,
        probs_TK: torch.Tensor,
        mask_TR: torch.Tensor,
    ) -> DispatchResult:
        be, R, T, k, cap, W = self.be, self.R, self.T, self.k, self.cap, self.W
        device, rb, mo = self.device, self.rb, self.mo
        if self.shape not in be.agreed_shapes:
            self._agree_worst(mask_TR)
        # send slots: destination-major, cap rows per peer, T on padding (the spare row)
        count_TR = mask_TR.cumsum(0, dtype=torch.int64)
        need = None
        if self.capped:
            # this rank's worst send, as count * R + destination (ties: the highest destination)
            need = torch.add(self.peer_arange, count_TR[-1], alpha=R).max()
            keep_TR = mask_TR & (count_TR <= cap)
        else:
            keep_TR = mask_TR
        if self.kernels:
            send_index = _inband.capped_slots(mask_TR, cap)
            need = self.no_need if need is None else need
            send = _inband.pack_inband(x, key_TK, probs_TK, send_index, need, self.E)
        else:
            base_1R, spare_TR, rows_TR = self.tables
            slot_TR = torch.where(keep_TR, count_TR + base_1R, spare_TR)
            buf = torch.full((R * cap + R * T,), T, dtype=torch.int64, device=device)
            send_index = buf.scatter_(0, slot_TR.view(-1), rows_TR)[: R * cap]
            if self.reuse:
                pack = self.pack
                rows_T, ids_T, probs_T, need_T = self.pack_views
            else:
                pack = torch.zeros((T + 1, self.rowb), dtype=torch.uint8, device=device)
                pack[T].copy_(self.spare_row)
                rows_T, ids_T, probs_T, need_T = self._pack_views(pack)
            rows_T.copy_(x)
            ids_T.copy_(key_TK)
            probs_T.copy_(probs_TK)
            if need is not None:
                need_T.copy_(need)
            if self.reuse:
                send = torch.index_select(pack, 0, send_index, out=self.send)
            else:
                send = pack.index_select(0, send_index)
        if self.reuse:
            recv = self.recv
        else:
            recv = torch.empty((W + 1, self.rowb), dtype=torch.uint8, device=device)
            recv[W].copy_(self.spare_row)
        be.all_to_all(send, self.splits, self.splits, out=recv[:W])
        stats = self.stats
        stats.rows_sent += W
        stats.rows_received += W
        self._account(self.splits, self.payload)
        meta_all = recv[:, mo:].view(torch.int32)
        worst_R = meta_all[:W].view(R, cap, 2 * k + 1)[:, 0, 2 * k]
        if self.checks:  # NOTE: the same error on every rank now (every rank got every worst)
            be.raise_inband_overflow(worst_R.tolist())
        else:
            torch.maximum(self.acc, worst_R, out=self.acc)
        shifted_all = self.local_lut[meta_all[:, :k]]  # id - lo + 1, 0 = not mine
        mine_W = shifted_all[:W].any(1)  # the real rows: the first of each block
        if self.kernels:
            got = _inband.unpack_blocks(
                recv[:W, :rb].view(self.dtype),
                meta_all[:W, : 2 * k],
                mine_W.view(R, cap).sum(1),
                cap=cap,
                k=k,
                lo=self.me * self.e,
                num_local=self.e,
            )
            recv_x, ids, probs, counts, out_index, _ = got
        else:
            out_index = torch.nonzero_static(mine_W, size=W, fill_value=W)[:, 0]
            recv_x = recv[:, :rb].view(self.dtype).index_select(0, out_index)
            shifted = shifted_all.index_select(0, out_index)
            ids = shifted - 1
            probs_all = meta_all[:, k : 2 * k].view(torch.float32)
            probs = torch.where(shifted > 0, probs_all.index_select(0, out_index), self.zero)
            counts = self._bincount(shifted.view(-1), self.e + 1)[1:]
        state = FlatState(self, send_index, out_index, self.splits, self.splits)
        return make_result(state, T, self.H, recv_x, ids, probs, counts, None, be.issuer)

    def _agree_worst(self, mask_TR: torch.Tensor) -> None:
        """The first call of a row shape: the count exchange, for the agreement on (H, k, dtype)
        and, where the host copy is taken, the overflow check on every rank (module docstring).
        On the CUDA branch with checks off nothing is read: the shape counts as agreed."""
        be, R = self.be, self.R
        if self.cuda and not self.checks:
            be.agreed_shapes.add(self.shape)
            return
        zeros_R = _pool.scalar(0, torch.int64, self.device).expand(R)
        G = be.exchange_counts(mask_TR, self.H, self.k, self.dtype, zeros_R)
        pending = be.start_host_counts(G)
        if pending is None:  # NOTE: W = R times the largest count (a multiple of R already)
            be.record_overflow(G[:, :R].max(), scale=R)
        else:
            Gh = pending.wait()  # NOTE: checks the agreement
            worst = max((Gh[s][g], s, g) for s in range(R) for g in range(R))
            if worst[0] > self.cap:
                what = f"rank {worst[1]} sending to rank {worst[2]}"
                W = self.W
                raise ValueError(overflow_message(what, worst[0], self.cap, W, R, R))
        be.agreed_shapes.add(self.shape)

    def _dispatch_dropless(
        self,
        x: torch.Tensor,
        key_TK: torch.Tensor,
        probs_TK: torch.Tensor,
        mask_TR: torch.Tensor,
        pairs: torch.Tensor,
    ) -> DispatchResult:
        be, R, T, k, me, device = self.be, self.R, self.T, self.k, self.me, self.device
        rb, mo = self.rb, self.mo
        if self.reuse:
            vec, G = self.vec, self.G
            torch.sum(mask_TR, 0, dtype=torch.int64, out=vec[:R])
            vec[-R:].copy_(pairs[:R])
        else:
            per_rank = mask_TR.sum(0, dtype=torch.int64)
            vec = torch.cat([per_rank, self.info, pairs[:R]])
            G = torch.empty((R, vec.shape[0]), dtype=torch.int64, device=device)
        be.in_flight = EXCHANGE_NAME
        _GATHER(G.view(-1), vec, group=self.group)
        be.in_flight = None
        Gh = G.tolist()  # NOTE: the dispatch's one host read
        stats = self.stats
        stats.host_syncs += 1
        c = self.info_col
        shape_0 = Gh[0][c : c + 3]
        if [row[c : c + 3] for row in Gh].count(shape_0) != R:
            check_agreement(Gh, num_ranks=R, num_nodes=be.num_nodes)
        cols = list(zip(*Gh, strict=True))
        send_splits = Gh[me][:R]
        recv_splits = list(cols[me])
        S, B = sum(send_splits), sum(recv_splits)
        pairs_in = sum(cols[self.pairs_col])
        send_index = torch.nonzero_static(mask_TR.t(), size=S)[:, 1]
        packed = max(map(sum, cols[:R])) * self.rowb <= PACK_MAX_CALL_BYTES
        if packed:
            if self.reuse:
                pack = self.pack
                rows_T, ids_T, probs_T, _ = self.pack_views
            else:
                pack = torch.empty((T, self.rowb), dtype=torch.uint8, device=device)
                rows_T, ids_T, probs_T, _ = self._pack_views(pack)
            rows_T.copy_(x)
            ids_T.copy_(key_TK)
            probs_T.copy_(probs_TK)
            if self.reuse:
                send = torch.index_select(pack, 0, send_index, out=self.buffer("send", S,
                                          (self.rowb,), torch.uint8))  # fmt: skip
            else:
                send = pack.index_select(0, send_index)
            recv = self.buffer("recv", B, (self.rowb,), torch.uint8)
            be.all_to_all(send, send_splits, recv_splits, out=recv)
            recv_x = recv[:, :rb].view(self.dtype).clone()
            meta_in = recv[:, mo:].view(torch.int32)
            self._account(send_splits, self.payload)
        else:
            recv_x, meta_in = self._rows_then_meta(x, key_TK, probs_TK, send_index,
                                                   send_splits, recv_splits, B)  # fmt: skip
        stats.rows_sent += S
        stats.rows_received += B
        shifted = self.local_lut[meta_in[:, :k]]
        ids = shifted - 1
        probs = torch.where(shifted > 0, meta_in[:, k:].view(torch.float32), self.zero)
        counts = self._bincount(shifted.view(-1), self.e + 1)[1:]
        state = FlatState(self, send_index, None, send_splits, recv_splits)
        return make_result(state, T, self.H, recv_x, ids, probs, counts, pairs_in, be.issuer)

    def _rows_then_meta(
        self,
        x: torch.Tensor,
        key_TK: torch.Tensor,
        probs_TK: torch.Tensor,
        send_index: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        B: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dropless call too large to pack: the rows straight into the caller's tensor, then
        their ``[B, 2k]`` int32 metadata (two collectives)."""
        k = self.k
        meta_TK = torch.empty((self.T, 2 * k), dtype=torch.int32, device=self.device)
        meta_TK[:, :k].copy_(key_TK)
        meta_TK[:, k:].view(torch.float32).copy_(probs_TK)
        be = self.be
        recv_x = be.output((B, self.H), self.dtype, self.device)
        be.all_to_all(x.index_select(0, send_index), send_splits, recv_splits, out=recv_x)
        meta_in = torch.empty((B, 2 * k), dtype=torch.int32, device=self.device)
        send_meta = meta_TK.index_select(0, send_index)
        be.all_to_all(send_meta, send_splits, recv_splits, out=meta_in, what=META)
        self._account(send_splits, self.payload)
        return recv_x, meta_in

    def _account(self, splits: list[int], row_bytes: int) -> None:
        """Add the bytes of ``splits[r]`` rows of ``row_bytes`` sent to every peer ``r != me``
        (``stats.bytes_sent_intra_node`` / ``_inter_node``)."""
        stats = self.stats
        if self.one_node:
            stats.bytes_sent_intra_node += (sum(splits) - splits[self.me]) * row_bytes
            return
        stats.bytes_sent_intra_node += sum([splits[r] for r in self.peers_intra]) * row_bytes
        stats.bytes_sent_inter_node += sum([splits[r] for r in self.peers_inter]) * row_bytes

    # ----------------------------------------------------------------- combine
    def combine(self, y: torch.Tensor, st: FlatState) -> torch.Tensor:
        """Send ``y`` (the rows dispatch returned, any width) back and sum them per token."""
        width, dtype, T = y.shape[1:], y.dtype, self.T
        S = st.send_index.shape[0]
        back = self.buffer("back", S, width, dtype)
        if st.out_index is not None:
            # NOTE: each returned row to its receive-buffer row (the tail onto the spare row
            # W, cut off); rows that were never returned keep arbitrary bytes, which travel
            # back into the senders' dummy row T
            W = self.W
            ret = self.buffer("return", W + 1, width, dtype)
            ret.index_copy_(0, st.out_index, y)
            y = ret[:W]
        self.be.all_to_all(y, st.recv_splits, st.send_splits, out=back)
        self._account(st.recv_splits, width.numel() * y.element_size())
        rows_out = T + int(st.out_index is not None)
        offsets = st.send_splits
        send_index = st.send_index
        out = None
        for members in self.node_groups:
            part = torch.zeros((rows_out, *width), dtype=dtype, device=self.device)
            for r in members:
                lo = sum(offsets[:r])
                hi = lo + offsets[r]
                if hi > lo:
                    # NOTE: one index_add_ per peer in rank order: unique indices (except the
                    # dummy row), so the order of the additions is fixed on every device
                    part.index_add_(0, send_index[lo:hi], back[lo:hi])
            out = part if out is None else out.add_(part)
        assert out is not None
        return first_rows(out, T) if rows_out > T else out

    def cached_dispatch(self, x: torch.Tensor, st: FlatState) -> torch.Tensor:
        """Send new rows (any width) along ``st``'s layout: the backward of ``combine``."""
        width, dtype, T = x.shape[1:], x.dtype, self.T
        S = st.send_index.shape[0]
        if st.out_index is None:
            B = sum(st.recv_splits)
            out = self.be.output((B, *width), dtype, self.device)
            send = x.index_select(0, st.send_index)
            return self.be.all_to_all(send, st.send_splits, st.recv_splits, out=out)
        W = self.W
        if T:
            send = x.index_select(0, st.send_index.clamp(max=T - 1))  # padding: any real row
        else:
            send = torch.zeros((S, *width), dtype=dtype, device=self.device)
        recv = self.buffer("recv_x", W + 1, width, dtype)
        recv[W].zero_()
        self.be.all_to_all(send, st.send_splits, st.recv_splits, out=recv[:W])
        return recv.index_select(0, st.out_index)
