"""Wyoming requests sent the way Home Assistant sends them, timed on arrival of each event.

* one-shot: ``synthesize {text, voice}``; read until ``audio-stop``.
* streaming text (HA's path whenever the program supports it): ``synthesize-start {voice}``,
  the text as ``synthesize-chunk`` deltas of a few characters (cut anywhere, like LLM output),
  then the full text once more as ``synthesize`` (backwards compatibility, ignored inside a
  stream), ``synthesize-stop``; read until ``synthesize-stopped``. Deltas are written while
  audio is read, so early sentences can be spoken while later text still arrives.

Times are measured with ``time.perf_counter`` from the first event sent; the wall-clock
``time.time()`` of that moment is kept to match the server's records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from .stats import RunTrace

MAX_EVENTS = 1_000_000
"""Upper bound on events read for one request (the loop is bounded)."""


class RequestFailed(RuntimeError):
    """The server closed the connection or did not answer in time."""


def text_deltas(text: str, delta_chars: int) -> list[str]:
    """``text`` cut into pieces of ``delta_chars`` characters (the last may be shorter)."""
    if delta_chars < 1:
        raise ValueError("delta_chars must be >= 1")
    return [text[i:i + delta_chars] for i in range(0, len(text), delta_chars)]


async def describe(host: str, port: int, timeout_s: float = 5.0) -> Info | None:
    """The server's ``info``, or None when it does not answer (yet)."""
    try:
        async with AsyncTcpClient(host, port, connect_timeout=timeout_s) as client:
            await client.write_event(Describe().event())
            for _ in range(100):
                event = await asyncio.wait_for(client.read_event(), timeout_s)
                if event is None:
                    return None
                if Info.is_type(event.type):
                    return Info.from_event(event)
    except (OSError, asyncio.TimeoutError):
        return None
    return None


async def _read_until(
    client: AsyncTcpClient, trace: RunTrace, started: float, is_end: Callable[[Event], bool],
    timeout_s: float,
) -> None:
    for _ in range(MAX_EVENTS):
        event = await asyncio.wait_for(client.read_event(), timeout_s)
        now = time.perf_counter() - started
        if event is None:
            raise RequestFailed("the server closed the connection mid-request")
        if AudioChunk.is_type(event.type):
            chunk = AudioChunk.from_event(event)
            trace.sample_rate_hz = chunk.rate
            trace.chunks.append((now, len(chunk.audio) // (chunk.width * chunk.channels)))
        elif Error.is_type(event.type):
            trace.error = Error.from_event(event).text
        if is_end(event):
            trace.total_s = now
            return
    raise RequestFailed(f"more than {MAX_EVENTS} events in one request")


async def one_shot(host: str, port: int, text: str, voice: str, trace: RunTrace,
                   timeout_s: float) -> RunTrace:
    """Send one ``synthesize`` and fill ``trace`` with what came back.

    Raises:
        RequestFailed: connection closed early; asyncio.TimeoutError: no event for timeout_s.
    """
    async with AsyncTcpClient(host, port, connect_timeout=10.0) as client:
        trace.wall_start_s = time.time()
        started = time.perf_counter()
        await client.write_event(
            Synthesize(text=text, voice=SynthesizeVoice(name=voice)).event())
        await _read_until(client, trace, started, lambda e: AudioStop.is_type(e.type), timeout_s)
    return trace


async def streaming(host: str, port: int, text: str, voice: str, trace: RunTrace,
                    timeout_s: float, delta_chars: int = 10,
                    delta_interval_s: float = 0.05) -> RunTrace:
    """Send ``text`` as a streaming request (deltas every ``delta_interval_s``); fill ``trace``.

    Raises:
        RequestFailed, asyncio.TimeoutError: as :func:`one_shot`.
    """
    async with AsyncTcpClient(host, port, connect_timeout=10.0) as client:
        trace.wall_start_s = time.time()
        started = time.perf_counter()
        voice_data = SynthesizeVoice(name=voice)
        await client.write_event(SynthesizeStart(voice=voice_data).event())

        async def send_text() -> None:
            for delta in text_deltas(text, delta_chars):
                await client.write_event(SynthesizeChunk(text=delta).event())
                await asyncio.sleep(delta_interval_s)
            await client.write_event(Synthesize(text=text, voice=voice_data).event())
            await client.write_event(SynthesizeStop().event())

        writer = asyncio.create_task(send_text())
        try:
            await _read_until(client, trace, started,
                              lambda e: SynthesizeStopped.is_type(e.type), timeout_s)
        finally:
            if not writer.done():
                writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
    return trace
