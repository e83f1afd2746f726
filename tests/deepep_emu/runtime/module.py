"""``make_runtime_module``: the emulated ``deep_ep._C`` of one release and NVLink domain.

TEST-ONLY.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from . import elastic, limits, transport
from .config import EventHandle, low_latency_rdma_size_hint, make_config_class
from .normal import Runtime

__all__ = ["make_runtime_module"]


def make_runtime_module(release: str, nvl_peers: int) -> types.ModuleType:
    """A module with the names DeepEP's Python layer takes from ``deep_ep._C``.

    Args:
        release: the DeepEP release whose limits the kernels enforce (``"1.2.1"``/``"2.1.0"``).
        nvl_peers: ranks of one emulated NVLink domain (DeepEP's ``NUM_MAX_NVL_PEERS``, 8).
    """
    if release not in limits.COMMITS or release == "nccl":
        raise ValueError(f"unknown DeepEP release {release!r}; known: {sorted(limits.COMMITS)}")
    if nvl_peers <= 0:
        raise ValueError(f"nvl_peers must be positive, got {nvl_peers}")
    mod = types.ModuleType("deep_ep._C")
    mod.__doc__ = f"Emulated DeepEP runtime (release {release}, NVLink domain of {nvl_peers})."
    mod.EMULATED_RELEASE = release
    mod.NUM_MAX_NVL_PEERS = nvl_peers
    mod.pending_group = None

    class Buffer(Runtime):
        def __init__(self, *args: Any) -> None:
            super().__init__(mod, *args)

    mod.Buffer = Buffer
    mod.Config = make_config_class(release, nvl_peers)
    mod.EventHandle = EventHandle
    mod.topk_idx_t = torch.int64
    mod.get_low_latency_rdma_size_hint = low_latency_rdma_size_hint
    mod.is_sm90_compiled = lambda: True
    mod.init_jit = lambda *args: None
    if release == "2.1.0":  # DeepEP V2 exists from 2.x on
        elastic.install(mod)
    # emulator-only accounting (not in DeepEP): which collectives are the runtime's own
    mod.emu_in_runtime = transport.in_runtime
    mod.emu_counters = transport.counters
    mod.emu_reset_counters = transport.reset
    return mod
