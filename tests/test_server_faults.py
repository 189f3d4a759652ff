"""Faults the server survives: a client hanging up at every stage of a
request, an exception inside one synthesis, SIGTERM with requests in flight and queued (a real
subprocess), and a second start over a half-written voice-feature cache."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from server_support import (
    FaultyEngine,
    SpyEngine,
    check_audio_format,
    client,
    collect,
    describe,
    fake_model_dir,
    link_engine_cache,
    make_settings,
    recording_faulty_factory,
    running_server,
    spy_factory,
    wait_until,
)
from wire_support import frame, free_port, server_process, wait_process_ready
from wyoming.client import AsyncTcpClient
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

from wyoming_cosyvoice3.server.cli import RunningServer

MakeClip = Callable[..., Path]
pytestmark = pytest.mark.timeout(180)


class Shared:
    server: RunningServer
    spy: SpyEngine
    release: threading.Event


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tiny_model_dir: Path, tiny_engine_cache: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Shared]:
    holder: list[SpyEngine] = []
    release = threading.Event()
    release.set()
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("data"), tiny_engine_cache,
                             max_concurrent=1)
    async with running_server(settings, spy_factory(holder, release)) as server:
        state = Shared()
        state.server, state.spy, state.release = server, holder[0], release
        yield state
        release.set()


def reset_socket(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed client or a pulled cable would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


LONG = " ".join(f"Sentence {n} keeps the engine busy for a while." for n in range(8))


async def before_audio(port: int, reset: bool) -> None:
    """Send a request and leave at once."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(Synthesize(text=LONG).event()))
    await writer.drain()
    reset_socket(writer) if reset else writer.close()


async def mid_chunk(port: int, reset: bool) -> None:
    """Leave after reading the header of the first audio-chunk, before its payload."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(Synthesize(text=LONG).event()))
    for _ in range(10):
        header = json.loads(await asyncio.wait_for(reader.readline(), 60))
        if header["type"] == "audio-chunk":
            break
        await reader.readexactly(header.get("data_length") or 0)
    reset_socket(writer) if reset else writer.close()


async def during_streaming_text(port: int, reset: bool) -> None:
    """Leave with a stream open and an unfinished sentence (nothing spoken yet)."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(SynthesizeStart().event())
                 + frame(SynthesizeChunk(text="An unfinished sentence without an").event()))
    await writer.drain()
    await asyncio.sleep(0.2)
    reset_socket(writer) if reset else writer.close()


async def right_after_stop(port: int, reset: bool) -> None:
    """Leave right after synthesize-stop, before any audio."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(SynthesizeStart().event()) + frame(SynthesizeChunk(text=LONG).event())
                 + frame(SynthesizeStop().event()))
    await writer.drain()
    reset_socket(writer) if reset else writer.close()


async def inside_an_event(port: int, reset: bool) -> None:
    """Leave half-way through an event (header sent, data cut short)."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(json.dumps({"type": "synthesize", "data_length": 40}).encode() + b'\n{"te')
    await writer.drain()
    await asyncio.sleep(0.1)
    reset_socket(writer) if reset else writer.close()


