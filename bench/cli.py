"""``python -m bench``: benchmark the real Wyoming server, preset by preset.

For each preset: start the Wyoming server (``python -m bench.serve``: the product's server
with the benchmark's hooks) on 127.0.0.1 with the model dir and a 5 s voice prompt, send one
warm-up request, then for each workload (60-character sentence, ~30 s paragraph) and mode
(one-shot ``synthesize``, streaming text) ``--runs`` measured requests through a Wyoming
client; stop the server. The MatMul throughput of the machine is measured before the first and
after each preset (the best sample is used); operation counts come from the model's graphs.
Writes ``OUT/raw.json`` (measurements), ``OUT/results.json`` (figures),
``OUT/server-<preset>.{log,jsonl}``, timeline PNGs and the ``--label`` section of
``--markdown`` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import client, report
from .analysis import analyse
from .costmodel import load_cost_models
from .run_helpers import (
    LONG_FIRST,
    PARAGRAPH,
    SENTENCE,
    STAND_IN_TRANSCRIPT,
    build_markdown,
    cut_voice_clip,
    draw_timelines,
    read_records,
)
from .server import VOICE_NAME, ServerProcess, write_voice_catalog
from .stats import RunTrace
from .throughput import measure

_LOGGER = logging.getLogger("benchmarks")
WORKLOADS = {"sentence": SENTENCE, "paragraph": PARAGRAPH, "long-first": LONG_FIRST}
MODES = ("one-shot", "streaming")


def build_parser() -> argparse.ArgumentParser:
    from wyoming_cosyvoice3.engine.options import PRESETS

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="model directory to serve")
    p.add_argument("--voice-clip", type=Path, default=None,
                   help="WAV to cut the voice prompt from (default: MODEL_DIR/voices/en-male.wav)")
    p.add_argument("--voice-seconds", type=float, default=5.0, help="prompt length (default 5)")
    p.add_argument("--voice-transcript", default=STAND_IN_TRANSCRIPT,
                   help="transcript of the prompt (zero-shot); random weights only care "
                   "about its length")
    p.add_argument("--cross-lingual", action="store_true", help="no transcript")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    p.add_argument("--workloads", default="sentence,paragraph",
                   help="comma-separated, of sentence, paragraph, long-first (an answer "
                        "opening with a 200-character sentence)")
    p.add_argument("--modes", default=",".join(MODES), help="one-shot,streaming")
    p.add_argument("--skip-cells", default="",
                   help="WORKLOAD:MODE pairs left out, comma-separated (e.g. "
                   "paragraph:one-shot for a long preset)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per cell (default 3)")
    p.add_argument("--cell-budget-s", type=float, default=900.0,
                   help="stop repeating a cell once another run would pass this many seconds "
                   "(at least one run is always made; default 900)")
    p.add_argument("--tokens-per-char", type=float, default=25 / 15,
                   help="fixed speech tokens per character (default 25/15: 15 characters/s)")
    p.add_argument("--threads", type=int, default=0,
                   help="server --threads and microbenchmark threads (0: physical cores)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra server flag, repeatable (e.g. --server-arg=--llm-precision=fp32)")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="also serve each preset from this source tree (e.g. a worktree of "
                   "the baseline commit), alive beside this tree's server, with the measured "
                   "requests alternating between them; rows '<preset> (baseline)'")
    p.add_argument("--variant", action="append", default=[],
                   help="also serve each preset from this tree with more server flags, "
                   "LABEL:FLAGS (e.g. 'cc:--bench-synthesis-options=flow_chunk_causal=true'), "
                   "alternating like --baseline-src; rows '<preset> (LABEL)'; repeatable")
    p.add_argument("--no-restart", action="store_true",
                   help="with --baseline-src or --variant, keep every server alive for all "
                   "runs; by default they all restart once, halfway through the runs, in "
                   "the reverse start order (BENCHMARKS.md \"Which server starts first\")")
    p.add_argument("--delta-chars", type=int, default=10, help="streaming delta size")
    p.add_argument("--delta-interval-s", type=float, default=0.05, help="time between deltas")
    p.add_argument("--request-timeout-s", type=float, default=1800.0,
                   help="longest wait for one event")
    p.add_argument("--throughput-seconds", type=float, default=1.5,
                   help="timing budget per MatMul microbenchmark")
    p.add_argument("--label", default="results", help="BENCHMARKS.md section label")
    p.add_argument("--markdown", default="BENCHMARKS.md",
                   help="markdown file to update ('' to skip)")
    p.add_argument("--plots-dir", type=Path, default=Path("docs/bench"),
                   help="where timeline PNGs go (named <label>-<workload>-<mode>.png)")
    p.add_argument("--report-only", action="store_true",
                   help="only redraw plots and markdown from OUT/results.json")
    p.add_argument("--rates-file", type=Path, default=None,
                   help="with --report-only: analyse at these rate samples (the JSON list "
                   "python -m bench.throughput prints) instead of the run's own, e.g. memory "
                   "rates measured with the weights evicted for a run that measured them "
                   "cached; the run's own stay in results.json as rates.run_samples")
    p.add_argument("--debug", action="store_true")
    return p


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _threads(requested: int) -> int:
    if requested > 0:
        return requested
    try:
        import psutil

        return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return os.cpu_count() or 1


async def _request(mode: str, port: int, text: str, trace: RunTrace,
                   args: argparse.Namespace) -> RunTrace:
    if mode == "one-shot":
        return await client.one_shot("127.0.0.1", port, text, VOICE_NAME, trace,
                                     args.request_timeout_s)
    return await client.streaming("127.0.0.1", port, text, VOICE_NAME, trace,
                                  args.request_timeout_s, args.delta_chars, args.delta_interval_s)


def _servers_for(preset: str, args: argparse.Namespace,
                 data_dir: Path) -> list[tuple[str, ServerProcess]]:
    """(label, server) for ``preset``: this tree's server, then the baseline and variants."""
    extra = [*args.server_arg]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    out = args.out

    def make(label: str, tag: str, flags: list[str], source: Path | None) -> tuple[
            str, ServerProcess]:
        data = data_dir if not tag else data_dir.parent / f"data-{tag}"
        if tag:  # its own voice cache and derived files; the same voice clip
            clip = data / "bench-voice.wav"
            data.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(data_dir / "bench-voice.wav", clip)
            shutil.copyfile(data_dir / "voices.yaml", data / "voices.yaml")
        name = preset if not tag else f"{preset}-{tag}"
        return label, ServerProcess(args.model_dir, data, preset, out / f"server-{name}.jsonl",
                                    out / f"server-{name}.log", args.tokens_per_char, flags,
                                    source)

    servers = [make(preset, "", extra, None)]
    if args.baseline_src is not None:
        threads = ["--threads", str(args.threads)] if args.threads else []
        servers.append(make(f"{preset} (baseline)", "baseline", threads, args.baseline_src))
    for spec in args.variant:
        label, _, flags = spec.partition(":")
        servers.append(make(f"{preset} ({label})", label, [*extra, *shlex.split(flags)], None))
    return servers


