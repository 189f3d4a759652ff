"""From raw measurements (``raw.json`` + the servers' stats files) to per-cell figures.

Kept apart from the collection so a finished benchmark can be analysed again
(``--report-only``) after a change to the counting or the tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .costmodel import load_cost_models
from .plot import graph_lanes
from .run_helpers import read_records
from .server import VOICE_NAME
from .stats import (
    RunTrace,
    graph_summary,
    median_run_index,
    medians,
    minimum_seconds,
    piece_starts_of,
    records_in_window,
    run_metrics,
)
from .throughput import Throughput


def analyse(raw: Mapping[str, Any], out_dir: Path) -> dict[str, Any]:
    """Figures of every run, medians per (preset, workload, mode), server summaries.

    Args:
        raw: the collected measurements (see ``cli._collect``).
        out_dir: where the servers' stats files and the FLOP-count cache are.
    """
    samples = raw["rates"].get("samples") or [raw["rates"]["start"], raw["rates"]["end"]]
    rates = Throughput(**samples[0])
    for sample in samples[1:]:
        rates = Throughput.best(rates, Throughput(**sample))
    records_by_preset = {s["preset"]: read_records(out_dir / s["stats_file"])
                         for s in raw["servers"]}
    graph_paths = {name: Path(path) for records in records_by_preset.values()
                   for r in records for name, path in r.get("graph_paths", {}).items()}
    costs = load_cost_models(graph_paths, out_dir / "flop-cache.json")
    servers, cells = [], []
    for server in raw["servers"]:
        records = records_by_preset[server["preset"]]
        voice = [r for r in records if r.get("kind") == "voice" and r.get("name") == VOICE_NAME]
        voice_graphs = graph_summary(voice, costs, rates)
        summary = {k: v for k, v in server.items() if k != "traces"}
        summary["feature_extraction_s"] = voice[0]["total_s"] if voice else None
        summary["feature_extraction_min_s"] = minimum_seconds(voice_graphs)
        summary["feature_extraction_graphs"] = voice_graphs
        servers.append(summary)
        traces = [RunTrace(**t) for t in server["traces"]]
        keys = list(dict.fromkeys((t.workload, t.mode) for t in traces))
        for workload, mode in keys:
            runs = []
            for trace in (t for t in traces if (t.workload, t.mode) == (workload, mode)):
                window = records_in_window(records, trace.wall_start_s,
                                           trace.wall_start_s + trace.total_s)
                metrics = run_metrics(trace, window, costs, rates,
                                      piece_starts=piece_starts_of(trace, records))
                metrics["trace"] = {"wall_start_s": trace.wall_start_s, "chunks": trace.chunks,
                                    "rate": trace.sample_rate_hz}
                metrics["records"] = [{k: v for k, v in r.items() if k != "graph_runs"}
                                      for r in window]
                metrics["lanes"] = graph_lanes(trace.wall_start_s, window)
                runs.append(metrics)
            cells.append({"preset": server["preset"], "workload": workload, "mode": mode,
                          "runs": runs, "median": medians(runs),
                          "median_run": median_run_index(runs)})
    return {
        **{k: v for k, v in raw.items() if k not in ("servers", "rates")},
        "rates": {**raw["rates"], "used": rates.to_json()},
        "cost_models": {k: v if isinstance(v, str) else v.to_json() for k, v in costs.items()},
        "servers": servers,
        "cells": cells,
    }
