"""The server's view of the engine: the calls it makes, and how the model is found and loaded.

Tests substitute an :data:`EngineFactory` (an instrumented wrapper of the real engine, or a
fault-injecting one) without touching the rest of the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ..engine.options import (
    AudioChunk,
    EngineOptions,
    ShouldStop,
    SynthesisOptions,
    SynthesisResult,
    VoicePrompt,
)
from ..engine.text.pieces import MorePieces, PlannedPiece
from .settings import Settings


class PiecePlanner(Protocol):
    """The engine's planning calls: how it will cut a text, without synthesising it."""

    def text_token_count(self, text: str) -> int | None:
        """LLM text tokens of ``text`` before normalisation; None when the engine does not
        count tokens (a test stand-in): the server then does not bound its pieces."""

    def plan_pieces(
        self, text: str, language_hint: str | None = None,
        max_piece_tokens: int | None = None, read_numbers: bool = True,
    ) -> list[PlannedPiece]:
        """The pieces ``synthesize`` would cut ``text`` into with these options."""


class Engine(PiecePlanner, Protocol):
    """What the server needs from :class:`wyoming_cosyvoice3.engine.CosyVoice3Engine`: every
    engine call the server makes is named here, so no call escapes the type checker
    (``tests/test_engine_port.py`` checks the real engine against this list)."""

    def prepare_voice(
        self, clip_path: Path, transcript: str | None = None, instruction: str | None = None,
        name: str = "voice",
    ) -> VoicePrompt: ...

    def release_voice_encoders(self) -> None:
        """Free the voice encoders (after the start-up voices are prepared)."""

    def warm_up(self, voice: VoicePrompt, options: SynthesisOptions | None = None) -> None:
        """One short synthesis with the requests' options before the server is ready."""

    def close(self) -> None:
        """Stop the engine's helpers (its voice encoder process) at shutdown."""

    def synthesize(
        self, text: str | Sequence[PlannedPiece], voice: VoicePrompt,
        options: SynthesisOptions = ..., should_stop: ShouldStop | None = None,
        result: SynthesisResult | None = None, more: MorePieces | None = None,
    ) -> Iterator[AudioChunk]:
        """Speak ``text``, or the pieces :meth:`plan_pieces` returned for it (spoken as
        planned: normalised and cut once), then the pieces ``more`` hands over while the
        request runs (called from an engine thread)."""


EngineFactory = Callable[[Path, EngineOptions], Engine]
"""Builds the engine from a model directory (runs in the loader thread)."""
ModelLocator = Callable[[Settings, ShouldStop], Path]
"""Finds or downloads the model directory (runs in the loader thread; may take long)."""


def default_engine_factory(model_dir: Path, options: EngineOptions) -> Engine:
    """Load the real engine (imported lazily so the server module loads without it)."""
    from ..engine.pipeline import CosyVoice3Engine

    engine: Engine = CosyVoice3Engine.load(model_dir, options)
    return engine


def default_model_locator(settings: Settings, should_stop: ShouldStop | None = None) -> Path:
    """``--model-dir`` as given, else the model downloaded into ``--download-dir``.

    Downloading (``wyoming_cosyvoice3.download.ensure_model``) touches no network when every
    file is already present; ``--local-files-only`` forbids the network altogether.
    """
    if settings.model_dir is not None:
        return settings.model_dir
    from ..download import ensure_model

    download_dir = settings.download_dir or settings.data_dirs[0]
    return Path(
        ensure_model(
            download_dir,
            settings.llm_precision,
            local_files_only=settings.local_files_only,
            should_stop=should_stop,
        )
    )
