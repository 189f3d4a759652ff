"""End-to-end engine behaviour on the tiny synthetic model (cases C1, C14, C15 and more)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from decoding_support import fixed_decoding

from wyoming_cosyvoice3.engine import (
    AudioChunk,
    CosyVoice3Engine,
    SynthesisCancelled,
    SynthesisOptions,
    SynthesisResult,
    SynthesisTimeout,
    TextError,
    VoicePrompt,
)
from wyoming_cosyvoice3.engine.llm.decoder import SilentRunFilter
from wyoming_cosyvoice3.engine.options import PRESETS

LONG_TEXT = (
    "The living room lights are now on, the kitchen is twenty one degrees, and the front "
    "door has been locked for the night while the garden sprinklers run until morning"
)
MEDIUM_TEXT = "The kitchen lights are on and the front door is locked."


@pytest.fixture(scope="module")
def engine(bare_engine: CosyVoice3Engine) -> CosyVoice3Engine:
    return bare_engine


@pytest.fixture(scope="module")
def voice(bare_voice: VoicePrompt) -> VoicePrompt:
    return bare_voice


class Recorder:
    """Counts model calls and records the tokens each piece decoded (wraps, never replaces)."""

    def __init__(self, engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self.pieces: list[list[int]] = []
        for name in ("flow_encoder", "estimator", "hift"):
            graph = getattr(engine.model, name)
            monkeypatch.setattr(graph, "run", self._wrap(name, graph.run))
        for name in ("prefill", "step"):
            monkeypatch.setattr(engine.llm, name, self._wrap("llm", getattr(engine.llm, name)))
        decode = engine.llm.decode

        def recording_decode(*args: Any, **kwargs: Any) -> Iterator[int]:
            tokens: list[int] = []
            self.pieces.append(tokens)
            for tok in decode(*args, **kwargs):
                tokens.append(tok)
                yield tok

        monkeypatch.setattr(engine.llm, "decode", recording_decode)

    def _wrap(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    def flow_frames(self) -> list[int]:
        """Mel frames per piece at speed 1: 2 x the tokens that pass the silent-run filter."""
        return [2 * len(SilentRunFilter().filter(tokens)) for tokens in self.pieces]


def run(engine: CosyVoice3Engine, text: str, voice: VoicePrompt, **opts: Any) -> list[AudioChunk]:
    return list(engine.synthesize(text, voice, SynthesisOptions().replace(**opts)))


def audio(chunks: list[AudioChunk]) -> np.ndarray:
    return np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)


@pytest.mark.parametrize("text", ["", "   ", "。", "...", "?!", "👍"])
def test_c1_unspeakable_text_yields_nothing(engine, voice, monkeypatch, text: str) -> None:
    rec = Recorder(engine, monkeypatch)
    result = SynthesisResult()
    chunks = list(engine.synthesize(text, voice, result=result))
    assert chunks == []
    assert "estimator" not in rec.calls and "hift" not in rec.calls
    assert result.audio_s == 0.0 and result.first_chunk_s is None


def test_c1_no_tokens_skips_flow_and_vocoder(engine, voice, monkeypatch) -> None:
    rec = Recorder(engine, monkeypatch)
    monkeypatch.setattr(engine.llm, "decode", lambda *a, **k: iter(()))
    for streaming in (True, False):
        assert run(engine, "Hello there.", voice, streaming=streaming) == []
    assert rec.calls == []


@pytest.mark.parametrize("text", ["Hello.", "Hello"])
@pytest.mark.parametrize("streaming", [True, False])
def test_c15_short_text_ends_cleanly(engine, voice, monkeypatch, text, streaming) -> None:
    rec = Recorder(engine, monkeypatch)
    chunks = run(engine, text, voice, streaming=streaming, seed=1)
    assert len(rec.pieces) == 1 and len(rec.pieces[0]) >= 2
    total = audio(chunks)
    assert len(total) == 480 * sum(rec.flow_frames())  # nothing cut, nothing extra
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    # the last chunk carries at least the 8 held-back vocoder frames
    assert len(chunks[-1].samples) >= 480 * 8
    assert total.dtype == np.float32 and np.max(np.abs(total)) <= 0.99
    # fade-in: the first sample is silent and the first 20 ms rise from 0
    assert total[0] == 0.0
    assert np.max(np.abs(total[:24])) <= np.max(np.abs(total[480:4800])) + 1e-9


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("speed", [1.5, 0.75])
def test_c14_speed_scales_length(engine, voice, monkeypatch, streaming, speed) -> None:
    rec = Recorder(engine, monkeypatch)
    base = audio(run(engine, MEDIUM_TEXT, voice, streaming=streaming, seed=5))
    frames = rec.flow_frames()
    assert len(base) == 480 * sum(frames)
    rec.pieces.clear()
    fast_chunks = run(engine, MEDIUM_TEXT, voice, streaming=streaming, seed=5, speed=speed)
    assert (len(fast_chunks) > 1) == streaming  # streamed in several chunks, or one
    fast = audio(fast_chunks)
    assert rec.flow_frames() == frames  # same seed, same tokens
    # each piece ends with int(frames / speed) mel frames, streamed or not
    assert len(fast) == 480 * sum(int(f / speed) for f in frames)
    assert abs(len(fast) - len(base) / speed) <= 480 * len(frames)


@pytest.mark.parametrize("speed", [1.5, 0.75])
def test_c14_speed_scales_length_with_fasts_capped_hops(engine, voice, monkeypatch,
                                                        speed) -> None:
    # fast's hop schedule (8 tokens, doubling up to its cap of 40): a piece long enough to
    # reach the cap still ends with int(frames / speed) mel frames
    flow = PRESETS["fast"].flow
    hops = {"first_hop_tokens": flow.first_hop_tokens, "max_hop_tokens": flow.max_hop_tokens}
    # no vocoder deferral: it follows the wall clock and may merge chunks on a slow machine
    fixed = {"flow": hops, "vocoder": {"defer": False}, "seed": 5}
    rec = Recorder(engine, monkeypatch)
    with fixed_decoding(engine, 2.5):  # 55 characters: about 137 tokens, one piece
        base = audio(run(engine, MEDIUM_TEXT, voice, **fixed))
        frames = rec.flow_frames()
        rec.pieces.clear()
        chunks = run(engine, MEDIUM_TEXT, voice, speed=speed, **fixed)
    assert rec.flow_frames() == frames
    # past 8 + 16 + 32 + 40 tokens, and the hops announced stop at the cap: 40 tokens at 25 a
    # second, at this speed
    assert max(frames) > 2 * (8 + 16 + 32 + 40)
    assert max(c.next_chunk_s for c in chunks) == pytest.approx(40 / 25 / speed)
    assert len(audio(chunks)) == 480 * sum(int(f / speed) for f in frames)
    assert abs(len(audio(chunks)) - len(base) / speed) <= 480 * len(frames)


def test_seed_reproduces_audio(engine, voice) -> None:
    # vocoder deferral follows the wall clock and moves the samples by float rounding
    # (where it cuts the mel): off, so that the seed alone decides
    text = "Good morning, the coffee is ready."
    a = audio(run(engine, text, voice, seed=3, vocoder={"defer": False}))
    b = audio(run(engine, text, voice, seed=3, vocoder={"defer": False}))
    c = audio(run(engine, text, voice, seed=4, vocoder={"defer": False}))
    assert len(a) > 0 and np.array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


def test_streaming_first_chunk_before_decoding_ends(engine, voice, monkeypatch) -> None:
    rec = Recorder(engine, monkeypatch)
    seen_at_first_chunk = None
    chunks = []
    result = SynthesisResult()
    for chunk in engine.synthesize(LONG_TEXT, voice, SynthesisOptions(seed=2), result=result):
        if seen_at_first_chunk is None:
            seen_at_first_chunk = sum(len(p) for p in rec.pieces)
        chunks.append(chunk)
    total_tokens = sum(len(p) for p in rec.pieces)
    assert len(chunks) > 1
    assert seen_at_first_chunk is not None and seen_at_first_chunk < total_tokens
    # the first chunk came right after first_hop (15) + 3 lookahead tokens reached the flow
    passed = SilentRunFilter().filter(rec.pieces[0][:seen_at_first_chunk])
    assert len(passed) == 15 + 3 and rec.pieces[0][seen_at_first_chunk - 1] == passed[-1]
    # result filled
    assert result.first_chunk_s is not None and result.first_chunk_s <= result.total_s
    assert result.audio_s == pytest.approx(len(audio(chunks)) / 24000)
    assert result.times.flow_calls >= len([c for c in chunks if len(c.samples)])
    assert result.times.llm_tokens == total_tokens
    stages = {e[0] for e in result.times.events}
    assert {"llm", "flow", "vocoder"} <= stages


def test_one_shot_runs_flow_once_per_piece(engine, voice, monkeypatch) -> None:
    rec = Recorder(engine, monkeypatch)
    chunks = run(engine, LONG_TEXT, voice, streaming=False, seed=2)
    assert rec.calls.count("flow_encoder") == len(rec.pieces)
    assert rec.calls.count("hift") == len(rec.pieces)
    assert len(chunks) == len(rec.pieces)


def test_cancel_after_first_chunk_stops_within_one_step(engine, voice, monkeypatch) -> None:
    rec = Recorder(engine, monkeypatch)
    state = {"stop": False, "calls_at_flip": -1}

    def should_stop() -> bool:
        return state["stop"]

    gen = engine.synthesize(LONG_TEXT, voice, SynthesisOptions(seed=2), should_stop)
    with pytest.raises(SynthesisCancelled):
        for _chunk in gen:
            if not state["stop"]:
                state["stop"] = True
                state["calls_at_flip"] = len(rec.calls)
    assert state["calls_at_flip"] > 0
    assert len(rec.calls) - state["calls_at_flip"] <= 1


def test_timeout(engine, voice) -> None:
    with pytest.raises(SynthesisTimeout):
        run(engine, LONG_TEXT, voice, max_request_s=1e-6)


def test_int16_output_and_bounded_options(engine, voice) -> None:
    f32 = run(engine, "Good night.", voice, seed=9)
    i16 = run(engine, "Good night.", voice, seed=9, output_dtype="int16")
    a, b = audio(f32), audio(i16)
    assert b.dtype == np.int16 and len(a) == len(b)
    assert np.array_equal(b, np.round(a * 32767.0).astype(np.int16))
    # bounded flow history: same length, different numbers
    fast = audio(run(engine, MEDIUM_TEXT, voice, seed=9, flow={"left_context_tokens": 10}))
    full = audio(run(engine, MEDIUM_TEXT, voice, seed=9))
    assert len(fast) == len(full) and not np.array_equal(fast, full)


def test_bad_options_fail_at_call(engine, voice) -> None:
    with pytest.raises(ValueError, match="speed"):
        engine.synthesize("Hi.", voice, SynthesisOptions(speed=3.0))


def test_warm_up(engine, voice, monkeypatch) -> None:
    """Warm-up runs every graph once on a short text (at most 50 LLM tokens), leaves the
    voice's prefix KV in the cache, and does not change what a request then produces."""
    engine.llm.prefix_cache.clear()
    before = audio(run(engine, MEDIUM_TEXT, voice, seed=4, vocoder={"defer": False}))
    engine.llm.prefix_cache.clear()
    rec = Recorder(engine, monkeypatch)
    engine.warm_up(voice)
    assert {"llm", "flow_encoder", "estimator", "hift"} <= set(rec.calls)
    assert len(rec.pieces) == 1 and 2 <= len(rec.pieces[0]) <= 50
    assert len(engine.llm.prefix_cache) == 1
    monkeypatch.undo()
    after = audio(run(engine, MEDIUM_TEXT, voice, seed=4, vocoder={"defer": False}))
    assert len(engine.llm.prefix_cache) == 1  # the request found the warmed prefix
    np.testing.assert_array_equal(after, before)


