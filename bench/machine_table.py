"""The cost table of ``--preset auto`` (``engine/machine.py`` ``STAGE_WORK``, ``LLM_WORK``), and
its check.

Both read the probe the benchmarked server ran at start (its log line ``machine probe:``, the
rates and the LLM forms' product times of :func:`~wyoming_cosyvoice3.engine.machine.
probe_rates`, and ``LLM graphs for``: the graphs it chose), so prediction and measurement come
from the same machine in the same hour.

``table``: per preset, the flow's and vocoder's work per second of audio of the streamed
paragraph (operations and int8 weight bytes of every graph run, counted with the cost models
of the **full-size** graphs, :mod:`.costmodel`) and the LLM's decoded tokens and prefilled
positions per audio second, with each stage's efficiency (measured stage seconds / seconds at
the probe's rates or product times) from a full-size benchmark run (``--efficiency``; each
preset's own factors when it ran there). The
graph runs come from a benchmark output directory (``--shapes``): best the same full-size run.
Input shapes depend only on the text, the voice prompt, the preset's schedule and how the
server cut the text into pieces, so a run on the ``tiny`` synthetic model stands in for
the full-size model: with the standard streamed paragraph it keeps up with the stream as a
machine faster than playback does (the table of ``server/machine.py``); ``--delta-chars
2000`` (the whole text at once) gives the 80-token pieces of a slow server without the piece
bound, ``--delta-interval-s 0.3`` sentence pieces like the bound of a machine at about half
playback speed (``preroll.piece_limit_s``, which does not act on the fast tiny model). The
streamed vocoder graph is counted as the benchmark counts it (its own cost model,
:func:`.costmodel.fit_streamed_vocoder`, from the efficiency run's ``flop-cache.json``; when
that has none, as ``hift.onnx`` over the same new mel frames with its fixed part once per
utterance, which leaves out the streamed graph's small fixed work per call); the windowed
``hift`` forms as ``hift.onnx`` over their frames. The fp32
streaming DiT of ``quality`` is counted
as the int8 one with every operation in fp32 (the int8 derivation swaps MatMul for the int8
pattern with the same multiply-accumulates).

``check``: each server's predicted RTF (``server/machine.py`` at the run's measured rates)
next to its measured streamed-paragraph RTF.

::

    python -m bench.machine_table table --shapes SHAPES_OUT \\
        --efficiency FULL_OUT --model-dir MODEL_DIR
    python -m bench.machine_table check OUT
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wyoming_cosyvoice3.engine.machine import (
    PREDICTION_ERROR,
    STAGE_WORK,
    LlmPlan,
    MachineRates,
    StageSplit,
    StageWork,
    predict_split,
)

from .costmodel import STAGES, CostModel, load_cost_models, stage_of
from .run_helpers import read_records
from .stats import RunTrace, records_in_window

_STAGE_TIME = {"llm_prefill": "llm_prefill_s", "llm_decode": "llm_decode_s", "flow": "flow_s",
               "vocoder": "vocoder_s"}


def _full_model(graph_file: str, costs: Mapping[str, CostModel]) -> CostModel | None:
    """The full-size cost model standing for ``graph_file`` (module doc)."""
    if graph_file.startswith("llm"):
        return costs.get("llm")
    if graph_file.startswith("flow_encoder"):
        return costs.get("flow_encoder")
    if graph_file.startswith("hift.stream"):
        return costs.get("hift_stream")
    if graph_file.startswith("hift"):
        return costs.get("hift")
    if graph_file.startswith("flow.decoder.estimator.stream"):
        return costs.get("dit_int8" if "int8" in graph_file else "dit_fp32")
    return None


def full_costs(model_dir: Path, efficiency_dir: Path) -> dict[str, CostModel]:
    """Full-size cost models: the benchmark run's cached fits (fused LLM, int8 streaming DiT,
    flow encoder, streamed vocoder) and hift.onnx of ``model_dir``; the fp32 DiT from the int8
    one; without a streamed vocoder fit, :func:`streamed_as_one_call`."""
    cache = json.loads((efficiency_dir / "flop-cache.json").read_text(encoding="utf-8"))
    out: dict[str, CostModel] = {}
    for key, data in cache.items():
        name = key.split(":", 1)[0]
        model = CostModel.from_json(data)
        if name.startswith("llm"):
            out["llm"] = model
        elif name.startswith("flow.decoder.estimator.stream") and "int8" in name:
            out["dit_int8"] = model
        elif name.startswith("flow_encoder"):
            out["flow_encoder"] = model
        elif name.startswith("hift.stream"):
            out["hift_stream"] = model
    hift = load_cost_models({"hift.onnx": model_dir / "hift.onnx"},
                            efficiency_dir / "flop-cache-hift.json")["hift.onnx"]
    if not isinstance(hift, CostModel):
        raise SystemExit(f"hift.onnx of {model_dir} could not be counted: {hift}")
    out["hift"] = hift
    if "hift_stream" not in out:
        print(f"# no streamed vocoder fit in {efficiency_dir}/flop-cache.json (re-analyse it: "
              "python -m bench --report-only): counted as hift.onnx over its frames",
              file=sys.stderr)
        out["hift_stream"] = streamed_as_one_call(hift)
    dit = out["dit_int8"]
    out["dit_fp32"] = CostModel(
        dit.family, tuple(a + b for a, b in zip(dit.fp32_coef, dit.int8_coef, strict=True)),
        tuple(0.0 for _ in dit.int8_coef), 0, dit.weight_bytes_fp32 + 4 * dit.weight_bytes_int8,
        0)
    return out


def streamed_as_one_call(hift: CostModel) -> CostModel:
    """A streamed vocoder cost model (basis 1, first, F) from hift.onnx's (1, F, F^2): each
    call its frames' share of one call, the fixed part on an utterance's first call (the
    streamed graph's own fixed work per call left out; :mod:`.costmodel`)."""
    return CostModel("hift_stream", (0.0, hift.fp32_coef[0], hift.fp32_coef[1]),
                     (0.0, hift.int8_coef[0], hift.int8_coef[1]), 0, hift.weight_bytes_fp32,
                     hift.weight_bytes_int8)


def paragraph_runs(out_dir: Path) -> dict[str, tuple[RunTrace, list[Mapping[str, Any]]]]:
    """Preset -> (trace, server records) of its first streamed paragraph run in ``out_dir``."""
    raw = json.loads((out_dir / "raw.json").read_text(encoding="utf-8"))
    found = {}
    for server in raw["servers"]:
        records = read_records(out_dir / server["stats_file"])
        for data in server["traces"]:
            trace = RunTrace(**data)
            if (trace.workload, trace.mode) == ("paragraph", "streaming"):
                window = records_in_window(records, trace.wall_start_s,
                                           trace.wall_start_s + trace.total_s)
                found[server["preset"]] = (trace, window)
                break
    return found


def stage_work(records: Sequence[Mapping[str, Any]], costs: Mapping[str, CostModel],
               ) -> dict[str, list[float]]:
    """Stage -> [fp32 ops, int8 ops, int8 weight bytes] summed over the graph runs."""
    work = {stage: [0.0, 0.0, 0.0] for stage in STAGES}
    for record in records:
        for graph_file, shapes, _start, _end in record.get("graph_runs", []):
            stage = stage_of(graph_file, shapes)
            model = _full_model(graph_file, costs)
            if stage is None or model is None:
                continue
            ops = model.ops(shapes)
            work[stage][0] += ops.fp32
            work[stage][1] += ops.int8
            work[stage][2] += model.weight_bytes_int8
    return work


_PROBE_LINE = re.compile(r"machine probe: (\{.*\})\s*$")
_PLAN_LINE = re.compile(r"LLM graphs for `[\w-]+`: ([\w-]+)(?:, prefill ([\w-]+))? \(")
_SPLIT_LINE = re.compile(r"split cores: LLM sessions")
_TIMED_LINE = re.compile(r"LLM decode step timed at load .*; ([\w-]+) decodes$")


def server_probes(out_dir: Path) -> dict[str, tuple[MachineRates, LlmPlan, bool]]:
    """Server label (``results.json``'s preset column) -> the probe it ran at start, its
    LLM graphs (the decode graph as the engine's timed steps chose it, when they ran) and
    whether it decoded beside the flow (its log's ``split cores:`` line), read from its log
    (servers without the probe's and the graphs' lines are left out)."""
    raw = json.loads((out_dir / "raw.json").read_text(encoding="utf-8"))
    found = {}
    for server in raw["servers"]:
        log = out_dir / Path(server["stats_file"]).with_suffix(".log").name
        rates = plan = None
        split = False
        if log.is_file():
            for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
                if (match := _PROBE_LINE.search(line)) is not None:
                    rates = MachineRates.from_json(json.loads(match[1]))
                elif (match := _PLAN_LINE.search(line)) is not None:
                    plan = LlmPlan(match[1], match[2])  # type: ignore[arg-type]
                elif _SPLIT_LINE.search(line) is not None:
                    split = True
                elif (match := _TIMED_LINE.search(line)) is not None and plan is not None:
                    # the engine's timed steps chose the decode graph among the plan's
                    prefill = plan.prefill_graph if match[1] != plan.prefill_graph else None
                    plan = LlmPlan(match[1], prefill)  # type: ignore[arg-type]
        if rates is not None and plan is not None:
            found[server["preset"]] = (rates, plan, split)
    return found


def llm_counts(records: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(decoded tokens, prefilled positions) of the LLM graph runs in ``records``."""
    tokens = positions = 0
    for record in records:
        for graph_file, shapes, _start, _end in record.get("graph_runs", []):
            if graph_file.startswith("llm"):
                n = int(shapes["inputs_embeds"][1])
                tokens, positions = (tokens + 1, positions) if n == 1 else (tokens, positions + n)
    return tokens, positions


def efficiencies(efficiency_dir: Path, costs: Mapping[str, CostModel],
                 ) -> dict[str, dict[str, float]]:
    """Preset -> stage -> measured stage seconds (the engine's StageTimes) / seconds at the
    probe the server ran (its rates for the flow and vocoder, its LLM graphs' product times
    for the LLM), for every preset with a streamed paragraph run and a logged probe in
    ``efficiency_dir`` (a full-size run)."""
    probes = server_probes(efficiency_dir)
    out: dict[str, dict[str, float]] = {}
    for preset, (_trace, records) in paragraph_runs(efficiency_dir).items():
        if preset not in probes:
            continue
        rates, plan, split = probes[preset]
        if split:  # stages sharing the cores: their seconds are not the stage's alone
            continue
        work = stage_work(records, costs)
        tokens, positions = llm_counts(records)
        for stage in STAGES:
            measured = sum(float(r.get("times", {}).get(_STAGE_TIME[stage], 0.0))
                           for r in records)
            if stage == "llm_decode" and rates.llm is not None:
                at_probe = tokens * rates.llm.decode_s[plan.decode]
            elif stage == "llm_prefill" and rates.llm is not None:
                at_probe = positions * rates.llm.prefill_s[plan.prefill_graph]
            else:
                dit = STAGE_WORK.get(preset, {}).get(stage)
                at_probe = StageWork(work[stage][0], work[stage][1], work[stage][2], 1.0,
                                     fp32_dit=dit is not None and dit.fp32_dit,
                                     ).seconds_per_audio_s(rates) / 1e9
            if at_probe > 0:
                out.setdefault(preset, {})[stage] = measured / at_probe
    return out


def _efficiency(factors: Mapping[str, Mapping[str, float]], preset: str, stage: str,
                fp32_dit: float) -> tuple[float, str]:
    """A preset's own factor when its run is there; else the other presets' (the same LLM
    and vocoder graphs; `fast` and `balanced` the same int8 DiT) or, for `quality`'s fp32
    DiT, ``fp32_dit``."""
    if stage in factors.get(preset, {}):
        return factors[preset][stage], preset
    if preset == "quality" and stage == "flow":
        return fp32_dit, "--fp32-dit-efficiency"
    for other in ("balanced", "fast", "quality"):
        if stage in factors.get(other, {}) and not (other == "quality" and stage == "flow"):
            return factors[other][stage], other
    return 1.0, "none"


def table(args: argparse.Namespace) -> int:
    costs = full_costs(args.model_dir, args.efficiency)
    factors = efficiencies(args.efficiency, costs)
    for preset, stages in factors.items():
        print(f"# efficiency of {preset} in {args.efficiency}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    for preset, (trace, records) in sorted(paragraph_runs(args.shapes).items()):
        audio_s = trace.audio_s
        work = stage_work(records, costs)
        tokens, positions = llm_counts(records)
        print(f"    {preset!r}: {{  # {audio_s:.2f} s of audio, "
              f"{sum(len(r.get('graph_runs', [])) for r in records)} graph runs; LLM "
              f"{tokens / audio_s:.2f} tokens and {positions / audio_s:.2f} prefilled "
              "positions per audio second")
        for stage in ("flow", "vocoder"):
            fp32, int8, stream = (v / audio_s / 1e9 for v in work[stage])
            eff, source = _efficiency(factors, preset, stage, args.fp32_dit_efficiency)
            dit = STAGE_WORK.get(preset, {}).get(stage)
            dit_arg = ", fp32_dit=True" if dit is not None and dit.fp32_dit else ""
            print(f"        {stage!r}: StageWork({fp32:.4g}, {int8:.4g}, {stream:.4g}, "
                  f"{eff:.3f}{dit_arg}),  # efficiency of {source}")
        print("    },")
        for stage in ("llm_decode", "llm_prefill"):
            eff, source = _efficiency(factors, preset, stage, args.fp32_dit_efficiency)
            print(f"    # {preset} {stage} efficiency {eff:.3f} (of {source})")
    return 0


def fitting_overlap(parts: StageSplit, measured_rtf: float) -> float:
    """The ``SPLIT_OVERLAP`` with which ``parts`` would predict ``measured_rtf`` exactly:
    (measured - the longer kind) / the shorter kind."""
    longer, shorter = max(parts.llm_s, parts.stages_s), min(parts.llm_s, parts.stages_s)
    return (measured_rtf - longer) / shorter


def check(args: argparse.Namespace) -> int:
    """Predicted (at the probe each server logged at start) against measured
    streamed-paragraph RTF per server."""
    results = json.loads((args.out / "results.json").read_text(encoding="utf-8"))
    probes = server_probes(args.out)
    print("| server | probe | LLM graphs | LLM / flow + vocoder predicted | predicted RTF | "
          f"measured RTF (median, n) | predicted / measured | within {PREDICTION_ERROR:.0%} | "
          "overlap that fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in results["cells"]:
        if (cell["workload"], cell["mode"]) != ("paragraph", "streaming"):
            continue
        preset = cell["preset"].split(" ", 1)[0]
        if preset not in STAGE_WORK or cell["preset"] not in probes:
            continue
        rtfs = [r["rtf"] for r in cell["runs"] if r.get("rtf")]
        if not rtfs:
            continue
        rates, plan, split = probes[cell["preset"]]
        measured = statistics.median(rtfs)
        parts = predict_split(rates, preset, plan)
        predicted = parts.rtf(split)
        graphs = plan.decode + (f" (prefill {plan.prefill})" if plan.prefill else "") + (
            ", split cores" if split else "")
        overlap = f"{fitting_overlap(parts, measured):.2f}" if split else "-"
        print(f"| {cell['preset']} | {rates.describe()}, {rates.threads or 'default'} threads | "
              f"{graphs} | {parts.llm_s:.2f} / {parts.stages_s:.2f} | {predicted:.2f} | "
              f"{measured:.2f} ({len(rtfs)}) | {predicted / measured:.2f} | "
              f"{'yes' if abs(predicted / measured - 1) <= PREDICTION_ERROR else 'no'} | "
              f"{overlap} |")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.machine_table",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("table", help="print STAGE_WORK for server/machine.py")
    t.add_argument("--shapes", type=Path, required=True,
                   help="benchmark output with a streamed paragraph run per preset")
    t.add_argument("--efficiency", type=Path, required=True,
                   help="full-size benchmark output (its flop-cache.json and paragraph run)")
    t.add_argument("--model-dir", type=Path, required=True, help="the full-size model")
    t.add_argument("--fp32-dit-efficiency", type=float, default=1.41,
                   help="quality's flow efficiency (default: BENCHMARKS.md 'Where the time "
                        "goes: quality', 450 s measured / 320 s at peak)")
    c = sub.add_parser("check", help="predicted against measured RTF of a benchmark run")
    c.add_argument("out", type=Path, help="benchmark output directory")
    args = parser.parse_args(argv)
    return table(args) if args.command == "table" else check(args)


if __name__ == "__main__":
    sys.exit(main())
