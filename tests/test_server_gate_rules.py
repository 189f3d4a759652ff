"""The piece gate's measurements and bounds one rule at a time, on a fake clock:
the hold bound counts from when the player runs dry, the runtime's history weighs at most
``PRIOR_WEIGHT_S`` of work against this response, very short pieces do not move the length
ratio, and the piece bound converts the measured length ratio the right way round.

``test_server_pauses.py`` checks the rule as a whole (no pause inside a piece at any rate);
these pin the parts whose mistakes that check does not see (a hold that ends early, a rate
that follows the history too long, a ratio moved by "Yes.")."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from server_support import FakeClock
from wyoming.audio import AudioChunk
from wyoming.event import Event

from wyoming_cosyvoice3.engine.text.pieces import PlannedPiece
from wyoming_cosyvoice3.server.preroll import (
    LENGTH_MARGIN,
    PieceGate,
    ProductionHistory,
    expected_speech_s,
    piece_limit_s,
)
from wyoming_cosyvoice3.server.speech import plan_pieces

RATE_HZ = 24000


def _chunk(duration_s: float) -> list[Event]:
    samples = round(duration_s * RATE_HZ)
    return [AudioChunk(rate=RATE_HZ, width=2, channels=1, audio=bytes(2 * samples)).event()]


async def test_the_hold_bound_counts_from_when_the_player_runs_dry() -> None:
    # r = 0.5 measured. Piece 0 (3 s) goes out whole at t = 1: the player is busy until 4.
    # Piece 1 (20 s expected) starts at 1.5 and is far from playing through, so only the
    # bound releases it: 1 s of audible silence, i.e. 1 s after the player ran dry (t = 5),
    # not 1 s after its first chunk (t = 2.5, while 2.5 s of piece 0 are still queued)
    clock = FakeClock()
    sent: list[float] = []

    async def send(event: Event) -> None:
        sent.append(clock.now_s)

    history = ProductionHistory()
    history.add_response(5.0, 10.0)
    gate = PieceGate(send, 1.0, history, clock=clock, first_audio_limit_s=1e9)
    gate.begin_text([3.0 / LENGTH_MARGIN, 20.0 / LENGTH_MARGIN])
    clock.now_s = 1.0
    await gate.audio(_chunk(3.0), 3.0, 0, piece_done=True)
    assert sent == [1.0] and gate.play_end == pytest.approx(4.0)
    clock.now_s = 1.5
    await gate.audio(_chunk(0.5), 0.5, 1, next_chunk_s=0.5)
    assert sent == [1.0]
    assert gate.release_due == pytest.approx(5.0)
    clock.now_s = 4.9
    await gate.release_if_due()
    assert sent == [1.0]
    clock.now_s = 5.0
    await gate.release_if_due()
    assert sent == [1.0, 5.0]
    assert gate.holds[-1] == (pytest.approx(1.0), (1, 1))  # audible from 4 to 5
    await gate.close()


async def test_the_history_counts_as_at_most_ten_seconds_of_work() -> None:
    # the history measured r = 0.5 over 100 s of work; this response makes 1 s of audio per
    # second. The history weighs PRIOR_WEIGHT_S = 10 s against this response's 10 s:
    # (10 + 0.5 x 10) / (10 + 10) = 0.75 (uncapped it would outweigh it: 60 / 110 = 0.55)
    clock = FakeClock()

    async def send(event: Event) -> None:
        pass

    history = ProductionHistory()
    history.add_response(50.0, 100.0)
    gate = PieceGate(send, 0.0, history, clock=clock)
    gate.begin_text([30.0])
    assert gate.rate() == pytest.approx(0.5)  # nothing of its own yet: the history's
    for k in range(11):  # the piece's first chunk starts it; the next 10 are measured
        clock.now_s = 1.0 + k
        await gate.audio(_chunk(1.0), 1.0, 0)
    assert gate.steady_audio_s == pytest.approx(10.0) and gate.steady_work_s == pytest.approx(10.0)
    assert gate.rate() == pytest.approx(0.75)
    await gate.close()


def test_very_short_pieces_do_not_move_the_length_ratio() -> None:
    # "Yes." (0.2 s expected) coming out at 4x that is a pause around one word, not a
    # measurement of the voice's speed: below MIN_PIECE_FOR_RATIO_S (0.5 s) nothing counts
    history = ProductionHistory()
    history.add_piece(2.0, 2.0)
    for measured_s, expected_s in ((0.8, expected_speech_s("Yes.")), (1.2, 0.49)):
        history.add_piece(measured_s, expected_s)
        assert (history.ratio, history.spread, history.pieces) == (1.0, None, 1)
    history.add_piece(1.1, 1.0)  # a piece of 1 s counts: ratio and spread move
    assert history.pieces == 2
    assert history.ratio == pytest.approx(1.05) and history.spread == pytest.approx(0.1)


class WordPlanner:
    """The engine's planning calls with words as tokens; sentences packed up to the bound."""

    def text_token_count(self, text: str) -> int | None:
        return len(text.split())

    def plan_pieces(self, text: str, language_hint: str | None = None,
                    max_piece_tokens: int | None = None,
                    read_numbers: bool = True) -> list[PlannedPiece]:
        limit = 80 if max_piece_tokens is None else max_piece_tokens
        pieces: list[str] = []
        for sentence in re.split(r"(?<=[.])\s+", text.strip()):
            if pieces and len((pieces[-1] + " " + sentence).split()) <= limit:
                pieces[-1] += " " + sentence
            else:
                pieces.append(sentence)
        return [PlannedPiece(piece, len(piece.split())) for piece in pieces]


async def test_the_piece_bound_divides_by_the_measured_length_ratio() -> None:
    # r = 0.5 and an 8 s bound: pieces of 0.7 x 8 x 0.5 / 0.5 = 5.6 s of real speech. The
    # pieces measured so far came out twice as long as their text predicts, so 5.6 s of
    # speech is 2.8 s as the text predicts it: with this text's 80 tokens per 330/14 s (33
    # non-blank characters per sentence) that is int(2.8 x 3.39) = 9 tokens, one 8-word
    # sentence per piece (the ratio applied the other way: 11.2 s, 38 tokens, 4 sentences)
    sentence = "word word word word word word word word."
    text = " ".join([sentence] * 10)
    history = ProductionHistory()
    history.add_response(5.0, 10.0)
    history.add_piece(4.0, 2.0)
    assert piece_limit_s(8.0, history.rate()) == pytest.approx(5.6)
    runtime = SimpleNamespace(production=history, loader=SimpleNamespace(engine=WordPlanner()))
    gate = SimpleNamespace(max_hold_s=8.0, decoding_ahead=False)
    max_tokens, expected, _ = await plan_pieces(runtime, gate, text, None)  # type: ignore[arg-type]
    assert expected_speech_s(text) == pytest.approx(330 / 14)
    assert max_tokens == int(2.8 * 80 / (330 / 14)) == 9
    assert expected == [pytest.approx(expected_speech_s(sentence))] * 10
