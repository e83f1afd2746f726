"""The DeepEP backend: V1 ``Buffer`` (``v1``, ``ll``), V2 ``ElasticBuffer`` (``elastic``), the
shared buffer (``buffer``), DeepEP's kernel limits (``rules``), sizing and support checks."""
