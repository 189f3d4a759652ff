"""Streamed sentences queued behind a running one are spoken as one engine request, or join
the running one when it asks for more, through the real server and a Wyoming client over
TCP."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from server_support import (
    FaultyEngine,
    Response,
    client,
    collect,
    fake_model_dir,
    make_settings,
    recording_faulty_factory,
    running_server,
    wait_until,
    whole_text_plan,
)
from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.engine.options import SynthesisOptions
from wyoming_cosyvoice3.engine.text.pieces import PlannedPiece
from wyoming_cosyvoice3.server.preroll import expected_speech_s
from wyoming_cosyvoice3.server.settings import Limits
from wyoming_cosyvoice3.server.streams import MERGE_BUDGET_S

MakeClip = Callable[..., Path]
LONG = "Then " + "many words here " * 22 + "end."  # 21 s expected: over the budget alone


async def _six_sentences(tmp_path: Path, make_clip: MakeClip,
                         follow_up: bool) -> tuple[FaultyEngine, Response]:
    """One stream: a first sentence that holds the engine while five more arrive."""
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data")
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as cl:
        engine = holder[0]
        engine.follow_up = follow_up
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="Hello HOLD there. Two").event())
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
    # all six sentences spoken: three 0.2 s chunks per sentence of the stand-in engine
    assert len(result.samples) == 6 * 3 * 4800
    return engine, result


async def test_queued_sentences_merge_up_to_the_budget(tmp_path: Path,
                                                        make_clip: MakeClip) -> None:
    # an engine that never asks for more (each request speaks what it was given): the
    # sentences queued behind the first are merged up to the budget per request
    assert expected_speech_s(LONG) > MERGE_BUDGET_S
    engine, _ = await _six_sentences(tmp_path, make_clip, follow_up=False)
    assert engine.texts == ["Hello HOLD there.", "Two. Three. Four.", LONG, "Tail."]


async def test_sentences_queued_meanwhile_join_the_running_request(
        tmp_path: Path, make_clip: MakeClip) -> None:
    # the engine asks for more text while its last piece plays (the real engine: once the
    # LLM has decoded it): the sentences queued meanwhile join the running request, merged
    # up to the budget at each ask, so the LLM never waits for a new request
    engine, _ = await _six_sentences(tmp_path, make_clip, follow_up=True)
    assert engine.texts == ["Hello HOLD there. Two. Three. Four. " + LONG + " Tail."]
    assert engine.plans == [["Hello HOLD there.", "Two.", "Three.", "Four.", LONG, "Tail."]]
    assert engine.outcomes == ["completed"]


async def test_an_error_behind_queued_sentences_is_not_taken(
        tmp_path: Path, make_clip: MakeClip) -> None:
    # the sentence before the error joins the running request, the error ends the response
    # after all the audio before it, and nothing after the error is spoken
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data",
                             limits=Limits(max_text_chars=40))
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as cl:
        engine = holder[0]
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="One HOLD. Two. ").event())
        assert await asyncio.to_thread(wait_until, lambda: len(engine.texts) == 1)
        await cl.write_event(SynthesizeChunk(text="Three is far too long " * 3).event())
        await asyncio.sleep(1.0)
        engine.gate.set()
        await cl.write_event(SynthesizeStop().event())
        result = await collect(cl, "synthesize-stopped")
    assert [e.code for e in result.errors] == ["text-too-long"]
    assert engine.texts == ["One HOLD. Two."]
    assert len(result.samples) == 2 * 3 * 4800
    types = result.types
    last_audio = max(i for i, t in enumerate(types) if t == "audio-chunk")
    assert last_audio < types.index("error") < types.index("audio-stop")


async def test_merge_stops_at_errors_and_the_end_marker() -> None:
    """An error or the end marker behind queued sentences is never merged away: it is carried
    and comes next, after the merged text."""
    from wyoming_cosyvoice3.server.protocol import SpeakRequest
    from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer
    from wyoming_cosyvoice3.server.streams import StreamError, StreamRequest

    stream = StreamRequest(request=SpeakRequest(), buffer=SentenceBuffer(), max_chars=1000)
    await stream.add_text({"text": "One. Two. Three. "})
    stream.add_problem("text-too-long", "too long")
    stream.finish()
    first = await stream.next_item()
    assert first is not None and not isinstance(first, StreamError)
    merged = stream.merge_queued(first)
    assert merged.text == "One. Two. Three." and merged.queued_at == first.queued_at
    error = await stream.next_item()
    assert isinstance(error, StreamError) and error.code == "text-too-long"
    assert await stream.next_item() is None
    # a budget of 0 s merges nothing: each sentence stays alone
    stream2 = StreamRequest(request=SpeakRequest(), buffer=SentenceBuffer(), max_chars=1000)
    await stream2.add_text({"text": "One. Two. "})
    first2 = await stream2.next_item()
    assert first2 is not None and not isinstance(first2, StreamError)
    assert stream2.merge_queued(first2, budget_s=0.0).text == "One."
    second = await stream2.next_item()
    assert second is not None and not isinstance(second, StreamError)
    assert second.text == "Two."


async def test_text_may_follow_until_the_end_and_its_queued_text_are_taken() -> None:
    """The piece gate takes a request's decoding as ending with its last piece only once the
    stream can bring no more text to the worker."""
    from wyoming_cosyvoice3.server.protocol import SpeakRequest
    from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer
    from wyoming_cosyvoice3.server.streams import StreamRequest

    stream = StreamRequest(request=SpeakRequest(), buffer=SentenceBuffer(), max_chars=1000)
    await stream.add_text({"text": "One. Two. "})
    assert await stream.next_item() is not None
    assert stream.text_may_follow()  # no synthesize-stop yet
    stream.finish()
    assert stream.text_may_follow()  # "Two." is queued before the end marker
    second = await stream.next_item()
    assert second is not None
    assert not stream.text_may_follow()  # only the end marker is left
    # a sentence carried by a merge still comes; the end marker carried does not count
    stream2 = StreamRequest(request=SpeakRequest(), buffer=SentenceBuffer(), max_chars=1000)
    await stream2.add_text({"text": "One. Two. "})
    stream2.finish()
    first = await stream2.next_item()
    assert first is not None
    stream2.merge_queued(first, budget_s=0.0)  # "Two." carried
    assert stream2.text_may_follow()
    assert await stream2.next_item() is not None
    stream2.merge_queued(first)  # the end marker carried
    assert stream2.has_carry
    assert not stream2.text_may_follow()


class _Planner:
    """The engine's planning calls: no token count (no bound), the text as one piece."""

    def text_token_count(self, text: str) -> int | None:
        return None

    def plan_pieces(self, text: str, language_hint: str | None = None,
                    max_piece_tokens: int | None = None,
                    read_numbers: bool = True) -> list[PlannedPiece]:
        return whole_text_plan(text)


