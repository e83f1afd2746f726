"""Multi-process tests on real gloo process groups."""
