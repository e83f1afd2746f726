"""The emulated device's memory as DeepEP's allocators see it. TEST-ONLY.

DeepEP allocates its buffers outside PyTorch's caching allocator: V2 / V2.5 with ``ncclMemAlloc``
/ ``cuMemCreate`` (deep_ep_v25/csrc/kernels/comm/symmetric.hpp:78-127), then the collective window
registration (context.cpp:185-199); V1 with ``cudaMalloc`` (v1.2.1 csrc/deep_ep.cpp:49, 62) and
NVSHMEM. None of them can use blocks PyTorch's cache holds: they get the driver's free memory
only. A rank whose allocation fails raises inside DeepEP's collective constructor while its peers
wait in the collective step after it (here: a gloo barrier, until the group's timeout).

A package's ``emu_device_memory`` (None: unlimited) is ``{"free", "torch_reserved",
"torch_allocated"}`` (bytes) and optionally ``"fragmented"`` (PyTorch's cache cannot be returned):
``allocate`` takes a buffer from ``free`` (or raises DeepEP's CUDA error), ``release`` gives it
back, ``empty_cache`` is ``torch.cuda.empty_cache()`` (the unused cache returns to ``free``).
The runtime module reaches its package through ``emu_package`` (set by the loaders).
"""

from __future__ import annotations

from typing import Any

__all__ = ["allocate", "empty_cache", "release"]


def _memory(module: Any) -> dict[str, Any] | None:
    return getattr(getattr(module, "emu_package", None), "emu_device_memory", None)


def allocate(module: Any, nbytes: int, how: str) -> None:
    """Take ``nbytes`` for a DeepEP buffer (``how``: ``"ncclMemAlloc"``, ``"cudaMalloc"``)."""
    mem = _memory(module)
    if mem is None:
        return
    if nbytes > mem["free"]:
        raise RuntimeError(
            f"Failed: CUDA error: out of memory ({how} of {nbytes} bytes, {mem['free']} free on "
            f"the emulated device; PyTorch's cache of "
            f"{mem['torch_reserved'] - mem['torch_allocated']} bytes is not the driver's)"
        )
    mem["free"] -= nbytes


def release(module: Any, nbytes: int) -> None:
    mem = _memory(module)
    if mem is not None:
        mem["free"] += nbytes


def empty_cache(package: Any) -> None:
    """``torch.cuda.empty_cache()`` on the emulated device."""
    mem = getattr(package, "emu_device_memory", None)
    if mem is None or mem.get("fragmented"):
        return
    mem["free"] += mem["torch_reserved"] - mem["torch_allocated"]
    mem["torch_reserved"] = mem["torch_allocated"]
