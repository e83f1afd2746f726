"""A test-only DeepEP: DeepEP's own Python layer over an emulated runtime on ``torch.distributed``.

``load.load_deep_ep(nvl_peers=..., release=...)`` returns the assembled ``deep_ep`` package; the
tests pass it to the adapter explicitly (``FlexDispatcher(..., _deep_ep=module)``). It is never
installed as ``deep_ep`` and never imported by the library, so ``auto`` backend selection in the
same process is not fooled by it.
"""
