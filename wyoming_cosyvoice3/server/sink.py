"""The narrow write side of one connection, handed to the request logic.

The connection handler (:mod:`.handler`) is the only reader of events. The one-shot and
streaming request logic (:mod:`.speech`, :mod:`.streams`) write their events through an
:class:`EventSink` and never see the handler: a sink knows how to write one event within the
write time limit, whether the client is gone, and whether its work must stop. The audio
they write is converted here too (:func:`pcm16`), and each request's figures are logged in one
line (:class:`RequestStats`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from wyoming.error import Error
from wyoming.event import Event

from ..engine.constants import OUTPUT_SAMPLE_RATE_HZ
from .protocol import first_line

_LOGGER = logging.getLogger(__name__)

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
