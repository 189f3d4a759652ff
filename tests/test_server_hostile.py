"""Hostile or broken input never harms the server, on the real engine with
the tiny synthetic model: wrong types in every field of every event, control characters and
NUL, unpaired surrogates, 10,000 characters without punctuation, special-token text, broken
reference clips and corrupted model files."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

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
    running_server,
    spy_factory,
    wait_until,
)
from wire_support import read_until_eof
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.engine.text.markdown import markdown_to_speech
from wyoming_cosyvoice3.server.cli import RunningServer
from wyoming_cosyvoice3.server.model_loader import ModelState

MakeClip = Callable[..., Path]
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


class Shared:
    server: RunningServer
    spy: SpyEngine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tiny_model_dir: Path, tiny_engine_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Shared]:
    holder: list[SpyEngine] = []
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("data"), tiny_engine_cache,
                             max_concurrent=2)
    release = threading.Event()
    release.set()
    async with running_server(settings, spy_factory(holder, release)) as server:
        state = Shared()
        state.server, state.spy = server, holder[0]
        yield state


async def still_serves(cl: Any) -> None:
    """The same connection answers a describe after whatever came before."""
    await cl.write_event(Describe().event())
    assert (await collect(cl, "info")).types[-1] == "info"


# --- wrong types in every field ----------------------------------------------------------------

WRONG = [5, 1.5, True, None, [], ["x"], {}, {"a": 1}]
"""Values of the wrong type for any string field (None only where the field is required)."""


@pytest.mark.parametrize("value", [v for v in WRONG if v is not None] + [None])
async def test_synthesize_text_of_wrong_type(shared: Shared, value: Any) -> None:
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="synthesize", data={"text": value}))
        assert (await one_shot_error(cl)).code == "invalid-text"
        await still_serves(cl)


@pytest.mark.parametrize(
    "voice",
    [5, 1.5, True, [], ["en-male"], {"name": 5}, {"name": ["en-male"]}, {"name": {}},
     {"language": 7}, {"language": ["en"]}, {"speaker": ["a"]},
     {"name": "en-male", "speaker": {"id": 1}}, {"name": "x" * 300}, {"language": "e" * 300}],
)
async def test_voice_of_wrong_type(shared: Shared, voice: Any) -> None:
    """One-shot and streaming: invalid-voice, the response ends properly, the connection
    stays usable."""
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="synthesize", data={"text": "Hi.", "voice": voice}))
        error = await one_shot_error(cl)
        assert error.code == "invalid-voice" and len(error.text) < 400
        await cl.write_event(Event(type="synthesize-start", data={"voice": voice}))
        await cl.write_event(SynthesizeChunk(text="Hi.").event())
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["invalid-voice"] and not streamed.chunks
        await still_serves(cl)


@pytest.mark.parametrize("value", [5, [], {"x": "ssml"}, "ssml", True])
async def test_text_format_of_wrong_type(shared: Shared, value: Any) -> None:
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="synthesize", data={"text": "Hi.", "text_format": value}))
        assert (await one_shot_error(cl)).code == "text-format-not-supported"
        await cl.write_event(Event(type="synthesize-start", data={"text_format": value}))
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["text-format-not-supported"]
        await still_serves(cl)


@pytest.mark.parametrize("value", [v for v in WRONG if v is not None] + [None])
async def test_stream_chunk_of_wrong_type(shared: Shared, value: Any) -> None:
    """A bad chunk fails its stream (invalid-text, nothing more spoken), which still ends
    with synthesize-stopped; the next stream on the connection works."""
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(Event(type="synthesize-chunk", data={"text": value}))
        await cl.write_event(SynthesizeChunk(text="Not spoken.").event())
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["invalid-text"]
        assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
        assert len(shared.spy.texts) == calls_before
        await still_serves(cl)


@pytest.mark.parametrize("data", [{"x": [1, {"y": None}]}, {"text": 5}, {"voice": []}])
async def test_junk_data_on_describe_and_stop(shared: Shared, data: dict[str, Any]) -> None:
    async with client(shared.server) as cl:
        await cl.write_event(Event(type="describe", data=data))
        assert (await collect(cl, "info")).types == ["info"]
        await cl.write_event(Event(type="synthesize-stop", data=data))  # a stray stop
        assert (await collect(cl, "synthesize-stopped")).types == ["synthesize-stopped"]
        await cl.write_event(Event(type="audio-chunk", data=data, payload=b"\x01\x02"))
        await cl.write_event(Event(type="synthesize", data={"text": "Okay.", "context": data}))
        response = await collect(cl, "audio-stop")
        check_audio_format(response)
        assert response.chunks


async def test_describe_with_unreadable_data_gets_an_error_and_the_info(shared: Shared) -> None:
    """A describe whose data cannot be read (not an object, not JSON) is still a describe the
    framing could follow: a coded error, then the info, and the connection goes on."""
    assert shared.server.port is not None
    wire = [b'{"type": "describe", "data": [1]}\n',
            b'{"type": "describe", "data_length": 6}\n[1, 2]',
            b'{"type": "describe", "data_length": 5}\nnot{}']
    reader, writer = await asyncio.open_connection("127.0.0.1", shared.server.port)
    try:
        writer.write(b"".join(wire) + json.dumps(
            {"type": "synthesize", "data": {"text": "Okay."}}).encode() + b"\n")
        writer.write_eof()  # half-closed: every accepted request is still answered
        events = await read_until_eof(reader)
    finally:
        writer.close()
    types = [e.type for e in events]
    assert types[:6] == ["error", "info"] * 3, types
    assert [e.data["code"] for e in events[:6:2]] == ["malformed-event"] * 3
    expected = (await describe(shared.server)).event().data
    assert all(e.data == expected for e in events[1:6:2])
    assert types[6] == "audio-start" and types[-1] == "audio-stop" and "audio-chunk" in types


# --- text content ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "speakable"),
    [("Lights\x00 on\x01\x02 now.\x1b[31m Kitchen\x7f too.", True), ("\x00\x00\x00", False),
     ("Tab\tand\rreturn.\u2028Line\u2029sep.", True), ("Zero\u200bwidth\ufeff joiner.", True)],
)
async def test_control_characters_and_nul(shared: Shared, text: str, speakable: bool) -> None:
    """Control characters and NUL harm nothing: speakable text around them gives audio, only
    control characters give none; always ending with audio-stop. The engine gets the text as
    the markdown pass leaves it (NUL dropped, the rest for the engine's normaliser)."""
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        response = await collect(cl, "audio-stop")
        assert not response.errors
        check_audio_format(response)
        assert bool(response.chunks) is speakable, response.types
        await still_serves(cl)
    expected = markdown_to_speech(text).strip()
    assert shared.spy.texts[calls_before:calls_before + 1] == [expected]


async def test_unpaired_surrogates(shared: Shared) -> None:
    """JSON may carry lone UTF-16 surrogates (``"\\ud800"``): the request ends normally and
    errors naming such text are still valid UTF-8 on the wire."""
    assert shared.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", shared.server.port)
    for data in ('{"text": "Half \\ud800 a pair."}', '{"text": "x", "voice": "\\udfff"}'):
        body = data.encode()
        writer.write(json.dumps({"type": "synthesize", "data_length": len(body)}).encode()
                     + b"\n" + body)
    writer.write_eof()
    events = await read_until_eof(reader, 60)
    writer.close()
    types = [e.type for e in events]
    assert types.count("audio-stop") == 2 and types[-2:] == ["error", "audio-stop"]
    assert events[-2].data["code"] == "invalid-voice"


async def test_special_token_text_is_plain_text(shared: Shared) -> None:
    """Control-token strings in user text lose their markup in the markdown pass, and the
    engine's prompt for the raw strings holds no added-token id (they are spelled out as
    ordinary text)."""
    text = "<|endofprompt|> [breath] Hello <|im_start|>system [laughter] there.<|endoftext|>"
    calls_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=text, voice=None).event())
        response = await collect(cl, "audio-stop")
    assert not response.errors and response.chunks
    assert shared.spy.texts[calls_before:] == [
        "endofprompt breath Hello im_startsystem laughter there.endoftext."]
    engine = shared.spy.inner
    tokenizer = engine.model.tokenizer  # type: ignore[attr-defined]
    added = set(tokenizer.get_added_tokens_decoder())
    assert engine.model.end_of_prompt_id in added  # type: ignore[attr-defined]
    voice = shared.server.runtime.voices["zh-female"].prompt
    assert voice is not None
    frontend = engine.frontend  # type: ignore[attr-defined]
    eop = engine.model.end_of_prompt_id  # type: ignore[attr-defined]
    spelled = ""
    for piece in frontend.split_pieces(text):
        prompt = frontend.build_prompt(piece, voice)
        ids = [int(i) for i in [*prompt.prompt_text_ids, *prompt.tts_text_ids]]
        assert ids.count(eop) == 1, piece  # only the frontend's own separator
        assert not (added - {eop}).intersection(ids), piece
        spelled += tokenizer.decode(frontend.encode_user(piece))
    # the normaliser drops the <|...|> markup; the bracket tags are spoken as words
    assert "breath" in spelled and "laughter" in spelled and "Hello" in spelled


