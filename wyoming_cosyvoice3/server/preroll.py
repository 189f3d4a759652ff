"""Adaptive pre-roll: hold back the first audio of a response until playback will not run dry.

Home Assistant's satellites start playing at the first ``audio-chunk`` and play 1 s of audio
per second. When the server produces audio more slowly than that, a player that starts at once
runs dry (a stall) again and again; a player that starts later, with audio in hand, does not.

Model (constant production rate): ``r`` = audio seconds produced per wall-clock second of this
response so far (from the start of its synthesis, so the first-chunk latency counts), ``A`` =
seconds of audio held, ``R`` = seconds of audio still to come. Starting playback now, the last
sample is produced ``R / r`` seconds from now and played ``A + R`` seconds from now, and earlier
samples are further ahead, so playback never runs dry when ``A >= R (1 / r - 1)``; with
``r >= 1`` it never does. Audio comes in engine chunks, each usable only once complete, so one
chunk's duration ``d`` (the longest seen so far) is added: ``A >= R (1 / r - 1) + d``. ``R`` =
the expected length of the whole text minus what was produced; the expected length comes from
the characters of the text received so far at :data:`LATIN_CHARS_PER_S` /
:data:`CJK_CHARS_PER_S`.

The first audio is held until that holds, until the synthesis has produced everything (or
waits for more streamed text), or until ``max_preroll_s`` after the first audio was produced,
whichever comes first; from then on every chunk is sent as soon as it exists. The bound keeps
the added first-audio latency bounded (``--max-preroll-ms``; 0 disables the pre-roll).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from wyoming.event import Event

from .output import ClientGone

_LOGGER = logging.getLogger(__name__)

LATIN_CHARS_PER_S = 14.0
"""Characters of non-CJK text per second of speech, on the slow side of read English
(about 150 words/min x 5.5-6 characters with the blank = 14-15 characters/s; the benchmark
decodes 15 characters/s), so the expected length errs long and the pre-roll errs safe."""
CJK_CHARS_PER_S = 4.0
"""Han, kana and hangul characters per second of speech (read Mandarin: about 4-5 syllables/s,
one character each), on the slow side for the same reason."""


def expected_speech_s(text: str) -> float:
    """Expected seconds of speech for ``text`` (see the module constants); >= 0."""
    cjk = sum(
        1 for c in text
        if "\u3040" <= c <= "\u30ff" or "\u3400" <= c <= "\u9fff" or "\uac00" <= c <= "\ud7af"
    )
    other = sum(1 for c in text if not c.isspace()) - cjk
    return cjk / CJK_CHARS_PER_S + max(other, 0) / LATIN_CHARS_PER_S


def needed_preroll_s(
    produced_s: float, elapsed_s: float, expected_s: float, chunk_s: float = 0.0
) -> float:
    """Audio seconds that must be in hand before playback starts (``R (1 / r - 1) + d``).

    Args:
        produced_s: audio produced so far, seconds.
        elapsed_s: wall-clock seconds of production so far (> 0).
        expected_s: expected audio of the whole response, seconds.
        chunk_s: ``d``, the duration of the longest chunk so far, seconds.

    Returns:
        0 when production keeps up (``r >= 1``) or nothing remains; ``inf`` before any audio.
    """
    if produced_s <= 0.0:
        return float("inf")
    remaining_s = max(expected_s - produced_s, 0.0)
    rate = produced_s / max(elapsed_s, 1e-9)
    if rate >= 1.0 or remaining_s == 0.0:
        return 0.0
    return remaining_s * (1.0 / rate - 1.0) + chunk_s


class PrerollGate:
    """Per-response gate between the synthesis and the connection (one per request).

    Args:
        send: writes one event to the client (``EventSink.send``).
        max_preroll_s: longest hold after the first audio was produced; 0 = never hold.
        expected_speech_s: callable giving the expected audio seconds of the whole response
            (called at each decision: a stream's text grows while it plays).
        clock: monotonic seconds (tests may pass their own).

    Attributes:
        first_sent_at: ``clock()`` when the first audio was sent, or None.
        held_s: seconds the first audio was held (0 until it was sent).
    """

    def __init__(
        self,
        send: Callable[[Event], Awaitable[None]],
        max_preroll_s: float,
        expected_speech_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_preroll_s < 0:
            raise ValueError(f"max_preroll_s must be >= 0, got {max_preroll_s}")
        self._send = send
        self.max_preroll_s = max_preroll_s
        self._expected = expected_speech_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._held: list[Event] = []
        self._released = max_preroll_s == 0
        self._timer: asyncio.Task[None] | None = None
        self.started_at: float | None = None
        self.first_audio_at: float | None = None
        self.first_sent_at: float | None = None
        self.produced_s = 0.0
        self.longest_chunk_s = 0.0
        self.held_s = 0.0

    @property
    def released(self) -> bool:
        """True once audio flows through without holding."""
        return self._released

    def start(self) -> None:
        """Mark the start of production (the first call counts; later calls are ignored)."""
        if self.started_at is None:
            self.started_at = self._clock()

    async def audio(self, events: list[Event], duration_s: float) -> None:
        """Send (or hold) the ``audio-chunk`` events of one engine chunk of ``duration_s``
        seconds, in order.

        Raises:
            ClientGone: the client disconnected.
        """
        async with self._lock:
            self.produced_s += duration_s
            self.longest_chunk_s = max(self.longest_chunk_s, duration_s)
            if self._released:
                for event in events:
                    await self._send_one(event)
                return
            now = self._clock()
            self.start()
            self._held.extend(events)
            if self.first_audio_at is None:
                self.first_audio_at = now
                self._timer = asyncio.create_task(self._release_at_bound())
            assert self.started_at is not None
            needed = needed_preroll_s(self.produced_s, now - self.started_at, self._expected(),
                                      self.longest_chunk_s)
            if self.produced_s >= needed or now - self.first_audio_at >= self.max_preroll_s:
                _LOGGER.debug("pre-roll: %.2f s in hand, %.2f s needed", self.produced_s, needed)
                await self._release_locked()

    async def release(self) -> None:
        """Send everything held and stop holding (end of production, or waiting for text).

        Raises:
            ClientGone: the client disconnected.
        """
        async with self._lock:
            await self._release_locked()

    async def close(self) -> None:
        """Cancel the bound's timer (held audio is not sent; call :meth:`release` first)."""
        timer, self._timer = self._timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError, ClientGone):
                await timer

    async def _release_locked(self) -> None:
        if self._released:
            return
        self._released = True
        if self.first_audio_at is not None:
            self.held_s = self._clock() - self.first_audio_at
        held, self._held = self._held, []
        for event in held:
            await self._send_one(event)
        timer, self._timer = self._timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()

    async def _send_one(self, event: Event) -> None:
        await self._send(event)
        if self.first_sent_at is None:
            self.first_sent_at = self._clock()

    async def _release_at_bound(self) -> None:
        assert self.first_audio_at is not None
        delay = self.first_audio_at + self.max_preroll_s - self._clock()
        await asyncio.sleep(max(delay, 0.0))
        with contextlib.suppress(ClientGone):  # the request's own next send reports it
            await self.release()
