"""An emulated DeepEP runtime (``deep_ep._C``) for CPU tests. TEST-ONLY, being built.

DeepEP's own Python layer (``deep_ep/buffers/legacy.py`` of the ``sgl-deep-ep`` wheel) is meant
to run over it, so that the backend meets DeepEP's real wrapper. Built so far: ``limits`` (DeepEP's
asserts and traps per release, each citing its source line) and ``transport`` (the gloo exchanges
the emulated kernels will use, with their own accounting). The kernels themselves (layout,
intranode/internode dispatch and combine, low-latency) are not written yet; the backend's tests
still run over the older stand-alone emulator in ``tests/deepep_emu/deep_ep``.
"""
