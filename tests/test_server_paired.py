"""Two pieces decoded at once, through the real server on the tiny synthetic model, driven by the
``wyoming`` package's client (cases C5, C6, C8 of shared/cases with pairing on): the audio is
the audio of one piece at a time, a stream's sentences are all spoken, a hang-up cancels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from server_support import (
    check_audio_format,
    client,
    collect,
    make_settings,
    running_server,
    wait_until,
)
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.server.cli import RunningServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = " ".join(f"Sentence number {n} says that the lights in room {n} are on." for n in range(9))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path, tiny_engine_cache: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    # no holds: the pieces are then the engine's own cut, the same for every request (with
    # holds their bound follows the measured rate, which the first request changes)
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("data"), tiny_engine_cache,
                             llm_graph="fused-q4", max_preroll_ms=0)
    async with running_server(settings) as running:
        yield running


def _llm(server: RunningServer) -> Any:
    engine = server.runtime.loader.engine
    assert engine is not None
    return engine.llm


def _count_two_row_steps(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    step_pair = llm.step_pair

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return step_pair(*args, **kwargs)

    monkeypatch.setattr(llm, "step_pair", counting)
    return calls


async def _one_shot(server: RunningServer, text: str) -> np.ndarray:
    async with client(server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        response = await collect(cl, "audio-stop")
    check_audio_format(response)
    return response.samples


async def test_paired_audio_is_the_audio_of_one_piece_at_a_time(
        server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm(server)
    if not llm.pairs_pieces:
        pytest.skip("this CPU's kernels couple the rows of a two-row fused-q4 step")
    # the vocoder's deferral follows the wall clock, which a busier machine moves between any
    # two requests (the mel is then cut elsewhere, a float rounding apart): off here
    monkeypatch.setattr("wyoming_cosyvoice3.engine.pipeline.may_defer", lambda *_: False)
    steps = _count_two_row_steps(llm, monkeypatch)
    paired = await _one_shot(server, TEXT)
    assert steps, "the pieces did not pair"  # the engine cuts the text into several pieces
    monkeypatch.setattr(llm, "pairs_pieces", False)
    alone = await _one_shot(server, TEXT)
    assert paired.size > 0 and paired.shape == alone.shape
    np.testing.assert_array_equal(paired, alone)  # same tokens, so the same samples


async def test_a_streams_sentences_are_all_spoken_with_pairing(
        server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """C6: deltas not aligned to words; the first sentence is heard before the stop; every
    sentence is spoken (the later ones join the decoding as they come)."""
    llm = _llm(server)
    if not llm.pairs_pieces:
        pytest.skip("this CPU's kernels couple the rows of a two-row fused-q4 step")
    deltas = ["The li", "ving room lig", "hts are now on. Th", "e kitchen is 21",
              ".5 degrees. The front door is locked. The gar", "den sprinklers run."]
    async with client(server) as cl:
        await cl.write_event(SynthesizeStart().event())
        for delta in deltas:
            await cl.write_event(SynthesizeChunk(text=delta).event())
        early = await collect(cl, "audio-chunk")
        assert early.types[-1] == "audio-chunk"
        await cl.write_event(SynthesizeStop().event())
        rest = await collect(cl, "synthesize-stopped")
    early.events.extend(rest.events)
    check_audio_format(early)
    assert early.types[-2:] == ["audio-stop", "synthesize-stopped"]
    # about 0.4 s of speech per tiny-model sentence at least: four sentences, none dropped
    assert early.samples.size > 4 * 0.4 * 24000


async def test_a_hang_up_cancels_a_paired_request(server: RunningServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """C8 while two pieces decode together: the request stops, the next client is served."""
    llm = _llm(server)
    if not llm.pairs_pieces:
        pytest.skip("this CPU's kernels couple the rows of a two-row fused-q4 step")
    steps = _count_two_row_steps(llm, monkeypatch)
    text = " ".join(f"Sentence number {n} is here to keep the engine busy." for n in range(12))
    async with client(server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        await collect(cl, "audio-chunk")
    runner = server.runtime.runner
    assert await asyncio.to_thread(wait_until, lambda: runner.active == 0, 30)
    assert steps  # the hang-up came while pieces were paired or after
    assert (await _one_shot(server, "Next please.")).size > 0
