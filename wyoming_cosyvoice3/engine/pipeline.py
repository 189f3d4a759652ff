"""The public engine: text + voice -> streamed 24 kHz audio (spec sections 4-7).

The pipeline only wires the stages: text -> pieces and LLM prompts (:mod:`.text`) -> speech
tokens (:func:`.llm.tokens.request_tokens`; with ``EngineOptions.split_cores`` decoded in a
per-request thread) -> per piece, the silent-run filter and a mel stream
(:class:`.flow.stream.MelStream`, opened from the request's :class:`.flow.stream.FlowRequest`,
which decides the flow's form, prompt and noise) -> the
speed resampler and the streaming vocoder (:mod:`.vocoder`) -> the samples that became final
are yielded.

Per-request state lives in a :class:`RequestState` (options, the seeded random streams of
:func:`.noise.request_streams`, the deadline and cancellation, stage times and timeline events,
and what has been sent) and per-piece state in a :class:`PieceState` (which holds the piece's
mel stream), both created per call and never stored on the engine; the engine's graphs and
helpers are shared and may serve several threads at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from . import constants as C
from .errors import SynthesisTimeout, TextError
from .flow.solver import FlowRunner
from .flow.stream import ChunkedFlows, FlowRequest, MelStream, SpeedResampler
from .llm.decoder import LlmDecoder, SilentRunFilter
from .llm.tokens import DecodeProgress, request_tokens
from .memory import return_freed_memory
from .model import CosyVoice3Model
from .noise import GrowingNoise, request_streams
from .options import (
    AudioChunk,
    EngineOptions,
    LlmPrompt,
    ShouldStop,
    StageTimes,
    SynthesisOptions,
    SynthesisResult,
    VoicePrompt,
)
from .sessions import set_run_observer
from .text.frontend import TextFrontend
from .text.pieces import MorePieces, PlannedPiece
from .vocoder.hift import HiftRunner, VocoderStream, may_defer
from .voice.prepare import VoiceFeatureExtractor
from .voice.worker import worker_for

logger = logging.getLogger(__name__)

WARM_UP_TEXT = "Hello."


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


@dataclass
class PieceState:
    """State of one text piece inside a request.

    Attributes:
        index: the piece's index in the request's text.
        mel: the piece's flow (tokens, chunk offsets, hop, key/value history).
        resampler: the speed resampler of the piece's mel.
        vocoder: the piece's streaming vocoder.
        silent_filter: drops the LLM's over-long silent-token runs.
        last_chunk_s: request-relative time of the piece's previous flow chunk (or of its
            start).
        received_tokens: the LLM's tokens of this piece taken so far (before the silent-run
            filter).
        samples_out: output samples of this piece made so far.
    """

    index: int
    mel: MelStream
    resampler: SpeedResampler
    vocoder: VocoderStream
    silent_filter: SilentRunFilter = field(default_factory=SilentRunFilter)
    last_chunk_s: float = 0.0
    received_tokens: int = 0
    samples_out: int = 0

    def left_s(self, progress: DecodeProgress, speed: float) -> float | None:
        """Audio seconds of this piece still to come after the samples made so far, once the
        LLM has decoded all of its tokens (None before): the tokens the flow has (the silent
        filter's drops excluded) and those decoded but not taken yet, at
        :data:`~.constants.SPEECH_TOKEN_RATE_HZ` per second of speech divided by ``speed``.
        Tokens the filter will still drop make it err long."""
        decoded = progress.tokens_if_ended(self.index)
        if decoded is None:
            return None
        tokens = len(self.mel.tokens) + max(decoded - self.received_tokens, 0)
        total_s = tokens / C.SPEECH_TOKEN_RATE_HZ / speed
        return max(total_s - self.samples_out / C.OUTPUT_SAMPLE_RATE_HZ, 0.0)

    def decoded_s(self, progress: DecodeProgress, speed: float) -> float:
        """Audio seconds of this piece's speech tokens the LLM has decoded so far (the silent
        filter's drops included), at :data:`~.constants.SPEECH_TOKEN_RATE_HZ` per second of
        speech divided by ``speed``; with ``split_cores`` it runs ahead of the audio."""
        return progress.decoded_so_far(self.index) / C.SPEECH_TOKEN_RATE_HZ / speed

    def defer_vocoder(self, req: RequestState, new_frames: int, final: bool) -> bool:
        """Whether the vocoder leaves this chunk's ``new_frames`` mel frames for its next
        call (``VocoderPreset.defer``, :func:`.vocoder.hift.may_defer`); also
        starts timing the next chunk."""
        now = req.now()
        since, self.last_chunk_s = now - self.last_chunk_s, now
        if final or not req.options.vocoder.defer:
            return False
        times = req.times
        per_frame = times.vocoder_s / times.vocoder_frames if times.vocoder_frames else None
        next_frames = new_frames + C.TOKEN_MEL_RATIO * self.mel.hop_tokens
        return may_defer(req.lead_s(), since, per_frame, self.vocoder.frames_for_call(next_frames))


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
        if options.read_numbers:
            self.frontend.start_warm_up()  # wetext's 0.5 s of loading, off the request path
        self.llm = LlmDecoder(model, pair_pieces=options.llm_pair_pieces)
        self.flow = FlowRunner(model)
        self.chunked = ChunkedFlows(self.flow, model, options)
        # the whole-mel graph loads on first use where the streamed vocoder serves synthesis
        self.hift = HiftRunner(lambda: model.hift, model.hift_stream)
        worker = worker_for(model.model_dir, options, model.dims.speaker_dim)
        self.voices = VoiceFeatureExtractor(model, options.voice_cache_dir, worker=worker)

    @classmethod
    def load(cls, model_dir: Path, options: EngineOptions | None = None) -> CosyVoice3Engine:
        """Load every graph of ``model_dir``.

        Raises:
            ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: see :mod:`.model`.
            ValueError: an option is out of range.
        """
        options = options or EngineOptions()
        options.validate()
        if options.observer is not None and options.observer.observes_graph_runs:
            set_run_observer(options.observer.graph_run)
        started = time.perf_counter()
        engine = cls(CosyVoice3Model.load(Path(model_dir), options), options)
        return_freed_memory()  # parsed ONNX protobufs are freed once the sessions exist
        logger.debug("engine loaded from %s in %.2f s", model_dir, time.perf_counter() - started)
        return engine

    def prepare_voice(
        self,
        clip_path: Path,
        transcript: str | None = None,
        instruction: str | None = None,
        name: str = "voice",
    ) -> VoicePrompt:
        """Compute (or load from the cache) the features of a reference clip
        (:meth:`.voice.prepare.VoiceFeatureExtractor.prepare`)."""
        started = time.perf_counter()
        voice = self.voices.prepare(Path(clip_path), transcript, instruction, name)
        if self.options.observer is not None:
            self.options.observer.voice_prepared(name, time.perf_counter() - started)
        return voice

    def release_voice_encoders(self) -> None:
        """Free the voice encoders now (see
        :meth:`.voice.prepare.VoiceFeatureExtractor.release_encoders`)."""
        self.voices.release_encoders()

    def close(self) -> None:
        """Stop the voice encoder process (a voice preparation in flight fails)."""
        self.voices.close()

    def warm_up(self, voice: VoicePrompt, options: SynthesisOptions | None = None) -> None:
        """Run one short synthesis so onnxruntime allocates its buffers before real requests.

        Pass the options requests will use (the server's preset); by default the estimator
        precision loaded at start. An estimator precision not loaded yet is loaded (and
        derived, once) here instead of in the first request (the streaming DiT computes the
        time conditioning of every preset's Euler schedule when it opens), and the voice's
        prefix KV is cached. With ``flow.chunk_causal`` the voice's prompt key/value cache is
        computed here too.
        """
        started = time.perf_counter()
        base = options or SynthesisOptions().replace(
            flow={"precision": self.options.flow.precision})
        self.model.estimator_for(base.flow.precision)
        self.chunked.warm_up(base.flow, voice.features)  # then cached on disk
        warm = base.replace(max_decode_tokens=min(base.max_decode_tokens, 50))
        for _ in self.synthesize(WARM_UP_TEXT, voice, warm):
            pass
        logger.debug("warm-up done in %.2f s", time.perf_counter() - started)

    # -- text -------------------------------------------------------------------------------
    def text_token_count(self, text: str) -> int:
        """Number of LLM text tokens of ``text`` as user text, before normalisation
        (:meth:`.text.frontend.TextFrontend.text_token_count`)."""
        return self.frontend.text_token_count(text)

    def plan_pieces(
        self,
        text: str,
        language_hint: str | None = None,
        max_piece_tokens: int | None = None,
        read_numbers: bool = True,
    ) -> list[PlannedPiece]:
        """The pieces :meth:`synthesize` cuts ``text`` into with the same options
        (``SynthesisOptions.language_hint``, ``max_piece_tokens``, ``read_numbers``), each
        with its text-token count; nothing is synthesised.

        Returns:
            Pieces in order; ``[]`` when nothing is speakable
            (:meth:`.text.frontend.TextFrontend.split_pieces`).

        Raises:
            TextError: ``text`` is not a ``str``.
        """
        frontend = self.frontend
        pieces = frontend.split_pieces(text, language_hint, max_piece_tokens, read_numbers)
        return [PlannedPiece(piece, frontend.text_token_count(piece)) for piece in pieces]

    # -- synthesis --------------------------------------------------------------------------
    def synthesize(
        self,
        text: str | Sequence[PlannedPiece],
        voice: VoicePrompt,
        options: SynthesisOptions | None = None,
        should_stop: ShouldStop | None = None,
        result: SynthesisResult | None = None,
        more: MorePieces | None = None,
    ) -> Iterator[AudioChunk]:
        """Synthesise ``text`` with ``voice``, yielding 24 kHz chunks as soon as they exist.

        Args:
            text: any text (normalised and cut into pieces here; pieces with nothing
                speakable are skipped, no chunk at all when the whole text is unspeakable),
                or the pieces :meth:`plan_pieces` returned for it, spoken as planned (the text
                is not normalised or cut again; ``language_hint``, ``max_piece_tokens`` and
                ``read_numbers`` of ``options`` were the plan's).
            voice: a prepared voice.
            options: per-request options (validated here).
            should_stop: checked before every model step (LLM step, flow encoder, Euler step,
                vocoder); True raises :class:`SynthesisCancelled`.
            result: filled with timings and the audio length while the request runs.
            more: text that arrives while the request runs: called once the LLM has decoded
                every piece so far (in the decoding thread with ``split_cores``), before the
                last of them ends; returns further pieces, as :meth:`plan_pieces` returns
                them, to speak in this request, or an empty sequence to end it. Where two
                pieces decode at once (:mod:`.llm.tokens`) it is also called while the last
                piece decodes alone, where an empty sequence means nothing came yet; it must
                return at once. The LLM then
                goes on decoding while the flow and vocoder finish the pieces before, where a
                request of its own would wait for them. The request's random streams go on
                too, so the audio is that of one request given all its pieces at once (with
                ``flow.whole_middle_pieces``, a piece that was the last when it began is
                streamed in chunks instead of made whole).

        Yields:
            :class:`AudioChunk` objects; the last has ``is_last`` True (a zero-length chunk when
            the last piece produced no audio after earlier pieces did).

        Raises:
            SynthesisCancelled, SynthesisTimeout, SynthesisFailed; ValueError for bad options;
            TextError: ``text`` is neither a ``str`` nor a sequence of :class:`PlannedPiece`,
            or ``more`` returned something else.
        """
        options = options or SynthesisOptions()
        options.validate()  # before the first chunk is asked for: bad options fail at the call
        if not isinstance(text, str):
            text = _checked_plan(text)
        return self._synthesize(text, voice, options, should_stop, result or SynthesisResult(),
                                more)

    def _synthesize(
        self,
        text: str | tuple[PlannedPiece, ...],
        voice: VoicePrompt,
        options: SynthesisOptions,
        should_stop: ShouldStop | None,
        result: SynthesisResult,
        more: MorePieces | None,
    ) -> Iterator[AudioChunk]:
        req = RequestState.create(options, should_stop, result)
        try:
            yield from self._run(text, voice, req, more)
        finally:
            req.result.total_s = req.now()
            req.result.audio_s = req.samples_out / C.OUTPUT_SAMPLE_RATE_HZ
            if self.options.observer is not None:
                spoken = text if isinstance(text, str) else " ".join(p.text for p in text)
                self.options.observer.request_finished(spoken, req.result)
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
            # the request's flow history, vocoder and graph buffers are freed by now; hand
            # the freed heap pages back (glibc keeps them mapped otherwise; a few ms)
            return_freed_memory()

    def _run(self, text: str | tuple[PlannedPiece, ...], voice: VoicePrompt,
             req: RequestState, more: MorePieces | None) -> Iterator[AudioChunk]:
        observer = self.options.observer
        pieces: list[str] = []
        prompts: list[LlmPrompt] = []
        fixed_tokens: list[int | None] = []

        def add(texts: list[str]) -> None:
            """Append pieces with their LLM prompts (and the benchmark's fixed lengths)."""
            for piece in texts:
                pieces.append(piece)
                prompts.append(self.frontend.build_prompt(piece, voice))
                fixed_tokens.append(None if observer is None
                                    else observer.fixed_speech_tokens(piece))
            req.result.pieces = len(pieces)

        def take_more() -> None:  # in the decoding thread (piece_tokens)
            assert more is not None
            began = req.now()
            add([planned.text for planned in _checked_plan(more())])
            req.times.frontend_s += req.now() - began

        started = req.now()
        if isinstance(text, str):
            add(self.frontend.split_pieces(text, req.options.language_hint,
                                           req.options.max_piece_tokens,
                                           req.options.read_numbers))
        else:  # planned by the caller through plan_pieces: normalised and cut once
            add([piece.text for piece in text])
        req.times.frontend_s += req.now() - started
        req.event("frontend", started)
        if not pieces:
            return
        flow = FlowRequest(self.chunked, req.options.flow, voice.features, req.flow_noise,
                           req.options.streaming)
        piece: PieceState | None = None
        progress = DecodeProgress()
        # with split_cores the tokens come from a decoding thread; leaving this block in any
        # way (end, error, cancellation, the caller closing the generator) stops and joins it
        with request_tokens(self.llm, prompts, fixed_tokens, req, self.options.split_cores,
                            None if more is None else take_more, progress) as stream:
            for index, token in stream:
                if piece is None:
                    piece = self._new_piece(index, req, flow.piece(0 < index < len(pieces) - 1))
                    logger.debug("piece %d (%s): %r", index, prompts[index].mode, pieces[index])
                left_s: float | None = None  # (a piece's last chunk says 0)
                decoded_s = 0.0
                if token is not None:
                    piece.received_tokens += 1
                    samples = self._accept(piece, token, req)
                    final = False
                    next_s = piece.mel.hop_tokens / C.SPEECH_TOKEN_RATE_HZ / req.options.speed
                    if samples is not None:
                        piece.samples_out += len(samples)
                        left_s = piece.left_s(progress, req.options.speed)
                        decoded_s = piece.decoded_s(progress, req.options.speed)
                else:  # end of the piece: flush every remaining token
                    samples = self._flush(piece, req)
                    final, piece, next_s = True, None, 0.0
                if samples is not None:
                    is_last = final and index == len(pieces) - 1
                    chunk = self._chunk(samples, req, index, is_last, next_s, final,
                                        left_s, progress.finished, decoded_s)
                    if chunk is not None:
                        yield chunk
        if req.chunks_out and not req.last_sent:
            # the last piece produced no audio: close the stream with an empty last chunk
            yield self._make_chunk(np.zeros(0, dtype=np.float32), req, len(pieces) - 1, True,
                                   piece_done=True)

    def _new_piece(self, index: int, req: RequestState, mel: MelStream) -> PieceState:
        return PieceState(
            last_chunk_s=req.now(),
            index=index,
            mel=mel,
            resampler=SpeedResampler(req.options.speed),
            vocoder=VocoderStream(
                self.hift, req.vocoder_noise, window_frames=req.options.vocoder_window_frames
            ),
        )

    def _accept(
        self, piece: PieceState, token: int, req: RequestState
    ) -> npt.NDArray[np.float32] | None:
        """Take one LLM token (silent-run filter); run a chunk once hop + lookahead are in."""
        if not piece.silent_filter.accept(token):
            return None
        if piece.mel.push(token):
            return self._advance(piece, req, final=False)
        return None

    def _flush(self, piece: PieceState, req: RequestState) -> npt.NDArray[np.float32] | None:
        """The piece's last chunk (None when the LLM produced no speech tokens)."""
        if not piece.mel.tokens:
            logger.debug("piece %d: no speech tokens; flow and vocoder skipped", piece.index)
            return None
        return self._advance(piece, req, final=True)

    def _advance(
        self, piece: PieceState, req: RequestState, final: bool
    ) -> npt.NDArray[np.float32]:
        """The piece's next chunk: its mel frames, then the vocoder on them."""
        offset = piece.mel.offset_tokens
        began = req.now()
        new_mel = piece.mel.next_mel(final, req.check, req.times)
        req.event("flow", began)
        resampled = piece.resampler.push(new_mel, final)
        began = req.now()
        calls = req.times.vocoder_calls
        defer = piece.defer_vocoder(req, resampled.shape[1], final)
        samples = piece.vocoder.push(resampled, final, req.check, req.times, defer)
        if req.times.vocoder_calls != calls:
            req.event("vocoder", began)
        logger.debug(
            "piece %d chunk: tokens %d..%d%s -> %d mel frames -> %d samples",
            piece.index,
            offset,
            piece.mel.offset_tokens,
            " (final)" if final else "",
            new_mel.shape[1],
            len(samples),
        )
        return samples

    def _chunk(
        self, samples: npt.NDArray[np.float32], req: RequestState, index: int, is_last: bool,
        next_chunk_s: float, piece_done: bool, piece_left_s: float | None = None,
        decoding_done: bool = False, piece_decoded_s: float = 0.0,
    ) -> AudioChunk | None:
        if len(samples) == 0 and not is_last:
            return None
        if len(samples) == 0 and req.chunks_out == 0:
            return None
        return self._make_chunk(samples, req, index, is_last, next_chunk_s, piece_done,
                                piece_left_s, decoding_done, piece_decoded_s)

    def _make_chunk(
        self, samples: npt.NDArray[np.float32], req: RequestState, index: int, is_last: bool,
        next_chunk_s: float = 0.0, piece_done: bool = False, piece_left_s: float | None = None,
        decoding_done: bool = False, piece_decoded_s: float = 0.0,
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
            next_chunk_s=next_chunk_s,
            piece_done=piece_done,
            piece_left_s=0.0 if piece_done else piece_left_s,
            decoding_done=decoding_done,
            piece_decoded_s=0.0 if piece_done else piece_decoded_s,
        )


def _checked_plan(plan: object) -> tuple[PlannedPiece, ...]:
    """``plan`` as a tuple of :class:`PlannedPiece`.

    Raises:
        TextError: ``plan`` is not a sequence of :class:`PlannedPiece`.
    """
    if not isinstance(plan, Sequence) or not all(isinstance(p, PlannedPiece) for p in plan):
        raise TextError("text must be a str or the pieces plan_pieces returned, got "
                        f"{type(plan).__name__}")
    return tuple(plan)
