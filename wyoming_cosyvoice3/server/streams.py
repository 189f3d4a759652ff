"""Streaming requests: ``synthesize-start`` / ``synthesize-chunk``... / ``synthesize-stop``.

The read loop feeds text into a :class:`StreamRequest`: markdown is turned into speech text
by :class:`~..engine.text.markdown.MarkdownSpeech` (which holds back markers split across
chunks), and sentence boundaries are found by :class:`~.streaming_text.SentenceBuffer`;
the connection's worker runs :func:`run_stream`,
which speaks each complete sentence as soon as it is queued, while later text still arrives.
Sentences that are already queued when the worker turns to the next one are spoken as one
engine request, up to :data:`MERGE_BUDGET_S` of expected speech (fewer LLM prefills of the
voice prompt, fewer first hops); the first sentence never waits for another. Sentences queued
while a request runs join it when its LLM has decoded the text it had (:class:`FollowUp`).
The whole response is one ``audio-start`` (24000 Hz, 16 bit, mono), the audio of every
sentence, one ``audio-stop`` and ``synthesize-stopped`` -- also after an error, so a client
such as Home Assistant, which waits for ``synthesize-stopped``, is never left hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from wyoming.audio import AudioStop
from wyoming.tts import SynthesizeStopped

from ..engine.errors import CosyVoiceError, TextError, TextTooLong
from ..engine.text.markdown import MarkdownSpeech
from ..engine.text.normalize import language_cues, winner
from ..engine.text.pieces import PlannedPiece
from .preroll import PieceGate, expected_speech_s
from .protocol import ClientGone, EventSink, RequestStats, SpeakRequest, check_chunk_text
from .runtime import ServerRuntime
from .speech import (
    INTERNAL_ERROR,
    audio_start,
    finish_gate,
    first_pieces,
    note_first_chunk,
    piece_bound_s,
    piece_gate,
    planned_pieces,
    speak,
    voice_or_error,
)
from .streaming_text import SentenceBuffer
from .voice_table import VoiceSlot

_LOGGER = logging.getLogger(__name__)

MERGE_BUDGET_S = 20.0
"""Longest expected speech of sentences merged into one engine request: about upstream's
80-token piece (utils/frontend_utils.py split_paragraph ``token_max_n``; 80 tokens are about
320 English characters = 23 s at 14 characters/s, or 80 CJK characters = 20 s)."""

INLINE_CHUNK_CHARS = 256
"""Chunks up to this size are converted on the event loop (at most ~20 ms of work)."""


@dataclass(frozen=True)
class StreamText:
    """A complete sentence and when it became complete (``time.monotonic()``)."""

    text: str
    queued_at: float


@dataclass(frozen=True)
class StreamError:
    """A problem with the streamed input, reported in order with the audio."""

    code: str
    text: str


@dataclass
class StreamRequest:
    """Per-request state of one streaming request (created at ``synthesize-start``).

    Attributes:
        request: the checked ``synthesize-start`` (voice; ``problem`` when it was bad).
        buffer: speech text received but not yet a complete sentence.
        markdown: the markdown-to-speech pass of this stream (holds back unfinished markup).
        max_chars: the text limit of this stream (``max_text_chars``).
        items: sentences / errors for the worker, ended by None.
        cancelled: set when the client left mid-stream; stops the current synthesis.
        waiting_for_text: True while the worker has spoken everything and waits for more
            text (the connection then counts as idle).
    """

    request: SpeakRequest
    buffer: SentenceBuffer
    max_chars: int
    items: asyncio.Queue[StreamText | StreamError | None] = field(
        default_factory=asyncio.Queue
    )
    cancelled: threading.Event = field(default_factory=threading.Event)
    markdown: MarkdownSpeech = field(default_factory=MarkdownSpeech)
    received_chars: int = 0
    """Characters of ``synthesize-chunk`` text received (the limit counts these)."""
    first_text_at: float | None = None
    """``time.monotonic()`` when the first non-empty ``synthesize-chunk`` arrived: the answer
    has started for the listener, and the first audio limit counts from here."""
    _converting: bool = False
    failed: bool = False
    finished: bool = False
    waiting_for_text: bool = False
    carry: StreamText | StreamError | None = None
    """An item taken from ``items`` while merging that did not fit; it comes next."""
    has_carry: bool = False
    cues: Counter[str] = field(default_factory=Counter)
    """Language votes of the sentences spoken so far
    (:func:`~..engine.text.normalize.language_cues`)."""
    voice_language: str | None = None
    """The chosen voice's first language, the hint when neither the stream nor the request
    names one (set when the voice is chosen)."""

    def language_hint(self, text: str) -> str | None:
        """The language hint for the next engine request, whose text is ``text``: the
        language the stream so far (``text`` included) reads in, else the requested voice
        language (Home Assistant sends none), else the voice's first language. The engine's
        normaliser uses it only for a sentence that has no cue of its own, so "Kitchen,
        21 °C." after "Here are the temperatures:" reads its number as the one-shot answer
        would (the one-shot text gives its earlier sentences' votes as the same context)."""
        self.cues.update(language_cues(text))
        return winner(self.cues) or self.request.voice.language or self.voice_language

    def text_may_follow(self) -> bool:
        """Whether more text can still reach the worker: the stream has not ended, or items
        besides its end marker are queued or carried."""
        return (not self.finished or self.items.qsize() > 1
                or (self.has_carry and isinstance(self.carry, StreamText)))

    async def next_item(self) -> StreamText | StreamError | None:
        """The next item: the carried one, else the next of ``items`` (waits for it)."""
        if self.has_carry:
            self.has_carry = False
            return self.carry
        return await self.items.get()

    def merge_queued(self, first: StreamText, budget_s: float = MERGE_BUDGET_S) -> StreamText:
        """``first`` joined with the sentences already queued behind it, while the text's
        expected speech stays within ``budget_s``; never waits for text.

        One engine request for several short sentences means fewer LLM prefills of the
        voice prompt and fewer restarts of the first hop (the engine still cuts the text
        into pieces of at most 80 + 20 text tokens).
        """
        text = first.text
        for _ in range(self.items.qsize()):
            if self.has_carry:
                break
            item = self.items.get_nowait()
            joined = f"{text} {item.text}" if isinstance(item, StreamText) else ""
            if not joined or expected_speech_s(joined) > budget_s:
                self.carry, self.has_carry = item, True
                break
            text = joined
        return StreamText(text, first.queued_at)

    @property
    def max_items(self) -> int:
        """Most items the stream can ever queue: each sentence holds at least one of the
        ``max_chars`` characters, plus one error and the end marker."""
        return self.max_chars + 2

    async def add_text(self, data: dict[str, Any]) -> None:
        """Take one ``synthesize-chunk``; queue the sentences it completes.

        A chunk longer than ``INLINE_CHUNK_CHARS`` is converted in a worker thread (hostile
        markdown costs up to about 65 µs per character; the event loop serves every
        connection). The read loop awaits this, so chunks stay in order.
        """
        if self.finished or self.failed:
            return
        try:
            text = check_chunk_text(data)
        except TextError as err:
            self.add_problem(err.code, str(err))
            return
        if self.received_chars + len(text) > self.max_chars:
            self.add_problem(TextTooLong.code, f"the streamed text exceeds the limit of "
                             f"{self.max_chars} characters; the rest of this response is "
                             "dropped (raise --max-text-chars)")
            return
        self.received_chars += len(text)
        if text and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        self._converting = True
        try:
            if len(text) <= INLINE_CHUNK_CHARS:
                speech = self.markdown.feed(text)
            else:
                speech = await asyncio.to_thread(self.markdown.feed, text)
        except Exception:  # a bug in the conversion ends this response, not the connection
            self._conversion_failed()
            return
        finally:
            self._converting = False
        if not (self.finished or self.failed):
            self._queue(speech)

    def _conversion_failed(self) -> None:
        _LOGGER.exception("The markdown conversion of a stream failed")
        self.add_problem(INTERNAL_ERROR, "the server failed unexpectedly; see its log")

    def _queue(self, speech: str) -> None:
        now = time.monotonic()
        for sentence in self.buffer.add(speech):
            self.items.put_nowait(StreamText(sentence, now))

    def add_problem(self, code: str, text: str) -> None:
        """Report the first problem of this stream in order with its audio; the text after
        it is dropped (the response ends with the error)."""
        if not self.finished and not self.failed:
            self.failed = True
            self.items.put_nowait(StreamError(code, text))

    def expire(self, code: str, text: str) -> None:
        """The client sent nothing for too long: report ``code``, drop the unspoken tail and
        end the response (``audio-stop`` + ``synthesize-stopped``)."""
        self.add_problem(code, text)
        self.finish()

    def finish(self) -> None:
        """``synthesize-stop``: queue the unfinished tail, then the end marker."""
        if self.finished:
            return
        if not self.failed and not self._converting:  # (shutdown during a conversion)
            try:
                self._queue(self.markdown.flush())
            except Exception:
                self._conversion_failed()
        self.finished = True
        tail = self.buffer.flush()
        if tail and not self.failed:
            self.items.put_nowait(StreamText(tail, time.monotonic()))
        self.items.put_nowait(None)

    def abandon(self) -> None:
        """The client left without ``synthesize-stop``: stop speaking, drop the rest."""
        self.cancelled.set()
        if not self.finished:
            self.finished = True
            self.items.put_nowait(None)


class FollowUp:
    """The engine's ``more`` for one engine request of a stream: the sentences queued since
    it began, handed over once the LLM has decoded what the request had, so that the
    decoding goes on while the flow and vocoder finish the request's last piece (a request
    of their own would wait for them, about 2 s of an idle LLM per request on a 2-core
    machine). Called from an engine thread; the taking runs on the event loop.

    Hands over the queued sentences merged as :meth:`StreamRequest.merge_queued` merges
    them, planned with the bound of the moment, and tells the gate their expected speech;
    stops at an error or the end marker (they come after the request, in order), when the
    stream is abandoned or the server stops, and once the request has run half the time
    limit (``max_request_s`` counts per request). Nothing is taken that is not spoken: a
    sentence the engine cannot plan is left for a request of its own, which reports why.
    """

    def __init__(self, runtime: ServerRuntime, stream: StreamRequest, gate: PieceGate,
                 stats: RequestStats, loop: asyncio.AbstractEventLoop) -> None:
        self.runtime = runtime
        self.stream = stream
        self.gate = gate
        self.stats = stats
        self.loop = loop
        self.deadline = time.monotonic() + runtime.settings.limits.max_request_s / 2

    def __call__(self) -> list[PlannedPiece]:
        """The pieces to speak next in the request (engine thread); [] ends it."""
        taken: concurrent.futures.Future[list[PlannedPiece]] = concurrent.futures.Future()

        def take() -> None:
            if taken.set_running_or_notify_cancel():
                try:
                    taken.set_result(self._take())
                except BaseException as err:  # handed to the engine thread, which fails
                    taken.set_exception(err)

        try:
            self.loop.call_soon_threadsafe(take)
        except RuntimeError:  # the event loop is closed: the server is gone
            return []
        try:
            return taken.result(timeout=FOLLOW_UP_WAIT_S)
        except concurrent.futures.TimeoutError:
            if taken.cancel():  # never ran: nothing was taken
                return []
            return taken.result()  # it ran meanwhile; it never waits

    def _take(self) -> list[PlannedPiece]:
        """Take and plan the queued sentences (event loop; never awaits)."""
        stream, runtime = self.stream, self.runtime
        engine = runtime.loader.engine
        if (engine is None or stream.cancelled.is_set() or runtime.stopping.is_set()
                or time.monotonic() > self.deadline):
            return []
        if stream.has_carry:
            item = stream.carry
        elif not stream.items.empty():
            item = stream.items.get_nowait()
            stream.carry, stream.has_carry = item, True
        else:
            return []
        if not isinstance(item, StreamText):
            return []  # an error or the end: after this request
        stream.has_carry = False
        merged = stream.merge_queued(item)
        try:
            plan = planned_pieces(engine, merged.text, stream.language_hint(merged.text),
                                  piece_bound_s(runtime, self.gate),
                                  runtime.loader.request_options().read_numbers)
        except CosyVoiceError:
            stream.carry, stream.has_carry = merged, True  # its own request reports it
            return []
        self.stats.chars += len(merged.text)
        self.stats.sentences += 1
        if plan.pieces:
            self.gate.add_pieces(plan.expected_s)
        return plan.pieces or []


FOLLOW_UP_WAIT_S = 5.0
"""Longest wait of an engine thread for the event loop to hand over a stream's next sentences
(the taking itself never waits: a busy loop answers within milliseconds)."""


async def run_stream(runtime: ServerRuntime, sink: EventSink, stream: StreamRequest) -> None:
    """Answer one streaming request, writing its events to ``sink`` (see module docstring).

    Raises:
        ClientGone: the client disconnected.
    """
    stats = RequestStats(kind="stream")
    slot = await voice_or_error(runtime, sink, stream.request)
    failed = slot is None
    if slot is not None:
        stats.voice = slot.entry.name
        stream.voice_language = slot.entry.languages[0] if slot.entry.languages else None
    await sink.send(audio_start().event())
    outcome = "failed" if failed else "done"
    gate = piece_gate(runtime, sink)
    gate.text_may_follow = stream.text_may_follow
    try:
        failed, outcome = await _speak_items(runtime, sink, stream, slot, stats, gate, failed,
                                             outcome)
    finally:
        await finish_gate(runtime, gate, sink)
    if stream.cancelled.is_set():
        outcome = "abandoned (no synthesize-stop)"
    await sink.send(AudioStop().event())
    await sink.send(SynthesizeStopped().event())
    stats.log(outcome)


async def _speak_items(
    runtime: ServerRuntime, sink: EventSink, stream: StreamRequest, slot: VoiceSlot | None,
    stats: RequestStats, gate: PieceGate, failed: bool, outcome: str,
) -> tuple[bool, str]:
    """Speak the stream's sentences until its end marker; returns (failed, outcome)."""
    for _ in range(stream.max_items):  # ends at the None marker
        stream.waiting_for_text = True
        try:
            item = await stream.next_item()
        finally:
            stream.waiting_for_text = False
        if item is None:
            break
        if stream.cancelled.is_set():
            continue
        if isinstance(item, StreamError):
            if not failed:
                await gate.release()
                await sink.send_error(item.code, item.text)
                failed, outcome = True, f"failed [{item.code}]"
            continue
        if not failed and slot is not None:
            item = stream.merge_queued(item)
        stats.chars += len(item.text)  # counted even when not spoken: the log shows the input
        if failed or slot is None:
            continue
        if gate.first_audio_from is None:
            gate.first_audio_from = stream.first_text_at or item.queued_at
        try:
            hint = stream.language_hint(item.text)
            more = FollowUp(runtime, stream, gate, stats, asyncio.get_running_loop())
            await speak(runtime, sink, first_pieces(runtime, gate, item.text), slot, stats,
                        item.queued_at, stream.cancelled, gate=gate, language_hint=hint,
                        more=more)
            if stream.items.empty() and not stream.has_carry:  # waiting for text: holding
                # audio back gains nothing
                await gate.release()
                note_first_chunk(stats, gate, item.queued_at)
        except ClientGone:
            stats.log("cancelled (client gone)")
            raise
        except CosyVoiceError as err:
            await gate.release()  # the audio made before the error comes first
            await sink.send_error(err.code, str(err))
            failed, outcome = True, f"failed [{err.code}]"
        except Exception:  # a bug must not leave the client without synthesize-stopped
            _LOGGER.exception("Synthesis for %s failed unexpectedly", sink.peer)
            await gate.release()
            await sink.send_error(INTERNAL_ERROR, "the server failed unexpectedly; see its "
                                     "log")
            failed, outcome = True, f"failed [{INTERNAL_ERROR}]"
    return failed, outcome
