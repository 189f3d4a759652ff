"""Piece-aligned pauses: the piece gate with a fake clock, the first-piece clause
split, and the real server over TCP with a slowed multi-piece engine.

The fake production: each piece starts after ``overhead_s`` (LLM prefill, first hop), then
makes ``chunk_s`` of audio every ``chunk_s / rate`` seconds. The benchmark's player model
(:func:`~bench.player.simulate_playback`) replays what the gate sent and
splits the stalls into pauses inside a piece and between pieces.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import (
    READ_TIMEOUT_S,
    FakeClock,
    FaultyEngine,
    audio_arrivals,
    client,
    fake_model_dir,
    make_settings,
    read,
    running_server,
)
from wyoming.audio import AudioChunk
from wyoming.event import Event
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from bench.player import PlaybackReport, simulate_playback
from wyoming_cosyvoice3.engine.errors import SynthesisCancelled
from wyoming_cosyvoice3.engine.machine import PREDICTION_ERROR
from wyoming_cosyvoice3.engine.options import PRESETS, EngineOptions, ShouldStop
from wyoming_cosyvoice3.engine.options import AudioChunk as EngineChunk
from wyoming_cosyvoice3.engine.text.pieces import PlannedPiece, split_first_clause
from wyoming_cosyvoice3.server.engine_port import Engine
from wyoming_cosyvoice3.server.preroll import (
    ARRIVAL_MARGIN_S,
    FIRST_AUDIO_LIMIT_S,
    FIRST_PIECE_MAX_S,
    FIRST_PIECE_MIN_S,
    LENGTH_MARGIN,
    SEED_WORK_S,
    PieceGate,
    ProductionHistory,
    expected_speech_s,
    first_piece_release_s,
    needed_hold_s,
    piece_limit_s,
)
from wyoming_cosyvoice3.server.speech import (
    DECODING_AHEAD_PIECE_S,
    MIN_PIECE_TOKENS,
    first_pieces,
    piece_bound_s,
    planned_pieces,
)

MakeClip = Callable[..., Path]
RATE_HZ = 24000


def _chunk_event(duration_s: float) -> Event:
    samples = round(duration_s * RATE_HZ)
    return AudioChunk(rate=RATE_HZ, width=2, channels=1, audio=bytes(2 * samples)).event()


async def _advance(gate: PieceGate, clock: FakeClock, to_s: float) -> None:
    """Move the fake clock to ``to_s``; the gate's timer runs on the event loop's clock, so a
    release due before then is fired on the fake one first."""
    due = gate.release_due
    if due is not None and due < to_s:
        clock.now_s = max(clock.now_s, due)
        await gate.release_if_due()
    clock.now_s = to_s


async def _produce(
    pieces_s: list[float], rate: float, chunk_s: float, overhead_s: float,
    max_hold_s: float = 60.0, history: ProductionHistory | None = None,
    first_audio_limit_s: float = FIRST_AUDIO_LIMIT_S, expected_factor: float = 1.0,
    origin_s: float | None = None,
) -> tuple[list[tuple[float, float]], list[float], list[float]]:
    """One engine request of ``pieces_s`` through a gate on a fake clock.

    Returns:
        (send time s, chunk s) of every chunk sent, piece starts in the audio (s), and the
        production time of every chunk (s).
    """
    clock = FakeClock()
    sent: list[tuple[float, float]] = []

    async def send(event: Event) -> None:
        sent.append((clock.now_s, len(event.payload or b"") / 2 / RATE_HZ))

    gate = PieceGate(send, max_hold_s, history or ProductionHistory(), clock=clock,
                     first_audio_limit_s=first_audio_limit_s)
    gate.first_audio_from = origin_s
    produced = []
    counts = [max(1, round(length_s / chunk_s)) for length_s in pieces_s]
    gate.begin_text([n * chunk_s * expected_factor for n in counts])  # whole chunks
    async def advance(to_s: float) -> None:
        await _advance(gate, clock, to_s)

    for index, count in enumerate(counts):
        await advance(clock.now_s + overhead_s)
        for _ in range(count):
            await advance(clock.now_s + chunk_s / rate)
            produced.append(clock.now_s)
            await gate.audio([_chunk_event(chunk_s)], chunk_s, index)
    await gate.end_text()
    await gate.release()
    await gate.close()
    return sent, [n / RATE_HZ for n in gate.piece_starts_samples], produced


def test_needed_hold_formula() -> None:
    assert expected_speech_s("a" * 42) == pytest.approx(3.0)
    assert expected_speech_s("你好世界") == pytest.approx(1.0)
    # R = 1.8 s to come at r = 2/3: the piece needs 0.9 s + one 0.2 s chunk in hand
    assert needed_hold_s(1.8, 2 / 3, 0.2) == pytest.approx(1.1)
    assert needed_hold_s(2.0, 0.5) == pytest.approx(2.0)
    assert needed_hold_s(2.0, 1.0, 0.2) == pytest.approx(0.2)  # keeps up: one chunk in hand
    assert needed_hold_s(0.0, 0.5, 0.2) == 0.0  # nothing to come
    # a last chunk is never longer than what remains: 0.3 s at r = 0.5 arrive 0.6 s on
    assert needed_hold_s(0.3, 0.5, 1.0) == pytest.approx(0.6)
    # r >= 1, chunks of 0.8 s: the next arrives 0.5 s on, the later ones are ahead of playback
    assert needed_hold_s(2.0, 1.6, 0.2, next_chunk_s=0.8) == pytest.approx(0.5)
    # r = 1.2 with a doubling hop (0.4, 0.8, 1.6, then the 3.2 s that remain): chunk j arrives
    # S_j / 1.2 on and is due S_(j-1) after the start: 0.33, 0.6, 1.13, 6 / 1.2 - 2.8 = 2.2
    assert needed_hold_s(6.0, 1.2, 0.2, next_chunk_s=0.4, max_chunk_s=4.0) == pytest.approx(2.2)
    # the same hop capped at 0.8 s: 0.4, 0.8 x 7: max at j = 2: 1.2 / 1.2 - 0.4 = 0.6
    assert needed_hold_s(6.0, 1.2, 0.2, next_chunk_s=0.4, max_chunk_s=0.8) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        needed_hold_s(1.0, 0.0)


def test_needed_hold_with_a_second_pace() -> None:
    # 3 s to come in chunks of 1 and 2 s, the first 0.5 s of it at r = 0.5 (1 s of work),
    # the rest at 2: chunk 1 is made 1 + 0.5 / 2 = 1.25 s on and due at once; chunk 2
    # 1 + 2.5 / 2 = 2.25 s on, due 1 s after the start: 1.25 s in hand
    assert needed_hold_s(3.0, 0.5, next_chunk_s=1.0, max_chunk_s=2.0, switch_s=0.5,
                         rate_after=2.0) == pytest.approx(1.25)
    # at r = 0.5 throughout chunk 2 binds: 3 / 0.5 - 1 = 5 s
    assert needed_hold_s(3.0, 0.5, next_chunk_s=1.0, max_chunk_s=2.0) == pytest.approx(5.0)
    # continuous: the worst point is the switch at 1 s of audio (made 2 s on): 1 s in hand;
    # at the end, 2 + 2 / 2 = 3 s on for 3 s of audio, nothing
    assert needed_hold_s(3.0, 0.5, switch_s=1.0, rate_after=2.0) == pytest.approx(1.0)
    # the switch beyond what remains: one pace
    assert needed_hold_s(2.0, 0.5, switch_s=5.0, rate_after=2.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        needed_hold_s(1.0, 0.5, switch_s=0.5, rate_after=0.0)


def test_first_piece_release_with_the_hop_doubling() -> None:
    # a 14.0 s piece, its first chunk of 0.4 s ready 0.7 s from now, the rest (13.6 s) at
    # r = 1.38 lowered to 1.38 / 1.1 = 1.2545 in chunks of 0.8, 1.6, 3.2, 4, 4 s (sums S_j
    # 0.8, 2.4, 5.6, 9.6, 13.6): S_j / 1.2545 - S_(j-1) = 0.638, 1.113, 4.464 - 2.4 = 2.064,
    # 7.652 - 5.6 = 2.052, 10.841 - 9.6 = 1.241: 2.064 s in hand, + 0.1 arrival;
    # the first chunk is in hand, so the release is 0.7 + 2.164 - 0.4 = 2.464 s from now
    assert first_piece_release_s(14.0, 1.38, 0.7, 0.4, 4.0) == pytest.approx(2.4638, abs=1e-4)
    # the hop capped at 0.8 s: chunks 0.8 each, the first binds at 0.638 + 0.1: 0.7 + 0.338
    assert first_piece_release_s(14.0, 1.38, 0.7, 0.4, 0.8) == pytest.approx(1.0377, abs=1e-4)
    # nothing after the first chunk: released when it is ready
    assert first_piece_release_s(0.3, 1.38, 0.7, 0.4, 4.0) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        first_piece_release_s(14.0, 0.0, 0.7, 0.4, 4.0)


async def test_the_gate_counts_each_responses_first_chunk_latency() -> None:
    async def send(event: Event) -> None:
        pass

    clock = FakeClock()
    history = ProductionHistory()
    for begin_s, latency_s in ((10.0, 0.8), (20.0, 0.4)):
        gate = PieceGate(send, 10.0, history, clock=clock)
        clock.now_s = begin_s
        gate.begin_text([1.0])
        clock.now_s = begin_s + latency_s
        await gate.audio([_chunk_event(0.2)], 0.2)
        clock.now_s = begin_s + 2.0  # a later chunk does not count
        await gate.audio([_chunk_event(0.2)], 0.2)
        await gate.end_text()
        await gate.close()
    # 0.8 first, then decayed by half: 0.8 x 0.5 + 0.4 x 0.5
    assert history.first_chunk_s == pytest.approx(0.6)


async def test_slow_machine_pauses_fall_only_at_piece_starts() -> None:
    sent, starts, _ = await _produce([1.5, 4.0, 3.0, 6.0, 2.0], rate=0.5, chunk_s=0.25,
                                     overhead_s=0.5)
    report = simulate_playback(sent, piece_starts_s=starts)
    assert len(starts) == 5
    assert report.stalls >= 3  # RTF about 2.3: the listener waits somewhere
    assert report.inside_stalls == 0 and report.between_stalls == report.stalls
    assert report.start_s is not None and report.start_s <= FIRST_AUDIO_LIMIT_S + 1e-9


async def test_without_the_gate_the_same_production_pauses_inside_pieces() -> None:
    # the control: max_hold_s = 0 sends every chunk at once (today's behaviour after the
    # pre-roll): the stalls fall inside the pieces
    sent, starts, produced = await _produce([1.5, 4.0, 3.0, 6.0, 2.0], rate=0.5, chunk_s=0.25,
                                            overhead_s=0.5, max_hold_s=0.0)
    assert [t for t, _ in sent] == produced
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls is not None and report.inside_stalls > 10


def _half_rate_gate() -> tuple[FakeClock, list[float], PieceGate]:
    """A gate on a fake clock whose history measured r = 0.5 (no first-audio limit, 60 s
    holds); returns the clock, the send time of every event, and the gate."""
    clock = FakeClock()
    sent: list[float] = []

    async def send(event: Event) -> None:
        sent.append(clock.now_s)

    history = ProductionHistory()
    history.add_response(5.0, 10.0)
    return clock, sent, PieceGate(send, 60.0, history, clock=clock, first_audio_limit_s=1e9)


async def test_audio_queued_at_the_player_counts() -> None:
    # at r = 0.5 a piece with 0.25 s still to come needs 0.25 s + one 0.25 s chunk in hand;
    # its first chunk alone (0.25 s) is short of that, but 0.4 s of the earlier piece are still
    # queued at the player, so it goes out at once (a gate ignoring Q would hold it)
    clock, sent, gate = _half_rate_gate()
    gate.begin_text([2.0 / LENGTH_MARGIN, 0.5 / LENGTH_MARGIN])
    for _ in range(8):
        clock.now_s += 0.5
        await gate.audio([_chunk_event(0.25)], 0.25, 0)
    await gate.release()
    # piece 0 went out at 2.5 s with 1.25 s in hand (0.75 s to come at r = 0.5 + one chunk):
    # the player is busy until 4.5 s
    assert len(sent) == 8 and gate.play_end == pytest.approx(4.5)
    clock.now_s = 4.1
    await gate.audio([_chunk_event(0.25)], 0.25, 1)
    assert sent[-1] == 4.1 and len(sent) == 9


async def test_a_piece_is_released_with_its_last_chunk() -> None:
    # r = 0.5 (measured), a piece expected at 4 s that the engine ends after 2 s: 1 s chunks
    # every 2 s. Its 1st chunk is held (3 s said to follow need 3 x 1.1 / 0.5 s of cover). Its
    # 2nd chunk is its last (the engine says so): nothing more of the piece can run dry, so
    # both go out at once instead of waiting for the timer or the next piece (the expected
    # length still says 2 s are to come, which would hold it past t = 6)
    clock, sent, gate = _half_rate_gate()
    gate.begin_text([4.0 / LENGTH_MARGIN, 2.0 / LENGTH_MARGIN])
    clock.now_s = 2.0
    await gate.audio([_chunk_event(1.0)], 1.0, 0, 1.0)
    assert sent == []
    clock.now_s = 4.0
    await gate.audio([_chunk_event(1.0)], 1.0, 0, 0.0, piece_done=True)
    assert sent == [4.0, 4.0]
    # the same chunk without the flag stays held (the expected length says 2 s to come)
    held_clock, held_sent, held = _half_rate_gate()
    held.begin_text([4.0 / LENGTH_MARGIN])
    held_clock.now_s = 2.0
    await held.audio([_chunk_event(1.0)], 1.0, 0, 1.0)
    held_clock.now_s = 4.0
    await held.audio([_chunk_event(1.0)], 1.0, 0, 0.0)
    assert held_sent == []
    await held.close()
    await gate.close()


async def test_a_held_piece_starts_between_chunks_when_waiting_covers_the_rest() -> None:
    # r = 0.5, 1 s chunks every 2 s, a 4 s piece: at its 2nd chunk (t = 4) 2 s are in hand and
    # 2 s + one chunk are needed; with nothing queued each second of waiting adds a second of
    # production, so it could start at t = 5 and still not run dry (the 3rd chunk comes at 6
    # while the player is at 1 s, the 4th at 8 exactly in time); with the 10 % rate margin
    # (r taken as 0.5 / 1.1: 2 x 1.2 + 1 s needed) and 0.1 s for the chunks' delivery it
    # starts at 5.5, still before its 3rd chunk
    sent, starts, produced = await _produce([4.0], rate=0.5, chunk_s=1.0, overhead_s=0.0,
                                            first_audio_limit_s=1e9,
                                            expected_factor=1 / LENGTH_MARGIN)
    assert produced == [2.0, 4.0, 6.0, 8.0]
    assert [t for t, _ in sent] == pytest.approx([5.5, 5.5, 6.0, 8.0])
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.floats(0.3, 8.0), min_size=1, max_size=6),
    rate=st.floats(0.25, 0.99),
    chunk_s=st.sampled_from([0.12, 0.25, 0.5, 1.0]),
    overhead_s=st.floats(0.0, 1.5),
)
def test_no_pause_inside_a_piece_at_any_slow_rate(
    pieces: list[float], rate: float, chunk_s: float, overhead_s: float
) -> None:
    # the rule alone (no first-audio limit, no bound): never dry inside a piece
    sent, starts, _ = asyncio.run(_produce(pieces, rate, chunk_s, overhead_s,
                                           first_audio_limit_s=1e9))
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls == 0, report.gaps


async def test_fast_machine_adds_no_latency() -> None:
    history = ProductionHistory()
    # a fresh runtime knows no rate before a piece's second chunk: its first response's first
    # chunk waits for the second (audio per second of work, start-up included, errs slow)
    sent, _, produced = await _produce([2.0, 3.0, 1.0], rate=1.6, chunk_s=0.25,
                                       overhead_s=0.3, history=history)
    assert sent[0][0] == produced[1] and [t for t, _ in sent[2:]] == produced[2:]
    assert history.rate() == pytest.approx(1.6)
    # from then on every chunk leaves the moment it exists, but a piece's first when nothing
    # is queued at the player: its next chunk comes 0.25 / 1.6 s later (0.17 s with the rate
    # margin), which leaves less than the 0.1 s delivery margin of the 0.25 s in hand, so it
    # waits 0.02 s
    wait_s = 0.25 * 1.1 / 1.6 + 0.1 - 0.25
    for overhead_s, waiting in ((0.3, {0}), (2.0, {0, 8, 20})):  # pieces of 8, 12, 4 chunks
        sent, _, produced = await _produce([2.0, 3.0, 1.0], rate=1.6, chunk_s=0.25,
                                           overhead_s=overhead_s, history=history)
        late = [t - made for (t, _), made in zip(sent, produced, strict=True)]
        assert late == pytest.approx([wait_s if k in waiting else 0.0
                                      for k in range(len(late))])


async def _produce_hops(
    pieces_s: list[float], rate: float, first_hop_s: float, max_hop_s: float,
    overhead_s: float, tell_next: bool = True, history: ProductionHistory | None = None,
) -> tuple[list[tuple[float, float]], list[float]]:
    """Like :func:`_produce`, with the engine's hop schedule: each piece's chunks are
    ``first_hop_s``, then twice the one before up to ``max_hop_s``, the last one the rest;
    each chunk takes its length / ``rate``; ``tell_next``: the gate is told the next hop.

    Returns:
        (send time s, chunk s) of every chunk sent, and the piece starts in the audio (s).
    """
    clock = FakeClock()
    sent: list[tuple[float, float]] = []

    async def send(event: Event) -> None:
        sent.append((clock.now_s, len(event.payload or b"") / 2 / RATE_HZ))

    gate = PieceGate(send, 60.0, history or ProductionHistory(), clock=clock,
                     first_audio_limit_s=1e9)
    gate.begin_text(pieces_s, max_hop_s if tell_next else 0.0)

    async def advance(to_s: float) -> None:
        await _advance(gate, clock, to_s)

    for index, length_s in enumerate(pieces_s):
        await advance(clock.now_s + overhead_s)
        made, hop = 0.0, first_hop_s
        while made < length_s - 1e-9:
            chunk = min(hop, length_s - made)
            made += chunk
            hop = min(2 * hop, max_hop_s)
            await advance(clock.now_s + chunk / rate)
            following = min(hop, length_s - made) if made < length_s - 1e-9 else 0.0
            await gate.audio([_chunk_event(chunk)], chunk, index,
                             following if tell_next else 0.0)
    await gate.end_text()
    await gate.release()
    await gate.close()
    return sent, [n / RATE_HZ for n in gate.piece_starts_samples]


async def test_a_short_first_chunk_waits_until_it_lasts_to_the_next() -> None:
    # r = 1.4 (faster than playback) with the doubling hop of the fast preset: 0.32 s, then
    # 0.64 s 0.46 s later. Sent at once, the first chunk runs dry 0.14 s before the second
    # comes; told the next hop, the gate holds it until it lasts (about 0.15 s more)
    history = ProductionHistory()
    history.add_response(14.0, 10.0)
    pieces = [1.0, 3.0, 5.0]
    sent, starts = await _produce_hops(pieces, 1.4, 0.32, 4.0, 0.3, history=history,
                                       tell_next=False)
    blind = simulate_playback(sent, piece_starts_s=starts)
    assert blind.inside_stalls is not None and blind.inside_stalls > 0
    sent, starts = await _produce_hops(pieces, 1.4, 0.32, 4.0, 0.3, history=history)
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls == 0, report.gaps
    first_made_s = 0.3 + 0.32 / 1.4
    assert first_made_s < sent[0][0] < first_made_s + 0.32 / 1.4 + ARRIVAL_MARGIN_S


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.floats(0.3, 8.0), min_size=1, max_size=5),
    rate=st.floats(0.25, 3.0),
    first_hop_s=st.sampled_from([0.32, 0.4, 1.0, 2.0]),
    max_hop_s=st.sampled_from([2.0, 4.0]),
    overhead_s=st.floats(0.0, 1.5),
)
def test_no_pause_inside_a_piece_with_a_doubling_hop(
    pieces: list[float], rate: float, first_hop_s: float, max_hop_s: float, overhead_s: float
) -> None:
    # slower and faster than playback, the engine's hop schedule: never dry inside a piece
    sent, starts = asyncio.run(_produce_hops(pieces, rate, first_hop_s, max_hop_s, overhead_s))
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls == 0, report.gaps


async def test_first_piece_hold_is_capped() -> None:
    # a 6 s first piece at r = 0.4 would need about 9 s in hand: first audio at the limit
    sent, starts, _ = await _produce([6.0, 2.0], rate=0.4, chunk_s=0.25, overhead_s=1.0)
    first_s = sent[0][0]
    assert first_s == pytest.approx(FIRST_AUDIO_LIMIT_S, abs=0.25 / 0.4)
    assert first_s < 5.0
    # the cap costs a pause inside that piece; the later pieces still pause only between
    report = simulate_playback(sent, piece_starts_s=starts)
    inside = [g for g, between in zip(report.gaps, report.gap_between, strict=True)
              if not between]
    assert inside and all(end <= sent[0][0] + 6.0 * (1 / 0.4) + 1.0 for _, end in inside)


@pytest.mark.parametrize(("origin_s", "due_s"),
                         [(None, FIRST_AUDIO_LIMIT_S), (-0.5, FIRST_AUDIO_LIMIT_S - 0.5)])
async def test_first_audio_limit_counts_from_the_answers_start(
    origin_s: float | None, due_s: float
) -> None:
    # the engine request starts at 0; the answer began at origin_s (the request arrived, or
    # a stream's first text came, before its first sentence was complete): the limit of a
    # long first piece counts from there
    sent, _, _ = await _produce([6.0], rate=0.4, chunk_s=0.1, overhead_s=0.5,
                                origin_s=origin_s)
    assert due_s <= sent[0][0] < due_s + 0.1 / 0.4 + 1e-9


async def test_bound_limits_a_hold_between_pieces() -> None:
    # a long second piece: its hold ends max_hold_s after the player ran dry
    sent, starts, _ = await _produce([1.0, 10.0], rate=0.5, chunk_s=0.5, overhead_s=0.2,
                                     max_hold_s=1.5)
    report = simulate_playback(sent, piece_starts_s=starts)
    between = [b - a for (a, b), k in zip(report.gaps, report.gap_between, strict=True) if k]
    assert between and max(between) <= 1.5 + 0.5 / 0.5 + 1e-6  # + one chunk interval


async def test_history_refines_expected_length() -> None:
    history = ProductionHistory()
    # the engine makes 0.6 of the expected length: the ratio moves towards 0.6
    await _produce([2.0, 2.0, 2.0], rate=0.5, chunk_s=0.25, overhead_s=0.2,
                   history=history, expected_factor=1 / 0.6)
    assert history.ratio is not None and 0.55 < history.length_ratio() < 0.7


def test_length_margin_follows_the_measured_misses() -> None:
    def history(ratios: list[float]) -> ProductionHistory:
        h = ProductionHistory()
        for ratio in ratios:
            h.add_piece(ratio * 2.0, 2.0)
        return h

    # before three pieces: the fixed prior
    assert history([]).length_margin() == LENGTH_MARGIN == 1.15
    assert history([1.0, 1.0]).length_margin() == 1.15
    # every piece as predicted: the floor
    assert history([1.0, 1.0, 1.0]).length_margin() == pytest.approx(1.03)
    # misses of 5 % then 1/1.025 - 1: spread (0.05 + 0.02439) / 2, margin 1 + 2 x spread
    assert history([1.0, 1.05, 1.0]).length_margin() == pytest.approx(1.0744, abs=1e-4)
    # misses of 20 % and 27 %: capped
    assert history([1.0, 1.2, 0.8]).length_margin() == pytest.approx(1.3)


async def test_a_calibrated_history_releases_earlier_and_still_plays_through() -> None:
    # r = 0.5, a 4 s piece in 0.5 s chunks whose length is predicted exactly: a fresh history
    # adds 15 % to the prediction, one whose last three pieces came out as predicted 3 %,
    # so the piece goes out earlier and still has no pause inside
    def calibrated() -> ProductionHistory:
        h = ProductionHistory()
        for _ in range(3):
            h.add_piece(2.0, 2.0)
        h.add_response(5.0, 10.0)
        return h

    def fresh() -> ProductionHistory:
        h = ProductionHistory()
        h.add_response(5.0, 10.0)
        return h

    first_sent = []
    for make in (fresh, calibrated):
        sent, starts, _ = await _produce([4.0], rate=0.5, chunk_s=0.5, overhead_s=0.0,
                                         history=make(), first_audio_limit_s=1e9)
        assert simulate_playback(sent, piece_starts_s=starts).inside_stalls == 0
        first_sent.append(sent[0][0])
    assert first_sent[1] < first_sent[0]
    # a piece that is not the request's last keeps the fixed margin (a longer hold before it
    # is paid back by the next piece): the same release either way
    followed = []
    for make in (fresh, calibrated):
        sent, _, _ = await _produce([4.0, 1.0], rate=0.5, chunk_s=0.5, overhead_s=0.0,
                                    history=make(), first_audio_limit_s=1e9)
        followed.append(sent[0][0])
    assert followed[0] == followed[1] == first_sent[0]


# --- the first piece: a clause of a long first sentence -------------------------------------

LONG_FIRST = ("Here is the weather for today, it will be sunny in the morning with temperatures "
              "around twenty degrees, clouds will move in during the afternoon and there is a "
              "chance of light rain in the evening and at night. Have a nice day.")


def _first(text: str) -> tuple[str, str]:
    return split_first_clause(text, FIRST_PIECE_MAX_S, FIRST_PIECE_MIN_S, expected_speech_s)


def test_long_first_sentence_is_cut_at_a_clause() -> None:
    first_sentence = LONG_FIRST.split(". ")[0]
    assert 190 <= len(first_sentence) <= 210
    head, rest = _first(LONG_FIRST)
    assert head == "Here is the weather for today,"
    assert f"{head} {rest}" == LONG_FIRST
    assert expected_speech_s(head) <= FIRST_PIECE_MAX_S


@pytest.mark.parametrize(("text", "head"), [
    ("The living room lights are off and the front door is locked.",
     "The living room lights are off"),
    ("In the upstairs bedroom, the thermostat is now set to nineteen degrees for the night.",
     "In the upstairs bedroom,"),
    ("大家好，这里介绍一篇名为AN IMAGE IS WORTH 16X16 WORDS的论文。", "大家好，"),
    ("这是一个没有逗号的非常长的中文句子它一直在继续说下去没有停顿。", "这是一个没有逗号的非"),
])
def test_first_clause_cuts(text: str, head: str) -> None:
    got, rest = _first(text)
    assert got == head and rest and expected_speech_s(got) <= FIRST_PIECE_MAX_S


@pytest.mark.parametrize(("text", "head", "rest"), [
    ("Look at the photo. 是 family, friends, 还是 people at a game?",  # C4
     "Look at the photo.", "是 family, friends, 还是 people at a game?"),
    ("The living room lights are now on. The kitchen is 21.5 degrees",  # C6
     "The living room lights are now on.", "The kitchen is 21.5 degrees"),
    # the paragraph of the benchmark: the next sentence (66 characters) does not fit in 2.5 s
    ("Good morning! It is seven degrees outside with light rain, so take an umbrella.",
     "Good morning!", "It is seven degrees outside with light rain, so take an umbrella."),
    # two short sentences fit together (23 characters: 1.6 s of expected speech)
    ("Okay. The lights are on. Now the heating is set to twenty one degrees.",
     "Okay. The lights are on.", "Now the heating is set to twenty one degrees."),
])
def test_short_first_sentences_are_the_first_piece(text: str, head: str, rest: str) -> None:
    # the engine would pack a short first sentence with the next into one piece too long to
    # play through by the first-audio limit
    assert _first(text) == (head, rest)
    assert expected_speech_s(head) <= FIRST_PIECE_MAX_S


@pytest.mark.parametrize("text", [
    "Battery at 50%.",
    "The lights are on. Done.",  # the rest is under FIRST_PIECE_MIN_S: one piece
    "Averyveryverylongwordwithoutanyblanksthatmightbeanaddressorsomething.com please",
    "",
])
def test_short_or_uncuttable_first_sentences_stay_whole(text: str) -> None:
    assert _first(text) == (text.strip(), "")


def test_first_clause_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        split_first_clause("text", 1.0, 2.0, expected_speech_s)


# --- the real server over TCP ---------------------------------------------------------------

CHUNK_S = 0.2
INTERVAL_S = 0.3
"""The paced engine makes 0.2 s of audio every 0.3 s (r = 2/3) after a 0.3 s start per piece."""
JITTER_S = 0.1
"""Gaps shorter than this are scheduling noise on a shared machine, not stalls."""


class PiecePacedEngine(FaultyEngine):
    """Each sentence is one piece (``piece_index`` 0, 1, ... within the request) with exactly
    its expected length of audio (``expected_speech_s``), made at r = 2/3."""

    sentence_end = r"(?<=[.!?])\s+"

    def _chunks(self, pieces: list[str], should_stop: ShouldStop) -> Iterator[EngineChunk]:
        samples = (0.1 * np.sin(np.arange(round(RATE_HZ * CHUNK_S)) * 0.05)).astype(np.float32)
        for index, piece in enumerate(pieces):
            time.sleep(INTERVAL_S)  # the piece's start-up
            for _ in range(round(expected_speech_s(piece) / CHUNK_S)):
                if should_stop():
                    raise SynthesisCancelled("stopped")
                time.sleep(INTERVAL_S)
                yield EngineChunk(samples, RATE_HZ, index, False, 0.0)


def piece_paced_factory(model_dir: Path, options: EngineOptions) -> Engine:
    return PiecePacedEngine(model_dir, options)


def _sentence(words: int) -> str:
    return " ".join(["word"] * words)[:-1] + "."  # 'word' = 4 letters: 5 chars per word


@pytest.mark.parametrize(("audio_s", "work_s", "parts_n"), [
    (20.0, 10.0, 1),  # twice as fast as playback: one LLM pass, unbroken prosody
    (11.5, 10.0, 1),  # 1.15: still 1.045x playback at the gate's 10 % margin
    (10.5, 10.0, 2),  # 1.05: within the margin, so it may be made more slowly than it plays
    (9.0, 10.0, 2),
])
def test_a_first_sentence_stays_whole_only_faster_than_playback_by_the_rate_margin(
    audio_s: float, work_s: float, parts_n: int,
) -> None:
    async def send(event: Event) -> None:
        raise AssertionError("nothing is sent")

    history = ProductionHistory()
    history.add_response(audio_s, work_s)
    runtime = SimpleNamespace(production=history)
    gate = PieceGate(send, 10.0, history)
    text = "The kitchen lights are on, and the front door is locked for the night."
    parts = first_pieces(runtime, gate, text)  # type: ignore[arg-type]
    assert " ".join(parts) == text
    assert len(parts) == parts_n


@pytest.mark.parametrize(("text", "latency_s", "elapsed_s", "parts_n"), [
    # LONG_FIRST's first sentence: 171 letters / 14 x 1.15 = 14.05 s; at r = 1.38 with
    # `balanced`'s hops (0.4 s first, doubling to 4 s) it needs 2.164 s in hand after its
    # first chunk (test_first_piece_release_with_the_hop_doubling): released 0.7 + 1.764 =
    # 2.46 s after the request began, past the limit 1 s of streamed text left (1.45 s): cut
    (LONG_FIRST, 0.7, 1.0, 2),
    # the same with the whole limit ahead and a quick first chunk: 0.2 + 1.764 < 2.45: whole
    (LONG_FIRST, 0.2, 0.0, 1),
    # no latency measured yet (a fresh server): the rate alone decides, whole
    (LONG_FIRST, None, 1.0, 1),
    # a 4.68 s sentence (57 letters) needs 1.113 + 0.1 s in hand after its first chunk:
    # released 0.7 + 0.813 = 1.51 s on, within the 2.15 s left after 0.3 s of text: whole
    ("The kitchen lights are on, and the front door is locked for the night.", 0.7, 0.3, 1),
])
def test_a_first_sentence_faster_than_playback_is_cut_when_it_would_miss_the_limit(
    text: str, latency_s: float | None, elapsed_s: float, parts_n: int,
) -> None:
    async def send(event: Event) -> None:
        raise AssertionError("nothing is sent")

    history = ProductionHistory()
    history.add_response(13.8, 10.0)  # r = 1.38: 1.25 x playback at the 10 % margin
    if latency_s is not None:
        history.add_first_chunk(latency_s)
    options = PRESETS["balanced"]
    assert (options.flow.first_hop_tokens, options.flow.max_hop_tokens) == (10, 100)
    runtime = SimpleNamespace(production=history,
                              loader=SimpleNamespace(request_options=lambda: options))
    clock = FakeClock()
    clock.now_s = 50.0 + elapsed_s
    gate = PieceGate(send, 10.0, history, clock=clock)
    gate.first_audio_from = 50.0
    parts = first_pieces(runtime, gate, text)  # type: ignore[arg-type]
    assert " ".join(parts) == text
    assert len(parts) == parts_n
    if parts_n == 2:
        assert parts[0] == "Here is the weather for today,"


async def test_streamed_answer_opening_with_a_long_sentence_starts_early(
    tmp_path: Path, make_clip: MakeClip
) -> None:
    # a 200-character first sentence at r = 2/3: the server speaks its first clause as the
    # first engine request, so the first audio comes within the limit and the first piece
    # plays through
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings_ = make_settings(model_dir, tmp_path / "data", max_preroll_ms=10000)
    async with running_server(settings_, piece_paced_factory) as server:
        engine = server.runtime.loader.engine
        assert isinstance(engine, PiecePacedEngine)
        deltas = [LONG_FIRST[i:i + 12] for i in range(0, len(LONG_FIRST), 12)]
        head = "Here is the weather for today,"
        head_s = CHUNK_S * round(expected_speech_s(head) / CHUNK_S)
        # only the first piece's audio is judged: the client leaves once it has all of it and
        # the engine works on the rest of the sentence (the rest would take about 15 s more)
        arrivals: list[tuple[float, float]] = []
        async with client(server) as cl:
            await cl.write_event(SynthesizeStart().event())
            t0 = time.monotonic()
            for delta in deltas:
                await cl.write_event(SynthesizeChunk(text=delta).event())
            await cl.write_event(SynthesizeStop().event())
            while sum(d for _, d in arrivals) < head_s - 1e-6:
                event = await read(cl)
                assert event.type != "synthesize-stopped", "the answer ended early"
                if AudioChunk.is_type(event.type):
                    chunk = AudioChunk.from_event(event)
                    arrivals.append((time.monotonic() - t0, len(chunk.audio) / 2 / chunk.rate))
        # one engine request whose first piece is the head
        assert len(engine.plans) == 1 and engine.plans[0][0] == head
    report = simulate_playback(arrivals, JITTER_S, piece_starts_s=[0.0, head_s])
    assert report.start_s is not None and report.start_s < FIRST_AUDIO_LIMIT_S + JITTER_S
    assert not [g for g, k in zip(report.gaps, report.gap_between, strict=True)
                if not k and g[1] <= report.start_s + head_s]  # the first piece plays through


async def _first_piece_streamed(tmp_path: Path, make_clip: MakeClip, latency_s: float | None,
                                delta_chars: int) -> str:
    """The first piece a fresh server plans for LONG_FIRST streamed in deltas of
    ``delta_chars``, its history told r = 1.38 (faster than playback by the rate margin) and
    a first-chunk latency of ``latency_s`` (None: none measured)."""
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings_ = make_settings(model_dir, tmp_path / "data", max_preroll_ms=10000)
    async with running_server(settings_, piece_paced_factory) as server:
        engine = server.runtime.loader.engine
        assert isinstance(engine, PiecePacedEngine)
        server.runtime.production.add_response(13.8, 10.0)
        if latency_s is not None:
            server.runtime.production.add_first_chunk(latency_s)
        async with client(server) as cl:
            await cl.write_event(SynthesizeStart().event())
            for i in range(0, len(LONG_FIRST), delta_chars):
                await cl.write_event(SynthesizeChunk(text=LONG_FIRST[i:i + delta_chars]).event())
            await cl.write_event(SynthesizeStop().event())
            while not AudioChunk.is_type((await read(cl)).type):
                pass  # the first audio: the engine request has begun
        return engine.plans[0][0]


async def test_the_server_cuts_a_first_sentence_the_gate_would_release_past_the_limit(
    tmp_path: Path, make_clip: MakeClip
) -> None:
    # with a 3 s first-chunk latency LONG_FIRST's first sentence could not be released
    # before 3 s, past the 2.45 s limit however soon the text came, so the server speaks its
    # first clause as the first piece; with no latency measured the rate alone decides and
    # keeps it whole (test_a_first_sentence_faster_than_playback_is_cut_when_it_would_miss_
    # the_limit has the arithmetic of a latency in between: no wall-clock margin here)
    assert await _first_piece_streamed(tmp_path, make_clip, 3.0, 12) == (
        "Here is the weather for today,")
    whole = await _first_piece_streamed(tmp_path, make_clip, None, 12)
    assert whole.startswith("Here is the weather for today, it will be")


async def test_server_pauses_fall_between_pieces_over_tcp(
    tmp_path: Path, make_clip: MakeClip
) -> None:
    # one streamed response of three sentences (pieces of 1.4, 2.1, 1.4 s), all text sent
    # at once so the server merges them into one engine request of three pieces
    text = f"{_sentence(4)[:-1]}ab. {_sentence(6)}ab {_sentence(4)}"
    pieces = re.split(r"(?<=[.])\s+", text)
    lengths = [expected_speech_s(p) for p in pieces]
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings_ = make_settings(model_dir, tmp_path / "data", max_preroll_ms=10000)
    async with running_server(settings_, piece_paced_factory) as server, client(server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text=text).event())
        await cl.write_event(SynthesizeStop().event())
        arrivals = await audio_arrivals(cl, "synthesize-stopped")
    counts = [round(length / CHUNK_S) for length in lengths]
    assert sum(d for _, d in arrivals) == pytest.approx(CHUNK_S * sum(counts))
    starts = [CHUNK_S * sum(counts[:k]) for k in range(len(counts))]
    report = simulate_playback(arrivals, JITTER_S, piece_starts_s=starts)
    assert report.inside_stalls == 0, (report.gaps, report.gap_between)
    assert report.between_stalls is not None and report.between_stalls >= 1
    assert report.start_s is not None and report.start_s < FIRST_AUDIO_LIMIT_S + JITTER_S


class DecodeReportingEngine(PiecePacedEngine):
    """The paced engine whose chunks also say how far their piece is decoded: 0.2 s more
    than the piece's audio so far (the flow's lookahead)."""

    def _chunks(self, pieces: list[str], should_stop: ShouldStop) -> Iterator[EngineChunk]:
        made_s: dict[int, float] = {}
        for chunk in super()._chunks(pieces, should_stop):
            made_s[chunk.piece_index] = made_s.get(chunk.piece_index, 0.0) + CHUNK_S
            yield replace(chunk, piece_decoded_s=made_s[chunk.piece_index] + CHUNK_S)


async def test_the_server_tells_the_gate_how_far_the_decoding_is_and_whether_text_follows(
    tmp_path: Path, make_clip: MakeClip, monkeypatch: pytest.MonkeyPatch
) -> None:
    told: list[tuple[float, bool]] = []
    audio = PieceGate.audio

    async def recording(self: PieceGate, *args: Any, **kwargs: Any) -> None:
        call = inspect.signature(audio).bind(self, *args, **kwargs)
        call.apply_defaults()
        told.append((call.arguments["piece_decoded_s"], self.text_may_follow()))
        await audio(self, *args, **kwargs)

    monkeypatch.setattr(PieceGate, "audio", recording)
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings_ = make_settings(model_dir, tmp_path / "data", max_preroll_ms=10000)
    async with running_server(settings_, DecodeReportingEngine) as server, \
            client(server) as cl:
        await cl.write_event(SynthesizeStart().event())
        await cl.write_event(SynthesizeChunk(text=f"{_sentence(4)} ").event())
        waited = 0.0
        while not told and waited < READ_TIMEOUT_S:
            await asyncio.sleep(0.01)
            waited += 0.01
        await cl.write_event(SynthesizeStop().event())
        await audio_arrivals(cl, "synthesize-stopped")
    chunks = round(expected_speech_s(_sentence(4)) / CHUNK_S)
    assert [d for d, _ in told] == pytest.approx([CHUNK_S * (k + 2) for k in range(chunks)])
    # the first chunk came before synthesize-stop: more text could still join
    assert told[0][1] is True
    assert told[-1][1] is False


# --- pieces sized for the hold on a slow machine ---------------------------------------------


@pytest.mark.parametrize(
    ("max_hold_s", "rate", "expected"),
    [
        (8.0, 0.5, 0.7 * 8.0 * 1.0),  # r / (1 - r) = 1
        (8.0, None, 0.7 * 8.0 * 1.0),  # before any measurement: assumed r = 0.5
        (6.0, 0.25, 0.7 * 6.0 / 3.0),  # a bound below the planned 8 s hold plans with it
        (30.0, 0.5, 0.7 * 8.0 * 1.0),  # a larger bound does not make pieces longer
        (8.0, 0.8, 0.7 * 8.0 * 4.0),
        (8.0, 1.0, None),  # keeps up: pieces as upstream cuts them
        (0.0, 0.3, None),  # nothing is ever held
    ],
)
def test_piece_limit_keeps_a_pieces_hold_within_the_bound(
    max_hold_s: float, rate: float | None, expected: float | None
) -> None:
    limit = piece_limit_s(max_hold_s, rate)
    if expected is None:
        assert limit is None
    else:
        assert limit == pytest.approx(expected)
        # a piece of that length, produced at r from nothing in hand, needs this much hold
        assert needed_hold_s(limit, rate or 0.5) == pytest.approx(0.7 * min(max_hold_s, 8.0))


class WordPlanner:
    """The engine's planning calls with words as tokens; records the bound of every plan."""

    def __init__(self) -> None:
        self.bounds: list[int | None] = []

    def text_token_count(self, text: str) -> int | None:
        return len(text.split())

    def plan_pieces(self, text: str, language_hint: str | None = None,
                    max_piece_tokens: int | None = None,
                    read_numbers: bool = True) -> list[PlannedPiece]:
        self.bounds.append(max_piece_tokens)
        limit = 80 if max_piece_tokens is None else max_piece_tokens
        pieces: list[str] = []
        for sentence in re.split(r"(?<=[.])\s+", text.strip()):
            if pieces and len((pieces[-1] + " " + sentence).split()) <= limit:
                pieces[-1] += " " + sentence
            else:
                pieces.append(sentence)
        return [PlannedPiece(piece, len(piece.split())) for piece in pieces]


