"""The state of one ``synthesize`` call (never stored on the engine): options, the seeded
random streams, the deadline and cancellation, stage times and timeline events, and what has
been sent.

One seed gives three independent random streams (:func:`request_streams`): RAS sampling
(used only by the LLM decoder, which may run in a producer thread), the flow noise and the
vocoder noise (both used only by the consumer), so overlapping decoding with the flow leaves
every stream's draws unchanged. The flow and the vocoder draw from per-request noise buffers
(:class:`GrowingNoise`; source: FunAudioLLM/CosyVoice ace7c47, ``cosyvoice/flow/flow_matching.py``
``CausalConditionalCFM.rand_noise`` and ``cosyvoice/hifigan/generator.py``, the source noise of
``SineGen2``). Per-piece state lives with the stages: the flow's in
:class:`.flow.stream.MelStream`, the rest in :class:`.pipeline.PieceState`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from . import constants as C
from .errors import SynthesisTimeout
from .options import ShouldStop, StageTimes, SynthesisOptions, SynthesisResult


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

    @classmethod
    def create(
        cls, options: SynthesisOptions, should_stop: ShouldStop | None, result: SynthesisResult
    ) -> RequestState:
        rng, flow_noise, vocoder_noise = request_streams(options.seed)
        return cls(
            options=options,
            should_stop=should_stop,
            result=result,
            start_s=time.perf_counter(),
            deadline_monotonic=time.monotonic() + options.max_request_s,
            rng=rng,
            flow_noise=flow_noise,
            vocoder_noise=vocoder_noise,
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


# -- noise buffers ---------------------------------------------------------------------------

FloatArray = npt.NDArray[np.float32]

FLOW_NOISE_BLOCK_FRAMES = 1000
VOCODER_NOISE_BLOCK_SAMPLES = 480 * 500


class GrowingNoise:
    """A per-request noise buffer that grows in fixed blocks, so its prefix never changes.

    Streamed and one-shot synthesis of the same request read identical noise for every frame,
    whatever lengths they ask for: upstream keeps one fixed buffer for the same reason
    (flow_matching.py ``CausalConditionalCFM.rand_noise``; generator.py source noise).

    Args:
        rng: the request's generator for this buffer (not shared with sampling).
        channels: values per frame (80 mel bins for the flow, 9 for the vocoder).
        kind: ``"normal"`` (N(0,1)) or ``"uniform"`` (U[0,1)).
        block_frames: frames drawn at a time.
    """

    def __init__(
        self, rng: np.random.Generator, channels: int, kind: str, block_frames: int = 1000
    ) -> None:
        if kind not in ("normal", "uniform"):
            raise ValueError(f"kind must be normal or uniform, got {kind!r}")
        self._rng = rng
        self.channels = channels
        self.kind = kind
        self.block_frames = block_frames
        self._data = np.zeros((0, channels), dtype=np.float32)

    def take(self, n_frames: int) -> FloatArray:
        """float32 [n_frames, channels], the first ``n_frames`` frames of the buffer (a view)."""
        if n_frames > self._data.shape[0]:
            missing = n_frames - self._data.shape[0]
            n_blocks = -(-missing // self.block_frames)
            blocks = [self._data]
            for _ in range(n_blocks):
                shape = (self.block_frames, self.channels)
                if self.kind == "normal":
                    blocks.append(self._rng.standard_normal(shape, dtype=np.float32))
                else:
                    blocks.append(self._rng.random(shape, dtype=np.float32))
            self._data = np.concatenate(blocks, axis=0)
        return self._data[:n_frames]


def request_streams(seed: int) -> tuple[np.random.Generator, GrowingNoise, GrowingNoise]:
    """The three independent random streams of a request with ``seed``: the RAS sampling
    generator, the flow noise (N(0,1), 80 mel bins per frame) and the vocoder source noise
    (U[0,1), 9 harmonic channels per sample), spawned from one ``SeedSequence(seed)``.

    Separate streams let the LLM decode in its own thread (it draws only from the first)
    while the flow and the vocoder draw from theirs, so every stream's draws stay the same.
    """
    sampling_seq, flow_seq, voc_seq = np.random.SeedSequence(seed).spawn(3)
    return (
        np.random.default_rng(sampling_seq),
        GrowingNoise(
            np.random.default_rng(flow_seq), C.MEL_BINS, "normal", FLOW_NOISE_BLOCK_FRAMES
        ),
        GrowingNoise(
            np.random.default_rng(voc_seq),
            C.HARMONIC_CHANNELS,
            "uniform",
            VOCODER_NOISE_BLOCK_SAMPLES,
        ),
    )
