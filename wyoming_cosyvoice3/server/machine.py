"""The preset that fits this machine (``--preset auto``): a short rate probe and the cost model.

At start, before the engine loads (the preset decides which graphs load), the server measures
three rates of this machine with onnxruntime (:func:`probe_rates`, about 1 s): float32 MatMul
operations per second, int8 operations per second in the ``quantize_dynamic`` pattern the
int8 graphs use, and int8 weight bytes per second that a one-row MatMul streams (LLM decoding
reads every weight once per token). The same three rates are the denominators of the
benchmark's physical limit (BENCHMARKS.md "What is measured").

Each preset's real-time factor on a streamed paragraph is then predicted per stage
(:data:`STAGE_WORK`): the stage's work per second of audio, counted on the full-size graphs
(operations and weight bytes), at the probed rates, times the stage's efficiency (measured
stage time / its time at the measured peak rates, from a recorded benchmark run). The stages
run one after another (their times add up to the request's time in the recorded runs), so the
predicted RTF is their sum (:func:`predict_rtf`).

:func:`choose_preset` takes the most exact preset (``quality`` > ``balanced`` > ``fast``) whose
predicted RTF keeps up with playback (<= 1) and whose measured peak memory fits in the
available memory; when none keeps up, ``balanced`` (pauses between sentences instead of a
lossier preset), or the cheapest one that fits memory.

``python -m wyoming_cosyvoice3.server.machine [--threads N]`` prints the probe and the
predictions for this machine.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_LOGGER = logging.getLogger(__name__)

AUTO = "auto"
"""The ``--preset`` value that chooses with :func:`choose_preset` at start."""
PRESET_ORDER: tuple[str, ...] = ("quality", "balanced", "fast")
"""Presets from the most exact to the cheapest."""
FALLBACK_PRESET = "balanced"
"""Taken when no preset keeps up with playback (issue 26: pauses between sentences are
better than a lossier preset that still pauses), or when the probe fails."""
KEEPS_UP_RTF = 1.0
"""A preset keeps up with playback when its predicted RTF is at most this."""
SEED_WORK_S = 2.0
"""Seconds of engine work the prediction counts as in the piece gate's production history
(:class:`.preroll.ProductionHistory`) of a fresh server: it sizes the first answer's pieces and
holds instead of the gate's assumed rate, and the first measured responses outweigh it (the
gate blends up to 10 s of history with each response's own measurement)."""


@dataclass(frozen=True)
class MachineRates:
    """Rates of this machine under onnxruntime (:func:`probe_rates`).

    Attributes:
        fp32_flops: float32 MatMul operations per second (1 multiply-accumulate = 2).
        int8_ops: int8 operations per second (DynamicQuantizeLinear + MatMulInteger + scale).
        int8_bytes: int8 weight bytes per second streamed by a one-row MatMulInteger.
        threads: intra-op threads the probe ran with (0: onnxruntime's choice, as the engine).
        probe_s: wall-clock seconds the probe took.
    """

    fp32_flops: float
    int8_ops: float
    int8_bytes: float
    threads: int = 0
    probe_s: float = 0.0

    def describe(self) -> str:
        """One short phrase, e.g. ``fp32 168 GFLOP/s, int8 336 GOP/s, 29.4 GB/s``."""
        return (f"fp32 {self.fp32_flops / 1e9:.0f} GFLOP/s, int8 {self.int8_ops / 1e9:.0f} "
                f"GOP/s, {self.int8_bytes / 1e9:.1f} GB/s")


@dataclass(frozen=True)
class StageWork:
    """Work of one stage per second of audio of a streamed paragraph, and its efficiency.

    Attributes:
        fp32_gop: float32 operations, 1e9 per audio second.
        int8_gop: int8 operations, 1e9 per audio second.
        int8_gb: int8 weight bytes streamed, 1e9 per audio second.
        efficiency: measured stage seconds / seconds at the probed rates, with two or more
            intra-op threads (>= 1).
        one_thread: factor on ``efficiency`` with one thread: the probe's large MatMuls
            gain almost 2x from a second thread, the stages' smaller graph runs less, so
            at one thread a stage is nearer to the probed rate.
    """

    fp32_gop: float
    int8_gop: float
    int8_gb: float
    efficiency: float
    one_thread: float = 1.0

    def seconds_per_audio_s(self, rates: MachineRates) -> float:
        """Predicted stage seconds per audio second: the larger of compute and weight
        streaming at ``rates`` (the runs of one stage are all one or the other), times the
        efficiency at ``rates.threads``."""
        compute_s = 1e9 * (self.fp32_gop / rates.fp32_flops + self.int8_gop / rates.int8_ops)
        stream_s = 1e9 * self.int8_gb / rates.int8_bytes
        factor = self.efficiency * (self.one_thread if _threads(rates) == 1 else 1.0)
        return max(compute_s, stream_s) * factor


