"""Derived forms of the LLM stage's graphs: the fused-operator decode graph (:mod:`.fused`,
built by :mod:`.fused_graph` from the weights :mod:`.weights` finds with :mod:`.patterns`) and
the memory-mapped text embedding table (:mod:`.embedding_table`)."""
