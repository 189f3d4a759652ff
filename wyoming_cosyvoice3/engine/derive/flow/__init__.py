"""Derived forms of the flow stage's DiT estimator: the split time / per-frame pair
(:mod:`.estimator_split`), the int8 graph (:mod:`.quantize`) and the chunk-causal streaming DiT
(:mod:`.streaming_estimator`, built by :mod:`.streaming_graph` from the weights
:mod:`.dit_structure` finds; run by :mod:`...graphs`, with full attention by
:mod:`.full_attention`)."""