def _threads(rates: MachineRates) -> int:
    """Intra-op threads the engine runs with: ``rates.threads``, or for 0 (onnxruntime's
    choice, one per core) the CPUs this process may run on."""
    if rates.threads > 0:
        return rates.threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Work (operations, weight bytes per audio second): the graph runs of the paragraph streamed
# as Home Assistant streams it (10 characters every 50 ms) on the tiny-dit synthetic model,
# which has the full-size model's input shapes, counted with the full-size graphs' cost
# models (regenerate: bench/machine_table.py `table`, module doc). How the server cuts the
# text into pieces moves the flow's work by about +-8 %: sentence pieces (a machine slower
# than playback) 182.6 / 84.3 / 1199 GOP per audio second for balanced / fast / quality,
# pieces of up to 80 text tokens 157.5 / 76.8 / 1054.
#
# Efficiencies (measured stage seconds / seconds at the probe's rates; bench/machine_table.py
# `efficiencies`), from full-size streamed-paragraph runs on two machines, BENCHMARKS.md "The
# preset that fits the machine": two threads: prefill 1.6-2.3, flow (int8 DiT) 1.54-1.73,
# vocoder 1.84-2.04, fp32 DiT 1.28-1.41, the same within about 10 % on both machines; LLM
# decoding 1.39-1.67 on one and 2.44 on the other (the one-row probe does not run the fused
# graph's kernel, so decoding varies most between CPUs): the geometric mean 1.92 errs by about
# 25 % either way on decoding alone, less on the whole. One thread / two threads, same machine
# and runs: prefill 0.66-0.77, decoding 0.73-0.82, int8 flow 0.74-0.81, fp32 flow 0.93,
# vocoder 0.70-0.74.
_PREFILL = (1.75, 0.70)
_DECODE = (1.92, 0.77)
_FLOW_INT8 = (1.64, 0.77)
_FLOW_FP32 = (1.34, 0.93)
_VOCODER = (1.90, 0.72)
FUSED_Q4_DECODE_RATIO = 0.73
"""``fast``'s LLM (``fused-q4``) decoding time / the int8 ``fused`` graph's, per token: 16.3
against 22.4 ms, 80 tokens after a 187-position prompt, two threads, the graphs taking turns
(``python -m bench.llm_decode``, BENCHMARKS.md "LLM decode graph")."""

STAGE_WORK: dict[str, dict[str, StageWork]] = {
    "quality": {
        "llm_prefill": StageWork(0.01215, 3.152, 0.06119, *_PREFILL),
        "llm_decode": StageWork(0.2975, 18.07, 9.044, *_DECODE),
        "flow": StageWork(1195.0, 0.0, 0.0, *_FLOW_FP32),
        "vocoder": StageWork(33.70, 0.0, 0.0, *_VOCODER),
    },
    "balanced": {
        "llm_prefill": StageWork(0.01462, 2.955, 0.04889, *_PREFILL),
        "llm_decode": StageWork(0.4251, 18.10, 9.056, *_DECODE),
        "flow": StageWork(18.88, 167.5, 0.4463, *_FLOW_INT8),
        "vocoder": StageWork(33.70, 0.0, 0.0, *_VOCODER),
    },
    "fast": {
        "llm_prefill": StageWork(0.01017, 3.557, 0.08613, *_PREFILL),
        "llm_decode": StageWork(0.1973, 18.02, 9.019,
                                _DECODE[0] * FUSED_Q4_DECODE_RATIO, _DECODE[1]),
        "flow": StageWork(4.011, 84.29, 0.3494, *_FLOW_INT8),
        "vocoder": StageWork(33.70, 0.0, 0.0, *_VOCODER),
    },
}
"""Preset -> stage -> :class:`StageWork` of the streamed benchmark paragraph (about 30 s of
speech, 5 s voice prompt) on the full-size model with each preset's LLM graph (int8
``fused``; ``fast``: ``fused-q4``, its decoding scaled by :data:`FUSED_Q4_DECODE_RATIO`): the
int8 LLM streams 0.36 GB of weights per token, the vocoder runs 33.7 GFLOP per second of
audio; the presets differ in the flow."""


