"""Reading Wyoming events with size limits and type checks.

``wyoming.event.async_read_event`` trusts ``data_length`` and ``payload_length`` (a header
announcing 10 GB makes it wait for, and buffer, 10 GB) and turns every malformed header into
a silent disconnect. This reader applies the same wire format (one JSON header line, then
``data_length`` bytes of JSON data, then ``payload_length`` bytes of payload) but bounds every
size (header line, data, payload), bounds how long a begun event may stall, and reports what
was wrong as a :class:`ProtocolError` with a Wyoming error code.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

from wyoming.event import Event


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