def test_last_piece_without_tokens_ends_with_empty_last_chunk(engine, voice, monkeypatch) -> None:
    text = " ".join([LONG_TEXT + "."] * 3)
    assert len(engine.frontend.split_pieces(text)) == 2
    calls = {"n": 0}

    def fake_decode(*args: Any, **kwargs: Any) -> Iterator[int]:
        calls["n"] += 1
        if calls["n"] == 1:
            yield from [100 + i for i in range(40)]

    monkeypatch.setattr(engine.llm, "decode", fake_decode)
    chunks = run(engine, text, voice, seed=1)
    assert calls["n"] == 2
    assert len(audio(chunks)) == 480 * 80
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks[-1].samples) == 0 and chunks[-1].piece_index == 1
    assert all(c.piece_index == 0 for c in chunks[:-1])


def test_unpunctuated_10k_text_is_bounded_pieces(engine, voice, monkeypatch) -> None:
    """One-shot text bounded like upstream: 10,000 characters without punctuation become
    pieces of at most 80 + 20 text tokens, each decoded and vocoded on its own (upstream
    split_paragraph token_max_n 80, merge_len 20), never one huge piece."""
    rec = Recorder(engine, monkeypatch)
    words = ("kitchen", "light", "door", "garden", "window", "morning", "twenty", "locked")
    text = " ".join(words[i % len(words)] for i in range(1700))[:10_000]
    assert len(text) == 10_000 and not any(c in text for c in ".,;:!?")
    result = SynthesisResult()
    per_char = 0.02
    with fixed_decoding(engine, per_char):
        chunks = list(engine.synthesize(text, voice, SynthesisOptions(streaming=False, seed=1),
                                        result=result))
    pieces = engine.frontend.split_pieces(text)
    counts = [engine.frontend.text_token_count(p) for p in pieces]
    assert result.pieces == len(pieces) == len(rec.pieces) >= 15  # ~555 characters each
    assert max(counts) <= 100 and min(counts) >= 20
    # every piece decoded exactly max(1, round(0.02 x its characters)) tokens
    assert [len(t) for t in rec.pieces] == [max(1, round(per_char * len(p))) for p in pieces]
    assert rec.calls.count("hift") == len(pieces)
    by_piece = np.bincount([c.piece_index for c in chunks],
                           weights=[len(c.samples) for c in chunks])
    assert len(by_piece) == len(pieces)
    assert by_piece.max() <= 2 * 480 * max(len(t) for t in rec.pieces)
    assert result.audio_s == pytest.approx(by_piece.sum() / 24000)


