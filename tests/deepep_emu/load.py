"""``load_deep_ep``: DeepEP's own Python layer over the emulated runtime. TEST-ONLY.

The ``sgl-deep-ep`` wheel (DeepEP 2.1.0, installed by ``scripts/setup.sh`` with ``--no-deps``)
ships DeepEP's Python files: ``deep_ep/buffers/legacy.py`` (the V1 ``Buffer``),
``deep_ep/utils/{event,envs,comm}.py``. Its ``deep_ep/__init__.py`` checks for CUDA and NCCL and
cannot run here, so this loader assembles the package itself:

1. a ``deep_ep`` package object whose ``__path__`` is the installed ``deep_ep`` directory (its
   ``__init__`` is never executed), with the emulated runtime registered as ``deep_ep._C``
   (``runtime.module.make_runtime_module``);
2. ``deep_ep.buffers.legacy`` and the ``deep_ep.utils`` modules it imports are executed from the
   wheel's files, unchanged;
3. the names the package's ``__init__`` would export are set on the package (``Buffer``,
   ``EventOverlap``, ``EventHandle``, ``Config``, ``topk_idx_t``, ``__version__``), plus
   ``IS_EMULATOR``, ``EMULATED_RELEASE`` and ``num_max_nvl_peers()`` for the adapter's support
   check;
4. the ``deep_ep*`` entries are removed from ``sys.modules`` again (the loaded modules keep
   their references), so ``import deep_ep`` elsewhere still fails as on a machine without it.

One patch, applied only to the loaded ``legacy`` module: ``check_nvlink_connections(group)``
(which calls ``torch.cuda.get_device_name``, raising on a CPU build) is replaced by a function
that keeps DeepEP's PCIe rule (utils/envs.py:155-156; v1.2.1 utils.py:76-77: when the emulated
device's name, ``emu_device_name``, default an SXM H100, contains ``PCIE``, a group of more than 2
ranks fails its ``assert``; the NVML pair check after it is not emulated) and records ``group``
for the emulated ``_C.Buffer`` that ``Buffer.__init__`` builds next — the compiled runtime gets
only ``rank`` and ``num_ranks``, and the emulation needs the group to move rows over gloo.

Release ``"2.1.0"`` also loads DeepEP V2, ``deep_ep/buffers/elastic.py`` (with the
``deep_ep.utils`` modules it imports: ``comm``, ``math``, ``semantic``), unchanged, and exports
``ElasticBuffer``, ``EPHandle``, ``get_physical_domain_size`` and ``get_logical_domain_size``
(over ``runtime.elastic``; release ``"1.2.1"`` has no V2 and exports none of them), and
``emu_nccl``, the emulated NCCL the adapter asks (``runtime.nccl.FakeLibNccl``). The NCCL
communicator needs no patch: on a gloo group ``utils/comm.py`` takes its fallback (one
``all_gather_object`` of ``_C.get_local_nccl_unique_id()``, then ``_C.create_nccl_comm``).
Patches, applied only to the loaded ``elastic`` module's namespace:

- ``check_nvlink_connections(group)``: the PCIe rule and the record, as for ``legacy``
  (elastic.py:320 calls it just before ``_C.ElasticBuffer``);
- ``torch``: a proxy module that forwards every name to ``torch`` except ``cuda``, whose
  ``synchronize`` is a no-op (``ElasticBuffer.__init__`` calls it around its barrier,
  elastic.py:365-367) and whose ``get_device_properties`` describes the emulated device
  (132 SMs, 80 GiB: ``get_theoretical_num_sms``, elastic.py:816); other ``torch.cuda`` names are
  the real ones;
- ``get_nvlink_gbs`` / ``get_rdma_gbs`` / ``check_fast_rdma_atomic_support``: constants (450 GB/s,
  50 GB/s, False) instead of running ``nvidia-smi`` / ``ibstat``.

While the wheel's files execute, ``torch.compile`` is an identity decorator (``load_v25.
eager_torch_compile``): ``utils/math.py`` decorates two fp8 cast helpers, unused here, with it.

Release ``"2.5.0"`` is DeepEP V2.5 from its own wheel (``sgl-deep-ep-v25``, package
``deep_ep_v25``: ``EPBuffer``, no ``Buffer`` / ``ElasticBuffer``), assembled by ``load_v25.py``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any

import torch

from tests.deepep_emu.runtime import memory
from tests.deepep_emu.runtime.module import make_runtime_module

__all__ = ["emulator_or_skip", "load_deep_ep", "wheel_dir", "WHEEL"]

WHEEL = "sgl-deep-ep==0.1.2.post1"
_CACHE: dict[tuple[int, str], types.ModuleType] = {}


def wheel_dir() -> Path:
    """The installed wheel's ``deep_ep`` directory (raises ``ModuleNotFoundError`` if absent)."""
    try:
        dist = importlib.metadata.distribution("sgl-deep-ep")
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            f"{WHEEL} is not installed: run scripts/setup.sh (pip install --no-deps {WHEEL})"
        ) from None
    path = Path(str(dist.locate_file("deep_ep")))
    if not (path / "buffers" / "legacy.py").is_file():
        raise ModuleNotFoundError(f"{path} has no buffers/legacy.py: is {WHEEL} installed whole?")
    return path


