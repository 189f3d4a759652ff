"""Sentence boundaries in streamed text (LLM deltas not aligned to words)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wyoming_cosyvoice3.server.protocol import parse_request
from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer, find_boundary
from wyoming_cosyvoice3.server.streams import (
    INLINE_CHUNK_CHARS,
    StreamError,
    StreamRequest,
    StreamText,
)


def feed(pieces: list[str], soft_limit_chars: int = 400) -> tuple[list[list[str]], str | None]:
    buffer = SentenceBuffer(soft_limit_chars)
    per_piece = [buffer.add(p) for p in pieces]
    return per_piece, buffer.flush()


def test_home_assistant_deltas() -> None:
    """C6: the first sentence is complete once the piece after its period arrives."""
    per_piece, tail = feed(["The li", "ving room lig", "hts are now on. Th", "e kitchen is 21",
                            ".5 degrees"])
    assert per_piece == [[], [], ["The living room lights are now on."], [], []]
    assert tail == "The kitchen is 21.5 degrees"


@pytest.mark.parametrize(
    ("pieces", "sentences", "tail"),
    [
        (["It is 21.", "5 degrees."], [], "It is 21.5 degrees."),
        (["Timer for 3:45 PM. ", "Done"], ["Timer for 3:45 PM."], "Done"),
        (["Dr. Smith and Mr. Jones met J. R. R. Tolkien. Yes"],
         ["Dr. Smith and Mr. Jones met J. R. R. Tolkien."], "Yes"),
        (["Really?! ", "Yes... ", "no"], ["Really?!", "Yes..."], "no"),
        (['He said "stop." Then', " left."], ['He said "stop."'], "Then left."),
        (["你好。今天天气很好！", "”明天"], ["你好。", "今天天气很好！”"], "明天"),
        (["你好。"], [], "你好。"),
        (["Line one\nLine two\n\nLine three"], ["Line one", "Line two"], "Line three"),
        (["e.g. this. And"], ["e.g. this."], "And"),
        (["मौसम अच्छा है। कल", " बारिश"], ["मौसम अच्छा है।"], "कल बारिश"),
        (["هل الباب مغلق؟ نعم"], ["هل الباب مغلق؟"], "نعم"),
        (["   ", "\n", " . "], ["."], None),
    ],
)
def test_boundaries(pieces: list[str], sentences: list[str], tail: str | None) -> None:
    per_piece, got_tail = feed(pieces)
    assert [s for group in per_piece for s in group] == sentences
    assert got_tail == tail


def test_text_without_punctuation_is_cut_at_spaces() -> None:
    words = "word " * 2000  # 10,000 characters, no sentence end
    per_piece, tail = feed([words[i:i + 7] for i in range(0, len(words), 7)], 200)
    sentences = [s for group in per_piece for s in group]
    assert len(sentences) > 40
    assert all(len(s) <= 200 for s in sentences)
    assert all(s.endswith("word") for s in sentences)  # never in the middle of a word
    assert " ".join([*sentences, tail or ""]).split() == words.split()


def test_cjk_without_punctuation_is_cut_at_the_limit() -> None:
    per_piece, tail = feed(["天" * 1000], 100)
    assert [len(s) for s in per_piece[0]] == [100] * 9
    assert tail == "天" * 100


def test_boundary_function() -> None:
    assert find_boundary("Hi. there") == 3
    assert find_boundary("Hi.") is None
    assert find_boundary("3.14 is pi") is None


_text = st.lists(
    st.sampled_from(["The", "lamp", "is", "on", "21.5", "Dr.", "J.", "。", "你好", "!", "?",
                     "...", ".", ",", "\n", " ", "  ", "\"", "”", "e.g.", "3:45"]),
    max_size=60,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_text, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_chunking_never_changes_the_sentences(text: str, cuts: list[int]) -> None:
    """However the text is cut into deltas, the same sentences come out, nothing lost."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    whole, whole_tail = feed([text], soft_limit_chars=10_000)
    split, split_tail = feed(pieces, soft_limit_chars=10_000)
    assert [s for g in split for s in g] == whole[0]
    assert split_tail == whole_tail
    spoken = "".join([*whole[0], whole_tail or ""])
    assert "".join(spoken.split()) == "".join(text.split())


# --- a stream request: markdown pass, then sentences -------------------------------------------
def _stream_request() -> StreamRequest:
    request = parse_request({}, 10_000, 0.0, with_text=False)
    return StreamRequest(request=request, buffer=SentenceBuffer(), max_chars=10_000)


def _drain(stream: StreamRequest) -> list[object]:
    items: list[object] = []
    while not stream.items.empty():
        item = stream.items.get_nowait()
        items.append(item.text if isinstance(item, StreamText) else item)
    return items


async def test_stream_request_speaks_markdown_as_sentences() -> None:
    stream = _stream_request()
    chunks = ["**Su", "re!** Here are the lights:\n- Kit", "chen: *on*\n- Living", " room"]
    for chunk in chunks:
        await stream.add_text({"text": chunk})
    assert _drain(stream) == ["Sure!", "Here are the lights:", "Kitchen: on."]
    big = "| Room | Temp |\n|---|---|\n" + "".join(f"| Room {n} | {n} °C |\n" for n in range(14))
    assert len(big) > INLINE_CHUNK_CHARS  # the worker-thread path
    await stream.add_text({"text": ": off\n\n" + big})
    stream.finish()
    assert _drain(stream) == ["Living room: off.", "Room, Temp.",
                              *[f"Room {n}, {n} °C." for n in range(14)], None]
    assert stream.received_chars == sum(map(len, chunks)) + len(": off\n\n") + len(big)


async def test_conversion_bug_ends_the_stream_with_a_coded_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = _stream_request()
    await stream.add_text({"text": "First. "})

    def broken(delta: str) -> str:
        raise RuntimeError("bug")

    monkeypatch.setattr(stream.markdown, "feed", broken)
    await stream.add_text({"text": "Second. "})
    stream.finish()
    items = _drain(stream)
    assert items[0] == "First."
    assert isinstance(items[1], StreamError) and items[1].code == "internal-error"
    assert items[2:] == [None]


def test_stream_language_hint_follows_the_stream() -> None:
    """Case C3 in a stream: a German stream hints German, so a later sentence without a cue
    of its own reads its number in German, never in English; an English stream hints "en"
    (case C6's sentences)."""
    from wyoming_cosyvoice3.engine.text.normalize import normalize_text

    german = _stream_request()
    assert german.language_hint("Die Temperatur beträgt 10 Grad.") == "de"
    assert german.language_hint("Flur, 19.") == "de"
    assert normalize_text("Flur, 19.", "de") == "Flur, neunzehn."
    assert normalize_text("Flur, 19.", None) == "Flur, 19."
    english = _stream_request()
    assert english.language_hint("The living room lights are now on.") == "en"
    assert english.language_hint("Kitchen, 21.5.") == "en"
    assert "twenty-one point five" in normalize_text("Kitchen, 21.5.", "en")
