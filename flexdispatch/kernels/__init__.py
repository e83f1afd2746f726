"""Fused Triton kernels for routing and permutation, and the ``impl`` switch that picks them;
the dispatcher's two kernels.

Shape letters: T tokens · H hidden · E experts · k top-k · N rows of a permutation · P = T*k
(token, slot) pairs.

``topk_routing``, ``permute`` and ``unpermute`` take ``impl="auto" | "torch" | "triton"``:

- ``"torch"``: the torch implementation (every device).
- ``"triton"``: the kernels of this package. On CUDA tensors they are compiled; on CPU tensors
  they run under Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment
  (that is how the tests run them without a GPU). Missing Triton, or a CPU tensor without
  ``TRITON_INTERPRET=1``, is a ``ValueError`` that says so.
- ``"auto"`` (the default): ``"triton"`` on CUDA tensors when ``triton`` imports, ``"torch"``
  otherwise, so nothing changes on CPU.

Two more kernels serve the dispatcher's hot path on CUDA and have no switch: they run whenever
the tensors are on CUDA and ``triton`` imports, else their torch ops do the same work
(``screen``: the deferred value checks of a dispatch in one launch; ``inband``: the send rows of
a flat worst-case dispatch in one launch).

``triton`` is imported lazily, on the first call that may use it, and any failure to import it is
kept as a reason (``triton_status()``), never raised by ``import flexdispatch``.
"""

from __future__ import annotations

from flexdispatch.kernels._triton import (
    IMPLS,
    interpreting,
    resolve_impl,
    triton_status,
)

__all__ = ["IMPLS", "interpreting", "resolve_impl", "triton_status"]
