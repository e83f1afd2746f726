"""Starting ranks and keeping them alive together.

- ``spawn``: ``spawn_group``, a simulated expert-parallel group on one machine (gloo on
  127.0.0.1), used by ``flexdispatch demo`` / ``bench`` and the multi-process tests;
- ``lifetime``: a rank ends with its parent or its launcher's agent, never hangs on a stopped peer;
- ``wire``: objects between the ranks and the parent as plain bytes, never an unrestricted pickle;
- ``devices``: which device each local rank gets (``python -m flexdispatch.launch.devices``).

The names of ``spawn`` are resolved lazily, so that importing ``lifetime`` or ``devices`` (the
command line does, before anything else) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GroupError",
    "MAX_TIMEOUT_S",
    "RANK_RUNTIME_BYTES",
    "broadcast_object",
    "die_with_parent",
    "end_stopped_local_peers",
    "free_port",
    "gather_objects",
    "loopback_interface",
    "spawn_group",
    "threads_per_rank",
    "under_launcher",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'flexdispatch.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module("flexdispatch.launch.spawn"), name)
    globals()[name] = value
    return value
