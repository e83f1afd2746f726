"""A torchtitan expert-parallel token dispatcher that moves tokens through flexdispatch.

Two ways in (torchtitan 0.3.0):

- in a model config: ``RoutedExperts.Config(token_dispatcher=FlexTokenDispatcher.Config(
  num_experts=E, top_k=k, backend="auto"))``;
- for a whole job, torchtitan's override mechanism: ``--override.imports
  flexdispatch.integrations.torchtitan.flexdispatch_override`` replaces every
  ``AllToAllTokenDispatcher.Config`` of the model (the "standard" EP dispatcher) by a
  ``FlexTokenDispatcher.Config`` with the same ``num_experts`` / ``top_k``. Options go as the
  entry's JSON kwargs: ``'flexdispatch.integrations.torchtitan.flexdispatch_override={"backend":
  "torch", "num_worst_tokens": -1}'``.

``FlexTokenDispatcher`` follows torchtitan's dispatcher contract: ``wire_meshes(ep_mesh=...)``
builds the ``FlexDispatcher`` on the EP mesh's group (collectively, from
``RoutedExperts.parallelize``); ``dispatch`` returns the received rows grouped by local expert
(expert-major) with the per-expert counts; ``combine`` weights each row by its routing score,
sums a token's rows in fp32 (``unpermute``), and sends the sums back (``FlexDispatcher.combine``).
The experts stay unweighted, as torchtitan's ``GroupedExperts`` expect. Without an EP mesh it
reorders locally, as torchtitan's own dispatchers do.

``num_worst_tokens``: 0 = dropless (one host sync per dispatch); ``W > 0`` = static shapes, no
host sync in the dispatch; ``-1`` = ``W = EP × num_max_tokens_per_rank``, the worst case for the
job's tokens per rank. ``update_flex_token_dispatcher_config(model_config, job_config)`` fills
``num_max_tokens_per_rank`` (and ``hidden_dim``) the way torchtitan's
``update_ep_token_dispatcher_config`` does for DeepEP (local batch × sequence length / (CP × TP));
where nothing filled it (the override path runs after torchtitan's own update), the first
dispatch's token count is taken (torchtitan pads every rank to the same count).

Importing this module does not import torchtitan. When torchtitan is already imported (as when its
``--override.imports`` imports this module) it registers the override at once; otherwise the
first use of ``FlexTokenDispatcher``, ``flexdispatch_override`` or
``update_flex_token_dispatcher_config`` does.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: at run time these load lazily (__getattr__): they import torchtitan
    from flexdispatch.integrations._torchtitan import (
        FLEXDISPATCH_SAVE_OPS,
        FlexDispatchMetadata,
        FlexTokenDispatcher,
        flexdispatch_override,
    )

__all__ = [
    "FLEXDISPATCH_SAVE_OPS",
    "FlexDispatchMetadata",
    "FlexTokenDispatcher",
    "TORCHTITAN_CHECKED",
    "flexdispatch_override",
    "update_flex_token_dispatcher_config",
]

TORCHTITAN_CHECKED = "0.3.0"
"""The torchtitan release the dispatcher is tested on."""

_LAZY = (
    "FLEXDISPATCH_SAVE_OPS",
    "FlexTokenDispatcher",
    "FlexDispatchMetadata",
    "flexdispatch_override",
)


def _impl() -> Any:
    try:
        importlib.import_module("torchtitan.models.common.token_dispatcher")
    except ImportError as exc:
        raise ImportError(
            f"flexdispatch.integrations.torchtitan needs torchtitan (checked on "
            f"{TORCHTITAN_CHECKED}; pip install --no-deps torchtitan=={TORCHTITAN_CHECKED} "
            f"spmd_types==0.2.3 tyro, plus triton): {exc}"
        ) from exc
    try:
        return importlib.import_module("flexdispatch.integrations._torchtitan")
    except ImportError as exc:
        if "flexdispatch" in str(getattr(exc, "name", "") or ""):
            raise
        installed = getattr(sys.modules.get("torchtitan"), "__version__", "unknown")
        raise ImportError(
            f"flexdispatch.integrations.torchtitan needs torchtitan's {TORCHTITAN_CHECKED} "
            f"interface (config.override, models.common.token_dispatcher); torchtitan "
            f"{installed} is installed: {exc}"
        ) from exc


def update_flex_token_dispatcher_config(model_config: Any, job_config: Any) -> None:
    """Fill ``hidden_dim`` and ``num_max_tokens_per_rank`` of every ``FlexTokenDispatcher.Config``
    in ``model_config`` from the job, as torchtitan's ``update_ep_token_dispatcher_config`` does
    for DeepEP: tokens per rank = ``training.local_batch_size * training.seq_len`` /
    (``context_parallel_degree * tensor_parallel_degree``).

    Raises:
        ValueError: naming the field: ``context_parallel_degree``, ``tensor_parallel_degree``,
            ``local_batch_size`` or ``seq_len`` not an int >= 1, ``seq_len`` not divisible by
            CP × TP, or a configured ``num_max_tokens_per_rank`` below the job's tokens per rank.
    """
    _impl().update_flex_token_dispatcher_config(model_config, job_config)


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # NOTE: these subclass torchtitan's classes: importing them imports it
        return getattr(_impl(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "torchtitan.config.override" in sys.modules:
    # NOTE: torchtitan is running (its --override.imports imports this module): register now
    _impl()
