"""``load_deep_ep(release="2.5.0")``: DeepEP V2.5's own Python layer over the emulated runtime.

TEST-ONLY. SGLang's wheel ``sgl-deep-ep-v25==0.1.0rc0`` (installed ``--no-deps`` by
``scripts/setup.sh``) ships the package ``deep_ep_v25``: ``buffers/ep.py`` (``EPBuffer``,
``EPHandle``), ``comm/``, ``utils/`` and DeepEP 2.5's C++/CUDA source. Its ``__init__`` checks the
host (a CUDA 13 torch, a driver, nvcc >= 13.1, NCCL >= 2.32.3 headers, one NCCL library loaded)
and initialises the JIT, so, like ``load.py`` for the 2.1.0 wheel, this loader assembles the
package itself:

1. a ``deep_ep_v25`` package object whose ``__path__`` is the installed folder (its ``__init__``
   never runs), with the emulated runtime (``runtime.ep.make_ep_runtime_module``) as
   ``deep_ep_v25._C``;
2. ``deep_ep_v25.buffers.ep`` and what it imports (``buffers/{allocator,base}.py``, ``comm/``,
   ``utils/{event,envs,math,semantic}.py``) are executed from the wheel's files, unchanged;
3. the names ``__init__`` would export are set on the package (``EPBuffer``, ``EPHandle``,
   ``EventOverlap``, ``EventHandle``, ``topk_idx_t``, ``get_num_*_alignment``,
   ``get_physical_domain_size``, ``get_logical_domain_size``, ``__version__ = "2.5.0"``), plus
   ``IS_EMULATOR``, ``EMULATED_RELEASE``, ``num_max_nvl_peers()``, ``runtime`` (the emulated
   ``_C``: ``runtime.emu_capture()``, ``runtime.emu_jit_compiles``) for the tests;
4. the ``deep_ep_v25*`` entries leave ``sys.modules`` again, so ``import deep_ep_v25`` elsewhere
   fails as on a machine without it.

Patches, only in the loaded ``buffers/ep.py`` namespace (what a CPU build cannot run):

- ``check_nvlink_connections(group)`` records ``group`` for the emulated ``_C.EPBuffer`` that
  ``EPBuffer.__init__`` builds next (ep.py:325; the runtime gets only the NCCL handle, the
  emulation needs the gloo group); the NCCL communicator itself takes ``comm/handle.py``'s
  fallback on a gloo group (``all_gather_object`` of ``_C.get_local_nccl_unique_id()``, then
  ``_C.create_nccl_comm``), unpatched;
- ``torch``: ``load._torch_proxy()`` (``cuda.synchronize`` a no-op around ``__init__``'s barrier,
  ep.py:367-369; ``cuda.get_device_properties`` the emulated device, ``get_theoretical_num_sms``,
  ep.py:563);
- ``get_nvlink_gbs`` / ``get_rdma_gbs`` / ``check_fast_rdma_atomic_support``: what the package's
  ``emu_probes`` dict says (``nvlink_gbs``, ``rdma_gbs``, ``fast_atomics``), read at each call,
  instead of running ``nvidia-smi`` / ``ibstat``. By default they fail as the real ones do without
  those tools (a slim container, this CPU machine): 0, 0 and False (deep_ep_v25/utils/envs.py:
  230-234, 279-283), so the adapter must survive a failed probe (audit-4 EV2); a test sets
  working values.
- ``check_nvlink_connections(group)`` also keeps DeepEP's PCIe rule (utils/envs.py:157): when the
  emulated device's name (``emu_device_name``, default an SXM H100) contains ``PCIE``, a group of
  more than 2 ranks fails its ``assert`` (the NVML pair check after it is not emulated).

And while the wheel's files execute, ``torch.compile`` is an identity decorator
(``eager_torch_compile``): ``utils/math.py`` decorates two fp8 cast helpers (unused by
``EPBuffer``) with it, and importing TorchDynamo / Inductor for them costs seconds per process.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from tests.deepep_emu.runtime import memory
from tests.deepep_emu.runtime.ep import make_ep_runtime_module
from tests.deepep_emu.runtime.ep_limits import WHEEL, wheel_root

__all__ = ["WHEEL", "eager_torch_compile", "load_v25"]

_CACHE: dict[int, types.ModuleType] = {}
_NAME = "deep_ep_v25"


@contextlib.contextmanager
def eager_torch_compile() -> Iterator[None]:
    """Within the block, ``@torch.compile(...)`` returns the function unchanged (no TorchDynamo
    import); the real ``torch.compile`` is restored after."""
    real = torch.compile

    def eager(fn: Any = None, **kw: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    torch.compile = eager  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real  # type: ignore[assignment]


def load_v25(nvl_peers: int = 8) -> types.ModuleType:
    """The assembled ``deep_ep_v25`` package over the emulated runtime (cached per domain)."""
    if nvl_peers in _CACHE:
        return _CACHE[nvl_peers]
    from tests.deepep_emu.load import _torch_proxy

    root = wheel_root()
    runtime = make_ep_runtime_module(nvl_peers)
    saved = {n: m for n, m in sys.modules.items() if n == _NAME or n.startswith(_NAME + ".")}
    for n in saved:
        del sys.modules[n]
    pkg = types.ModuleType(_NAME)
    pkg.__path__ = [str(root)]
    pkg.__package__ = _NAME
    sys.modules[_NAME] = pkg
    sys.modules[_NAME + "._C"] = runtime
    pkg._C = runtime
    try:
        with eager_torch_compile():
            ep = importlib.import_module(_NAME + ".buffers.ep")
            event = importlib.import_module(_NAME + ".utils.event")
            comm = importlib.import_module(_NAME + ".comm")
    finally:
        for n in [n for n in sys.modules if n == _NAME or n.startswith(_NAME + ".")]:
            del sys.modules[n]
        sys.modules.update(saved)

    def check_nvlink_connections(group: Any) -> None:
        if "PCIE" in pkg.emu_device_name:  # utils/envs.py:156-157
            assert group.size() <= 2, "PCIe GPUs only have pairwise NVLink connections"
        runtime.pending_group = group

    pkg.emu_device_name = "NVIDIA H100 80GB HBM3"
    pkg.emu_nccl = runtime.emu_nccl
    pkg.emu_device_memory = None  # unlimited (runtime/memory.py)
    pkg.emu_empty_cache = lambda: memory.empty_cache(pkg)
    runtime.emu_package = pkg
    pkg.emu_probes = {"nvlink_gbs": 0.0, "rdma_gbs": 0.0, "fast_atomics": False}
    ep.check_nvlink_connections = check_nvlink_connections
    ep.torch = _torch_proxy()
    ep.get_nvlink_gbs = lambda *a, **kw: float(pkg.emu_probes["nvlink_gbs"])
    ep.get_rdma_gbs = lambda *a, **kw: float(pkg.emu_probes["rdma_gbs"])
    ep.check_fast_rdma_atomic_support = lambda *a, **kw: bool(pkg.emu_probes["fast_atomics"])
    pkg.EPBuffer = ep.EPBuffer
    pkg.EPHandle = ep.EPHandle
    pkg.EventOverlap = event.EventOverlap
    pkg.EventHandle = runtime.EventHandle
    pkg.topk_idx_t = runtime.topk_idx_t
    pkg.get_num_allocation_alignment = runtime.get_num_allocation_alignment
    pkg.get_num_tma_alignment = runtime.get_num_tma_alignment
    pkg.get_num_rdma_alignment = runtime.get_num_rdma_alignment
    pkg.get_physical_domain_size = comm.get_physical_domain_size
    pkg.get_logical_domain_size = comm.get_logical_domain_size
    pkg.destroy_all_managed_nccl_comm = comm.destroy_all_managed_nccl_comm
    pkg.__version__ = "2.5.0"
    pkg.ep = ep
    pkg.runtime = runtime
    pkg.IS_EMULATOR = True
    pkg.EMULATED_RELEASE = "2.5.0"
    pkg.NUM_MAX_NVL_PEERS = nvl_peers
    pkg.num_max_nvl_peers = lambda: nvl_peers
    _CACHE[nvl_peers] = pkg
    return pkg
