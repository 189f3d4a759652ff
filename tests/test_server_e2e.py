"""The real server on an ephemeral TCP port, with the real engine on the tiny synthetic model,
driven by the ``wyoming`` package's own client (cases C1, C5-C11, C13 of shared/cases)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from server_support import (
    SpyEngine,
    check_audio_format,
    client,
    collect,
    describe,
    make_settings,
    one_shot_error,
    read,
    running_server,
    spy_factory,
    wait_until,
)
from wire_support import frame, read_until_eof
from wyoming.audio import AudioChunk
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

from wyoming_cosyvoice3.server.cli import RunningServer
from wyoming_cosyvoice3.server.preroll import ProductionHistory
from wyoming_cosyvoice3.server.protocol import pcm16
from wyoming_cosyvoice3.server.streams import INLINE_CHUNK_CHARS

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Shared:
    server: RunningServer
    spy: SpyEngine
    release: threading.Event


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tiny_model_dir: Path, tiny_engine_cache: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Shared]:
    data_dir = tmp_path_factory.mktemp("data")
    holder: list[SpyEngine] = []
    release = threading.Event()
    release.set()  # tests clear it to hold requests before their last chunk
    settings = make_settings(tiny_model_dir, data_dir, tiny_engine_cache, max_concurrent=2)
    async with running_server(settings, spy_factory(holder, release)) as server:
        state = Shared()
        state.server, state.spy, state.release = server, holder[0], release
        yield state
        release.set()


def expected_pcm(state: Shared, texts: list[str], voice: str) -> np.ndarray:
    """What the engine itself produces for ``texts`` (one request each) with the server's seed."""
    runtime = state.server.runtime
    prompt = runtime.voices[voice].prompt
    assert prompt is not None
    options = runtime.loader.synthesis_options(runtime.settings.seed)
    pcm = b"".join(pcm16(chunk.samples) for text in texts
                   for chunk in state.spy.inner.synthesize(text, prompt, options))
    return np.frombuffer(pcm, dtype="<i2")


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    # identical up to float rounding of the int16 conversion
    assert np.max(np.abs(got.astype(np.int32) - want.astype(np.int32)), initial=0) <= 2


async def test_describe(shared: Shared) -> None:
    info = await describe(shared.server)
    assert len(info.tts) == 1
    program = info.tts[0]
    assert program.name == "cosyvoice3" and program.installed
    assert program.supports_synthesize_streaming
    for credit in ("FunAudioLLM", "CosyVoice3", "Apache-2.0"):
        assert credit in program.attribution.name
    voices = {v.name: v for v in program.voices}
    assert list(voices) == ["zh-female", "en-male"]
    assert all(v.installed for v in voices.values())
    assert voices["zh-female"].languages[0] == "zh" and voices["en-male"].languages[0] == "en"
    assert "FunAudioLLM" in voices["en-male"].attribution.name


async def test_one_shot_streams_24khz_pcm_in_chunks(shared: Shared) -> None:
    text = "Hello world. This is a test."
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=text, voice=SynthesizeVoice("en-male")).event())
        response = await collect(cl, "audio-stop")
    check_audio_format(response)
    assert len(response.chunks) > 2
    assert all(len(c.audio) <= 1024 * 2 for c in response.chunks)
    assert_same_audio(response.samples, expected_pcm(shared, [text], "en-male"))
    assert np.abs(response.samples).max() > 100  # not silence