def test_vocoder_defer_is_exact_and_runs_fewer_frames(engine, voice, monkeypatch) -> None:
    """While the audio already emitted lasts, the vocoder skips flow chunks;
    the exact vocoder's samples are unchanged and it runs fewer mel frames. The audio in hand
    is set to 60 s after the first chunk (a shared test machine does not run the tiny model
    faster than real time reliably)."""
    from wyoming_cosyvoice3.engine.pipeline import RequestState

    real_lead = RequestState.lead_s
    runs = {}
    for defer in (False, True):
        rec = Recorder(engine, monkeypatch)
        monkeypatch.setattr(RequestState, "lead_s",
                            lambda self: 60.0 if real_lead(self) != 0.0 else 0.0)
        result = SynthesisResult()
        opts = SynthesisOptions(seed=4).replace(
            flow={"first_hop_tokens": 5, "max_hop_tokens": 10}, vocoder={"defer": defer})
        with fixed_decoding(engine, 0.8):
            chunks = list(engine.synthesize(LONG_TEXT, voice, opts, result=result))
        runs[defer] = (audio(chunks), rec.calls.count("hift"), rec.calls.count("flow_encoder"),
                       result.times.vocoder_frames)
        monkeypatch.undo()
    (plain, plain_hift, plain_flow, plain_frames) = runs[False]
    (deferred, deferred_hift, deferred_flow, deferred_frames) = runs[True]
    assert plain_flow == deferred_flow >= 10 and plain_hift == plain_flow
    assert deferred_hift < plain_hift and deferred_frames < plain_frames
    assert deferred.shape == plain.shape
    assert np.max(np.abs(deferred - plain)) <= 1e-5


