"""The narrow write side of one connection, handed to the request logic.

The connection handler (:mod:`.handler`) is the only reader of events. The one-shot and
streaming request logic (:mod:`.speech`, :mod:`.streams`) write their events through an
:class:`EventSink` and never see the handler: a sink knows how to write one event within the
write time limit, whether the client is gone, and whether its work must stop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from wyoming.error import Error
from wyoming.event import Event

from .output import ClientGone
from .protocol import first_line

_LOGGER = logging.getLogger(__name__)

MAX_ERROR_TEXT_CHARS = 2000
"""Error texts are cut to this length."""


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
