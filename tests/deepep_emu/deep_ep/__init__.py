"""Emulated ``deep_ep`` (DeepEP V1 API, release v1.2.1) for CPU/gloo tests. TEST-ONLY.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R local
experts · k top-k · M received rows · W worst-case rows.

The same Python surface as ``deep_ep``: ``Buffer`` (normal, cached and worst-case dispatch,
combine, low-latency dispatch/combine), ``Config`` with the buffer-size hints, ``EventOverlap``,
``topk_idx_t``. Every transfer is one ``all_to_all_single`` of packed bytes, so it runs on gloo.

Quirks an adapter must survive, reproduced here:

- ``AssertionError`` where DeepEP's Python wrapper asserts (cached dispatch with top-k args,
  worst-case mode across nodes, odd ``set_num_sms``, unknown R in ``get_*_config``,
  ``destroy`` without ``explicitly_destroy``), ``RuntimeError`` where its C++ ``EP_HOST_ASSERT``
  fires (byte counts not multiples of 128, rank counts, dtypes, ``H * elem_size % 16``, top-k
  dtype and ``k <= 32``, buffers smaller than a call needs, combine of non-bf16 rows).
- ``x`` must be bf16 or an ``(fp8 [T, H], fp32 scales [T, H / 128])`` tuple; combine takes bf16.
- Worst-case mode (``num_worst_tokens = W``): W rows out; the tails of ``recv_x`` and
  ``recv_topk_weights`` hold garbage (NaN and huge values), only ``recv_topk_idx``'s tail is
  ``-1``; ``num_recv_tokens_per_expert_list`` is empty. Receiving more than W rows raises (real
  DeepEP would write out of bounds).
- Received top-k ids are local, ``-1`` elsewhere, weights 0 there; per-expert counts come from
  the exchanged ``num_tokens_per_expert`` (aligned to ``expert_alignment``), as in DeepEP.
- The handle is a tuple (its contents are the emulator's own).
- Low-latency: expert-major ``[e, R * max, H]`` output with a garbage tail, ``recv_count``,
  fp8 with column-major scales, ``return_recv_hook`` (data lands only when the hook runs, and is
  garbage if two more low-latency kernels ran in between: DeepEP's two-buffer rule), the
  weighted combine, and a buffer that must be cleaned after normal kernels ran on it.

Not emulated: CUDA streams and events (``EventOverlap`` wraps a no-op CPU event), the CPU
busy-wait for receive counts (this module reads counts on the host freely; it is not the code
under test), NVSHMEM environment set-up, ``use_ue8m0``, LogFMT and zero-copy combine, the
non-deterministic arrival order of low-latency rows (here: source rank, then token), and
MNNVL/fabric memory.
"""

from __future__ import annotations

import torch

from . import _config
from ._config import Config, get_low_latency_rdma_size_hint
from .buffer import Buffer
from .utils import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "get_low_latency_rdma_size_hint",
    "topk_idx_t",
    "IS_EMULATOR",
    "num_max_nvl_peers",
    "set_num_max_nvl_peers",
]

topk_idx_t = torch.int64
"""dtype of ``topk_idx`` the kernels read."""
IS_EMULATOR = True
"""Marks this module as the emulator (the real ``deep_ep`` has no such attribute)."""


def num_max_nvl_peers() -> int:
    """Ranks of one emulated NVLink domain (8 unless a test lowered it)."""
    return _config.NUM_MAX_NVL_PEERS


def set_num_max_nvl_peers(peers: int) -> None:
    """Fake smaller nodes in this process (e.g. 2, so that 4 ranks are 2 "nodes")."""
    if peers <= 0:
        raise ValueError(f"peers must be positive, got {peers}")
    _config.NUM_MAX_NVL_PEERS = peers