async def test_home_assistant_streaming_sequence(shared: Shared) -> None:
    """C6: deltas not aligned to words; first sentence heard before synthesize-stop."""
    pieces = ["The li", "ving room lig", "hts are now on. Th", "e kitchen is 21", ".5 degrees"]
    calls_before = len(shared.spy.texts)
    ended_before = len(shared.spy.outcomes)
    async with client(shared.server) as cl:
        voice = SynthesizeVoice("en-male")
        await cl.write_event(SynthesizeStart(voice=voice).event())
        for piece in pieces:
            await cl.write_event(SynthesizeChunk(text=piece).event())
        # the first sentence is complete: its audio must come before we send the stop
        early = await collect(cl, "audio-chunk")
        assert early.types[-1] == "audio-chunk"
        # the stop ends the tail sentence; sent while the first sentence's engine request
        # still decodes, the engine would take it into that request (one engine request per
        # answer), on a busy machine sometimes: wait for the request to end (bounded)
        for _ in range(1500):
            if len(shared.spy.outcomes) > ended_before:
                break
            await asyncio.sleep(0.02)
        assert shared.spy.outcomes[ended_before:] == ["completed"]
        await cl.write_event(Synthesize(text="".join(pieces), voice=voice).event())
        await cl.write_event(SynthesizeStop().event())
        rest = await collect(cl, "synthesize-stopped")
    response = early
    response.events.extend(rest.events)
    check_audio_format(response)
    assert response.types[-2:] == ["audio-stop", "synthesize-stopped"]
    # the markdown pass ends the unpunctuated tail as a sentence (the engine would add the
    # same full stop to its last piece)
    sentences = ["The living room lights are now on.", "The kitchen is 21.5 degrees."]
    assert shared.spy.texts[calls_before:] == sentences  # the compat synthesize was ignored
    assert_same_audio(response.samples, expected_pcm(shared, sentences, "en-male"))


_MARKDOWN_REPLY = ("**Sure!** Here are the lights:\n- Kitchen: *on*\n- Living room: off\n\n"
                   "| Room | Temp |\n|---|---|\n| Hall | 19 °C |\n\n```yaml\nx: 1\n```\n"
                   "See [the docs](https://example.com/a_b) 👍")


async def test_markdown_reply_streamed_over_tcp(shared: Shared) -> None:
    """An agent's markdown in small deltas reaches the engine as plain sentences."""
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        voice = SynthesizeVoice("en-male")
        await cl.write_event(SynthesizeStart(voice=voice).event())
        for start in range(0, len(_MARKDOWN_REPLY), 3):
            await cl.write_event(SynthesizeChunk(text=_MARKDOWN_REPLY[start:start + 3]).event())
        await cl.write_event(SynthesizeStop().event())
        response = await collect(cl, "synthesize-stopped")
    check_audio_format(response)
    # sentences queued together reach the engine as one request (merged with blanks)
    assert " ".join(shared.spy.texts[calls_before:]) == " ".join([
        "Sure!", "Here are the lights:", "Kitchen: on.", "Living room: off.", "Room, Temp.",
        "Hall, 19 °C.", "See the docs.",
    ])
    # a request carries the language of the stream so far, so a sentence without an
    # English cue of its own ("Hall, 19 °C.") reads its numbers as the one-shot answer does
    hints = dict(zip(shared.spy.texts[calls_before:], shared.spy.hints[calls_before:],
                     strict=True))
    assert [hint for text, hint in hints.items() if "Hall, 19" in text] == ["en"]
    # alone, "Sure!" gives no cue (when not merged): the hint is then the voice's first
    # language (en-male: en), which the normaliser uses only for sentences without a cue
    assert hints.get("Sure!", "en") == "en"


async def test_large_markdown_chunk_is_converted_off_the_loop(shared: Shared) -> None:
    """A chunk over INLINE_CHUNK_CHARS goes through the worker-thread path, in order."""
    items = "".join(f"- **Lamp {n}** is *on*\n" for n in range(12))
    big = "Here is the list:\n" + items
    assert len(big) > INLINE_CHUNK_CHARS
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(SynthesizeStart(voice=SynthesizeVoice("en-male")).event())
        await cl.write_event(SynthesizeChunk(text="Sure! ").event())
        await cl.write_event(SynthesizeChunk(text=big).event())
        await cl.write_event(SynthesizeChunk(text="\nDone.").event())
        await cl.write_event(SynthesizeStop().event())
        response = await collect(cl, "synthesize-stopped")
    check_audio_format(response)
    assert " ".join(shared.spy.texts[calls_before:]) == " ".join(
        ["Sure!", "Here is the list:", *[f"Lamp {n} is on." for n in range(12)], "Done."])