def test_plan_bounds_pieces_by_the_texts_own_tokens_per_second() -> None:
    # 10 sentences of 8 words (33 non-blank characters: 33/14 s of expected speech, 8 tokens
    # each): 80 tokens per 330/14 s; 5.6 s of limit x 3.39 tokens/s = 19 tokens
    sentence = _sentence(8)
    text = " ".join([sentence] * 10)
    planner = WordPlanner()
    limit_s = piece_limit_s(8.0, 0.5)
    assert limit_s is not None
    max_tokens, expected, _ = planned_pieces(planner, text, None, limit_s)
    tokens_per_s = 80 / expected_speech_s(text)
    assert max_tokens == int(limit_s * tokens_per_s) == 19
    assert planner.bounds == [19]
    # the planner packs two sentences (16 tokens) per piece under the 19-token bound
    assert expected == [pytest.approx(expected_speech_s(f"{sentence} {sentence}"))] * 5
    # no bound: upstream's packing (80 tokens: all ten sentences in one piece)
    max_tokens, expected, _ = planned_pieces(planner, text, None, None)
    assert max_tokens is None and expected == [pytest.approx(expected_speech_s(text))]
    # a text shorter than the limit is not bounded
    assert planned_pieces(planner, sentence, None, limit_s)[0] is None


