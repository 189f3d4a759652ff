"""Files made once from the published model files and kept in the engine cache.

Each derivation finds what it needs by graph structure, validates its result against the
source graph when it is made, and on any mismatch falls back (one warning) to the source:
the int8 DiT estimator (:mod:`.quantize`), the split estimator (:mod:`.estimator_split`),
the memory-mapped text embedding table (:mod:`.embedding_table`), the fused-operator LLM
graph (:mod:`.llm_fused`, built by :mod:`.llm_fused_graph` from the weights
:mod:`.llm_weights` finds), the chunk-causal streaming DiT (:mod:`.streaming_estimator`,
built by :mod:`.streaming_graph` from weights found by :mod:`.dit_structure`). The
derive-once sequence they share (reuse, failure marker, atomic writes) and the cache-file
helpers are in :mod:`.files`. Imports the top engine modules and no stage.
"""
