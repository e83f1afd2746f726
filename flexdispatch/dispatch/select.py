"""Which backend a dispatcher gets: the registry and the selection rule.

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · E experts in total.

``select_backend`` turns ``DispatchConfig.backend`` (and ``deepep_api``) into a backend object and
a reason. Every rank must reach the same decision, so a choice that depends on local facts (can
``deep_ep`` be imported here? has it ``ElasticBuffer``?) is agreed with one small MIN all-reduce
over "can use" flags.

``auto`` picks ``deepep`` only when ``deep_ep`` imports, the group is NCCL on CUDA, DeepEP supports
the topology (and the worst-case request: V1 intranode only, V2 across nodes too) and, in
low-latency mode with a known ``hidden_size``, the hidden size — on every rank; otherwise
``torch``, with the reason.

``DispatchConfig.deepep_api`` names the DeepEP release: ``'v1'`` (``deep_ep.Buffer``), ``'v2'``
(``deep_ep.ElasticBuffer``) or ``'v25'`` (``deep_ep_v25.EPBuffer``); each backend class builds
itself from the config (``DispatchBackend.from_config``). ``deepep_api='auto'`` runs DeepEP V2
where every rank has it and its static bound is known — worst-case mode (``M = W / R``) or
dropless with ``num_max_dispatch_tokens_per_rank`` set, except a dropless dispatch across nodes,
which runs V1's node-deduplicated internode kernels unless ``deepep_hybrid=False`` — and V1
(``Buffer``) otherwise: low-latency mode, ``deepep_async_finish``, dropless with no per-rank
token bound (``auto_deepep_api``). DeepEP 2.5 (``deepep_api='v25'``) comes first where every
rank has it, under the same bound rule (and also unbounded where V1 cannot run); the same one
all-reduce agrees on it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch.distributed as dist

from flexdispatch.backends.base import Capability, DispatchBackend
from flexdispatch.backends.deepep.support import deepep_support, load_deep_ep
from flexdispatch.config import DispatchConfig, deepep_release
from flexdispatch.distributed import all_reduce_min_flag, all_reduce_min_flags, group_size
from flexdispatch.types import DispatchStats

__all__ = [
    "Capability",
    "DispatchBackend",
    "auto_deepep_api",
    "BACKENDS",
    "backend_class",
    "deepep_available",
    "select_backend",
]

_CLASSES: dict[str, tuple[str, str]] = {
    "torch": ("flexdispatch.backends.torch.a2a", "TorchA2ABackend"),
    "v1": ("flexdispatch.backends.deepep.v1.backend", "DeepEPV1Backend"),
    "v2": ("flexdispatch.backends.deepep.v2.backend", "DeepEPV2Backend"),
    "v25": ("flexdispatch.backends.deepep.v25.backend", "DeepEPV25Backend"),
}


def backend_class(api: str) -> type[DispatchBackend]:
    """The backend class of ``api`` (``"torch"``, or a DeepEP release: ``"v1"``, ``"v2"``,
    ``"v25"``), imported now (never when this module is)."""
    module, name = _CLASSES[api]
    return getattr(importlib.import_module(module), name)


_V25_NOT_EVERYWHERE = "deep_ep_v25.EPBuffer is usable here but not on every rank"


def _v25_local(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    module: ModuleType | None,
    hooked: bool,
) -> tuple[bool, str, ModuleType | None]:
    """The local part of ``_v25_support``: normal mode, DeepEP 2.5 imports and has ``EPBuffer``,
    an NCCL group on CUDA, its NCCL rule on this process's runtime (``nccl.nccl_rule``) and the
    PCIe rule (``support.pcie_rule``). No collective: ``(ok, reason, module)``."""
    from flexdispatch.backends.deepep.nccl import generation_rule
    from flexdispatch.backends.deepep.support import group_is_nccl_on_cuda, is_emulator, pcie_rule
    from flexdispatch.backends.deepep.v25.support import load_deep_ep_v25, v25_available

    if config.mode != "normal":
        return False, "deepep_api='v25': DeepEP 2.5 has no low-latency kernels", None
    why = "no deep_ep_v25 module given (test hook)"
    if not hooked:
        module, why = load_deep_ep_v25()
    ok, why = v25_available(module, why)
    if ok and module is not None and not is_emulator(module):
        ok, nccl = group_is_nccl_on_cuda(group)
        why = why if ok else nccl
    if ok and module is not None:
        ok, rule = generation_rule("v25", module)
        why = f"{why}; {rule}" if ok else rule
    if ok and module is not None:
        ok, why = pcie_rule(module, group_size(group), why)
    return ok, why, module


def _v25_support(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    module: ModuleType | None,
    hooked: bool,
) -> tuple[bool, str, bool]:
    """Whether DeepEP 2.5 can serve this group here (``v25.support.v25_rules``), judged as its
    constructor will: on DeepEP's own NVLink (NCCL LSA) domain, not ``ranks_per_node`` (a
    launcher's local world size need not be the NVLink domain), and on NCCL's report of its
    device API and GIN (``gin.gin_support``: the buffer asserts on it otherwise).

    Collective whenever it is called with ``mode='normal'``: the domain query needs the group's
    communicator, so it runs only where every rank has DeepEP 2.5 (one small all-reduce first).

    Returns:
        ``(ok, reason, present)``: ``present`` says DeepEP 2.5 was usable here before its rules
        (so a refusal is worth naming when ``auto`` picks another API).
    """
    from flexdispatch.backends.deepep.gin import gin_support
    from flexdispatch.backends.deepep.v25.support import v25_rules

    del ranks_per_node  # NOTE: DeepEP 2.5 reads its NVLink domain from NCCL, not the launcher
    if config.mode != "normal":
        return False, "deepep_api='v25': DeepEP 2.5 has no low-latency kernels (use 'v1')", False
    ok, why, module = _v25_local(config, group, module=module, hooked=hooked)
    R = group_size(group)
    if R > 1 and not all_reduce_min_flag(ok, group):
        return False, why if not ok else _V25_NOT_EVERYWHERE, False
    if not ok or module is None:
        return False, why, False
    world = group if group is not None else dist.group.WORLD
    _, L = (1, R) if R == 1 else module.get_physical_domain_size(world)
    ok, rule, hybrid = v25_rules(
        R,
        L,
        num_experts,
        hybrid=config.deepep_hybrid,
        num_worst_tokens=config.num_worst_tokens,
        hidden=config.hidden_size,
    )
    if not ok:
        return False, rule, True
    nodes = R // max(min(L, R), 1)
    ok, gin = gin_support(module, world, hybrid=hybrid, generation="v25", num_ranks=R, nodes=nodes)
    if not ok:
        return False, gin, True
    return True, f"{why}; {rule}; {gin}", True


def _v2_support(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    ranks_per_node: int,
    deep_ep: ModuleType | None,
) -> Capability:
    """Whether the V2 path can serve this group here (local answer): DeepEP's topology rules
    (worst-case mode allowed across nodes), normal mode, and ``deep_ep.ElasticBuffer``."""
    from flexdispatch.backends.deepep.gin import gin_support
    from flexdispatch.backends.deepep.nccl import generation_rule
    from flexdispatch.backends.deepep.v2.backend import v2_available

    if config.mode != "normal":
        return False, "deepep_api='v2' runs mode='normal' only (low-latency: use 'v1')"
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
    W, R = config.num_worst_tokens, group_size(group)
    if W % R:
        return False, f"num_worst_tokens={W} is not a multiple of R={R} (V2 takes M = W / R)"
    # NOTE: V2's own workspace limits (layout.cuh:38-40), beside V1's rules above
    if num_experts > 2048 or R > 1024 or num_experts // R > 256:
        return False, (
            f"DeepEP V2 takes E <= 2048 experts, R <= 1024 ranks and at most 256 local experts, "
            f"got E={num_experts}, R={R}, e={num_experts // R}"
        )
    module = deep_ep if deep_ep is not None else load_deep_ep()[0]
    has, reason = v2_available(module)
    if not has:
        return False, reason
    ok, rule = generation_rule("v2", module)
    if not ok:
        return False, rule
    # NOTE: V2's buffer builds an NCCL device communicator and asserts GIN (direct mode:
    # ginType) unless EP_DISABLE_GIN
    world = group if group is not None else dist.group.WORLD
    nodes = R // max(min(ranks_per_node, R), 1)
    ok, gin = gin_support(module, world, hybrid=False, generation="v2", num_ranks=R, nodes=nodes)
    if not ok:
        return False, gin
    return True, f"{why}; {reason}; {rule}; {gin}"


BACKENDS = ("torch", "deepep")
"""The backends ``DispatchConfig.backend`` names (``"auto"`` picks one of them)."""


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
    """Pick and build the backend named by ``config.backend`` (and the DeepEP API).

    Args:
        config: the dispatch config (``backend`` is ``"auto"``, ``"torch"`` or ``"deepep"``;
            ``deepep_api`` is ``"auto"``, ``"v1"``, ``"v2"`` or ``"v25"``).
        group: the process group (None = WORLD, or a world of one).
        num_experts: E.
        ranks_per_node: L (already resolved).
        stats: counters the backend adds to.
        deep_ep: a ``deep_ep`` module to use instead of importing one (private test hook: the
            emulator in ``tests/deepep_emu``).

    Returns:
        ``(backend, reason)``; the reason says why this backend (and DeepEP API) was chosen.

    Raises:
        ValueError: ``backend="deepep"`` cannot be honoured (the message says why).
    """
    kwargs = {"num_experts": num_experts, "ranks_per_node": ranks_per_node, "stats": stats}
    requested = deepep_release(config.deepep_api)
    if config.backend == "torch":
        return backend_class("torch").from_config(config, group, **kwargs), (
            "backend='torch' requested"
        )
    from flexdispatch.backends.deepep.v25.support import split_hook

    deep_ep, v25_module, hooked = split_hook(deep_ep)
    v25_3 = (False, "deepep_api excludes DeepEP 2.5", False)
    if requested in ("v25", "auto"):
        v25_3 = _v25_support(
            config,
            group,
            num_experts=num_experts,
            ranks_per_node=ranks_per_node,
            module=v25_module,
            hooked=hooked,
        )
    v25 = v25_3[:2]
    known: dict[str, Capability] = {}
    if requested in ("v25", "auto"):
        known["v25"] = v25

    def v1_support() -> Capability:
        if hooked and deep_ep is None:
            return False, "no deep_ep module given (test hook)"
        return deepep_support(
            group=group,
            num_experts=num_experts,
            ranks_per_node=ranks_per_node,
            num_worst_tokens=config.num_worst_tokens,
            mode=config.mode,
            hidden_size=config.hidden_size,
            num_max_dispatch_tokens_per_rank=config.num_max_dispatch_tokens_per_rank,
            deep_ep=deep_ep,
        )

    def v2_support() -> Capability:
        if hooked and deep_ep is None:
            return False, "no deep_ep module given (test hook)"
        return _v2_support(
            config, group, num_experts=num_experts, ranks_per_node=ranks_per_node, deep_ep=deep_ep
        )

    def v25_local() -> Capability:
        return _v25_local(config, group, module=v25_module, hooked=hooked)[:2]

    local = {"v25": v25_local, "v2": v2_support, "v1": v1_support}

    def others(api: str) -> str:
        """The other generations that can run here (never one whose own check failed)."""
        return _alternatives(api, known, local)

    if requested == "v25":
        note = "DeepEP API: v25 deep_ep_v25.EPBuffer (deepep_api='v25' requested)"
        return _build(config, group, "v25", v25, note, kwargs, v25_module, others=others)
    v1 = known["v1"] = v1_support()
    if requested == "v1":
        note = "DeepEP API: v1 deep_ep.Buffer (deepep_api='v1')"
        return _build(config, group, "v1", v1, note, kwargs, deep_ep, others=others)
    v2 = known["v2"] = v2_support()
    if requested == "v2":
        note = "DeepEP API: v2 deep_ep.ElasticBuffer (deepep_api='v2' requested)"
        return _build(config, group, "v2", v2, note, kwargs, deep_ep, others=others)
    across = group_size(group) > ranks_per_node
    api, why = auto_deepep_api(config, v2, v1, v25, across_nodes=across)
    if v25[1] == _V25_NOT_EVERYWHERE:
        why = f"DeepEP 2.5 is not the choice of every rank; {why}"
    alt, alt_why = (
        auto_deepep_api(config, v2, v1, across_nodes=across) if api == "v25" else (api, why)
    )
    # NOTE: every rank must run the same API: V2.5 / V2 only where every rank would pick it
    # (the choice without V2.5 is agreed in the same all-reduce).
    want_v25, ok_v25, want_v2, ok_v2, ok_v1 = all_reduce_min_flags(
        [api == "v25", v25[0], alt == "v2", v2[0], v1[0]], group
    )
    if api == "v25" and not want_v25:
        api, why = alt, f"DeepEP 2.5 is not the choice of every rank; {alt_why}"
    if api == "v2" and not want_v2:
        api, why = "v1", "V2 is not the choice of every rank"
    note = f"DeepEP API: {api} {_BUFFER_CLASS[api]} (deepep_api='auto': {why})"
    support = {"v25": v25, "v2": v2, "v1": v1}[api]
    if api != "v25" and v25_3[2] and not v25[0]:  # NOTE: DeepEP 2.5 is here but refused: say why
        support = (support[0], f"{support[1]}; DeepEP 2.5 not used: {v25[1]}")
    everywhere = {"v25": ok_v25, "v2": ok_v2, "v1": ok_v1}[api]
    module = v25_module if api == "v25" else deep_ep
    return _build(
        config, group, api, support, note, kwargs, module, everywhere=everywhere, others=others
    )


def _alternatives(
    api: str, known: dict[str, Capability], local: dict[str, Callable[[], Capability]]
) -> str:
    """``"deepep_api='v1' / 'v2', "`` for the generations other than ``api`` whose own support
    check passes in this process (known, or its local part computed now), or ``""``: a refusal
    never suggests a generation that cannot run here (issue 44, Q1)."""
    names = []
    for other in ("v25", "v2", "v1"):
        if other != api and (known[other] if other in known else local[other]())[0]:
            names.append(f"'{other}'")
    return f"deepep_api={' / '.join(names)}, " if names else ""


_BUFFER_CLASS = {
    "v25": "deep_ep_v25.EPBuffer",
    "v2": "deep_ep.ElasticBuffer",
    "v1": "deep_ep.Buffer",
}


def _build(
    config: DispatchConfig,
    group: dist.ProcessGroup | None,
    api: str,
    support: Capability,
    note: str,
    kwargs: dict,
    deep_ep: ModuleType | None,
    *,
    everywhere: bool | None = None,
    others: Callable[[str], str] = lambda api: "",
) -> tuple[DispatchBackend, str]:
    """Build the deepep backend of ``api`` (or, with ``backend='auto'``, torch when it cannot
    serve every rank; with ``backend='deepep'``, raise on every rank when one cannot build it).
    ``everywhere``: the support already agreed across ranks (None: agree here with one small
    all-reduce); ``others(api)``: the hint naming the generations that can run here instead."""
    ok, why = support
    cls = backend_class(api)
    what = "deepep backend" + (f" with deepep_api={api!r}" if api != "v1" else "")
    if config.backend == "deepep":
        if everywhere is None:  # NOTE: a rank that cannot build it makes every rank raise
            everywhere = all_reduce_min_flag(ok, group)
        if not ok:
            alt = others(api)
            raise ValueError(f"{what} not available: {why}; use {alt}backend='torch' or 'auto'")
        if everywhere is False:
            raise ValueError(
                f"{what} is usable here ({why}) but not on every rank; use backend='auto'"
            )
        return cls.from_config(config, group, **kwargs, _deep_ep=deep_ep), (
            f"backend='deepep' requested ({why}); {note}"
        )
    if everywhere is None:
        everywhere = all_reduce_min_flag(ok, group)
    if everywhere:
        return cls.from_config(config, group, **kwargs, _deep_ep=deep_ep), (
            f"auto: deepep on every rank ({why}); {note}"
        )
    if ok:
        module = "deep_ep" if api == "v1" else _BUFFER_CLASS[api]
        why = f"{module} is usable here but not on every rank"
    requested = deepep_release(config.deepep_api)
    prefix = f"deepep_api={requested!r}: " if requested not in ("auto", "v1") else ""
    return backend_class("torch").from_config(config, group, **kwargs), (
        f"auto: torch fallback ({prefix}{why})"
    )


def auto_deepep_api(
    config: DispatchConfig,
    v2: Capability,
    v1: Capability,
    v25: Capability | None = None,
    *,
    across_nodes: bool = False,
) -> tuple[str, str]:
    """``deepep_api='auto'``: which DeepEP API suits this config here (local answer), and why.

    Across nodes (``across_nodes``) the node-deduplicated kernels come first: DeepEP 2.5 (hybrid
    mode unless ``deepep_hybrid=False``), else V1's internode kernels for a dropless dispatch,
    not V2's direct mode (one RDMA put per destination *rank*) — unless
    ``deepep_hybrid=False`` asks for direct mode.

    DeepEP 2.5 (``v25``: ``deep_ep_v25.EPBuffer``) first, where it exists and its static bound is
    known (as V2's below) or V1 cannot run here. V2 (``ElasticBuffer``) runs where it exists and
    its static bound is known: worst-case mode (``M = W / R``, static shapes without a host sync,
    intranode and across nodes) or a dropless dispatch with ``num_max_dispatch_tokens_per_rank``
    set. V1 keeps low-latency mode, ``deepep_async_finish`` and dropless dispatch with no
    per-rank token bound (V1 takes any T).
    """
    if config.mode != "normal":
        return "v1", "low-latency kernels are DeepEP V1's"
    if config.deepep_async_finish:
        return "v1", "deepep_async_finish runs on V1's communication stream"
    bound = "num_max_dispatch_tokens_per_rank" in config.model_fields_set
    if v25 is not None and v25[0]:
        if config.num_worst_tokens:
            return "v25", "worst-case mode: DeepEP 2.5 static shapes, no host sync"
        if bound:
            M = config.num_max_dispatch_tokens_per_rank
            return "v25", f"DeepEP 2.5, dropless with num_max_dispatch_tokens_per_rank={M} set"
        if not v1[0]:
            M = config.num_max_dispatch_tokens_per_rank
            return "v25", (
                f"DeepEP 2.5, dropless with num_max_dispatch_tokens_per_rank={M} tokens per rank "
                f"at first, grown to the largest T the ranks dispatch (V1 cannot run: "
                f"{v1[1]})"
            )
    ok, why = v2
    if not ok:
        return "v1", f"V2 cannot run: {why}"
    if across_nodes and not config.num_worst_tokens and v1[0] and config.deepep_hybrid is not False:
        return "v1", (
            "across nodes: V1's internode kernels send a token once per destination node and "
            "forward it over NVLink (V2 here would be direct mode, one RDMA put per destination "
            "rank; deepep_hybrid=False or deepep_api='v2' asks for that)"
        )
    if config.num_worst_tokens:
        if not v1[0]:
            return "v2", "worst-case mode: V2 static shapes (V1 cannot: " + v1[1] + ")"
        direct = " (direct mode across nodes: V1 has no internode worst-case mode)"
        return "v2", "worst-case mode: V2 static shapes with M = W / R, no host sync" + (
            direct if across_nodes else ""
        )
    if "num_max_dispatch_tokens_per_rank" in config.model_fields_set:
        M = config.num_max_dispatch_tokens_per_rank
        return "v2", f"dropless with num_max_dispatch_tokens_per_rank={M} set"
    # NOTE: only generations whose own check passed here are named (V2 did, to get here)
    also = (" / 'v25'", " / V2.5") if v25 is not None and v25[0] else ("", "")
    return "v1", (
        f"dropless with no per-rank token bound: V1 takes any T (set "
        f"num_max_dispatch_tokens_per_rank, or deepep_api='v2'{also[0]} for V2{also[1]})"
    )
