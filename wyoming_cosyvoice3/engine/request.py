"""Per-request and per-piece state of one ``synthesize`` call (never stored on the engine).

Split out of :mod:`.pipeline`. One seed gives three independent random streams: RAS sampling
(used only by the LLM decoder, which may run in a producer thread), the flow noise and the
vocoder noise (both used only by the consumer), so overlapping decoding with the flow leaves
every stream's draws unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import constants as C
from .errors import SynthesisTimeout
from .flow.melops import SpeedResampler
from .llm.sampling import SilentRunFilter
from .noise import GrowingNoise
from .options import StageTimes, SynthesisOptions
from .types import ShouldStop, SynthesisResult, VoiceFeatures
from .vocoder.hift import VocoderStream
from .vocoder.schedule import may_defer

if TYPE_CHECKING:
    from .llm.decoder import LlmDecoder
    from .types import LlmPrompt

FLOW_NOISE_BLOCK_FRAMES = 1000
VOCODER_NOISE_BLOCK_SAMPLES = 480 * 500


@dataclass
class RequestState:
    """State of one ``synthesize`` call."""

    options: SynthesisOptions
    should_stop: ShouldStop | None
    result: SynthesisResult
    start_s: float
    deadline_monotonic: float
    rng: np.random.Generator
    flow_noise: GrowingNoise
    vocoder_noise: GrowingNoise
    samples_out: int = 0
    chunks_out: int = 0
    last_sent: bool = False
    flow_noise_skip_frames: int = 0
    """Noise columns skipped with ``flow_prompt_tokens``: the trimmed prompt's frames and
    every generated frame read the same noise columns as with the whole prompt."""

    @classmethod
    def create(
        cls, options: SynthesisOptions, should_stop: ShouldStop | None, result: SynthesisResult
    ) -> RequestState:
        # one seed -> three independent streams: RAS sampling, flow noise, vocoder noise
        sampling_seq, flow_seq, voc_seq = np.random.SeedSequence(options.seed).spawn(3)
        return cls(
            options=options,
            should_stop=should_stop,
            result=result,
            start_s=time.perf_counter(),
            deadline_monotonic=time.monotonic() + options.max_request_s,
            rng=np.random.default_rng(sampling_seq),
            flow_noise=GrowingNoise(
                np.random.default_rng(flow_seq), C.MEL_BINS, "normal", FLOW_NOISE_BLOCK_FRAMES
            ),
            vocoder_noise=GrowingNoise(
                np.random.default_rng(voc_seq),
                C.HARMONIC_CHANNELS,
                "uniform",
                VOCODER_NOISE_BLOCK_SAMPLES,
            ),
        )

    @property
    def times(self) -> StageTimes:
        return self.result.times

    def now(self) -> float:
        """Seconds since the request started."""
        return time.perf_counter() - self.start_s

    def check(self) -> bool:
        """Cancellation callable for the stages: True = stop; raises past the deadline."""
        if self.should_stop is not None and self.should_stop():
            return True
        if time.monotonic() > self.deadline_monotonic:
            raise SynthesisTimeout(
                f"request exceeded max_request_s={self.options.max_request_s:g} s; raise it "
                "or send shorter text"
            )
        return False

    def lead_s(self) -> float:
        """Seconds of emitted audio not yet played by a player that started at the first
        chunk (0 before the first chunk)."""
        first = self.result.first_chunk_s
        if first is None:
            return 0.0
        return self.samples_out / C.OUTPUT_SAMPLE_RATE_HZ - (self.now() - first)

    def event(self, stage: str, start_s: float, end_s: float | None = None) -> None:
        """Record a timeline event from ``start_s`` until ``end_s`` (default now), both
        request-relative seconds."""
        self.times.events.append((stage, start_s, self.now() if end_s is None else end_s))


@dataclass
class PieceState:
    """State of one text piece (utterance) inside a request."""

    index: int
    hop_tokens: int
    resampler: SpeedResampler
    vocoder: VocoderStream
    tokens: list[int] = field(default_factory=list)
    offset_tokens: int = 0
    silent_filter: SilentRunFilter = field(default_factory=SilentRunFilter)
    last_chunk_s: float = 0.0
    """Request-relative time of the piece's previous flow chunk (or of its start)."""
    base_hop_tokens: int = 0
    """Hop before first-chunk padding; doubles after each chunk (model.py ``token_hop_len``)."""
    flow_history: Any = None
    """Chunk-causal flow: this piece's key/value history (flow.chunked.KvCache), or None."""

    def defer_vocoder(self, req: RequestState, new_frames: int, final: bool) -> bool:
        """Whether the vocoder leaves this chunk's ``new_frames`` mel frames for its next
        call (``SynthesisOptions.vocoder_defer``, :func:`.vocoder.schedule.may_defer`); also
        starts timing the next chunk."""
        now = req.now()
        since, self.last_chunk_s = now - self.last_chunk_s, now
        if final or not req.options.vocoder_defer:
            return False
        times = req.times
        per_frame = times.vocoder_s / times.vocoder_frames if times.vocoder_frames else None
        next_frames = new_frames + C.TOKEN_MEL_RATIO * self.hop_tokens
        return may_defer(req.lead_s(), since, per_frame, self.vocoder.frames_for_call(next_frames))


