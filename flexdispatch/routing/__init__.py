"""Routing: top-k and hash routing (pure functions), ``TopKRouter`` and the router losses.

Shape letters: T tokens on this rank · H hidden · E experts in total · R ranks · e = E/R local
experts · k top-k · L ranks per node · N nodes · M received rows · W worst-case rows.
"""

from __future__ import annotations

from flexdispatch.routing.dense import routing_map_to_topk
from flexdispatch.routing.hash import hash_routing
from flexdispatch.routing.losses import (
    AuxLossAutoScaler,
    aux_loss_scores,
    count_tokens_per_expert,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from flexdispatch.routing.router import TopKRouter, gating_linear
from flexdispatch.routing.topk import expert_capacity, topk_routing

__all__ = [
    "topk_routing",
    "hash_routing",
    "routing_map_to_topk",
    "expert_capacity",
    "TopKRouter",
    "gating_linear",
    "AuxLossAutoScaler",
    "aux_loss_scores",
    "count_tokens_per_expert",
    "switch_aux_loss",
    "seq_aux_loss",
    "global_aux_loss",
    "z_loss",
]
