"""DeepEP V2 (``deep_ep.ElasticBuffer``, DeepEP 2.1.0+), direct mode."""
