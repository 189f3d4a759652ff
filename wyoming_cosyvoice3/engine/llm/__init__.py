"""LLM stage: prompt embeddings -> speech tokens (25 Hz).

Prefill and KV-cache decoding with the per-voice prompt-prefix KV cache, RAS sampling, the
silent-run filter and a request's token stream over its pieces (:mod:`.decoder`); the
per-request decoding thread of ``EngineOptions.split_cores`` (:mod:`.producer`). Imports the
top engine modules and no other stage.
"""
