"""Derived forms of the flow stage's DiT estimator: the chunk-causal streaming DiT
(:mod:`.streaming_estimator`, built by :mod:`.streaming_graph` from the weights
:mod:`.dit_structure` finds, int8 by the recipe of :mod:`.quantize`; run by :mod:`...dit_runner`,
with full attention by :mod:`.full_attention`)."""
