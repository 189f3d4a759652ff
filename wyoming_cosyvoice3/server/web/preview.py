"""Preview: a sentence spoken in a voice, sent as a WAV stream while it is being made.

The answer is ``audio/wav`` (24000 Hz, 16-bit, mono PCM) in chunked transfer encoding: a
44-byte RIFF header whose size fields say "unknown length" (0xFFFFFFFF, as streaming WAV
writers do), then the samples of each engine chunk as soon as the engine yields it, so an
``<audio>`` element starts playing after the first chunk. The synthesis goes through the
runtime like a Wyoming request (same worker slots, queue limit, time limit, preset and seed);
it stops within one model step when the browser goes away or the server stops.

Errors before the first audio are JSON answers with a status (the page shows the message);
after audio has been sent the stream just ends (and the server logs why).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import numpy as np
from aiohttp import web

from ...engine.constants import OUTPUT_SAMPLE_RATE_HZ
from ...engine.errors import CosyVoiceError, EmptyText, SynthesisCancelled
from ...engine.options import AudioChunk
from ..protocol import CHANNELS, SAMPLE_WIDTH_BYTES, ClientGone, RequestStats, pcm16
from ..runner import ServerBusy
from ..runtime import ServerRuntime
from ..speech import speech_text
from .errors import BadRequest, Conflict, NotFound, PageError, Unavailable

_LOGGER = logging.getLogger(__name__)

MAX_PREVIEW_CHARS = 500
"""Longest preview text (also at most ``--max-text-chars``): a sentence or two."""
UNKNOWN_LENGTH = 0xFFFFFFFF
"""RIFF/data size of a WAV stream whose length is not known when its header is sent."""


def wav_stream_header(rate_hz: int = OUTPUT_SAMPLE_RATE_HZ, channels: int = CHANNELS,
                      width_bytes: int = SAMPLE_WIDTH_BYTES) -> bytes:
    """The 44-byte canonical PCM WAV header with "unknown" RIFF and data sizes."""
    block_align = channels * width_bytes
    return (b"RIFF" + struct.pack("<I", UNKNOWN_LENGTH) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate_hz, rate_hz * block_align,
                                    block_align, 8 * width_bytes)
            + b"data" + struct.pack("<I", UNKNOWN_LENGTH))


def preview_text(raw: str | None, max_text_chars: int) -> str:
    """Validate the preview text.

    Raises:
        BadRequest: blank or longer than ``min(500, max_text_chars)`` characters.
    """
    text = (raw or "").strip()
    limit = min(MAX_PREVIEW_CHARS, max_text_chars)
    if not text:
        raise BadRequest("type a sentence to hear")
    if len(text) > limit:
        raise BadRequest(f"the preview text has {len(text)} characters; use at most {limit}")
    return text


async def stream_preview(request: web.Request, runtime: ServerRuntime, name: str,
                         text: str) -> web.StreamResponse:
    """Synthesise ``text`` (markdown, as Home Assistant's agents write it: turned into speech
    text first, like a Wyoming request) with voice ``name`` and stream it as WAV.

    Raises:
        NotFound: no such voice; Conflict: the voice is disabled (the reason is given);
        Unavailable: the model is not ready, or too many syntheses wait;
        BadRequest: nothing speakable; PageError: the engine failed before any audio.
    """
    slot = runtime.voices.get(name)
    if slot is None:
        raise NotFound(f"there is no voice named {name!r}; reload the page")
    loader = runtime.loader
    try:
        loader.require_ready()
    except CosyVoiceError as err:
        raise Unavailable(str(err)) from err
    if slot.prompt is None:
        raise Conflict(f"voice {name!r} is disabled: {slot.problem or 'not prepared'}")
    chars = len(text)
    text = await speech_text(text)  # the same markdown pass as a Wyoming request
    if not text:
        raise BadRequest("nothing speakable in the text (only markup or punctuation); type words")
    options = loader.request_options()
    response = web.StreamResponse(headers={"Content-Type": "audio/wav",
                                           "Cache-Control": "no-store"})
    stats = RequestStats(kind="preview", voice=name, chars=chars, sentences=1)
    started = time.monotonic()
    gone = False

    def should_stop() -> bool:
        transport = request.transport
        return gone or runtime.stopping.is_set() or transport is None or transport.is_closing()

    async def on_chunk(chunk: AudioChunk) -> None:
        nonlocal gone
        pcm = pcm16(np.asarray(chunk.samples))
        try:
            if not response.prepared:
                await response.prepare(request)
                await response.write(wav_stream_header())
                stats.first_chunk_s = time.monotonic() - started
            await response.write(pcm)
        except (ConnectionError, RuntimeError) as err:  # aiohttp: reset / closing transport
            gone = True
            raise ClientGone from err
        stats.audio_samples += len(pcm) // SAMPLE_WIDTH_BYTES

    outcome = "done"
    try:
        stats.compute_s = await runtime.runner.run_synthesis(text, slot.prompt, options,
                                                             should_stop, on_chunk)
    except ClientGone:
        stats.log("cancelled (client gone)")
        return response
    except asyncio.CancelledError:  # the page server is closing (shutdown)
        stats.log("cancelled (server stopping)")
        raise
    except EmptyText as err:
        raise BadRequest(f"nothing speakable in the text ({err}); type words") from err
    except ServerBusy as err:
        raise Unavailable(str(err)) from err
    except SynthesisCancelled as err:
        if not response.prepared:
            stats.log("cancelled")
            raise Unavailable(f"the preview was stopped: {err}") from err
        outcome = "cancelled"
    except CosyVoiceError as err:
        if not response.prepared:
            stats.log(f"failed [{err.code}]")
            raise PageError(f"the preview failed: {err}") from err
        outcome = f"failed [{err.code}]"
    if not response.prepared:  # nothing was produced
        await response.prepare(request)
        await response.write(wav_stream_header())
    try:
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        outcome = "cancelled (client gone)"
    stats.log(outcome)
    return response
