"""CosyVoice3 inference engine: numpy + onnxruntime, no Wyoming or asyncio.

Public API::

    from wyoming_cosyvoice3.engine import CosyVoice3Engine, SynthesisOptions

    engine = CosyVoice3Engine.load(model_dir)
    voice = engine.prepare_voice(clip_path, transcript="...")
    for chunk in engine.synthesize("Hello.", voice, SynthesisOptions(seed=1)):
        ...  # chunk.samples: float32 24 kHz mono

``CosyVoice3Engine`` is imported lazily so that the light modules (options, errors, istft,
noise, ...) import without loading the model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    CosyVoiceError,
    EmptyText,
    GraphSignatureMismatch,
    ModelFilesMissing,
    ModelLoadError,
    ModelNotReady,
    SynthesisCancelled,
    SynthesisFailed,
    SynthesisTimeout,
    TextError,
    TextTooLong,
    VoiceError,
    VoiceNotFound,
)
from .options import (
    PRESETS,
    AudioChunk,
    EngineOptions,
    LlmPrompt,
    ShouldStop,
    StageTimes,
    SynthesisOptions,
    SynthesisResult,
    VoiceFeatures,
    VoicePrompt,
)

if TYPE_CHECKING:
    from .pipeline import CosyVoice3Engine

__all__ = [
    "PRESETS",
    "AudioChunk",
    "CosyVoice3Engine",
    "CosyVoiceError",
    "EmptyText",
    "EngineOptions",
    "GraphSignatureMismatch",
    "LlmPrompt",
    "ModelFilesMissing",
    "ModelLoadError",
    "ModelNotReady",
    "ShouldStop",
    "StageTimes",
    "SynthesisCancelled",
    "SynthesisFailed",
    "SynthesisOptions",
    "SynthesisResult",
    "SynthesisTimeout",
    "TextError",
    "TextTooLong",
    "VoiceError",
    "VoiceFeatures",
    "VoiceNotFound",
    "VoicePrompt",
]


def __getattr__(name: str) -> Any:
    if name == "CosyVoice3Engine":
        from .pipeline import CosyVoice3Engine

        return CosyVoice3Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
