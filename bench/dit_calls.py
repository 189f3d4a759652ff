"""The streaming DiT's calls at their compute cost: two main graphs timed call by call.

``python -m bench.dit_calls --model-dir DIR --cache-dir CACHE --baseline-main FILE
[--baseline-time FILE] [--precision int8] [--records SERVER.jsonl] [--repeats 5] [--threads 0]
[--out calls.json]``;
``python -m bench.dit_calls --model-dir DIR --cache-dir CACHE --profile 26,80,160 [--cached 250]``

The graph this tree derives (into ``--cache-dir``, when it is not there yet) and a baseline
main graph (``--baseline-main``: a main graph of the same inputs and outputs that another
tree derived, e.g. ``flow.decoder.estimator.stream4int8main-*.onnx`` from a server's engine
cache; it reads the time conditioning from ``--baseline-time``, the time graph derived beside
it, or by default from this tree's ``stream2time`` graph) run the
same call mix in one process, taking turns call by call (A, B, then B, A), on the same random
inputs: batch 2 (CFG), F new frames after M cached ones (the prompt's first 200, the rest
history), the chunk mask of frames M .. M + F - 1. The mix defaults to ``balanced``'s streamed
30 s paragraph (:data:`BALANCED_PARAGRAPH`: 224 calls, recorded by a ca8ff16 server on the
full-size synthetic model); ``--records`` reads it from a server's ``--bench-stats-file``
instead.

Printed per shape and in total (weighted by the calls of the mix): the median milliseconds of
each graph, the compute minimum of a call (its fp32 operations at the measured fp32 MatMul rate
plus its int8 operations at the int8 rate, :func:`.stats.run_bounds`, operations counted on
each graph by :mod:`.costmodel`, rates measured by :mod:`.throughput` at the start and end of
the run, the better of the two) and the ratio measured / minimum; and the largest difference
between the two graphs' velocities (relative to the baseline's largest value).

``--profile F,F,...`` instead profiles this tree's main graph with onnxruntime's profiler, one
call of F new frames after ``--cached`` ones per shape (same inputs as the timing), and prints
each operator type's kernel time per call, its share and its node count (the nodes after
onnxruntime's own fusions): where a call's time goes, without the timing's comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wyoming_cosyvoice3.engine.dit_runner import StreamingEstimator, chunk_attention_bias
from wyoming_cosyvoice3.engine.sessions import CPU_PROVIDER, Graph, GraphSpec, open_session

BALANCED_PARAGRAPH: tuple[tuple[int, int, int], ...] = (
    (26, 200, 60), (40, 226, 48), (80, 266, 24), (160, 300, 24), (44, 266, 12),
    (36, 266, 12), (24, 226, 8), (154, 300, 8), (200, 300, 8), (200, 0, 4), (36, 300, 4),
    (156, 300, 4), (110, 300, 4), (84, 300, 4),
)
"""(new frames F, cached frames M, calls) of ``balanced``'s streamed 30 s paragraph: a ca8ff16
server on the full-size synthetic model, batch 2 in every call (/work/runs/b0)."""
PROMPT_FRAMES = 200
"""Cached frames given as the prompt's (``balanced``: 103 prompt tokens, 200 cacheable
frames); the rest are history."""


def mix_of_records(path: Path) -> list[tuple[int, int, int]]:
    """(F, M, calls) of every streaming main-graph run of a server's stats file (batch 2)."""
    calls: Counter[tuple[int, int]] = Counter()
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            for graph_file, shapes, _start, _end in record.get("graph_runs", []):
                name = Path(graph_file).name
                if not (name.startswith("flow.decoder.estimator.stream") and "main" in name):
                    continue
                cached = sum(int(shapes[key][2]) for key in ("prompt_key_0", "hist_key_0")
                             if key in shapes)
                calls[(int(shapes["x"][2]), cached)] += 1
    return [(f, m, n) for (f, m), n in calls.most_common()]


