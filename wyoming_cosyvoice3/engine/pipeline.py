"""The public engine: text + voice -> streamed 24 kHz audio (spec sections 4-7).

Per text piece: LLM decoding (KV cache, RAS) yields speech tokens; the silent-run filter
thins them; every ``hop`` tokens (+ 3 lookahead tokens) the flow turns prompt ++ all tokens so
far into mel frames, the new frames go through the speed resampler and the streaming vocoder,
and the samples that became final are yielded. The hop doubles after each chunk up to
``max_hop_tokens`` (model.py ``CosyVoice2Model.tts``: ``token_hop_len``,
``stream_scale_factor``, ``token_max_hop_len``); the last chunk of a piece flushes everything.

All per-request state (random generators, noise buffers, hop, offsets, emitted samples) lives
in :class:`_Request` / :class:`_Piece` objects created per call; the engine's graphs and
helpers are shared and may serve several threads at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from . import bench_hooks
from . import constants as C
from .errors import SynthesisTimeout
from .flow import FlowRunner, GrowingNoise, SpeedResampler
from .llm import LlmDecoder
from .model import CosyVoice3Model
from .options import EngineOptions, StageTimes, SynthesisOptions
from .sampling import SilentRunFilter
from .text.frontend import TextFrontend
from .types import AudioChunk, LlmPrompt, ShouldStop, SynthesisResult, VoicePrompt
from .vocoder import HiftRunner, VocoderStream
from .voice import VoiceFeatureExtractor

logger = logging.getLogger(__name__)

_FLOW_NOISE_BLOCK_FRAMES = 1000
_VOCODER_NOISE_BLOCK_SAMPLES = 480 * 500
WARM_UP_TEXT = "Hello."


@dataclass
class _Request:
    """State of one ``synthesize`` call (never stored on the engine)."""

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
    ) -> _Request:
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
                np.random.default_rng(flow_seq), C.MEL_BINS, "normal", _FLOW_NOISE_BLOCK_FRAMES
            ),
            vocoder_noise=GrowingNoise(
                np.random.default_rng(voc_seq),
                C.HARMONIC_CHANNELS,
                "uniform",
                _VOCODER_NOISE_BLOCK_SAMPLES,
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

    def event(self, stage: str, start_s: float) -> None:
        """Record a timeline event from ``start_s`` (request-relative) until now."""
        self.times.events.append((stage, start_s, self.now()))


@dataclass
class _Piece:
    """State of one text piece (utterance) inside a request."""

    index: int
    hop_tokens: int
    resampler: SpeedResampler
    vocoder: VocoderStream
    tokens: list[int] = field(default_factory=list)
    offset_tokens: int = 0
    silent_filter: SilentRunFilter = field(default_factory=SilentRunFilter)


class CosyVoice3Engine:
    """Fun-CosyVoice3-0.5B on onnxruntime: voice preparation and streamed synthesis.

    Create with :meth:`load`. Thread-safe: each ``synthesize`` call keeps its own state.

    Attributes:
        model: the loaded graphs and tokenizer.
        options: the engine options it was loaded with.
    """

    def __init__(self, model: CosyVoice3Model, options: EngineOptions) -> None:
        self.model = model
        self.options = options
        self.frontend = TextFrontend(model.tokenizer, model.end_of_prompt_id)
        self.llm = LlmDecoder(model)
        self.flow = FlowRunner(model)
        self.hift = HiftRunner(model.hift)
        self.voices = VoiceFeatureExtractor(model, options.voice_cache_dir)

    @classmethod
    def load(cls, model_dir: Path, options: EngineOptions | None = None) -> CosyVoice3Engine:
        """Load every graph of ``model_dir``.

        Raises:
            ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: see :mod:`.model`.
            ValueError: an option is out of range.
        """
        options = options or EngineOptions()
        options.validate()
        started = time.perf_counter()
        engine = cls(CosyVoice3Model.load(Path(model_dir), options), options)
        logger.debug("engine loaded from %s in %.2f s", model_dir, time.perf_counter() - started)
        return engine

    def prepare_voice(
        self,
        clip_path: Path,
        transcript: str | None = None,
        instruction: str | None = None,
        name: str = "voice",
    ) -> VoicePrompt:
        """Compute (or load from the cache) the features of a reference clip; see voice.py."""
        started = time.perf_counter()
        voice = self.voices.prepare(Path(clip_path), transcript, instruction, name)
        bench_hooks.record_voice(name, time.perf_counter() - started)
        return voice

    def warm_up(self, voice: VoicePrompt) -> None:
        """Run one short synthesis so onnxruntime allocates its buffers before real requests."""
        started = time.perf_counter()
        for _ in self.synthesize(WARM_UP_TEXT, voice, SynthesisOptions(max_decode_tokens=50)):
            pass
        logger.debug("warm-up done in %.2f s", time.perf_counter() - started)

    # -- synthesis --------------------------------------------------------------------------
    def synthesize(
        self,
        text: str,
        voice: VoicePrompt,
        options: SynthesisOptions | None = None,
        should_stop: ShouldStop | None = None,
        result: SynthesisResult | None = None,
    ) -> Iterator[AudioChunk]:
        """Synthesise ``text`` with ``voice``, yielding 24 kHz chunks as soon as they exist.

        Args:
            text: any text; pieces with nothing speakable are skipped (no chunk at all when
                the whole text is unspeakable).
            voice: a prepared voice.
            options: per-request options (validated here).
            should_stop: checked before every model step (LLM step, flow encoder, Euler step,
                vocoder); True raises :class:`SynthesisCancelled`.
            result: filled with timings and the audio length while the request runs.

        Yields:
            :class:`AudioChunk` objects; the last has ``is_last`` True (a zero-length chunk when
            the last piece produced no audio after earlier pieces did).

        Raises:
            SynthesisCancelled, SynthesisTimeout, SynthesisFailed; ValueError for bad options.
        """
        options = bench_hooks.apply_env(options or SynthesisOptions())
        options.validate()  # before the first chunk is asked for: bad options fail at the call
        return self._synthesize(text, voice, options, should_stop, result or SynthesisResult())

    def _synthesize(
        self,
        text: str,
        voice: VoicePrompt,
        options: SynthesisOptions,
        should_stop: ShouldStop | None,
        result: SynthesisResult,
    ) -> Iterator[AudioChunk]:
        req = _Request.create(options, should_stop, result)
        try:
            yield from self._run(text, voice, req)
        finally:
            req.result.total_s = req.now()
            req.result.audio_s = req.samples_out / C.OUTPUT_SAMPLE_RATE_HZ
            bench_hooks.record_request(text, req.result)
            t = req.times
            logger.debug(
                "request: %d pieces, %.2f s audio in %.2f s (RTF %.2f), first chunk %s; "
                "prefill %.3f s, %d tokens in %.3f s, flow %d calls %.3f s, "
                "vocoder %d calls %.3f s",
                req.result.pieces,
                req.result.audio_s,
                req.result.total_s,
                req.result.rtf,
                "n/a" if req.result.first_chunk_s is None else f"{req.result.first_chunk_s:.3f} s",
                t.llm_prefill_s,
                t.llm_tokens,
                t.llm_decode_s,
                t.flow_calls,
                t.flow_s,
                t.vocoder_calls,
                t.vocoder_s,
            )

    def _run(self, text: str, voice: VoicePrompt, req: _Request) -> Iterator[AudioChunk]:
        started = req.now()
        pieces = self.frontend.split_pieces(text)
        req.times.frontend_s += req.now() - started
        req.event("frontend", started)
        req.result.pieces = len(pieces)
        for index, piece_text in enumerate(pieces):
            is_last_piece = index == len(pieces) - 1
            started = req.now()
            prompt = self.frontend.build_prompt(piece_text, voice)
            req.times.frontend_s += req.now() - started
            logger.debug("piece %d (%s): %r", index, prompt.mode, piece_text)
            fixed = req.options.fixed_tokens_per_char
            fixed_tokens = None if fixed is None else max(1, round(fixed * len(piece_text)))
            for samples, final in self._piece_audio(prompt, voice, req, index, fixed_tokens):
                chunk = self._chunk(samples, req, index, final and is_last_piece)
                if chunk is not None:
                    yield chunk
        if req.chunks_out and not req.last_sent:
            # the last piece produced no audio: close the stream with an empty last chunk
            yield self._make_chunk(np.zeros(0, dtype=np.float32), req, len(pieces) - 1, True)

    def _piece_audio(
        self,
        prompt: LlmPrompt,
        voice: VoicePrompt,
        req: _Request,
        index: int,
        fixed_tokens: int | None = None,
    ) -> Iterator[tuple[npt.NDArray[np.float32], bool]]:
        """Decode one piece and yield ``(samples, final)`` per chunk (spec section 7)."""
        opts = req.options
        piece = _Piece(
            index=index,
            hop_tokens=opts.first_hop_tokens,
            resampler=SpeedResampler(opts.speed),
            vocoder=VocoderStream(self.hift, req.vocoder_noise),
        )
        llm_start = req.now()
        tokens = self.llm.decode(
            prompt,
            req.rng,
            should_stop=req.check,
            max_tokens=opts.max_decode_tokens,
            deadline=req.deadline_monotonic,
            times=req.times,
            fixed_tokens=fixed_tokens,
        )
        for token in tokens:
            if not piece.silent_filter.accept(token):
                continue
            piece.tokens.append(token)
            pending = len(piece.tokens) - piece.offset_tokens
            if opts.streaming and pending >= piece.hop_tokens + C.PRE_LOOKAHEAD_TOKENS:
                req.event("llm", llm_start)
                yield self._advance(piece, voice, req, final=False), False
                llm_start = req.now()
        req.event("llm", llm_start)
        if not piece.tokens:
            logger.debug("piece %d: no speech tokens; flow and vocoder skipped", index)
            return
        yield self._advance(piece, voice, req, final=True), True

    def _advance(
        self, piece: _Piece, voice: VoicePrompt, req: _Request, final: bool
    ) -> npt.NDArray[np.float32]:
        """Run the flow for the next chunk of ``piece`` and the vocoder on the new frames.

        Non-final: the chunk covers ``hop`` tokens and the flow also sees the next 3
        (lookahead), whose 6 mu frames are dropped. Final: every remaining token.
        """
        opts = req.options
        offset = piece.offset_tokens
        if final:
            end, drop, advance = len(piece.tokens), 0, len(piece.tokens) - offset
        else:
            end = offset + piece.hop_tokens + C.PRE_LOOKAHEAD_TOKENS
            drop = C.TOKEN_MEL_RATIO * C.PRE_LOOKAHEAD_TOKENS
            advance = piece.hop_tokens
        left = opts.flow_left_context_tokens
        start = max(0, offset - left) if left > 0 else 0
        features = voice.features
        flow_tokens = np.concatenate(
            [
                np.asarray(features.speech_tokens, dtype=np.int64).reshape(-1),
                np.asarray(piece.tokens[start:end], dtype=np.int64),
            ]
        )
        noise_frames = int(features.prompt_mel.shape[0]) + C.TOKEN_MEL_RATIO * end
        began = req.now()
        mel = self.flow.mel_for_tokens(
            flow_tokens,
            features,
            req.flow_noise.take(noise_frames).T,
            steps=opts.euler_steps,
            cfg_rate=opts.cfg_rate,
            cfg_steps=opts.cfg_steps,
            drop_lookahead_frames=drop,
            should_stop=req.check,
            times=req.times,
            generated_offset_tokens=start,
        )
        req.event("flow", began)
        new_mel = mel[:, C.TOKEN_MEL_RATIO * (offset - start) :]
        piece.offset_tokens = offset + advance
        piece.hop_tokens = min(opts.max_hop_tokens, piece.hop_tokens * 2)
        resampled = piece.resampler.push(new_mel, final)
        began = req.now()
        calls = req.times.vocoder_calls
        samples = piece.vocoder.push(resampled, final, req.check, req.times)
        if req.times.vocoder_calls != calls:
            req.event("vocoder", began)
        logger.debug(
            "piece %d chunk: tokens %d..%d%s -> %d mel frames -> %d samples",
            piece.index,
            offset,
            piece.offset_tokens,
            " (final)" if final else "",
            new_mel.shape[1],
            len(samples),
        )
        return samples

    def _chunk(
        self, samples: npt.NDArray[np.float32], req: _Request, index: int, is_last: bool
    ) -> AudioChunk | None:
        if len(samples) == 0 and not is_last:
            return None
        if len(samples) == 0 and req.chunks_out == 0:
            return None
        return self._make_chunk(samples, req, index, is_last)

    def _make_chunk(
        self, samples: npt.NDArray[np.float32], req: _Request, index: int, is_last: bool
    ) -> AudioChunk:
        elapsed = req.now()
        if req.result.first_chunk_s is None and len(samples):
            req.result.first_chunk_s = elapsed
        req.samples_out += len(samples)
        req.chunks_out += 1
        req.last_sent = is_last
        out: np.ndarray = samples
        if req.options.output_dtype == "int16":
            out = np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
        return AudioChunk(
            samples=out,
            sample_rate_hz=C.OUTPUT_SAMPLE_RATE_HZ,
            piece_index=index,
            is_last=is_last,
            elapsed_s=elapsed,
        )