async def test_markdown_one_shot_over_tcp(shared: Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    # the markdown reaches the engine as one request. A runtime that measured production
    # faster than playback keeps a one-shot text whole; a fresh one assumes a slow machine
    # and speaks a short first clause as a request of its own (server/speech.py
    # first_pieces, test_server_pauses.py). The tiny model is fast once measured, but the
    # test must not depend on the tests before it: the history is set here
    fast = ProductionHistory()
    fast.add_response(20.0, 10.0)
    monkeypatch.setattr(shared.server.runtime, "production", fast)
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=_MARKDOWN_REPLY,
                                        voice=SynthesizeVoice("en-male")).event())
        response = await collect(cl, "audio-stop")
    check_audio_format(response)
    assert shared.spy.texts[calls_before:] == [
        "Sure! Here are the lights:\nKitchen: on.\nLiving room: off.\nRoom, Temp.\n"
        "Hall, 19 °C.\nSee the docs."
    ]


async def test_slow_stream_loses_nothing(shared: Shared) -> None:
    """C7: chunks arriving with pauses (shortened from 2 s) all end up spoken."""
    pieces = ["Good mor", "ning. ", "The wea", "ther is ", "sunny today", "."]
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(SynthesizeStart(voice=SynthesizeVoice("zh-female")).event())
        for piece in pieces:
            await cl.write_event(SynthesizeChunk(text=piece).event())
            await asyncio.sleep(0.4)
        await cl.write_event(SynthesizeStop().event())
        response = await collect(cl, "synthesize-stopped")
    check_audio_format(response)
    sentences = ["Good morning.", "The weather is sunny today."]
    assert shared.spy.texts[calls_before:] == sentences
    assert_same_audio(response.samples, expected_pcm(shared, sentences, "zh-female"))


async def test_connection_is_reusable(shared: Shared) -> None:
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text="One.").event())
        first = await collect(cl, "audio-stop")
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="Two. Three").event())
        await cl.write_event(SynthesizeStop().event())
        second = await collect(cl, "synthesize-stopped")
        await cl.write_event(Synthesize(text="Four.").event())
        third = await collect(cl, "audio-stop")
        await cl.write_event(Describe().event())
        info = await read(cl)
    for response in (first, second, third):
        check_audio_format(response)
        assert response.chunks
    assert Info.is_type(info.type)


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
async def test_blank_text_is_a_coded_error(shared: Shared, text: str) -> None:
    """C1 (blank): empty-text error; the same connection then synthesises."""
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        assert (await one_shot_error(cl)).code == "empty-text"
        await cl.write_event(Synthesize(text="Okay.").event())
        check_audio_format(await collect(cl, "audio-stop"))


async def test_unspeakable_text_gives_empty_audio(shared: Shared) -> None:
    """C1 (nothing speakable): audio-start + audio-stop, no chunk, connection open."""
    async with client(shared.server) as cl:
        for text in ["。", "...", "?!", "👍"]:
            await cl.write_event(Synthesize(text=text).event())
            response = await collect(cl, "audio-stop")
            assert response.types == ["audio-start", "audio-stop"], text
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="👍 ...").event())
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert streamed.types == ["audio-start", "audio-stop", "synthesize-stopped"]
        await cl.write_event(Synthesize(text="Fine.").event())
        check_audio_format(await collect(cl, "audio-stop"))


