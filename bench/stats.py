"""Figures of one benchmark run and medians over runs.

A run joins what the client saw (:class:`RunTrace`: when each ``audio-chunk`` arrived) with
what the server recorded for the same time window (the JSON lines of
:mod:`.recorder`: stage times and every graph run with its input
shapes). Each graph run has a compute time (operations / measured MatMul rate) and a
weight-streaming time (weight bytes read / measured streaming rate). The physical limit of a
run is the largest of three lower bounds: all compute time, all streaming time (compute and
memory traffic may overlap, e.g. LLM decoding in a thread next to the flow), and per graph the
sum over its runs of the larger of the two (runs of one graph are sequential). No
implementation on this machine can run those graphs faster.

The same bound per stage (:func:`stage_summary`: LLM prefill, LLM decoding, flow, vocoder;
:func:`.costmodel.stage_of`) stands next to the stage's measured seconds (the engine's
``StageTimes``), so each stage's distance from its physical cost shows on its own.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .costmodel import STAGES, CostModel, stage_of
from .player import simulate_playback
from .throughput import Throughput

WINDOW_SLACK_S = 0.05
"""Clock slack when matching server records to a client request (same machine, same clock)."""


@dataclass
class RunTrace:
    """What the client measured for one request.

    Attributes:
        preset / workload / mode: the cell (mode ``one-shot`` or ``streaming``).
        wall_start_s: ``time.time()`` when the first event of the request was sent.
        total_s: request sent -> last event (``audio-stop`` / ``synthesize-stopped``) received.
        chunks: (arrival_s after the request, samples) of each ``audio-chunk``.
        sample_rate_hz: rate of the audio (24000).
        error: the server's ``error`` text, if any.
    """

    preset: str
    workload: str
    mode: str
    wall_start_s: float
    total_s: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    sample_rate_hz: int = 24000
    error: str | None = None

    @property
    def first_chunk_s(self) -> float | None:
        return next((t for t, n in self.chunks if n > 0), None)

    @property
    def audio_s(self) -> float:
        return sum(n for _, n in self.chunks) / self.sample_rate_hz


def records_in_window(
    records: Iterable[Mapping[str, Any]], start_s: float, end_s: float
) -> list[Mapping[str, Any]]:
    """Server ``request`` records that started within the client's request [start_s, end_s].

    The engine starts after the client sent its first event and, for a streaming request, runs
    once per sentence before ``synthesize-stopped``. Only the start gets a slack: the next
    client request may begin within milliseconds of this one's end, so a record that started
    after ``end_s`` belongs to it.
    """
    return [
        r for r in records
        if r.get("kind") == "request"
        and start_s - WINDOW_SLACK_S <= r["wall_start_s"] <= end_s
    ]


def piece_starts_of(
    trace: RunTrace, records: Iterable[Mapping[str, Any]]
) -> list[int] | None:
    """Sample offsets where the server's pieces start in ``trace``'s audio: the server's
    ``pieces`` record written within the request's time window whose sample count equals
    what the client received (exact: the offsets count the same samples); None without one
    (an older server, or no ``--bench-stats-file``)."""
    end_s = trace.wall_start_s + trace.total_s + WINDOW_SLACK_S
    received = sum(n for _, n in trace.chunks)
    for record in records:
        if (record.get("kind") == "pieces"
                and trace.wall_start_s <= float(record["wall_end_s"]) <= end_s
                and int(record.get("samples", -1)) == received):
            return [int(s) for s in record["starts"]]
    return None


def run_bounds(model: CostModel, shapes: Mapping[str, Sequence[int]],
               rates: Throughput) -> tuple[float, float, float, float]:
    """(fp32 operations, int8 operations, compute seconds, weight-streaming seconds) of a run."""
    ops = model.ops(shapes)
    compute_s = ops.fp32 / rates.fp32_flops + ops.int8 / rates.int8_ops
    memory_s = (model.weight_bytes_fp32 / rates.fp32_bytes
                + model.weight_bytes_int8 / rates.int8_bytes)
    return ops.fp32, ops.int8, compute_s, memory_s


def minimum_seconds(graphs: Mapping[str, Mapping[str, float]]) -> float:
    """Lower bound of the time all graph runs of :func:`graph_summary` need (module doc)."""
    if not graphs:
        return 0.0
    return max(sum(g["compute_s"] for g in graphs.values()),
               sum(g["memory_s"] for g in graphs.values()),
               max(g["min_s"] for g in graphs.values()))


def graph_summary(
    records: Iterable[Mapping[str, Any]],
    costs: Mapping[str, CostModel | str],
    rates: Throughput,
    until_wall_s: float | None = None,
    keep: Callable[[str, Mapping[str, Sequence[int]]], bool] | None = None,
) -> dict[str, dict[str, float]]:
    """Per graph file: runs, measured seconds, operations, compute / weight-streaming seconds
    and its minimum (per run the larger of the two, summed).

    Args:
        records: server records (their ``graph_runs``).
        costs: cost model (or why there is none) per graph file.
        rates: measured throughput.
        until_wall_s: only graph runs that ended by this wall-clock time (first chunk).
        keep: only graph runs for which ``keep(graph file, input shapes)`` holds (a stage).
    """
    out: dict[str, dict[str, float]] = {}
    for record in records:
        for graph_file, shapes, start_s, end_s in record.get("graph_runs", []):
            if until_wall_s is not None and end_s > until_wall_s:
                continue
            if keep is not None and not keep(graph_file, shapes):
                continue
            row = out.setdefault(graph_file, dict.fromkeys(
                ("runs", "seconds", "fp32_ops", "int8_ops", "compute_s", "memory_s", "min_s"),
                0.0))
            row["runs"] += 1
            row["seconds"] += end_s - start_s
            model = costs.get(graph_file)
            if isinstance(model, CostModel):
                try:
                    fp32, int8, compute_s, memory_s = run_bounds(model, shapes, rates)
                except (KeyError, IndexError):  # inputs unlike the family's: not counted
                    row["uncounted_runs"] = row.get("uncounted_runs", 0.0) + 1
                    continue
                row["fp32_ops"] += fp32
                row["int8_ops"] += int8
                row["compute_s"] += compute_s
                row["memory_s"] += memory_s
                row["min_s"] += max(compute_s, memory_s)
    return out


def _in_stage(stage: str, graph_file: str, shapes: Mapping[str, Sequence[int]]) -> bool:
    return stage_of(graph_file, shapes) == stage


def stage_summary(
    records: Sequence[Mapping[str, Any]],
    costs: Mapping[str, CostModel | str],
    rates: Throughput,
) -> dict[str, dict[str, float | None]]:
    """Per stage (:data:`.costmodel.STAGES`): measured seconds (the engine's ``StageTimes``,
    summed over the records), the seconds its graph runs took, runs, operations, compute and
    weight-streaming seconds, the stage's minimum (:func:`minimum_seconds` of its graph runs)
    and measured / minimum (None without a minimum)."""
    out: dict[str, dict[str, float | None]] = {}
    for stage in STAGES:
        graphs = graph_summary(records, costs, rates, keep=functools.partial(_in_stage, stage))
        measured = sum(float(r.get("times", {}).get(f"{stage}_s", 0.0)) for r in records)
        min_s = minimum_seconds(graphs)
        rows = graphs.values()
        out[stage] = {
            "measured_s": measured,
            "graph_s": sum(g["seconds"] for g in rows),
            "runs": sum(g["runs"] for g in rows),
            "uncounted_runs": sum(g.get("uncounted_runs", 0.0) for g in rows),
            "fp32_gops": sum(g["fp32_ops"] for g in rows) / 1e9,
            "int8_gops": sum(g["int8_ops"] for g in rows) / 1e9,
            "compute_s": sum(g["compute_s"] for g in rows),
            "memory_s": sum(g["memory_s"] for g in rows),
            "min_s": min_s,
            "ratio": measured / min_s if min_s > 0 else None,
        }
    return out


def stage_split(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Summed :class:`StageTimes` figures of the records, with per-token and per-chunk means."""
    keys = ("frontend_s", "llm_prefill_s", "llm_decode_s", "llm_tokens", "flow_s",
            "flow_calls", "vocoder_s", "vocoder_calls")
    total = dict.fromkeys(keys, 0.0)
    for record in records:
        times = record.get("times", {})
        for key in keys:
            total[key] += float(times.get(key, 0.0))
    total["llm_ms_per_token"] = (1e3 * total["llm_decode_s"] / total["llm_tokens"]
                                 if total["llm_tokens"] else 0.0)
    total["flow_s_per_chunk"] = (total["flow_s"] / total["flow_calls"]
                                 if total["flow_calls"] else 0.0)
    return total


