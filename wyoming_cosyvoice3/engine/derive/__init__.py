"""Graphs made once from the published model files and kept in the engine cache.

Grouped by the stage whose graph they replace: :mod:`.llm` (the fused-operator LLM, the
memory-mapped text embedding table), :mod:`.flow` (the chunk-causal streaming DiT, fp32 and
int8, which also serves full attention) and :mod:`.vocoder` (the streamed HiFT). Each
derivation finds what it needs by graph structure and validates its result against the source
graph when it is made. :mod:`.common` holds what they share: the graph index and projection
record (:mod:`.common.graph`), the derive-once sequence and cache files (:mod:`.common.files`:
reuse, failure marker, atomic writes, the child process of :mod:`.child`) and the
derive-or-fall-back helper (:mod:`.common.forms`); the tables of forms per stage are in
:mod:`..loaders`. Imports the top engine modules and no stage.
"""
