"""Dispatch backends: the registry and the selection rule.

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · E experts in total.

``select_backend`` turns ``DispatchConfig.backend`` into a backend object and a reason. Every rank
must reach the same decision, so a choice that depends on local facts (can ``deep_ep`` be imported
here?) is agreed with one small MIN all-reduce over a "can use" flag.

``auto`` picks ``deepep`` only when ``deep_ep`` imports, the group is NCCL on CUDA, DeepEP supports
the topology (and the worst-case request: intranode only) and, in low-latency mode with a known
``hidden_size``, the hidden size — on every rank; otherwise ``torch``, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch.distributed as dist

from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.deepep_support import deepep_support, load_deep_ep
from flexdispatch.config import DispatchConfig
from flexdispatch.distributed import all_reduce_min_flag
from flexdispatch.types import DispatchStats

__all__ = [
    "Capability",
    "DispatchBackend",
    "BACKENDS",
    "deepep_available",
    "make_torch_backend",
    "make_deepep_backend",
    "make_deepep_elastic_backend",
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


def make_deepep_backend(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
    _deep_ep: ModuleType | None = None,
) -> DispatchBackend:
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


def make_deepep_elastic_backend(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
    _deep_ep: ModuleType | None = None,
) -> DispatchBackend:
    """Build the ``deepep`` backend's V2 path (``deep_ep.ElasticBuffer``) from a config.

    Raises:
        ValueError: DeepEP V2 cannot serve this group (with the reason).
    """
    from flexdispatch.backends.deepep_elastic import DeepEPElasticBackend

    return DeepEPElasticBackend(
        group,
        num_experts=num_experts,
        ranks_per_node=ranks_per_node,
        num_worst_tokens=config.num_worst_tokens,
        hierarchical=config.hierarchical,
        checks=config.checks or None,
        stats=stats,
        num_sms=config.deepep_num_sms,
        num_max_tokens_per_rank=config.num_max_dispatch_tokens_per_rank,
        _deep_ep=_deep_ep,
    )


def _elastic_support(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    deep_ep: ModuleType | None,
) -> Capability:
    """Whether the V2 path can serve this group here (local answer): DeepEP's topology rules
    (worst-case mode allowed across nodes), normal mode, and ``deep_ep.ElasticBuffer``."""
    from flexdispatch.backends.deepep_elastic import elastic_available

    if config.mode != "normal":
        return False, "deepep_api='elastic' runs mode='normal' only (low-latency: use 'legacy')"
    ok, why = deepep_support(
        group=group,
        num_experts=num_experts,
        ranks_per_node=ranks_per_node,
        num_worst_tokens=0,
        mode=config.mode,
        hidden_size=config.hidden_size,
        deep_ep=deep_ep,
    )
    if not ok:
        return False, why
    module = deep_ep if deep_ep is not None else load_deep_ep()[0]
    has, reason = elastic_available(module)
    if not has:
        return False, reason
    return True, f"{why}; {reason}"


def _api_note(config: DispatchConfig) -> str:
    if config.deepep_api == "legacy":
        return "DeepEP API: legacy deep_ep.Buffer (deepep_api='legacy')"
    return (
        "DeepEP API: legacy deep_ep.Buffer (deepep_api='auto': the V2 ElasticBuffer path is "
        "opt-in for now, set deepep_api='elastic')"
    )


BACKENDS: dict[str, BackendFactory] = {"torch": make_torch_backend, "deepep": make_deepep_backend}
"""Registered backend factories by name."""


def deepep_available() -> Capability:
    """Whether ``deep_ep`` imports here, as ``(ok, reason)``; never raises."""
    module, why = load_deep_ep()
    return module is not None, why


def select_backend(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
    deep_ep: ModuleType | None = None,
) -> tuple[DispatchBackend, str]:
    """Pick and build the backend named by ``config.backend``.

    Args:
        config: the dispatch config (``backend`` is ``"auto"``, ``"torch"`` or ``"deepep"``).
        group: the process group (None = WORLD, or a world of one).
        num_experts: E.
        ranks_per_node: L (already resolved).
        stats: counters the backend adds to.
        deep_ep: a ``deep_ep`` module to use instead of importing one (private test hook: the
            emulator in ``tests/deepep_emu``).

    Returns:
        ``(backend, reason)``; the reason says why this backend was chosen.

    Raises:
        ValueError: ``backend="deepep"`` cannot be honoured (the message says why).
    """
    kwargs = {"num_experts": num_experts, "ranks_per_node": ranks_per_node, "stats": stats}
    if config.backend == "torch":
        return make_torch_backend(config, group, **kwargs), "backend='torch' requested"
    if config.deepep_api == "elastic":
        return _select_elastic(config, group, deep_ep=deep_ep, **kwargs)
    ok, why = deepep_support(
        group=group,
        num_experts=num_experts,
        ranks_per_node=ranks_per_node,
        num_worst_tokens=config.num_worst_tokens,
        mode=config.mode,
        hidden_size=config.hidden_size,
        num_max_dispatch_tokens_per_rank=config.num_max_dispatch_tokens_per_rank,
        deep_ep=deep_ep,
    )
    if config.backend == "deepep":
        if not ok:
            raise ValueError(f"deepep backend not available: {why}; use backend='torch' or 'auto'")
        backend = make_deepep_backend(config, group, **kwargs, _deep_ep=deep_ep)
        return backend, f"backend='deepep' requested ({why}); {_api_note(config)}"
    # NOTE: usability is a local fact (imports, devices); every rank must choose alike.
    if all_reduce_min_flag(ok, group):
        backend = make_deepep_backend(config, group, **kwargs, _deep_ep=deep_ep)
        return backend, f"auto: deepep on every rank ({why}); {_api_note(config)}"
    if ok:
        why = "deep_ep is usable here but not on every rank"
    return make_torch_backend(config, group, **kwargs), f"auto: torch fallback ({why})"


def _select_elastic(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    stats: DispatchStats,
    deep_ep: ModuleType | None,
) -> tuple[DispatchBackend, str]:
    """``select_backend`` with ``deepep_api='elastic'``: the V2 path, or (auto) torch."""
    kwargs = {"num_experts": num_experts, "ranks_per_node": ranks_per_node, "stats": stats}
    ok, why = _elastic_support(
        config, group, num_experts=num_experts, ranks_per_node=ranks_per_node, deep_ep=deep_ep
    )
    api = "DeepEP API: elastic deep_ep.ElasticBuffer (deepep_api='elastic' requested)"
    if config.backend == "deepep":
        if not ok:
            raise ValueError(
                f"deepep backend with deepep_api='elastic' not available: {why}; use "
                "deepep_api='legacy', backend='torch' or 'auto'"
            )
        backend = make_deepep_elastic_backend(config, group, **kwargs, _deep_ep=deep_ep)
        return backend, f"backend='deepep' requested ({why}); {api}"
    if all_reduce_min_flag(ok, group):
        backend = make_deepep_elastic_backend(config, group, **kwargs, _deep_ep=deep_ep)
        return backend, f"auto: deepep on every rank ({why}); {api}"
    if ok:
        why = "deep_ep.ElasticBuffer is usable here but not on every rank"
    reason = f"auto: torch fallback (deepep_api='elastic': {why})"
    return make_torch_backend(config, group, **kwargs), reason
