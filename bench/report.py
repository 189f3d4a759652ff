"""Benchmark outputs: machine description, markdown tables, the BENCHMARKS.md section.

The generated markdown lives between ``<!-- bench:LABEL:begin -->`` and
``<!-- bench:LABEL:end -->`` in BENCHMARKS.md, so hand-written text around it survives a
re-run and several labels (full model, tiny smoke) can coexist.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TARGETS = {
    # project targets on the 2-core reference machine: first audio (60-char sentence),
    # streaming RTF (30 s paragraph), stalls, steady RSS in GB
    "quality": (15.0, 7.0, None, 2.5),
    "balanced": (2.0, 1.0, 0, 1.5),
    "fast": (1.0, 0.7, 0, 1.2),
}


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, memory, library versions and load average."""
    import numpy
    import onnxruntime

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    physical = None
    memory_gb = None
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
        memory_gb = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "memory_gb": memory_gb,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def results_table(cells: Sequence[Mapping[str, Any]]) -> str:
    """One row per (preset, workload, mode) with the median figures.

    What a listener hears: the stalls (n / s) split into pauses inside a piece (they break a
    word) and between pieces (they sound like a breath; "-" when the server did not report its
    pieces), and the listening time (request to last sample: first audio + audio + pauses).
    """
    head = ("| preset | workload | mode | n | first chunk s | total s | audio s | RTF | "
            "stalls (n / s) | pauses inside pieces (n / s) | pauses between pieces (n / s) | "
            "listening s | LLM prefill s | decode ms/token | flow s/chunk (chunks) | "
            "vocoder s | min s | physical ratio | first-chunk ratio |")
    lines = [head, "|" + "---|" * 19]
    for cell in cells:
        m = cell["median"]
        lines.append(
            f"| {cell['preset']} | {cell['workload']} | {cell['mode']} | {int(m['n'])} | "
            f"{_f(m['first_chunk_s'])} | {_f(m['total_s'])} | {_f(m['audio_s'])} | "
            f"{_f(m['rtf'])} | {_f(m['stalls'], 1)} / {_f(m['stall_s'])} | "
            f"{_f(m.get('inside_stalls'), 1)} / {_f(m.get('inside_stall_s'))} | "
            f"{_f(m.get('between_stalls'), 1)} / {_f(m.get('between_stall_s'))} | "
            f"{_f(m.get('listening_s'))} | "
            f"{_f(m['llm_prefill_s'], 3)} | {_f(m['llm_ms_per_token'], 1)} | "
            f"{_f(m['flow_s_per_chunk'])} ({_f(m['flow_calls'], 0)}) | {_f(m['vocoder_s'])} | "
            f"{_f(m['min_s'])} | {_f(m['physical_ratio'], 1)} | "
            f"{_f(m['first_chunk_physical_ratio'], 1)} |"
        )
    return "\n".join(lines)


STAGE_LABELS = {"llm_prefill": "LLM prefill", "llm_decode": "LLM decode", "flow": "flow",
                "vocoder": "vocoder"}


def stages_table(cells: Sequence[Mapping[str, Any]]) -> str:
    """Per cell and stage: measured seconds (the engine's stage times) / the stage's minimum at
    the measured peak rates (ratio); the whole answer: request seconds / its minimum (stages
    may overlap, :func:`.stats.minimum_seconds`) and the sum of the stages' minima (one after
    another). Medians of each figure over the runs."""
    head = ("| preset | workload | mode | "
            + " | ".join(f"{label} s: measured / min (ratio)" for label in STAGE_LABELS.values())
            + " | whole answer s: measured / min (ratio) | sum of stage minima s |")
    lines = [head, "|" + "---|" * (3 + len(STAGE_LABELS) + 2)]
    for cell in cells:
        m = cell["median"]
        stages = " | ".join(
            f"{_f(m.get(f'{stage}_s'))} / {_f(m.get(f'{stage}_min_s'))} "
            f"({_f(m.get(f'{stage}_ratio'), 1)})" for stage in STAGE_LABELS)
        lines.append(
            f"| {cell['preset']} | {cell['workload']} | {cell['mode']} | {stages} | "
            f"{_f(m.get('total_s'))} / {_f(m.get('min_s'))} ({_f(m.get('physical_ratio'), 1)}) "
            f"| {_f(m.get('stages_min_s'))} |")
    return "\n".join(lines)


