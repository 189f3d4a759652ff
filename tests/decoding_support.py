"""A fixed decoding length for engine tests: the tiny models' random weights never stop
sensibly, so tests decode exactly ``max(1, round(rate x characters))`` speech tokens per text
piece through the engine's hook (``EngineObserver.fixed_speech_tokens``), as the benchmark
does (``bench/recorder.py``), written here on its own so that the tests do not take the rule
from the code they check."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from wyoming_cosyvoice3.engine import CosyVoice3Engine
from wyoming_cosyvoice3.engine.options import EngineObserver


class FixedDecoding(EngineObserver):
    """Decode ``max(1, round(tokens_per_char x len(piece)))`` tokens per piece."""

    def __init__(self, tokens_per_char: float) -> None:
        self.tokens_per_char = tokens_per_char

    def fixed_speech_tokens(self, piece_text: str) -> int | None:
        return max(1, round(self.tokens_per_char * len(piece_text)))


@contextmanager
def fixed_decoding(engine: CosyVoice3Engine, tokens_per_char: float) -> Iterator[None]:
    """Within the block, ``engine``'s requests decode the fixed length (for a shared engine
    fixture: the engine's observer is replaced and restored). Consume the chunks inside."""
    saved = engine.options
    engine.options = dataclasses.replace(saved, observer=FixedDecoding(tokens_per_char))
    try:
        yield
    finally:
        engine.options = saved
