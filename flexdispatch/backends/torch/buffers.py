"""Reusable row buffers of the ``torch`` backend: ``scratch`` for rows that never leave a call,
``output`` for rows handed to the caller.

On CPU, fresh buffers of more than 32 MiB are ``mmap``-ed by the C allocator and page-faulted on
every call, which costs about as much as gloo's transfer of the rows: both kinds are reused
(``scratch`` per key, ``output`` through ``_pool.OUTPUT_POOL`` once nothing refers to an earlier
output any more). On other devices the caching allocator already reuses memory: ``torch.empty``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flexdispatch._checks.tensors import cuda_code_path
from flexdispatch._pool import OUTPUT_POOL

__all__ = ["RowBuffers"]


class RowBuffers:
    """The buffers of one backend (mixed into ``TorchA2ABackend``)."""

    def __init__(self) -> None:
        self._scratch: dict[str, torch.Tensor] = {}
        self._scratch_views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._parts: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def scratch(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised ``shape`` buffer for rows that never leave the current call.

        On CPU the bytes are kept per ``key`` and reused by later calls: fresh buffers of more
        than 32 MiB are ``mmap``-ed by the C allocator and page-faulted on every call, which costs
        about as much as gloo's transfer of the rows; a repeated (key, shape, dtype) gets the same
        view object back (no view ops). On other devices (caching allocators) this is
        ``torch.empty``. Never return a scratch view to the caller. NOTE: the reuse makes one
        backend (one ``FlexDispatcher``) unsafe to call from two threads at once on CPU.

        Args:
            key: names the buffer; two buffers alive at the same time need different keys.
            shape: any shape; ``dtype``, ``device``: those of the result.
        """
        if device.type != "cpu" or cuda_code_path(device):
            return torch.empty(shape, dtype=dtype, device=device)
        view = self._scratch_views.get((key, shape, dtype))
        if view is not None:
            return view
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._scratch[key] = buf
            self._scratch_views.clear()  # NOTE: views of the old buffer must not be lent again
        elif len(self._scratch_views) >= 64:
            self._scratch_views.clear()
        view = buf[:nbytes].view(dtype).view(shape)
        self._scratch_views[(key, shape, dtype)] = view
        return view

    def output(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor handed to the caller (dispatch rows, combine sums).

        On CPU it comes from ``_pool.OUTPUT_POOL``, which lends the memory of an earlier
        output again once the caller has dropped every reference to it (no page faults); on other
        devices it is ``torch.empty`` (the caching allocator already reuses memory).
        """
        if device.type == "cpu" and not cuda_code_path(device):
            return OUTPUT_POOL.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    def parts(
        self,
        key: tuple,
        base: torch.Tensor,
        build: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...]:
        """``build(base)``: views of a ``scratch`` buffer, kept for the next call (CPU).

        ``scratch`` lends the same view object again for a repeated (key, shape, dtype), so the
        views of the last call are reused while ``base`` is that object; ``key`` must name
        everything ``build`` depends on besides ``base``. Elsewhere (a fresh buffer per call,
        which must not be kept alive) ``build`` runs every time.
        """
        if base.device.type != "cpu" or cuda_code_path(base.device):
            return build(base)
        got = self._parts.get(key)
        if got is None or got[0] is not base:
            if len(self._parts) >= 64:
                self._parts.clear()
            got = self._parts[key] = (base, build(base))
        return got[1]