def _torch_proxy() -> types.ModuleType:
    """``torch`` for the loaded ``elastic`` module: ``cuda.synchronize`` is a no-op and
    ``cuda.get_device_properties`` describes the emulated device; everything else is torch's."""
    from tests.deepep_emu.runtime.elastic import DEVICE_SMS

    props = types.SimpleNamespace(
        name="emulated NVIDIA H800",
        multi_processor_count=DEVICE_SMS,
        total_memory=80 * 1024**3,
    )

    class _Cuda(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cuda, name)

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    cuda = _Cuda("torch.cuda (emulated device)")
    cuda.synchronize = lambda *a, **kw: None
    cuda.get_device_properties = lambda *a, **kw: props
    proxy = _Torch("torch (emulated device)")
    proxy.cuda = cuda
    return proxy


def emulator_or_skip(nvl_peers: int = 8, release: str = "2.1.0") -> types.ModuleType:
    """``load_deep_ep(nvl_peers, release)``, or skip the calling test (or, at import, its module)
    with the reason when the wheel's files are not installed (e.g. a GPU machine without them:
    ``scripts/gpu_check.sh --wheels DIR`` installs them)."""
    import pytest

    try:
        return load_deep_ep(nvl_peers, release)
    except ModuleNotFoundError as exc:
        pytest.skip(f"DeepEP emulator unavailable: {exc}", allow_module_level=True)


def load_deep_ep(nvl_peers: int = 8, release: str = "2.1.0") -> types.ModuleType:
    """The assembled ``deep_ep`` package (cached per ``(nvl_peers, release)``).

    Args:
        nvl_peers: ranks of one emulated NVLink domain (8 as in DeepEP; tests use 2 so that 4
            ranks make 2 nodes).
        release: whose kernel limits the runtime enforces: ``"1.2.1"`` or ``"2.1.0"`` (the
            ``deep_ep`` package), or ``"2.5.0"`` (the ``deep_ep_v25`` package, ``load_v25``).
    """
    if release == "2.5.0":
        from tests.deepep_emu.load_v25 import load_v25

        return load_v25(nvl_peers)
    key = (nvl_peers, release)
    if key in _CACHE:
        return _CACHE[key]
    root = wheel_dir()
    runtime = make_runtime_module(release, nvl_peers)
    saved = {n: m for n, m in sys.modules.items() if n == "deep_ep" or n.startswith("deep_ep.")}
    for n in saved:
        del sys.modules[n]
    pkg = types.ModuleType("deep_ep")
    pkg.__path__ = [str(root)]
    pkg.__package__ = "deep_ep"
    sys.modules["deep_ep"] = pkg
    sys.modules["deep_ep._C"] = runtime
    pkg._C = runtime
    elastic = envs = None
    from tests.deepep_emu.load_v25 import eager_torch_compile

    # NOTE: utils/math.py decorates two unused fp8 helpers with torch.compile: importing
    # TorchDynamo for them cost ~3-6 s per process (load_v25.eager_torch_compile)
    try:
        with eager_torch_compile():
            legacy = importlib.import_module("deep_ep.buffers.legacy")
            event = importlib.import_module("deep_ep.utils.event")
            if release == "2.1.0":
                elastic = importlib.import_module("deep_ep.buffers.elastic")
                envs = importlib.import_module("deep_ep.utils.envs")
    finally:
        for n in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
            del sys.modules[n]
        sys.modules.update(saved)

    def check_nvlink_connections(group: Any) -> None:
        if "PCIE" in pkg.emu_device_name:  # utils/envs.py:155-156 (v1.2.1 utils.py:76-77)
            assert group.size() <= 2, "PCIe GPUs only have pairwise NVLink connections"
        runtime.pending_group = group

    legacy.check_nvlink_connections = check_nvlink_connections
    pkg.Buffer = legacy.Buffer
    pkg.EventOverlap = event.EventOverlap
    pkg.EventHandle = runtime.EventHandle
    pkg.Config = runtime.Config
    pkg.topk_idx_t = runtime.topk_idx_t
    pkg.__version__ = "2.1.0"
    pkg.legacy = legacy
    pkg.runtime = runtime
    pkg.IS_EMULATOR = True
    pkg.EMULATED_RELEASE = release
    pkg.NUM_MAX_NVL_PEERS = nvl_peers
    pkg.num_max_nvl_peers = lambda: nvl_peers
    pkg.emu_device_name = "NVIDIA H100 80GB HBM3"
    pkg.emu_device_memory = None  # unlimited (runtime/memory.py)
    pkg.emu_empty_cache = lambda: memory.empty_cache(pkg)
    runtime.emu_package = pkg
    if elastic is not None and envs is not None:
        elastic.check_nvlink_connections = check_nvlink_connections
        elastic.torch = _torch_proxy()
        elastic.get_nvlink_gbs = lambda *a, **kw: 450.0
        elastic.get_rdma_gbs = lambda *a, **kw: 50.0
        elastic.check_fast_rdma_atomic_support = lambda *a, **kw: False
        pkg.ElasticBuffer = elastic.ElasticBuffer
        pkg.EPHandle = elastic.EPHandle
        pkg.get_physical_domain_size = envs.get_physical_domain_size
        pkg.get_logical_domain_size = envs.get_logical_domain_size
        pkg.elastic = elastic
        pkg.emu_nccl = runtime.emu_nccl
    _CACHE[key] = pkg
    return pkg
