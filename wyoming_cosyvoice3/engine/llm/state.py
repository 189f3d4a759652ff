"""Per-request LLM decoding state (KV cache, positions, tokens), shared by the decoder and the
prefix cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KvValue = Any
"""One KV tensor: an ``onnxruntime.OrtValue`` (IOBinding path) or a numpy array (fallback)."""


@dataclass
class DecodeState:
    """Per-request LLM state: the KV cache and the number of positions it holds.

    Attributes:
        kv: one tensor per ``past_key_values.{i}.{key,value}`` input, in layer order
            (key before value), each float32 [1, kv_heads, past_len, head_dim].
        past_len: positions already in the cache (the next position id).
        tokens: speech tokens generated so far (the RAS window sees all of them).

    Tensors in ``kv`` are never written to after creation (every model step allocates new
    ``present.*`` tensors), so a state may be copied with :meth:`fork` and both copies decoded
    independently; a later prefix cache can keep the state of a voice's fixed prefix
    ``[SOS, prompt text]`` and fork it for each request.
    """

    kv: list[KvValue]
    past_len: int = 0
    tokens: list[int] = field(default_factory=list)

    def fork(self) -> DecodeState:
        """A copy sharing the (immutable) KV tensors, with its own token list."""
        return DecodeState(kv=list(self.kv), past_len=self.past_len, tokens=list(self.tokens))
