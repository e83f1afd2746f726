"""What the emulated token-bounded buffers share: V2's ``ElasticBuffer`` and V2.5's ``EPBuffer``.

TEST-ONLY. Shape letters: T tokens · H hidden · E experts · R ranks · e = E / R local experts ·
k top-k · M = ``num_max_tokens_per_rank`` · a = ``expert_alignment`` · n received rows.

DeepEP V2 (``csrc/elastic/``, DeepEP 2.1.0) and V2.5 (``csrc/buffers/ep.hpp`` of the
``sgl-deep-ep-v25`` wheel) are one design: a receive slot per (source rank, token) bounded by M,
rows sent once per destination rank, an expanded layout grouped by local expert, a combine that
sends each received token's row back. ``elastic.py`` (V2, direct mode) and ``ep.py`` (V2.5, direct
and hybrid mode) keep what differs — their asserts (``elastic.*`` / ``ep.*`` ids), V2.5's hybrid
mode, its shared receive region and deferred epilogues — and take the rest from here:

- ``BoundedRuntime``: the constructor's group hand-over (``check_nvlink_connections`` records the
  gloo group the emulation moves rows over), the seeded atomic order, the row packing of a
  dispatch, the first-slot indices of direct mode, the expanded placement, the combine's send and
  its weights channel;
- ``NcclComms``: the emulated NCCL communicators ``comm/handle.py`` / ``utils/comm.py`` create on a
  gloo group (``get_local_nccl_unique_id``, ``create_nccl_comm``, ``destroy_nccl_comm``);
- ``gin_disabled``: ``EP_DISABLE_GIN`` as both runtimes read it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from . import limits, nccl, transport

__all__ = [
    "BoundedRuntime",
    "NcclComms",
    "expert_counts",
    "gin_disabled",
]


def gin_disabled() -> bool:
    """``get_env("EP_DISABLE_GIN", 0) != 0`` as the runtime reads it: ``sscanf("%d")`` takes the
    leading integer ("2abc" is 2), into an int (utils/system.hpp); no integer: not skipped."""
    m = re.match(r"\s*([+-]?\d+)", os.environ.get("EP_DISABLE_GIN", "0"))
    return m is not None and (int(m.group(1)) & 0xFFFFFFFF) != 0


def expert_counts(local: torch.Tensor, e: int) -> torch.Tensor:
    """``[e]`` int64 (row, slot) pairs per local expert of ``local`` ``[n, k]`` (-1 elsewhere)."""
    if not e:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([(local == j).sum() for j in range(e)]).to(torch.int64)


class NcclComms:
    """The emulated NCCL communicators of one runtime module: handle -> ``(R, rank)``."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.comms: dict[int, tuple[int, int]] = {}

    def unique_id(self) -> bytearray:
        return bytearray(b"emulated-nccl-unique-id")

    def create(self, root_unique_id: Any, num_ranks: int, rank_idx: int) -> int:
        handle = self.base + len(self.comms)
        self.comms[handle] = (num_ranks, rank_idx)
        return handle

    def destroy(self, nccl_comm: int) -> None:
        self.comms.pop(nccl_comm, None)

    def size(self, nccl_comm: int) -> int:
        if nccl_comm not in self.comms:
            raise RuntimeError(f"emulated NCCL communicator {nccl_comm:#x} does not exist")
        return self.comms[nccl_comm][0]

    def install(self, mod: Any) -> None:
        """The module functions DeepEP's Python layer calls to make its communicator."""
        mod.get_local_nccl_unique_id = self.unique_id
        mod.create_nccl_comm = self.create
        mod.destroy_nccl_comm = self.destroy
        mod.emu_nccl_comms = self.comms