def test_language_hint_reads_a_sentence_without_cue(engine, voice, monkeypatch) -> None:
    """``SynthesisOptions.language_hint`` reaches the text normaliser: "Kitchen, 21 °C." has
    no English cue, so its number stays digits without a hint and is read with "en"."""
    prompts: list[str] = []
    build = engine.frontend.build_prompt

    def recording(piece: str, voice_prompt: VoicePrompt) -> Any:
        prompts.append(piece)
        return build(piece, voice_prompt)

    monkeypatch.setattr(engine.frontend, "build_prompt", recording)
    options = SynthesisOptions(streaming=False)
    with fixed_decoding(engine, 1.0):
        list(engine.synthesize("Kitchen, 21 °C.", voice, options))
        list(engine.synthesize("Kitchen, 21 °C.", voice, options.replace(language_hint="en")))
    assert prompts == ["Kitchen, 21 °C.", "Kitchen, twenty-one degrees Celsius."]



def test_planned_pieces_are_the_pieces_synthesis_speaks(engine, voice, monkeypatch) -> None:
    """``plan_pieces`` (the server's planning call) gives the pieces ``synthesize`` cuts with
    the same options, each with its text-token count, and synthesises nothing."""
    text = "Kitchen, 21 °C. " + " ".join([LONG_TEXT + "."] * 2)
    spoken: list[str] = []
    build = engine.frontend.build_prompt

    def recording(piece: str, voice_prompt: VoicePrompt) -> Any:
        spoken.append(piece)
        return build(piece, voice_prompt)

    monkeypatch.setattr(engine.frontend, "build_prompt", recording)
    options = SynthesisOptions(streaming=False, language_hint="en", max_piece_tokens=12)
    plan = engine.plan_pieces(text, "en", 12, True)
    assert not spoken
    with fixed_decoding(engine, 0.05):
        list(engine.synthesize(text, voice, options))
    assert [piece.text for piece in plan] == spoken
    assert len(spoken) >= 4 and spoken[0] == "Kitchen, twenty-one degrees Celsius."
    assert [piece.text_tokens for piece in plan] == [
        len(engine.frontend.encode_user(piece)) for piece in spoken]
    # the count the server bounds pieces with is of the text as given, before normalisation
    assert engine.text_token_count("21 °C") == len(engine.frontend.encode_user("21 °C"))
    assert engine.plan_pieces("?!") == []


