"""What this machine does fast: a short onnxruntime probe, the LLM graphs each preset runs on
it, and each preset's predicted real-time factor.

The probe (:func:`probe_rates`, 3-8 s) measures

* three rates: float32 MatMul operations per second, int8 operations per second in the
  ``quantize_dynamic`` pattern of the int8 DiT, and int8 weight bytes per second that a
  one-row MatMul streams from memory (the caches evicted first, :func:`evict_bytes`);
* the LLM's products in each derived form (:func:`probe_llm`): two decoder layers' four
  projections at the published widths, built exactly as the fused LLM graphs build them
  (:func:`~.derive.llm.fused_graph.build_projection_stack`), timed for one row with the caches
  evicted (a decode step reads every weight from memory) and for 128 rows (a prefill), scaled
  to the whole model by weight bytes. Which form is fastest differs between CPUs: on the
  AVX-512 + AMX test machine per-tensor int8 (``fused``) prefills 3.4x faster than 8-bit
  blocks (``fused-b8``) but decodes 1.3x slower (BENCHMARKS.md "LLM decode graph").

:func:`choose_llm_graphs` picks, per preset, the LLM graph that decodes (among the preset's
:attr:`~.options.LlmPreset.decode_graphs`) and the one that prefills (the lossless forms) from
those figures. :func:`predict_rtf` predicts a preset's real-time factor on a streamed
paragraph: per stage its work per second of audio (:data:`STAGE_WORK`: LLM tokens and
prefilled positions; flow and vocoder operations counted on the full-size graphs) at the
probed costs, times the stage's efficiency measured in full-size runs; the stages add up,
or, with the LLM decoding beside the flow (``EngineOptions.split_cores``), overlap
(:class:`StageSplit`). :func:`choose_preset`
takes the most exact preset that keeps up with playback with the prediction's error as margin
(:func:`keeps_up_rtf`).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import constants as C
from .llm.graph_choice import token_cost_s
from .options import LOSSLESS_LLM_GRAPHS, PRESET_STAGES, LlmGraph
from .sessions import available_cpus, session_options

_LOGGER = logging.getLogger(__name__)

PRESET_ORDER: tuple[str, ...] = ("quality", "balanced", "fast")
"""Presets from the most exact to the cheapest."""
FALLBACK_PRESET = "balanced"
"""Taken when no preset keeps up with playback and none is predicted within its error of real
time (pauses between sentences are better than a lossier preset that still pauses), or when
the probe fails."""
PREDICTION_ERROR = 0.15
"""Largest relative error of :func:`predict_rtf` against the benchmark's streamed paragraph
on the machines measured (BENCHMARKS.md "The preset that fits the machine": ``balanced`` and
``fast`` 0.89-1.10 of the measured RTF, ``quality`` with its flow at the DiT-sized rate
0.94-1.01, on two threads and on one)."""
PREDICTION_ERRORS: dict[str, float] = dict.fromkeys(("quality", "balanced", "fast"),
                                                    PREDICTION_ERROR)
"""Preset -> how far the measured RTF may exceed the prediction (one figure for every preset
since ``quality``'s flow is predicted from the DiT-sized rate; its prediction from the peak
fp32 rate had been 0.83-1.51 of the measured RTF)."""
KEEPS_UP_RTF = 1.0 / (1.0 + PREDICTION_ERROR)
"""A preset keeps up with playback when the predicted RTF is at most this: even
a prediction :data:`PREDICTION_ERROR` too low still leaves it at or below real time."""


PAIRING_GRAPHS: tuple[str, ...] = ("fused-b8", "fused-q4")
"""LLM graphs that decode two pieces of an answer at once (:mod:`.llm.tokens`): ``fused-q4``'s
two-row steps give each row its own logits, ``fused-b8``'s are validated when derived;
per-tensor int8 (``fused``) couples its rows. The engine checks it again at load."""
PAIRED_STEP_COST = 1.2
"""Seconds of a two-row decode step / a one-row step of the pairing graphs, 200 cached
positions, 2 threads: 1.20 (``fused-q4``) and 1.21 (``fused-b8``) on the AMX Xeon, 1.19 and
1.19 on the Zen 4 EPYC (BENCHMARKS.md "Two pieces decoded at once", "The Zen 4, and the gate
that sees decoded pieces")."""


def keeps_up_rtf(preset: str) -> float:
    """The largest predicted RTF at which ``preset`` counts as keeping up with playback:
    ``1 / (1 + PREDICTION_ERRORS[preset])``.

    Raises:
        KeyError: not a preset.
    """
    return 1.0 / (1.0 + PREDICTION_ERRORS[preset])


# --- the probe --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlmCosts:
    """Seconds the LLM's products take on this machine, per derived form (:func:`probe_llm`).

    Attributes:
        decode_s: LLM graph name -> seconds of one decode step's products (one row through
            every projection of the published 24 layers and the head, weights from memory).
        prefill_s: LLM graph name -> seconds per prefilled position (128-row products).
    """

    decode_s: Mapping[str, float]
    prefill_s: Mapping[str, float]

    def token_s(self, graph: str) -> float:
        """Seconds per decoded token of a long answer with ``graph``: its one-row step, or
        for a graph that decodes two pieces at once (:data:`PAIRING_GRAPHS`) the per-token
        cost with its two-row steps at :data:`PAIRED_STEP_COST` x one row
        (:func:`~.llm.graph_choice.token_cost_s`).

        Raises:
            KeyError: ``graph`` was not measured.
        """
        step_s = self.decode_s[graph]
        paired = PAIRED_STEP_COST * step_s if graph in PAIRING_GRAPHS else None
        return token_cost_s(step_s, paired)

    @classmethod
    def from_rates(cls, int8_bytes: float, int8_ops: float) -> LlmCosts:
        """An estimate where the forms were not timed: decoding streams each form's weight
        bytes (4-bit: half) at ``int8_bytes``, a prefilled position costs the model's
        multiply-accumulates at ``int8_ops``; every form prefills alike."""
        weights = llm_weight_bytes()
        decode = {"fused": weights / int8_bytes, "fused-b8": weights / int8_bytes,
                  "fused-q4": 0.5 * weights / int8_bytes}
        position = 2.0 * weights / int8_ops
        return cls(decode, dict.fromkeys(decode, position))


@dataclass(frozen=True)
class MachineRates:
    """Rates of this machine under onnxruntime (:func:`probe_rates`).

    Attributes:
        fp32_flops: float32 MatMul operations per second (1 multiply-accumulate = 2).
        int8_ops: int8 operations per second (DynamicQuantizeLinear + MatMulInteger + scale).
        int8_bytes: int8 weight bytes per second streamed from memory by a one-row
            MatMulInteger.
        threads: intra-op threads the probe ran with (0: onnxruntime's choice, as the engine).
        probe_s: wall-clock seconds the probe took.
        llm: the LLM forms' measured costs (None: not measured).
        fp32_dit_flops: float32 operations per second of a DiT-sized product
            (:data:`PROBE_DIT_SHAPE`), the median over the probe's windows (0: not measured;
            :meth:`dit_fp32_rate` then gives ``fp32_flops``).
    """

    fp32_flops: float
    int8_ops: float
    int8_bytes: float
    threads: int = 0
    probe_s: float = 0.0
    llm: LlmCosts | None = None
    fp32_dit_flops: float = 0.0

    def describe(self) -> str:
        """One short phrase, e.g. ``fp32 168 GFLOP/s, int8 336 GOP/s, 22.4 GB/s``."""
        return (f"fp32 {self.fp32_flops / 1e9:.0f} GFLOP/s, int8 {self.int8_ops / 1e9:.0f} "
                f"GOP/s, {self.int8_bytes / 1e9:.1f} GB/s")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (the server logs it at start; ``bench/machine_table.py`` reads it)."""
        out: dict[str, Any] = {"fp32_flops": self.fp32_flops, "int8_ops": self.int8_ops,
                               "int8_bytes": self.int8_bytes, "threads": self.threads,
                               "probe_s": self.probe_s, "fp32_dit_flops": self.fp32_dit_flops}
        if self.llm is not None:
            out["llm"] = {"decode_s": dict(self.llm.decode_s),
                          "prefill_s": dict(self.llm.prefill_s)}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MachineRates:
        """The inverse of :meth:`to_json`.

        Raises:
            KeyError, TypeError, ValueError: not a :meth:`to_json` form.
        """
        llm = data.get("llm")
        return cls(float(data["fp32_flops"]), float(data["int8_ops"]),
                   float(data["int8_bytes"]), int(data.get("threads", 0)),
                   float(data.get("probe_s", 0.0)),
                   None if llm is None else LlmCosts(
                       {k: float(v) for k, v in llm["decode_s"].items()},
                       {k: float(v) for k, v in llm["prefill_s"].items()}),
                   float(data.get("fp32_dit_flops", 0.0)))

    def dit_fp32_rate(self) -> float:
        """``fp32_dit_flops``, or ``fp32_flops`` where it was not measured."""
        return self.fp32_dit_flops if self.fp32_dit_flops > 0 else self.fp32_flops

    def llm_costs(self) -> LlmCosts:
        """``llm``, or where it was not measured :meth:`LlmCosts.from_rates`."""
        return self.llm or LlmCosts.from_rates(self.int8_bytes, self.int8_ops)

    def thread_count(self) -> int:
        """Intra-op threads the engine runs with: ``threads``, or for 0 (onnxruntime's choice,
        one per core) the CPUs this process may run on."""
        return self.threads if self.threads > 0 else available_cpus()


PROBE_COMPUTE_SHAPE = (256, 1024, 4096)
"""M, K, N of the compute-bound MatMuls (the benchmark's ``bench/throughput.py`` shape)."""
PROBE_DIT_SHAPE = (1200, 1024, 2048)
"""M, K, N of the DiT-sized float32 MatMul: the CFG pair of a 600-frame window (2 x 600 rows;
a 5 s prompt is 250 frames, a sentence 150-500) through the first product of the published
DiT's feed-forward (width 1024, ``ff_mult`` 2). ``quality``'s flow is float32 products of this
size (:attr:`StageWork.fp32_dit`). Its median over the probe's windows followed ``quality``'s
DiT calls where the fastest run of the smaller compute product did not: with other work on the
host, a DiT call's time x the median rate varied by +-8 % over six rounds, x the fastest
256-row rate by +-20 %."""
PROBE_STREAM_SHAPE = (4096, 8192)
"""K, N of the int8 weight streamed by the one-row MatMul (32 MiB)."""
MIN_EVICT_BYTES = 64 << 20
"""Smallest buffer read before each timed one-row run (a CPU whose last-level cache size is
not readable): larger than the 32 MiB L3 of the 2-core EPYC test machines."""
COMPUTE_ROUNDS = 4
"""The fp32 and int8 MatMul rates are each timed in this many short windows spread over the
probe (one before and one after each LLM round, :data:`LLM_ROUNDS`), and the fastest run of all
is kept: on a shared host one window read anywhere from 0.65x to 1x the machine's rate (slower
periods last a second or more), while the stages' times over a whole answer varied by under
8 % (BENCHMARKS.md "The preset that fits the machine")."""
DIT_RUNS = 3
"""Timed runs of the DiT-sized product per window (the median is kept; about 25 ms each at
200 GFLOP/s)."""
EVICTED_RUNS = 8
"""Timed runs of each measurement that evicts the caches first (the fastest or the median is
kept; each eviction reads :func:`evict_bytes`, 0.45 GB on a 300 MB L3)."""
LLM_ROUNDS = 3
"""The LLM forms are timed in this many rounds spread over the probe, :data:`LLM_ROUND_RUNS`
decode runs each, and each form's median over the rounds is kept, so that one busy or idle
second of a shared host sets one round, not the figure: on the quiet test host the same
form's decode product, timed again seconds later, read 16-32 ms a token (BENCHMARKS.md "The
preset that fits the machine")."""
LLM_ROUND_RUNS = 4
"""Timed decode runs per form and round (each after an eviction of the caches)."""
LLM_PROBE_LAYERS = 2
"""Decoder layers in the LLM probe's graphs (30 MB of int8 weights at the published widths)."""
LLM_PROBE_PREFILL_ROWS = 128
"""Rows of the LLM probe's prefill product (a sentence's prompt is 30-250 positions)."""
LLM_PROBE_FORMS: dict[str, tuple[str, int]] = {
    "fused": ("int8", 32),
    "fused-b8": ("nbits8", 128),
    "fused-q4": ("nbits4", 32),
}
"""LLM graph -> (projection kernel, block size) as :mod:`.derive.llm.fused` builds it
(``B8_BLOCK_SIZE``, ``Q4_BLOCK_SIZE``; a test ties the two)."""
LLM_WIDTHS = (C.LLM_HIDDEN_SIZE,
              C.LLM_HIDDEN_SIZE + 2 * C.LLM_NUM_KV_HEADS * C.LLM_HEAD_DIM,
              C.LLM_INTERMEDIATE_SIZE)
"""(hidden, q|k|v, ffn) widths of the published Qwen2-0.5B LLM (896, 1152, 4864)."""


def last_level_cache_bytes(root: Path = Path("/")) -> int | None:
    """Size of the largest CPU cache of CPU 0 (sysfs ``cache/index*/size``), or None.

    Args:
        root: file system root (tests point it at a fake ``sys`` tree).
    """
    sizes = []
    for size_file in (root / "sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size_file.read_text(encoding="ascii").strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2]])
    return max(sizes) if sizes else None


def evict_bytes(root: Path = Path("/")) -> int:
    """Bytes to read before a timed one-row run so that its weights come from memory:
    1.5x the last-level cache (some CPUs keep part of an evicting stream), at least
    :data:`MIN_EVICT_BYTES`. The LLM reads 0.36 GB per token, more than any cache it meets;
    a probe whose weights stayed in a 300 MB L3 measured 43 GB/s where memory gives 22."""
    cache = last_level_cache_bytes(root)
    return max(MIN_EVICT_BYTES, int(1.5 * cache) if cache else 0)


def _int8_matmul_bytes(k: int, n: int, rng: np.random.Generator) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    # one random block repeated is quick to make; the values do not change the speed. Weights
    # within +-63: the u8 x s8 pair sums stay exact in int16 on AVX2 without VNNI
    block = rng.integers(-63, 64, size=(64, n), dtype=np.int8)
    inits = [numpy_helper.from_array(np.resize(block, (k, n)), "weight"),
             numpy_helper.from_array(np.zeros((), dtype=np.int8), "weight_zero"),
             numpy_helper.from_array(np.full((n,), 0.01, dtype=np.float32), "weight_scale")]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero"]),
        helper.make_node("MatMulInteger", ["xq", "weight", "x_zero", "weight_zero"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x_scale", "weight_scale"], ["scale"]),
        helper.make_node("Mul", ["acc_f", "scale"], ["y"]),
    ]
    return _model(nodes, inits, k, n)


def _fp32_matmul_bytes(k: int, n: int, rng: np.random.Generator) -> bytes:
    from onnx import helper, numpy_helper

    floats = rng.standard_normal((64, n), dtype=np.float32) * 0.02
    inits = [numpy_helper.from_array(np.resize(floats, (k, n)), "weight")]
    return _model([helper.make_node("MatMul", ["x", "weight"], ["y"])], inits, k, n)


def _model(nodes: list[Any], inits: list[Any], k: int, n: int) -> bytes:
    from onnx import TensorProto, helper

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


def _session(model: Any, threads: int) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(model, session_options(threads),
                                providers=["CPUExecutionProvider"])


def _median_s(run: Callable[[], Any], runs: int, before: Callable[[], Any] | None = None) -> float:
    run()
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def llm_weight_bytes(layers: int = C.LLM_NUM_LAYERS, head: bool = True) -> int:
    """int8 weight bytes of ``layers`` decoder layers' projections (and the speech head) at
    :data:`LLM_WIDTHS`: 364 MB for the published model."""
    hidden, qkv, ffn = LLM_WIDTHS
    per_layer = hidden * qkv + hidden * hidden + hidden * 2 * ffn + ffn * hidden
    return layers * per_layer + (hidden * C.SPEECH_EMBEDDING_ROWS if head else 0)


def llm_probe_models(forms: tuple[str, ...] = tuple(LLM_PROBE_FORMS)) -> dict[str, bytes]:
    """Form -> the serialized graph :func:`probe_llm` times: :data:`LLM_PROBE_LAYERS` layers'
    projections at :data:`LLM_WIDTHS` in the form's kernel and block size.

    Raises:
        ImportError: onnx is not installed.
        KeyError: a form not in :data:`LLM_PROBE_FORMS`.
    """
    from .derive.llm.fused_graph import build_projection_stack

    return {form: build_projection_stack(LLM_PROBE_FORMS[form][0], LLM_WIDTHS, LLM_PROBE_LAYERS,
                                         block_size=LLM_PROBE_FORMS[form][1]).SerializeToString()
            for form in forms}


def probe_llm(threads: int = 0, forms: tuple[str, ...] = tuple(LLM_PROBE_FORMS),
              decode_runs: int = EVICTED_RUNS, prefill_runs: int = 3,
              evict: np.ndarray | None = None,
              models: Mapping[str, bytes] | None = None) -> LlmCosts:
    """Time each LLM form's products on this machine (module docstring; about 0.5 s a form).

    Args:
        threads: intra-op threads (0: onnxruntime's choice).
        forms: LLM graph names of :data:`LLM_PROBE_FORMS`.
        decode_runs, prefill_runs: timed runs (medians).
        evict: buffer read before each one-row run (default :func:`evict_bytes` of ones).
        models: form -> its serialized probe graph (:func:`llm_probe_models`), so that
            rounds build each once; default: built here.

    Raises:
        ImportError: onnx is not installed.
        RuntimeError: onnxruntime failed.
    """
    rng = np.random.default_rng(0)
    models = models if models is not None else llm_probe_models(forms)
    buffer = np.ones(evict_bytes(), dtype=np.uint8) if evict is None else evict
    scale = llm_weight_bytes() / llm_weight_bytes(LLM_PROBE_LAYERS, head=False)
    row = rng.standard_normal((1, LLM_WIDTHS[0]), dtype=np.float32)
    rows = rng.standard_normal((LLM_PROBE_PREFILL_ROWS, LLM_WIDTHS[0]), dtype=np.float32)
    decode, prefill = {}, {}
    # one form after the other, each session's runs back to back as the engine runs its LLM:
    # sessions taking turn by turn measure the other sessions' spinning threads as well
    # (fused-b8 read 31 ms a token that way against 21 ms alone, as slow as fused)
    for form in forms:
        session = _session(models[form], threads)

        def one_row(session: Any = session) -> Any:
            return session.run(None, {"x": row})

        def many_rows(session: Any = session) -> Any:
            return session.run(None, {"x": rows})

        decode[form] = scale * _median_s(one_row, decode_runs, before=buffer.max)
        prefill[form] = scale * _median_s(many_rows, prefill_runs) / LLM_PROBE_PREFILL_ROWS
        del session
    return LlmCosts(decode, prefill)


def median_costs(rounds: list[LlmCosts]) -> LlmCosts:
    """Each form's median decode and prefill cost over ``rounds`` (forms every round has).

    Raises:
        ValueError: ``rounds`` is empty.
    """
    if not rounds:
        raise ValueError("no LLM probe rounds")

    def median(field_of: Callable[[LlmCosts], Mapping[str, float]]) -> dict[str, float]:
        forms = set.intersection(*(set(field_of(r)) for r in rounds))
        return {form: float(np.median([field_of(r)[form] for r in rounds]))
                for form in sorted(forms)}

    return LlmCosts(median(lambda r: r.decode_s), median(lambda r: r.prefill_s))


def probe_rates(threads: int = 0, budget_s: float = 1.0, seed: int = 0,
                llm: bool = True) -> MachineRates:
    """Measure :class:`MachineRates` on the CPU provider (about ``budget_s`` of timing plus
    building the graphs, and with ``llm`` :func:`probe_llm`; 32 MiB of int8 weights and an
    eviction buffer of :func:`evict_bytes` held while it runs).

    Args:
        threads: intra-op threads, as the engine's sessions get them (0: onnxruntime's
            choice; the engine's ``--threads``).
        budget_s: timing budget split over the three rate measurements.
        llm: also time the LLM forms (:func:`probe_llm`).

    Raises:
        ImportError: onnx is not installed (it builds the probe graphs).
        RuntimeError: onnxruntime failed (its own error types derive from it).
    """
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    m, k, n = PROBE_COMPUTE_SHAPE
    k_stream, n_stream = PROBE_STREAM_SHAPE
    x = rng.standard_normal((m, k), dtype=np.float32)
    row = rng.standard_normal((1, k_stream), dtype=np.float32)
    each_s = budget_s / 3

    def fastest(model: bytes, inputs: dict[str, np.ndarray],
                before: Callable[[], Any] | None = None) -> float:
        probe = _session(model, threads)  # released on return: one probe graph at a time
        # each eviction reads 1.5x the last-level cache: a few runs, not the whole budget's
        runs = 100 if before is None else EVICTED_RUNS
        return _fastest_s(lambda: probe.run(None, inputs), each_s, runs, before=before)

    def fastest_in(model: bytes, window_s: float) -> float:
        probe = _session(model, threads)
        return _fastest_s(lambda: probe.run(None, {"x": x}), window_s)

    compute = {"fp32": _fp32_matmul_bytes(k, n, rng), "int8": _int8_matmul_bytes(k, n, rng)}
    best = dict.fromkeys(compute, math.inf)
    m_dit, k_dit, n_dit = PROBE_DIT_SHAPE
    dit_model = _fp32_matmul_bytes(k_dit, n_dit, rng)
    dit_x = rng.standard_normal((m_dit, k_dit), dtype=np.float32)
    dit_medians: list[float] = []

    def compute_round() -> None:
        for name, model in compute.items():
            best[name] = min(best[name], fastest_in(model, each_s / COMPUTE_ROUNDS))
        dit = _session(dit_model, threads)
        dit_medians.append(_median_s(lambda: dit.run(None, {"x": dit_x}), DIT_RUNS))

    evict = np.ones(evict_bytes(), dtype=np.uint8)
    llm_models = llm_probe_models() if llm else {}
    llm_rounds: list[LlmCosts] = []

    def llm_round() -> None:
        if llm:
            llm_rounds.append(probe_llm(threads, decode_runs=LLM_ROUND_RUNS, prefill_runs=2,
                                        evict=evict, models=llm_models))

    # the rounds spread over the whole probe, so that a slow or fast second of a shared host
    # weighs one round, not the whole figure
    compute_round()
    llm_round()
    compute_round()
    stream_s = fastest(_int8_matmul_bytes(k_stream, n_stream, rng), {"x": row},
                       before=evict.max)
    for _ in range(LLM_ROUNDS - 1):
        llm_round()
        compute_round()
    llm_models.clear()  # the probe graphs and the eviction buffer go with this frame
    costs = median_costs(llm_rounds) if llm_rounds else None
    fp32_s, int8_s = best["fp32"], best["int8"]
    ops = 2.0 * m * k * n
    dit_ops = 2.0 * m_dit * k_dit * n_dit
    return MachineRates(ops / fp32_s, ops / int8_s, k_stream * n_stream / stream_s, threads,
                        time.perf_counter() - started, costs,
                        dit_ops / float(np.median(dit_medians)))


# --- the LLM graphs of a preset on this machine ------------------------------------------------


SEPARATE_PREFILL_GAIN = 1.5
"""A preset prefills with another LLM graph than it decodes with only when that graph
prefills at least this many times faster: the second graph holds its own 0.36 GB of weights,
worth it where a sentence's prompt then starts decoding hundreds of milliseconds sooner."""


DECODE_CANDIDATE_SPREAD = 2.0
"""The preset's decode graphs whose probed step is within this factor of the fastest one are
timed again at load as the decoder runs them (:class:`LlmPlan` ``candidates``): on the
AVX-512 + AMX test machine the probe read ``fused`` at 0.86-1.80x ``fused-q4`` while a real
step took 1.5x (BENCHMARKS.md "LLM decode graph"), so a reading within 2x does not settle the
order; graphs further apart are not loaded for it."""


@dataclass(frozen=True)
class LlmPlan:
    """The LLM graphs a preset runs on this machine.

    Attributes:
        decode: the graph that decodes (``EngineOptions.llm_graph``).
        prefill: the graph that prefills prompts, or None: the decode graph
            (``EngineOptions.llm_prefill_graph``).
        reason: why, in a few words (the log line).
        candidates: further graphs the engine times real decode steps of at load, ``decode``
            then decoding only if it is the fastest (``EngineOptions.llm_decode_candidates``):
            the preset's decode graphs the probe read within :data:`DECODE_CANDIDATE_SPREAD`
            of the fastest.
    """

    decode: LlmGraph
    prefill: LlmGraph | None = None
    reason: str = ""
    candidates: tuple[LlmGraph, ...] = ()

    @property
    def prefill_graph(self) -> LlmGraph:
        """The graph that prefills (``prefill``, else ``decode``)."""
        return self.prefill or self.decode


def choose_llm_graphs(preset: str, costs: LlmCosts | None) -> LlmPlan:
    """The decode graph among the preset's candidates
    (:attr:`~.options.LlmPreset.decode_graphs`) cheapest per token of a long answer
    (:meth:`LlmCosts.token_s`: two pieces at once where the graph pairs) and, when a
    lossless graph prefills at least :data:`SEPARATE_PREFILL_GAIN` times faster than that one,
    that graph for prefills; the candidates read within :data:`DECODE_CANDIDATE_SPREAD` of it
    per token are timed again at load (``candidates``).
    Without measured costs: the preset's default graph (:attr:`~.options.LlmPreset.graph`).

    Raises:
        KeyError: unknown preset.
    """
    stage = PRESET_STAGES[preset].llm
    if costs is None:
        return LlmPlan(stage.graph, None, "not measured: the preset's default")
    candidates = [g for g in stage.decode_graphs if g in costs.decode_s]
    if not candidates:
        return LlmPlan(stage.graph, None, "its graphs were not measured: the preset's default")
    decode = min(candidates, key=costs.token_s)
    close = tuple(g for g in candidates if g != decode
                  and costs.token_s(g) <= DECODE_CANDIDATE_SPREAD * costs.token_s(decode))
    timed = f"; {', '.join(close)} timed at load" if close else ""
    lossless = [g for g in LOSSLESS_LLM_GRAPHS if g in costs.prefill_s]
    if decode not in costs.prefill_s or not lossless:
        return LlmPlan(decode, None, f"{decode} decodes fastest{timed}", close)
    prefill = min(lossless, key=lambda g: costs.prefill_s[g])
    if prefill == decode:
        return LlmPlan(decode, None, f"{decode} decodes and prefills fastest{timed}", close)
    gain = costs.prefill_s[decode] / costs.prefill_s[prefill]
    if gain >= SEPARATE_PREFILL_GAIN:
        return LlmPlan(decode, prefill, f"{decode} decodes fastest; {prefill} prefills "
                       f"{gain:.1f}x faster{timed}", close)
    return LlmPlan(decode, None, f"{decode} decodes fastest; {prefill} prefills only "
                   f"{gain:.1f}x faster{timed}", close)


# --- the cost model ----------------------------------------------------------------------------


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
        fp32_dit: the float32 work runs at the DiT-sized rate
            (:meth:`MachineRates.dit_fp32_rate`) instead of the peak ``fp32_flops``: a stage
            that is float32 DiT products throughout (``quality``'s flow).
    """

    fp32_gop: float
    int8_gop: float
    int8_gb: float
    efficiency: float
    one_thread: float = 1.0
    fp32_dit: bool = False

    def seconds_per_audio_s(self, rates: MachineRates) -> float:
        """Predicted stage seconds per audio second: the larger of compute and weight
        streaming at ``rates`` (the runs of one stage are all one or the other), times the
        efficiency at ``rates.threads``."""
        fp32_rate = rates.dit_fp32_rate() if self.fp32_dit else rates.fp32_flops
        compute_s = 1e9 * (self.fp32_gop / fp32_rate + self.int8_gop / rates.int8_ops)
        stream_s = 1e9 * self.int8_gb / rates.int8_bytes
        factor = self.efficiency * (self.one_thread if rates.thread_count() == 1 else 1.0)
        return max(compute_s, stream_s) * factor


@dataclass(frozen=True)
class LlmWork:
    """The LLM's work per second of audio of a streamed paragraph and its efficiency against
    the probe's products (:class:`LlmCosts`).

    Attributes:
        tokens: decoded tokens per audio second (25: the speech token rate).
        positions: prefilled positions per audio second (the pieces' prompts).
        decode_efficiency, prefill_efficiency: measured stage seconds / the probe's product
            seconds for the same work (attention, norms, sampling and the step's bookkeeping
            on top of the products), two or more threads.
        one_thread: factors on both with one thread.
    """

    tokens: float
    positions: float
    decode_efficiency: float
    prefill_efficiency: float
    one_thread: float = 1.0

    def seconds_per_audio_s(self, rates: MachineRates, plan: LlmPlan) -> float:
        """Predicted LLM seconds per audio second with ``plan``'s graphs (estimated from the
        rates where the forms were not timed, :meth:`MachineRates.llm_costs`)."""
        costs = rates.llm_costs()
        factor = self.one_thread if rates.thread_count() == 1 else 1.0
        # one row a step: the efficiencies were fitted so, and with the decoding beside the
        # flow two pieces at once did not move the Xeon's predictions out of their error
        # (BENCHMARKS.md "The decode graph that pairs")
        decode = self.tokens * costs.decode_s[plan.decode] * self.decode_efficiency
        prefill = (self.positions * costs.prefill_s[plan.prefill_graph]
                   * self.prefill_efficiency)
        return (decode + prefill) * factor


# Work per audio second of the paragraph streamed as Home Assistant streams it (10 characters
# every 50 ms), 5 s voice prompt, cross-lingual (no prompt speech tokens in the LLM's prompt):
# the flow and vocoder operations are counted on the full-size graphs, the LLM's decoded tokens
# and prefilled positions in the same run (bench/machine_table.py `table`); how the server cuts
# the text into pieces moves the flow's work by about +-8 % and the prefilled positions more.
# Efficiencies: measured stage seconds / seconds at the probed rates or products
# (bench/machine_table.py `efficiencies`), BENCHMARKS.md "The preset that fits the machine".
# Each factor is the geometric mean of two calibration runs an hour apart (the same machine's
# factors moved by up to 1.45x between them: the probe's rates vary more than the stages').
# Per preset where the work differs (the flow's call mix, the LLM's decode graph); the
# vocoder's graph is the same in every preset, so one factor over the three presets' runs.
# One thread: the geometric mean of the presets' factors, and that of the earlier calibrations
# and a later one-thread run on a quiet host (whose stages ran 1.1-1.3x slower against the
# probe than in the earlier runs, where unit tests shared the host).
_LLM_ONE_THREAD = 1.066
_INT8_FLOW_ONE_THREAD = 0.727
# the vocoder's operations: 33.70 GFLOP per audio second counted on the streamed form before
# its lean rewrite (derive/vocoder/hift_lean.py), which does 185.4 of its 202.2 GFLOP per
# 300-frame schedule: 30.90; the efficiency is the one measured before (the rewrite ran
# 1.07-1.11x faster, near its 1.09x fewer operations)
_VOCODER = StageWork(30.90, 0.0, 0.0, 2.40, 0.925)

LLM_WORK: dict[str, LlmWork] = {
    "quality": LlmWork(24.66, 5.83, 1.079, 4.33, _LLM_ONE_THREAD),
    "balanced": LlmWork(24.80, 4.68, 1.079, 3.51, _LLM_ONE_THREAD),
    "fast": LlmWork(24.90, 3.85, 1.095, 2.38, _LLM_ONE_THREAD),
}
"""Preset -> the LLM's work per audio second: tokens, prefilled positions (the pieces'
prompts: shorter pieces on a slower machine prefill more), efficiencies."""
STAGE_WORK: dict[str, dict[str, StageWork]] = {
    "quality": {
        # against the DiT-sized rate, from one calibration run and checked on a second
        # server start (BENCHMARKS.md "The preset that fits the machine")
        "flow": StageWork(1451.0, 0.0, 0.0, 1.162, 0.933, fp32_dit=True),
        "vocoder": _VOCODER,
    },
    "balanced": {
        "flow": StageWork(19.13, 151.2, 0.4232, 2.679, _INT8_FLOW_ONE_THREAD),
        "vocoder": _VOCODER,
    },
    "fast": {
        "flow": StageWork(5.069, 78.27, 0.1978, 3.464, _INT8_FLOW_ONE_THREAD),
        "vocoder": _VOCODER,
    },
}
"""Preset -> the flow's and vocoder's :class:`StageWork` of the streamed benchmark paragraph
on the full-size model: the vocoder runs 30.9 GFLOP per second of audio; the presets differ
in the flow."""


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
    # streamed paragraph, one LLM graph: steady 2.79 GB, peak 6.95 GB (the chunk-causal
    # history of the longest piece, 3.6 MB per mel frame)
    "quality": PresetMemory(2.79e9, 6.95e9),
    "balanced": PresetMemory(1.45e9, 2.08e9),
    "fast": PresetMemory(1.15e9, 1.61e9),
}
"""Preset -> measured memory (full-size synthetic model, 5 s voice prompt, one LLM graph)."""
PREFILL_GRAPH_BYTES = 0.37e9
"""Resident bytes a separate prefill graph adds (the int8 LLM's weights, prepacked)."""


def preset_peak_bytes(preset: str, plan: LlmPlan | None = None) -> float:
    """The preset's measured peak memory, plus a separate prefill graph's weights."""
    extra = PREFILL_GRAPH_BYTES if plan is not None and plan.prefill is not None else 0.0
    return PRESET_MEMORY[preset].peak_bytes + extra


def fitted_plan(preset: str, plan: LlmPlan, available_bytes: float | None) -> LlmPlan:
    """``plan`` within ``available_bytes`` (None: not limited): one LLM graph, nothing timed,
    when the preset's peak with a separate prefill graph does not fit; without the candidates
    timed at load when their weights (:data:`PREFILL_GRAPH_BYTES` each, all loaded while the
    steps are timed) do not fit beside the preset's peak."""
    if available_bytes is None:
        return plan
    if plan.prefill is not None and preset_peak_bytes(preset, plan) > available_bytes:
        return LlmPlan(plan.decode, None, "one LLM graph: a second does not fit in memory")
    extra = [g for g in plan.candidates if g != plan.prefill]
    if extra and (preset_peak_bytes(preset, plan) + len(extra) * PREFILL_GRAPH_BYTES
                  > available_bytes):
        return LlmPlan(plan.decode, plan.prefill,
                       f"{plan.reason}; nothing timed at load: it does not fit in memory")
    return plan


SPLIT_OVERLAP = 0.6
"""With ``EngineOptions.split_cores``, the fraction of the shorter kind of work (the LLM's, or
the flow's and vocoder's together) that still adds to the longer one's time: the two run at
once, each slower than alone because they share the cores and the memory bus, and the flow
waits for the LLM's first tokens. Fitted to ``balanced``'s streamed paragraph through the
server on the 2-core Xeon of BENCHMARKS.md ("Both cores busy"): 0.61 from the stage seconds
measured without the option in the same run, 0.62 in a later run from the stages predicted
at its server's probe (``python -m bench.machine_table check``, column "overlap that fits")."""


@dataclass(frozen=True)
class StageSplit:
    """Predicted seconds per audio second of the two kinds of work ``split_cores`` runs at
    once.

    Attributes:
        llm_s: the LLM: prefill and decoding (memory-bound).
        stages_s: the flow and the vocoder (compute-bound).
    """

    llm_s: float
    stages_s: float

    def rtf(self, split_cores: bool) -> float:
        """The real-time factor: the sum one after the other; with ``split_cores`` the longer
        kind plus :data:`SPLIT_OVERLAP` of the shorter."""
        if not split_cores:
            return self.llm_s + self.stages_s
        return (max(self.llm_s, self.stages_s)
                + SPLIT_OVERLAP * min(self.llm_s, self.stages_s))


def predict_split(rates: MachineRates, preset: str, plan: LlmPlan | None = None) -> StageSplit:
    """Predicted seconds per audio second of the LLM and of the flow with the vocoder for
    ``preset`` on a streamed paragraph at ``rates`` with ``plan``'s LLM graphs (default
    :func:`choose_llm_graphs` for ``rates``), each as if it ran alone.

    Raises:
        KeyError: ``preset`` has no cost table.
    """
    plan = plan or choose_llm_graphs(preset, rates.llm)
    return StageSplit(LLM_WORK[preset].seconds_per_audio_s(rates, plan),
                      sum(stage.seconds_per_audio_s(rates)
                          for stage in STAGE_WORK[preset].values()))


def predict_rtf(rates: MachineRates, preset: str, plan: LlmPlan | None = None,
                split_cores: bool = False) -> float:
    """Predicted real-time factor (seconds of work per second of audio) of ``preset`` on a
    streamed paragraph at ``rates``, with ``plan``'s LLM graphs (default
    :func:`choose_llm_graphs` for ``rates``), the LLM decoding beside the flow with
    ``split_cores`` (:meth:`StageSplit.rtf`).

    Raises:
        KeyError: ``preset`` has no cost table.
    """
    return predict_split(rates, preset, plan).rtf(split_cores)


@dataclass(frozen=True)
class PresetChoice:
    """What ``--preset auto`` chose and why.

    Attributes:
        preset: the chosen preset.
        predicted_rtf: preset -> predicted RTF (empty when the probe failed).
        rates: the probe's rates (None when it failed).
        available_bytes: memory available to this process when it chose (None: unknown).
        reason: why this preset, in a few words.
        plan: the chosen preset's LLM graphs (None when the probe failed).
        split_cores: the predictions are for the LLM decoding beside the flow
            (``EngineOptions.split_cores``).
    """

    preset: str
    predicted_rtf: dict[str, float] = field(default_factory=dict)
    rates: MachineRates | None = None
    available_bytes: float | None = None
    reason: str = ""
    plan: LlmPlan | None = None
    split_cores: bool = False

    @property
    def keeps_up(self) -> bool:
        """The prediction says the preset keeps up with playback with the margin for its own
        error (:func:`keeps_up_rtf`)."""
        rtf = self.predicted_rtf.get(self.preset)
        return rtf is not None and rtf <= keeps_up_rtf(self.preset)

    def summary(self) -> str:
        """The one line the server logs and the voice page shows."""
        rtf = self.predicted_rtf.get(self.preset)
        if rtf is None or self.rates is None:
            return f"preset auto took `{self.preset}`: {self.reason}"
        speed = 1.0 / rtf if rtf > 0 else math.inf
        others = ", ".join(f"{name} {value:.2f}" for name, value in self.predicted_rtf.items()
                           if name != self.preset)
        if self.keeps_up:
            outlook = ("short answers play without pauses; a long one may pause between its "
                       "first sentences")
        elif rtf <= 1.0:
            outlook = ("about as fast as playback: long answers may pause between sentences "
                       "(the prediction errs by up to "
                       f"{PREDICTION_ERRORS[self.preset]:.0%})")
        else:
            outlook = "expect pauses between sentences on long answers"
        memory = ("" if self.available_bytes is None
                  else f", {self.available_bytes / 1e9:.1f} GB available")
        llm = "" if self.plan is None else f"; LLM {self.plan.decode}" + (
            f" (prefill {self.plan.prefill})" if self.plan.prefill else "") + (
            ", decoding beside the flow" if self.split_cores else "")
        return (f"preset auto took `{self.preset}`: this machine makes speech at about "
                f"{speed:.2g}x playback speed with it (predicted RTF {rtf:.2f}; {others}; "
                f"{self.rates.describe()}, {self.rates.threads or 'default'} threads"
                f"{memory}{llm}); {outlook}")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form for the voice page (the predictions unrounded: the page shows them
        to two decimals as :meth:`summary` does, and a value rounded twice can differ, e.g.
        2.2849 -> 2.285 -> 2.29 against 2.28)."""
        return {
            "preset": self.preset,
            "predicted_rtf": dict(self.predicted_rtf),
            "keeps_up": self.keeps_up,
            "reason": self.reason,
            "summary": self.summary(),
        }


def choose_preset(rates: MachineRates, available_bytes: float | None,
                  split_cores: bool = False) -> PresetChoice:
    """The most exact preset that keeps up with playback and fits in memory.

    Args:
        rates: this machine's rates (:func:`probe_rates`, with LLM costs).
        available_bytes: memory this process may still use; None: not limited.
        split_cores: the engine will decode beside the flow (``EngineOptions.split_cores``;
            :meth:`StageSplit.rtf`).

    Returns:
        The choice: the first of :data:`PRESET_ORDER` with predicted RTF <=
        :func:`keeps_up_rtf` whose peak memory fits; else the preset predicted fastest of
        those that fit when its prediction is at most ``1 + PREDICTION_ERRORS[preset]`` (the
        prediction errs both ways: on the Zen 4 EPYC ``fast`` was predicted at 1.04-1.09
        and made speech at RTF 0.71-0.84, BENCHMARKS.md "The decode graph that pairs");
        else :data:`FALLBACK_PRESET` when it fits; else the cheapest preset that fits; else
        the one with the smallest peak. A preset whose separate prefill graph does not fit
        runs with one LLM graph.
    """

    def plan_for(name: str) -> LlmPlan:
        return fitted_plan(name, choose_llm_graphs(name, rates.llm), available_bytes)

    plans = {name: plan_for(name) for name in PRESET_ORDER}
    predicted = {name: predict_rtf(rates, name, plans[name], split_cores)
                 for name in PRESET_ORDER}

    def fits(name: str) -> bool:
        return available_bytes is None or preset_peak_bytes(name, plans[name]) <= available_bytes

    def choice(name: str, reason: str) -> PresetChoice:
        return PresetChoice(name, predicted, rates, available_bytes, reason, plans[name],
                            split_cores)

    for name in PRESET_ORDER:
        if predicted[name] <= keeps_up_rtf(name) and fits(name):
            return choice(name, "the most exact preset that keeps up with playback (with the "
                                "prediction's margin) and fits in memory")
    fitting = [name for name in PRESET_ORDER if fits(name)]
    if fitting:
        quickest = min(fitting, key=lambda name: predicted[name])
        if predicted[quickest] <= 1.0 + PREDICTION_ERRORS[quickest]:
            return choice(quickest, "no preset keeps up with the prediction's margin; the "
                                    "fastest is predicted within the prediction's error of "
                                    "real time")
    if fits(FALLBACK_PRESET):
        return choice(FALLBACK_PRESET, "no preset keeps up with playback with the "
                                       "prediction's margin")
    if fitting:  # the cheapest that fits
        return choice(fitting[-1], "no preset keeps up with playback and "
                                   f"`{FALLBACK_PRESET}` needs more memory")
    smallest = min(PRESET_ORDER, key=lambda name: PRESET_MEMORY[name].peak_bytes)
    return choice(smallest, "no preset fits in the available memory; the smallest one")