def run_halves(runs: int, servers: int, restart: bool) -> list[range]:
    """The run indices of each life of a preset's servers: with more than one server (a
    comparison) and ``restart``, the first ``ceil(runs / 2)`` runs, then the rest after every
    server started again in the reverse order (a server started before the others ran up to 6 %
    slower for its whole life in A/A runs, BENCHMARKS.md "Which server starts first", so each
    row gets about half of its runs from either start position); otherwise all runs in one
    life."""
    if servers < 2 or not restart or runs < 2:
        return [range(runs)]
    half = (runs + 1) // 2
    return [range(half), range(half, runs)]


def _start_all(servers: Sequence[tuple[str, ServerProcess]], args: argparse.Namespace,
               again: bool) -> None:
    """Start ``servers`` one after the other (in this order), each with a warm-up request."""
    for label, server in servers:
        _LOGGER.info("[%s] starting the server%s", label, " again" if again else "")
        server.start(again=again)
        _LOGGER.info("[%s] ready in %.1f s (RSS %.2f GB); warm-up request", label,
                     server.load_s, server.rss_bytes() / 1e9)
        asyncio.run(_request("one-shot", server.port, SENTENCE,
                             RunTrace(label, "warm-up", "one-shot", 0.0), args))


def _run_preset(preset: str, args: argparse.Namespace, data_dir: Path,
                workloads: Sequence[str], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Serve ``preset`` (and its baseline/variants, alive at once, each measured request
    going to them in turn, the order rotating per run; restarted halfway in the reverse
    start order, :func:`run_halves`) and measure every cell."""
    servers = _servers_for(preset, args, data_dir)
    traces: dict[str, list[RunTrace]] = {label: [] for label, _ in servers}
    starts: dict[str, list[int]] = {label: [] for label, _ in servers}
    steady: dict[str, int] = {}
    skip = {tuple(c.split(":", 1)) for c in args.skip_cells.split(",") if c}
    cells = [(w, m) for w in workloads for m in modes if (w, m) not in skip]
    spent = dict.fromkeys(cells, 0.0)
    done = dict.fromkeys(cells, 0)
    halves = run_halves(args.runs, len(servers), not args.no_restart)
    try:
        for life, indices in enumerate(halves):
            if life:
                for _, server in servers:
                    server.stop()
            order = servers if life % 2 == 0 else servers[::-1]
            _start_all(order, args, again=life > 0)
            for position, (label, _) in enumerate(order):
                starts[label].append(position)
            for cell in cells:
                workload, mode = cell
                for index in indices:
                    # stop repeating a cell once another run would pass its budget
                    if done[cell] and spent[cell] + spent[cell] / done[cell] > args.cell_budget_s:
                        break
                    cell_start = time.monotonic()
                    turn = index % len(servers)
                    for label, server in servers[turn:] + servers[:turn]:
                        trace = RunTrace(label, workload, mode, 0.0)
                        asyncio.run(_request(mode, server.port, WORKLOADS[workload], trace,
                                             args))
                        traces[label].append(trace)
                        _LOGGER.info("[%s] %s %s run %d: first chunk %s s, total %.2f s, "
                                     "audio %.2f s%s", label, workload, mode, index + 1,
                                     f"{trace.first_chunk_s:.2f}" if trace.first_chunk_s
                                     else "-", trace.total_s, trace.audio_s,
                                     f", error: {trace.error}" if trace.error else "")
                    spent[cell] += time.monotonic() - cell_start
                    done[cell] += 1
        steady = {label: server.rss_bytes() for label, server in servers}
    finally:
        for _, server in servers:
            server.stop()
    return [{
        "preset": label,
        "load_s": server.load_s,
        "peak_rss_bytes": server.peak_rss_bytes,
        "steady_rss_bytes": steady.get(label, 0),
        "stats_file": server.stats_file.name,
        "start_positions": starts[label],
        "traces": [dataclasses.asdict(t) for t in traces[label]],
        "command": shlex.join(server.command()),
        **({"source_dir": str(server.source_dir)} if server.source_dir is not None else {}),
    } for label, server in servers]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    raw_file = args.out / "raw.json"
    if args.report_only:
        raw = json.loads(raw_file.read_text(encoding="utf-8"))
        if args.rates_file is not None:
            samples = json.loads(args.rates_file.read_text(encoding="utf-8"))
            raw["rates"] = {"samples": samples if isinstance(samples, list) else [samples],
                            "run_samples": raw["rates"].get("samples"),
                            "from": str(args.rates_file)}
    else:
        presets = [p for p in args.presets.split(",") if p]
        workloads = [w for w in args.workloads.split(",") if w]
        modes = [m for m in args.modes.split(",") if m]
        unknown = ([w for w in workloads if w not in WORKLOADS]
                   + [m for m in modes if m not in MODES])
        if unknown or args.runs < 1:
            print(f"unknown workloads/modes {unknown} or --runs < 1", file=sys.stderr)
            return 2
        raw = _collect(args, argv, presets, workloads, modes)
        raw_file.write_text(json.dumps(raw, indent=1), encoding="utf-8")
    result = analyse(raw, args.out)
    (args.out / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    plots = draw_timelines(result["cells"], args.plots_dir, args.label)
    if args.markdown:
        markdown = Path(args.markdown)
        body = build_markdown(result, plots, markdown.parent)
        report.update_markdown(markdown, args.label, body)
    print(report.results_table(result["cells"]))
    _LOGGER.info("results in %s", args.out)
    return 0


def _collect(args: argparse.Namespace, argv: Sequence[str], presets: Sequence[str],
             workloads: Sequence[str], modes: Sequence[str]) -> dict[str, Any]:
    """Run everything; return the raw measurements (``raw.json``)."""
    started = time.monotonic()
    machine = report.machine_info()
    data_dir = args.out / "data"
    clip = cut_voice_clip(args.voice_clip or args.model_dir / "voices" / "en-male.wav",
                          data_dir / "bench-voice.wav", args.voice_seconds)
    write_voice_catalog(data_dir, clip, None if args.cross_lingual else args.voice_transcript)
    threads = _threads(args.threads)
    _LOGGER.info("measuring MatMul throughput (%d threads)", threads)
    samples = [measure(threads, args.throughput_seconds).to_json()]
    loads = [_load_average()]
    servers = []
    for preset in presets:  # measured again after each preset: the best sample is used
        ran = _run_preset(preset, args, data_dir, workloads, modes)
        servers += ran
        # count the graphs these servers ran now, while derived files surely exist (cached)
        records = [r for server in ran for r in read_records(args.out / server["stats_file"])]
        load_cost_models({name: Path(path) for r in records
                          for name, path in r.get("graph_paths", {}).items()},
                         args.out / "flop-cache.json")
        loads.append(_load_average())
        samples.append(measure(threads, args.throughput_seconds).to_json())
    machine["load_average_end"] = loads[-1]
    machine["load_average_samples"] = loads
    return {
        "command": "python -m bench " + shlex.join(argv),
        "machine": machine,
        "elapsed_s": time.monotonic() - started,
        "rates": {"samples": samples},
        "tokens_per_char": args.tokens_per_char,
        "texts": {w: WORKLOADS[w] for w in workloads},
        "servers": servers,
    }
