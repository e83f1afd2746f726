"""flexdispatch: MoE expert-parallel token dispatch over DeepEP or torch.distributed.

Public names are resolved lazily so that ``import flexdispatch`` (and the CLI) stays cheap and an
optional dependency that fails to import never breaks the names that do not need it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # configs
    "RouterConfig": "flexdispatch.config",
    "DispatchConfig": "flexdispatch.config",
    "MoEConfig": "flexdispatch.config",
    "load_config": "flexdispatch.config",
    "list_presets": "flexdispatch.config",
    # result types
    "RoutingResult": "flexdispatch.types",
    "DispatchLayout": "flexdispatch.types",
    "Permutation": "flexdispatch.types",
    "DispatchResult": "flexdispatch.types",
    "ExpandedDispatchResult": "flexdispatch.types",
    "DispatchHandle": "flexdispatch.types",
    "DispatchStats": "flexdispatch.types",
    # routing
    "topk_routing": "flexdispatch.routing",
    "hash_routing": "flexdispatch.routing",
    "routing_map_to_topk": "flexdispatch.routing",
    "TopKRouter": "flexdispatch.routing",
    # layout and permutation
    "get_dispatch_layout": "flexdispatch.layout",
    "permute": "flexdispatch.permutation",
    "unpermute": "flexdispatch.permutation",
    # dispatch and the layer
    "FlexDispatcher": "flexdispatch.dispatch.dispatcher",
    "GroupedExperts": "flexdispatch.experts",
    "MoELayer": "flexdispatch.moe",
    "MoEOutput": "flexdispatch.moe",
    # tools
    "plan_cluster": "flexdispatch.planner",
    "spawn_group": "flexdispatch.launch",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flexdispatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
