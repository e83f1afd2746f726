"""The dispatcher and what it is made of.

- ``dispatcher``: ``FlexDispatcher``, its checks and its public calls;
- ``autograd``: the autograd Functions of its eager path;
- ``overlap``: a dispatch in two halves (``PendingDispatch``), the combine with a bias;
- ``ops``: the ``torch.library`` custom ops ``torch.compile`` traces instead;
- ``select``: which backend a config gets, agreed by every rank;
- ``decode``: expert-major decode dispatch (``DecodeDispatcher``) for inference.
"""
