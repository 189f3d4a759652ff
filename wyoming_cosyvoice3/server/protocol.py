"""The Wyoming wire of one connection: reading events within size limits, checking a request,
writing events within the write limit.

``wyoming.event.async_read_event`` trusts ``data_length`` and ``payload_length`` (a header
announcing 10 GB makes it wait for, and buffer, 10 GB) and turns every malformed header into
a silent disconnect. This reader applies the same wire format (one JSON header line, then
``data_length`` bytes of JSON data, then ``payload_length`` bytes of payload) but bounds every
size (header line, data, payload), bounds how long a begun event may stall, and reports what
was wrong as a :class:`ProtocolError` with a Wyoming error code.

The text and voice of a request are then checked by pure functions over the event data (no
I/O), so that every malformed value becomes a typed error with a Wyoming code:
``invalid-text``, ``empty-text``, ``text-too-long``, ``text-format-not-supported``,
``invalid-voice``.

The write side (last section) is narrow and handed to the request logic: the connection handler
(:mod:`.handler`) is the only reader of events, while the one-shot and streaming request logic
(:mod:`.speech`, :mod:`.streams`) write their events through an :class:`EventSink` and never see
the handler. A sink knows how to write one event within the write time limit, whether the client
is gone, and whether its work must stop. The audio they write is converted there too
(:func:`pcm16`), and each request's figures are logged in one line (:class:`RequestStats`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from wyoming.error import Error
from wyoming.event import Event

from ..engine.constants import OUTPUT_SAMPLE_RATE_HZ
from ..engine.errors import CosyVoiceError, EmptyText, TextError, TextTooLong, VoiceNotFound

_LOGGER = logging.getLogger(__name__)

MAX_VOICE_FIELD_CHARS = 256
"""Longest ``voice.name`` / ``language`` / ``speaker`` accepted (longer: ``invalid-voice``)."""


class ProtocolError(Exception):
    """An event could not be read.

    Attributes:
        code: Wyoming error code (``malformed-event`` or ``event-too-large``).
        fatal: True when the byte stream can no longer be followed (the connection must be
            closed after the error event); False when the bad event was skipped whole.
        event_type: the skipped event's type when it could be read (a broken ``synthesize``
            is answered like a failed request: ``error`` then ``audio-stop``).
    """

    def __init__(self, code: str, message: str, fatal: bool,
                 event_type: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal
        self.event_type = event_type


class IdleTimeout(Exception):
    """No event began within the timeout (nothing was consumed: reading may simply go on)."""


def _length(header: dict[str, Any], key: str, limit: int) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError("malformed-event", f"'{key}' must be a non-negative integer, "
                            f"got {short_repr(value)}", fatal=True)
    if value > limit:
        raise ProtocolError("event-too-large", f"'{key}' of {value} bytes exceeds the limit "
                            f"of {limit} bytes", fatal=True)
    return value


def short_repr(value: Any, max_chars: int = 80) -> str:
    """``repr(value)`` cut to ``max_chars`` (error texts never echo megabytes back)."""
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


async def _timed(awaitable: Awaitable[bytes], timeout_s: float | None, what: str) -> bytes:
    """Await a read that has already consumed part of an event: a stall is fatal."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError as err:
        raise ProtocolError("idle-timeout", f"the client stopped sending in the middle of an "
                            f"event ({what}) for {timeout_s:g} s", fatal=True) from err


async def _read_header(
    reader: asyncio.StreamReader, max_header_bytes: int, timeout_s: float | None,
    stall_s: float | None,
) -> bytes | None:
    """The header line with its newline; None at the end of the stream.

    Raises:
        IdleTimeout: nothing arrived within ``timeout_s`` (nothing consumed).
        ProtocolError: the line is longer than ``max_header_bytes`` (fatal).
    """
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout_s)
    except asyncio.TimeoutError as err:
        raise IdleTimeout from err
    except asyncio.IncompleteReadError:
        return None  # the stream ended, possibly inside a header
    except asyncio.LimitOverrunError as err:
        # longer than the reader's buffer limit: take it in pieces, up to max_header_bytes
        buffer = bytearray()
        consumed = err.consumed
        for _ in range(max_header_bytes + 1):  # each pass takes at least one byte
            if len(buffer) + consumed > max_header_bytes:
                break
            try:
                buffer += await _timed(reader.readexactly(consumed), stall_s, "header")
                buffer += await _timed(reader.readuntil(b"\n"), stall_s, "header")
            except asyncio.IncompleteReadError:
                return None
            except asyncio.LimitOverrunError as more:
                consumed = more.consumed
                continue
            break
        line = bytes(buffer)
    if len(line) > max_header_bytes or not line.endswith(b"\n"):
        raise ProtocolError("event-too-large", "event header line longer than "
                            f"{max_header_bytes} bytes", fatal=True)
    return line


