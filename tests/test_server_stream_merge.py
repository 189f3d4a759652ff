"""Streamed sentences queued behind a running one are spoken as one engine request (issue 12
item 3), through the real server and a Wyoming client over TCP."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from server_support import (
    FaultyEngine,
    client,
    collect,
    fake_model_dir,
    make_settings,
    recording_faulty_factory,
    running_server,
    wait_until,
)
from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.server.preroll import expected_speech_s
from wyoming_cosyvoice3.server.streams import MERGE_BUDGET_S

MakeClip = Callable[..., Path]
LONG = "Then " + "many words here " * 22 + "end."  # 21 s expected: over the budget alone


async def test_queued_sentences_merge_up_to_the_budget(tmp_path: Path,
                                                        make_clip: MakeClip) -> None:
    assert expected_speech_s(LONG) > MERGE_BUDGET_S
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data")
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="Hello HOLD there. Two").event())
        engine = holder[0]
        # the first sentence starts as soon as it is complete, alone
        assert await asyncio.to_thread(wait_until, lambda: len(engine.texts) == 1)
        assert engine.texts == ["Hello HOLD there."]
        for text in (". Three. Fo", "ur. ", LONG + " ", "Tail. "):
            await cl.write_event(SynthesizeChunk(text=text).event())
        await asyncio.sleep(1.0)  # the server reads the chunks while the first sentence holds
        engine.gate.set()
        await cl.write_event(SynthesizeStop().event())
        result = await collect(cl, "synthesize-stopped")
    assert not result.errors
    assert engine.texts == ["Hello HOLD there.", "Two. Three. Four.", LONG, "Tail."]
    # all six sentences spoken: three 0.2 s chunks per sentence of the stand-in engine
    assert len(result.samples) == 6 * 3 * 4800