@pytest.mark.parametrize(("rate", "decoding_ahead", "max_hold_s", "bound_s"), [
    (1.5, True, 8.0, 8.0),  # faster than playback: one sentence a piece all the same
    (0.9, True, 8.0, 8.0),  # the hold's bound would be 50.4 s: one sentence
    (0.5, True, 8.0, 5.6),  # the hold's bound (0.7 x 8 x 0.5 / 0.5) is shorter
    (1.5, False, 8.0, None),  # decoding between chunks: upstream's pieces
    (0.9, False, 8.0, 50.4),
    (1.5, True, 0.0, None),  # nothing ever held: upstream's pieces
])
def test_decoding_ahead_bounds_pieces_to_about_a_sentence_at_any_rate(
    rate: float, decoding_ahead: bool, max_hold_s: float, bound_s: float | None,
) -> None:
    # two sentences of 20 words (80 letters, 5.7 s of expected speech each) that came
    # together: beside the decoding each is a piece of its own
    history = ProductionHistory()
    history.add_response(10.0 * rate, 10.0)
    runtime = SimpleNamespace(production=history)

    async def send(event: Event) -> None:
        raise AssertionError("nothing is sent")

    gate = PieceGate(send, max_hold_s, history, decoding_ahead=decoding_ahead)
    limit_s = piece_bound_s(runtime, gate)  # type: ignore[arg-type]
    assert limit_s == (None if bound_s is None else pytest.approx(bound_s))
    assert DECODING_AHEAD_PIECE_S == 8.0
    text = f"{_sentence(20)} {_sentence(20)}"
    assert expected_speech_s(text) == pytest.approx(160 / 14)
    _, expected, _ = planned_pieces(WordPlanner(), text, None, limit_s)
    assert len(expected) == (1 if bound_s is None or bound_s > 160 / 14 else 2)


