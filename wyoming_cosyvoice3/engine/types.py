"""Data passed between the stages and returned to callers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

ShouldStop = Callable[[], bool]
"""Cancellation callable: checked before every model step; True stops the request."""

PromptMode = Literal["zero_shot", "cross_lingual", "instruct"]


@dataclass
class StageTimes:
    """Wall-clock seconds spent per stage of one request (filled as the request runs)."""

    frontend_s: float = 0.0
    llm_prefill_s: float = 0.0
    llm_decode_s: float = 0.0
    llm_tokens: int = 0
    flow_s: float = 0.0
    flow_calls: int = 0
    vocoder_s: float = 0.0
    vocoder_calls: int = 0
    vocoder_frames: int = 0
    """Mel frames the vocoder ran over, summed over its calls (re-run frames count again)."""
    events: list[tuple[str, float, float]] = field(default_factory=list)
    """(stage, start_s, end_s) relative to the request start, for timelines."""


@dataclass(frozen=True)
class VoiceFeatures:
    """Features of one reference clip, computed once and cached (spec section 2).

    Attributes:
        speech_tokens: int64 [L], 25 Hz speech tokens of the clip (frontend.py
            _extract_speech_token), trimmed so that ``prompt_mel`` has exactly 2L frames.
        speaker_embedding: float32 [192], CAM++ embedding (frontend.py _extract_spk_embedding),
            not normalised (the flow path L2-normalises it).
        prompt_mel: float32 [2L, 80], 50 frames/s natural-log mel of the 24 kHz clip
            (frontend.py _extract_speech_feat).
    """

    speech_tokens: npt.NDArray[np.int64]
    speaker_embedding: npt.NDArray[np.float32]
    prompt_mel: npt.NDArray[np.float32]


@dataclass(frozen=True)
class VoicePrompt:
    """A prepared voice: its features plus what selects the prompt mode.

    Attributes:
        features: the clip's :class:`VoiceFeatures`.
        transcript: what the clip says; ``None`` makes every request cross-lingual.
        instruction: a style instruction (instruct mode), e.g. "Speak cheerfully."
        name: voice id, for logs.
    """

    features: VoiceFeatures
    transcript: str | None = None
    instruction: str | None = None
    name: str = "voice"


@dataclass(frozen=True)
class LlmPrompt:
    """What the LLM is prefilled with for one text piece (spec section 4).

    Attributes:
        prompt_text_ids: int64 [P], token ids of the prompt text (may be empty).
        tts_text_ids: int64 [N], token ids of the text to speak (N >= 1); min/max decode
            lengths are 2N and 20N.
        prompt_speech_tokens: int64 [L], the clip's speech tokens (empty unless zero-shot).
        mode: which prompt mode built it.
    """

    prompt_text_ids: npt.NDArray[np.int64]
    tts_text_ids: npt.NDArray[np.int64]
    prompt_speech_tokens: npt.NDArray[np.int64]
    mode: PromptMode


@dataclass
class AudioChunk:
    """One piece of output audio.

    Attributes:
        samples: float32 [N] in [-0.99, 0.99] or int16 [N]; 24 kHz mono.
        sample_rate_hz: always 24000.
        piece_index: index of the text piece (sentence) it belongs to.
        is_last: True on the last chunk of the whole request.
        elapsed_s: seconds from the start of ``synthesize`` to this chunk being ready.
        next_chunk_s: audio seconds the piece's next flow chunk will bring (its next hop
            of speech tokens at 25 per second, divided by the speed); 0 after the piece's
            last chunk. A consumer that holds audio until a piece can play through uses it
            for the wait until the next chunk.
    """

    samples: np.ndarray
    sample_rate_hz: int
    piece_index: int
    is_last: bool
    elapsed_s: float
    next_chunk_s: float = 0.0


@dataclass
class SynthesisResult:
    """Summary of one finished request (returned by ``Synthesis.result``)."""

    audio_s: float = 0.0
    first_chunk_s: float | None = None
    total_s: float = 0.0
    pieces: int = 0
    times: StageTimes = field(default_factory=StageTimes)

    @property
    def rtf(self) -> float:
        """Real-time factor: processing seconds per second of audio (0 if no audio)."""
        return self.total_s / self.audio_s if self.audio_s > 0 else 0.0
