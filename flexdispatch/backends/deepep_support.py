"""Whether the ``deepep`` backend can run here, and its factory (light: no DeepEP import).

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · E experts · W worst-case rows ·
H hidden.

``deep_ep`` is imported lazily and every way that import is known to fail (``ImportError``,
``OSError`` for a missing ``libnvshmem``/CUDA library, ``AssertionError`` and ``RuntimeError`` from
its CUDA/NCCL checks) becomes a reason string, so a job that never uses DeepEP never dies of it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexdispatch.backends import deepep_sizing as sizing
from flexdispatch.backends.base import Capability
from flexdispatch.distributed import group_size, is_distributed
from flexdispatch.types import DispatchStats

if TYPE_CHECKING:
    from flexdispatch.backends.deepep import DeepEPBackend

__all__ = [
    "load_deep_ep",
    "is_emulator",
    "nvl_peers",
    "group_is_nccl_on_cuda",
    "deepep_support",
    "make_deepep_backend",
]


def load_deep_ep() -> tuple[ModuleType | None, str]:
    """Import ``deep_ep`` if it can be; never raises.

    Returns:
        ``(module, reason)``, or ``(None, reason)`` with the import error.
    """
    try:
        module = importlib.import_module("deep_ep")
    except (ImportError, OSError, AssertionError, RuntimeError) as exc:
        return None, f"import deep_ep failed: {type(exc).__name__}: {exc}"
    if not hasattr(module, "Buffer"):
        return None, "the importable deep_ep has no Buffer (not DeepEP's V1 API)"
    return module, "deep_ep imports"


def is_emulator(module: ModuleType) -> bool:
    """True for the test emulator (``tests/deepep_emu``), which runs on CPU/gloo groups."""
    return getattr(module, "IS_EMULATOR", False) is True


def nvl_peers(module: ModuleType) -> int:
    """DeepEP's NVLink domain size: 8, or what the test emulator was told to fake."""
    if is_emulator(module) and callable(getattr(module, "num_max_nvl_peers", None)):
        return int(module.num_max_nvl_peers())
    return sizing.NUM_MAX_NVL_PEERS


def group_is_nccl_on_cuda(group: dist.ProcessGroup | None) -> Capability:
    """Whether ``group`` is an NCCL group on a machine with CUDA (what DeepEP needs)."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not is_distributed(group):
        return False, "torch.distributed is not initialised (DeepEP needs a process group)"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return False, f"the process group uses {backend!r}, DeepEP needs NCCL on CUDA"
    return True, "NCCL group on CUDA"


def deepep_support(
    *,
    group: dist.ProcessGroup | None,
    num_experts: int,
    ranks_per_node: int,
    num_worst_tokens: int = 0,
    mode: str = "normal",
    hidden_size: int | None = None,
    deep_ep: ModuleType | None = None,
) -> Capability:
    """Whether the ``deepep`` backend can serve this group here (a local answer; no collective).

    Checks, in order: ``deep_ep`` imports; the group is NCCL on CUDA (waived for the test
    emulator); DeepEP supports the topology and the worst-case request; low-latency mode accepts
    the hidden size (when known).
    """
    if deep_ep is None:
        deep_ep, why = load_deep_ep()
        if deep_ep is None:
            return False, why
    if not is_emulator(deep_ep):
        ok, why = group_is_nccl_on_cuda(group)
        if not ok:
            return False, why
    R = group_size(group)
    if num_experts % max(R, 1):
        return False, f"num_experts={num_experts} is not divisible by R={R}"
    ok, why = sizing.check_topology(
        R, ranks_per_node, num_worst_tokens=num_worst_tokens, nvl_peers=nvl_peers(deep_ep)
    )
    if not ok:
        return False, why
    lists = sizing.LOW_LATENCY_HIDDEN_SIZES
    if mode == "low_latency" and hidden_size is not None and hidden_size not in lists:
        sizes = ", ".join(map(str, lists))
        return False, f"low-latency kernels support H in {sizes}, not {hidden_size}"
    return True, f"deep_ep usable ({why})"


def make_deepep_backend(
    config: Any,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
    _deep_ep: ModuleType | None = None,
) -> DeepEPBackend:
    """Build the ``deepep`` backend from a ``DispatchConfig``.

    Args:
        config: the ``DispatchConfig``.
        group: the process group (None = WORLD).
        num_experts: E.
        ranks_per_node: L (resolved).
        stats: counters the backend adds to.
        _deep_ep: a ``deep_ep`` module to use instead of importing one (test hook, see
            ``DeepEPBackend``).

    Raises:
        ValueError: DeepEP cannot serve this group (with the reason).
    """
    from flexdispatch.backends.deepep import DeepEPBackend

    return DeepEPBackend(
        group,
        num_experts=num_experts,
        ranks_per_node=ranks_per_node,
        num_worst_tokens=config.num_worst_tokens,
        hierarchical=config.hierarchical,
        checks=config.checks or None,
        stats=stats,
        async_finish=config.deepep_async_finish,
        num_sms=config.deepep_num_sms,
        mode=config.mode,
        num_max_dispatch_tokens_per_rank=config.num_max_dispatch_tokens_per_rank,
        use_fp8=config.use_fp8,
        _deep_ep=_deep_ep,
    )
