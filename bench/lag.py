"""How early each answer of a benchmark run could have started playing without a pause.

``python -m bench.lag OUT`` reads the servers' records of a run (``OUT/server-*.jsonl``, the
``--bench-stats-file`` of each server the benchmark started) and prints, per engine request
that made at least ``--min-audio-s`` of audio, its **earliest pause-free start**: the server
made chunk ``k`` at ``t_k`` seconds after the request began, and a listener who starts at
``T`` hears it on time when ``t_k <= T + S_k``, ``S_k`` = the audio of the chunks before it,
so ``T = max_k (t_k - S_k)``; ``T + audio`` is the shortest listening time any release rule
could give that answer without a pause (the arrival of a chunk at the client, a few ms, left
out). A chunk is a vocoder call (a graph run of the vocoder stage,
:func:`~bench.costmodel.stage_of`); its audio is its
``speech_feat`` mel frames, scaled so that the request's frames add up to its audio (exact for
the streamed vocoder, which turns each frame into 20 ms once).

It tells how far the piece gate's holds are from the production's own lag (the listening time
the benchmark measured against ``T + audio``), and how a change of piece plan or chunk schedule
moves that lag (BENCHMARKS.md, "Sentence pieces when decoding beside the flow").
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .costmodel import stage_of
from .run_helpers import read_records


@dataclass(frozen=True)
class RequestLag:
    """One engine request's earliest pause-free start.

    Attributes:
        chars: characters of text the request began with.
        pieces: text pieces it spoke.
        audio_s: seconds of audio it made.
        total_s: seconds from its start to its end (production).
        start_s: the earliest pause-free start ``T``, seconds after the request began.
    """

    chars: int
    pieces: int
    audio_s: float
    total_s: float
    start_s: float

    @property
    def listening_s(self) -> float:
        """Shortest pause-free listening time, seconds: ``T`` + the audio."""
        return self.start_s + self.audio_s


def request_lag(record: Mapping[str, Any]) -> RequestLag | None:
    """The :class:`RequestLag` of one ``"request"`` record, or None when it ran no vocoder
    call (no audio) or recorded no graph runs.

    Raises:
        KeyError: a request record without its fields (not a server's record).
    """
    began = float(record["wall_start_s"])
    calls = sorted((float(end), int(shapes["speech_feat"][2]))
                   for graph_file, shapes, _start, end in record.get("graph_runs", ())
                   if stage_of(Path(str(graph_file)).name, shapes) == "vocoder")
    frames = sum(n for _, n in calls)
    audio_s = float(record["audio_s"])
    if not calls or frames <= 0:
        return None
    per_frame_s = audio_s / frames
    before_s = start_s = 0.0
    for end, n in calls:
        start_s = max(start_s, end - began - before_s)
        before_s += n * per_frame_s
    return RequestLag(int(record.get("chars", 0)), int(record.get("pieces", 0)), audio_s,
                      float(record["total_s"]), start_s)


def read_lags(path: Path, min_audio_s: float = 0.0) -> list[RequestLag]:
    """The lags of a server's requests with at least ``min_audio_s`` of audio, in order
    (:func:`~bench.run_helpers.read_records`: a missing file or a line that is not JSON
    gives nothing)."""
    lags: list[RequestLag] = []
    for record in read_records(path):
        if record.get("kind") != "request" or float(record.get("audio_s", 0.0)) < min_audio_s:
            continue
        lag = request_lag(record)
        if lag is not None:
            lags.append(lag)
    return lags


def summary(name: str, lags: Sequence[RequestLag]) -> str:
    """One line: the server's name, each request's ``T`` and the medians."""
    if not lags:
        return f"{name}: no request"
    starts = ", ".join(f"{lag.start_s:.2f}" for lag in lags)
    return (f"{name}: earliest pause-free start {starts} s (median "
            f"{statistics.median(lag.start_s for lag in lags):.2f}); shortest listening "
            f"median {statistics.median(lag.listening_s for lag in lags):.2f} s; production "
            f"median {statistics.median(lag.total_s for lag in lags):.2f} s")


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lag", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="a benchmark run's --out directory")
    p.add_argument("--min-audio-s", type=float, default=0.0,
                   help="leave out requests with less audio (e.g. 1 drops the warm-up, 20 "
                        "keeps the paragraph)")
    p.add_argument("--max-audio-s", type=float, default=float("inf"),
                   help="leave out requests with more audio (e.g. 10 keeps the sentence)")
    args = p.parse_args(None if argv is None else list(argv))
    files = sorted(args.out.glob("server-*.jsonl"))
    if not files:
        p.error(f"no server-*.jsonl in {args.out}")
    for path in files:
        lags = [lag for lag in read_lags(path, args.min_audio_s)
                if lag.audio_s <= args.max_audio_s]
        print(summary(path.stem.removeprefix("server-"), lags))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
