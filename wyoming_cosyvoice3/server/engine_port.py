"""The server's view of the engine: the calls it makes, and how the model is found and loaded.

Tests substitute an :data:`EngineFactory` (an instrumented wrapper of the real engine, or a
fault-injecting one) without touching the rest of the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from .settings import Settings


class Engine(Protocol):
    """What the server needs from :class:`wyoming_cosyvoice3.engine.CosyVoice3Engine`."""

    def prepare_voice(
        self, clip_path: Path, transcript: str | None = None, instruction: str | None = None,
        name: str = "voice",
    ) -> VoicePrompt: ...

    def synthesize(
        self, text: str, voice: VoicePrompt, options: SynthesisOptions = ...,
        should_stop: ShouldStop | None = None, result: SynthesisResult | None = None,
    ) -> Iterator[AudioChunk]: ...


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
