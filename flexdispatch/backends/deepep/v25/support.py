"""DeepEP V2.5 (``deep_ep_v25.EPBuffer``): the guarded import, the rules, the JIT buckets.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R local
experts · k top-k · L ranks per node (the NVLink domain) · N = R / L nodes · W worst-case rows ·
M = ``num_max_tokens_per_rank``.

DeepEP 2.5 ships as its own package (SGLang's wheel ``sgl-deep-ep-v25``, ``import deep_ep_v25``)
beside ``deep_ep`` (V1 ``Buffer`` and V2 ``ElasticBuffer``); the import is lazy, where its own
import check would pass (``nccl.import_deepep``), and every way it fails becomes a reason string
("not installed" or "installed but refused to import"). Its limits (``docs/deepep.md``, "DeepEP
V2.5"), as ``v25_rules`` applies them before any collective:

- one logical domain of R ranks (direct mode) or N nodes of L NVLink peers (hybrid mode:
  rows cross the node boundary once per destination node and are forwarded over NVLink, like V1's
  internode kernels), R a multiple of the NVLink domain, R <= 1024;
- E divisible by R, E <= 2048, e <= 512 (its workspace layout);
- hybrid mode: N <= 32, L <= 64 and L + e <= 128 (its notify warps), else direct mode;
- direct mode: R <= the threads of its dispatch kernel, forward and cached (the backward), which
  shrink as the token rows widen (``direct_threads``; include/deep_ep/impls/ep/dispatch.cuh:402);
- k <= 32; rows of 32-byte multiples; combine rows of 256-column multiples (padded by the
  adapter).

JIT: DeepEP 2.5 compiles each kernel at its first use, and ``num_max_tokens_per_rank`` is a
template argument. ``token_bucket`` rounds it up to a power of two (at least 16), so every
worst-case ``W`` and every dropless bound in one bucket shares one set of kernels.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from flexdispatch.backends.base import Capability

__all__ = [
    "EP_DEVICE_SMEM",
    "EP_MAX_EXPERTS",
    "EP_MAX_LOCAL_EXPERTS",
    "EP_MAX_RANKS",
    "MIN_TOKEN_BUCKET",
    "v25_available",
    "direct_thread_rule",
    "direct_threads",
    "hybrid_row_rule",
    "v25_rules",
    "load_deep_ep_v25",
    "split_hook",
    "token_bucket",
    "tokens_message",
]

EP_MAX_RANKS = 1024  # kNumMaxRanks (include/deep_ep/common/compiled.cuh:74)
EP_MAX_EXPERTS = 2048  # EPSignals::kNumMaxExperts (layout/ep/workspace.cuh:10)
EP_MAX_LOCAL_EXPERTS = 512  # EPSignals::kNumMaxExpertsPerRank (layout/ep/workspace.cuh:11)
EP_HYBRID_MAX_NODES = 32  # hybrid_dispatch.cuh:336
EP_HYBRID_MAX_PEERS = 64  # hybrid_combine.cuh:179
EP_HYBRID_NOTIFY = 128  # 4 notify warps: L + e <= 128 (hybrid_dispatch.cuh:261)
MIN_TOKEN_BUCKET = 16
EP_DEVICE_SMEM = 232448  # opt-in shared memory per block of an H100 / H200 (227 KiB)
_NOTIFY_WARPS = 4  # kNumNotifyWarps (csrc/kernels/ep/dispatch.hpp:20)


def load_deep_ep_v25() -> tuple[ModuleType | None, str]:
    """Import ``deep_ep_v25`` (DeepEP 2.5) if it can be; never raises."""
    from flexdispatch.backends.deepep.nccl import import_deepep

    module, why = import_deepep("deep_ep_v25")
    return module, why


def v25_available(
    module: ModuleType | None, why: str = "deep_ep_v25 does not import"
) -> Capability:
    """Whether ``module`` offers DeepEP 2.5's ``EPBuffer``."""
    if module is None:
        return False, why
    if getattr(module, "EPBuffer", None) is None:
        version = getattr(module, "__version__", "?")
        return False, (
            f"the module given as DeepEP 2.5 ({version}) has no EPBuffer: install "
            "sgl-deep-ep-v25 (pip install --no-deps sgl-deep-ep-v25)"
        )
    return True, f"deep_ep_v25.EPBuffer exists (DeepEP {getattr(module, '__version__', '?')})"


def split_hook(hook: Any) -> tuple[ModuleType | None, ModuleType | None, bool]:
    """The test hook ``_deep_ep`` as ``(deep_ep module, deep_ep_v25 module, hooked)``.

    A module with ``EPBuffer`` and no ``Buffer`` is DeepEP 2.5; a dict may give both
    (``{"deep_ep": ..., "deep_ep_v25": ...}``); any other module is ``deep_ep``. ``hooked`` says a
    hook was given (then nothing real is imported for the missing one).
    """
    if hook is None:
        return None, None, False
    if isinstance(hook, dict):
        return hook.get("deep_ep"), hook.get("deep_ep_v25"), True
    if getattr(hook, "EPBuffer", None) is not None and getattr(hook, "Buffer", None) is None:
        return None, hook, True
    return hook, None, True


