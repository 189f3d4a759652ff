"""One Wyoming connection: events in, jobs in order, audio out.

The read loop never waits for synthesis: it turns events into jobs (``describe``, a one-shot
``synthesize``, a streaming request) that one worker task per connection answers in order,
so text chunks of a stream keep arriving while earlier sentences are spoken, and a reset
connection is noticed at once (its ``should_stop`` flag stops the engine within one model
step). Every failure becomes a coded ``error`` event and the connection stays usable; only an
unreadable byte stream (broken header, oversized event) closes it.

Half-closing clients (TCP ``shutdown(SHUT_WR)`` after their last event) still get their
answers: end of input lets accepted jobs finish. A client that fully closed is detected by
the reset its kernel answers to the next write.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from typing import Any

import numpy as np
from wyoming.audio import AudioChunk as WyomingAudioChunk
from wyoming.audio import AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.server import AsyncEventHandler
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
)

from ..engine.constants import OUTPUT_SAMPLE_RATE_HZ
from ..engine.errors import CosyVoiceError, EmptyText, SynthesisCancelled
from ..engine.types import AudioChunk
from .info import build_info
from .output import CHANNELS, SAMPLE_WIDTH_BYTES, ClientGone, RequestStats, pcm16
from .protocol import ProtocolError, read_event
from .requests import check_text, check_text_format, parse_voice, select_voice
from .runtime import ServerRuntime, VoiceSlot
from .streaming_text import SentenceBuffer
from .streams import StreamRequest, run_stream

_LOGGER = logging.getLogger(__name__)

MAX_PENDING_JOBS = 16
"""Requests one connection may have waiting behind the current one."""


class CosyVoiceEventHandler(AsyncEventHandler):
    """Handles one client connection (create through :func:`make_handler_factory`)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, runtime: ServerRuntime
    ) -> None:
        super().__init__(reader, writer)
        self.runtime = runtime
        self.peer = str(writer.get_extra_info("peername") or "client")
        self.gone = threading.Event()
        """Set when the client is gone: every synthesis of this connection stops."""
        self._jobs: asyncio.Queue[Any] = asyncio.Queue()
        self._stream: StreamRequest | None = None
        self._warned_stray_chunk = False
        self._busy_reported = False

    # --- plumbing -------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """Cancellation callable handed to the engine."""
        return self.gone.is_set() or self.runtime.stopping.is_set()

    async def send(self, event: Event) -> None:
        """Write one event; raise :class:`ClientGone` when the client has disconnected."""
        if self.gone.is_set() or self.writer.transport.is_closing():
            self.gone.set()
            raise ClientGone
        try:
            await self.write_event(event)
        except (ConnectionError, OSError) as err:
            self.gone.set()
            raise ClientGone from err

    async def send_error(self, code: str, text: str) -> None:
        """Send a coded ``error`` event (logged at INFO: it is the client's problem)."""
        _LOGGER.info("Error for %s: [%s] %s", self.peer, code, text)
        await self.send(Error(text=text, code=code).event())

    # --- read loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Read events until the client leaves; answer them in order on a worker task."""
        worker = asyncio.create_task(self._work(), name=f"cosyvoice3 worker {self.peer}")
        limits = self.runtime.settings.limits
        try:
            while not self.gone.is_set():
                try:
                    event = await read_event(self.reader, limits.max_event_data_bytes,
                                             limits.max_event_payload_bytes)
                except ProtocolError as err:
                    self._add_job(("error", err.code, str(err)))
                    if err.fatal:
                        break
                    continue
                except (ConnectionError, OSError):
                    self.gone.set()  # reset by the peer: stop its work now
                    break
                if event is None:
                    break
                if not await self.handle_event(event):
                    break
        finally:
            if self._stream is not None:
                self._stream.abandon()
                self._stream = None
            self._jobs.put_nowait(None)
            try:
                await worker
            except asyncio.CancelledError:
                self.gone.set()
                raise
            finally:
                await self.disconnect()
                self.writer.close()

    async def handle_event(self, event: Event) -> bool:
        """Turn one event into a job (or stream input). Never blocks on synthesis."""
        if Describe.is_type(event.type):
            self._add_job(("describe",))
        elif SynthesizeStart.is_type(event.type):
            self._start_stream(event.data)
        elif SynthesizeChunk.is_type(event.type):
            self._stream_chunk(event.data)
        elif SynthesizeStop.is_type(event.type):
            self._stop_stream()
        elif Synthesize.is_type(event.type):
            if self._stream is not None:
                _LOGGER.debug("Ignoring the compatibility synthesize inside a stream")
            else:
                self._add_job(("synthesize", event.data, time.monotonic()))
        else:
            _LOGGER.debug("Ignoring event %s from %s", event.type, self.peer)
        return True

    def _add_job(self, job: tuple[Any, ...]) -> bool:
        """Queue a job for the worker; refuse it (one ``server-busy`` error per burst) when
        ``MAX_PENDING_JOBS`` are already waiting. Returns whether it was queued."""
        if self._jobs.qsize() < MAX_PENDING_JOBS:
            self._jobs.put_nowait(job)
            self._busy_reported = False
            return True
        _LOGGER.warning("Client %s has too many pending requests; refusing %s", self.peer,
                        job[0])
        if not self._busy_reported:
            self._busy_reported = True
            self._jobs.put_nowait(("error", "server-busy",
                                   f"more than {MAX_PENDING_JOBS} requests are pending on this "
                                   "connection; wait for the answers first"))
        return False

    # --- streaming input ------------------------------------------------------------------

    def _start_stream(self, data: dict[str, Any]) -> None:
        if self._stream is not None:
            _LOGGER.warning("synthesize-start inside an open stream from %s: ending the first",
                            self.peer)
            self._stop_stream()
        stream = StreamRequest(data=data, buffer=SentenceBuffer(), started=time.monotonic())
        self._stream = stream
        if not self._add_job(("stream", stream)):
            stream.abandon()  # refused: its chunks and stop are swallowed

    def _stream_chunk(self, data: dict[str, Any]) -> None:
        stream = self._stream
        if stream is None:
            if not self._warned_stray_chunk:
                _LOGGER.warning("Ignoring synthesize-chunk outside a stream from %s", self.peer)
                self._warned_stray_chunk = True
            return
        stream.add_text(data, self.runtime.settings.limits.max_text_chars)

    def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            self._add_job(("stopped",))  # answer a stray stop so a waiting client is released
            return
        stream.finish()

    # --- worker ---------------------------------------------------------------------------

    async def _work(self) -> None:
        while True:
            job = await self._jobs.get()
            if job is None:
                return
            try:
                await self._run_job(job)
            except ClientGone:
                self.gone.set()
            except Exception:  # a bug must not leave the client waiting forever
                _LOGGER.exception("Request from %s failed unexpectedly", self.peer)
                try:
                    await self.send_error("internal-error", "the server failed unexpectedly; "
                                          "see its log")
                except ClientGone:
                    self.gone.set()
            if self.gone.is_set():
                self._drain_jobs()
                return

    def _drain_jobs(self) -> None:
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None and job[0] == "stream":
                job[1].abandon()

    async def _run_job(self, job: tuple[Any, ...]) -> None:
        kind = job[0]
        if kind == "describe":
            await self.send(build_info(self.runtime).event())
        elif kind == "error":
            await self.send_error(job[1], job[2])
        elif kind == "stopped":
            await self.send(SynthesizeStopped().event())
        elif kind == "synthesize":
            await self._one_shot(job[1], job[2])
        elif kind == "stream":
            await run_stream(self, job[1])

    # --- synthesis ------------------------------------------------------------------------

    def choose_voice(self, data: dict[str, Any]) -> VoiceSlot:
        """Check that the model is ready and pick the request's voice (coded errors)."""
        self.runtime.require_ready()
        return select_voice(parse_voice(data), self.runtime.voices,
                            self.runtime.default_voice_slot())

    async def speak(self, text: str, slot: VoiceSlot, stats: RequestStats, t0: float,
                    extra_stop: threading.Event | None = None) -> None:
        """Synthesise ``text`` and send its audio-chunk events (audio-start already sent).

        Raises:
            ClientGone: the client disconnected (the engine was stopped).
            CosyVoiceError: the engine failed (not for unspeakable text, which sends nothing).
        """
        samples_per_chunk = self.runtime.settings.samples_per_chunk
        seed = self.runtime.settings.seed
        options = self.runtime.synthesis_options(
            seed if seed is not None else secrets.randbelow(2**31)
        )

        def stop() -> bool:
            return self.should_stop() or (extra_stop is not None and extra_stop.is_set())

        async def on_chunk(chunk: AudioChunk) -> None:
            pcm = pcm16(np.asarray(chunk.samples))
            step = samples_per_chunk * SAMPLE_WIDTH_BYTES
            for offset in range(0, len(pcm), step):
                piece = pcm[offset:offset + step]
                await self.send(WyomingAudioChunk(rate=OUTPUT_SAMPLE_RATE_HZ,
                                                  width=SAMPLE_WIDTH_BYTES, channels=CHANNELS,
                                                  audio=piece).event())
                if stats.first_chunk_s is None:
                    stats.first_chunk_s = time.monotonic() - t0
                stats.audio_samples += len(piece) // SAMPLE_WIDTH_BYTES

        stats.sentences += 1
        if slot.prompt is None:
            raise CosyVoiceError(f"voice {slot.entry.name!r} is not prepared")
        try:
            stats.compute_s += await self.runtime.run_synthesis(
                text, slot.prompt, options, stop, on_chunk
            )
        except EmptyText:
            _LOGGER.debug("Nothing speakable in %r", text[:80])
        except SynthesisCancelled:
            if self.gone.is_set() or (extra_stop is not None and extra_stop.is_set()):
                raise ClientGone from None
            raise

    async def _one_shot(self, data: dict[str, Any], t0: float) -> None:
        stats = RequestStats(kind="synthesize")
        try:
            text = check_text(data, self.runtime.settings.limits.max_text_chars)
            check_text_format(data)
            slot = self.choose_voice(data)
        except CosyVoiceError as err:
            await self.send_error(err.code, str(err))
            return
        stats.voice, stats.chars = slot.entry.name, len(text)
        await self.send(AudioStart(rate=OUTPUT_SAMPLE_RATE_HZ, width=SAMPLE_WIDTH_BYTES,
                                   channels=CHANNELS).event())
        outcome = "done"
        try:
            await self.speak(text, slot, stats, t0)
        except ClientGone:
            stats.log("cancelled (client gone)")
            raise
        except CosyVoiceError as err:
            outcome = f"failed [{err.code}]"
            await self.send_error(err.code, str(err))
        await self.send(AudioStop().event())
        stats.log(outcome)


def make_handler_factory(runtime: ServerRuntime) -> Any:
    """A ``wyoming`` handler factory bound to ``runtime``."""

    def factory(reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> CosyVoiceEventHandler:
        return CosyVoiceEventHandler(reader, writer, runtime)

    return factory


__all__ = ["ClientGone", "CosyVoiceEventHandler", "make_handler_factory", "pcm16"]
