"""A simulated real-time player: when would a listener hear gaps?

The player starts when the first audio arrives and then consumes audio at 1 s per second.
Whenever the next chunk arrives after everything received so far has been played, the player
has run dry: one stall, lasting until that chunk arrives. This is what a Home Assistant
satellite does with a streamed TTS response (no extra buffering assumed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

STALL_TOLERANCE_S = 0.001
"""Gaps shorter than this are timer noise, not audible stalls."""


@dataclass
class PlaybackReport:
    """Outcome of :func:`simulate_playback`.

    Attributes:
        stalls: times the player ran dry before the last chunk.
        stall_s: seconds spent waiting in those stalls.
        start_s: arrival time of the first audio (the first-chunk latency).
        end_s: when playback ends.
        gaps: (start_s, end_s) of each stall, for timelines.
    """

    stalls: int = 0
    stall_s: float = 0.0
    start_s: float | None = None
    end_s: float | None = None
    gaps: list[tuple[float, float]] = field(default_factory=list)


def simulate_playback(
    arrivals: Sequence[tuple[float, float]], tolerance_s: float = STALL_TOLERANCE_S
) -> PlaybackReport:
    """Simulate playback of chunks ``(arrival_s, duration_s)`` sorted by arrival time.

    Chunks without audio (duration 0) are ignored. Arrival times are seconds from any common
    origin (e.g. the request).

    Raises:
        ValueError: arrivals are not sorted or a duration is negative.
    """
    report = PlaybackReport()
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
            play_end = arrival_s
        play_end = max(play_end, arrival_s) + duration_s
    report.end_s = play_end
    return report
