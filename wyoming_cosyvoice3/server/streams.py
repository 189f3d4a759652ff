"""Streaming requests: ``synthesize-start`` / ``synthesize-chunk``... / ``synthesize-stop``.

The read loop feeds text into a :class:`StreamRequest` (sentence boundaries found by
:class:`~.streaming_text.SentenceBuffer`); the connection's worker runs :func:`run_stream`,
which speaks each complete sentence as soon as it is queued, while later text still arrives.
The whole response is one ``audio-start`` (24000 Hz, 16 bit, mono), the audio of every
sentence, one ``audio-stop`` and ``synthesize-stopped`` -- also after an error, so a client
such as Home Assistant, which waits for ``synthesize-stopped``, is never left hanging.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wyoming.audio import AudioStart, AudioStop
from wyoming.tts import SynthesizeStopped

from ..engine.constants import OUTPUT_SAMPLE_RATE_HZ
from ..engine.errors import CosyVoiceError, TextError, TextTooLong
from .output import CHANNELS, SAMPLE_WIDTH_BYTES, ClientGone, RequestStats
from .requests import check_chunk_text, check_text_format
from .streaming_text import SentenceBuffer

if TYPE_CHECKING:
    from .handler import CosyVoiceEventHandler


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
        data: the ``synthesize-start`` data (``voice``, ``text_format``).
        buffer: text received but not yet a complete sentence.
        items: sentences / errors for the worker, ended by None.
        cancelled: set when the client left mid-stream; stops the current synthesis.
    """

    data: dict[str, Any]
    buffer: SentenceBuffer
    started: float
    items: asyncio.Queue[StreamText | StreamError | None] = field(
        default_factory=asyncio.Queue
    )
    cancelled: threading.Event = field(default_factory=threading.Event)
    overflowed: bool = False
    finished: bool = False

    def add_text(self, data: dict[str, Any], max_chars: int) -> None:
        """Take one ``synthesize-chunk``; queue the sentences it completes."""
        if self.finished or self.overflowed:
            return
        try:
            text = check_chunk_text(data)
        except TextError as err:
            self.items.put_nowait(StreamError(err.code, str(err)))
            return
        if self.buffer.total_chars + len(text) > max_chars:
            self.overflowed = True
            message = (f"the streamed text exceeds the limit of {max_chars} characters; the "
                       "rest of this response is dropped (raise --max-text-chars)")
            self.items.put_nowait(StreamError(TextTooLong.code, message))
            return
        now = time.monotonic()
        for sentence in self.buffer.add(text):
            self.items.put_nowait(StreamText(sentence, now))

    def finish(self) -> None:
        """``synthesize-stop``: queue the unfinished tail, then the end marker."""
        if self.finished:
            return
        self.finished = True
        tail = self.buffer.flush()
        if tail and not self.overflowed:
            self.items.put_nowait(StreamText(tail, time.monotonic()))
        self.items.put_nowait(None)

    def abandon(self) -> None:
        """The client left without ``synthesize-stop``: stop speaking, drop the rest."""
        self.cancelled.set()
        if not self.finished:
            self.finished = True
            self.items.put_nowait(None)


async def run_stream(handler: CosyVoiceEventHandler, stream: StreamRequest) -> None:
    """Answer one streaming request on ``handler``'s connection (see module docstring).

    Raises:
        ClientGone: the client disconnected.
    """
    stats = RequestStats(kind="stream")
    failed = False
    slot = None
    try:
        check_text_format(stream.data)
        slot = handler.choose_voice(stream.data)
        stats.voice = slot.entry.name
    except CosyVoiceError as err:
        await handler.send_error(err.code, str(err))
        failed = True
    await handler.send(AudioStart(rate=OUTPUT_SAMPLE_RATE_HZ, width=SAMPLE_WIDTH_BYTES,
                                  channels=CHANNELS).event())
    outcome = "failed" if failed else "done"
    while True:
        item = await stream.items.get()
        if item is None:
            break
        if stream.cancelled.is_set():
            continue
        if isinstance(item, StreamError):
            if not failed:
                await handler.send_error(item.code, item.text)
                failed, outcome = True, f"failed [{item.code}]"
            continue
        if failed or slot is None:
            continue
        stats.chars += len(item.text)
        try:
            await handler.speak(item.text, slot, stats, item.queued_at, stream.cancelled)
        except ClientGone:
            stats.log("cancelled (client gone)")
            raise
        except CosyVoiceError as err:
            await handler.send_error(err.code, str(err))
            failed, outcome = True, f"failed [{err.code}]"
    if stream.cancelled.is_set():
        outcome = "abandoned (no synthesize-stop)"
    await handler.send(AudioStop().event())
    await handler.send(SynthesizeStopped().event())
    stats.log(outcome)
