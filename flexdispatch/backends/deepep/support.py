"""Whether the ``deepep`` backend can run here, and its factory (light: no DeepEP import).

Shape letters (ARCHITECTURE.md): R ranks · L ranks per node · E experts · W worst-case rows ·
H hidden.

``deep_ep`` is imported lazily, where DeepEP's own import check would pass (``nccl.import_deepep``:
also after NCCL mapped its plugins), and every way that import fails becomes a reason string that
tells a missing package from a refused one, so a job that never uses DeepEP never dies of it.

``pcie_rule``: every DeepEP generation asserts at most 2 ranks on PCIe GPUs when it builds its
buffer (``check_nvlink_connections``: V1 ``Buffer``, V2 ``ElasticBuffer``, V2.5 ``EPBuffer``), so
the rule is part of every generation's support check.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

from flexdispatch.backends.base import Capability
from flexdispatch.backends.deepep import rules, sizing
from flexdispatch.backends.deepep.nccl import import_deepep
from flexdispatch.distributed import group_size, is_distributed

__all__ = [
    "load_deep_ep",
    "is_emulator",
    "nvl_peers",
    "group_is_nccl_on_cuda",
    "pcie_rule",
    "SupportCheck",
    "deepep_support_checks",
    "deepep_support_for",
    "deepep_support",
    "require_deep_ep",
]


def load_deep_ep() -> tuple[ModuleType | None, str]:
    """Import ``deep_ep`` if it can be; never raises.

    Returns:
        ``(module, reason)``, or ``(None, reason)`` with the import error.
    """
    module, why = import_deepep("deep_ep")
    if module is None:
        return None, why
    if not hasattr(module, "Buffer"):
        return None, "the importable deep_ep has no Buffer (not DeepEP's V1 API)"
    return module, why


def require_deep_ep(hook: ModuleType | None) -> ModuleType:
    """``hook`` (a test's module) or the imported ``deep_ep``; ValueError with the reason when it
    does not import."""
    if hook is not None:
        return hook
    module, why = load_deep_ep()
    if module is None:
        raise ValueError(f"deepep backend not available: {why}")
    return module


def is_emulator(module: ModuleType) -> bool:
    """True for the test emulator (``tests/deepep_emu``), which runs on CPU/gloo groups."""
    return getattr(module, "IS_EMULATOR", False) is True


def nvl_peers(module: ModuleType) -> int:
    """DeepEP's NVLink domain size: 8, or what the test runtime was told to emulate."""
    if is_emulator(module):
        peers = getattr(module, "NUM_MAX_NVL_PEERS", None)
        if callable(getattr(module, "num_max_nvl_peers", None)):
            peers = module.num_max_nvl_peers()
        if peers is not None:
            return int(peers)
    return sizing.NUM_MAX_NVL_PEERS


def qp_depth() -> int:
    """``NVSHMEM_QP_DEPTH`` as DeepEP's Python layer reads it (default 1024)."""
    import os

    try:
        return int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
    except ValueError:
        return 0


def pcie_rule(module: ModuleType, num_ranks: int, why: str = "") -> Capability:
    """DeepEP's PCIe rule, for every generation: at most 2 ranks on a GPU whose name contains
    ``PCIE`` (pairwise NVLink only; ``check_nvlink_connections``, deep_ep/utils/envs.py:155-156,
    deep_ep_v25/utils/envs.py:156-157, v1.2.1 deep_ep/utils.py:76-77), asserted when the buffer is
    built (the first dispatch): refused at selection instead. ``why``: the reason kept when it
    holds."""
    if is_emulator(module):
        name = str(getattr(module, "emu_device_name", ""))
    else:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    if "PCIE" in name and num_ranks > 2:
        return False, (
            f"DeepEP takes at most 2 ranks on PCIe GPUs ({name}: pairwise NVLink only; every "
            f"DeepEP generation asserts it when it builds its buffer): use backend='torch' or an "
            f"expert-parallel group of 2"
        )
    return True, why


def group_is_nccl_on_cuda(group: dist.ProcessGroup | None) -> Capability:
    """Whether ``group`` is an NCCL group on a machine with CUDA (what DeepEP needs)."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not is_distributed(group):
        return False, "torch.distributed is not initialised (DeepEP needs a process group)"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return False, f"the process group uses {backend!r}, DeepEP needs NCCL on CUDA"
    return True, "NCCL group on CUDA"


SupportCheck = tuple[str, bool, str]
"""``(name, ok, reason)``: one named condition of DeepEP support."""


def deepep_support_checks(
    num_ranks: int,
    ranks_per_node: int,
    *,
    imported: Capability,
    nccl_on_cuda: Capability,
    num_experts: int | None = None,
    num_worst_tokens: int = 0,
    mode: str = "normal",
    hidden_size: int | None = None,
    nvl_peers: int = sizing.NUM_MAX_NVL_PEERS,
    release: str = rules.DEFAULT_RELEASE,
    num_max_dispatch_tokens_per_rank: int | None = None,
) -> tuple[SupportCheck, ...]:
    """Every condition of DeepEP support, each evaluated (not only up to the first failure).

    The one rule behind ``deepep_support_for`` (selection) and ``flexdispatch.doctor`` (which
    reports each check). It needs neither ``deep_ep`` nor a process group: the caller says whether
    ``deep_ep`` imports and whether the group is (or would be) NCCL on CUDA.

    Args:
        num_ranks: R.
        ranks_per_node: L.
        imported: ``(ok, reason)`` of importing ``deep_ep``.
        nccl_on_cuda: ``(ok, reason)``: the group is NCCL on CUDA (pass ``(True, ...)`` to waive
            it, as for the test emulator).
        num_experts: E; when given, E must divide by R.
        num_worst_tokens: W (0 = dropless); DeepEP takes W > 0 intranode only.
        mode: ``"normal"`` or ``"low_latency"``.
        hidden_size: H; in low-latency mode it must be one of the compiled hidden sizes.
        nvl_peers: DeepEP's NVLink domain (8; the emulator can fake smaller nodes).
        release: the DeepEP release whose limits apply (``rules``).
        num_max_dispatch_tokens_per_rank: low-latency tokens per rank and call (checked in
            low-latency mode when given).

    Returns:
        ``(name, ok, reason)`` in this order: ``import``, ``nccl_on_cuda``, ``experts`` (with
        ``num_experts``), ``topology``, ``local_experts`` (with ``num_experts``),
        ``low_latency_hidden`` (low-latency mode with ``hidden_size``), ``low_latency_tokens``
        (low-latency mode with ``num_max_dispatch_tokens_per_rank``).
    """
    R = num_ranks
    checks: list[SupportCheck] = [("import", *imported), ("nccl_on_cuda", *nccl_on_cuda)]
    if num_experts is not None:
        ok = num_experts % max(R, 1) == 0
        why = (
            f"num_experts={num_experts} divides by R={R}"
            if ok
            else f"num_experts={num_experts} is not divisible by R={R}"
        )
        checks.append(("experts", ok, why))
    limits = rules.rules_for(release)
    ok, why = sizing.check_topology(
        R,
        ranks_per_node,
        num_worst_tokens=num_worst_tokens,
        internode_node_counts=limits.internode_node_counts,
        nvl_peers=nvl_peers,
        low_latency=mode == "low_latency",
    )
    checks.append(("topology", ok, why))
    if num_experts is not None and R > 0 and num_experts % R == 0:
        checks.append(("local_experts", *_local_experts(num_experts, R, ranks_per_node, limits)))
    if mode == "low_latency" and num_max_dispatch_tokens_per_rank is not None:
        checks.append(
            ("low_latency_tokens", *_low_latency_tokens(R, num_max_dispatch_tokens_per_rank))
        )
    if mode == "low_latency" and hidden_size is not None:
        sizes = limits.low_latency_hidden_sizes
        if hidden_size in sizes:
            checks.append(("low_latency_hidden", True, f"low-latency kernels take H={hidden_size}"))
        else:
            listed = ", ".join(map(str, sizes))
            checks.append(
                (
                    "low_latency_hidden",
                    False,
                    f"low-latency kernels support H in {listed}, not {hidden_size}",
                )
            )
    return tuple(checks)


def _local_experts(E: int, R: int, L: int, limits: rules.Rules) -> Capability:
    """DeepEP's layout-notify kernels: one thread per expert of a rank (intranode, 128 threads)
    or of a node (internode, 512 threads) — ``rules``."""
    e = E // R
    if L >= R:
        cap = limits.max_local_experts_intranode
        if e > cap:
            return False, (
                f"{e} local experts per rank exceed DeepEP {limits.release}'s intranode limit of "
                f"{cap} (notify_dispatch runs {cap} threads): use more ranks or the torch backend"
            )
        return True, f"{e} local experts (intranode limit {cap})"
    per_node = E // (R // L)
    cap = limits.max_experts_per_node_internode
    if per_node > cap:
        return False, (
            f"{per_node} experts per node exceed DeepEP {limits.release}'s internode limit of "
            f"{cap} (notify_dispatch runs {cap} threads): use more nodes or the torch backend"
        )
    return True, f"{per_node} experts per node (internode limit {cap})"


def _low_latency_tokens(R: int, n: int) -> Capability:
    """Low-latency rules on ``num_max_dispatch_tokens_per_rank`` (``rules``)."""
    if (R * n) % 4:
        return False, (
            f"R * num_max_dispatch_tokens_per_rank = {R} * {n} is not a multiple of 4, which "
            f"DeepEP's low-latency TMA copies require: round num_max_dispatch_tokens_per_rank up "
            f"to a multiple of 4"
        )
    depth, need = qp_depth(), 2 * (n + 1)
    if depth < need:
        return False, (
            f"NVSHMEM_QP_DEPTH={depth} is below 2 * (num_max_dispatch_tokens_per_rank + 1) = "
            f"{need}, which DeepEP's low-latency kernels need (in-flight work requests): export "
            f"NVSHMEM_QP_DEPTH={max(need, 1024)} before the first DeepEP buffer is built"
        )
    return True, f"low-latency: {n} tokens per rank, NVSHMEM_QP_DEPTH={depth}"


def deepep_support_for(
    num_ranks: int,
    ranks_per_node: int,
    *,
    nccl_on_cuda: Capability,
    num_experts: int | None = None,
    num_worst_tokens: int = 0,
    mode: str = "normal",
    hidden_size: int | None = None,
    num_max_dispatch_tokens_per_rank: int | None = None,
    deep_ep: ModuleType | None = None,
) -> Capability:
    """Whether DeepEP can serve R ranks with L per node, without a process group.

    Checks, in order (``deepep_support_checks``): ``deep_ep`` imports; ``nccl_on_cuda`` (waived
    for the test emulator); E divides by R (when given); DeepEP supports the topology and the
    worst-case request; low-latency mode accepts the hidden size (when known).

    Args:
        num_ranks: R.
        ranks_per_node: L.
        nccl_on_cuda: ``(ok, reason)``: the group is NCCL on CUDA (``group_is_nccl_on_cuda``).
        num_experts: E, or None to skip that check.
        num_worst_tokens: W (0 = dropless).
        mode: ``"normal"`` or ``"low_latency"``.
        hidden_size: H, or None to skip the low-latency hidden-size check.
        deep_ep: the ``deep_ep`` module (the emulator in tests); None imports it.

    Returns:
        ``(ok, reason)``: the first failing check's reason, else ``"deep_ep usable (...)"``.
    """
    if deep_ep is None:
        deep_ep, why = load_deep_ep()
        if deep_ep is None:
            return False, why
    if is_emulator(deep_ep):
        nccl_on_cuda = (True, "the test emulator runs on any process group")
    checks = deepep_support_checks(
        num_ranks,
        ranks_per_node,
        imported=(True, "deep_ep imports"),
        nccl_on_cuda=nccl_on_cuda,
        num_experts=num_experts,
        num_worst_tokens=num_worst_tokens,
        mode=mode,
        hidden_size=hidden_size,
        nvl_peers=nvl_peers(deep_ep),
        release=rules.release_of(deep_ep),
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
    )
    failed = next((why for _, ok, why in checks if not ok), None)
    if failed is not None:
        return False, failed
    topology = next(why for name, _, why in checks if name == "topology")
    return pcie_rule(deep_ep, num_ranks, f"deep_ep usable ({topology})")


def deepep_support(
    *,
    group: dist.ProcessGroup | None,
    num_experts: int,
    ranks_per_node: int,
    num_worst_tokens: int = 0,
    mode: str = "normal",
    hidden_size: int | None = None,
    num_max_dispatch_tokens_per_rank: int | None = None,
    deep_ep: ModuleType | None = None,
) -> Capability:
    """Whether the ``deepep`` backend can serve this group here (a local answer; no collective).

    ``deepep_support_for`` with R = the group's size and the group's NCCL-on-CUDA answer.
    """
    return deepep_support_for(
        group_size(group),
        ranks_per_node,
        nccl_on_cuda=group_is_nccl_on_cuda(group),
        num_experts=num_experts,
        num_worst_tokens=num_worst_tokens,
        mode=mode,
        hidden_size=hidden_size,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        deep_ep=deep_ep,
    )
