"""Timeline PNGs: per workload, one panel per preset showing its median run.

Lanes (top to bottom): the server's stages as bars over time (text frontend from the engine's
stage events; LLM, flow and vocoder from the graph runs themselves, so work that overlaps in
threads shows as overlapping bars), the ``audio-chunk`` arrivals at the client as ticks, and
the simulated player (green while playing; while stalled red when the pause falls inside a
piece and amber when it falls between two pieces, grey when the pieces are unknown). Time 0 is
the moment the request was sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STAGES = ("frontend", "llm", "flow", "vocoder")
COLORS = {"frontend": "#9467bd", "llm": "#1f77b4", "flow": "#ff7f0e", "vocoder": "#2ca02c"}
PAUSE_COLORS = {"inside": "#d62728", "between": "#f2b134", "unknown": "#7f7f7f"}
"""Player lane colours of a stall by where it falls (:mod:`.player`)."""
LANES = (*STAGES, "audio-chunk", "player")


MERGE_GAP_S = 0.01
"""Graph runs closer than this are drawn as one bar."""


def lane_of(graph_file: str) -> str:
    """Timeline lane of a graph file (contract names; derived int8 files included)."""
    if graph_file.startswith(("llm", "speech_embedding", "text_embedding")):
        return "llm"
    if graph_file.startswith(("flow_encoder", "flow.decoder.estimator")):
        return "flow"
    if graph_file.startswith("hift"):
        return "vocoder"
    return "other"


def graph_lanes(trace_start_wall_s: float, records: Sequence[Mapping[str, Any]]
                ) -> list[tuple[str, float, float]]:
    """The records' graph runs as (lane, start_s, end_s) relative to the request, runs of one
    lane closer than :data:`MERGE_GAP_S` merged (LLM steps become one bar per stretch)."""
    runs: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        for graph_file, _shapes, start, end in record.get("graph_runs", []):
            runs.setdefault(lane_of(graph_file), []).append(
                (float(start) - trace_start_wall_s, float(end) - trace_start_wall_s))
    out = []
    for lane, spans in runs.items():
        spans.sort()
        current = list(spans[0])
        for start, end in spans[1:]:
            if start - current[1] <= MERGE_GAP_S:
                current[1] = max(current[1], end)
            else:
                out.append((lane, current[0], current[1]))
                current = [start, end]
        out.append((lane, current[0], current[1]))
    return out


def timeline_of(trace_start_wall_s: float, records: Sequence[Mapping[str, Any]]
                ) -> list[tuple[str, float, float]]:
    """Engine stage events of the records as (stage, start_s, end_s) relative to the request
    (used for the text frontend; model work is drawn from :func:`graph_lanes`)."""
    out = []
    for record in records:
        offset = float(record["wall_start_s"]) - trace_start_wall_s
        for stage, start_s, end_s in record.get("times", {}).get("events", []):
            out.append((str(stage), offset + float(start_s), offset + float(end_s)))
    return out


def pause_spans(gaps: Sequence[Sequence[float]], between: Sequence[bool]
                ) -> dict[str, list[tuple[float, float]]]:
    """Stalls ``(start_s, end_s)`` as ``(start_s, length_s)`` bars per kind: ``inside`` /
    ``between`` pieces (``between`` holds one flag per gap), or all ``unknown`` when
    ``between`` does not match ``gaps``."""
    out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in PAUSE_COLORS}
    known = len(between) == len(gaps)
    for k, (start_s, end_s) in enumerate(gaps):
        kind = ("between" if between[k] else "inside") if known else "unknown"
        out[kind].append((float(start_s), float(end_s) - float(start_s)))
    return out


def plot_workload(path: Path, title: str, panels: Sequence[Mapping[str, Any]]) -> None:
    """Write one PNG.

    Args:
        path: output file (.png).
        title: figure title (workload and mode).
        panels: one per preset: ``{"label", "stages": [(stage, start, end)], "chunks":
            [(arrival_s, samples)], "rate", "play": (start, end) | None, "gaps": [(a, b)],
            "gap_between": [bool per gap] (empty: unknown), "subtitle"}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 0.6 + 1.9 * len(panels)),
                             squeeze=False)
    end = max([1.0] + [p["play"][1] for p in panels if p.get("play")]
              + [e for p in panels for _, _, e in p["stages"]])
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        rows = {lane: i for i, lane in enumerate(reversed(LANES))}
        for stage, start_s, end_s in panel["stages"]:
            if stage in rows:
                ax.broken_barh([(start_s, max(end_s - start_s, end * 1e-3))],
                               (rows[stage] - 0.4, 0.8), color=COLORS.get(stage, "grey"))
        arrivals = [t for t, n in panel["chunks"] if n > 0]
        if arrivals:
            ax.vlines(arrivals, rows["audio-chunk"] - 0.4, rows["audio-chunk"] + 0.4,
                      color="black", linewidth=0.5)
        play = panel.get("play")
        if play:
            ax.broken_barh([(play[0], play[1] - play[0])], (rows["player"] - 0.4, 0.8),
                           color="#8fd18f")
            for kind, gaps in pause_spans(panel.get("gaps", []),
                                          panel.get("gap_between", [])).items():
                if gaps:
                    ax.broken_barh(gaps, (rows["player"] - 0.4, 0.8), color=PAUSE_COLORS[kind])
        ax.set_yticks(list(rows.values()), list(rows.keys()), fontsize=8)
        ax.set_xlim(0, end * 1.02)
        ax.set_title(f"{panel['label']}: {panel.get('subtitle', '')}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the request was sent")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
