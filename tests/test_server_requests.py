"""Request checks without a network: text validation, voice selection (C10), the bounded
event reader (C9), and PCM conversion (C13)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wyoming_cosyvoice3.engine.errors import (
    EmptyText,
    TextError,
    TextTooLong,
    VoiceNotFound,
)
from wyoming_cosyvoice3.engine.options import VoiceFeatures, VoicePrompt
from wyoming_cosyvoice3.server.catalog import VoiceEntry
from wyoming_cosyvoice3.server.protocol import (
    ProtocolError,
    TextFormatNotSupported,
    VoiceRequest,
    check_text,
    check_text_format,
    parse_voice,
    pcm16,
    read_event,
)
from wyoming_cosyvoice3.server.voice_table import VoiceSlot, select_voice


def test_check_text() -> None:
    assert check_text({"text": " Hi. "}, 10) == " Hi. "
    for data, error in [({}, TextError), ({"text": 5}, TextError), ({"text": None}, TextError),
                        ({"text": ""}, EmptyText), ({"text": " \n"}, EmptyText),
                        ({"text": "x" * 11}, TextTooLong)]:
        with pytest.raises(error) as info:
            check_text(data, 10)
        assert info.value.code in ("invalid-text", "empty-text", "text-too-long")
    assert EmptyText.code == "empty-text" and TextError.code == "invalid-text"


def test_text_format() -> None:
    check_text_format({})
    check_text_format({"text_format": "text"})
    with pytest.raises(TextFormatNotSupported) as info:
        check_text_format({"text_format": "ssml"})
    assert info.value.code == "text-format-not-supported"


def slot(name: str, languages: tuple[str, ...], installed: bool = True) -> VoiceSlot:
    features = VoiceFeatures(np.zeros(2, np.int64), np.zeros(192, np.float32),
                             np.zeros((4, 80), np.float32))
    entry = VoiceEntry(name=name, description=name, languages=languages, clip=f"{name}.wav",
                       search_dirs=(Path("."),))
    return VoiceSlot(entry, VoicePrompt(features, name=name) if installed else None,
                     None if installed else "clip not found")


VOICES = {s.entry.name: s for s in [slot("zh-female", ("zh", "en", "de")),
                                    slot("en-male", ("en", "zh")),
                                    slot("broken", ("fr",), installed=False),
                                    slot("us", ("en-US",))]}


@pytest.mark.parametrize(
    ("data", "expected"),
    [({}, "zh-female"), ({"voice": None}, "zh-female"), ({"voice": {}}, "zh-female"),
     ({"voice": "en-male"}, "en-male"), ({"voice": {"name": "en-male"}}, "en-male"),
     ({"voice": {"language": "en"}}, "en-male"), ({"voice": {"language": "en_US"}}, "us"),
     ({"voice": {"language": "en-GB"}}, "en-male"), ({"voice": {"language": "de"}}, "zh-female"),
     ({"voice": {"language": "ZH"}}, "zh-female")],
)
def test_select_voice(data: dict, expected: str) -> None:
    chosen = select_voice(parse_voice(data), VOICES, VOICES["zh-female"])
    assert chosen.entry.name == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [({"voice": {"name": "nobody"}}, "unknown voice 'nobody'"),
     ({"voice": {"name": "broken"}}, "clip not found"),
     ({"voice": {"name": "en-male", "speaker": "1"}}, "no speakers"),
     ({"voice": {"language": "fr"}}, "no voice speaks 'fr'"),
     ({"voice": {"name": 3}}, "must be a string"),
     ({"voice": [1]}, "must be an object")],
)
def test_voice_errors(data: dict, message: str) -> None:
    with pytest.raises(VoiceNotFound, match=message) as info:
        select_voice(parse_voice(data), VOICES, VOICES["zh-female"])
    assert info.value.code == "invalid-voice"
    if "unknown" in message or "fr" in message:
        assert "zh-female, en-male, us" in str(info.value)  # installed voices only


def test_no_installed_voice() -> None:
    with pytest.raises(VoiceNotFound, match="no voice is installed"):
        select_voice(VoiceRequest(), {"broken": VOICES["broken"]}, None)


# --- the bounded event reader ---------------------------------------------------------------


async def read_all(raw: bytes, limit: int = 1000) -> list[object]:
    results, ended = await read_to_end(raw, limit)
    assert ended
    return results


async def read_to_end(raw: bytes, limit: int = 1000) -> tuple[list[object], bool]:
    """Every event / ``(code, fatal)`` read from ``raw``, and whether reading ended (end of
    input or a fatal error) before a bound of one read per line plus one."""
    reader = asyncio.StreamReader(limit=2**16)
    reader.feed_data(raw)
    reader.feed_eof()
    results: list[object] = []
    for _ in range(raw.count(b"\n") + 2):
        try:
            event = await read_event(reader, limit, limit)
        except ProtocolError as err:
            results.append((err.code, err.fatal))
            if err.fatal:
                return results, True
            continue
        if event is None:
            return results, True
        results.append((event.type, event.data, event.payload))
    return results, False


def frame(header: dict, data: bytes = b"", payload: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\n" + data + payload


async def test_reader_merges_inline_and_separate_data() -> None:
    body = json.dumps({"text": "Hi"}).encode()
    raw = frame({"type": "synthesize", "data": {"voice": {"name": "a"}},
                 "data_length": len(body), "payload_length": 3}, body, b"abc")
    assert await read_all(raw) == [("synthesize", {"voice": {"name": "a"}, "text": "Hi"},
                                    b"abc")]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"garbage\n", [("malformed-event", True)]),
        (b"[]\n", [("malformed-event", True)]),
        (frame({"type": "x", "payload_length": 1001}), [("event-too-large", True)]),
        (frame({"type": "x", "data_length": "7"}), [("malformed-event", True)]),
        (frame({"type": "x", "data_length": True}), [("malformed-event", True)]),
        (frame({"data": {}}) + frame({"type": "describe"}),
         [("malformed-event", False), ("describe", {}, None)]),
        (frame({"type": "x", "data": [1]}) + frame({"type": "describe"}),
         [("malformed-event", False), ("describe", {}, None)]),
        (frame({"type": "x", "data_length": 5}, b"[1,2]") + frame({"type": "describe"}),
         [("malformed-event", False), ("describe", {}, None)]),
        (frame({"type": "x", "data_length": 500}, b"[" * 500), [("malformed-event", False)]),
        (frame({"type": "x", "data_length": 50}, b"{}"), []),  # ends inside the event
        (b'{"type": "describe"}', []),  # no newline: the stream ended mid-header
    ],
)
async def test_reader_rejects_bad_input(raw: bytes, expected: list[object]) -> None:
    assert await read_all(raw) == expected


FRAGMENTS = [b'{"type": "describe"}\n', b'{"type": "synthesize", "data_length": 13}\n',
             b'{"text": "Hi"}', b'{"type": "x", "payload_length": 3}\n', b"abc", b"\n",
             b'{"type": "x", "data_length": 500}\n', b"[1, 2]", b'"data": {"a": 1}}', b"{"]
"""Pieces of valid and broken events, so that random input also contains readable events."""


@settings(max_examples=200, deadline=None)
@given(raw=st.one_of(st.binary(max_size=300), st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=8)), max_size=12).map(b"".join)))
async def test_reader_never_raises_anything_else(raw: bytes) -> None:
    """On any bytes the reader returns events or coded errors, each read consumes at least
    one line (so it ends within one read per line), a fatal error is the last result, and
    no event carries more than the limits."""
    results, ended = await read_to_end(raw + b"\n", limit=100)
    assert ended
    for index, result in enumerate(results):
        assert isinstance(result, tuple)
        if len(result) == 2:
            code, fatal = result
            assert code in {"malformed-event", "event-too-large"}
            assert not fatal or index == len(results) - 1
        else:
            kind, data, payload = result
            assert isinstance(kind, str) and isinstance(data, dict)
            assert payload is None or (isinstance(payload, bytes) and len(payload) <= 100)


# --- PCM --------------------------------------------------------------------------------------


def test_pcm16() -> None:
    samples = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, np.nan], dtype=np.float32)
    pcm = np.frombuffer(pcm16(samples), dtype="<i2")
    assert pcm.tolist() == [0, 16384, -16384, 32767, -32767, 32767, 0]
    assert pcm16(np.array([1, -2], dtype=np.int16)) == b"\x01\x00\xfe\xff"
    assert len(pcm16(np.zeros(0, np.float32))) == 0