async def test_bad_requests_keep_the_connection(shared: Shared) -> None:
    """C9 (typed data) and unknown events: coded errors, then normal service."""
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="synthesize", data={}))
        assert (await one_shot_error(cl)).code == "invalid-text"
        await cl.write_event(Event(type="synthesize", data={"text": 5}))
        assert (await one_shot_error(cl)).code == "invalid-text"
        await cl.write_event(Event(type="synthesize", data={"text": "Hi.", "text_format": "ssml"}))
        assert (await one_shot_error(cl)).code == "text-format-not-supported"
        await cl.write_event(Event(type="synthesize", data={"text": "x" * 10001}))
        assert (await one_shot_error(cl)).code == "text-too-long"
        await cl.write_event(Event(type="select-program", data={"name": "x"}))
        await cl.write_event(Event(type="not-an-event"))
        await cl.write_event(Synthesize(text="Still here.").event())
        response = await collect(cl, "audio-stop")
    assert response.types[0] == "audio-start"  # the ignored events produced nothing
    check_audio_format(response)


async def raw_exchange(port: int, data: bytes) -> list[dict]:
    """Send raw bytes; return the JSON headers the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    headers = []
    try:
        for _ in range(20):
            line = await asyncio.wait_for(reader.readline(), 10)
            if not line:
                break
            header = json.loads(line)
            if header.get("data_length"):
                header["data"] = json.loads(await reader.readexactly(header["data_length"]))
            headers.append(header)
    finally:
        writer.close()
    return headers


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"this is not json\n", "malformed-event"),
        (b'["a list"]\n', "malformed-event"),
        (b'{"type": "synthesize", "payload_length": 100000000000}\n', "event-too-large"),
        (b'{"type": "synthesize", "data_length": -3}\n', "malformed-event"),
        (b"{" * 70000 + b"\n", "event-too-large"),
    ],
)
async def test_broken_wire_input_closes_cleanly(shared: Shared, raw: bytes, code: str) -> None:
    """C9 (wire): a coded error, then the server closes that connection and serves others."""
    assert shared.server.port is not None
    headers = await raw_exchange(shared.server.port, raw)
    assert [h["type"] for h in headers] == ["error"]
    assert headers[0]["data"]["code"] == code
    info = await describe(shared.server)
    assert info.tts[0].voices


async def test_bad_data_block_is_skipped(shared: Shared) -> None:
    """A synthesize whose data is not a JSON object: answered like a failed one-shot request
    (error + audio-stop), and the connection goes on (the framing is intact)."""
    assert shared.server.port is not None
    body = b"[1, 2]"
    raw = (json.dumps({"type": "synthesize", "data_length": len(body)}).encode() + b"\n" + body
           + json.dumps({"type": "describe"}).encode() + b"\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", shared.server.port)
    writer.write(raw)
    await writer.drain()
    types = []
    for _ in range(3):
        header = json.loads(await asyncio.wait_for(reader.readline(), 10))
        await reader.readexactly(header.get("data_length", 0))
        types.append(header["type"])
    writer.close()
    assert types == ["error", "audio-stop", "info"]


@pytest.mark.parametrize(
    ("voice", "used"),
    [(None, "zh-female"), ({}, "zh-female"), ({"name": "en-male"}, "en-male"),
     ({"language": "en"}, "en-male"), ({"language": "en-GB"}, "en-male"),
     ({"language": "de"}, "zh-female"), ({"language": "zh"}, "zh-female")],
)
async def test_voice_selection(shared: Shared, voice: dict | None, used: str) -> None:
    """C10: default voice, voice by name, first voice of a language."""
    data: dict = {"text": "Yes."}
    if voice is not None:
        data["voice"] = voice
    calls_before = len(shared.spy.voices)
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="synthesize", data=data))
        response = await collect(cl, "audio-stop")
    check_audio_format(response)
    assert response.chunks
    assert shared.spy.voices[calls_before:] == [used]


@pytest.mark.parametrize(
    "voice", [{"name": "nobody"}, {"name": "en-male", "speaker": "2"}, {"language": "xx"},
              {"name": 7}],
)
async def test_unknown_voice_is_a_coded_error(shared: Shared, voice: dict) -> None:
    """C10: coded invalid-voice error naming the valid voices; connection stays usable."""
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="synthesize", data={"text": "Hi.", "voice": voice}))
        error = await one_shot_error(cl)
        assert error.code == "invalid-voice"
        if "speaker" not in voice and voice != {"name": 7}:
            assert "zh-female" in error.text and "en-male" in error.text
        # the same in a stream: error, then the stream still ends with synthesize-stopped
        await cl.write_event(Event(type="synthesize-start", data={"voice": voice}))
        await cl.write_event(SynthesizeChunk(text="Hi.").event())
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert streamed.errors[0].code == "invalid-voice"
        assert not streamed.chunks
        await cl.write_event(Synthesize(text="Hi.").event())
        check_audio_format(await collect(cl, "audio-stop"))


async def test_long_text_streams_audio_early(shared: Shared) -> None:
    """C5: 3,000 characters; the first audio-chunk arrives while synthesis is still running."""
    prose = ("The evening was quiet, and the lamps along the river came on one by one. "
             "People walked slowly home, talking about the day and the weather ahead. ")
    text = (prose * 25)[:3000]
    calls_before = len(shared.spy.outcomes)
    shared.release.clear()  # no request may finish before we saw its first chunk
    try:
        async with client(shared.server) as cl:
            await cl.write_event(Synthesize(text=text).event())
            response = await collect(cl, "audio-chunk")
            assert response.types == ["audio-start", "audio-chunk"]
            assert len(shared.spy.outcomes) == calls_before  # the engine is still at work
            check = AudioChunk.from_event(response.events[-1][1])
            assert (check.rate, check.width, check.channels) == (24000, 2, 1)
    finally:
        shared.release.set()
    # leaving cancelled the rest: the engine stops instead of speaking 3,000 characters
    assert await asyncio.to_thread(wait_until, lambda: shared.server.runtime.runner.active == 0, 30)
    assert shared.spy.outcomes[calls_before:] in (["cancelled"], ["closed"])
    assert shared.spy.stop_flags[calls_before:] == [True]


async def test_disconnect_cancels_and_next_client_is_served(shared: Shared) -> None:
    """C8: the client hangs up after the first audio-chunk of a long request."""
    text = " ".join(f"Sentence number {n} is here to keep the engine busy." for n in range(12))
    calls_before = len(shared.spy.outcomes)
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        await collect(cl, "audio-chunk")
    assert await asyncio.to_thread(wait_until, lambda: shared.server.runtime.runner.active == 0, 30)
    assert shared.spy.outcomes[calls_before:] in (["cancelled"], ["closed"])
    assert shared.spy.stop_flags[calls_before:] == [True]  # should_stop reported the hang-up
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text="Next please.").event())
        response = await collect(cl, "audio-stop")
    check_audio_format(response)
    assert_same_audio(response.samples, expected_pcm(shared, ["Next please."], "zh-female"))


async def test_disconnect_during_streaming_text(shared: Shared) -> None:
    """C8 (streaming): hang up mid-stream, before synthesize-stop."""
    calls_before = len(shared.spy.outcomes)
    async with client(shared.server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="A first sentence that is spoken. And").event())
        await collect(cl, "audio-chunk")
    assert await asyncio.to_thread(wait_until, lambda: shared.server.runtime.runner.active == 0, 30)
    assert shared.spy.outcomes[calls_before:] in (["cancelled"], ["closed"])
    assert shared.spy.stop_flags[calls_before:] == [True]
    info = await describe(shared.server)
    assert info.tts[0].voices[0].installed


async def test_two_clients_and_a_describe(shared: Shared) -> None:
    """C11: two syntheses in progress at once; a third client's describe is answered at once."""
    texts = ["First client speaking here.", "Second client speaking now."]
    shared.release.clear()
    try:
        async with client(shared.server) as a, client(shared.server) as b:
            await a.write_event(Synthesize(text=texts[0], voice=SynthesizeVoice("en-male")).event())
            await b.write_event(Synthesize(text=texts[1], voice=SynthesizeVoice("en-male")).event())
            got_a = await collect(a, "audio-chunk")
            got_b = await collect(b, "audio-chunk")
            # both requests are in the engine and held before their last chunk
            assert shared.server.runtime.runner.active == 2
            info = await describe(shared.server, timeout_s=1.0)
            assert [v.installed for v in info.tts[0].voices] == [True, True]
            shared.release.set()
            got_a.events.extend((await collect(a, "audio-stop")).events)
            got_b.events.extend((await collect(b, "audio-stop")).events)
    finally:
        shared.release.set()
    for response, text in zip((got_a, got_b), texts, strict=True):
        check_audio_format(response)
        assert_same_audio(response.samples, expected_pcm(shared, [text], "en-male"))


