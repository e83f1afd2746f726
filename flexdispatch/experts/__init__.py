"""Grouped experts: the MLPs of the experts this rank holds, run over expert-major rows.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · F expert hidden
(``ffn_hidden_size``) · E experts in total · R ranks · e = E / R local experts · k top-k ·
M rows received by this rank. ``N`` here is the number of rows fed to the experts (the rows of a
``Permutation``), not the node count.

Two interchangeable paths compute the same thing:

- ``torch._grouped_mm`` (one call per weight for all experts, no host sync; segment ends are the
  int32 cumulative sum of ``tokens_per_expert``), used where the dtype, device and strides allow;
- a per-expert loop of plain matmuls, which needs the segment sizes on the host: exactly one
  ``tokens_per_expert.tolist()`` per forward (a device-to-host sync on an accelerator).

Weights are a pure function of a seed and the *global* expert id (``init_expert_weights``), so a
rank holding experts ``[r*e, (r+1)*e)`` and a single-process reference holding all E experts get
bit-identical weights.
"""

from __future__ import annotations

from flexdispatch.experts.activations import ACTIVATIONS, GATED_ACTIVATIONS, apply_activation
from flexdispatch.experts.grouped import GroupedExperts
from flexdispatch.experts.grouped_mm import GroupedMMSupport, grouped_mm_support
from flexdispatch.experts.init import ExpertWeights, expert_seed, init_expert_weights
from flexdispatch.experts.shared import SharedExperts

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "SharedExperts",
    "apply_activation",
    "ExpertWeights",
    "GroupedExperts",
    "GroupedMMSupport",
    "expert_seed",
    "grouped_mm_support",
    "init_expert_weights",
]
