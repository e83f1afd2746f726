"""What this machine gives ``flexdispatch demo``: the ranks' devices and the resident memory of
one process before its tensors.

Devices (``spawned_topology``, ``launcher_devices``): see ``flexdispatch.launch.devices``. Spawned
here, without ``--nodes``/``--ranks-per-node``: one rank per GPU on a GPU machine, 2 x 2 over
gloo on the CPU; more ranks than GPUs is refused before anything starts.

Runtime memory (``measure_runtime``):

A CPU build of torch 2.13 holds about 250 MiB once imported; a CUDA build loads its CUDA
libraries at ``import torch`` and holds about 690 MB (torch 2.11+cu130 on an H200 machine),
before any CUDA context. No constant bounds both, so ``flexdispatch demo`` measures it: a probe
process imports what a rank imports (torch, ``torch.distributed``, flexdispatch's layer), joins
a one-rank gloo group, runs a small ``MoELayer`` forward and backward (on a GPU when the ranks
use one) and reports its peak resident size (``VmHWM``). The demo sizes every process with
``runtime_allowance(measured)`` = measured x ``HEADROOM`` + ``SLACK``.

Where nothing can be measured (no ``/proc``, the probe fails or times out), the fixed
``FALLBACK_BYTES`` is used and the reason is said. ``$FLEXDISPATCH_RUNTIME_BYTES`` (a size)
replaces the measurement.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from collections.abc import Callable

__all__ = [
    "FALLBACK_BYTES",
    "HEADROOM",
    "RUNTIME_ENV",
    "SLACK",
    "launcher_devices",
    "measure_runtime",
    "runtime_allowance",
    "spawned_topology",
]

MiB = 1 << 20
FALLBACK_BYTES = 800 * MiB
"""Used when the probe cannot measure (above the ~690 MB of a CUDA build of torch)."""
HEADROOM = 1.25
SLACK = 32 * MiB
RUNTIME_ENV = "FLEXDISPATCH_RUNTIME_BYTES"
PROBE_TIMEOUT_S = 120.0

# NOTE: what a rank holds before its own tensors: the imports, a process group, the autograd
# engine and the kernels a small layer step loads (oneDNN, or the CUDA context and cuBLAS).
_PROBE = r"""
import os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from flexdispatch.config import load_config
from flexdispatch.moe import MoELayer
import flexdispatch.cli.demo  # noqa: F401  (what a spawned rank unpickles)
dev = torch.device(sys.argv[1])
if dev.type == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    cfg = load_config("tiny_cpu")
    layer = MoELayer(cfg, seed=0, device=dev)
    x = torch.randn(16, cfg.hidden_size, device=dev, requires_grad=True)
    layer(x).output.sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
finally:
    dist.destroy_process_group()
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM:"):
            print("VMHWM", int(line.split()[1]) * 1024)