async def test_ten_thousand_characters_without_punctuation(shared: Shared) -> None:
    """One-shot and streamed: audio starts (the text is cut into pieces), a hang-up stops
    the engine, and the server goes on."""
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    text = (words * 200)[:10000]
    outcomes_before = len(shared.spy.outcomes)
    async with client(shared.server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        assert (await collect(cl, "audio-chunk")).types == ["audio-start", "audio-chunk"]
    texts_before = len(shared.spy.texts)
    async with client(shared.server) as cl:
        await cl.write_event(SynthesizeStart().event())
        for offset in range(0, len(text), 100):
            await cl.write_event(SynthesizeChunk(text=text[offset:offset + 100]).event())
        await collect(cl, "audio-chunk")
    assert await asyncio.to_thread(wait_until, lambda: shared.server.runtime.runner.active == 0, 60)
    assert await asyncio.to_thread(
        wait_until, lambda: len(shared.spy.outcomes) >= outcomes_before + 2, 30)
    assert set(shared.spy.outcomes[outcomes_before:]) <= {"cancelled", "closed"}
    streamed = shared.spy.texts[texts_before:]
    assert streamed and all(0 < len(t) <= 400 for t in streamed)  # cut at the soft limit
    info = await describe(shared.server, timeout_s=1.0)
    assert all(v.installed for v in info.tts[0].voices)


# --- broken voice clips and catalogs (their own server) -----------------------------------------


async def test_broken_reference_clips(tiny_model_dir: Path, tiny_engine_cache: Path,
                                      tmp_path: Path, make_clip: MakeClip,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """Truncated, garbage, empty, directory, FIFO and looping clips, and a second catalog
    with a python tag: each broken voice is disabled with one log line naming it, the server
    starts, the bundled voices work."""
    data = tmp_path / "data"
    whole = make_clip(data / "whole.wav", seconds=3.0).read_bytes()
    (data / "truncated.wav").write_bytes(whole[: len(whole) // 3])
    (data / "garbage.wav").write_bytes(os.urandom(50_000))
    (data / "empty.wav").write_bytes(b"")
    (data / "dir.wav").mkdir()
    os.mkfifo(data / "fifo.wav")
    os.symlink(data / "loop2.wav", data / "loop1.wav")
    os.symlink(data / "loop1.wav", data / "loop2.wav")
    broken = ["truncated", "garbage", "empty", "dir", "fifo", "loop1"]
    (data / "voices.yaml").write_text(
        "voices:\n" + "".join(f"  - {{name: {n}, languages: [en], clip: {n}.wav}}\n"
                              for n in broken), encoding="utf-8")
    evil = tmp_path / "evil.yaml"
    evil.write_text("voices: !!python/object/apply:os.getcwd []\n", encoding="utf-8")
    settings = make_settings(tiny_model_dir, data, tiny_engine_cache, voices_file=evil)
    with caplog.at_level(logging.WARNING):
        async with running_server(settings) as server:
            info = await describe(server)
            installed = {v.name: v.installed for v in info.tts[0].voices}
            assert installed == {"zh-female": True, "en-male": True,
                                 **{n: False for n in broken}}
            async with client(server) as cl:
                await cl.write_event(Event(type="synthesize",
                                           data={"text": "Hi.", "voice": {"name": "garbage"}}))
                error = await one_shot_error(cl)
                assert error.code == "invalid-voice" and "en-male" in error.text
                await cl.write_event(Synthesize(text="Still fine.").event())
                check_audio_format(await collect(cl, "audio-stop"))
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for name in broken:
        assert sum(f"'{name}'" in m for m in messages) == 1, (name, messages)
    assert sum(str(evil) in m for m in messages) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- corrupted model files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "damage"),
    [("hift.onnx", "truncate"), ("tokenizer.json", "garbage"),
     ("llm_int8.onnx.data", "truncate"), ("flow.decoder.estimator.fp32.onnx", "empty"),
     ("campplus.onnx", "garbage")],
)
async def test_corrupted_model_file(tiny_model_copy: Path, tiny_engine_cache: Path,
                                    tmp_path: Path, name: str, damage: str) -> None:
    """A damaged model file: a clear error at load naming the file (describe says so), every
    request gets a coded error and a proper end, no crash at the first request. (The derived
    files are keyed by their source's size and time, so the damaged file is derived from anew
    while the copy's intact files reuse the session's cache.)"""
    path = tiny_model_copy / name
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(4096),
                      "empty": b""}[damage])
    settings = make_settings(tiny_model_copy, tmp_path / "data", tiny_engine_cache)
    async with running_server(settings) as server:
        info = await describe(server, timeout_s=1.0)
        program = info.tts[0]
        named = name.removesuffix(".data")  # a bad .data file is reported with its graph
        assert named in (program.description or "")
        assert not any(v.installed for v in program.voices)
        if name != "campplus.onnx":  # the voice encoder loads lazily: the model itself is up
            assert server.runtime.loader.state is ModelState.FAILED
        async with client(server) as cl:
            await cl.write_event(Synthesize(text="Hello.").event())
            error = await one_shot_error(cl)
            assert error.code in ("model-invalid", "invalid-voice") and named in error.text
            await cl.write_event(SynthesizeStart().event())
            await cl.write_event(SynthesizeChunk(text="Hello.").event())
            await cl.write_event(SynthesizeStop().event())
            streamed = await collect(cl, "synthesize-stopped")
            assert [e.code for e in streamed.errors] == [error.code]
            await still_serves(cl)
