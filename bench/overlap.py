"""How fast each stage's graph runs go while the other kind of work runs beside them.

With ``EngineOptions.split_cores`` the LLM's decoding runs in a thread of its own beside the
flow and the vocoder. ``python -m bench.overlap OUT`` reads the servers' records of a benchmark
run (``OUT/server-*.jsonl``) and sorts every decode step and every DiT and vocoder call into:

* **alone**: the other kind of work overlapped it for less than :data:`ALONE_BELOW` of its
  duration;
* **beside**: it overlapped for more than :data:`BESIDE_ABOVE` (runs in between are left out).

Runs are compared only with runs of the same graph file and the same input shapes (the same
work), and the tool prints their median durations alone and beside. Then, per server, the
**share** of its alone speed each kind of work kept beside the other: the sum of the alone
medians of its beside runs over the sum of their durations. The two shares add up to how many
machines' worth of work the overlap gave. 2 would mean the two kinds of work did not slow
each other at all; 1 means the same as running them one after the other. Last, per stage,
the seconds its runs in a long answer (``--stages-min-audio-s``) would have taken alone, to
set beside the stage's minimum at the machine's rates (BENCHMARKS.md, "The decoding beside
the flow shares the cores").
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .costmodel import stage_of
from .run_helpers import read_records

ALONE_BELOW = 0.05
"""A run overlapped by the other kind of work for less than this share of its duration
counts as alone (a few ms at its edges are the threads handing over)."""
BESIDE_ABOVE = 0.8
"""A run overlapped for more than this share of its duration counts as beside."""

_SIDES = {"llm_decode": "decoding", "flow": "flow and vocoder", "vocoder": "flow and vocoder"}
_OTHER_SIDE = {"decoding": "flow and vocoder", "flow and vocoder": "decoding"}

RunKey = tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]
"""A graph file's name and its input shapes, for a decode step its rows only: runs with equal
keys did equal work. A decode step reads every weight once whatever its past; its attention
over a longer past adds a little (a two-row ``fused-b8`` step alone on the Xeon of
BENCHMARKS.md: 26.1 ms at 0-127 positions, 27.4 ms at 128-255), so steps deep into a
paragraph count as slightly shorter alone than they are."""


@dataclass
class Overlap:
    """The alone and beside durations of one server's runs.

    Attributes:
        runs: per run key, ``{"alone": [s, ...], "beside": [s, ...]}``.
        sides: per run key, ``"decoding"`` or ``"flow and vocoder"``.
        labels: per run key, a short description (stage and size).
    """

    runs: dict[RunKey, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: {"alone": [], "beside": []}))
    sides: dict[RunKey, str] = field(default_factory=dict)
    labels: dict[RunKey, str] = field(default_factory=dict)
    requests: list[tuple[float, list[tuple[str, RunKey, float, bool]]]] = field(
        default_factory=list)
    """Per request, its audio seconds and ``(stage, key, seconds, alone)`` of every run
    sorted (alone, beside or in between)."""

    def ran_s(self, stage: str, min_audio_s: float = 0.0) -> float | None:
        """Median over the requests with at least ``min_audio_s`` of audio of the seconds
        ``stage``'s counted runs took as they ran; None when no such request ran the stage."""
        totals = [sum(seconds for run_stage, _key, seconds, _alone in runs
                      if run_stage == stage)
                  for audio_s, runs in self.requests
                  if audio_s >= min_audio_s and any(r[0] == stage for r in runs)]
        return statistics.median(totals) if totals else None

    def alone_equivalent_s(self, stage: str, min_audio_s: float = 0.0
                           ) -> tuple[float, int] | None:
        """Median over the requests with at least ``min_audio_s`` of audio of the seconds
        ``stage``'s runs would have taken alone (a run alone as it ran; any other as the
        alone median of its key, in any request, or without one as its duration times its
        side's :meth:`share`, or as its duration when that is not measured), and how many of
        their runs had no alone figure; None when no such request ran the stage."""
        share = self.share(_SIDES[stage]) or 1.0
        totals, missing = [], 0
        for audio_s, runs in self.requests:
            if audio_s < min_audio_s:
                continue
            total, ran = 0.0, False
            for run_stage, key, seconds, was_alone in runs:
                if run_stage != stage:
                    continue
                ran = True
                alone = self.runs[key]["alone"] if key in self.runs else []
                if was_alone:
                    total += seconds
                elif alone:
                    total += statistics.median(alone)
                else:
                    total += seconds * share
                    missing += 1
            if ran:
                totals.append(total)
        return (statistics.median(totals), missing) if totals else None

    def share(self, side: str) -> float | None:
        """Share of its alone speed ``side`` kept beside the other kind of work: the alone
        medians of its beside runs over their durations (only keys measured both ways);
        None when no key was."""
        alone_s = beside_s = 0.0
        for key, both in self.runs.items():
            if self.sides[key] != side or not both["alone"] or not both["beside"]:
                continue
            alone_s += statistics.median(both["alone"]) * len(both["beside"])
            beside_s += sum(both["beside"])
        return alone_s / beside_s if beside_s > 0 else None


def _key(name: str, stage: str, shapes: Mapping[str, Sequence[int]]) -> RunKey:
    if stage == "llm_decode":
        return name, (("rows", (int(shapes["inputs_embeds"][0]),)),)
    return name, tuple(sorted((k, tuple(int(d) for d in v)) for k, v in shapes.items()))