@dataclass(frozen=True)
class PresetMemory:
    """Measured resident memory of a preset on the full-size model, bytes.

    Attributes:
        steady_bytes: RSS after the measured requests, idle.
        peak_bytes: VmHWM over loading and speaking the streamed paragraph (the figure that
            must fit: a long answer reaches it again).
    """

    steady_bytes: float
    peak_bytes: float


PRESET_MEMORY: dict[str, PresetMemory] = {
    # BENCHMARKS.md "`quality`'s peak memory" (streamed paragraph, ab-qm7): steady 2.79 GB,
    # peak 6.95 GB (the chunk-causal history of the longest piece, 3.6 MB per mel frame)
    "quality": PresetMemory(2.79e9, 6.95e9),
    # BENCHMARKS.md "`balanced` made chunk-causal" (ab-bc7): steady 1.45 GB, peak 2.08 GB
    "balanced": PresetMemory(1.45e9, 2.08e9),
    # BENCHMARKS.md "`fast` made chunk-causal" (f8, the `cc` row): steady 1.15 GB, peak 1.61 GB
    "fast": PresetMemory(1.15e9, 1.61e9),
}
"""Preset -> measured memory (full-size synthetic model, 5 s voice prompt)."""


def predict_rtf(rates: MachineRates, preset: str,
                work: Mapping[str, Mapping[str, StageWork]] | None = None) -> float:
    """Predicted real-time factor (seconds of work per second of audio) of ``preset`` on a
    streamed paragraph at ``rates``.

    Raises:
        KeyError: ``preset`` has no cost table.
    """
    stages = (STAGE_WORK if work is None else work)[preset]
    return sum(stage.seconds_per_audio_s(rates) for stage in stages.values())


