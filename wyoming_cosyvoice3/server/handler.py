"""One Wyoming connection: events in, jobs in order, audio out.

The read loop never waits for synthesis: it turns events into jobs (``describe``, a one-shot
``synthesize``, a streaming request) that one worker task per connection answers in order,
so text chunks of a stream keep arriving while earlier sentences are spoken, and a reset
connection is noticed at once (its ``should_stop`` flag stops the engine within one model
step). Every failure becomes a coded ``error`` event and the connection stays usable; only an
unreadable byte stream (broken header, oversized or stalled event) closes it.

Limits (:class:`.settings.Limits`): a connection over ``max_connections`` gets
``too-many-connections`` and is closed; a connection that sends nothing while nothing is
being answered for ``idle_timeout_s`` gets ``idle-timeout`` and is closed; a client that reads
nothing for ``write_timeout_s`` is dropped (its synthesis stops and frees its worker).

Half-closing clients (TCP ``shutdown(SHUT_WR)`` after their last event) still get their
answers: end of input lets accepted jobs finish. A client that fully closed is detected by
the reset its kernel answers to the next write.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

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

from ..engine.errors import CosyVoiceError
from .info import build_info
from .protocol import (
    ClientGone,
    EventSink,
    IdleTimeout,
    ProtocolError,
    SpeakRequest,
    parse_request,
    pcm16,
    read_event,
)
from .runtime import ServerRuntime
from .settings import IDLE_TIMEOUT, SERVER_BUSY, TOO_MANY_CONNECTIONS
from .speech import run_one_shot
from .streaming_text import SentenceBuffer
from .streams import StreamRequest, run_stream

_LOGGER = logging.getLogger(__name__)

REFUSAL_LINGER_S = 1.0
"""How long a refused connection is kept open so that the client reads its error."""


class CosyVoiceEventHandler(AsyncEventHandler):
    """Handles one client connection (create through :func:`make_handler_factory`)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, runtime: ServerRuntime
    ) -> None:
        super().__init__(reader, writer)
        self.runtime = runtime
        self.limits = runtime.settings.limits
        self.peer = str(writer.get_extra_info("peername") or "client")
        self.sink = EventSink(self.write_event, writer.transport, self.limits.write_timeout_s,
                              runtime.stopping, self.peer)
        """The write side handed to the request logic (the handler alone reads)."""
        self._jobs: asyncio.Queue[Any] = asyncio.Queue()
        self._stream: StreamRequest | None = None
        self._running: Any = None
        """The job the worker is answering (None between jobs)."""
        self._last_activity = time.monotonic()
        self._warned_stray_chunk = False
        self._busy_reported = False

    # --- plumbing -------------------------------------------------------------------------

    @property
    def gone(self) -> threading.Event:
        """Set when the client is gone: every synthesis of this connection stops."""
        return self.sink.gone

    def should_stop(self) -> bool:
        """Cancellation callable handed to the engine."""
        return self.sink.should_stop()

    def begin_shutdown(self) -> None:
        """The server is stopping: end an open stream (``cancelled``) so that its response
        is completed with ``audio-stop`` + ``synthesize-stopped`` before the connection
        closes; running and queued syntheses stop through :meth:`should_stop`."""
        if self._stream is not None:
            self._stream.expire("cancelled", "the server is shutting down")
            self._stream = None

    @property
    def _activity(self) -> float:
        """``time.monotonic()`` of the last event in or out of this connection."""
        return max(self._last_activity, self.sink.last_write)

    @property
    def answered(self) -> bool:
        """True when nothing accepted on this connection is still being answered."""
        return self._jobs.empty() and self._running is None

    # --- connection -----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection, or refuse it when ``max_connections`` are already open."""
        if not self.runtime.connections.try_open():
            await self._refuse()
            return
        try:
            await self._serve()
        finally:
            self.runtime.connections.close()

    async def _refuse(self) -> None:
        self.runtime.note_refused_connection(self.peer)
        try:
            await asyncio.wait_for(self.write_event(Error(
                text=f"the server already has {self.limits.max_connections} connections; "
                "try again later (or raise --max-connections)",
                code=TOO_MANY_CONNECTIONS).event()), REFUSAL_LINGER_S)
            if self.writer.can_write_eof():
                self.writer.write_eof()
            # read what the client already sent, so that closing does not reset the
            # connection before the client has read the error
            await asyncio.wait_for(self._discard_input(), REFUSAL_LINGER_S)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self.writer.close()

    async def _discard_input(self) -> None:
        for _ in range(64):
            if not await self.reader.read(1 << 16):
                return

    async def _serve(self) -> None:
        """Read events until the client leaves; answer them in order on a worker task."""
        worker = asyncio.create_task(self._work(), name=f"cosyvoice3 worker {self.peer}")
        limits = self.limits
        try:
            while not self.gone.is_set():
                timeout_s = self._activity + limits.idle_timeout_s - time.monotonic()
                try:
                    event = await read_event(
                        self.reader, limits.max_event_data_bytes, limits.max_event_payload_bytes,
                        limits.max_event_header_bytes, max(0.01, timeout_s),
                        limits.idle_timeout_s,
                    )
                except IdleTimeout:
                    if self._idle_expired():
                        break
                    continue
                except ProtocolError as err:
                    self._broken_event(err)
                    if err.fatal:
                        break
                    continue
                except (ConnectionError, OSError):
                    self.gone.set()  # reset by the peer: stop its work now
                    break
                if event is None:
                    break
                self._last_activity = time.monotonic()
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

    def _idle_expired(self) -> bool:
        """On a read timeout: True (and the idle error queued) when the connection has been
        idle for ``idle_timeout_s``: nothing to answer, or only an open stream waiting for
        text, and no event in or out for that long."""
        limit_s = self.limits.idle_timeout_s
        if time.monotonic() - self._activity < limit_s or not self._jobs.empty():
            return False
        running = self._running
        if running is not None and not (isinstance(running, StreamRequest)
                                        and running.waiting_for_text):
            self._last_activity = time.monotonic()  # busy answering: idleness starts later
            return False
        message = f"no event for {limit_s:g} s; closing the connection"
        _LOGGER.info("Client %s was idle for %g s; closing", self.peer, limit_s)
        if self._stream is not None:
            self._stream.expire(IDLE_TIMEOUT, message)  # ends its response first
            self._stream = None
        else:
            self._add_job(("error", IDLE_TIMEOUT, message))
        return True

    def _broken_event(self, err: ProtocolError) -> None:
        """An event that could not be read: answer it like the request it was meant to be."""
        kind = err.event_type
        if kind is not None and SynthesizeStart.is_type(kind):
            self._start_stream(SpeakRequest(received=time.monotonic(), problem=_coded(err)))
        elif kind is not None and self._stream is not None and (
            SynthesizeChunk.is_type(kind) or SynthesizeStop.is_type(kind)
        ):
            self._stream.add_problem(err.code, str(err))
            if SynthesizeStop.is_type(kind):
                self._stop_stream()
        elif kind is not None and Synthesize.is_type(kind) and self._stream is None:
            self._add_job(("synthesize", SpeakRequest(received=time.monotonic(),
                                                      problem=_coded(err))))
        else:
            self._add_job(("error", err.code, str(err)))
            if kind is not None and SynthesizeStop.is_type(kind):
                self._add_job(("stopped",))
            elif kind is not None and Describe.is_type(kind):
                self._add_job(("describe",))

    # --- events ---------------------------------------------------------------------------

    async def handle_event(self, event: Event) -> bool:
        """Turn one event into a job (or stream input). Never blocks on synthesis."""
        max_chars = self.limits.max_text_chars
        if Describe.is_type(event.type):
            self._add_job(("describe",))
        elif SynthesizeStart.is_type(event.type):
            self._start_stream(parse_request(event.data, max_chars, time.monotonic(),
                                             with_text=False))
        elif SynthesizeChunk.is_type(event.type):
            await self._stream_chunk(event.data)
        elif SynthesizeStop.is_type(event.type):
            self._stop_stream()
        elif Synthesize.is_type(event.type):
            if self._stream is not None:
                _LOGGER.debug("Ignoring the compatibility synthesize inside a stream")
            else:
                self._add_job(("synthesize", parse_request(event.data, max_chars,
                                                           time.monotonic())))
        else:
            _LOGGER.debug("Ignoring event %s from %s", event.type, self.peer)
        return True

    def _add_job(self, job: tuple[Any, ...]) -> bool:
        """Queue a job for the worker; refuse it (one ``server-busy`` error per burst) when
        ``max_pending_requests`` are already waiting. Returns whether it was queued."""
        limit = self.limits.max_pending_requests
        if self._jobs.qsize() < limit:
            self._jobs.put_nowait(job)
            self._busy_reported = False
            return True
        _LOGGER.warning("Client %s has too many pending requests; refusing %s", self.peer,
                        job[0])
        if not self._busy_reported:
            self._busy_reported = True
            self._jobs.put_nowait(("error", SERVER_BUSY,
                                   f"more than {limit} requests are pending on this "
                                   "connection; wait for the answers first (or raise "
                                   "--max-pending-requests)"))
        return False

    def _start_stream(self, request: SpeakRequest) -> None:
        if self._stream is not None:
            _LOGGER.warning("synthesize-start inside an open stream from %s: ending the first",
                            self.peer)
            self._stop_stream()
        stream = StreamRequest(request=request, buffer=SentenceBuffer(),
                               max_chars=self.limits.max_text_chars)
        self._stream = stream
        if not self._add_job(("stream", stream)):
            stream.abandon()  # refused: its chunks and stop are swallowed

    async def _stream_chunk(self, data: dict[str, Any]) -> None:
        stream = self._stream
        if stream is None:
            if not self._warned_stray_chunk:
                _LOGGER.warning("Ignoring synthesize-chunk outside a stream from %s", self.peer)
                self._warned_stray_chunk = True
            return
        await stream.add_text(data)

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
            self._running = job[1] if job[0] == "stream" else job
            try:
                await self._run_job(job)
            except ClientGone:
                self.gone.set()
            except Exception:  # a bug must not leave the client waiting forever
                _LOGGER.exception("Request from %s failed unexpectedly", self.peer)
                try:
                    await self.sink.send_error("internal-error", "the server failed unexpectedly; "
                                          "see its log")
                except ClientGone:
                    self.gone.set()
            finally:
                self._running = None
                self._last_activity = time.monotonic()
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
        sink = self.sink
        if kind == "describe":
            await sink.send(build_info(self.runtime).event())
        elif kind == "error":
            await sink.send_error(job[1], job[2])
        elif kind == "stopped":
            await sink.send(SynthesizeStopped().event())
        elif kind == "synthesize":
            await run_one_shot(self.runtime, sink, job[1])
        elif kind == "stream":
            await run_stream(self.runtime, sink, job[1])


def _coded(err: ProtocolError) -> CosyVoiceError:
    """A protocol error as the coded error a request reports."""
    coded = CosyVoiceError(str(err))
    coded.code = err.code
    return coded


def make_handler_factory(runtime: ServerRuntime) -> Any:
    """A ``wyoming`` handler factory bound to ``runtime``."""

    def factory(reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> CosyVoiceEventHandler:
        return CosyVoiceEventHandler(reader, writer, runtime)

    return factory


__all__ = ["ClientGone", "CosyVoiceEventHandler", "make_handler_factory", "pcm16"]
