"""DeepEP V1 (``deep_ep.Buffer``): the normal kernels (``backend``, ``combine``, ``links``) and
the low-latency decode kernels (``low_latency``)."""
