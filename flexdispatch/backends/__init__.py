"""Dispatch backends: the registry and the selection rule.

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · E experts in total.

``select_backend`` turns ``DispatchConfig.backend`` into a backend object and a reason. Every rank
must reach the same decision, so a choice that depends on local facts (can ``deep_ep`` be imported
here?) is agreed with one small MIN all-reduce over a "can use" flag.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.config import DispatchConfig
from flexdispatch.distributed import all_reduce_min_flag
from flexdispatch.types import DispatchStats

__all__ = [
    "Capability",
    "DispatchBackend",
    "BACKENDS",
    "deepep_available",
    "make_torch_backend",
    "select_backend",
]

BackendFactory = Callable[..., DispatchBackend]


def make_torch_backend(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
) -> DispatchBackend:
    """Build the ``torch`` (``all_to_all_single``) backend from a config."""
    from flexdispatch.backends.torch_a2a import TorchA2ABackend

    return TorchA2ABackend(
        group,
        num_experts=num_experts,
        ranks_per_node=ranks_per_node,
        num_worst_tokens=config.num_worst_tokens,
        hierarchical=config.hierarchical,
        checks=config.checks or None,
        stats=stats,
    )


BACKENDS: dict[str, BackendFactory] = {"torch": make_torch_backend}
"""Registered backend factories by name (``deepep`` joins when its backend lands)."""


def deepep_available() -> Capability:
    """Whether ``deep_ep`` imports here, as ``(ok, reason)``; never raises."""
    try:
        import deep_ep  # noqa: F401
    except (ImportError, OSError, AssertionError) as exc:
        return False, f"import deep_ep failed: {type(exc).__name__}: {exc}"
    if "deepep" not in BACKENDS:
        return False, "deep_ep imports, but this flexdispatch version has no deepep backend yet"
    return True, "deep_ep imports"


def select_backend(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
) -> tuple[DispatchBackend, str]:
    """Pick and build the backend named by ``config.backend``.

    Args:
        config: the dispatch config (``backend`` is ``"auto"``, ``"torch"`` or ``"deepep"``).
        group: the process group (None = WORLD, or a world of one).
        num_experts: E.
        ranks_per_node: L (already resolved).
        stats: counters the backend adds to.

    Returns:
        ``(backend, reason)``; the reason says why this backend was chosen.

    Raises:
        ValueError: ``backend="deepep"`` cannot be honoured (the message says why).
    """
    kwargs = {"num_experts": num_experts, "ranks_per_node": ranks_per_node, "stats": stats}
    if config.backend == "torch":
        return make_torch_backend(config, group, **kwargs), "backend='torch' requested"
    if config.backend == "deepep":
        ok, why = deepep_available()
        if not ok:
            raise ValueError(f"deepep backend not available: {why}; use backend='torch' or 'auto'")
        return BACKENDS["deepep"](config, group, **kwargs), "backend='deepep' requested"
    ok, why = deepep_available()
    # NOTE: importability is a local fact; every rank must choose alike.
    if all_reduce_min_flag(ok, group):
        return BACKENDS["deepep"](config, group, **kwargs), "auto: deep_ep usable on every rank"
    if ok:
        why = "deep_ep is not usable on every rank"
    return make_torch_backend(config, group, **kwargs), f"auto: torch fallback ({why})"
