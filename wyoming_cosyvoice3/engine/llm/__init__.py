"""LLM stage: prompt embeddings -> speech tokens (25 Hz).

Prefill and KV-cache decoding with the per-voice prompt-prefix KV cache, and a request's token
stream over its pieces (:mod:`.decoder`); RAS sampling and the silent-run filter
(:mod:`.sampling`); the optional decoding thread (:mod:`.producer`). Imports the top engine
modules and no other stage.
"""
