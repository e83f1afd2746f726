"""Starting ranks and keeping them alive together.

- ``spawn``: ``spawn_group``, a simulated expert-parallel group on one machine (gloo on
  127.0.0.1), used by ``flexdispatch demo`` / ``bench`` and the multi-process tests;
- ``lifetime``: a rank ends with its parent or its launcher's agent (a reaper for spawned ranks),
  never hangs on a stopped peer, and acts on no other process unless it provably is a torchrun
  worker whose collective failed;
- ``wire``: objects between the ranks and the parent as plain bytes, never an unrestricted pickle;
- ``devices``: which device each local rank gets (``python -m flexdispatch.launch.devices``);
- ``store``: the single-node torchrun recipe's rendezvous store, on 127.0.0.1 only
  (``python -m flexdispatch.launch.store``).

The public names below are resolved lazily, so that importing ``lifetime`` or ``devices`` (the
command line does, before anything else) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "GroupError": "spawn",
    "RANK_RUNTIME_BYTES": "spawn",
    "free_port": "spawn",
    "loopback_interface": "spawn",
    "spawn_group": "spawn",
    "threads_per_rank": "spawn",
    "under_launcher": "spawn",
    "MAX_TIMEOUT_S": "lifetime",
    "die_with_parent": "lifetime",
    "end_stopped_local_peers": "lifetime",
    "broadcast_object": "wire",
    "gather_objects": "wire",
}
"""Each public name -> the submodule it lives in."""

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flexdispatch.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flexdispatch.launch.{home}"), name)
    globals()[name] = value
    return value
