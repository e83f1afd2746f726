"""flexdispatch inside the frameworks people train with.

One module per host, each importing its framework only when it is used (``import flexdispatch``
never needs either framework):

- ``flexdispatch.integrations.megatron``: ``install()`` makes every Megatron-Core ``MoELayer``
  built with ``moe_token_dispatcher_type="flex"`` move its tokens through a ``FlexDispatcher``;
- ``flexdispatch.integrations.torchtitan``: ``FlexTokenDispatcher``, a torchtitan expert-parallel
  token dispatcher, and an ``@override`` that swaps it in for a whole job;
- ``flexdispatch.integrations.hf``: ``expert_parallel(model)`` shards the sparse MoE blocks of a
  Hugging Face transformers model in place.

docs/integrations.md has the lines that switch a job, what is covered and what is not.
"""

from __future__ import annotations
