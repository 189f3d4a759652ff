"""In-memory cache of the LLM state after a voice's fixed prompt prefix.

Every LLM prompt starts with ``[speech_emb(SOS), text_emb(prompt text)]`` (spec section 4):
for a zero-shot voice the prompt text is ``SYS + transcript`` and is the same for every
request of that voice. Its KV cache is computed once and each request continues from a fork
of it (:meth:`~.llm.DecodeState.fork`: the KV tensors are immutable and shared).

The decoder always prefills in two calls (prefix, then the rest), whether or not the cache is
enabled, so cached and uncached requests see bit-identical logits. With dynamic int8
quantisation one call and two calls are not bit-identical (activations are quantised per
tensor over the positions of one call); the benchmark's "levers" section records the
difference.

Size: 24 KiB per cached position with the published dims (24 layers x key+value x 2 heads x
64 x 4 bytes), e.g. 0.9 MiB for a 40-token transcript. One cache per decoder = per LLM
precision; entries are keyed by the prompt-text ids, least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from .state import DecodeState


class PrefixCache:
    """Thread-safe LRU map ``prompt-text ids -> DecodeState`` after the prefix.

    Args:
        max_entries: entries kept (0 disables the cache: :meth:`get` always misses).
    """

    def __init__(self, max_entries: int = 16) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, DecodeState] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(prompt_text_ids: npt.ArrayLike) -> bytes:
        """Cache key of a prompt text: its int64 ids as bytes."""
        return np.asarray(prompt_text_ids, dtype=np.int64).reshape(-1).tobytes()

    def get(self, key: bytes) -> DecodeState | None:
        """A fork of the cached state (the caller may extend it), or None."""
        with self._lock:
            state = self._entries.get(key)
            if state is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return state.fork()

    def put(self, key: bytes, state: DecodeState) -> None:
        """Store a fork of ``state`` (taken right after the prefix prefill)."""
        if self.max_entries == 0:
            return
        with self._lock:
            self._entries[key] = state.fork()
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
