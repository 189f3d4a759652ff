"""Pieces of the benchmark command: workload texts, the voice clip, records, plots, markdown."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import report
from .plot import plot_workload, timeline_of

_LOGGER = logging.getLogger("benchmarks")

SENTENCE = "The living room lights are off and the front door is locked."
"""60 characters: a typical Home Assistant confirmation (about 4 s of speech)."""
PARAGRAPH = (
    "Good morning! It is seven degrees outside with light rain, so take an umbrella. "
    "Your first meeting starts at nine thirty in the small conference room. "
    "The dishwasher finished its cycle an hour ago and the washing machine will be done in "
    "twenty minutes. I turned the heating up to twenty one degrees in the living room and the "
    "kitchen. Traffic on your usual route is moderate, so leaving by eight fifteen should get "
    "you there on time. Have a nice day."
)
"""450 characters of English in six sentences (about 30 s of speech at 15 characters/s)."""
LONG_FIRST = (
    "Here is the weather for the whole day, it will be sunny in the morning with temperatures "
    "around twenty degrees, clouds will move in during the afternoon and light rain follows "
    "in the evening and at night. Have a nice day."
)
"""An answer that opens with a 200-character sentence (its first audio must come within
about 5 s, when Home Assistant's Voice PE satellite gives up)."""
STAND_IN_TRANSCRIPT = (
    "This is a short recording of my voice, used as a prompt for speech synthesis."
)
"""Transcript of the 5 s prompt: with random weights only its length (77 characters, about
what 5 s of speech holds) matters; it makes the prompt zero-shot, as with a real voice."""


def cut_voice_clip(source: Path, target: Path, seconds: float) -> Path:
    """Write the first ``seconds`` of ``source`` (mono, PCM16, same rate) to ``target``.

    A shorter clip is repeated until it is long enough.

    Raises:
        FileNotFoundError: ``source`` is missing; ValueError: it holds no audio.
    """
    import soundfile as sf

    audio, rate = sf.read(str(source), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if mono.size == 0:
        raise ValueError(f"{source} holds no audio")
    wanted = round(seconds * rate)
    if mono.size < wanted:
        _LOGGER.warning("%s is %.2f s long; repeating it to %.1f s", source, mono.size / rate,
                        seconds)
        mono = np.tile(mono, -(-wanted // mono.size))
    target.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(target), mono[:wanted], rate, subtype="PCM_16")
    return target


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a server stats file (unreadable lines are skipped)."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def draw_timelines(cells: Sequence[Mapping[str, Any]], plots_dir: Path, label: str
                   ) -> dict[str, Path]:
    """One PNG per (workload, mode) with a panel per preset (its median run)."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["workload"], cell["mode"]), []).append(cell)
    written = {}
    for (workload, mode), group in groups.items():
        panels = []
        for cell in group:
            run = cell["runs"][cell["median_run"]]
            trace = run["trace"]
            chunks = trace["chunks"]
            gaps = run["stall_gaps"]
            first = run["first_chunk_s"]
            play = (first, first + run["audio_s"] + run["stall_s"]) if first is not None else None
            rtf = f"RTF {run['rtf']:.2f}" if run["rtf"] else "no audio"
            if run.get("inside_stalls") is None:
                pauses = f"{run['stalls']} stalls ({run['stall_s']:.1f} s)"
            else:
                pauses = (f"pauses inside pieces {run['inside_stalls']} "
                          f"({run['inside_stall_s']:.1f} s), between "
                          f"{run['between_stalls']} ({run['between_stall_s']:.1f} s)")
            panels.append({
                "label": cell["preset"],
                "subtitle": f"first chunk {first or 0:.2f} s, {rtf}, {pauses}",
                "stages": [e for e in timeline_of(trace["wall_start_s"], run["records"])
                           if e[0] == "frontend"] + [tuple(x) for x in run.get("lanes", [])],
                "chunks": chunks, "play": play, "gaps": gaps,
                "gap_between": run.get("gap_between", []),
            })
        path = plots_dir / f"{label}-{workload}-{mode}.png"
        plot_workload(path, f"{workload}, {mode} (median run per preset)", panels)
        written[f"{workload}-{mode}"] = path
    return written


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path.resolve(), base.resolve())


def build_markdown(result: Mapping[str, Any], plots: Mapping[str, Path], base: Path) -> str:
    """The generated BENCHMARKS.md section for one benchmark result."""
    m = result["machine"]
    r = result["rates"]["used"]
    cells = result["cells"]
    load_start = m.get("load_average") or [0, 0, 0]
    load_end = m.get("load_average_end") or [0, 0, 0]
    lines = [
        f"Command: `{result['command']}` ({result['elapsed_s'] / 60:.1f} min).",
        "",
        f"Machine: {m['cpu']}, {m['physical_cores']} physical / {m['logical_cores']} logical "
        f"cores, {m['memory_gb']} GB RAM; Python {m['python']}, onnxruntime {m['onnxruntime']}, "
        f"numpy {m['numpy']}. Load average (1 min) {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end"
        + (f", {', '.join(f'{x[0]:.2f}' for x in m['load_average_samples'][1:] if x)} after each "
           "preset" if m.get("load_average_samples") else "")
        + " (other processes shared the CPU when it is above 0).",
        "",
        ("MatMul throughput measured in this run" if not result["rates"].get("from")
         else f"MatMul throughput from {result['rates']['from']} (measured apart from the run)")
        + f" ({r['threads']} threads, best of "
        f"{len(result['rates'].get('samples', [0, 0]))} measurements): "
        f"fp32 {r['fp32_flops'] / 1e9:.0f} GFLOP/s, int8 {r['int8_ops'] / 1e9:.0f} GOP/s "
        f"(quantize_dynamic pattern); one-row weight streaming {r['fp32_bytes'] / 1e9:.1f} GB/s "
        f"fp32, {r['int8_bytes'] / 1e9:.1f} GB/s int8"
        + (f" (weights evicted from the caches before each run: "
           f"{r['evict_bytes'] / 2**20:.0f} MiB read)" if r.get("evict_bytes")
           else " (weights cached between runs: partly a cache rate)")
        + ".",
        "",
        f"Decoding length fixed at {result['tokens_per_char']:.3f} speech tokens per character "
        "(random weights never stop sensibly). Texts: "
        + "; ".join(f"{k} ({len(v)} characters): \"{v}\"" for k, v in result["texts"].items()),
        "",
        "### Medians",
        "",
        report.results_table(cells),
        "",
        "### Measured against the minimum, per stage",
        "",
        report.stages_table(cells),
        "",
        report.servers_table(result["servers"]),
        "",
        "### Against the targets",
        "",
        report.targets_table(cells, result["servers"]),
        "",
    ]
    for cell in cells:
        if (cell["workload"], cell["mode"]) != ("paragraph", "streaming"):
            continue
        run = cell["runs"][cell["median_run"]]
        lines += [f"### Where the time goes: {cell['preset']}, paragraph, streaming "
                  "(median run)", "", report.graphs_table(run["graphs"]), ""]
    if plots:
        lines += ["### Timelines", ""]
        for key, path in plots.items():
            lines += [f"![{key}]({_rel(path, base)})", ""]
    return "\n".join(lines)
