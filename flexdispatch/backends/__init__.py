"""Dispatch backends: the ways of moving rows between ranks, behind one protocol.

- ``base``: ``DispatchBackend``, the protocol every backend implements (and its optional hooks);
- ``torch``: ``all_to_all_single`` over any process group (NCCL, gloo), flat or hierarchical;
- ``deepep``: DeepEP's buffers, one adapter per release (``v1``, ``v2``, ``v25``);
- ``counts``: the host agreements the backends share (token counts, row shapes).

Which backend a config gets is decided by the dispatcher (``flexdispatch.dispatch.select``).
"""
