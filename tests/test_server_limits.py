"""Every resource limit of the server: each is a setting, each exceeded one is
a coded ``error``, and the server keeps serving. Runs on the fast fault-injecting engine
(``FaultyEngine``): the limits are the server's, not the model's."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from server_support import (
    FaultyEngine,
    check_audio_format,
    client,
    collect,
    describe,
    fake_model_dir,
    make_settings,
    one_shot_error,
    recording_faulty_factory,
    running_server,
    wait_until,
)
from wire_support import frame, read_until_eof
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.server.protocol import IdleTimeout, ProtocolError, read_event
from wyoming_cosyvoice3.server.settings import ERROR_CODES, OPTIONS, Limits, resolve_settings

MakeClip = Callable[..., Path]
pytestmark = pytest.mark.timeout(120)


def settings_with(tmp_path: Path, make_clip: MakeClip, **limits: Any) -> Any:
    """Settings of a FaultyEngine server with the given limits (others default)."""
    concurrent = limits.pop("max_concurrent", 1)
    return make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data",
                         max_concurrent=concurrent, limits=Limits(**limits))


async def raw_connection(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


# --- settings ---------------------------------------------------------------------------------


def test_every_limit_is_a_setting_with_an_error_code() -> None:
    """Each Limits field has a flag/env/options key and a documented error code."""
    dests = {opt.dest for opt in OPTIONS}
    for limit in fields(Limits):
        assert limit.name in dests, limit.name
        assert limit.name in ERROR_CODES or limit.name == "write_timeout_s"
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    limits_section = readme[readme.index("## Limits"):readme.index("## Performance")]
    for opt in OPTIONS:
        if opt.dest in {f.name for f in fields(Limits)}:
            assert f"`{opt.flag}`" in limits_section and f"`{opt.env}`" in limits_section
    for code in set(ERROR_CODES.values()):
        assert f"`{code}`" in limits_section, code


def test_limits_from_flags_environment_and_options_file(tmp_path: Path) -> None:
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"max_connections": 5, "idle_timeout_seconds": 7.5,
                                   "max_event_header_bytes": 4096}), encoding="utf-8")
    env = {"COSYVOICE3_MAX_PENDING_REQUESTS": "3", "COSYVOICE3_WRITE_TIMEOUT_SECONDS": "9",
           "COSYVOICE3_MAX_CONNECTIONS": "6"}
    settings = resolve_settings(["--model-dir", "m", "--options-file", str(options),
                                 "--max-clip-bytes", "1000", "--max-event-data-bytes", "2000",
                                 "--max-event-payload-bytes", "3000"], environ=env)
    assert settings.limits == Limits(
        max_connections=6, idle_timeout_s=7.5, max_event_header_bytes=4096,
        max_pending_requests=3, write_timeout_s=9.0, max_clip_bytes=1000,
        max_event_data_bytes=2000, max_event_payload_bytes=3000,
    )
    with pytest.raises(SystemExit):
        resolve_settings(["--model-dir", "m", "--max-connections", "0"], environ={})


# --- connections ------------------------------------------------------------------------------


async def test_connection_limit(tmp_path: Path, make_clip: MakeClip) -> None:
    """Over max_connections: too-many-connections, closed; a slot freed is usable again."""
    settings = settings_with(tmp_path, make_clip, max_connections=2)
    async with running_server(settings, recording_faulty_factory([])) as server:
        assert server.port is not None
        async with client(server) as a, client(server) as b:
            for cl in (a, b):  # both connections are being served
                await cl.write_event(Describe().event())
                assert (await collect(cl, "info")).types == ["info"]
            reader, writer = await raw_connection(server.port)
            writer.write(frame(Describe().event()))  # already sent: still gets the error
            events = await read_until_eof(reader, 10)
            writer.close()
            assert [e.type for e in events] == ["error"]
            assert events[0].data["code"] == "too-many-connections"
            assert "--max-connections" in events[0].data["text"]
            assert server.runtime.connections.open == 2
        assert await asyncio.to_thread(
            wait_until, lambda: server.runtime.connections.open == 0
        )
        assert (await describe(server)).tts[0].voices


async def test_idle_connection_is_closed(tmp_path: Path, make_clip: MakeClip) -> None:
    settings = settings_with(tmp_path, make_clip, idle_timeout_s=0.4)
    async with running_server(settings, recording_faulty_factory([])) as server:
        assert server.port is not None
        reader, writer = await raw_connection(server.port)
        events = await read_until_eof(reader, 30)
        writer.close()
        assert [(e.type, e.data.get("code")) for e in events] == [("error", "idle-timeout")]
        assert await asyncio.to_thread(
            wait_until, lambda: server.runtime.connections.open == 0
        )


async def test_idle_stream_is_ended_then_closed(tmp_path: Path, make_clip: MakeClip) -> None:
    """An open stream waiting for text counts as idle: it is ended properly (so a waiting
    client is released), then the connection is closed."""
    holder: list[FaultyEngine] = []
    settings = settings_with(tmp_path, make_clip, idle_timeout_s=0.4)
    async with running_server(settings, recording_faulty_factory(holder)) as server:
        assert server.port is not None
        reader, writer = await raw_connection(server.port)
        writer.write(frame(SynthesizeStart().event())
                     + frame(SynthesizeChunk(text="Spoken now. And an unfinished").event()))
        events = await read_until_eof(reader, 30)
        writer.close()
    types = [e.type for e in events]
    assert types[0] == "audio-start" and "audio-chunk" in types
    assert types[-3:] == ["error", "audio-stop", "synthesize-stopped"]
    assert events[-3].data["code"] == "idle-timeout"
    assert holder[0].texts == ["Spoken now."]  # the unfinished tail was dropped


async def test_waiting_for_an_answer_is_not_idle(tmp_path: Path, make_clip: MakeClip) -> None:
    """A request held in the engine and one queued behind it, both far longer than the idle
    time: neither connection is closed; both get all their audio."""
    holder: list[FaultyEngine] = []
    settings = settings_with(tmp_path, make_clip, idle_timeout_s=0.3)
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as a, client(server) as b:
        await a.write_event(Synthesize(text="HOLD this one.").event())
        assert await asyncio.to_thread(holder[0].started.acquire, True, 30)
        await b.write_event(Synthesize(text="Queued behind.").event())
        assert await asyncio.to_thread(wait_until, lambda: server.runtime.runner._waiting == 1)
        await asyncio.sleep(1.2)  # four idle periods
        holder[0].gate.set()
        for cl in (a, b):
            response = await collect(cl, "audio-stop")
            assert not response.errors
            check_audio_format(response)
            assert len(response.chunks) >= 3


async def test_stalled_event_is_closed(tmp_path: Path, make_clip: MakeClip) -> None:
    settings = settings_with(tmp_path, make_clip, idle_timeout_s=0.4)
    async with running_server(settings, recording_faulty_factory([])) as server:
        assert server.port is not None
        reader, writer = await raw_connection(server.port)
        writer.write(json.dumps({"type": "synthesize", "data_length": 50}).encode() + b"\n"
                     + b'{"text": ')
        events = await read_until_eof(reader, 30)
        writer.close()
        assert [(e.type, e.data.get("code")) for e in events] == [("error", "idle-timeout")]


async def test_client_that_stops_reading_is_dropped(tmp_path: Path,
                                                    make_clip: MakeClip) -> None:
    """A client that never reads: once the socket buffers are full, the write times out,
    the synthesis stops and the worker serves the next client."""
    holder: list[FaultyEngine] = []
    settings = settings_with(tmp_path, make_clip, write_timeout_s=0.5)
    async with running_server(settings, recording_faulty_factory(holder)) as server:
        assert server.port is not None
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(frame(Synthesize(text="ENDLESS audio for nobody.").event()))
        try:
            assert await asyncio.to_thread(wait_until, lambda: holder[0].outcomes != [], 60)
            assert holder[0].outcomes in (["cancelled"], ["closed"])
            assert holder[0].stop_flags == [True]
            assert await asyncio.to_thread(wait_until, lambda: server.runtime.runner.active == 0)
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="Next.").event())
                check_audio_format(await collect(cl, "audio-stop"))
        finally:
            sock.close()


# --- queues -----------------------------------------------------------------------------------


async def test_full_synthesis_queue_is_server_busy(tmp_path: Path, make_clip: MakeClip) -> None:
    """max_queued_requests=1 with one worker: the third request is refused (one-shot and
    stream both end properly); the held and the queued request then complete."""
    holder: list[FaultyEngine] = []
    settings = settings_with(tmp_path, make_clip, max_queued_requests=1)
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as a, client(server) as b, client(server) as c:
        await a.write_event(Synthesize(text="HOLD the worker.").event())
        assert await asyncio.to_thread(holder[0].started.acquire, True, 30)
        await b.write_event(Synthesize(text="Waiting.").event())
        assert await asyncio.to_thread(wait_until, lambda: server.runtime.runner._waiting == 1)
        await c.write_event(Synthesize(text="Too many.").event())
        refused = await collect(c, "audio-stop")
        assert refused.types[-2:] == ["error", "audio-stop"] and not refused.chunks
        error = refused.errors[0]
        assert error.code == "server-busy" and "--max-queued-requests" in error.text
        await c.write_event(SynthesizeStart().event())
        await c.write_event(SynthesizeChunk(text="Also too many. ").event())
        await c.write_event(SynthesizeStop().event())
        streamed = await collect(c, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["server-busy"]
        assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
        holder[0].gate.set()
        for cl in (a, b):
            response = await collect(cl, "audio-stop")
            assert not response.errors and response.chunks
        assert holder[0].texts == ["HOLD the worker.", "Waiting."]


async def test_pending_requests_per_connection(tmp_path: Path, make_clip: MakeClip) -> None:
    """max_pending_requests=2: a burst of five describes behind a held request gives two
    answers and one server-busy; the connection stays usable."""
    holder: list[FaultyEngine] = []
    settings = settings_with(tmp_path, make_clip, max_pending_requests=2)
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as cl:
        await cl.write_event(Synthesize(text="HOLD please.").event())
        assert await asyncio.to_thread(holder[0].started.acquire, True, 30)
        for _ in range(5):
            await cl.write_event(Describe().event())
        await asyncio.sleep(0.2)
        holder[0].gate.set()
        check_audio_format(await collect(cl, "audio-stop"))
        answers = [(await collect(cl, t)).types[-1] for t in ("info", "info", "error")]
        assert answers == ["info", "info", "error"]
        await cl.write_event(Describe().event())
        assert (await collect(cl, "info")).types == ["info"]


# --- time and text ----------------------------------------------------------------------------


async def test_request_time_limit(tmp_path: Path, make_clip: MakeClip) -> None:
    """max_request_s: an endless synthesis ends with timeout (one-shot and stream)."""
    settings = settings_with(tmp_path, make_clip, max_request_s=0.3)
    async with running_server(settings, recording_faulty_factory([])) as server, \
            client(server) as cl:
        await cl.write_event(Synthesize(text="ENDLESS talk.").event())
        response = await collect(cl, "audio-stop")
        assert response.types[0] == "audio-start" and response.chunks
        assert response.types[-2:] == ["error", "audio-stop"]
        assert response.errors[0].code == "timeout"
        assert "--max-request-seconds" in response.errors[0].text
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="ENDLESS again. ").event())
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["timeout"]
        assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
        await cl.write_event(Synthesize(text="Short.").event())
        fine = await collect(cl, "audio-stop")
        assert not fine.errors and fine.chunks


async def test_streamed_text_limit(tmp_path: Path, make_clip: MakeClip) -> None:
    """A stream over max_text_chars: text-too-long, what came before is spoken, the rest is
    dropped, and the stream still ends with synthesize-stopped."""
    holder: list[FaultyEngine] = []
    settings = settings_with(tmp_path, make_clip, max_text_chars=40)
    async with running_server(settings, recording_faulty_factory(holder)) as server, \
            client(server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text="First sentence here. ").event())
        await cl.write_event(SynthesizeChunk(text="Second one is too long now.").event())
        await cl.write_event(SynthesizeChunk(text="Third.").event())
        await cl.write_event(SynthesizeStop().event())
        streamed = await collect(cl, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["text-too-long"]
        assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
        assert holder[0].texts == ["First sentence here."]
        await cl.write_event(Synthesize(text="x" * 41).event())
        assert (await one_shot_error(cl)).code == "text-too-long"


# --- event sizes ------------------------------------------------------------------------------


async def test_event_size_limits_are_configurable(tmp_path: Path, make_clip: MakeClip) -> None:
    settings = settings_with(tmp_path, make_clip, max_event_header_bytes=100_000,
                             max_event_data_bytes=1000, max_event_payload_bytes=1000)
    async with running_server(settings, recording_faulty_factory([])) as server:
        assert server.port is not None
        # a header longer than the stream reader's 64 KiB buffer, within the limit: served
        reader, writer = await raw_connection(server.port)
        writer.write(json.dumps({"type": "describe", "pad": "x" * 80_000}).encode() + b"\n")
        writer.write_eof()
        assert [e.type for e in await read_until_eof(reader, 30)] == ["info"]
        writer.close()
        for raw in (
            json.dumps({"type": "describe", "pad": "x" * 120_000}).encode() + b"\n",
            json.dumps({"type": "synthesize", "data_length": 1001}).encode() + b"\n",
            json.dumps({"type": "synthesize", "payload_length": 1001}).encode() + b"\n",
        ):
            reader, writer = await raw_connection(server.port)
            writer.write(raw)
            events = await read_until_eof(reader, 30)
            writer.close()
            assert [(e.type, e.data.get("code")) for e in events] == [
                ("error", "event-too-large")]
        # within the limits the same connection shape works
        reader, writer = await raw_connection(server.port)
        writer.write(frame(Event(type="synthesize", data={"text": "Fits."},
                                 payload=b"\0" * 1000)))
        writer.write_eof()
        types = [e.type for e in await read_until_eof(reader, 30)]
        writer.close()
        assert types[0] == "audio-start" and types[-1] == "audio-stop"


@pytest.mark.parametrize(
    ("raw", "limit", "expected"),
    [
        (b'{"type": "describe"}\n', 21, "describe"),
        (b'{"type": "describe"}\n', 20, "event-too-large"),
        (b'{"type": "describe", "x": "' + b"y" * 70000 + b'"}\n', 70100, "describe"),
        (b'{"type": "describe", "x": "' + b"y" * 70000 + b'"}\n', 70000, "event-too-large"),
        (b"z" * 200000, 100000, "event-too-large"),  # no newline at all
    ],
)
async def test_reader_header_limit(raw: bytes, limit: int, expected: str) -> None:
    reader = asyncio.StreamReader(limit=2**16)
    reader.feed_data(raw)
    reader.feed_eof()
    try:
        event = await read_event(reader, 1000, 1000, max_header_bytes=limit)
    except ProtocolError as err:
        assert err.fatal
        got = err.code
    else:
        assert event is not None
        got = event.type
    assert got == expected


# --- reference clips --------------------------------------------------------------------------


async def test_clip_size_limit(tmp_path: Path, make_clip: MakeClip) -> None:
    """A catalog clip over max_clip_bytes: that voice is not installed, the reason names the
    setting, the other voices work."""
    settings = settings_with(tmp_path, make_clip, max_clip_bytes=120_000)
    data_dir = tmp_path / "data"
    make_clip(data_dir / "big.wav", seconds=4.0)  # 192 kB of PCM16 at 24 kHz
    (data_dir / "voices.yaml").write_text(
        "voices:\n  - name: big\n    languages: [en]\n    clip: big.wav\n", encoding="utf-8")
    async with running_server(settings, recording_faulty_factory([])) as server:
        info = await describe(server)
        assert {v.name: v.installed for v in info.tts[0].voices} == {
            "zh-female": True, "en-male": True, "big": False}
        async with client(server) as cl:
            await cl.write_event(Event(type="synthesize",
                                       data={"text": "Hi.", "voice": {"name": "big"}}))
            error = await one_shot_error(cl)
        assert error.code == "invalid-voice" and "--max-clip-bytes" in error.text


async def test_reader_timeouts() -> None:
    """Nothing arriving: IdleTimeout with nothing consumed (reading can go on); a begun event
    may take ``stall_timeout_s`` per part however short the wait for its start was."""
    reader = asyncio.StreamReader()
    with pytest.raises(IdleTimeout):
        await read_event(reader, 1000, 1000, timeout_s=0.05)
    reader.feed_data(b'{"type": "describe"')  # half a header: still not consumed
    with pytest.raises(IdleTimeout):
        await read_event(reader, 1000, 1000, timeout_s=0.05)
    body = b'{"text": "Hi."}'

    async def trickle() -> None:
        reader.feed_data(b', "data_length": %d}\n' % len(body))
        await asyncio.sleep(0.3)  # longer than timeout_s, shorter than stall_timeout_s
        reader.feed_data(body)

    feeder = asyncio.create_task(trickle())
    event = await read_event(reader, 1000, 1000, timeout_s=0.1, stall_timeout_s=5.0)
    await feeder
    assert event is not None and event.type == "describe" and event.data == {"text": "Hi."}
    reader.feed_data(b'{"type": "synthesize", "data_length": 5}\n{"')
    with pytest.raises(ProtocolError) as info:
        await read_event(reader, 1000, 1000, timeout_s=5.0, stall_timeout_s=0.1)
    assert info.value.code == "idle-timeout" and info.value.fatal