async def read_event(
    reader: asyncio.StreamReader,
    max_data_bytes: int,
    max_payload_bytes: int,
    max_header_bytes: int = 1 << 16,
    timeout_s: float | None = None,
    stall_timeout_s: float | None = None,
) -> Event | None:
    """Read one event.

    Args:
        reader: the connection's stream.
        max_data_bytes / max_payload_bytes / max_header_bytes: size limits.
        timeout_s: how long to wait for an event to begin (then :class:`IdleTimeout`); None
            waits forever.
        stall_timeout_s: how long each further part of a begun event may take (then a fatal
            ``idle-timeout`` error); None: ``timeout_s``.

    Returns:
        The event, or None at the end of the stream (also when it ends inside an event).

    Raises:
        IdleTimeout: no event began within ``timeout_s``.
        ProtocolError: the header or data is malformed, too large, or stalled.
        ConnectionError: the connection was reset.
    """
    stall_s = timeout_s if stall_timeout_s is None else stall_timeout_s
    line = await _read_header(reader, max_header_bytes, timeout_s, stall_s)
    if line is None:
        return None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as err:
        raise ProtocolError("malformed-event", f"event header is not JSON: {err}",
                            fatal=True) from err
    if not isinstance(header, dict):
        raise ProtocolError("malformed-event", "event header must be a JSON object", fatal=True)
    data_length = _length(header, "data_length", max_data_bytes)
    payload_length = _length(header, "payload_length", max_payload_bytes)
    try:
        data_bytes = (await _timed(reader.readexactly(data_length), stall_s, "data")
                      if data_length else b"")
        payload = (await _timed(reader.readexactly(payload_length), stall_s, "payload")
                   if payload_length else None)
    except asyncio.IncompleteReadError:
        return None

    event_type = header.get("type")
    if not isinstance(event_type, str) or not event_type:
        raise ProtocolError("malformed-event", "event header needs a 'type' string",
                            fatal=False)
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise ProtocolError("malformed-event", f"'data' of {short_repr(event_type)} must be an "
                            "object", fatal=False, event_type=event_type)
    if data_bytes:
        try:
            extra = json.loads(data_bytes)
        except (ValueError, RecursionError) as err:
            raise ProtocolError("malformed-event", f"data of {short_repr(event_type)} is not JSON: "
                                f"{err}", fatal=False, event_type=event_type) from err
        if not isinstance(extra, dict):
            raise ProtocolError("malformed-event", f"data of {short_repr(event_type)} must be an "
                                "object", fatal=False, event_type=event_type)
        data = {**data, **extra}
    return Event(type=event_type, data=data, payload=payload)