def token_bucket(n: int) -> int:
    """``num_max_tokens_per_rank`` as compiled: ``n`` rounded up to a power of two, >= 16.

    DeepEP 2.5 compiles a kernel per value (a template argument); a handful of buckets serve
    every batch size (1..16, 17..32, 33..64, ...) at most twice the memory of the exact value.
    """
    if n <= 0:
        raise ValueError(f"num_max_tokens_per_rank must be positive, got {n}")
    return max(MIN_TOKEN_BUCKET, 1 << (n - 1).bit_length())


def _a(n: int, b: int) -> int:
    return -(-n // b) * b


def direct_threads(
    num_ranks: int, num_experts: int, row_bytes: int, scale_packs: int, topk: int, smem: int
) -> tuple[int, int]:
    """Threads of DeepEP 2.5's direct-mode dispatch kernel, ``(forward, cached)``: as many
    dispatch warps as token rows fit in shared memory (beside the notify counters, forward), at
    most 32 warps in all (csrc/kernels/ep/dispatch.hpp:64-79); a token row is its
    ``TokenLayout`` with an mbarrier (layout/ep/token.cuh:17-41)."""
    meta = 8 * topk + 4 * (1 + topk)
    tok = _a(_a(row_bytes, 32) + _a(4 * scale_packs, 32) + _a(meta, 32), 64) + 32
    notify = _a(num_ranks + num_experts, _NOTIFY_WARPS * 32) * 4
    forward = (_NOTIFY_WARPS + min((smem - notify) // tok, 32 - _NOTIFY_WARPS)) * 32
    cached = min(smem // tok, 32) * 32
    return forward, cached


def direct_thread_rule(
    num_ranks: int,
    num_experts: int,
    *,
    row_bytes: int,
    scale_packs: int,
    topk: int,
    backward_row_bytes: int,
    smem: int = EP_DEVICE_SMEM,
) -> str | None:
    """Why DeepEP 2.5's direct mode cannot dispatch these rows on R ranks (its kernel needs a
    thread per rank: ``kNumThreads >= kNumRanks``, include/deep_ep/impls/ep/dispatch.cuh:402,
    and at least one dispatch warp: with none, rows too wide for shared memory, no token is ever
    sent, dispatch.cuh:278), checking the forward kernel and the cached one of the backward
    (``backward_row_bytes`` rows); None when it can."""
    R, E = num_ranks, num_experts
    forward, _ = direct_threads(R, E, row_bytes, scale_packs, topk, smem)
    _, cached = direct_threads(R, E, backward_row_bytes, 0, topk, smem)
    for threads, wide, kernel in (
        (forward - 32 * _NOTIFY_WARPS, row_bytes, "dispatch"),
        (cached, backward_row_bytes, "cached dispatch (the backward)"),
    ):
        if threads <= 0:
            return (
                f"DeepEP 2.5's direct-mode {kernel} kernel fits no {wide}-byte row in {smem} "
                f"bytes of shared memory (it would have no dispatch warp, dispatch.cuh:278): "
                f"dispatch narrower rows (split the hidden size) or use hybrid mode"
            )
    if min(forward, cached) >= R:
        return None
    return (
        f"DeepEP 2.5's direct-mode dispatch kernel needs a thread per rank (dispatch.cuh:402), "
        f"but {row_bytes}-byte rows with k={topk} give it {forward} threads and its cached "
        f"dispatch (the backward, {backward_row_bytes}-byte rows) {cached}, fewer than R={R}: "
        f"use hybrid mode (deepep_hybrid=None / True), narrower rows, or fewer ranks"
    )


def hybrid_row_rule(
    num_ranks: int,
    num_experts: int,
    *,
    row_bytes: int,
    scale_packs: int,
    topk: int,
    dispatch_cols: int,
    combine_cols: int,
    smem: int = EP_DEVICE_SMEM,
) -> str | None:
    """Why DeepEP 2.5's hybrid mode cannot move these rows (None when it can).

    Its dispatch picks channels per SM from shared memory: as many dispatch rows (beside the
    notify counters, at most 28) and combine rows of the dispatch's ``dispatch_cols`` as fit,
    halved, at most 8 (csrc/buffers/ep.hpp:437-456) — 0 for rows too wide for two, and the
    combine asserts that its 2 x channels-per-SM warps of *its* rows (``combine_cols``) fit
    (csrc/kernels/ep/combine.hpp:56).
    """
    meta = 8 * topk + 4 * (1 + topk)
    dtok = _a(_a(row_bytes, 32) + _a(4 * scale_packs, 32) + _a(meta, 32), 64) + 32

    def ctok(cols: int) -> int:
        return _a(_a(2 * cols, 32) + _a(8 * topk, 32), 64) + 32

    notify = _a(num_ranks + num_experts, _NOTIFY_WARPS * 32) * 4
    per_sm = min((smem - notify) // dtok, 32 - _NOTIFY_WARPS, smem // ctok(dispatch_cols))
    per_sm = min(per_sm // 2, 8)
    if per_sm <= 0:
        return (
            f"DeepEP 2.5's hybrid dispatch fits fewer than two {row_bytes}-byte rows per SM "
            f"({smem} bytes of shared memory), so it would run 0 channels: use direct mode "
            f"(deepep_hybrid=False) or narrower rows"
        )
    if 2 * per_sm * ctok(combine_cols) > smem:
        return (
            f"DeepEP 2.5's hybrid combine of {combine_cols}-column rows needs "
            f"{2 * per_sm} x {ctok(combine_cols)} bytes of shared memory (combine.hpp:56), more "
            f"than {smem}: the dispatch's {dispatch_cols} columns chose {per_sm} channels per SM; "
            f"dispatch a hidden size that is a multiple of 256 columns"
        )
    return None


def v25_rules(
    num_ranks: int,
    nvl_peers: int,
    num_experts: int,
    *,
    hybrid: bool | None = None,
    num_worst_tokens: int = 0,
    hidden: int | None = None,
) -> tuple[bool, str, bool]:
    """DeepEP 2.5's topology and size rules, before any collective.

    Args:
        num_ranks: R.
        nvl_peers: the NVLink domain (L: ranks per node as launched; the emulator's domain).
        num_experts: E.
        hybrid: ``DispatchConfig.deepep_hybrid``: True hybrid mode across nodes, False direct
            mode, None hybrid where its limits hold.
        num_worst_tokens: W (must be a multiple of R: M = W / R).
        hidden: H (bf16 columns) when known: direct mode's thread rule for bf16 rows, with the
            smallest top-k (the dispatch checks its own rows and k before the first kernel).

    Returns:
        ``(ok, reason, hybrid)``: whether DeepEP 2.5 can serve it, why, and the mode it runs.
    """
    R, E = num_ranks, num_experts
    L = min(nvl_peers, R)
    if R > EP_MAX_RANKS:
        return False, f"R={R} exceeds DeepEP 2.5's {EP_MAX_RANKS} ranks", False
    if R % L:
        return False, f"R={R} is not a multiple of the NVLink domain L={L}", False
    if E % R:
        return False, f"num_experts={E} is not divisible by R={R}", False
    if E > EP_MAX_EXPERTS:
        return False, f"num_experts={E} exceeds DeepEP 2.5's {EP_MAX_EXPERTS} experts", False
    e = E // R
    if e > EP_MAX_LOCAL_EXPERTS:
        return False, f"{e} local experts exceed DeepEP 2.5's {EP_MAX_LOCAL_EXPERTS}", False
    if num_worst_tokens % R:
        W = num_worst_tokens
        return False, f"num_worst_tokens={W} is not a multiple of R={R} (M = W / R)", False
    N = R // L
    threads = None
    if hidden is not None and hidden > 0:
        row = 2 * _a(hidden, 16)
        threads = direct_thread_rule(
            R, E, row_bytes=row, scale_packs=0, topk=1, backward_row_bytes=row
        )
    if N == 1:
        if threads:
            return False, threads, False
        return True, f"DeepEP 2.5 over one NVLink domain of {R} rank(s)", False
    why_not = None
    if N > EP_HYBRID_MAX_NODES:
        why_not = f"N={N} nodes exceed hybrid mode's {EP_HYBRID_MAX_NODES}"
    elif L > EP_HYBRID_MAX_PEERS:
        why_not = f"L={L} NVLink peers exceed hybrid mode's {EP_HYBRID_MAX_PEERS}"
    elif L + e > EP_HYBRID_NOTIFY:
        why_not = f"L + e = {L} + {e} exceeds hybrid mode's {EP_HYBRID_NOTIFY} notify threads"
    if hybrid is True and why_not:
        return False, f"deepep_hybrid=True cannot run: {why_not} (set deepep_hybrid=False)", False
    if hybrid is False or why_not:
        if threads:
            return False, threads, False
        extra = "deepep_hybrid=False" if hybrid is False else why_not
        return True, f"DeepEP 2.5 direct mode over {N} nodes of {L} ({extra})", False
    return (
        True,
        (
            f"DeepEP 2.5 hybrid mode over {N} nodes of {L} (one RDMA row per destination node, "
            f"forwarded over NVLink)"
        ),
        True,
    )


def tokens_message(rank: int | str, T: int, *, M: int, R: int, W: int) -> str:
    """Why rank ``rank`` may not dispatch ``T`` tokens: over ``W / R`` (worst-case, ``W`` > 0)
    or over the dropless bound ``M``."""
    if W:
        return (
            f"rank {rank} dispatches {T} tokens but num_worst_tokens W={W} allows W/R = "
            f"{W}/{R} = {M} per rank on DeepEP 2.5 (each rank owns W / R receive slots on "
            f"every rank): raise DispatchConfig.num_worst_tokens to at least {T * R}"
        )
    return (
        f"rank {rank} dispatches {T} tokens but DeepEP 2.5's dropless dispatch takes at most "
        f"num_max_dispatch_tokens_per_rank = {M} per rank: raise "
        f"DispatchConfig.num_max_dispatch_tokens_per_rank to at least {T} (on every rank)"
    )