async def test_follow_up_takes_nothing_late_or_when_stopping() -> None:
    """The running request is handed nothing once it has run half the time limit, while the
    server stops or once the stream is abandoned: those sentences stay queued (or are
    dropped with the stream) and nothing taken is lost."""
    from wyoming_cosyvoice3.server.preroll import PieceGate, ProductionHistory
    from wyoming_cosyvoice3.server.protocol import RequestStats, SpeakRequest
    from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer
    from wyoming_cosyvoice3.server.streams import FollowUp, StreamRequest

    async def send(event: object) -> None:
        del event

    stream = StreamRequest(request=SpeakRequest(), buffer=SentenceBuffer(), max_chars=1000)
    await stream.add_text({"text": "One. Two. "})
    runtime = SimpleNamespace(
        loader=SimpleNamespace(engine=_Planner(), request_options=SynthesisOptions),
        stopping=threading.Event(), production=ProductionHistory(),
        settings=SimpleNamespace(limits=Limits(max_request_s=10.0)))
    gate = PieceGate(send, 0.0, runtime.production)
    gate.begin_text([1.0])
    stats = RequestStats(kind="stream")
    before = time.monotonic()
    more = FollowUp(runtime, stream, gate, stats, asyncio.get_running_loop())  # type: ignore[arg-type]
    assert before + 5.0 <= more.deadline <= time.monotonic() + 5.0  # half of max_request_s
    more.deadline = time.monotonic() - 0.1  # the request has run half the limit
    assert await asyncio.to_thread(more) == []
    more.deadline = time.monotonic() + 60.0
    runtime.stopping.set()
    assert await asyncio.to_thread(more) == []
    assert stream.items.qsize() == 2 and not stream.has_carry  # nothing was taken
    runtime.stopping.clear()
    taken = await asyncio.to_thread(more)
    assert [piece.text for piece in taken] == ["One. Two."]  # merged, as at a request's start
    assert stream.items.empty() and (stats.chars, stats.sentences) == (9, 1)
    await stream.add_text({"text": "Three. "})
    stream.abandon()
    assert await asyncio.to_thread(more) == []
