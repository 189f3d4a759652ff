"""Resource limits of the server and the bookkeeping that enforces the connection limit.

The server has no authentication (the Wyoming protocol has none) and often runs on a small
board, so every resource a client can make it spend is bounded; each bound is a setting
(flag, environment variable and add-on option, see ``settings.OPTIONS``) and each exceeded
bound is answered with a coded ``error`` event (codes in :data:`ERROR_CODES`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

TOO_MANY_CONNECTIONS = "too-many-connections"
IDLE_TIMEOUT = "idle-timeout"
SERVER_BUSY = "server-busy"

ERROR_CODES = {
    "max_text_chars": "text-too-long",
    "max_pending_requests": SERVER_BUSY,
    "max_queued_requests": SERVER_BUSY,
    "max_request_s": "timeout",
    "max_connections": TOO_MANY_CONNECTIONS,
    "idle_timeout_s": IDLE_TIMEOUT,
    "max_event_header_bytes": "event-too-large",
    "max_event_data_bytes": "event-too-large",
    "max_event_payload_bytes": "event-too-large",
    "max_clip_bytes": "invalid-voice",
}
"""The ``error`` code sent when each limit is exceeded (``write_timeout_s`` has none: a client
that stops reading cannot read an error either; its connection is dropped)."""

MAX_VOICE_FIELD_CHARS = 256
"""Longest ``voice.name`` / ``language`` / ``speaker`` accepted (longer: ``invalid-voice``)."""


@dataclass(frozen=True)
class Limits:
    """Bounds that keep clients from exhausting the server.

    Attributes:
        max_text_chars: characters of one ``synthesize`` text, and of all the text of one
            streaming request (its ``synthesize-chunk`` pieces summed).
        max_pending_requests: requests one connection may have waiting behind the one being
            answered; more get one ``server-busy`` error per burst.
        max_queued_requests: syntheses waiting for a free worker, over all connections; one
            more is refused with ``server-busy``.
        max_request_s: wall-clock seconds one synthesis (a one-shot text, or one sentence of
            a stream) may run once it has a worker; then ``timeout``.
        max_connections: simultaneous client connections; one more gets
            ``too-many-connections`` and is closed.
        idle_timeout_s: a connection with nothing to answer that sends no event for this long
            gets ``idle-timeout`` and is closed (an open stream waiting for text is idle too).
        write_timeout_s: a connection whose client reads nothing for this long while the
            server has output for it is dropped (its synthesis stops, its worker is freed).
        max_event_header_bytes: length of an event's JSON header line.
        max_event_data_bytes: size of an event's JSON data block (``data_length``).
        max_event_payload_bytes: size of an event's binary payload (``payload_length``); a TTS
            server receives no audio.
        max_clip_bytes: size of a catalog voice's reference clip file (the engine also caps
            clips at 64 MiB and 30 s).
    """

    max_text_chars: int = 10000
    max_pending_requests: int = 16
    max_queued_requests: int = 16
    max_request_s: float = 600.0
    max_connections: int = 32
    idle_timeout_s: float = 120.0
    write_timeout_s: float = 60.0
    max_event_header_bytes: int = 1 << 16
    max_event_data_bytes: int = 1 << 20
    max_event_payload_bytes: int = 1 << 20
    max_clip_bytes: int = 1 << 26


class ConnectionCounter:
    """Counts open connections against ``max_connections`` (thread-safe, never negative)."""

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        """Connections holding a slot right now."""
        return self._open

    def try_open(self) -> bool:
        """Take a slot; False when ``maximum`` are already open."""
        with self._lock:
            if self._open >= self.maximum:
                return False
            self._open += 1
            return True

    def close(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._open = max(0, self._open - 1)
