"""flexdispatch as SGLang's expert-parallel dispatcher (checked on sglang 0.5.23).

Switching a server::

    pip install flexdispatch          # the sglang.srt.plugins entry point "flexdispatch"
    FLEXDISPATCH_SGLANG=1 python -m sglang.launch_server --model-path <moe model> --tp 2 \\
        --moe-a2a-backend deepep --deepep-mode auto
    # optional: FLEXDISPATCH_SGLANG_CONFIG='{"backend": "auto"}' (a DispatchConfig as JSON),
    #           FLEXDISPATCH_SGLANG_NORMAL_FORMAT=standard (StandardDispatchOutput for prefill)

How it plugs in. SGLang loads every ``sglang.srt.plugins`` entry point in each of its processes
and then applies the hooks they registered with its ``HookRegistry`` (which also rebinds every
``from ... import`` of a hooked function). flexdispatch's is ``register()``: when
``FLEXDISPATCH_SGLANG=1`` it registers an AROUND hook on
``sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher``, SGLang's closed factory
of MoE dispatchers. For layers SGLang would give its DeepEP dispatcher (``--moe-a2a-backend
deepep``, which stays on the command line so that every other SGLang path — ``DeepEPMoE``, the
decode-graph adapter, the piecewise-graph split, two-batch overlap — treats the layer as DeepEP)
the hook returns a ``FlexSGLangDispatcher`` on the group DeepEP would use
(``get_parallel().tp_group.device_group``); every other layer gets SGLang's own dispatcher.

The dispatcher picks its mode per call as SGLang's DeepEP dispatcher does
(``--deepep-mode auto``: dropless ``FlexDispatcher`` for extend batches, ``DecodeDispatcher``
for decode batches, which SGLang captures in CUDA graphs) and speaks DeepEP's formats
(``DeepEPNormalDispatchOutput``, ``DeepEPLLDispatchOutput``).

Refused in one line when a layer is built: quantized experts (their DeepEP path dispatches fp8 /
fp4 rows with scales, which this dispatcher does not produce), single-batch overlap, fused shared
experts. Importing this module does not import SGLang.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from flexdispatch.config import DispatchConfig
from flexdispatch.integrations._engines import config_from_env, switched_on, updated_config

if TYPE_CHECKING:  # NOTE: at run time this loads lazily (__getattr__): it imports SGLang
    from flexdispatch.integrations._sglang import FlexSGLangDispatcher

__all__ = [
    "ENV_CONFIG",
    "ENV_NORMAL_FORMAT",
    "ENV_SWITCH",
    "FlexSGLangDispatcher",
    "SGLANG_CHECKED",
    "TARGET",
    "install",
    "installed_config",
    "make_dispatcher",
    "register",
    "uninstall",
]

SGLANG_CHECKED = "0.5.23"
"""The SGLang release the plug-in is tested on."""

ENV_SWITCH = "FLEXDISPATCH_SGLANG"
"""``1`` turns the plug-in on when SGLang loads it (``register()``)."""

ENV_CONFIG = "FLEXDISPATCH_SGLANG_CONFIG"
"""A ``DispatchConfig`` as JSON (optional; default ``DispatchConfig()``, backend ``"auto"``)."""

ENV_NORMAL_FORMAT = "FLEXDISPATCH_SGLANG_NORMAL_FORMAT"
"""``deepep`` (default: ``DeepEPNormalDispatchOutput``) or ``standard``
(``StandardDispatchOutput``) for normal-mode (prefill) dispatches."""

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"
"""The function the AROUND hook wraps."""

_LAZY = ("FlexSGLangDispatcher",)
_STATE: dict[str, Any] = {}  # "config", "normal_format": what new layers get while installed


def _settings_from_env() -> tuple[DispatchConfig, str]:
    config = config_from_env(ENV_CONFIG)
    fmt = os.environ.get(ENV_NORMAL_FORMAT, "").strip() or "deepep"
    if fmt not in ("deepep", "standard"):
        raise ValueError(f"{ENV_NORMAL_FORMAT} must be 'deepep' or 'standard', got {fmt!r}")
    return config, fmt


def _hook_registry() -> Any:
    try:
        return importlib.import_module("sglang.srt.plugins.hook_registry")
    except ImportError as exc:
        raise ImportError(
            f"flexdispatch.integrations.sglang needs SGLang (checked on {SGLANG_CHECKED}): {exc}"
        ) from exc


def create_moe_dispatcher_around(original: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on ``create_moe_dispatcher(moe_runner_config, quant_method)``: a
    ``FlexSGLangDispatcher`` for a DeepEP layer while installed, else SGLang's own answer."""
    config = _STATE.get("config")
    if config is not None:
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        if get_moe_a2a_backend().is_deepep():
            named = dict(zip(("moe_runner_config", "quant_method"), args, strict=False))
            named.update(kwargs)
            return make_dispatcher(
                named["moe_runner_config"],
                named.get("quant_method"),
                config,
                normal_format=_STATE["normal_format"],
            )
    return original(*args, **kwargs)