def run_metrics(
    trace: RunTrace,
    records: Sequence[Mapping[str, Any]],
    costs: Mapping[str, CostModel | str],
    rates: Throughput,
    piece_starts: Sequence[int] | None = None,
) -> dict[str, Any]:
    """All figures of one run (flat dict of numbers, plus ``graphs``, ``stall_gaps`` and
    ``gap_between``).

    Args:
        piece_starts: sample offsets where the server's pieces start (:func:`piece_starts_of`);
            None leaves the inside / between split of the pauses unknown (None figures).
    """
    starts_s = (None if piece_starts is None
                else [n / trace.sample_rate_hz for n in piece_starts])
    playback = simulate_playback([(t, n / trace.sample_rate_hz) for t, n in trace.chunks],
                                 piece_starts_s=starts_s)
    audio_s = trace.audio_s
    first = trace.first_chunk_s
    graphs = graph_summary(records, costs, rates)
    min_s = minimum_seconds(graphs)
    first_min_s = None
    if first is not None:
        early = graph_summary(records, costs, rates, until_wall_s=trace.wall_start_s + first)
        first_min_s = minimum_seconds(early)
    metrics: dict[str, Any] = {
        "first_chunk_s": first,
        "total_s": trace.total_s,
        "audio_s": audio_s,
        "rtf": trace.total_s / audio_s if audio_s > 0 else None,
        "stalls": playback.stalls,
        "stall_s": playback.stall_s,
        "inside_stalls": playback.inside_stalls,
        "inside_stall_s": playback.inside_stall_s,
        "between_stalls": playback.between_stalls,
        "between_stall_s": playback.between_stall_s,
        "listening_s": playback.listening_s,
        "pieces": None if piece_starts is None else len(piece_starts),
        "fp32_gops": sum(g["fp32_ops"] for g in graphs.values()) / 1e9,
        "int8_gops": sum(g["int8_ops"] for g in graphs.values()) / 1e9,
        "min_s": min_s,
        "physical_ratio": trace.total_s / min_s if min_s > 0 else None,
        "first_chunk_min_s": first_min_s,
        "first_chunk_physical_ratio": (first / first_min_s
                                       if first is not None and first_min_s else None),
        "server_requests": len(records),
        "error": trace.error,
    }
    metrics.update(stage_split(records))
    stages = stage_summary(records, costs, rates)
    for stage, row in stages.items():  # flat, for the medians
        metrics[f"{stage}_min_s"] = row["min_s"]
        metrics[f"{stage}_ratio"] = row["ratio"]
    metrics["stages_min_s"] = sum(float(row["min_s"] or 0.0) for row in stages.values())
    metrics["stages"] = stages
    metrics["graphs"] = graphs
    metrics["stall_gaps"] = playback.gaps
    metrics["gap_between"] = playback.gap_between
    return metrics


def medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Median of every numeric top-level figure over ``runs`` (None when no run has it)."""
    keys = [k for k, v in (runs[0].items() if runs else [])
            if isinstance(v, (int, float)) or v is None]
    out: dict[str, float | None] = {}
    for key in keys:
        values = [float(r[key]) for r in runs
                  if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        out[key] = statistics.median(values) if values else None
    out["n"] = float(len(runs))
    return out


def median_run_index(runs: Sequence[Mapping[str, Any]], key: str = "total_s") -> int:
    """Index of the run whose ``key`` is the median (lower median for even counts)."""
    order = sorted(range(len(runs)), key=lambda i: float(runs[i].get(key) or 0.0))
    return order[(len(order) - 1) // 2]