def _graph(path: Path, threads: int) -> Graph:
    """The main graph as the engine opens it (arena shrunk after every run)."""
    session = open_session(path, threads, (CPU_PROVIDER,), True, memory_arena=True)
    spec = GraphSpec(path.name, {i.name: "float32" for i in session.get_inputs()},
                     {o.name: "float32" for o in session.get_outputs()})
    return Graph(path, spec, session=session, shrink_arena=True)


class Caller:
    """Feeds a main graph through the engine's runner (both graphs take this tree's
    inputs: the baseline is an earlier derivation of the same form)."""

    def __init__(self, graph: Graph, time_graph: Path) -> None:
        self.est = StreamingEstimator(graph, open_session(time_graph, 0, (CPU_PROVIDER,)))
        self.depth, self.heads, self.head_dim = (self.est.depth, self.est.heads,
                                                 self.est.head_dim)
        self.dim = self.est.dim

    def run(self, frames: dict[str, np.ndarray], t: float, start: int, bias: np.ndarray,
            conv: tuple[np.ndarray, np.ndarray], prompt: Sequence[tuple[np.ndarray, np.ndarray]],
            hist: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        out = self.est.run(frames, t, start, bias, conv, prompt, hist)
        return np.asarray(out.velocity)


def _inputs(caller: Any, frames: int, cached: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    b, h, dh = 2, caller.heads, caller.head_dim

    def kv(m: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(rng.standard_normal((b, h, m, dh), dtype=np.float32),
                 rng.standard_normal((b, h, m, dh), dtype=np.float32))
                for _ in range(caller.depth)]

    prompt = min(cached, PROMPT_FRAMES)
    feeds = {k: rng.standard_normal((b, 80, frames), dtype=np.float32)
             for k in ("x", "mu", "cond")}
    feeds["spks"] = rng.standard_normal((b, 80), dtype=np.float32)
    conv = tuple(rng.standard_normal((b, caller.dim, 30), dtype=np.float32) for _ in range(2))
    return {"frames": feeds, "t": float(np.float32(0.37)), "start": cached,
            "bias": chunk_attention_bias(cached, frames, cached), "conv": conv,
            "prompt": kv(prompt), "hist": kv(cached - prompt)}


def _cost(path: Path) -> Any:
    from .costmodel import FAMILIES, fit_cost_model
    from .flops import load_stripped

    return fit_cost_model(load_stripped(path), FAMILIES["stream_estimator"])


def _shapes(frames: int, cached: int, heads: int, head_dim: int) -> dict[str, list[int]]:
    prompt = min(cached, PROMPT_FRAMES)
    return {"x": [2, 80, frames], "prompt_key_0": [2, heads, prompt, head_dim],
            "hist_key_0": [2, heads, cached - prompt, head_dim]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import (
        ensure_streaming_estimator,
    )

    from .stats import run_bounds
    from .throughput import Throughput, measure

    threads = args.threads
    source = Path(args.model_dir) / "flow.decoder.estimator.fp32.onnx"
    main, time_graph = ensure_streaming_estimator(source, Path(args.cache_dir), args.precision)
    baseline = Path(args.baseline_main)
    callers: dict[str, Any] = {
        "baseline": Caller(_graph(baseline, threads),
                           Path(args.baseline_time) if args.baseline_time else time_graph),
        "current": Caller(_graph(main, threads), time_graph),
    }
    costs = {"baseline": _cost(baseline), "current": _cost(main)}
    mix = list(BALANCED_PARAGRAPH) if args.records is None else mix_of_records(args.records)
    from .cli import _threads

    rate_threads = _threads(threads)
    rates_start = measure(rate_threads, args.throughput_seconds)
    seconds: dict[tuple[int, int], dict[str, list[float]]] = {
        (f, m): {name: [] for name in callers} for f, m, _ in mix}
    diffs: dict[tuple[int, int], float] = {}
    inputs = {(f, m): _inputs(callers["current"], f, m, seed=f * 1000 + m) for f, m, _ in mix}
    order = list(callers)
    for f, m, _ in mix:  # first calls: arenas, time conditioning, the velocity comparison
        got = {name: caller.run(**inputs[(f, m)]) for name, caller in callers.items()}
        ref = got["baseline"]
        diffs[(f, m)] = float(np.abs(got["current"] - ref).max() / max(1.0, np.abs(ref).max()))
    for rep in range(args.repeats):
        for f, m, _ in mix:
            for name in order if (rep + f) % 2 == 0 else order[::-1]:
                began = time.perf_counter()
                callers[name].run(**inputs[(f, m)])
                seconds[(f, m)][name].append(time.perf_counter() - began)
    rates = Throughput.best(rates_start, measure(rate_threads, args.throughput_seconds))
    rows = []
    heads, head_dim = callers["current"].heads, callers["current"].head_dim
    totals = {k: 0.0 for k in ("baseline_s", "current_s", "baseline_min_s", "current_min_s")}
    for f, m, calls in mix:
        row: dict[str, Any] = {"frames": f, "cached": m, "calls": calls,
                               "max_rel_diff": diffs[(f, m)]}
        for name in callers:
            median = statistics.median(seconds[(f, m)][name])
            fp32, int8, compute_s, _memory_s = run_bounds(
                costs[name], _shapes(f, m, heads, head_dim), rates)
            row[f"{name}_ms"] = 1e3 * median
            row[f"{name}_min_ms"] = 1e3 * compute_s
            row[f"{name}_ratio"] = median / compute_s
            row[f"{name}_gflop"] = [fp32 / 1e9, int8 / 1e9]
            totals[f"{name}_s"] += calls * median
            totals[f"{name}_min_s"] += calls * compute_s
        rows.append(row)
    return {
        "precision": args.precision, "threads": threads, "repeats": args.repeats,
        "baseline_main": str(baseline), "current_main": str(main),
        "rates": rates.to_json(), "shapes": rows,
        "total": {**totals,
                  "baseline_ratio": totals["baseline_s"] / totals["baseline_min_s"],
                  "current_ratio": totals["current_s"] / totals["current_min_s"],
                  "calls": sum(calls for _, _, calls in mix)},
    }


def table(result: dict[str, Any]) -> Iterable[str]:
    """The result as text lines."""
    rates = result["rates"]
    yield (f"rates: fp32 {rates['fp32_flops'] / 1e9:.0f} GFLOP/s, int8 "
           f"{rates['int8_ops'] / 1e9:.0f} GOP/s ({result['threads'] or 'auto'} threads)")
    yield (f"{'F':>4} {'M':>4} {'calls':>5} | {'base ms':>8} {'min':>6} {'ratio':>5} | "
           f"{'new ms':>8} {'min':>6} {'ratio':>5} | {'new/base':>8} {'max rel diff':>12}")
    for row in result["shapes"]:
        yield (f"{row['frames']:>4} {row['cached']:>4} {row['calls']:>5} | "
               f"{row['baseline_ms']:8.1f} {row['baseline_min_ms']:6.1f} "
               f"{row['baseline_ratio']:5.2f} | {row['current_ms']:8.1f} "
               f"{row['current_min_ms']:6.1f} {row['current_ratio']:5.2f} | "
               f"{row['current_ms'] / row['baseline_ms']:8.3f} {row['max_rel_diff']:12.2g}")
    total = result["total"]
    yield (f"weighted ({total['calls']} calls): baseline {total['baseline_s']:.2f} s (minimum "
           f"{total['baseline_min_s']:.2f} s, ratio {total['baseline_ratio']:.2f}); current "
           f"{total['current_s']:.2f} s (minimum {total['current_min_s']:.2f} s, ratio "
           f"{total['current_ratio']:.2f}); current / baseline "
           f"{total['current_s'] / total['baseline_s']:.3f}")


PROFILE_WARMUP = 2
"""Runs before the profiled ones (arena growth, first-run allocations)."""


def profile_shapes(args: argparse.Namespace) -> dict[str, Any]:
    """Per shape: wall milliseconds per call and per operator type the kernel milliseconds
    per call and the node count, from onnxruntime's profiler (the module doc)."""
    import onnxruntime as ort

    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import (
        ensure_streaming_estimator,
    )
    from wyoming_cosyvoice3.engine.sessions import session_options

    source = Path(args.model_dir) / "flow.decoder.estimator.fp32.onnx"
    main, time_graph = ensure_streaming_estimator(source, Path(args.cache_dir), args.precision)
    frames_list = [int(f) for f in str(args.profile).split(",") if f.strip()]
    result: dict[str, Any] = {"main": str(main), "cached": args.cached, "shapes": []}
    for frames in frames_list:
        options = session_options(args.threads, True, True)
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"dit_calls_{frames}")
        session = ort.InferenceSession(str(main), options, providers=[CPU_PROVIDER])
        spec = GraphSpec(main.name, {i.name: "float32" for i in session.get_inputs()},
                         {o.name: "float32" for o in session.get_outputs()})
        caller = Caller(Graph(main, spec, session=session, shrink_arena=True), time_graph)
        call = _inputs(caller, frames, args.cached, seed=frames)
        walls = []
        for _ in range(PROFILE_WARMUP + args.repeats):
            began = time.perf_counter()
            caller.run(**call)
            walls.append(time.perf_counter() - began)
        trace = Path(session.end_profiling())
        try:
            events = json.loads(trace.read_text())
        finally:
            trace.unlink(missing_ok=True)
        result["shapes"].append({"frames": frames,
                                 "wall_ms": 1e3 * statistics.median(walls[PROFILE_WARMUP:]),
                                 **_op_times(events, args.repeats)})
    return result


def _op_times(events: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    """Kernel microseconds per operator type over the last ``runs`` model runs, per run."""
    starts = sorted(e["ts"] for e in events
                    if e.get("cat") == "Session" and e.get("name") == "model_run")
    first = starts[-runs] if len(starts) >= runs else 0
    total: Counter[str] = Counter()
    nodes: dict[str, set[str]] = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith("_kernel_time") or event["ts"] < first:
            continue
        op = event.get("args", {}).get("op_name", "?")
        total[op] += event["dur"]
        nodes.setdefault(op, set()).add(name)
    return {"kernel_ms": sum(total.values()) / runs / 1e3,
            "ops": [{"op": op, "ms": us / runs / 1e3, "nodes": len(nodes[op])}
                    for op, us in total.most_common()]}


def profile_table(result: dict[str, Any], top: int = 12) -> Iterable[str]:
    """The profile as text lines."""
    yield f"{Path(result['main']).name}, {result['cached']} cached frames"
    for shape in result["shapes"]:
        kernel = shape["kernel_ms"]
        yield (f"F={shape['frames']}: {shape['wall_ms']:.1f} ms per call, kernels "
               f"{kernel:.1f} ms")
        for row in shape["ops"][:top]:
            yield (f"  {row['op']:<26} {row['ms']:8.2f} ms {100 * row['ms'] / kernel:5.1f} % "
                   f"({row['nodes']} nodes)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--cache-dir", required=True, help="where this tree's graphs are derived")
    p.add_argument("--baseline-main", default=None,
                   help="a main graph file of the same form (another tree's derived graph)")
    p.add_argument("--baseline-time", default=None,
                   help="the time graph derived beside --baseline-main (default: this tree's; "
                        "needed when the two trees' time graphs differ in their outputs)")
    p.add_argument("--precision", choices=("fp32", "int8"), default="int8")
    p.add_argument("--records", type=Path, default=None,
                   help="a server's --bench-stats-file: take the call mix from it")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--throughput-seconds", type=float, default=1.5,
                   help="time budget of each MatMul rate measurement")
    p.add_argument("--profile", default=None, metavar="F,F,...",
                   help="profile this tree's main graph per operator type at these new-frame "
                        "counts instead of timing two graphs")
    p.add_argument("--cached", type=int, default=250,
                   help="cached frames of the profiled calls")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.profile is not None:
        result = profile_shapes(args)
        lines = profile_table(result)
    else:
        if args.baseline_main is None:
            p.error("--baseline-main is needed (or --profile)")
        result = run(args)
        lines = table(result)
    for line in lines:
        print(line)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