def test_a_plan_is_spoken_as_planned_without_normalising_again(engine, voice,
                                                               monkeypatch) -> None:
    """``synthesize`` given ``plan_pieces``'s plan speaks exactly those pieces, with the audio
    of the same text given whole, and does not normalise or cut the text a second time."""
    text = "Kitchen, 21 °C. " + " ".join([LONG_TEXT + "."] * 2)
    options = SynthesisOptions(streaming=False, language_hint="en", max_piece_tokens=12)
    plan = engine.plan_pieces(text, "en", 12, True)
    with fixed_decoding(engine, 0.05):
        whole = np.concatenate([c.samples for c in engine.synthesize(text, voice, options)])
    calls: list[str] = []
    split = engine.frontend.split_pieces

    def counting(*args: Any, **kwargs: Any) -> list[str]:
        calls.append(args[0])
        return split(*args, **kwargs)

    monkeypatch.setattr(engine.frontend, "split_pieces", counting)
    with fixed_decoding(engine, 0.05):
        planned = np.concatenate([c.samples for c in engine.synthesize(plan, voice, options)])
    assert calls == []
    np.testing.assert_array_equal(planned, whole)
    # a plan is a sequence of PlannedPiece; anything else is the caller's error
    with pytest.raises(TextError):
        engine.synthesize([text], voice, options)  # type: ignore[list-item]


