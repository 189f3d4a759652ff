"""Simulated real-time playback (bench.player)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.player import simulate_playback


def test_audio_arriving_faster_than_real_time_never_stalls() -> None:
    # 1 s chunks every 0.5 s
    report = simulate_playback([(0.5 * i + 2.0, 1.0) for i in range(10)])
    assert report.stalls == 0 and report.stall_s == 0.0
    assert report.start_s == 2.0
    assert report.end_s == pytest.approx(12.0)


def test_one_late_chunk_is_one_stall_of_the_waiting_time() -> None:
    # plays 0..1, next chunk at 1.75 -> dry for 0.75 s; then plays 1.75..2.75, next at 2.5: fine
    report = simulate_playback([(0.0, 1.0), (1.75, 1.0), (2.5, 1.0)])
    assert report.stalls == 1
    assert report.stall_s == pytest.approx(0.75)
    assert report.gaps == [(1.0, 1.75)]
    assert report.end_s == pytest.approx(3.75)


def test_empty_chunks_are_ignored_and_start_is_first_audio() -> None:
    report = simulate_playback([(0.1, 0.0), (0.4, 0.5), (5.0, 0.0), (0.9, 0.5)][:3])
    assert report.start_s == 0.4 and report.stalls == 0
    assert simulate_playback([]).start_s is None


def test_tiny_gaps_below_the_tolerance_are_not_stalls() -> None:
    report = simulate_playback([(0.0, 1.0), (1.0005, 1.0)])
    assert report.stalls == 0


def test_unsorted_or_negative_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        simulate_playback([(1.0, 0.1), (0.5, 0.1)])
    with pytest.raises(ValueError):
        simulate_playback([(0.0, -0.1)])


@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 2)), min_size=1, max_size=40))
def test_playback_end_is_start_plus_audio_plus_stalls(pairs: list[tuple[float, float]]) -> None:
    gaps = [g for g, _ in pairs]
    times = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    chunks = [(t, d) for t, (_, d) in zip(times, pairs, strict=True)]
    report = simulate_playback(chunks, tolerance_s=0.0)
    audio = sum(d for _, d in chunks)
    if report.start_s is None:
        assert audio == 0
        return
    assert report.stall_s >= 0 and report.stalls == len(report.gaps)
    assert report.end_s == pytest.approx(report.start_s + audio + report.stall_s, abs=1e-6)


def test_stalls_are_told_apart_by_where_pieces_start() -> None:
    # pieces start at 0 and 1.5 s of audio; 0.5 s chunks
    arrivals = [(0.0, 0.5), (0.5, 0.5), (1.2, 0.5), (2.5, 0.5), (3.5, 0.5)]
    report = simulate_playback(arrivals, piece_starts_s=[0.0, 1.5])
    assert report.gaps == [(1.0, 1.2), (1.7, 2.5), (3.0, 3.5)]
    assert report.gap_between == [False, True, False]
    assert report.inside_stalls == 2 and report.inside_stall_s == pytest.approx(0.7)
    assert report.between_stalls == 1 and report.between_stall_s == pytest.approx(0.8)
    assert report.listening_s == pytest.approx(4.0)
    assert simulate_playback(arrivals).inside_stalls is None
