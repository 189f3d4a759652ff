"""A simulated real-time player: when would a listener hear gaps?

The player starts when the first audio arrives and then consumes audio at 1 s per second.
Whenever the next chunk arrives after everything received so far has been played, the player
has run dry: one stall, lasting until that chunk arrives. This is what a Home Assistant
satellite does with a streamed TTS response (no extra buffering assumed).

Given where the server's pieces start in the audio (``piece_starts_s``, from the server's
record of the response, :mod:`.recorder`), each stall is a pause *between* pieces (the chunk
that ends it starts a piece: it sounds like a breath) or *inside* one (it breaks a word).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

STALL_TOLERANCE_S = 0.001
"""Gaps shorter than this are timer noise, not audible stalls."""
POSITION_TOLERANCE_S = 1e-4
"""A chunk starts a piece when its audio position is this close to a piece start (float sums
of 24 kHz chunk lengths; 2.4 samples)."""


@dataclass
class PlaybackReport:
    """Outcome of :func:`simulate_playback`.

    Attributes:
        stalls: times the player ran dry before the last chunk.
        stall_s: seconds spent waiting in those stalls.
        start_s: arrival time of the first audio (the first-chunk latency).
        end_s: when playback ends.
        gaps: (start_s, end_s) of each stall, for timelines.
        gap_between: per gap, True when it falls between pieces (the chunk after it starts a
            piece), False inside one; empty when the pieces are unknown.
        inside_stalls / inside_stall_s, between_stalls / between_stall_s: the stalls split
            that way (None when the pieces are unknown).
    """

    stalls: int = 0
    stall_s: float = 0.0
    start_s: float | None = None
    end_s: float | None = None
    gaps: list[tuple[float, float]] = field(default_factory=list)
    gap_between: list[bool] = field(default_factory=list)
    inside_stalls: int | None = None
    inside_stall_s: float | None = None
    between_stalls: int | None = None
    between_stall_s: float | None = None

    @property
    def listening_s(self) -> float | None:
        """What a listener spends from the request to the last sample: first audio + audio +
        all pauses (``end_s`` from the arrivals' origin, the request)."""
        return self.end_s


def simulate_playback(
    arrivals: Sequence[tuple[float, float]], tolerance_s: float = STALL_TOLERANCE_S,
    piece_starts_s: Sequence[float] | None = None,
) -> PlaybackReport:
    """Simulate playback of chunks ``(arrival_s, duration_s)`` sorted by arrival time.

    Chunks without audio (duration 0) are ignored. Arrival times are seconds from any common
    origin (e.g. the request).

    Args:
        arrivals: ``(arrival_s, duration_s)`` per chunk.
        tolerance_s: gaps up to this long are not stalls.
        piece_starts_s: audio positions (seconds into the response's audio) where pieces
            start; None = unknown (no inside / between split).

    Raises:
        ValueError: arrivals are not sorted or a duration is negative.
    """
    report = PlaybackReport()
    starts = sorted(piece_starts_s) if piece_starts_s is not None else None
    position_s = 0.0
    play_end: float | None = None
    last_arrival = float("-inf")
    for arrival_s, duration_s in arrivals:
        if arrival_s < last_arrival:
            raise ValueError("arrivals must be sorted by time")
        if duration_s < 0:
            raise ValueError(f"negative chunk duration {duration_s}")
        last_arrival = arrival_s
        if duration_s == 0:
            continue
        if play_end is None:
            report.start_s = arrival_s
            play_end = arrival_s
        elif arrival_s - play_end > tolerance_s:
            report.stalls += 1
            report.stall_s += arrival_s - play_end
            report.gaps.append((play_end, arrival_s))
            if starts is not None:
                report.gap_between.append(
                    any(abs(position_s - start) <= POSITION_TOLERANCE_S for start in starts))
            play_end = arrival_s
        play_end = max(play_end, arrival_s) + duration_s
        position_s += duration_s
    report.end_s = play_end
    if starts is not None:
        between = [b - a for (a, b), k in zip(report.gaps, report.gap_between, strict=True) if k]
        inside = [b - a for (a, b), k in zip(report.gaps, report.gap_between, strict=True)
                  if not k]
        report.between_stalls, report.between_stall_s = len(between), sum(between)
        report.inside_stalls, report.inside_stall_s = len(inside), sum(inside)
    return report