def make_dispatcher(
    moe_runner_config: Any,
    quant_method: Any,
    dispatch_config: DispatchConfig,
    *,
    group: Any = None,
    normal_format: str = "deepep",
) -> FlexSGLangDispatcher:
    """A ``FlexSGLangDispatcher`` for one SGLang MoE layer, from SGLang's runtime state:
    ``get_deepep_mode()``, two-batch overlap (one set of dispatchers per sub-batch), B =
    ``dispatch_config.num_max_dispatch_tokens_per_rank`` when set, else SGLang's
    ``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK``.

    Args:
        moe_runner_config: SGLang's ``MoeRunnerConfig`` of the layer.
        quant_method: the layer's quant method (unquantized only).
        dispatch_config: the flexdispatch config.
        group: the process group; None = ``get_parallel().tp_group.device_group``.
        normal_format: ``"deepep"`` or ``"standard"``.

    Raises:
        ValueError: a layer the plug-in does not serve, in one line.
    """
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe.utils import get_deepep_mode, is_sbo_enabled, is_tbo_enabled
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    from flexdispatch.integrations._sglang import FlexSGLangDispatcher

    if quant_method is not None and not isinstance(quant_method, UnquantizedFusedMoEMethod):
        raise ValueError(
            f"flexdispatch's SGLang plug-in dispatches unquantized rows; this layer's "
            f"{type(quant_method).__name__} experts take DeepEP's fp8 / fp4 dispatch: unset "
            f"FLEXDISPATCH_SGLANG for this model"
        )
    if is_sbo_enabled():
        raise ValueError(
            "flexdispatch's SGLang plug-in does not run single-batch overlap "
            "(--enable-single-batch-overlap): run without it, or unset FLEXDISPATCH_SGLANG"
        )
    if group is None:
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().tp_group.device_group
    if "num_max_dispatch_tokens_per_rank" in dispatch_config.model_fields_set:
        B = dispatch_config.num_max_dispatch_tokens_per_rank
    else:
        B = envs.SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get()
    config = dispatch_config
    if config.hidden_size is None:
        config = updated_config(config, hidden_size=moe_runner_config.hidden_size)
    return FlexSGLangDispatcher(
        config,
        group=group,
        num_experts=moe_runner_config.num_experts,
        num_local_experts=moe_runner_config.num_local_experts,
        router_topk=moe_runner_config.top_k,
        hidden_size=moe_runner_config.hidden_size,
        params_dtype=moe_runner_config.params_dtype,
        deepep_mode=get_deepep_mode(),
        num_max_dispatch_tokens_per_rank=B,
        normal_format=normal_format,  # type: ignore[arg-type]
        num_subbatches=2 if is_tbo_enabled() else 1,
    )


def install(
    dispatch_config: DispatchConfig | None = None, *, normal_format: str = "deepep"
) -> None:
    """Register the AROUND hook (once per process) and make it serve DeepEP layers built from now
    on with ``dispatch_config``. SGLang applies registered hooks when its ``load_plugins()``
    runs (at engine start); a hook registered later is applied here, on this target alone.

    Raises:
        TypeError: ``dispatch_config`` is not a ``DispatchConfig``.
        ValueError: an unknown ``normal_format``.
        ImportError: SGLang does not import.
    """
    if dispatch_config is None:
        dispatch_config = DispatchConfig()
    if not isinstance(dispatch_config, DispatchConfig):
        raise TypeError(
            f"dispatch_config must be a flexdispatch DispatchConfig or None, got "
            f"{type(dispatch_config).__name__}"
        )
    if normal_format not in ("deepep", "standard"):
        raise ValueError(f"normal_format must be 'deepep' or 'standard', got {normal_format!r}")
    hr = _hook_registry()
    registry = hr.HookRegistry
    _STATE["config"] = dispatch_config
    _STATE["normal_format"] = normal_format
    hooks = registry._hooks[TARGET]
    if not any(h is create_moe_dispatcher_around for _, h, _ in hooks):
        registry.register(TARGET, create_moe_dispatcher_around, hr.HookType.AROUND)
        if TARGET in registry._patched:
            # NOTE: SGLang applied its hooks already (a programmatic install after start-up):
            # wrap the current function and rebind it as SGLang's registry does
            module = importlib.import_module(TARGET.rsplit(".", 1)[0])
            current = module.create_moe_dispatcher
            wrapped = hr._wrap_fn(current, create_moe_dispatcher_around, hr.HookType.AROUND)
            module.create_moe_dispatcher = wrapped
            hr._propagate_patch(current, wrapped, module)


def uninstall() -> None:
    """Make the hook pass every call to SGLang's own factory (a no-op when not installed). The
    wrapper stays applied (SGLang's registry cannot unpatch); layers already built keep their
    dispatcher."""
    _STATE.pop("config", None)
    _STATE.pop("normal_format", None)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: ``install()`` with ``FLEXDISPATCH_SGLANG_CONFIG``
    and ``FLEXDISPATCH_SGLANG_NORMAL_FORMAT`` when ``FLEXDISPATCH_SGLANG=1``, else
    ``uninstall()`` (no hook is registered). The environment is read at each call.

    Raises:
        ValueError: a bad ``FLEXDISPATCH_SGLANG_CONFIG`` or ``FLEXDISPATCH_SGLANG_NORMAL_FORMAT``.
    """
    if not switched_on(ENV_SWITCH):
        uninstall()
        return
    config, fmt = _settings_from_env()
    install(config, normal_format=fmt)


def installed_config() -> DispatchConfig | None:
    """The ``DispatchConfig`` new DeepEP layers get, or None when not installed."""
    return _STATE.get("config")


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # NOTE: it subclasses SGLang's BaseDispatcher: importing it imports SGLang
        _hook_registry()
        return getattr(importlib.import_module("flexdispatch.integrations._sglang"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