def servers_table(servers: Sequence[Mapping[str, Any]]) -> str:
    """One row per preset: load time, feature extraction, memory."""
    lines = ["| preset | load + warm-up s | feature extraction s (5 s clip; min s) | "
             "peak RSS GB | steady RSS GB |", "|---|---|---|---|---|"]
    for s in servers:
        lines.append(
            f"| {s['preset']} | {_f(s['load_s'], 1)} | {_f(s.get('feature_extraction_s'))} "
            f"({_f(s.get('feature_extraction_min_s'), 3)}) | "
            f"{_f(s['peak_rss_bytes'] / 1e9)} | {_f(s['steady_rss_bytes'] / 1e9)} |"
        )
    return "\n".join(lines)


def _cell(cells: Sequence[Mapping[str, Any]], preset: str, workload: str, mode: str
          ) -> Mapping[str, Any] | None:
    return next((c["median"] for c in cells if (c["preset"], c["workload"], c["mode"])
                 == (preset, workload, mode)), None)


def targets_table(cells: Sequence[Mapping[str, Any]], servers: Sequence[Mapping[str, Any]]
                  ) -> str:
    """The project's targets next to the measured medians.

    First audio is the one-shot sentence: in the streaming cell the client's own text pacing
    (deltas every ``--delta-interval-s``) is part of the wait.
    """
    lines = ["| preset | first audio, sentence one-shot (target) | "
             "streaming RTF, paragraph (target) | "
             "stalls, paragraph streaming (target) | steady RSS GB (target) |",
             "|---|---|---|---|---|"]
    for preset, (first_t, rtf_t, stalls_t, rss_t) in TARGETS.items():
        sentence = _cell(cells, preset, "sentence", "one-shot")
        paragraph = _cell(cells, preset, "paragraph", "streaming")
        server = next((s for s in servers if s["preset"] == preset), None)
        if sentence is None and paragraph is None:
            continue

        def mark(value: float | None, target: float | None) -> str:
            if value is None:
                return "-"
            if target is None:
                return _f(value)
            return f"{_f(value)} {'met' if value <= target else 'MISSED'}"

        rss = server["steady_rss_bytes"] / 1e9 if server else None
        lines.append(
            f"| {preset} | {mark(sentence['first_chunk_s'] if sentence else None, first_t)} "
            f"(<= {first_t:g}) | {mark(paragraph['rtf'] if paragraph else None, rtf_t)} "
            f"(<= {rtf_t:g}) | "
            f"{mark(paragraph['stalls'] if paragraph else None, stalls_t)} "
            f"({'report' if stalls_t is None else stalls_t}) | {mark(rss, rss_t)} "
            f"(<= {rss_t:g}) |"
        )
    return "\n".join(lines)


def graphs_table(graphs: Mapping[str, Mapping[str, float]]) -> str:
    """Per-graph split of one run: measured time against its physical minimum."""
    lines = ["| graph | runs | measured s | fp32 GFLOP | int8 GOP | compute-bound s | "
             "weight-streaming s | min s | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, g in sorted(graphs.items(), key=lambda kv: -kv[1]["seconds"]):
        ratio = g["seconds"] / g["min_s"] if g["min_s"] > 0 else None
        lines.append(f"| {name} | {int(g['runs'])} | {_f(g['seconds'])} | "
                     f"{_f(g['fp32_ops'] / 1e9, 1)} | {_f(g['int8_ops'] / 1e9, 1)} | "
                     f"{_f(g['compute_s'], 3)} | {_f(g['memory_s'], 3)} | "
                     f"{_f(g['min_s'], 3)} | {_f(ratio, 1)} |")
    return "\n".join(lines)


def replace_section(document: str, label: str, body: str) -> str:
    """``document`` with the section ``label`` replaced by ``body`` (appended if absent)."""
    begin, end = f"<!-- bench:{label}:begin -->", f"<!-- bench:{label}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in document and end in document:
        head, rest = document.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    return document.rstrip() + "\n\n" + block + "\n"


def update_markdown(path: Path, label: str, body: str) -> None:
    """Rewrite the ``label`` section of the markdown file ``path`` (created if missing)."""
    document = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    path.write_text(replace_section(document, label, body), encoding="utf-8")