@dataclass(frozen=True)
class PresetChoice:
    """What ``--preset auto`` chose and why.

    Attributes:
        preset: the chosen preset.
        predicted_rtf: preset -> predicted RTF (empty when the probe failed).
        rates: the probe's rates (None when it failed).
        available_bytes: memory available to this process when it chose (None: unknown).
        reason: why this preset, in a few words.
    """

    preset: str
    predicted_rtf: dict[str, float] = field(default_factory=dict)
    rates: MachineRates | None = None
    available_bytes: float | None = None
    reason: str = ""

    @property
    def keeps_up(self) -> bool:
        rtf = self.predicted_rtf.get(self.preset)
        return rtf is not None and rtf <= KEEPS_UP_RTF

    def summary(self) -> str:
        """The one line the server logs and the voice page shows."""
        rtf = self.predicted_rtf.get(self.preset)
        if rtf is None or self.rates is None:
            return f"preset auto took `{self.preset}`: {self.reason}"
        speed = 1.0 / rtf if rtf > 0 else math.inf
        others = ", ".join(f"{name} {value:.2f}" for name, value in self.predicted_rtf.items()
                           if name != self.preset)
        outlook = ("answers play without pauses" if self.keeps_up
                   else "expect pauses between sentences on long answers")
        memory = ("" if self.available_bytes is None
                  else f", {self.available_bytes / 1e9:.1f} GB available")
        return (f"preset auto took `{self.preset}`: this machine makes speech at about "
                f"{speed:.2g}x playback speed with it (predicted RTF {rtf:.2f}; {others}; "
                f"{self.rates.describe()}, {self.rates.threads or 'default'} threads"
                f"{memory}); {outlook}")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form for the voice page."""
        return {
            "preset": self.preset,
            "predicted_rtf": {k: round(v, 3) for k, v in self.predicted_rtf.items()},
            "keeps_up": self.keeps_up,
            "reason": self.reason,
            "summary": self.summary(),
        }


def choose_preset(rates: MachineRates, available_bytes: float | None,
                  work: Mapping[str, Mapping[str, StageWork]] | None = None,
                  memory: Mapping[str, PresetMemory] | None = None) -> PresetChoice:
    """The most exact preset that keeps up with playback and fits in memory.

    Args:
        rates: this machine's rates (:func:`probe_rates`).
        available_bytes: memory this process may still use (:func:`available_memory_bytes`);
            None: not limited.
        work, memory: cost and memory tables (default :data:`STAGE_WORK`,
            :data:`PRESET_MEMORY`).

    Returns:
        The choice: the first of :data:`PRESET_ORDER` with predicted RTF <=
        :data:`KEEPS_UP_RTF` whose peak memory fits; else :data:`FALLBACK_PRESET` when it
        fits; else the cheapest preset that fits; else the one with the smallest peak.
    """
    memory = PRESET_MEMORY if memory is None else memory
    predicted = {name: predict_rtf(rates, name, work) for name in PRESET_ORDER}

    def fits(name: str) -> bool:
        return available_bytes is None or memory[name].peak_bytes <= available_bytes

    for name in PRESET_ORDER:
        if predicted[name] <= KEEPS_UP_RTF and fits(name):
            reason = "the most exact preset that keeps up with playback and fits in memory"
            return PresetChoice(name, predicted, rates, available_bytes, reason)
    if fits(FALLBACK_PRESET):
        reason = "no preset keeps up with playback"
        return PresetChoice(FALLBACK_PRESET, predicted, rates, available_bytes, reason)
    fitting = [name for name in reversed(PRESET_ORDER) if fits(name)]
    if fitting:
        reason = f"no preset keeps up with playback and `{FALLBACK_PRESET}` needs more memory"
        return PresetChoice(fitting[0], predicted, rates, available_bytes, reason)
    smallest = min(PRESET_ORDER, key=lambda name: memory[name].peak_bytes)
    reason = "no preset fits in the available memory; the smallest one"
    return PresetChoice(smallest, predicted, rates, available_bytes, reason)


# --- the probe ----------------------------------------------------------------------------

PROBE_COMPUTE_SHAPE = (256, 1024, 4096)
"""M, K, N of the compute-bound MatMuls (the benchmark's ``bench/throughput.py`` shape)."""
PROBE_STREAM_SHAPE = (4096, 8192)
"""K, N of the int8 weight streamed by the one-row MatMul (32 MiB, the benchmark's shape)."""
EVICT_BYTES = 64 << 20
"""Bytes read before each timed one-row run, so that its weight comes from memory, as the
LLM's 0.36 GB per token does, and not from a last-level cache as large as the weight (32 MiB
on the 2-core reference machine: 42-44 GB/s with the weight cached, 30-38 GB/s evicted, quiet
machine, 2026-12-03)."""


def _model_bytes(k: int, n: int, int8: bool, rng: np.random.Generator) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    # the values do not change the speed: one random block repeated is quick to make
    if int8:
        # weights within +-63: the u8 x s8 pair sums stay exact in int16 on AVX2 without VNNI
        block = rng.integers(-63, 64, size=(64, n), dtype=np.int8)
        weight = numpy_helper.from_array(np.resize(block, (k, n)), "weight")
        inits = [weight,
                 numpy_helper.from_array(np.zeros((), dtype=np.int8), "weight_zero"),
                 numpy_helper.from_array(np.full((n,), 0.01, dtype=np.float32), "weight_scale")]
        nodes = [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero"]),
            helper.make_node("MatMulInteger", ["xq", "weight", "x_zero", "weight_zero"],
                             ["acc"]),
            helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x_scale", "weight_scale"], ["scale"]),
            helper.make_node("Mul", ["acc_f", "scale"], ["y"]),
        ]
    else:
        floats = rng.standard_normal((64, n), dtype=np.float32) * 0.02
        inits = [numpy_helper.from_array(np.resize(floats, (k, n)), "weight")]
        nodes = [helper.make_node("MatMul", ["x", "weight"], ["y"])]
    graph = helper.make_graph(
        nodes, "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return bytes(model.SerializeToString())


def _fastest_s(run: Callable[[], Any], budget_s: float, max_runs: int = 100,
               before: Callable[[], Any] | None = None) -> float:
    """Fastest of repeated ``run()`` calls within about ``budget_s`` (one untimed first);
    ``before()`` runs untimed before each call."""
    run()
    best = math.inf
    spent = 0.0
    for _ in range(max_runs):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        elapsed = time.perf_counter() - started
        best = min(best, elapsed)
        spent += elapsed
        if spent >= budget_s:
            break
    return best


def probe_rates(threads: int = 0, budget_s: float = 1.0, seed: int = 0) -> MachineRates:
    """Measure :class:`MachineRates` on the CPU provider (about ``budget_s`` of timing plus
    building the graphs; 32 MiB of int8 weights and a 64 MiB buffer held while it runs).

    Args:
        threads: intra-op threads, as the engine's sessions get them (0: onnxruntime's
            choice; the engine's ``--threads``).
        budget_s: timing budget split over the three measurements.

    Raises:
        ImportError: onnx is not installed (it builds the probe graphs).
        RuntimeError: onnxruntime failed (its own error types derive from it).
    """
    import onnxruntime as ort

    from ..engine.graphs import session_options

    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    m, k, n = PROBE_COMPUTE_SHAPE
    k_stream, n_stream = PROBE_STREAM_SHAPE
    x = rng.standard_normal((m, k), dtype=np.float32)
    row = rng.standard_normal((1, k_stream), dtype=np.float32)

    def session(model: bytes) -> Any:
        return ort.InferenceSession(model, session_options(threads),
                                    providers=["CPUExecutionProvider"])

    each_s = budget_s / 3

    def fastest(model: bytes, inputs: dict[str, np.ndarray],
                before: Callable[[], Any] | None = None) -> float:
        probe = session(model)  # released on return: one probe graph at a time
        return _fastest_s(lambda: probe.run(None, inputs), each_s, before=before)

    fp32_s = fastest(_model_bytes(k, n, False, rng), {"x": x})
    int8_s = fastest(_model_bytes(k, n, True, rng), {"x": x})
    evict = np.ones(EVICT_BYTES, dtype=np.uint8)
    stream_s = fastest(_model_bytes(k_stream, n_stream, True, rng), {"x": row},
                       before=evict.max)
    del evict
    ops = 2.0 * m * k * n
    return MachineRates(ops / fp32_s, ops / int8_s, k_stream * n_stream / stream_s, threads,
                        time.perf_counter() - started)


# --- memory -------------------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_rss_bytes(statm: Path) -> int:
    try:
        return int(statm.read_text(encoding="ascii").split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_memory_bytes(root: Path = Path("/")) -> float | None:
    """Memory this process may grow into, bytes: the smaller of the system's
    ``MemAvailable`` and what the cgroup's limit leaves (v2 ``memory.max`` -
    ``memory.current``, v1 ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``; containers
    such as a Home Assistant add-on), plus this process's own RSS (the measured peaks include
    it). None when neither is readable (not Linux).

    Args:
        root: file system root (tests point it at a fake ``proc``/``sys`` tree).
    """
    limits: list[int] = []
    available = _meminfo_available(root / "proc/meminfo")
    if available is not None:
        limits.append(available)
    cgroup = root / "sys/fs/cgroup"
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(cgroup / limit_file), _read_int(cgroup / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # "max" / no limit
            limits.append(max(0, limit - usage))
    if not limits:
        return None
    return float(min(limits) + _own_rss_bytes(root / "proc/self/statm"))


def choose_for_this_machine(threads: int = 0, budget_s: float = 1.0,
                            probe: Callable[[int, float], MachineRates] | None = None,
                            memory: Callable[[], float | None] | None = None) -> PresetChoice:
    """Probe this machine and choose (:func:`choose_preset`); never raises: a failed probe
    gives :data:`FALLBACK_PRESET` with the reason.

    Args:
        threads: the engine's ``--threads`` (0: onnxruntime's choice).
        budget_s: the probe's timing budget.
        probe, memory: replace :func:`probe_rates` / :func:`available_memory_bytes` (tests).
    """
    available = (memory or available_memory_bytes)()
    try:
        rates = (probe or (lambda t, b: probe_rates(t, b)))(threads, budget_s)
    except (ImportError, RuntimeError, OSError, ValueError) as err:
        return PresetChoice(FALLBACK_PRESET, available_bytes=available,
                            reason=f"the machine could not be measured ({err})")
    return choose_preset(rates, available)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the probe and every preset's predicted RTF for this machine."""
    parser = argparse.ArgumentParser(
        prog="python -m wyoming_cosyvoice3.server.machine",
        description="Measure this machine as --preset auto does and print the prediction.")
    parser.add_argument("--threads", type=int, default=0,
                        help="onnxruntime threads as the server's --threads (0: its choice)")
    parser.add_argument("--budget-s", type=float, default=1.0, help="probe timing budget")
    args = parser.parse_args(argv)
    choice = choose_for_this_machine(args.threads, args.budget_s)
    if choice.rates is not None:
        print(f"rates: {choice.rates.describe()} ({choice.rates.threads or 'default'} threads, "
              f"probe {choice.rates.probe_s:.2f} s)")
    for name, rtf in choice.predicted_rtf.items():
        print(f"{name}: predicted RTF {rtf:.3f}")
    print(choice.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