def first_line(text: str, max_chars: int = 200) -> str:
    """The first non-empty line of ``text``, cut to ``max_chars`` (for logs and summaries).

    Long multi-line messages (e.g. the list of missing model files) are logged in full once,
    when they happen; repeated mentions use this summary.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if len(line) > max_chars:
        line = line[: max_chars - 3].rstrip() + "..."
    if len(lines) > 1:
        line += " (details in the server log)"
    return line


# -- checking a request -----------------------------------------------------------------------

class TextFormatNotSupported(CosyVoiceError):
    """The request asks for a text format other than plain text (e.g. SSML)."""

    code = "text-format-not-supported"


@dataclass(frozen=True)
class VoiceRequest:
    """The ``voice`` of a request: by name (+ speaker), else by language, else default."""

    name: str | None = None
    language: str | None = None
    speaker: str | None = None


@dataclass(frozen=True)
class SpeakRequest:
    """A one-shot ``synthesize`` or a ``synthesize-start``, checked when it arrives, so that
    a queued request keeps only what it needs (never the client's whole event data).

    Attributes:
        text: the text to speak (one-shot; "" for a stream or when ``problem`` is set).
        voice: the requested voice.
        received: ``time.monotonic()`` when the event arrived.
        problem: why the request cannot be served (sent as its coded ``error``), or None.
    """

    text: str = ""
    voice: VoiceRequest = VoiceRequest()
    received: float = 0.0
    problem: CosyVoiceError | None = None


def parse_request(
    data: Mapping[str, Any], max_chars: int, received: float, with_text: bool = True
) -> SpeakRequest:
    """Check a ``synthesize`` (``with_text``) or ``synthesize-start`` event's data.

    Never raises: a bad field becomes :attr:`SpeakRequest.problem` (the first one found, in
    the order text, text_format, voice).
    """
    try:
        text = check_text(data, max_chars) if with_text else ""
        check_text_format(data)
        voice = parse_voice(data)
    except CosyVoiceError as err:
        return SpeakRequest(received=received, problem=err)
    return SpeakRequest(text=text, voice=voice, received=received)


def check_text(data: Mapping[str, Any], max_chars: int) -> str:
    """The ``text`` of a ``synthesize`` event, validated.

    Raises:
        TextError: missing or not a string (``invalid-text``).
        TextTooLong: more than ``max_chars`` characters.
        EmptyText: blank text.
    """
    if "text" not in data:
        raise TextError("synthesize needs a 'text' field with the text to speak")
    text = data["text"]
    if not isinstance(text, str):
        raise TextError(f"'text' must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise TextTooLong(
            f"text of {len(text)} characters exceeds the limit of {max_chars}; split it or "
            "raise --max-text-chars"
        )
    if not text.strip():
        raise EmptyText("the text is empty; send something to speak")
    return text


def check_chunk_text(data: Mapping[str, Any]) -> str:
    """The ``text`` of a ``synthesize-chunk`` event (may be empty or whitespace)."""
    text = data.get("text", "")
    if not isinstance(text, str):
        raise TextError(f"'text' of synthesize-chunk must be a string, got {type(text).__name__}")
    return text


def check_text_format(data: Mapping[str, Any]) -> None:
    """Only plain text is spoken; ``text_format`` other than ``text`` is refused."""
    text_format = data.get("text_format")
    if text_format is None or text_format == "text":
        return
    raise TextFormatNotSupported(
        f"text_format {short_repr(text_format)} is not supported; send plain text "
        "(text_format 'text')"
    )


def parse_voice(data: Mapping[str, Any]) -> VoiceRequest:
    """Read ``data['voice']``: absent, ``{}``, ``{name, speaker?}``, ``{language}`` or a name.

    Raises:
        VoiceNotFound: a field has the wrong type or is longer than ``MAX_VOICE_FIELD_CHARS``.
    """
    voice = data.get("voice")
    if voice is None:
        return VoiceRequest()
    if isinstance(voice, str):
        voice = {"name": voice}
    if not isinstance(voice, dict):
        raise VoiceNotFound("'voice' must be an object like {\"name\": ...}, got "
                            f"{short_repr(voice)}")
    fields: dict[str, str | None] = {}
    for key in ("name", "language", "speaker"):
        value = voice.get(key)
        if value is not None and not isinstance(value, str):
            raise VoiceNotFound(f"voice '{key}' must be a string, got {short_repr(value)}")
        if value is not None and len(value) > MAX_VOICE_FIELD_CHARS:
            raise VoiceNotFound(f"voice '{key}' is longer than {MAX_VOICE_FIELD_CHARS} "
                                "characters")
        fields[key] = value or None
    return VoiceRequest(**fields)


# -- writing events -------------------------------------------------------------------------

MAX_ERROR_TEXT_CHARS = 2000
"""Error texts are cut to this length."""
SAMPLE_WIDTH_BYTES = 2
"""16-bit PCM: every audio event carries rate 24000, width 2, channels 1."""
CHANNELS = 1


class ClientGone(Exception):
    """The client disconnected; the request stops quietly."""


class EventSink:
    """Writes the events of one connection (one sink per connection, made by its handler).

    Args:
        write_event: coroutine that writes one event to the connection.
        transport: the connection's transport (``is_closing``, ``abort``).
        write_timeout_s: a client that reads nothing for this long is dropped.
        server_stopping: set when the server shuts down; every synthesis stops.
        peer: the client's address, for log lines.

    Attributes:
        gone: set when the client is gone: every synthesis of this connection stops.
        last_write: ``time.monotonic()`` of the last event written (idle accounting).
    """

    def __init__(
        self, write_event: Callable[[Event], Awaitable[None]], transport: asyncio.WriteTransport,
        write_timeout_s: float, server_stopping: threading.Event, peer: str,
    ) -> None:
        self._write_event = write_event
        self._transport = transport
        self._write_timeout_s = write_timeout_s
        self._server_stopping = server_stopping
        self.peer = peer
        self.gone = threading.Event()
        self.last_write = time.monotonic()

    def should_stop(self) -> bool:
        """Cancellation callable handed to the engine: the client left or the server stops."""
        return self.gone.is_set() or self._server_stopping.is_set()

    async def send(self, event: Event) -> None:
        """Write one event.

        Raises:
            ClientGone: the client has disconnected, or has not read for ``write_timeout_s``
                (the connection is then aborted).
        """
        if self.gone.is_set() or self._transport.is_closing():
            self.gone.set()
            raise ClientGone
        try:
            await asyncio.wait_for(self._write_event(event), self._write_timeout_s)
        except asyncio.TimeoutError:
            _LOGGER.warning("Client %s read nothing for %g s; dropping it", self.peer,
                            self._write_timeout_s)
            self.gone.set()
            self._transport.abort()
            raise ClientGone from None
        except (ConnectionError, OSError) as err:
            self.gone.set()
            raise ClientGone from err
        self.last_write = time.monotonic()

    async def send_error(self, code: str, text: str) -> None:
        """Send a coded ``error`` event (logged at INFO: it is the client's problem).

        Raises:
            ClientGone: as :meth:`send`.
        """
        text = text[:MAX_ERROR_TEXT_CHARS].encode("utf-8", "replace").decode("utf-8")
        _LOGGER.info("Error for %s: [%s] %s", self.peer, code, first_line(text))
        await self.send(Error(text=text, code=code).event())


# -- audio and request figures ----------------------------------------------------------------

def pcm16(samples: np.ndarray) -> bytes:
    """Samples -> little-endian 16-bit PCM bytes (``len`` always a multiple of 2).

    Args:
        samples: float32 [N] in [-1, 1] (NaN becomes 0, values are clipped), or int16 [N].
    """
    if samples.dtype == np.int16:
        return samples.astype("<i2", copy=False).tobytes()
    clipped = np.clip(np.nan_to_num(samples.astype(np.float32, copy=False)), -1.0, 1.0)
    return np.round(clipped * 32767.0).astype("<i2").tobytes()


@dataclass
class RequestStats:
    """Figures of one request for its single INFO log line.

    Attributes:
        kind: ``synthesize`` (one-shot) or ``stream``.
        first_chunk_s: seconds from the request (one-shot) or from the first complete
            sentence (stream) to the first audio-chunk sent: the first-chunk latency.
        audio_samples: 24 kHz samples sent.
        compute_s: seconds the request held a synthesis worker (for the RTF).
    """

    kind: str
    voice: str = "-"
    chars: int = 0
    sentences: int = 0
    first_chunk_s: float | None = None
    audio_samples: int = 0
    compute_s: float = 0.0

    @property
    def audio_s(self) -> float:
        return self.audio_samples / OUTPUT_SAMPLE_RATE_HZ

    @property
    def rtf(self) -> float:
        """Real-time factor: compute seconds per audio second (0 without audio)."""
        return self.compute_s / self.audio_s if self.audio_s > 0 else 0.0

    def log(self, outcome: str) -> None:
        first = f"{self.first_chunk_s:.3f}s" if self.first_chunk_s is not None else "-"
        _LOGGER.info(
            "%s %s: voice=%s chars=%d sentences=%d first_chunk=%s audio=%.2fs rtf=%.2f",
            self.kind, outcome, self.voice, self.chars, self.sentences, first, self.audio_s,
            self.rtf,
        )
