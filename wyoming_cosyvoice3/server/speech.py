"""Speaking one text on a connection, and the one-shot ``synthesize`` request.

A one-shot response is ``audio-start``, ``audio-chunk``..., ``audio-stop``. When it fails the
client gets a coded ``error`` and then ``audio-stop`` as well: Home Assistant's one-shot client
(``homeassistant/components/wyoming/tts.py``, ``async_get_tts_audio``) skips ``error`` events
and reads until ``audio-stop`` or the end of the connection, so an ``error`` alone would leave
it waiting; with the ``audio-stop`` it returns at once with the audio received so far (none
when the request failed before audio), while other clients still read the coded error.

The text of every request goes through the markdown-to-speech pass
(:mod:`..engine.text.markdown`) before synthesis.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from wyoming.audio import AudioChunk as WyomingAudioChunk
from wyoming.audio import AudioStart, AudioStop

from ..engine.constants import (
    DEFAULT_MAX_PIECE_TOKENS,
    OUTPUT_SAMPLE_RATE_HZ,
    SPEECH_TOKEN_RATE_HZ,
)
from ..engine.errors import CosyVoiceError, EmptyText, SynthesisCancelled, SynthesisTimeout
from ..engine.options import AudioChunk
from ..engine.text.markdown import markdown_to_speech
from ..engine.text.normalize import language_cues, winner
from ..engine.text.pieces import (
    SENTENCE_MARKS,
    MorePieces,
    PlannedPiece,
    cut_after_marks,
    split_first_clause,
)
from .engine_port import PiecePlanner
from .preroll import (
    FIRST_PIECE_MAX_S,
    FIRST_PIECE_MIN_S,
    LENGTH_MARGIN,
    RATE_MARGIN,
    PieceGate,
    expected_speech_s,
    first_piece_release_s,
    piece_limit_s,
)
from .protocol import (
    CHANNELS,
    SAMPLE_WIDTH_BYTES,
    ClientGone,
    EventSink,
    RequestStats,
    SpeakRequest,
    pcm16,
)
from .runtime import ServerRuntime
from .voice_table import VoiceSlot

_LOGGER = logging.getLogger(__name__)

INTERNAL_ERROR = "internal-error"


async def speech_text(raw: str) -> str:
    """``raw`` (markdown, as conversation agents write it) as the text the engine speaks
    (:func:`~..engine.text.markdown.markdown_to_speech`, stripped). Runs in a thread:
    10,000 characters of hostile markup take up to about a second, and ``describe`` must
    stay answered."""
    return (await asyncio.to_thread(markdown_to_speech, raw)).strip()


def text_language(text: str, requested: str | None, slot: VoiceSlot) -> str | None:
    """The language hint of a one-shot text: the language the whole text reads in (so that
    both engine requests of a first piece cut off it read alike), else the requested voice
    language, else the voice's first language; the normaliser uses it only for sentences
    without a cue of their own (:func:`~..engine.text.normalize.reading_language`)."""
    return (winner(language_cues(text)) or requested
            or (slot.entry.languages[0] if slot.entry.languages else None))


def audio_start() -> AudioStart:
    """The one audio format of every response: 24000 Hz, 16 bit, mono."""
    return AudioStart(rate=OUTPUT_SAMPLE_RATE_HZ, width=SAMPLE_WIDTH_BYTES, channels=CHANNELS)


async def voice_or_error(runtime: ServerRuntime, sink: EventSink,
                         request: SpeakRequest) -> VoiceSlot | None:
    """The request's voice, or None after sending its ``error``: the request's own problem
    or a coded error (model not ready, unknown voice), or ``internal-error`` for any other
    exception (a bug; its traceback is logged). The caller then ends its response, so a
    bug before synthesis still gets ``audio-stop`` (and ``synthesize-stopped``).

    Raises:
        ClientGone: the client disconnected.
    """
    try:
        if request.problem is not None:
            raise request.problem
        return runtime.choose_voice(request.voice)
    except CosyVoiceError as err:
        await sink.send_error(err.code, str(err))
    except Exception:  # a bug must not leave the client without the end of its response
        _LOGGER.exception("Choosing the voice for %s failed unexpectedly", sink.peer)
        await sink.send_error(INTERNAL_ERROR, "the server failed unexpectedly; see its log")
    return None


async def speak(
    runtime: ServerRuntime, sink: EventSink, parts: Sequence[str], slot: VoiceSlot,
    stats: RequestStats, t0: float, extra_stop: threading.Event | None = None,
    gate: PieceGate | None = None, language_hint: str | None = None,
    more: MorePieces | None = None,
) -> None:
    """Synthesise ``parts`` as one engine request and send its audio-chunk events
    (audio-start already sent).

    ``parts`` are texts that read on from each other (usually one; :func:`first_pieces` cuts
    a long first sentence in two). Each is planned on its own, so that a part boundary is a
    piece boundary, and the plans are spoken as one request: with split cores the engine
    decodes the next part's tokens while the flow and vocoder still work on the part before
    (two requests would leave the decoding idle for that time).

    With ``gate`` the events go through the response's piece gate (:mod:`.preroll`), which
    may hold back each piece's audio until it can play through; ``stats.first_chunk_s`` is
    when audio was really sent.

    The wall-clock limit (``max_request_s``) counts from the first ``should_stop`` call, made
    when the request got its worker; the engine enforces the same limit, this is a backstop.

    ``extra_stop`` set (e.g. a stream abandoned without ``synthesize-stop``) stops the
    synthesis and returns normally, so the caller can still end its response.

    ``language_hint`` becomes ``SynthesisOptions.language_hint`` (the text normaliser's
    language when a text has no cue of its own; a stream passes its earlier sentences'
    language). ``more`` goes to the engine: the pieces of text that came meanwhile, asked
    for while the request runs (a stream's later sentences, :mod:`.streams`).

    Raises:
        ClientGone: the client disconnected (the engine was stopped).
        CosyVoiceError: the engine failed (not for unspeakable text, which sends nothing);
            SynthesisTimeout past the time limit.
    """
    settings = runtime.settings
    samples_per_chunk = settings.samples_per_chunk
    limit_s = settings.limits.max_request_s
    options = runtime.loader.request_options()
    if language_hint is not None:
        options = options.replace(language_hint=language_hint)
    deadline: list[float] = []

    def stop() -> bool:
        if not deadline:
            deadline.append(time.monotonic() + limit_s)
        return (sink.should_stop() or (extra_stop is not None and extra_stop.is_set())
                or time.monotonic() > deadline[0])

    async def on_chunk(chunk: AudioChunk) -> None:
        pcm = pcm16(np.asarray(chunk.samples))
        step = samples_per_chunk * SAMPLE_WIDTH_BYTES
        events = [
            WyomingAudioChunk(rate=OUTPUT_SAMPLE_RATE_HZ, width=SAMPLE_WIDTH_BYTES,
                              channels=CHANNELS, audio=pcm[offset:offset + step]).event()
            for offset in range(0, len(pcm), step)
        ]
        samples = len(pcm) // SAMPLE_WIDTH_BYTES
        if gate is not None:
            await gate.audio(events, samples / OUTPUT_SAMPLE_RATE_HZ, chunk.piece_index,
                             chunk.next_chunk_s, chunk.piece_done, chunk.piece_left_s,
                             chunk.decoding_done, chunk.piece_decoded_s)
            stats.audio_samples += samples
        else:
            for event in events:
                await sink.send(event)
                stats.audio_samples += len(event.payload or b"") // SAMPLE_WIDTH_BYTES
        note_first_chunk(stats, gate, t0)

    stats.sentences += 1
    whole_middle = False  # without a gate every piece streams (nothing holds it)
    if slot.prompt is None:
        raise CosyVoiceError(f"voice {slot.entry.name!r} is not prepared")
    text = " ".join(parts)
    speech: str | list[PlannedPiece] = text
    if gate is not None:
        plans = [await plan_pieces(runtime, gate, part, options.language_hint,
                                   options.read_numbers) for part in parts]
        bounds = [plan.max_tokens for plan in plans if plan.max_tokens is not None]
        slow = piece_limit_s(gate.max_hold_s, runtime.production.rate()) is not None
        if all(plan.pieces is not None for plan in plans):
            # the engine speaks the plans: the text is cut once, each part into its own pieces
            speech = [piece for plan in plans for piece in plan.pieces or ()]
            expected = [s for plan in plans if plan.pieces for s in plan.expected_s] or [0.0]
        else:  # the engine plans (and reports its error) itself
            expected = [expected_speech_s(text)]
        if bounds:
            options = options.replace(max_piece_tokens=min(bounds))
        # synthesis is (or may be) slower than playback, so a middle piece is held until most
        # of it is made, and streaming it in chunks would only cost time; not where the
        # decoding runs beside the flow: the flow would wait for the piece's last token
        # before its first chunk, idle while the decoding goes on
        whole_middle = options.flow.whole_middle_pieces and slow and not gate.decoding_ahead
        gate.begin_text(expected,
                        options.flow.max_hop_tokens / SPEECH_TOKEN_RATE_HZ / options.speed)
    options = options.replace(flow={"whole_middle_pieces": whole_middle})
    try:
        try:
            stats.compute_s += await runtime.runner.run_synthesis(
                speech, slot.prompt, options, stop, on_chunk, more=more)
        finally:
            if gate is not None:
                gate.stop_work()
        if gate is not None:
            await gate.end_text()
    except EmptyText:
        _LOGGER.debug("Nothing speakable in %r", text[:80])
    except SynthesisCancelled:
        if sink.gone.is_set():
            raise ClientGone from None
        if extra_stop is not None and extra_stop.is_set():
            return  # the caller's request was abandoned; the client still reads its end
        if deadline and time.monotonic() > deadline[0] and not runtime.stopping.is_set():
            raise SynthesisTimeout(
                f"the synthesis took longer than {limit_s:g} s; shorten the text or raise "
                "--max-request-seconds"
            ) from None
        raise


MIN_PIECE_TOKENS = 8
"""Smallest piece bound in text tokens (about two to three words of English with the release's
tokenizer): on a very slow machine a shorter piece would not shorten the pause before it by
much and would leave single words for the LLM to speak alone."""


class PiecePlan(NamedTuple):
    """How the engine will speak one text (:func:`plan_pieces`).

    Attributes:
        max_tokens: the piece bound in text tokens (None: the engine's own bound).
        expected_s: expected seconds of speech of each piece (``[0.0]``: nothing speakable).
        pieces: the engine's plan, handed back to ``synthesize`` so that the text is
            normalised and cut once; None where the engine did not plan (not loaded, or it
            failed: the engine then plans the text itself and reports the error).
    """

    max_tokens: int | None
    expected_s: list[float]
    pieces: list[PlannedPiece] | None


def planned_pieces(engine: PiecePlanner, text: str, language_hint: str | None,
                   limit_s: float | None, read_numbers: bool = True) -> PiecePlan:
    """The piece bound in text tokens for ``limit_s`` seconds of speech (None: no bound),
    the pieces the engine cuts with it and their expected seconds (about 1 ms per 100
    characters: a worker thread's call, or on the event loop for a few sentences).

    The bound is this text's own tokens per second of expected speech times ``limit_s``,
    between :data:`MIN_PIECE_TOKENS` and upstream's ``DEFAULT_MAX_PIECE_TOKENS``; a text
    shorter than ``limit_s``, or an engine that counts no tokens, is not bounded.
    """
    max_tokens: int | None = None
    speech_s = expected_speech_s(text)
    if limit_s is not None and speech_s > limit_s:
        tokens = engine.text_token_count(text)
        if tokens is not None:
            tokens_per_s = tokens / speech_s
            max_tokens = min(max(int(limit_s * tokens_per_s), MIN_PIECE_TOKENS),
                             DEFAULT_MAX_PIECE_TOKENS)
    pieces = engine.plan_pieces(text, language_hint, max_tokens, read_numbers)
    return PiecePlan(max_tokens, [expected_speech_s(piece.text) for piece in pieces] or [0.0],
                     pieces)


DECODING_AHEAD_PIECE_S = 8.0
"""Longest expected speech of a piece when the engine decodes beside the flow
(``decoding_ahead``), seconds, at any rate: about one long sentence (the benchmark paragraph's
longest, 105 characters, expects 7.5 s), so sentences that arrive together are spoken as
pieces of their own instead of packed into upstream's 80-token pieces. A long piece's tokens
come at the decoding's pace beside the flow, each hop twice the one before, so its later
chunks fall seconds behind its playback; shorter pieces decode two at a time and start
with short hops (BENCHMARKS.md, "Sentence pieces when decoding beside the flow")."""


def piece_bound_s(runtime: ServerRuntime, gate: PieceGate) -> float | None:
    """Longest expected speech of a piece (:func:`.preroll.piece_limit_s` at the measured
    rate, at most :data:`DECODING_AHEAD_PIECE_S` with ``gate.decoding_ahead`` where pieces
    may be held, in seconds of ``expected_speech_s`` as the pieces are measured), or None: no
    bound."""
    history = runtime.production
    limit_s = piece_limit_s(gate.max_hold_s, history.rate())
    if gate.decoding_ahead and gate.max_hold_s > 0:  # never holding: pieces as upstream cuts
        limit_s = min(limit_s if limit_s is not None else DECODING_AHEAD_PIECE_S,
                      DECODING_AHEAD_PIECE_S)
    return None if limit_s is None else limit_s / history.length_ratio()


async def plan_pieces(runtime: ServerRuntime, gate: PieceGate, text: str,
                      language_hint: str | None, read_numbers: bool = True) -> PiecePlan:
    """How the engine should cut ``text`` into pieces for ``gate``, and what to expect.

    When synthesis is (or, before any measurement, may be) slower than playback, pieces are
    bounded to what one hold can cover (:func:`.preroll.piece_limit_s`, converted to text
    tokens with this text's own tokens per second of expected speech): about one sentence
    each instead of upstream's 80-token packs, so the pauses fall between sentences. Where
    the engine decodes beside the flow, pieces are bounded to about one sentence at any rate
    (:func:`piece_bound_s`).

    Returns:
        The :class:`PiecePlan`: the engine's own pieces (``Engine.plan_pieces``: normalised
        and cut, made in a worker thread, about 1 ms per 100 characters), which the request
        then synthesises as they are.
    """
    engine = runtime.loader.engine
    if engine is None:  # not loaded: the request fails when it asks for synthesis
        return PiecePlan(None, [expected_speech_s(text)], None)
    try:
        return await asyncio.to_thread(planned_pieces, engine, text, language_hint,
                                       piece_bound_s(runtime, gate), read_numbers)
    except CosyVoiceError:  # the engine reports it itself when asked to synthesise
        return PiecePlan(None, [expected_speech_s(text)], None)


def first_pieces(runtime: ServerRuntime, gate: PieceGate | None, text: str) -> list[str]:
    """``text`` as the parts of a response's first engine request (:func:`speak`): a long
    first sentence gives a short first part, cut at a clause boundary
    (:func:`~..engine.text.pieces.split_first_clause`, :data:`.preroll.FIRST_PIECE_MAX_S`),
    which becomes the request's first piece, so it can play through early. Only when audio
    may be held (``gate`` with a
    bound), nothing was produced yet, and production is not known to be faster than
    playback with the gate's margin (:data:`.preroll.RATE_MARGIN`; a fast machine keeps the
    sentence whole: one LLM pass, unbroken prosody): a rate just above 1, measured on a short
    answer, does not promise that a whole sentence is made faster than it plays
    (BENCHMARKS.md "The first sentence cut below the rate margin"). Faster than that, the
    first sentence is still cut when the gate would not release it by the first-audio limit
    (:func:`first_sentence_misses_limit`): the limit would then start it before it can play
    through, and the pauses would fall inside it (BENCHMARKS.md "A fast machine's long first
    sentence").
    """
    if gate is None or gate.max_hold_s == 0 or gate.started_at is not None:
        return [text]
    rate = runtime.production.rate()
    if (rate is not None and rate / (1.0 + RATE_MARGIN) >= 1.0
            and not first_sentence_misses_limit(runtime, gate, text, rate)):
        return [text]
    head, rest = split_first_clause(text, FIRST_PIECE_MAX_S, FIRST_PIECE_MIN_S,
                                    expected_speech_s)
    return [head, rest] if rest else [text]


def first_sentence_misses_limit(runtime: ServerRuntime, gate: PieceGate, text: str,
                                rate: float) -> bool:
    """Whether the piece gate is predicted to release the first sentence of ``text`` only
    after the first audio is due (:meth:`.preroll.PieceGate.first_audio_due_in_s`), by
    :func:`.preroll.first_piece_release_s`: the sentence's expected speech times the measured
    length ratio and :data:`.preroll.LENGTH_MARGIN`, its first chunk after the runtime's
    recent first-chunk latency (:attr:`.preroll.ProductionHistory.first_chunk_s`) with the
    preset's first hop, later chunks doubling up to its longest hop, at ``rate``. False
    while the latency or the answer's start is not known (a fresh server keeps the rule of
    :func:`first_pieces` alone)."""
    history = runtime.production
    due_in_s = gate.first_audio_due_in_s()
    if history.first_chunk_s is None or due_in_s is None:
        return False
    options = runtime.loader.request_options()
    token_s = 1.0 / SPEECH_TOKEN_RATE_HZ / options.speed
    sentences = cut_after_marks(text.strip(), SENTENCE_MARKS)
    sentence_s = (expected_speech_s(sentences[0] if sentences else text)
                  * history.length_ratio() * LENGTH_MARGIN)
    release_s = first_piece_release_s(sentence_s, rate, history.first_chunk_s,
                                      options.flow.first_hop_tokens * token_s,
                                      options.flow.max_hop_tokens * token_s)
    return release_s > due_in_s


def report_pieces(runtime: ServerRuntime, gate: PieceGate) -> None:
    """Hand the response's piece boundaries to the installed observer, if any
    (:meth:`.hooks.ServerObserver.response_pieces`)."""
    if runtime.observer is not None:
        runtime.observer.response_pieces(gate.piece_starts_samples, gate.sent_samples)


def note_first_chunk(stats: RequestStats, gate: PieceGate | None, t0: float) -> None:
    """Set ``stats.first_chunk_s`` once audio was sent (by the gate, maybe held before)."""
    if stats.first_chunk_s is not None:
        return
    if gate is None:
        stats.first_chunk_s = time.monotonic() - t0
    elif gate.first_sent_at is not None:
        stats.first_chunk_s = gate.first_sent_at - t0


def piece_gate(runtime: ServerRuntime, sink: EventSink) -> PieceGate:
    """The piece gate of one response (``--max-preroll-ms`` bounds each hold; 0 sends at
    once), measuring the rate as the engine produces (``decoding_ahead`` with split cores)."""
    return PieceGate(sink.send, runtime.settings.max_preroll_ms / 1000.0, runtime.production,
                     decoding_ahead=runtime.loader.split_cores)


async def finish_gate(runtime: ServerRuntime, gate: PieceGate, sink: EventSink) -> None:
    """Send what ``gate`` holds (unless the client is gone), stop its timer, count the
    response in the runtime's history and report its pieces to the observer, if any.

    Raises:
        ClientGone: the client disconnected while the held audio was sent.
    """
    try:
        if not sink.gone.is_set():
            await gate.release()
    finally:
        await gate.close()
        report_pieces(runtime, gate)


async def run_one_shot(runtime: ServerRuntime, sink: EventSink, request: SpeakRequest) -> None:
    """Answer one ``synthesize``: audio, or a coded ``error``; always ending with ``audio-stop``.

    Raises:
        ClientGone: the client disconnected.
    """
    stats = RequestStats(kind="synthesize")
    slot = await voice_or_error(runtime, sink, request)
    if slot is None:
        await sink.send(AudioStop().event())
        return
    stats.voice, stats.chars = slot.entry.name, len(request.text)
    await sink.send(audio_start().event())
    outcome = "done"
    gate = piece_gate(runtime, sink)
    gate.first_audio_from = request.received
    try:
        try:
            text = await speech_text(request.text)
            hint = text_language(text, request.voice.language, slot)
            await speak(runtime, sink, first_pieces(runtime, gate, text), slot, stats,
                        request.received, gate=gate, language_hint=hint)
        finally:
            await finish_gate(runtime, gate, sink)  # the audio made so far, also on error
        note_first_chunk(stats, gate, request.received)
    except ClientGone:
        stats.log("cancelled (client gone)")
        raise
    except CosyVoiceError as err:
        outcome = f"failed [{err.code}]"
        await sink.send_error(err.code, str(err))
    except Exception:  # a bug must not leave the client without its audio-stop
        _LOGGER.exception("Synthesis for %s failed unexpectedly", sink.peer)
        outcome = f"failed [{INTERNAL_ERROR}]"
        await sink.send_error(INTERNAL_ERROR, "the server failed unexpectedly; see its log")
    await sink.send(AudioStop().event())
    stats.log(outcome)
