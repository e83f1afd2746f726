"""The ``torch`` backend: ``all_to_all_single`` dispatch and combine, flat (``flat``) and
hierarchical (``hier``), driven by ``a2a.TorchA2ABackend``."""