def flow_prompt_features(features: VoiceFeatures, prompt_tokens: int) -> VoiceFeatures:
    """The voice features the flow sees with ``SynthesisOptions.flow_prompt_tokens``.

    ``prompt_tokens`` <= 0 or >= the voice's L tokens: ``features`` unchanged (spec-exact).
    Otherwise the last ``prompt_tokens`` speech tokens and the last ``2 * prompt_tokens``
    prompt-mel frames (they stay aligned: the prompt mel has exactly 2L frames, spec section
    2d); the speaker embedding is unchanged. The DiT runs on every prompt frame in every Euler
    step (spec section 7), so this bounds the fixed cost of each chunk.
    """
    tokens = np.asarray(features.speech_tokens, dtype=np.int64).reshape(-1)
    if prompt_tokens <= 0 or prompt_tokens >= len(tokens):
        return features
    frames = C.TOKEN_MEL_RATIO * prompt_tokens
    return VoiceFeatures(
        speech_tokens=tokens[-prompt_tokens:],
        speaker_embedding=features.speaker_embedding,
        prompt_mel=np.asarray(features.prompt_mel, dtype=np.float32)[-frames:],
    )


def token_stream(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: RequestState,
    stopped: ShouldStop | None,
) -> Iterator[tuple[int, int | None]]:
    """``(piece index, token)`` for every accepted LLM token of every piece of a request, then
    ``(piece index, None)`` at the end of each piece.

    Runs in the producer thread with ``overlap_decoding``. It records "llm" timeline spans,
    split where the consumer ran a chunk in between.

    Args:
        llm: the model's decoder (``llm.decode`` is looked up at each piece).
        prompts: one LLM prompt per text piece.
        fixed_tokens: per piece, the benchmark's fixed token count or None.
        req: the request (seeded generator, limits, cancellation, stage times).
        stopped: the producer thread's stop flag, or None.

    Raises:
        as ``LlmDecoder.decode`` (cancellation, timeout, graph failure).
    """

    def should_stop() -> bool:
        return (stopped is not None and stopped()) or req.check()

    opts = req.options
    for index, prompt in enumerate(prompts):
        span = req.now()
        tokens = llm.decode(
            prompt,
            req.rng,
            should_stop=should_stop,
            max_tokens=opts.max_decode_tokens,
            deadline=req.deadline_monotonic,
            times=req.times,
            fixed_tokens=fixed_tokens[index],
        )
        for token in tokens:
            handed = req.now()
            yield index, token
            if req.now() - handed > 1e-3:  # the consumer ran a chunk in between
                req.event("llm", span, handed)
                span = req.now()
        req.event("llm", span)
        yield index, None