def test_plan_bound_has_a_floor() -> None:
    text = " ".join([_sentence(8)] * 10)
    max_tokens, _, _ = planned_pieces(WordPlanner(), text, None, 0.1)
    assert max_tokens == MIN_PIECE_TOKENS


class RecordingPacedEngine(PiecePacedEngine):
    """The paced engine with word-token planning; records each request's piece bound,
    flow option and planned pieces."""

    def __init__(self, model_dir: Path, options: EngineOptions) -> None:
        super().__init__(model_dir, options)
        self.planner = WordPlanner()
        self.max_piece_tokens: list[int] = []
        self.whole_middle_pieces: list[bool] = []
        self.planned: list[list[str]] = []
        """The planned pieces of each request."""

    def text_token_count(self, text: str) -> int | None:
        return self.planner.text_token_count(text)

    def plan_pieces(self, text: str, language_hint: str | None = None,
                    max_piece_tokens: int | None = None,
                    read_numbers: bool = True) -> list[PlannedPiece]:
        return self.planner.plan_pieces(text, language_hint, max_piece_tokens, read_numbers)

    def synthesize(self, text, voice, options=None, should_stop=None, result=None, more=None):  # type: ignore[no-untyped-def]
        assert options is not None
        self.max_piece_tokens.append(options.max_piece_tokens)
        self.whole_middle_pieces.append(options.flow.whole_middle_pieces)
        self.planned.append([text] if isinstance(text, str) else [p.text for p in text])
        return super().synthesize(text, voice, options, should_stop, result, more)


