"""flexdispatch: MoE expert-parallel token dispatch over DeepEP or torch.distributed.

Public names are resolved lazily so that ``import flexdispatch`` (and the CLI) stays cheap and an
optional dependency that fails to import never breaks the names that do not need it.

Module paths that moved in 0.1 (``_MOVED``) still import, for one release, as the module they moved
to (the same object), with a ``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
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
    "PendingDispatch": "flexdispatch.types",
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


_MOVED: dict[str, str] = {
    "flexdispatch.hf": "flexdispatch.integrations.hf",
    "flexdispatch.decode": "flexdispatch.dispatch.decode",
    "flexdispatch.dispatcher": "flexdispatch.dispatch.dispatcher",
    "flexdispatch.ops": "flexdispatch.dispatch.ops",
    "flexdispatch.devices": "flexdispatch.launch.devices",
    "flexdispatch.deepep_limits": "flexdispatch.backends.deepep.limits",
    "flexdispatch.backends.cpu_pool": "flexdispatch._pool",
}
"""Old module path -> where it lives now (README.md, "Renamed")."""


def _moved(old: str) -> ModuleType:
    new = _MOVED[old]
    warnings.warn(
        f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, 3
    )
    return importlib.import_module(new)


class _MovedLoader(importlib.abc.Loader):
    """Loads an old path as the module it moved to (one module object under both names)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _moved(spec.name)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # NOTE: the import system stamped the old path's spec on the module: give it its own back
        module.__spec__ = self._own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of ``_MOVED``; consulted after every real file (last on the path)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(name, _MovedLoader())


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if f"flexdispatch.{name}" in _MOVED:
            return _moved(f"flexdispatch.{name}")
        raise AttributeError(f"module 'flexdispatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