async def test_half_closed_client_gets_its_answers(shared: Shared) -> None:
    """A client that sends its requests and then shuts down its sending side (TCP half-close)
    still receives every answer; then the server ends the connection."""
    assert shared.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", shared.server.port)
    for event in (Describe().event(), Synthesize(text="Half closed.").event()):
        body = json.dumps(event.data).encode()
        writer.write(json.dumps({"type": event.type, "data_length": len(body)}).encode()
                     + b"\n" + body)
    writer.write_eof()
    await writer.drain()
    types: list[str] = []
    pcm_bytes = 0
    for _ in range(10000):
        line = await asyncio.wait_for(reader.readline(), 30)
        if not line:
            break
        header = json.loads(line)
        await reader.readexactly(header.get("data_length") or 0)
        pcm_bytes += len(await reader.readexactly(header.get("payload_length") or 0))
        types.append(header["type"])
    writer.close()
    assert types[0] == "info" and types[1] == "audio-start" and types[-1] == "audio-stop"
    assert set(types[2:-1]) == {"audio-chunk"} and pcm_bytes > 0 and pcm_bytes % 2 == 0


async def test_half_close_during_a_stream_still_ends_it(shared: Shared) -> None:
    """End of input while a stream (no ``synthesize-stop``) is being spoken: the stream stops
    speaking but its response still ends with ``audio-stop`` + ``synthesize-stopped``."""
    assert shared.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", shared.server.port)
    while shared.spy.started.acquire(blocking=False):  # forget earlier tests' requests
        pass
    shared.release.clear()  # the sentence is held in the engine before its last chunk
    try:
        for event in (SynthesizeStart().event(),
                      SynthesizeChunk(text="Held here. And more").event()):
            writer.write(frame(event))
        await writer.drain()
        assert await asyncio.to_thread(shared.spy.started.acquire, True, 30)
        writer.write_eof()  # while "Held here." is still being synthesised
        await writer.drain()
        events = await read_until_eof(reader, timeout_s=30)
    finally:
        shared.release.set()
        writer.close()
    types = [e.type for e in events]
    assert types[0] == "audio-start" and types[-2:] == ["audio-stop", "synthesize-stopped"]
    assert "error" not in types


async def test_flood_of_requests_is_bounded(shared: Shared) -> None:
    """More than 16 requests pending on one connection: one server-busy error, the rest are
    answered in order, the connection stays usable."""
    async with client(shared.server) as cl:
        shared.release.clear()
        try:
            await cl.write_event(Synthesize(text="Hold on.").event())
            first = await collect(cl, "audio-chunk")
            for _ in range(40):
                await cl.write_event(Describe().event())
            await asyncio.sleep(0.2)
        finally:
            shared.release.set()
        first.events.extend((await collect(cl, "audio-stop")).events)
        check_audio_format(first)
        answers = [(await read(cl)).type for _ in range(17)]
        assert answers.count("info") == 16 and answers.count("error") == 1
        await cl.write_event(Describe().event())
        assert (await read(cl)).type == "info"
