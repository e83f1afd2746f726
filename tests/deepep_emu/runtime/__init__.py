"""An emulated DeepEP runtime (``deep_ep._C``) for CPU tests. TEST-ONLY.

DeepEP's own Python layer (``deep_ep/buffers/legacy.py`` of the ``sgl-deep-ep`` wheel) runs over
it: ``tests/deepep_emu/load.py`` assembles the package. Modules: ``limits`` (DeepEP's asserts and
traps per release, each citing its source line), ``transport`` (packing and the gloo exchanges
the kernels use, with their own accounting), ``config`` (``Config``, size hints, compiled shape
sets, ``EventHandle``), ``normal`` (layout, intranode and internode kernels), ``low_latency``
(decode kernels), ``module`` (``make_runtime_module``); DeepEP V2 (``elastic``) and V2.5 (``ep``,
``ep_layout``, ``ep_limits``) share ``bounded`` (what their token-bounded buffers do alike).
"""
