"""The ``deepep`` backend: one adapter per DeepEP release behind the dispatch contract.

- ``v1/``: DeepEP's V1 ``deep_ep.Buffer`` (v1.2.1, and ``legacy`` in DeepEP 2.x): ``backend``
  (normal kernels, intranode and internode), ``combine``, ``links`` (the NVLink / RDMA byte
  counts of a handle) and ``low_latency`` (the decode kernels);
- ``v2/``: DeepEP V2's ``deep_ep.ElasticBuffer`` (DeepEP 2.1.0+, direct mode);
- ``v25/``: DeepEP 2.5's ``deep_ep_v25.EPBuffer`` (hybrid or direct mode, JIT kernels):
  ``backend``, ``buffer`` (the shared buffer, the JIT registry, the deferred epilogue), ``layout``
  (row widths and their refusals), ``links`` (the agreed link probes), ``rows`` (receive order,
  ids, traffic) and ``support`` (its rules and the token bucket);
- shared by them: ``buffer`` (one buffer per process and group), ``sizing`` (buffer sizes, the
  wire format of rows), ``rules`` and ``limits`` (DeepEP's kernel limits: per installed release,
  and the fixed ones a config is checked against), ``support`` (importing ``deep_ep``, the
  topology rules), ``refusals`` (what is refused before any kernel), ``counters`` (traffic
  counted on the device) and ``gin`` (NCCL's GIN report).

``dispatch.select`` picks the release (``DispatchConfig.deepep_api``).
"""
