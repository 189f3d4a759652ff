"""Adaptive pre-roll through the real server and a Wyoming client over TCP (the first piece's
hold of the piece gate, :mod:`~wyoming_cosyvoice3.server.preroll`).

A paced stand-in engine makes 0.2 s of audio every 0.3 s (production rate r = 2/3 of real
time) and exactly as much audio as the server expects for the text (42 letters at 14 per
second = 3.0 s), all of it one piece. Playback that starts with A seconds in hand never runs
dry when A >= (3 - A)(1 / r - 1) + 0.2 (one chunk), i.e. A >= 1.2 s: six chunks, made 1.8 s
after the request; the gate predicts 15 % more (LENGTH_MARGIN) and waits for seven (2.1 s),
within the first-audio limit of 2.5 s. The client measures when every chunk arrives; the
benchmark's player model counts the stalls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from server_support import (
    FaultyEngine,
    audio_arrivals,
    client,
    fake_model_dir,
    make_settings,
    running_server,
)
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from bench.player import simulate_playback
from wyoming_cosyvoice3.engine.errors import SynthesisCancelled
from wyoming_cosyvoice3.engine.options import AudioChunk as EngineChunk
from wyoming_cosyvoice3.engine.options import EngineOptions, ShouldStop
from wyoming_cosyvoice3.server.engine_port import Engine
from wyoming_cosyvoice3.server.preroll import FIRST_AUDIO_LIMIT_S, expected_speech_s

CHUNK_S = 0.2
INTERVAL_S = 0.3
TEXT = "a" * 42  # 42 / 14 characters per second = 3.0 s expected
MakeClip = Callable[..., Path]
JITTER_S = 0.1
"""Gaps shorter than this are scheduling noise on a shared machine, not stalls."""


class PacedEngine(FaultyEngine):
    """0.2 s of audio every 0.3 s, ``expected_speech_s(text)`` seconds in all."""

    def _chunks(self, pieces: list[str], should_stop: ShouldStop) -> Iterator[EngineChunk]:
        count = round(expected_speech_s(" ".join(pieces)) / CHUNK_S)
        samples = (0.1 * np.sin(np.arange(round(24000 * CHUNK_S)) * 0.05)).astype(np.float32)
        for _ in range(count):
            if should_stop():
                raise SynthesisCancelled("stopped")
            time.sleep(INTERVAL_S)
            yield EngineChunk(samples, 24000, 0, False, 0.0)


def paced_factory(model_dir: Path, options: EngineOptions) -> Engine:
    return PacedEngine(model_dir, options)


async def _one_shot(server) -> list[tuple[float, float]]:
    async with client(server) as cl:
        await cl.write_event(Synthesize(text=TEXT).event())
        return await audio_arrivals(cl, "audio-stop")


async def _stream(server) -> list[tuple[float, float]]:
    async with client(server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text=TEXT[:20]).event())
        await cl.write_event(SynthesizeChunk(text=TEXT[20:]).event())
        task = asyncio.ensure_future(audio_arrivals(cl, "synthesize-stopped"))
        await cl.write_event(SynthesizeStop().event())
        return await task


@pytest.mark.parametrize("mode", ["one-shot", "stream"])
async def test_preroll_holds_first_audio_until_playback_cannot_run_dry(
    tmp_path: Path, make_clip: MakeClip, mode: str
) -> None:
    model_dir = fake_model_dir(tmp_path, make_clip)

    async def measured(bound_ms: int) -> list[tuple[float, float]]:
        settings = make_settings(model_dir, tmp_path / f"data{bound_ms}", max_preroll_ms=bound_ms)
        async with running_server(settings, paced_factory) as server:
            return await (_one_shot(server) if mode == "one-shot" else _stream(server))

    # the three servers run side by side (the paced engine sleeps; each server has its own
    # engine and measures its own production rate), not one after another
    bounds_ms = (0, 500, 3000)
    results = dict(zip(bounds_ms, await asyncio.gather(*map(measured, bounds_ms)), strict=True))
    for arrivals in results.values():
        assert sum(d for _, d in arrivals) == pytest.approx(3.0)
    # no pre-roll: the first chunk after one interval, then a stall before nearly every chunk
    first, report = results[0][0][0], simulate_playback(results[0], JITTER_S / 2)
    assert INTERVAL_S - 0.01 <= first < 2 * INTERVAL_S + JITTER_S
    assert report.stalls >= 10
    # bound 500 ms: held 0.5 s after the first chunk was made, then stalls remain
    first = results[500][0][0]
    assert INTERVAL_S + 0.5 - 0.01 <= first < 2 * INTERVAL_S + 0.5 + JITTER_S
    assert simulate_playback(results[500], JITTER_S).stalls >= 1
    # bound 3000 ms: nothing before six chunks (1.8 s; the gate waits for seven, 2.1 s; a
    # slower machine measures a lower rate and holds longer, up to the first-audio limit of
    # 2.5 s after the synthesis started), never dry afterwards
    first = results[3000][0][0]
    assert 6 * INTERVAL_S - 0.01 <= first < FIRST_AUDIO_LIMIT_S + JITTER_S
    assert results[3000][5][0] - first < JITTER_S  # the six held chunks come together
    assert simulate_playback(results[3000], JITTER_S).stalls == 0