class BoundedRuntime:
    """The part of the emulated ``ElasticBuffer`` and ``EPBuffer`` that is the same (module
    docstring). A subclass sets ``rank``, ``num_ranks``, ``calls`` and ``group``."""

    rank: int
    num_ranks: int
    calls: int
    group: Any

    @staticmethod
    def take_group(module: Any, what: str) -> Any:
        """The gloo group the wheel's ``__init__`` handed to ``check_nvlink_connections`` just
        before building the emulated ``_C`` buffer."""
        group = module.pending_group
        module.pending_group = None
        if group is None:
            raise RuntimeError(f"emulated {what} built outside its Python class (no process group)")
        return group

    gin_contexts = True  # NOTE: the device communicator was built with GIN contexts

    def check_gin_contexts(self, rdma_ranks: int, prefix: str) -> None:
        """With ``EP_DISABLE_GIN`` the device communicator has no GIN contexts (V2.5
        context.cpp:124-155, V2 nccl.cu:86-99), which a kernel across RDMA ranks uses: a trap
        (DeepEP has no check for it)."""
        limits.device_trap(
            self.gin_contexts or rdma_ranks <= 1,
            f"{prefix}.no_gin_context",
            self.release_id,
            f"EP_DISABLE_GIN was set when the buffer was built, the group spans {rdma_ranks} "
            f"RDMA ranks",
        )

    release_id = ""

    def device_comm(
        self, module: Any, num_ranks: int, hybrid: bool, rel: str, *, v25: bool
    ) -> None:
        """DeepEP's NCCL device communicator, as its context builds it on the emulated NCCL
        (``module.emu_nccl``, ``nccl``), in DeepEP's order:

        - V2.5 asks NCCL's report first (context.cpp:117), V2 where it checks GIN (R > 1,
          nccl.cu:84): NCCL refuses a caller compiled newer than the runtime;
        - unless ``EP_DISABLE_GIN``: the GIN type, the railed one in hybrid mode, is not NONE
          (V2: for R > 1), and V2.5 also asserts GDAKI support;
        - V2 below NCCL 2.31: the runtime is the NCCL it was compiled with (nccl.cu:104);
        - ``ncclDevCommCreate`` refuses a communicator without symmetric memory, whatever
          ``EP_DISABLE_GIN`` (NCCL dev_runtime.cc:1523).
        """
        lib = module.emu_nccl
        caller = nccl.V25_CALLER if v25 else nccl.V2_CALLER
        runtime = lib.version()
        props = lib.query(num_ranks, caller)
        too_new = f"compiled with NCCL {nccl.code(caller)}, runtime {nccl.code(runtime)}"
        gin = not gin_disabled() and (v25 or num_ranks > 1)
        if v25 or gin:
            limits.host_assert(props is not None, "nccl.caller_too_new", "nccl", too_new)
        prefix = "ep" if v25 else "elastic"
        if gin:
            assert props is not None
            key = "railedGinType" if hybrid else "ginType"
            kind = props[key]
            limits.host_assert(kind != 0, f"{prefix}.gin_type", rel, f"NCCL reports {key} = NONE")
            if v25:
                gdaki = bool(props["ginSupport"] and props["ginSupport"][nccl.GIN_GDAKI])
                limits.host_assert(gdaki, "ep.gin_gdaki", rel, "NCCL reports no GDAKI support")
        if not v25:
            limits.host_assert(
                runtime == nccl.V2_CALLER,
                "elastic.nccl_version",
                rel,
                f"compiled with NCCL 2.30.7, this process runs NCCL {'.'.join(map(str, runtime))}",
            )
        limits.host_assert(props is not None, "nccl.caller_too_new", "nccl", too_new)
        assert props is not None
        limits.host_assert(
            bool(props["deviceApiSupport"]),
            "nccl.devcomm_symmetric",
            "nccl",
            "NCCL reports deviceApiSupport = 0 for this communicator",
        )
        self.gin_contexts = not gin_disabled()
        self.release_id = rel

    def gen(self) -> torch.Generator:
        """The seeded stand-in for DeepEP's ``atomicAdd`` order (per rank and call)."""
        self.calls += 1
        return torch.Generator().manual_seed(7919 * self.calls + self.rank)

    # ----------------------------------------------------------------- dispatch
    def dest_parts(self, topk_idx: torch.Tensor, e: int) -> tuple[torch.Tensor, list]:
        """``dest [T, k]`` (the destination rank of each slot, -1 for a dropped one) and, per
        destination rank, the tokens sent there (one row per token and rank)."""
        T, R = topk_idx.shape[0], self.num_ranks
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // e, -1)
        in_rank = torch.zeros(T, R, dtype=torch.bool)
        in_rank[valid.nonzero()[:, 0], dest[valid]] = True
        return dest, [in_rank[:, r].nonzero().flatten() for r in range(R)]

    def send_rows(
        self,
        x: torch.Tensor,
        sf: torch.Tensor | None,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        parts: list,
        M: int,
        recv_counts: list[int] | None,
    ) -> tuple[dict[str, Any], list[int]]:
        """Send each destination its tokens' rows (the parts' order is their slot order): ``x``
        (fp8 as bytes), ``src_rank * M + token``, the ids, the scales and the weights. The counts
        are exchanged first unless the receiver knows them (``recv_counts``: a cached dispatch).

        Returns:
            ``({"x", "src", "idx", "sf", "w"}, recv_counts)``: the rows received, grouped by
            source rank in rank order.
        """
        me, k = self.rank, topk_idx.shape[1]
        sel = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        fp8 = x.element_size() == 1
        fields = [
            x[sel].view(torch.uint8) if fp8 else x[sel],
            (me * M + sel).to(torch.int32).view(-1, 1),
            topk_idx[sel],
        ]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [
            (torch.uint8 if fp8 else x.dtype, (x.shape[1],)),
            (torch.int32, (1,)),
            (torch.int64, (k,)),
        ]
        if sf is not None:
            fields.append(sf[sel])
            specs.append((sf.dtype, (sf.shape[1],)))
        if topk_weights is not None:
            fields.append(topk_weights[sel])
            specs.append((torch.float32, (k,)))
        send_counts = [int(p.numel()) for p in parts]
        data = transport.pack(fields)
        if recv_counts is None:
            recv, recv_counts = transport.exchange(data, send_counts, self.group)
        else:
            recv = transport.exchange_known(data, send_counts, recv_counts, self.group)
        got = transport.unpack(recv, specs)
        rows = {
            "x": got[0].view(x.dtype) if fp8 else got[0],
            "src": got[1].view(-1),
            "idx": got[2],
            "sf": got[3] if sf is not None else None,
            "w": got[-1] if topk_weights is not None else None,
        }
        return rows, recv_counts

    def direct_slots(self, topk_idx: torch.Tensor, e: int, parts: list, M: int) -> torch.Tensor:
        """``dst_buffer_slot_idx [T, k]`` int32 of direct mode: ``rank * M + slot`` (this
        sender's region of the destination's receive buffer) at the first slot of each
        destination rank, -1 elsewhere (V2 I/dispatch.cuh:344-349, V2.5 :340-346)."""
        T, k = topk_idx.shape
        dest = torch.where(topk_idx >= 0, topk_idx // e, -1)
        slots = torch.full((T, k), -1, dtype=torch.int32)
        first = torch.ones(T, k, dtype=torch.bool)
        for j in range(1, k):
            first[:, j] = (dest[:, j : j + 1] != dest[:, :j]).all(1)
        for r, part in enumerate(parts):
            pos = torch.full((T,), -1, dtype=torch.int64)
            pos[part] = self.rank * M + torch.arange(part.numel())
            hit = first & (dest == r)
            slots[hit] = pos.view(T, 1).expand(T, k)[hit].to(torch.int32)
        return slots

    @staticmethod
    def trap_duplicates(local: torch.Tensor, lid: str, rel: str) -> None:
        """A received token naming one local expert twice traps in the copy epilogue."""
        srt = local.sort(1).values
        dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(1)
        limits.device_trap(
            not bool(dup.any()),
            lid,
            rel,
            f"{int(dup.sum())} received token(s) name one local expert twice",
        )

    @staticmethod
    def expand_slots(
        local: torch.Tensor, starts: torch.Tensor, e: int, g: torch.Generator | None
    ) -> torch.Tensor:
        """``[n, k]`` int64: the expanded row of each (row, slot) of a local expert, or -1:
        expert ``j``'s rows from ``starts[j]`` on, in atomic order when ``g`` is given."""
        n, k = local.shape
        dst = torch.full((n, k), -1, dtype=torch.int64)
        for j in range(e):
            hit = local == j
            rows_j = hit.any(1).nonzero().flatten()
            if g is not None:  # atomicAdd order inside an expert
                rows_j = rows_j[torch.randperm(rows_j.numel(), generator=g)]
            slot_j = hit[rows_j].to(torch.int64).argmax(1)
            dst[rows_j, slot_j] = starts[j] + torch.arange(rows_j.numel())
        return dst

    @staticmethod
    def zero_padding(
        tensors: list, starts: torch.Tensor, counts: torch.Tensor, aligned: torch.Tensor
    ) -> None:
        """``do_zero_padding``: zero each expert's alignment gap in every tensor given."""
        for j in range(counts.numel()):
            lo, hi = int(starts[j] + counts[j]), int(starts[j] + aligned[j])
            for t in tensors:
                if t is not None:
                    t[lo:hi] = 0

    # ----------------------------------------------------------------- combine
    def combine_send(
        self,
        x: torch.Tensor,
        w: torch.Tensor | None,
        meta: torch.Tensor,
        topk_idx: torch.Tensor,
        psum_su: torch.Tensor,
        E: int,
        M: int,
        expand: bool,
        amr: bool,
        src_trap: tuple[str, str] | None = None,
    ) -> dict[str, Any]:
        """Send each received token's row (or slot rows) back to its source rank: with
        ``allow_multiple_reduction`` a token's slot rows summed in fp32 and rounded to bf16
        first. ``src_trap``: ``(limit id, release)`` of a device trap on a source rank outside the
        group (V2.5). Returns the rows received per source token, with the rank each came from."""
        R, k = self.num_ranks, topk_idx.shape[1]
        e = E // R
        n = meta.shape[0]
        if n == M * R:  # no CPU sync: the real count from the prefix sum (I/combine.cuh:46-47)
            n = int(psum_su[-1])
        m = meta[:n].to(torch.int64)
        src_r, src_t = m[:, 0] // M, m[:, 0] % M
        if src_trap is not None:
            bad = (src_r < 0) | (src_r >= R)
            limits.device_trap(
                not bool(bad.any()),
                src_trap[0],
                src_trap[1],
                f"{int(bad.sum())} row(s) name no source rank of the group",
            )
        wk = None
        if not expand:
            vals = x[:n].float()
            wk = None if w is None else w[:n]
            rank_of, tok_of = src_r, src_t
        else:
            dst = m[:, 2:]
            ok = dst >= 0
            safe = dst.clamp(min=0)
            if amr:
                # NOTE: a single slot's row is bf16 already: its rounding changes nothing
                vals = (x[safe].float() * ok.unsqueeze(-1)).sum(1)
                vals = vals.to(torch.bfloat16).float()
                rank_of, tok_of = src_r, src_t
                if w is not None:
                    wk = torch.where(ok, w[safe], 0.0)
            else:
                vals = x[dst[ok]].float()
                rows = torch.arange(n).view(n, 1).expand(n, k)[ok]
                rank_of, tok_of = src_r[rows], src_t[rows]
        order = torch.argsort(rank_of, stable=True)
        send_counts = torch.bincount(rank_of, minlength=R).tolist()
        fields = [tok_of[order].to(torch.int32).view(-1, 1), vals[order].to(torch.float32)]
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = [
            (torch.int32, (1,)),
            (torch.float32, (x.shape[1],)),
        ]
        if wk is not None:
            fields.append(wk[order])
            specs.append((torch.float32, (k,)))
        dest = torch.where(topk_idx >= 0, topk_idx // e, -1)
        if expand and not amr:
            recv_counts = [int((dest == r).sum()) for r in range(R)]
        else:
            recv_counts = [int((dest == r).any(1).sum()) for r in range(R)]
        recv = transport.exchange_known(
            transport.pack(fields), send_counts, recv_counts, self.group
        )
        got = transport.unpack(recv, specs)
        from_rank = torch.repeat_interleave(torch.arange(R), torch.tensor(recv_counts))
        return {
            "tok": got[0].view(-1).to(torch.int64),
            "vals": got[1],
            "from": from_rank,
            "w": got[2] if wk is not None else None,
            "dest": dest,
        }

    @staticmethod
    def combine_weights(got: dict[str, Any], T: int, k: int) -> torch.Tensor:
        """``combined_topk_weights [T, k]``: slot ``j``'s weight as the rank owning it sent it."""
        out = torch.zeros(T, k, dtype=torch.float32)
        ri, ci = (got["dest"][got["tok"]] == got["from"].view(-1, 1)).nonzero(as_tuple=True)
        out[got["tok"][ri], ci] = got["w"][ri, ci]
        return out