"""


def runtime_allowance(measured: int) -> int:
    """What the estimate counts per process for a measured runtime (an upper bound of it)."""
    return int(measured * HEADROOM) + SLACK


def measure_runtime(
    device_type: str = "cpu", progress: Callable[[str], None] | None = None
) -> tuple[int, int | None, str]:
    """(allowance in bytes, measured bytes or None, where it comes from) for a demo process whose
    ranks run on ``device_type`` (``cpu``: the probe sees no GPU, as gloo ranks; ``cuda``: it
    runs its step on ``cuda:0``). Cached per device type for the life of this process;
    ``progress`` hears what is measured."""
    if progress is not None:
        progress(f"measuring the runtime of one process ({device_type})")
    got = _measure(device_type, os.environ.get(RUNTIME_ENV, "").strip())
    if progress is not None:
        progress(f"runtime per process: {got[2]}")
    return got


@functools.lru_cache(maxsize=4)
def _measure(device_type: str, env_value: str) -> tuple[int, int | None, str]:
    # NOTE: $FLEXDISPATCH_RUNTIME_BYTES is part of the key: a value set once is not kept after it
    # is unset (a test that set it used to decide every later demo's runtime in its process)
    if env_value:
        from flexdispatch.cli.demo_fit import parse_size

        size = parse_size(env_value, f"${RUNTIME_ENV}")
        return size, None, f"${RUNTIME_ENV}"
    if not os.path.exists("/proc/self/status"):
        return FALLBACK_BYTES, None, "fixed allowance (no /proc on this system to measure)"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if device_type != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, device_type],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return FALLBACK_BYTES, None, f"fixed allowance (the probe failed: {exc})"
    for line in proc.stdout.splitlines():
        if line.startswith("VMHWM "):
            measured = int(line.split()[1])
            return (
                runtime_allowance(measured),
                measured,
                f"measured {measured / MiB:.0f} MiB in a probe process ({device_type}), "
                f"x{HEADROOM:g} + {SLACK // MiB} MiB",
            )
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return FALLBACK_BYTES, None, f"fixed allowance (the probe failed: {last[:200]})"


# --------------------------------------------------------------------------- devices

_CPU_HINT = "--cpu (or FLEXDISPATCH_DEVICE=cpu)"


def _gpu_topology(gpus: int, num_experts: int) -> tuple[int, int]:
    """(nodes, ranks per node) for one rank per GPU: the most GPUs whose count divides E, as 2
    simulated nodes when that count is even and >= 4 (so the hierarchical mode has 2 nodes)."""
    R = max(r for r in range(1, gpus + 1) if num_experts % r == 0)
    return (2, R // 2) if R >= 4 and R % 2 == 0 else (1, R)


def spawned_topology(
    args: argparse.Namespace,
    num_experts: int,
    check_world: Callable[[int], None] | None = None,
):
    """(nodes, ranks per node, ``DevicePlan``) of a demo spawned on this machine.

    ``--nodes``/``--ranks-per-node`` as given; when neither is given, one rank per GPU on a GPU
    machine (``_gpu_topology``), 2 × 2 on the CPU. All R ranks run here, so R is compared with
    the GPUs visible (``flexdispatch.launch.devices.plan_devices``): more is refused, naming both.
    """
    from flexdispatch.launch.devices import plan_devices, requested_device, visible_gpus

    device = requested_device(getattr(args, "cpu", False))
    gpus, source = visible_gpus()
    nodes, per_node = args.nodes, args.ranks_per_node
    if nodes is None and per_node is None and device != "cpu" and gpus > 0:
        nodes, per_node = _gpu_topology(gpus, num_experts)
    nodes = 2 if nodes is None else nodes
    per_node = 2 if per_node is None else per_node
    if nodes < 1 or per_node < 1:
        raise ValueError(
            f"--nodes and --ranks-per-node must be >= 1, got --nodes {nodes} "
            f"--ranks-per-node {per_node}"
        )
    if check_world is not None:  # NOTE: what the preset refuses comes before what the GPUs do
        check_world(nodes * per_node)
    plan = plan_devices(
        nodes * per_node,
        device=device,
        gpus=gpus,
        gpus_source=source,
        ranks_hint="--nodes 1 --ranks-per-node {gpus} (or neither)",
        cpu_hint=_CPU_HINT,
    )
    return nodes, per_node, plan


def launcher_devices(args: argparse.Namespace, local_ranks: int):
    """The ``DevicePlan`` of this node's ``local_ranks`` torchrun ranks (refused, on every rank
    alike, before the process group exists when they outnumber the GPUs)."""
    from flexdispatch.launch.devices import plan_devices, requested_device

    return plan_devices(
        local_ranks,
        device=requested_device(getattr(args, "cpu", False)),
        ranks_hint="--nproc-per-node {gpus} (NPROC_PER_NODE={gpus} with scripts/launch/)",
        cpu_hint=_CPU_HINT,
    )