def _label(stage: str, shapes: Mapping[str, Sequence[int]]) -> str:
    if stage == "llm_decode":
        return f"decode step, {shapes['inputs_embeds'][0]} row(s)"
    if stage == "vocoder":
        return f"vocoder, {shapes['speech_feat'][2]} frames"
    history = shapes.get("hist_key_0")
    extra = f", {history[2]} history" if history is not None and len(history) > 2 else ""
    return f"DiT, {shapes['x'][2]} frames{extra}"


def _covered_s(start: float, end: float, others: Sequence[tuple[float, float]]) -> float:
    """Seconds of ``[start, end]`` that ``others`` (disjoint intervals) cover."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)


def add_request(overlap: Overlap, record: Mapping[str, Any]) -> None:
    """Sort one ``"request"`` record's decode steps, DiT calls and vocoder calls into
    ``overlap`` (the flow's encoder and other graphs are not counted).

    Raises:
        KeyError: a record without its fields (not a server's record).
    """
    runs = []
    for graph_file, shapes, start, end in record.get("graph_runs", ()):
        name = Path(str(graph_file)).name
        stage = stage_of(name, shapes)
        if stage is None or stage == "llm_prefill" or name.startswith("flow_encoder"):
            continue
        runs.append((name, stage, shapes, float(start), float(end)))
    intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for _name, stage, _shapes, start, end in runs:
        intervals[_SIDES[stage]].append((start, end))
    sorted_runs: list[tuple[str, RunKey, float, bool]] = []
    overlap.requests.append((float(record.get("audio_s", 0.0)), sorted_runs))
    for name, stage, shapes, start, end in runs:
        side = _SIDES[stage]
        duration = end - start
        if duration <= 0:
            continue
        covered = _covered_s(start, end, intervals[_OTHER_SIDE[side]]) / duration
        kind = "alone" if covered < ALONE_BELOW else "beside" if covered > BESIDE_ABOVE else None
        key = _key(name, stage, shapes)
        sorted_runs.append((stage, key, duration, kind == "alone"))
        overlap.sides[key] = side
        overlap.labels[key] = _label(stage, shapes)
        if kind is not None:
            overlap.runs[key][kind].append(duration)


def read_overlap(path: Path, min_audio_s: float = 0.0) -> Overlap:
    """The runs of a server's requests with at least ``min_audio_s`` of audio
    (:func:`~bench.run_helpers.read_records`: a missing file gives nothing)."""
    overlap = Overlap()
    for record in read_records(path):
        if record.get("kind") == "request" and float(record.get("audio_s", 0.0)) >= min_audio_s:
            add_request(overlap, record)
    return overlap


def report(name: str, overlap: Overlap, min_runs: int = 3,
           stages_min_audio_s: float = 0.0) -> list[str]:
    """Lines: per run key with at least ``min_runs`` runs both ways, the medians alone and
    beside in ms and their ratio; then both shares and their sum; then per stage its
    seconds as run and alone per request with at least ``stages_min_audio_s`` of audio
    (:meth:`Overlap.ran_s`, :meth:`Overlap.alone_equivalent_s`)."""
    lines = [f"{name}:"]
    for key in sorted(overlap.runs, key=lambda k: (overlap.sides[k], overlap.labels[k])):
        both = overlap.runs[key]
        if len(both["alone"]) < min_runs or len(both["beside"]) < min_runs:
            continue
        alone, beside = statistics.median(both["alone"]), statistics.median(both["beside"])
        lines.append(f"  {overlap.labels[key]}: alone {alone * 1000:.1f} ms "
                     f"({len(both['alone'])}), beside {beside * 1000:.1f} ms "
                     f"({len(both['beside'])}), {beside / alone:.2f}x")
    shares = {side: overlap.share(side) for side in ("decoding", "flow and vocoder")}
    parts = [f"{side} {share:.2f}" for side, share in shares.items() if share is not None]
    if len(parts) == 2:
        total = sum(s for s in shares.values() if s is not None)
        lines.append(f"  share of the alone speed kept beside: {', '.join(parts)}; "
                     f"together {total:.2f} machines")
    else:
        lines.append("  share of the alone speed kept beside: not measured both ways")
    for stage in ("llm_decode", "flow", "vocoder"):
        equivalent = overlap.alone_equivalent_s(stage, stages_min_audio_s)
        ran = overlap.ran_s(stage, stages_min_audio_s)
        if equivalent is not None and ran is not None:
            lines.append(f"  {stage}: {ran:.2f} s as run, {equivalent[0]:.2f} s alone, a "
                         f"request of >= {stages_min_audio_s:g} s of audio, medians "
                         f"({equivalent[1]} runs without an alone figure, estimated from the "
                         "share)")
    return lines


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="a benchmark run's --out directory")
    p.add_argument("--min-audio-s", type=float, default=1.0,
                   help="leave out requests with less audio (the default drops the warm-up)")
    p.add_argument("--min-runs", type=int, default=3,
                   help="print a run size only when measured this often both alone and beside")
    p.add_argument("--stages-min-audio-s", type=float, default=20.0,
                   help="the per-stage seconds alone are for requests with at least this much "
                        "audio (the default keeps the paragraph)")
    args = p.parse_args(None if argv is None else list(argv))
    files = sorted(args.out.glob("server-*.jsonl"))
    if not files:
        p.error(f"no server-*.jsonl in {args.out}")
    for path in files:
        overlap = read_overlap(path, args.min_audio_s)
        print("\n".join(report(path.stem.removeprefix("server-"), overlap, args.min_runs,
                                args.stages_min_audio_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
