"""Reading Wyoming events with size limits and type checks.

``wyoming.event.async_read_event`` trusts ``data_length`` and ``payload_length`` (a header
announcing 10 GB makes it wait for, and buffer, 10 GB) and turns every malformed header into
a silent disconnect. This reader applies the same wire format (one JSON header line, then
``data_length`` bytes of JSON data, then ``payload_length`` bytes of payload) but bounds every
size and reports what was wrong as a :class:`ProtocolError` with a Wyoming error code.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from wyoming.event import Event


class ProtocolError(Exception):
    """An event could not be read.

    Attributes:
        code: Wyoming error code (``malformed-event`` or ``event-too-large``).
        fatal: True when the byte stream can no longer be followed (the connection must be
            closed after the error event); False when the bad event was skipped whole.
    """

    def __init__(self, code: str, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal


def _length(header: dict[str, Any], key: str, limit: int) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError("malformed-event", f"'{key}' must be a non-negative integer, "
                            f"got {value!r}", fatal=True)
    if value > limit:
        raise ProtocolError("event-too-large", f"'{key}' of {value} bytes exceeds the limit "
                            f"of {limit} bytes", fatal=True)
    return value


async def read_event(
    reader: asyncio.StreamReader, max_data_bytes: int, max_payload_bytes: int
) -> Event | None:
    """Read one event.

    Returns:
        The event, or None at the end of the stream (also when it ends inside an event).

    Raises:
        ProtocolError: the header or data is malformed or too large.
        ConnectionError: the connection was reset.
    """
    try:
        line = await reader.readline()
    except ValueError as err:  # longer than the reader's line limit
        raise ProtocolError("event-too-large", f"event header line too long: {err}",
                            fatal=True) from err
    if not line or not line.endswith(b"\n"):
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
        data_bytes = await reader.readexactly(data_length) if data_length else b""
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None

    event_type = header.get("type")
    if not isinstance(event_type, str) or not event_type:
        raise ProtocolError("malformed-event", "event header needs a 'type' string",
                            fatal=False)
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise ProtocolError("malformed-event", f"'data' of {event_type} must be an object",
                            fatal=False)
    if data_bytes:
        try:
            extra = json.loads(data_bytes)
        except (ValueError, RecursionError) as err:
            raise ProtocolError("malformed-event", f"data of {event_type} is not JSON: {err}",
                                fatal=False) from err
        if not isinstance(extra, dict):
            raise ProtocolError("malformed-event", f"data of {event_type} must be an object",
                                fatal=False)
        data = {**data, **extra}
    return Event(type=event_type, data=data, payload=payload)