STAGES: dict[str, Callable[[int, bool], Awaitable[None]]] = {
    "before_audio": before_audio,
    "mid_chunk": mid_chunk,
    "during_streaming_text": during_streaming_text,
    "right_after_stop": right_after_stop,
    "inside_an_event": inside_an_event,
}


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
@pytest.mark.parametrize("stage", list(STAGES))
async def test_client_leaves_at_every_stage(shared: Shared, stage: str, reset: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Whenever the client goes (closing or resetting the connection), its work stops, the
    worker and the connection slot are freed, nothing is logged above INFO, and the next
    client gets exactly what the engine produces."""
    server = shared.server
    assert server.port is not None
    outcomes_before = len(shared.spy.outcomes)
    with caplog.at_level(logging.INFO):
        await STAGES[stage](server.port, reset)
        assert await asyncio.to_thread(
            wait_until, lambda: server.runtime.runner.active == 0
            and server.runtime.connections.open == 0, 60)
    # every synthesis that started was stopped by the hang-up (none ran to its end)
    assert set(shared.spy.outcomes[outcomes_before:]) <= {"cancelled", "closed"}
    assert all(shared.spy.stop_flags[outcomes_before:])
    assert not [r for r in caplog.records if r.levelno > logging.INFO], [
        r.getMessage() for r in caplog.records]
    async with client(server) as cl:
        await cl.write_event(Synthesize(text="Next client.").event())
        response = await collect(cl, "audio-stop")
    check_audio_format(response)
    assert not response.errors and response.chunks


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
async def test_client_leaves_while_queued(shared: Shared, reset: bool) -> None:
    """A request waiting for the (single) worker whose client leaves: after a reset it is
    never synthesised; after a plain close (which looks like a half-close until the next
    write) it is stopped at its first audio write, before its first sentence ends."""
    server = shared.server
    assert server.port is not None
    texts_before = len(shared.spy.texts)
    shared.release.clear()  # the first request holds the worker before its last chunk
    try:
        async with client(server) as holder:
            await holder.write_event(Synthesize(text="Holding the worker.").event())
            await collect(holder, "audio-chunk")
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(frame(Synthesize(text=LONG).event()))
            await writer.drain()
            assert await asyncio.to_thread(wait_until, lambda: server.runtime.runner._waiting == 1)
            reset_socket(writer) if reset else writer.close()
            await asyncio.sleep(0.2)
            shared.release.set()
            response = await collect(holder, "audio-stop")
            assert not response.errors
    finally:
        shared.release.set()
    assert await asyncio.to_thread(wait_until, lambda: server.runtime.runner.active == 0
                                   and server.runtime.runner._waiting == 0, 60)
    texts = shared.spy.texts[texts_before:]
    outcomes = shared.spy.outcomes[texts_before:]
    if reset:  # never synthesised
        assert texts == ["Holding the worker."]
        assert outcomes == ["completed"]
    else:  # synthesis began, and stopped before its first sentence ended
        assert texts == ["Holding the worker.", LONG]
        assert outcomes[0] == "completed" and outcomes[1] in {"cancelled", "closed"}
        assert shared.spy.stop_flags[-1] is True


async def _read_until(reader: asyncio.StreamReader, event_type: str) -> None:
    """Read raw events up to the header of the first ``event_type`` (its data unread)."""
    for _ in range(100):
        header = json.loads(await asyncio.wait_for(reader.readline(), 60))
        if header["type"] == event_type:
            return
        await reader.readexactly((header.get("data_length") or 0)
                                 + (header.get("payload_length") or 0))
    raise AssertionError(f"no {event_type}")


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
async def test_disconnect_stops_the_synthesis_in_time(tmp_path: Path, make_clip: MakeClip,
                                                      reset: bool) -> None:
    """When the synthesis stops after the client leaves, measured from the hang-up (DEVELOPMENT.md,
    "Protocol behaviour"). The stand-in engine's steps: 10 ms per chunk; before the first
    chunk of a ``HOLD`` sentence, a wait that checks the stop flag every 0.1 s.

    * while audio is being written: the next write fails (close) or the read fails (reset);
      the engine stops within one step;
    * while the engine computes and nothing is due to be written: a reset stops it within one
      step; a plain close looks like a half-close, so the engine goes on until its first audio
      write after the close, then stops within one step."""
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data")
    async with running_server(settings, recording_faulty_factory(holder)) as server:
        assert server.port is not None
        engine = holder[0]

        async def ended(count: int) -> float:
            assert await asyncio.to_thread(wait_until, lambda: len(engine.ended) >= count, 30)
            return engine.ended[count - 1]

        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(frame(Synthesize(text="Talk ENDLESS.").event()))
        await _read_until(reader, "audio-chunk")
        left = time.monotonic()
        reset_socket(writer) if reset else writer.close()
        writing_s = await ended(1) - left

        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(frame(Synthesize(text="Wait HOLD.").event()))
        await _read_until(reader, "audio-start")
        await asyncio.sleep(0.2)  # the engine is inside its wait
        left = time.monotonic()
        reset_socket(writer) if reset else writer.close()
        if reset:
            computing_s = await ended(2) - left
        else:
            await asyncio.sleep(1.0)
            assert len(engine.ended) == 1  # still computing: nothing was written yet
            released = time.monotonic()
            engine.gate.set()  # the first chunk is ready and written: the close is noticed
            computing_s = await ended(2) - released
    print(f"stopped {writing_s:.3f} s after the hang-up while writing, {computing_s:.3f} s "
          f"{'after the hang-up' if reset else 'after the first audio'} while computing")
    assert len(engine.outcomes) == 2 and set(engine.outcomes) <= {"closed", "cancelled"}
    assert all(engine.stop_flags)
    assert writing_s < 0.5 and computing_s < 0.5


# --- an exception inside one synthesis ---------------------------------------------------------


async def test_bug_in_one_synthesis(tmp_path: Path, make_clip: MakeClip,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """A plain exception (not a coded engine error) inside one synthesis: that client gets
    internal-error and a proper end (one-shot and stream), one traceback is logged, the other
    client's request is unaffected, the connection stays usable."""
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data",
                             max_concurrent=2)
    with caplog.at_level(logging.INFO):
        async with running_server(settings, recording_faulty_factory(holder)) as server, \
                client(server) as bad, client(server) as good:
            await bad.write_event(Synthesize(text="Fine start. Then a CRASH here.").event())
            await good.write_event(Synthesize(text="All good. Really.").event())
            failed = await collect(bad, "audio-stop")
            fine = await collect(good, "audio-stop")
            assert [e.code for e in failed.errors] == ["internal-error"]
            assert failed.types[-2:] == ["error", "audio-stop"] and failed.chunks
            check_audio_format(failed)
            assert not fine.errors and len(fine.chunks) >= 6
            await bad.write_event(SynthesizeStart().event())
            await bad.write_event(SynthesizeChunk(text="One. CRASH now. Three.").event())
            await bad.write_event(SynthesizeStop().event())
            streamed = await collect(bad, "synthesize-stopped")
            assert [e.code for e in streamed.errors] == ["internal-error"]
            assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
            await bad.write_event(Synthesize(text="Recovered.").event())
            again = await collect(bad, "audio-stop")
            assert not again.errors and again.chunks
            assert server.runtime.runner.active == 0
    tracebacks = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(tracebacks) == 2 and all(r.exc_info for r in tracebacks)
    assert holder[0].texts[-1] == "Recovered."


