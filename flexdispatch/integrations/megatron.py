"""Megatron-Core's flex token dispatcher, moving its tokens through flexdispatch.

::

    import flexdispatch.integrations.megatron as fd_megatron
    fd_megatron.install()  # or install(DispatchConfig(backend="torch", num_worst_tokens=...))
    # then build the model with moe_token_dispatcher_type="flex" (backend "deepep", the default)

How it plugs in. ``MoELayer.__init__`` picks its dispatcher by
``config.moe_token_dispatcher_type`` from three classes it names directly; there is no registry.
The ``"flex"`` one, ``MoEFlexTokenDispatcher``, does the TP×EP bookkeeping (one group of
``tp·ep`` ranks, each token's routing map repeated for every expert-TP rank) and hands the
communication to a manager object (``_comm_manager``), the slot Megatron's own DeepEP, HybridEP
and NCCL-EP backends fill. ``install()`` rebinds the name ``MoEFlexTokenDispatcher`` that
``megatron.core.transformer.moe.moe_layer`` looks up to ``FlexdispatchTokenDispatcher``, a
subclass whose only change is the manager it builds: ``FlexdispatchManager``, which routes by the
map (``flexdispatch.routing_map_to_topk``), dispatches and combines through a ``FlexDispatcher``
on the TP×EP group and permutes the received rows by local expert. Nothing in Megatron is edited;
``uninstall()`` puts the name back (layers built meanwhile keep their dispatcher).

Why the backend string stays ``"deepep"``. Megatron keys behaviour on
``moe_flex_dispatcher_backend``: the 1F1B all-to-all overlap schedule writes detached copies of
the probs into ``_comm_manager.token_probs`` / ``.dispatched_probs`` for ``"deepep"``, the
input-freeing policy and the config checks test the same string, and the config accepts only
``"deepep"``, ``"hybridep"`` and ``"ncclep"``. The manager keeps DeepEP's attribute names
(``token_indices``, ``token_probs``, ``dispatched_indices``, ``dispatched_probs``,
``tokens_per_expert``, ``handle``) and the dispatcher keeps DeepEP's ``cudagraph_attrs``, so
every one of those code paths treats it exactly as it treats DeepEP. Which transport runs is
``DispatchConfig.backend``'s business (``"auto"``: DeepEP V1 / V2 / 2.5 where they import and the
group is NCCL on CUDA, else ``torch.distributed`` all-to-all); ``"hybridep"`` and ``"ncclep"``
layers keep Megatron's own managers.

Covered: top-k routing of any score function, capacity dropping (the map decides, dropped pairs
stay dropped), expert tensor parallelism (tp × ep, as Megatron's flex dispatcher), shared experts,
``moe_router_padding_for_quantization`` (each local expert's rows padded to Megatron's quantisation
alignment with zero rows, ``permute(align=...)``), ``moe_router_dtype="fp64"``, and
``DispatchConfig.num_worst_tokens`` (static dispatch shapes, no host sync in the dispatch; the
expert permutation then syncs once, as Megatron's experts need their counts on the host).
Refused at build time, one line naming the option: ``moe_pad_expert_input_to_capacity`` and
``moe_expert_rank_capacity_factor``.

First-step cost: ``MoEFlexTokenDispatcher.dispatch_preprocess`` is ``@jit_fuser``, which is
``torch.compile`` on torch >= 2.2. The first MoE forward compiles it (about 23 s on a CPU; 0.6 to
5 s for each new shape afterwards). ``TORCHDYNAMO_DISABLE=1`` (set before Megatron is imported)
or ``megatron.core.jit.disable_jit_fuser()`` before the model is built skips it.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

from flexdispatch.config import DispatchConfig
from flexdispatch.integrations import _installed

if TYPE_CHECKING:  # NOTE: at run time these load lazily (__getattr__): they import Megatron
    from flexdispatch.integrations._megatron import (
        FlexdispatchManager,
        FlexdispatchTokenDispatcher,
    )

__all__ = [
    "FlexdispatchManager",
    "FlexdispatchTokenDispatcher",
    "MEGATRON_CORE_CHECKED",
    "install",
    "installed_config",
    "uninstall",
]

MEGATRON_CORE_CHECKED = "0.19.2"
"""The megatron-core release the plug-in is tested on (its dispatcher interface is that of tag
``core_v0.19.0``)."""

_LAZY = ("FlexdispatchManager", "FlexdispatchTokenDispatcher")
_STATE = _installed.MEGATRON


def _moe_layer_module() -> ModuleType:
    try:
        return importlib.import_module("megatron.core.transformer.moe.moe_layer")
    except ImportError as exc:
        raise ImportError(
            f"flexdispatch.integrations.megatron needs megatron-core (checked on "
            f"{MEGATRON_CORE_CHECKED}; on Python 3.11: pip install --ignore-requires-python "
            f"--no-deps megatron-core=={MEGATRON_CORE_CHECKED}, plus triton): {exc}"
        ) from exc


def install(dispatch_config: DispatchConfig | None = None) -> None:
    """Make every ``MoELayer`` built from now on with ``moe_token_dispatcher_type="flex"`` and
    ``moe_flex_dispatcher_backend="deepep"`` dispatch through a ``FlexDispatcher``.

    Calling it again replaces the config for layers built afterwards. Each layer builds its own
    ``FlexDispatcher`` on its TP×EP group (collectively: every rank builds its layers together).

    Args:
        dispatch_config: the dispatchers' ``DispatchConfig`` (None: ``DispatchConfig()``, backend
            ``"auto"``). ``moe_flex_dispatcher_num_sms`` from Megatron's config fills
            ``deepep_num_sms`` when the config leaves it unset.

    Warns when the installed megatron-core is not ``MEGATRON_CORE_CHECKED``'s release.

    Raises:
        TypeError: ``dispatch_config`` is not a ``DispatchConfig``.
        ImportError: megatron-core does not import, or its dispatcher interface is not the one
            the plug-in subclasses (naming the installed and the checked release).
    """
    if dispatch_config is None:
        dispatch_config = DispatchConfig()
    if not isinstance(dispatch_config, DispatchConfig):
        raise TypeError(
            f"dispatch_config must be a flexdispatch DispatchConfig or None, got "
            f"{type(dispatch_config).__name__}"
        )
    moe_layer = _moe_layer_module()
    _check_version()
    _megatron = _impl()
    if "original" not in _STATE:
        _STATE["original"] = moe_layer.MoEFlexTokenDispatcher
    _STATE["config"] = dispatch_config
    moe_layer.MoEFlexTokenDispatcher = _megatron.FlexdispatchTokenDispatcher


def uninstall() -> None:
    """Give ``moe_layer.MoEFlexTokenDispatcher`` back to Megatron's own class (a no-op when not
    installed). Layers already built keep their dispatcher. A name that something else rebound
    after ``install`` (another plug-in) is left as it is, with a warning naming it."""
    original = _STATE.pop("original", None)
    _STATE.pop("config", None)
    if original is None:
        return
    moe_layer = _moe_layer_module()
    ours = sys.modules.get("flexdispatch.integrations._megatron")
    current = moe_layer.MoEFlexTokenDispatcher
    if ours is not None and current is not ours.FlexdispatchTokenDispatcher:
        warnings.warn(
            f"flexdispatch.integrations.megatron.uninstall: moe_layer.MoEFlexTokenDispatcher is "
            f"now {getattr(current, '__qualname__', current)!s}, bound after install(): left as "
            f"it is (Megatron's own class was not put back over it)",
            stacklevel=2,
        )
        return
    moe_layer.MoEFlexTokenDispatcher = original


def _version(text: str) -> tuple[int, ...] | None:
    """``"0.19.2"`` -> ``(0, 19)``; None when it does not start with two numbers."""
    parts = str(text).split(".")[:2]
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _installed_version() -> str:
    core = sys.modules.get("megatron.core")
    return str(getattr(core, "__version__", "unknown"))


def _check_version() -> None:
    """Warn when the installed megatron-core is another release than ``MEGATRON_CORE_CHECKED``
    (major.minor): the plug-in subclasses Megatron's dispatcher interface, which moves between
    releases."""
    installed = _installed_version()
    if _version(installed) != _version(MEGATRON_CORE_CHECKED):
        warnings.warn(
            f"flexdispatch's Megatron plug-in is checked on megatron-core {MEGATRON_CORE_CHECKED}; "
            f"megatron-core {installed} is installed: its flex dispatcher interface may differ "
            f"(run scripts/megatron_acceptance against it)",
            stacklevel=3,
        )


def _impl() -> ModuleType:
    """``flexdispatch.integrations._megatron``; an import failure (Megatron's interface moved)
    named with the installed and the checked release."""
    try:
        return importlib.import_module("flexdispatch.integrations._megatron")
    except ImportError as exc:
        if "flexdispatch" in str(getattr(exc, "name", "") or ""):
            raise
        raise ImportError(
            f"flexdispatch's Megatron plug-in needs megatron-core {MEGATRON_CORE_CHECKED}'s "
            f"dispatcher interface; megatron-core {_installed_version()} is installed: {exc}"
        ) from exc


def installed_config() -> DispatchConfig | None:
    """The ``DispatchConfig`` new layers get, or None when not installed."""
    return _STATE.get("config")


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # NOTE: these subclass Megatron's classes: importing them imports Megatron
        _moe_layer_module()
        return getattr(_impl(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