@pytest.mark.parametrize(("max_preroll_ms", "bounded"), [(8000, True), (0, False)])
@pytest.mark.parametrize("cpus", [1, 2])
async def test_slow_server_asks_the_engine_for_sentence_pieces(
    tmp_path: Path, make_clip: MakeClip, monkeypatch: pytest.MonkeyPatch, max_preroll_ms: int,
    bounded: bool, cpus: int,
) -> None:
    # a fresh server (no measured rate: assumed slow) with holds allowed bounds the pieces of
    # a long answer; with holds off (--max-preroll-ms 0) the engine cuts as upstream does.
    # On 2 CPUs the engine decodes beside the flow (split cores)
    from wyoming_cosyvoice3.server import model_loader

    monkeypatch.setattr(model_loader, "available_cpus", lambda: cpus)
    text = " ".join([_sentence(8)] * 6)
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings_ = make_settings(model_dir, tmp_path / "data", max_preroll_ms=max_preroll_ms)
    async with running_server(settings_, RecordingPacedEngine) as server, client(server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        engine = server.runtime.loader.engine
        assert isinstance(engine, RecordingPacedEngine)
        # the bound is handed over when the engine request starts: no need to wait for the
        # paced audio (about 20 s) before the client leaves
        assert await asyncio.to_thread(engine.started.acquire, True, READ_TIMEOUT_S)
    head, rest = _first(text)
    if bounded:
        # with holds the short first sentence is a part of its own (split_first_clause),
        # planned unbounded (it fits the planned hold), and the rest is planned with the
        # bound; both are spoken as one engine request, the head its first piece
        assert rest and head == _sentence(8)
        assert len(engine.planner.bounds) == 2 and engine.planner.bounds[0] is None
        bound = engine.planner.bounds[1]
        assert bound is not None and bound < 80
        assert len(engine.planned) == 1 and engine.planned[0][0] == head
        assert " ".join(engine.planned[0][1:]) == rest
        assert len(engine.planned[0]) > 2
        assert all(len(piece.split()) <= bound for piece in engine.planned[0][1:])
        assert engine.max_piece_tokens == [bound]
        # pieces held until they play through: the middle ones are made in one chunk each,
        # unless the decoding runs beside the flow (which would wait for each one's last token)
        assert engine.whole_middle_pieces == [cpus == 1]
    else:
        assert engine.max_piece_tokens == [80]
        assert engine.whole_middle_pieces == [False]


def _seeded_history(predicted_rtf: float) -> ProductionHistory:
    """A fresh server's history after ``--preset auto`` predicted ``predicted_rtf``."""
    history = ProductionHistory()
    history.seed_prediction(predicted_rtf)
    return history


async def test_a_prior_just_faster_than_playback_still_bounds_the_first_answer() -> None:
    # auto predicted RTF 0.92 (just faster than playback), the machine measures RTF 1.25
    # (r = 0.8). Seeded with the prediction's error the prior is r = 0.945 < 1: the first
    # answer's pieces are bounded and its first piece is held, and the first piece measured
    # (0.8) replaces the prior for the rest of the answer: no pause inside any piece
    history = _seeded_history(0.92)
    assert PREDICTION_ERROR == 0.15 and history.rate() == pytest.approx(1 / (0.92 * 1.15))
    assert piece_limit_s(10.0, history.rate()) is not None  # bounded pieces
    pieces = [3.0, 4.0, 4.0, 3.0]
    sent, starts, _ = await _produce(pieces, rate=0.8, chunk_s=0.25, overhead_s=0.3,
                                     history=history, first_audio_limit_s=1e9)
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls == 0 and report.stalls == report.between_stalls
    # the response's measurement replaced the prior (r = 0.8 of these pieces)
    assert not history.seeded and history.rate() == pytest.approx(0.8, rel=1e-9)


async def test_a_prior_taken_as_measured_would_pause_inside_the_first_answer() -> None:
    # the control: the prediction (r = 1 / 0.92 = 1.09) taken as a measurement without its
    # error, as before: pieces are not bounded, the first piece is not held, and production at
    # r = 0.8 runs the player dry inside the first piece
    history = ProductionHistory()
    history.add_response(SEED_WORK_S / 0.92, SEED_WORK_S)
    assert piece_limit_s(10.0, history.rate()) is None  # no bound: "faster than playback"
    sent, starts, _ = await _produce([3.0, 4.0, 4.0, 3.0], rate=0.8, chunk_s=0.25,
                                     overhead_s=0.3, history=history, first_audio_limit_s=1e9)
    report = simulate_playback(sent, piece_starts_s=starts)
    assert report.inside_stalls is not None and report.inside_stalls > 0


async def test_a_measured_piece_outweighs_a_predicted_prior() -> None:
    # within one response: once a piece is measured, a prior that is only a prediction no
    # longer counts (a measured history does: PRIOR_WEIGHT_S)
    clock = FakeClock()

    async def send(event: Event) -> None:
        del event

    seeded = _seeded_history(0.5)  # predicts r = 1.74
    gate = PieceGate(send, 60.0, seeded, clock=clock, first_audio_limit_s=1e9)
    gate.begin_text([3.0, 3.0])
    for _ in range(6):
        clock.now_s += 0.5  # r = 0.5
        await gate.audio([_chunk_event(0.25)], 0.25, 0)
    assert gate.rate() == pytest.approx(0.5, rel=0.05)
    measured = ProductionHistory()
    measured.add_response(1.74 * SEED_WORK_S, SEED_WORK_S)
    other = PieceGate(send, 60.0, measured, clock=clock, first_audio_limit_s=1e9)
    other.begin_text([3.0, 3.0])
    for _ in range(6):
        clock.now_s += 0.5
        await other.audio([_chunk_event(0.25)], 0.25, 0)
    rate = other.rate()
    assert rate is not None and rate > 0.7  # blended with the measured history



async def _decoded_ahead_answers(decoding_ahead: bool) -> tuple[float, PlaybackReport]:
    """Two answers through one history as an engine decoding its tokens in a thread beside
    the flow makes them: a one-sentence answer whose later chunks came from tokens decoded
    while its first was made (its first 1 s chunk 2.5 s after the request, then 2 s at 3.8 s
    and 1 s at 4.5 s: 1.5 s of audio a second chunk to chunk, 0.89 over its work), then a
    long piece that starts alike and is then paced by the decoding (4 s chunks every 5 s:
    0.8). Returns the rate the sentence left in the history and the player's report of the
    long piece."""
    clock = FakeClock()
    sent: list[tuple[float, float]] = []

    async def send(event: Event) -> None:
        sent.append((clock.now_s, len(event.payload or b"") / 2 / RATE_HZ))

    history = ProductionHistory()

    async def answer(expected_s: float, chunks: tuple[tuple[float, float, float], ...]) -> None:
        start_s = clock.now_s
        gate = PieceGate(send, 60.0, history, clock=clock, first_audio_limit_s=1e9,
                         decoding_ahead=decoding_ahead)
        gate.begin_text([expected_s], max_chunk_s=4.0)
        for at_s, chunk_s, next_s in chunks:
            await _advance(gate, clock, start_s + at_s)
            await gate.audio([_chunk_event(chunk_s)], chunk_s, 0, next_chunk_s=next_s)
        await gate.end_text()
        await gate.release()
        await gate.close()

    await answer(4.0, ((2.5, 1.0, 2.0), (3.8, 2.0, 1.0), (4.5, 1.0, 0.0)))
    recorded = history.rate()
    assert recorded is not None
    sent.clear()
    clock.now_s = 100.0
    await answer(13.0, ((2.5, 1.0, 2.0), (3.8, 2.0, 4.0), (8.8, 4.0, 4.0), (13.8, 4.0, 2.0),
                        (16.3, 2.0, 0.0)))
    return recorded, simulate_playback([(t - 100.0, d) for t, d in sent], piece_starts_s=[0.0])


async def test_decoding_ahead_measures_the_rate_over_the_engine_work() -> None:
    # chunk to chunk the sentence looked 1.5x faster than playback; over its work (the 2.5 s
    # to its first chunk included) it made 4 s of audio in 4.5 s
    ahead_rate, ahead = await _decoded_ahead_answers(True)
    chunk_rate, behind = await _decoded_ahead_answers(False)
    assert ahead_rate == pytest.approx(4.0 / 4.5)
    assert chunk_rate == pytest.approx(3.0 / 2.0)
    # the long piece plays through only with the rate over the work: taught 1.5 by the
    # sentence, the other gate lets it start at 3.8 s with 3 s in hand, so it runs dry from
    # 6.8 s until the 4 s chunk of 8.8 s and from 12.8 s until the one of 13.8 s
    assert ahead.inside_stalls == 0, ahead
    assert behind.inside_stalls == 2, behind
    assert behind.inside_stall_s == pytest.approx(3.0, abs=0.01)


# -- pieces whose tokens are all decoded -------------------------------------------------------

Made = tuple[float, float, float | None, bool]
"""One engine chunk: (made at s, audio s, the piece's audio still to come after it or None
while the piece is being decoded, the request's decoding had finished)."""


async def _one_piece(history: ProductionHistory, expected_s: float, chunks: tuple[Made, ...],
                     start_s: float = 0.0, decoded_s: tuple[float, ...] = (),
                     text_may_follow: bool = False) -> list[tuple[float, float]]:
    """One answer of one piece through ``history`` (the engine decoding beside the flow);
    ``decoded_s``: per chunk, the piece's tokens decoded so far in audio seconds (default 0:
    not told); returns what the client got, (arrival s after ``start_s``, audio s)."""
    clock = FakeClock()
    clock.now_s = start_s
    sent: list[tuple[float, float]] = []

    async def send(event: Event) -> None:
        sent.append((clock.now_s - start_s, len(event.payload or b"") / 2 / RATE_HZ))

    gate = PieceGate(send, 60.0, history, clock=clock, first_audio_limit_s=1e9,
                     decoding_ahead=True)
    gate.text_may_follow = lambda: text_may_follow
    gate.begin_text([expected_s], max_chunk_s=2.0)
    for k, (at_s, chunk_s, left_s, decoding_done) in enumerate(chunks):
        await _advance(gate, clock, start_s + at_s)
        last = k == len(chunks) - 1
        await gate.audio([_chunk_event(chunk_s)], chunk_s, 0,
                         next_chunk_s=0.0 if last else min(chunks[k + 1][1], 2.0),
                         piece_done=last, piece_left_s=left_s, decoding_done=decoding_done,
                         piece_decoded_s=decoded_s[k] if decoded_s else 0.0)
    await gate.end_text()
    await gate.release()
    await gate.close()
    return sent


def _taught(decoding_rate: float, decoded_rate: float) -> ProductionHistory:
    """A history that saw pieces made from decoded tokens at ``decoding_rate`` beside the
    decoding and at ``decoded_rate`` after it, and an engine-work rate of 0.5."""
    history = ProductionHistory()
    history.add_response(5.0, 10.0)
    history.add_decoded("decoding", 4.0 * decoding_rate, 4.0)
    history.add_decoded("decoded", 4.0 * decoded_rate, 4.0)
    return history


# a 12 s piece decoded before its first chunk, which comes 6 s into the request (the engine
# was busy with the pieces before it), then 2 s of audio every second
DECODED_PIECE: tuple[Made, ...] = (
    (6.0, 1.0, 11.0, True), (7.0, 2.0, 9.0, True), (8.0, 2.0, 7.0, True),
    (9.0, 2.0, 5.0, True), (10.0, 2.0, 3.0, True), (11.0, 2.0, 1.0, True),
    (11.5, 1.0, 0.0, True))


async def test_a_decoded_piece_is_held_at_the_flows_pace_and_plays_through() -> None:
    # the rate over the engine work says 1 s of audio took 6 s: held for that, the piece
    # would wait for most of its audio; made from decoded tokens at 2 s a second it needs
    # only its next chunk's 1.1 s (2 s at 2 / 1.1, + the arrival margin) in hand
    sent = await _one_piece(_taught(1.0, 2.0), 12.0, DECODED_PIECE)
    report = simulate_playback(sent, piece_starts_s=[0.0])
    assert sent[0][0] == pytest.approx(6.0 + 2.0 / (2.0 / 1.1) + ARRIVAL_MARGIN_S - 1.0)
    assert report.stalls == 0, report
    # without the engine's word that the piece is decoded the gate holds it long
    unknown = tuple((at, d, None, done) for at, d, _, done in DECODED_PIECE)
    held = await _one_piece(_taught(1.0, 2.0), 12.0, unknown)
    assert held[0][0] > sent[0][0] + 2.0


async def test_beside_the_decoding_the_pace_measured_beside_it_holds() -> None:
    # the same piece while the decoding still runs: the pace measured beside the decoding
    # (1.0, 0.91 with the margin: 3.1 s needed in hand at 6 s, the first chunk brought 1 s)
    # holds it, not the 2.0 measured after it; its second chunk (2 s in 1 s) lifts the
    # measured pace above 1 and releases it
    beside = tuple((at, d, left, False) for at, d, left, _ in DECODED_PIECE)
    sent = await _one_piece(_taught(1.0, 2.0), 12.0, beside)
    assert sent[0][0] == pytest.approx(7.0)
    assert simulate_playback(sent, piece_starts_s=[0.0]).stalls == 0
    # with no pace measured after the decoding, the one beside it is used: same release
    only_beside = ProductionHistory()
    only_beside.add_response(5.0, 10.0)
    only_beside.add_decoded("decoding", 4.0, 4.0)
    first = await _one_piece(only_beside, 12.0, DECODED_PIECE)
    assert first[0][0] == pytest.approx(sent[0][0])


async def test_the_decoded_pace_is_measured_from_chunks_of_decoded_pieces_only() -> None:
    history = ProductionHistory()
    # chunk to chunk: 2 s in 1 s from a decoded piece after the decoding, 2 s in 2 s beside
    # it, and 2 s in 4 s from a piece still being decoded (not counted)
    await _one_piece(history, 8.0, ((1.0, 2.0, None, False), (5.0, 2.0, 4.0, False),
                                    (7.0, 2.0, 2.0, True), (8.0, 2.0, 0.0, True)))
    assert history.decoded_rates["decoding"] == pytest.approx([2.0, 2.0])
    assert history.decoded_rates["decoded"] == pytest.approx([2.0, 1.0])


# a 4 s sentence still being decoded at its second chunk (2 s into the request, 1.5 s of
# audio made, 3.6 s decoded, at 1.6 s of audio a second since its first chunk); its decoding
# ends at 2.25 s, and the flow then makes 2 s of audio a second
DECODING_PIECE: tuple[Made, ...] = (
    (1.0, 0.5, None, False), (2.0, 1.0, None, False), (2.6, 1.0, 1.5, True),
    (3.35, 1.5, 0.0, True))
DECODING_PIECE_DECODED_S = (2.0, 3.6, 4.0, 4.0)


async def test_a_piece_still_being_decoded_is_held_for_the_pace_after_its_decoding() -> None:
    # at the second chunk: r over the engine work with the history's 10 s at 0.5 is
    # (1.5 + 5) / (2 + 10) = 0.542, 0.492 with the margin; 4 x 1.15 - 1.5 = 3.1 s to come in
    # chunks of 1, 2 and 0.1 s. At one pace the 2 s chunk binds: 3 / 0.492 - 1 = 5.09 s in
    # hand. With the decoding's pace (1.6 / 1.1 = 1.45) its 1 s still to decode takes 0.69 s,
    # in which 0.34 s of audio is made; the rest comes at 2 / 1.1 = 1.82: chunk 2 is made
    # 0.69 + 2.66 / 1.82 = 2.15 s on and due 1 s after the start, so 1.15 + 0.1 s are needed
    # and the 1.5 s in hand release it at once
    sent = await _one_piece(_taught(1.0, 2.0), 4.0, DECODING_PIECE,
                            decoded_s=DECODING_PIECE_DECODED_S)
    assert sent[0][0] == pytest.approx(2.0)
    assert simulate_playback(sent, piece_starts_s=[0.0]).stalls == 0
    # not told how far the decoding is: held until the third chunk, which says the piece is
    # decoded (1.5 s to come at 1.82 need 0.93 s in hand; 2.5 s are)
    one_pace = await _one_piece(_taught(1.0, 2.0), 4.0, DECODING_PIECE)
    assert one_pace[0][0] == pytest.approx(2.6)
    # text may still follow the piece (a stream): after its decoding a later piece may be
    # decoded beside the flow, at the 1.0 measured beside it (0.91 with the margin): chunk 2
    # is made 0.69 + 2.66 / 0.91 = 3.61 s on, 2.71 s needed in hand: held too
    beside = await _one_piece(_taught(1.0, 2.0), 4.0, DECODING_PIECE,
                              decoded_s=DECODING_PIECE_DECODED_S, text_may_follow=True)
    assert beside[0][0] > 2.0
    # decoded past its expected 4.6 s at the second chunk: the piece runs longer than
    # predicted and its decoding's end is unknown, so one pace again (taking the end as
    # reached would predict the rest at 1.82 and release it at once)
    longer = await _one_piece(_taught(1.0, 2.0), 4.0, DECODING_PIECE,
                              decoded_s=(2.0, 4.7, 4.7, 4.7))
    assert longer[0][0] == pytest.approx(one_pace[0][0])


@pytest.mark.parametrize("text", [
    # C4, repeated to well over 8 s of expected speech
    " ".join(["大家好，这里介绍一篇名为AN IMAGE IS WORTH 16X16 WORDS的论文。"] * 3),
    # (16 text tokens each: a tail under 20 tokens joins the piece before, as upstream merges)
    " ".join(["Look at the photo. 是 family, friends, 还是 people at a game?"] * 5),
    # C2 twice: numbers, times, dates and units read as words (the bound is judged on the
    # text as written, 7.1 s of expected speech once, 12.9 s once read as words)
    " ".join(["It is 21.5 °C in the living room. Your timer for 3:45 PM is set. Battery at "
              "50%. Today is December 17, 2023. Dinner at 6:31 PM."] * 2),
])
def test_the_sentence_bound_cuts_the_cases_and_keeps_their_text(
    engine_fast: Engine, text: str,
) -> None:
    # beside the decoding a piece holds at most 8 s: the real front end cuts the mixed-script
    # and number cases into several pieces that together read exactly what one unbounded
    # plan reads (only blanks and the full stops added at a cut differ)
    bounded = planned_pieces(engine_fast, text, None, DECODING_AHEAD_PIECE_S)
    whole = planned_pieces(engine_fast, text, None, None)
    assert bounded.pieces is not None and whole.pieces is not None
    assert bounded.max_tokens is not None and whole.max_tokens is None
    assert len(bounded.pieces) >= 2 and len(bounded.pieces) > len(whole.pieces)

    def letters(pieces: list[PlannedPiece]) -> str:
        return re.sub(r"[\s.。]", "", "".join(piece.text for piece in pieces))

    assert letters(bounded.pieces) == letters(whole.pieces)
