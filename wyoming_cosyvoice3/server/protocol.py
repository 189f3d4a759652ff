"""Reading Wyoming events with size limits and type checks.

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
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

from wyoming.event import Event

from ..engine.errors import CosyVoiceError, EmptyText, TextError, TextTooLong, VoiceNotFound
from .limits import MAX_VOICE_FIELD_CHARS
from .voice_slots import VoiceSlot


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


def _primary(language: str) -> str:
    return language.replace("_", "-").split("-", 1)[0].lower()


def _valid_names(voices: Mapping[str, VoiceSlot]) -> str:
    names = [name for name, slot in voices.items() if slot.installed]
    if names:
        return ", ".join(names)
    problem = next((f"{name}: {slot.problem}" for name, slot in voices.items() if slot.problem),
                   "check the voice catalog and the log")
    return f"(none; {problem})"


def select_voice(
    request: VoiceRequest, voices: Mapping[str, VoiceSlot], default: VoiceSlot | None
) -> VoiceSlot:
    """Pick the voice: by name, else the first voice listing the language, else the default.

    A language matches exactly first (``en-US``), then by its primary subtag (``en``); voices
    whose first language matches are preferred over voices that merely list it.

    Raises:
        VoiceNotFound: unknown or unusable name, a speaker (no voice has speakers), an
            unsupported language, or no installed voice at all; the message lists the
            installed voices.
    """
    valid = _valid_names(voices)
    if request.name is not None:
        slot = voices.get(request.name)
        if slot is None:
            raise VoiceNotFound(f"unknown voice {short_repr(request.name)}; installed voices: "
                                f"{valid}")
        if not slot.installed:
            reason = slot.problem or "it is not prepared yet"
            raise VoiceNotFound(
                f"voice {request.name!r} is not available ({reason}); installed voices: {valid}"
            )
        if request.speaker is not None:
            raise VoiceNotFound(
                f"voice {request.name!r} has no speakers (got speaker {request.speaker!r}); "
                "leave 'speaker' out"
            )
        return slot
    if request.language is not None:
        wanted = request.language.replace("_", "-").lower()
        installed = [slot for slot in voices.values() if slot.installed]
        for match in (
            lambda s: s.entry.languages[0].lower() == wanted,
            lambda s: _primary(s.entry.languages[0]) == _primary(wanted),
            lambda s: any(lang.lower() == wanted for lang in s.entry.languages),
            lambda s: any(_primary(lang) == _primary(wanted) for lang in s.entry.languages),
        ):
            found = next((slot for slot in installed if match(slot)), None)
            if found is not None:
                return found
        languages = sorted({lang for slot in installed for lang in slot.entry.languages})
        raise VoiceNotFound(
            f"no voice speaks {request.language!r}; languages: {', '.join(languages) or '-'}; "
            f"installed voices: {valid}"
        )
    if default is None:
        raise VoiceNotFound(f"no voice is installed; installed voices: {valid}")
    return default
