"""Property-based fuzz of the event handler over a real TCP connection, on the real engine with
the tiny synthetic model: random event sequences with random and wrongly typed data, ended by
a half-close, a garbage line or a hang-up.

Properties: nothing escapes (the server answers and closes the connection itself); every
accepted request ends -- a one-shot ``synthesize`` with ``audio-stop``, a stream with
``audio-stop`` + ``synthesize-stopped``, a stray ``synthesize-stop`` with
``synthesize-stopped``, a ``describe`` with ``info`` -- in the order the requests were sent,
with errors only as coded ``error`` events; audio is only inside ``audio-start`` ..
``audio-stop``; afterwards the server frees everything and answers ``describe`` within 1 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st
from server_support import (
    describe,
    make_settings,
    running_server,
    wait_until,
)
from wire_support import frame, read_until_eof
from wyoming.audio import AudioChunk
from wyoming.event import Event

from wyoming_cosyvoice3.server.cli import RunningServer

pytestmark = pytest.mark.timeout(300)

ANSWER_TYPES = {"info", "audio-start", "audio-chunk", "audio-stop", "synthesize-stopped",
                "error"}
MARKERS = ("info", "audio-stop", "synthesize-stopped")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path, tiny_engine_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("data"), tiny_engine_cache,
                             max_concurrent=2)
    async with running_server(settings) as running:
        yield running


# --- strategies ----------------------------------------------------------------------------------

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
texts = st.one_of(
    st.sampled_from(["Hi.", "Ok", "", "   ", "。", "👍", "...", "<|endofprompt|>[breath]",
                     "a\x00b.", "Wait. No", "\ud800."]),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=5),
    junk,
)
voice_names = st.sampled_from(["en-male", "zh-female", "nobody", "", "x" * 300])
voices = st.one_of(
    voice_names,
    st.fixed_dictionaries({}, optional={"name": st.one_of(voice_names, junk),
                                        "language": st.one_of(st.sampled_from(["en", "de",
                                                                               "zz"]), junk),
                                        "speaker": st.one_of(st.just("0"), junk)}),
    junk,
)
junk_datas = st.fixed_dictionaries(
    {},
    optional={"text": texts, "voice": voices,
              "text_format": st.one_of(st.sampled_from(["text", "ssml"]), junk),
              "context": junk},
)
valid_datas = st.fixed_dictionaries(
    {"text": st.sampled_from(["Hi.", "Ok. Go", "。", "👍", "a\x00b.", "Wait, no",
                              "<|endofprompt|>[breath] go."])},
    optional={"voice": st.sampled_from(["en-male", {"name": "zh-female"}, {"language": "en"},
                                        {}]),
              "text_format": st.just("text")},
)
datas = st.one_of(valid_datas, valid_datas, junk_datas)
event_types = st.sampled_from(["describe", "synthesize", "synthesize", "synthesize-start",
                               "synthesize-chunk", "synthesize-chunk", "synthesize-stop",
                               "audio-chunk", "select-program"])
wire_events = st.builds(lambda t, d, p: Event(type=t, data=d, payload=p), event_types, datas,
                   st.one_of(st.none(), st.binary(min_size=1, max_size=8)))
speakable = st.sampled_from(["Hi.", "Ok. Go", "a\x00b.", "No"])
good_voices = st.sampled_from([{}, {"voice": "en-male"}, {"voice": {"name": "zh-female"}},
                               {"voice": {"language": "en"}}])
one_shots = st.builds(lambda text, voice: [Event(type="synthesize", data={"text": text, **voice})],
                      speakable, good_voices)
streams = st.builds(
    lambda voice, parts: [Event(type="synthesize-start", data=voice),
                          *(Event(type="synthesize-chunk", data={"text": p}) for p in parts),
                          Event(type="synthesize-stop")],
    good_voices, st.lists(speakable, min_size=1, max_size=2))
units = st.one_of(one_shots, streams, st.lists(wire_events, min_size=1, max_size=3))
"""A well-formed speakable request (one-shot or stream) or up to three random events, so
that most sequences mix requests that produce audio with junk around them."""
sequences = st.lists(units, min_size=1, max_size=3).map(
    lambda parts: [event for part in parts for event in part])
endings = st.sampled_from(["half-close", "half-close", "garbage", "hang-up"])


def expected_markers(sent: list[Event]) -> list[str]:
    """The ending events of every answer, in order (requests are answered in order)."""
    markers: list[str] = []
    stream_open = False
    for event in sent:
        if event.type == "describe":
            markers.append("info")
        elif event.type == "synthesize-start":
            markers += ["audio-stop", "synthesize-stopped"]  # also ends an open stream
            stream_open = True
        elif event.type == "synthesize-stop":
            if not stream_open:
                markers.append("synthesize-stopped")  # a stray stop is answered
            stream_open = False
        elif event.type == "synthesize" and not stream_open:
            markers.append("audio-stop")
    return markers


def check_answers(received: list[Event], sent: list[Event]) -> None:
    types = [e.type for e in received]
    assert set(types) <= ANSWER_TYPES, types
    assert [t for t in types if t in MARKERS] == expected_markers(sent), types
    in_audio = False
    for event in received:
        if event.type == "audio-start":
            assert not in_audio, types
            in_audio = True
        elif event.type == "audio-stop":
            in_audio = False
        elif event.type == "audio-chunk":
            assert in_audio, types
            chunk = AudioChunk.from_event(event)
            assert (chunk.rate, chunk.width, chunk.channels) == (24000, 2, 1)
            assert len(chunk.audio) % 2 == 0
        elif event.type == "error":
            assert isinstance(event.data.get("code"), str) and event.data["code"], event.data
    assert not in_audio, types


@pytest.mark.asyncio(loop_scope="module")
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sent=sequences, ending=endings)
async def test_random_event_sequences(server: RunningServer, sent: list[Event],
                                      ending: str) -> None:
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"".join(frame(e) for e in sent))
        if ending == "garbage":
            writer.write(b"\x00not an event\n")
        if ending == "hang-up":
            writer.close()
        else:
            writer.write_eof()
            await writer.drain()
            received = await read_until_eof(reader, 120)
            check_answers(received, sent)
            types = [e.type for e in received]
            note(f"ending {ending}: {'audio' if 'audio-chunk' in types else 'no audio'}, "
                  f"{'errors' if 'error' in types else 'no errors'}")
    finally:
        writer.close()
    runtime = server.runtime
    assert await asyncio.to_thread(
        wait_until, lambda: runtime.runner.active == 0 and runtime.connections.open == 0, 60)
    info = await describe(server, timeout_s=1.0)
    assert [v.installed for v in info.tts[0].voices] == [True, True]


def test_expected_markers_model() -> None:
    """The reference model of the answers, on hand-made sequences."""
    def ev(kind: str, **data: Any) -> Event:
        return Event(type=kind, data=data)

    assert expected_markers([ev("describe"), ev("synthesize", text="a")]) == [
        "info", "audio-stop"]
    assert expected_markers([ev("synthesize-start"), ev("synthesize"), ev("describe"),
                             ev("synthesize-stop"), ev("synthesize-stop")]) == [
        "audio-stop", "synthesize-stopped", "info", "synthesize-stopped"]
    assert expected_markers([ev("synthesize-start"), ev("synthesize-start")]) == [
        "audio-stop", "synthesize-stopped"] * 2