def test_each_chunk_announces_the_audio_of_its_pieces_next_chunk(engine, voice) -> None:
    """``AudioChunk.next_chunk_s`` is the piece's next hop in seconds (hops 5, 10, 20 tokens
    at 25 tokens per second, halved again at speed 2), 0 on a piece's last chunk."""
    opts = SynthesisOptions(seed=4, max_piece_tokens=12).replace(
        flow={"first_hop_tokens": 5, "max_hop_tokens": 20}, vocoder={"defer": False})
    text = "The kitchen lights are on now. The front door is locked for the night."
    with fixed_decoding(engine, 1.5):
        chunks = list(engine.synthesize(text, voice, opts))
        fast = list(engine.synthesize(text, voice, opts.replace(speed=2.0)))
    assert {c.piece_index for c in chunks} == {0, 1}
    assert [c.next_chunk_s for c in chunks[:2]] == pytest.approx([0.4, 0.8])
    # at speed 2 a chunk may carry no audio yet (and is not sent): the hops still halve
    assert {round(c.next_chunk_s, 6) for c in fast} <= {0.0, 0.2, 0.4}
    assert 0.4 in {round(c.next_chunk_s, 6) for c in fast}
    last_of_piece = [c for k, c in enumerate(chunks)
                     if k + 1 == len(chunks) or chunks[k + 1].piece_index != c.piece_index]
    assert [c.next_chunk_s for c in last_of_piece] == [0.0, 0.0]
    # the last chunk of each piece says so (the server releases a held piece with it)
    assert [c.piece_done for c in chunks] == [any(c is x for x in last_of_piece) for c in chunks]


def test_whole_middle_pieces_run_in_one_chunk_each(engine, voice) -> None:
    """``flow.whole_middle_pieces``: the first and the last piece stream exactly as before, each
    middle piece comes as one chunk that equals the piece of a request made without
    streaming (the same tokens through one flow and vocoder call)."""
    opts = SynthesisOptions(seed=4, max_piece_tokens=12).replace(
        flow={"first_hop_tokens": 5, "max_hop_tokens": 20}, vocoder={"defer": False})
    text = ("The kitchen lights are on now. The front door is locked for the night. "
            "The heating is set to twenty degrees. Good night.")

    def by_piece(chunks: list[Any]) -> dict[int, list[Any]]:
        pieces: dict[int, list[Any]] = {}
        for c in chunks:
            pieces.setdefault(c.piece_index, []).append(c)
        return pieces

    with fixed_decoding(engine, 1.5):
        streamed = by_piece(list(engine.synthesize(text, voice, opts)))
        whole = by_piece(list(engine.synthesize(text, voice,
                                                opts.replace(flow={"whole_middle_pieces": True}))))
        one_shot = by_piece(list(engine.synthesize(text, voice, opts.replace(streaming=False))))
    last = len(streamed) - 1
    assert last >= 2 and sorted(whole) == sorted(streamed) == sorted(one_shot)
    for index, chunks in whole.items():
        samples = np.concatenate([c.samples for c in chunks])
        if index in (0, last):
            assert len(chunks) == len(streamed[index]) > 1
            reference = np.concatenate([c.samples for c in streamed[index]])
        else:
            assert len(chunks) == 1 and chunks[0].piece_done and len(streamed[index]) > 1
            reference = np.concatenate([c.samples for c in one_shot[index]])
        assert samples.shape == reference.shape
        assert np.array_equal(samples, reference)
