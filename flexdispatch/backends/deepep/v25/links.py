"""DeepEP 2.5's link probes (NVLink and RDMA bandwidth, fast RDMA atomics), made safe to use.

R ranks · E experts · k top-k.

DeepEP 2.5 sizes its kernels from host probes (``deep_ep_v25/utils/envs.py``):
``get_nvlink_gbs`` parses ``nvidia-smi nvlink -s`` and ``get_rdma_gbs`` / ``check_fast_rdma_atomic_
support`` parse ``ibstat`` for the CA ``mlx5_0``. Each answers 0 (False) when its tool is missing,
fails or names another NIC — common in slim containers. ``EPBuffer.get_theoretical_num_sms``
then divides by the 0 in hybrid mode (``ZeroDivisionError``, buffers/ep.py:512) or, inside a node,
settles on its floor of 4 SMs (buffers/ep.py:519-530), and ``num_allocated_qps`` follows the
atomics probe (65 or 129 in hybrid mode, buffers/ep.py:328-335) on each host alone.

So the adapter runs DeepEP's own probes once per buffer, replaces a failed one by a
documented default, agrees the values across ranks — the smallest *measured* bandwidth (a failure
never wins), fast atomics only where every rank has them — and passes them to
``get_theoretical_num_sms`` and the ``EPBuffer`` constructor explicitly. ``deepep_num_sms`` skips
the model altogether.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch.distributed import collective_device, collective_guard, is_distributed

__all__ = [
    "NVLINK_GBS_DEFAULT",
    "QPS_DIRECT",
    "QPS_HYBRID",
    "QPS_HYBRID_FAST_ATOMICS",
    "RDMA_GBS_DEFAULT",
    "Links",
    "agree_links",
    "choose_links",
    "probe_links",
]

NVLINK_GBS_DEFAULT = 430.0
"""NVLink GB/s when ``nvidia-smi`` cannot say: an H100 / H200 SXM (18 NVLink-4 links of 26.6
GB/s) times DeepEP's efficiency factor 0.9 (``get_nvlink_gbs(factor=0.9)``)."""
RDMA_GBS_DEFAULT = 50.0
"""RDMA GB/s when ``ibstat`` cannot say: one 400 Gb/s NIC per GPU (ConnectX-7), DeepEP's
``rate / 8``."""
QPS_DIRECT = 17  # buffers/ep.py:334
QPS_HYBRID = 129  # buffers/ep.py:333, without fast RDMA atomics
QPS_HYBRID_FAST_ATOMICS = 65  # buffers/ep.py:333, MT4131 NICs


@dataclass(frozen=True)
class Links:
    """What the probes said and what the adapter uses.

    Attributes:
        nvlink_gbs, rdma_gbs: the bandwidths passed to ``get_theoretical_num_sms`` (GB/s).
        nvlink_probed, rdma_probed: the (agreed) measurement, 0 where every probe failed or
            none ran.
        fast_atomics: every rank's NIC has fast RDMA atomics (hybrid mode's 65 QPs).
        num_allocated_qps: the QPs every rank allocates (``EPBuffer(num_allocated_qps=...)``).
        detail: one line for ``doctor`` and the reasons.
    """

    nvlink_gbs: float
    rdma_gbs: float
    nvlink_probed: float
    rdma_probed: float
    fast_atomics: bool
    num_allocated_qps: int
    detail: str


def probe_links(module: ModuleType, *, rdma: bool) -> tuple[float, float, bool]:
    """DeepEP 2.5's own probes as its ``EPBuffer`` sees them (the names its ``buffers/ep.py``
    calls): ``(nvlink GB/s, RDMA GB/s, fast atomics)``, 0 / False for a failure; the RDMA ones
    only with ``rdma`` (more than one RDMA rank, as DeepEP probes them). Never raises."""
    # NOTE: the namespace of deep_ep_v25/buffers/ep.py, where EPBuffer looks the probes up
    names: dict[str, Any] = getattr(inspect.unwrap(module.EPBuffer.__init__), "__globals__", {})

    def call(name: str, default: Any) -> Any:
        fn = names.get(name)
        if fn is None:
            return default
        try:
            return fn()
        except Exception:  # a probe must not break a dispatch
            return default

    nvl = float(call("get_nvlink_gbs", 0.0) or 0.0)
    if not rdma:
        return nvl, 0.0, False
    return (
        nvl,
        float(call("get_rdma_gbs", 0.0) or 0.0),
        bool(call("check_fast_rdma_atomic_support", False)),
    )


def choose_links(
    nvlink_probed: float, rdma_probed: float, fast_atomics: bool, *, hybrid: bool, rdma: bool
) -> Links:
    """The values to use from (agreed) probe results: a failed probe (0, or not finite) takes its
    documented default (``NVLINK_GBS_DEFAULT``, ``RDMA_GBS_DEFAULT``)."""

    def ok(v: float) -> bool:
        return math.isfinite(v) and v > 0

    nvl = nvlink_probed if ok(nvlink_probed) else NVLINK_GBS_DEFAULT
    rd = rdma_probed if ok(rdma_probed) else RDMA_GBS_DEFAULT
    qps = (QPS_HYBRID_FAST_ATOMICS if fast_atomics else QPS_HYBRID) if hybrid else QPS_DIRECT
    parts = [
        f"NVLink {nvl:g} GB/s ("
        + ("nvidia-smi nvlink -s" if ok(nvlink_probed) else "default: nvidia-smi gave nothing")
        + ")"
    ]
    if rdma:
        parts.append(
            f"RDMA {rd:g} GB/s ("
            + ("ibstat mlx5_0" if ok(rdma_probed) else "default: ibstat gave nothing")
            + ")"
        )
    parts.append(f"{qps} QPs" + (" (fast RDMA atomics)" if hybrid and fast_atomics else ""))
    return Links(
        nvlink_gbs=nvl,
        rdma_gbs=rd,
        nvlink_probed=nvlink_probed if ok(nvlink_probed) else 0.0,
        rdma_probed=rdma_probed if ok(rdma_probed) else 0.0,
        fast_atomics=fast_atomics,
        num_allocated_qps=qps,
        detail="; ".join(parts),
    )


def agree_links(module: ModuleType, group: Any, *, hybrid: bool, rdma: bool) -> Links:
    """Probe here, agree over ``group`` (one MIN all-reduce: the smallest measured bandwidth, a
    failure counted as none; fast atomics only if every rank has them), choose."""
    nvl, rd, atomics = probe_links(module, rdma=rdma)
    if is_distributed(group):
        big = float("inf")
        t = torch.tensor(
            [nvl if nvl > 0 else big, rd if rd > 0 else big, 1.0 if atomics else 0.0],
            dtype=torch.float64,
            device=collective_device(group),
        )
        with collective_guard("all_reduce (DeepEP 2.5 link probes)", group):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        nvl, rd, a = t.tolist()
        atomics = a > 0
    return choose_links(nvl, rd, atomics, hybrid=hybrid, rdma=rdma)
