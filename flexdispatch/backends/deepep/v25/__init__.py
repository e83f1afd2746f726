"""DeepEP 2.5 (``deep_ep_v25.EPBuffer``): hybrid or direct mode, kernels compiled at first use."""
