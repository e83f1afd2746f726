"""Routing: top-k and hash routing (pure functions), ``TopKRouter`` and the router losses.

Shape letters: T tokens on this rank · H hidden · E experts in total · R ranks · e = E/R local
experts · k top-k · L ranks per node · N nodes · M received rows · W worst-case rows.
"""

from __future__ import annotations

from flexdispatch.routing import dense, hash, losses, router, topk
from flexdispatch.routing.dense import *  # noqa: F403
from flexdispatch.routing.hash import *  # noqa: F403
from flexdispatch.routing.losses import *  # noqa: F403
from flexdispatch.routing.router import *  # noqa: F403
from flexdispatch.routing.topk import *  # noqa: F403

# NOTE: the face names each module's own list once (its ``__all__``)
__all__ = [*topk.__all__, *hash.__all__, *dense.__all__, *router.__all__, *losses.__all__]
