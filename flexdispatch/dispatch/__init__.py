"""The dispatcher and what it is made of.

- ``dispatcher``: ``FlexDispatcher``: its checks, its public calls (a dispatch in two halves
  returns a ``types.PendingDispatch``) and ``warmup``;
- ``autograd``: the autograd Functions of its eager path;
- ``ops``: the ``torch.library`` custom ops ``torch.compile`` traces instead;
- ``select``: which backend a config gets, agreed by every rank;
- ``decode``: expert-major decode dispatch (``DecodeDispatcher``) for inference.
"""