async def test_bug_outside_the_engine_still_ends_the_response(
        tmp_path: Path, make_clip: MakeClip, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A plain exception in the server's own request logic before synthesis (here: voice
    selection): the one-shot client still gets internal-error then audio-stop, the stream
    client audio-stop + synthesize-stopped, each within 5 s (Home Assistant would otherwise
    wait for its own timeout); the traceback is logged once each; the connection is reused."""
    import wyoming_cosyvoice3.server.voice_table as voice_table

    original = voice_table.select_voice

    def buggy_select_voice(voice: Any, *args: Any, **kwargs: Any) -> Any:
        if voice.name == "buggy":
            raise RuntimeError("injected bug in voice selection")
        return original(voice, *args, **kwargs)

    monkeypatch.setattr(voice_table, "select_voice", buggy_select_voice)
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data")
    with caplog.at_level(logging.INFO):
        async with running_server(settings, recording_faulty_factory(holder)) as server, \
                client(server) as cl:
            await cl.write_event(Synthesize(text="Hello there.", voice=SynthesizeVoice(
                name="buggy")).event())
            failed = await collect(cl, "audio-stop", timeout_s=5.0)
            assert failed.types == ["error", "audio-stop"]
            assert [e.code for e in failed.errors] == ["internal-error"]
            await cl.write_event(SynthesizeStart(voice=SynthesizeVoice(name="buggy")).event())
            await cl.write_event(SynthesizeChunk(text="One. Two.").event())
            await cl.write_event(SynthesizeStop().event())
            streamed = await collect(cl, "synthesize-stopped", timeout_s=5.0)
            assert [e.code for e in streamed.errors] == ["internal-error"]
            assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
            assert not streamed.chunks
            await cl.write_event(Synthesize(text="Recovered.").event())
            again = await collect(cl, "audio-stop")
            assert not again.errors and again.chunks
    assert holder[0].texts == ["Recovered."]
    tracebacks = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(tracebacks) == 2 and all(r.exc_info for r in tracebacks)


# --- SIGTERM -----------------------------------------------------------------------------------


async def test_sigterm_with_streaming_and_queued_requests(tiny_model_dir: Path,
                                                          tiny_engine_cache: Path,
                                                          tmp_path: Path) -> None:
    """SIGTERM while one stream is being spoken and a one-shot request waits for the single
    worker: both clients get ``cancelled`` and their proper ends, the process exits 0 within
    5 s of the signal. (A one-shot request in flight: the faulty engine's test below.)"""
    port = free_port()
    # --max-preroll-ms 0: no holds, so the first sentence is not cut into a first clause of
    # its own (a separate engine request, after which the queued request could take the
    # worker before the rest of the stream)
    process = server_process(port, tiny_model_dir,
                             link_engine_cache(tmp_path / "data", tiny_engine_cache),
                             "--no-warm-up",
                             "--max-concurrent", "1", "--max-preroll-ms", "0")
    # one sentence of 379 characters: a single synthesis that holds the only worker for
    # seconds (about 7 s on 2 cores; its first chunk comes after about 0.3 s)
    sentence = ", ".join(["the lights in the living room are on"] * 10) + ". "
    try:
        await wait_process_ready(process, port)
        async with AsyncTcpClient("127.0.0.1", port) as streamer, \
                AsyncTcpClient("127.0.0.1", port) as queued:
            await streamer.write_event(SynthesizeStart().event())
            await streamer.write_event(SynthesizeChunk(text=sentence + LONG).event())
            await collect(streamer, "audio-chunk")
            await queued.write_event(Synthesize(text="Waiting for the worker.").event())
            await asyncio.sleep(0.3)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            streamed = await collect(streamer, "synthesize-stopped")
            waited = await collect(queued, "audio-stop")
        assert [e.code for e in streamed.errors] == ["cancelled"]
        assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
        assert [e.code for e in waited.errors] == ["cancelled"] and not waited.chunks
        assert waited.types[-2:] == ["error", "audio-stop"]
        code = await asyncio.to_thread(process.wait, 30)
        exit_s = time.monotonic() - signalled
        assert exit_s < 5.0, f"exited {exit_s:.2f} s after SIGTERM (README: at most 5 s)"
        # the listener is gone
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = process.stderr.read().decode() if process.stderr else ""
    assert code == 0, stderr
    assert "Traceback" not in stderr and "Server stopped" in stderr


async def test_sigterm_exits_within_5_s_while_a_model_step_runs(tmp_path: Path,
                                                                make_clip: MakeClip) -> None:
    """SIGTERM while the engine is inside one step that takes 20 s and does not look at its
    stop flag (a long model step on a slow CPU), with a second request queued behind it: both
    clients still get ``cancelled`` and ``audio-stop`` within 5 s, and the process exits with
    code 0 within 5 s of the signal (measured), logging that a synthesis was still running."""
    port = free_port()
    model_dir = fake_model_dir(tmp_path, make_clip)
    process = server_process(port, model_dir, tmp_path / "data", "--no-warm-up",
                             "--max-concurrent", "1",
                             program=(str(Path(__file__).parent / "faulty_server.py"),))
    try:
        await wait_process_ready(process, port)
        async with AsyncTcpClient("127.0.0.1", port) as stuck, \
                AsyncTcpClient("127.0.0.1", port) as queued:
            await stuck.write_event(Synthesize(text="One STALL here. Two.").event())
            await collect(stuck, "audio-chunk")  # the 20 s step starts after this chunk
            await queued.write_event(Synthesize(text="Waiting for the worker.").event())
            await asyncio.sleep(0.3)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            answers = [await collect(cl, "audio-stop", timeout_s=5.0) for cl in (stuck, queued)]
            answered_s = time.monotonic() - signalled
            code = await asyncio.to_thread(process.wait, 60)
            exit_s = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = process.stderr.read().decode() if process.stderr else ""
    assert code == 0, stderr
    for answer in answers:
        assert [e.code for e in answer.errors] == ["cancelled"]
        assert answer.types[-2:] == ["error", "audio-stop"]
    assert answered_s < 5.0 and exit_s < 5.0, (
        f"answered {answered_s:.2f} s, exited {exit_s:.2f} s after SIGTERM (README: 5 s)")
    assert "Traceback" not in stderr and "still running" in stderr, stderr


# --- half-written cache ------------------------------------------------------------------------


async def test_second_start_over_a_damaged_voice_cache(tiny_model_dir: Path,
                                                       tiny_engine_cache: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The voice-feature cache of a first start is damaged as a crash mid-write would leave
    it (truncated and empty files, stray temporary files): the second start recomputes the
    features, serves, and leaves a readable cache."""
    data_dir = tmp_path / "data"
    settings = make_settings(tiny_model_dir, data_dir, tiny_engine_cache)
    async with running_server(settings) as server:
        assert all(slot.installed for slot in server.runtime.voices.values())
    cache = data_dir / "voice-cache"
    files = sorted(cache.glob("*.npz"))
    assert len(files) == 2
    first = {f.name: dict(np.load(f)) for f in files}
    files[0].write_bytes(files[0].read_bytes()[: files[0].stat().st_size // 2])
    files[1].write_bytes(b"")
    (cache / f".{files[0].stem[:16]}.abc123.tmp").write_bytes(b"PK\x03\x04 half")
    with caplog.at_level(logging.WARNING):
        async with running_server(settings) as server:
            info = await describe(server)
            assert all(v.installed for v in info.tts[0].voices)
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="Back again.").event())
                response = await collect(cl, "audio-stop")
            assert not response.errors and response.chunks
    warned = " ".join(r.getMessage() for r in caplog.records if "voice cache" in r.getMessage())
    assert all(f.name in warned for f in files)
    for f in files:  # rewritten whole, with the same features
        again = dict(np.load(f))
        assert again.keys() == first[f.name].keys()
        for key, value in again.items():
            np.testing.assert_array_equal(value, first[f.name][key])
