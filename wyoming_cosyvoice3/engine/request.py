"""The state of one ``synthesize`` call (never stored on the engine): options, the seeded
random streams, the deadline and cancellation, stage times and timeline events, and what has
been sent.

One seed gives three independent random streams (:func:`.noise.request_streams`): RAS sampling
(used only by the LLM decoder, which may run in a producer thread), the flow noise and the
vocoder noise (both used only by the consumer), so overlapping decoding with the flow leaves
every stream's draws unchanged. Per-piece state lives with the stages: the flow's in
:class:`.flow.stream.MelStream`, the rest in :class:`.piece.PieceState`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from . import constants as C
from .errors import SynthesisTimeout
from .noise import GrowingNoise, request_streams
from .options import StageTimes, SynthesisOptions
from .types import ShouldStop, SynthesisResult


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
