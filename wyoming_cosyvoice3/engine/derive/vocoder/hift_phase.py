"""The phase-carrying vocoder graph: ``hift.onnx`` with its harmonic source's phase as state.

Why: CausalHiFTGenerator's harmonic source (cosyvoice/hifigan/generator.py ``SineGen2``,
``causal=True``) accumulates phase over the whole utterance: per mel frame ``rad = (f0 h /
24000) mod 1`` for harmonics h = 1..9, ``phase = 2 pi 480 cumsum(rad)``. Everything else in the
generator is convolutions with a bounded receptive field. A vocoder that sees only a left
window of the mel therefore restarts the phase at the window start and its harmonics come
out phase-shifted against the one-call audio (the windowed ``balanced``/``fast`` vocoder's
10 dB waveform SNR in BENCHMARKS.md). With the phase of the window's already-emitted frames
given as an input, a windowed call computes what one call over the whole mel computes.

The derived graph is ``hift.onnx``, its nodes upstream of the accumulated phase rewritten so
that they round the same at every call length (:mod:`.hift_exact`; the streamed vocoder
carries the same rewrite, so its chunks equal this graph's one call), plus one input and one
output:

* ``phase_carry`` float32 [1, W, H]: the accumulated phase (the CumSum's units, H harmonic
  channels) of the first W mel frames of ``speech_feat``, taken from earlier calls; W = 0
  gives exactly the one-call graph's computation (:func:`.hift_exact.exact_one_call`), which
  differs from ``hift.onnx``'s only by float rounding (checked on the source's rad values,
  :data:`.hift_exact.MAX_RAD_DIFFERENCE`);
* ``source_phase`` float32 [1, M, H]: the accumulated phase of every frame of this call:
  ``phase_carry`` for the first W frames, then ``phase_carry[W-1] + cumsum(rad)[j] -
  cumsum(rad)[W-1]`` (the graph's own cumsum continued from the carried value).

Found by structure: the graph's only ``CumSum`` (over axis 1) whose output reaches a ``Sin``
through scalar ``Mul``/``Div`` and value-preserving nodes (``Transpose``, nearest ``Resize``,
``Reshape``, ``Tile``, ...); the product of those scalars is the radians per CumSum unit, so
the host can keep the carried phase modulo one period (:attr:`PhaseCarryReport.period`)
instead of letting it grow (upstream's float32 phase loses about 0.03 rad of precision by
30 s of audio; the carried one does not).

Validated when derived, on seeded random mel (:func:`validate`): with W = 0 the outputs equal
the one-call graph's; adding one period to the carry changes the output only by float
rounding (a wrong period would change it by order 1); a windowed call with the carry
reproduces the one-call magnitude over its new frames within
:data:`MAX_WINDOW_REL_ERROR` (the same call without the carry is recorded for comparison).
Any failure raises :class:`ModelLoadError`; the caller keeps ``hift.onnx`` with one warning.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ... import constants as C
from ...errors import ModelLoadError
from ...graphs import HIFT, Graph, GraphSpec
from ..common.files import derive_reported, run_child, validation_session
from ..common.forms import Form
from ..common.graph import GraphIndex
from .hift_exact import MAX_RAD_DIFFERENCE, exact_one_call, rad_difference

logger = logging.getLogger(__name__)

PHASE_TAG = "phase2"
"""File tag of the derived graph (bumped when the recipe changes)."""
CARRY_INPUT = "phase_carry"
PHASE_OUTPUT = "source_phase"
PHASE_HIFT = GraphSpec(
    HIFT.file,
    {**HIFT.inputs, CARRY_INPUT: "float32"},
    {**HIFT.outputs, PHASE_OUTPUT: "float32"},
)
"""Signature of the derived graph (file name kept: logs and errors name the published one)."""
PASS_THROUGH_OPS = frozenset(
    {"Transpose", "Resize", "Reshape", "Tile", "Unsqueeze", "Squeeze", "Identity", "Expand"}
)
"""Ops between the CumSum and the Sin that move values without changing them."""
MAX_CHAIN_NODES = 16
VALIDATION_FRAMES = 96
"""Mel frames of the validation input: a first call over 64, then a windowed call."""
VALIDATION_WINDOW_FRAMES = 32
"""Left window of the validation's second call (beyond the receptive fields measured:
16 frames on the upstream-exported parity model, 24 on the full-size synthetic one)."""
MAX_WINDOW_REL_ERROR = 0.05
"""Largest accepted |magnitude difference| / max |magnitude| of the windowed call with carry
against one call, and of a carry shifted by one period against the carry (measured: 2e-4
parity model, 9e-3 full-size synthetic, whose float32 phase rounding its random weights
amplify; without the carry 0.09 on the parity model)."""
EXACT_REL = 1e-5
"""W = 0: largest accepted relative difference from the one-call graph (float rounding)."""


@dataclass(frozen=True)
class PhaseCarryReport:
    """What the derivation found and measured.

    Attributes:
        harmonics: H, channels of ``phase_carry`` / ``source_phase`` (9 upstream).
        period: CumSum units per 2 pi of source phase (``2 pi / product of the scalars``
            between the CumSum and the Sin; upstream ``1 / 480``).
        exact_rel: W = 0 against the one-call graph: max |difference| / max |value|.
        published_rad: the one-call graph against ``hift.onnx`` on the source's rad values
            (the CumSum's input; :func:`.hift_exact.rad_difference`).
        window_rel: windowed call with the carry against one call (magnitude, new frames).
        window_rel_without: the same windowed call with the phase restarted (no carry).
        derive_s: seconds to derive and validate.
    """

    harmonics: int
    period: float
    exact_rel: float
    published_rad: float
    window_rel: float
    window_rel_without: float
    derive_s: float


def find_phase_cumsum(gr: GraphIndex) -> tuple[Any, float]:
    """The source's CumSum node and the radians per CumSum unit (see module docstring).

    Raises:
        ModelLoadError: no single CumSum over axis 1 reaching a Sin through scalar Mul/Div
            and value-preserving nodes.
    """
    cumsums = [node for node in gr.g.node if node.op_type == "CumSum"]
    if len(cumsums) != 1:
        raise ModelLoadError(f"expected one CumSum (the harmonic source), found {len(cumsums)}")
    node = cumsums[0]
    axis = gr.const(node.input[1])
    if axis is None or int(np.asarray(axis).reshape(-1)[0]) != 1:
        raise ModelLoadError("the source's CumSum does not run over axis 1 (frames)")
    if gr.attr(node, "exclusive", 0) or gr.attr(node, "reverse", 0):
        raise ModelLoadError("the source's CumSum is exclusive or reversed")
    radians, name = 1.0, node.output[0]
    for _ in range(MAX_CHAIN_NODES):
        users = gr.consumers.get(name, [])
        if len(users) != 1:
            raise ModelLoadError("the source phase feeds more than one node before its Sin")
        user = users[0]
        if user.op_type == "Sin":
            if not (np.isfinite(radians) and radians != 0.0):
                raise ModelLoadError("the source phase scale is not a finite non-zero number")
            return node, radians
        if user.op_type in ("Mul", "Div"):
            other = user.input[1] if user.input[0] == name else user.input[0]
            value = gr.const(other)
            divides_it = user.op_type == "Div" and other == user.input[0]
            if value is None or value.size != 1 or divides_it:
                raise ModelLoadError(f"the source phase is scaled by a non-constant {user.op_type}")
            scalar = float(np.asarray(value, dtype=np.float64).reshape(-1)[0])
            radians = radians * scalar if user.op_type == "Mul" else radians / scalar
        elif user.op_type not in PASS_THROUGH_OPS or (
            user.op_type == "Resize" and gr.attr(user, "mode", b"nearest") != b"nearest"
        ):
            raise ModelLoadError(f"unexpected {user.op_type} between the source CumSum and Sin")
        name = user.output[0]
    raise ModelLoadError("no Sin within reach of the source CumSum")


def add_phase_carry(model: Any) -> tuple[Any, float]:
    """Rewrite ``model`` (onnx.ModelProto, changed in place) into the phase-carrying graph.

    Returns:
        (the model, radians per CumSum unit).

    Raises:
        ModelLoadError: structure not recognised (:func:`find_phase_cumsum`).
    """
    from onnx import TensorProto, helper, numpy_helper

    gr = GraphIndex(model)
    if CARRY_INPUT in gr.inputs:
        raise ModelLoadError(f"the graph already has an input {CARRY_INPUT}")
    cumsum, radians = find_phase_cumsum(gr)
    raw = cumsum.output[0]
    for node in model.graph.node:  # every reader of the cumsum reads the carried phase
        if node is not cumsum:
            for i, name in enumerate(node.input):
                if name == raw:
                    node.input[i] = PHASE_OUTPUT

    def ints(name: str, values: list[int]) -> Any:
        array = np.asarray(values, dtype=np.int64)
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))

    p = "phase_carry/"  # W = carry frames; u = the graph's own cumsum over the call's frames
    nodes = [
        helper.make_node("Shape", [CARRY_INPUT], [p + "w"], start=1, end=2),
        ints(p + "one", [1]),
        ints(p + "axis", [1]),
        ints(p + "end", [2**62]),
        helper.make_node("Sub", [p + "w", p + "one"], [p + "w_1"]),
        # u[W-1] and carry[W-1]; both slices are empty (sum 0) when W = 0
        helper.make_node("Slice", [raw, p + "w_1", p + "w", p + "axis"], [p + "u_at"]),
        helper.make_node("ReduceSum", [p + "u_at", p + "axis"], [p + "u_base"], keepdims=1),
        helper.make_node("Slice", [CARRY_INPUT, p + "w_1", p + "w", p + "axis"], [p + "c_at"]),
        helper.make_node("ReduceSum", [p + "c_at", p + "axis"], [p + "c_last"], keepdims=1),
        helper.make_node("Slice", [raw, p + "w", p + "end", p + "axis"], [p + "u_new"]),
        helper.make_node("Sub", [p + "u_new", p + "u_base"], [p + "u_rel"]),
        helper.make_node("Add", [p + "u_rel", p + "c_last"], [p + "u_cont"]),
        helper.make_node("Concat", [CARRY_INPUT, p + "u_cont"], [PHASE_OUTPUT], axis=1),
    ]
    at = list(model.graph.node).index(cumsum) + 1
    for offset, node in enumerate(nodes):
        model.graph.node.insert(at + offset, node)
    model.graph.input.append(
        helper.make_tensor_value_info(CARRY_INPUT, TensorProto.FLOAT, [1, "carry_frames", None])
    )
    model.graph.output.append(
        helper.make_tensor_value_info(PHASE_OUTPUT, TensorProto.FLOAT, [1, "num_frames", None])
    )
    return model, radians


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    scale = float(np.abs(a).max()) or 1.0
    return float(np.abs(np.asarray(a, np.float64) - b).max()) / scale


def validate(source: Path, one_call: Any, derived: Any, radians: float, seed: int = 0
             ) -> PhaseCarryReport:
    """Run the checks of the module docstring on seeded random input; the report.

    Args:
        source: ``hift.onnx``; one_call: the one-call graph (onnx.ModelProto,
            :func:`.hift_exact.exact_one_call`); derived: the phase-carrying graph.

    Raises:
        ModelLoadError: a check failed.
    """
    import onnx

    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    frames, spf = VALIDATION_FRAMES, C.SAMPLES_PER_MEL_FRAME
    mel = (rng.standard_normal((1, C.MEL_BINS, frames)) - 5.0).astype(np.float32)
    noise = rng.random((1, spf * frames, C.HARMONIC_CHANNELS), dtype=np.float32)
    try:
        rad = rad_difference(onnx.load(str(source)), one_call,
                             {"speech_feat": mel, "noise": noise})
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelLoadError(f"the one-call hift does not run: {exc}") from exc
    if not rad <= MAX_RAD_DIFFERENCE:
        raise ModelLoadError(f"the one-call hift's source differs from hift.onnx's by {rad:.3g}")
    published, ours = validation_session(one_call), validation_session(derived)
    reference = published.run(["magnitude", "phase"], {"speech_feat": mel, "noise": noise})
    del published
    names = ["magnitude", "phase", PHASE_OUTPUT]

    def run(first: int, carry: np.ndarray) -> list[np.ndarray]:
        feeds = {"speech_feat": mel[:, :, first:], "noise": noise[:, spf * first :],
                 CARRY_INPUT: np.ascontiguousarray(carry, dtype=np.float32)}
        return list(ours.run(names, feeds))

    harmonics = C.HARMONIC_CHANNELS  # the source noise's channels: one per harmonic
    empty = np.zeros((1, 0, harmonics), np.float32)
    try:
        whole = run(0, empty)
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelLoadError(f"the phase-carrying hift does not run: {exc}") from exc
    exact = max(_rel(reference[i], whole[i]) for i in range(2))
    if whole[2].shape[1:] != (frames, harmonics) or not exact <= EXACT_REL:
        raise ModelLoadError(
            f"the phase-carrying hift differs from the one-call graph without a carry "
            f"({exact:.3g}) or "
            f"its source phase is not [frames, harmonics] ({whole[2].shape[1:]})"
        )
    emitted = 64 - C.VOCODER_RIGHT_CONTEXT_FRAMES  # frames final after a first call over 64
    first = emitted - VALIDATION_WINDOW_FRAMES
    carry = whole[2][:, first:emitted]
    period = 2.0 * np.pi / abs(radians)
    windowed = run(first, carry)
    shifted = run(first, carry + np.float32(period))
    restarted = run(first, empty)
    stft_frames = C.SAMPLES_PER_MEL_FRAME // C.ISTFT_HOP
    new = slice(stft_frames * (emitted - first), stft_frames * (frames - first))
    target = reference[0][:, :, stft_frames * emitted : stft_frames * frames]
    report = PhaseCarryReport(
        harmonics=harmonics,
        period=float(period),
        exact_rel=exact,
        published_rad=rad,
        window_rel=_rel(target, windowed[0][:, :, new]),
        window_rel_without=_rel(target, restarted[0][:, :, new]),
        derive_s=time.perf_counter() - started,
    )
    shift_rel = _rel(windowed[0], shifted[0])
    if not (report.window_rel <= MAX_WINDOW_REL_ERROR and shift_rel <= MAX_WINDOW_REL_ERROR):
        raise ModelLoadError(
            f"the phase-carrying hift does not continue the phase: windowed call off by "
            f"{report.window_rel:.3g} (allowed {MAX_WINDOW_REL_ERROR}), one period of carry "
            f"changes it by {shift_rel:.3g}"
        )
    return report


def write_phase_hift(source: Path, graph: Path, report_json: Path) -> PhaseCarryReport:
    """Derive, validate and write the phase-carrying graph of ``source`` and its report
    (run in the derivation child process, :mod:`..child`).

    Raises:
        ModelLoadError: structure not recognised or a check failed.
    """
    import onnx

    started = time.perf_counter()
    try:
        one_call, _, _ = exact_one_call(onnx.load(str(source)))
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelLoadError(f"the vocoder does not run for probing: {exc}") from exc
    model = onnx.ModelProto()
    model.CopyFrom(one_call)
    model, radians = add_phase_carry(model)
    report = validate(source, one_call, model, radians)
    report = PhaseCarryReport(**{**asdict(report), "derive_s": time.perf_counter() - started})
    onnx.save(model, str(graph))
    report_json.write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    return report


def has_op_name(path: Path, op_type: bytes) -> bool:
    """Whether ``op_type`` occurs anywhere in the bytes of the ONNX file ``path``: a necessary
    condition for a node of that type (operator names are stored as plain strings), checked
    by scanning the file without parsing it (tens of milliseconds for the published 83 MB
    hift.onnx, no model in memory), so a graph without one needs no derivation process."""
    import mmap

    try:
        with path.open("rb") as handle, mmap.mmap(
            handle.fileno(), 0, access=mmap.ACCESS_READ
        ) as m:
            return m.find(op_type) >= 0
    except (OSError, ValueError):  # unreadable or empty: the derivation reports the problem
        return True


def ensure_phase_hift(
    source: Path, cache_dir: Path, *, in_process: bool = False
) -> tuple[Path, PhaseCarryReport]:
    """Path of the phase-carrying graph of ``source`` (derived and validated once, in a child
    process unless ``in_process``; :func:`~..common.files.derive_reported`) and its report.

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: not derivable or not valid (now or in an earlier attempt).
    """

    def make(tmps: list[Path]) -> None:
        report_json, graph = tmps
        if not has_op_name(source, b"CumSum"):
            raise ModelLoadError(f"{source.name} has no CumSum: no harmonic source to carry")
        if in_process:
            write_phase_hift(source, graph, report_json)
        else:
            run_child(["hift", str(source), str(graph), str(report_json)])

    (_, target), report = derive_reported(
        source, cache_dir, [(PHASE_TAG, ".onnx.json"), (PHASE_TAG, ".onnx")], make,
        PhaseCarryReport, report_index=0, name="phase-carrying vocoder",
    )
    return target, report


PHASE_WARNING = ("phase-carrying vocoder not used (%s); windowed vocoder calls restart the "
                 "harmonic phase")
"""The fallback warning of this form (:class:`~..common.forms.Form`)."""


def open_phase_hift(
    source: Path, cache_dir: Path, threads: int, providers: tuple[str, ...], spin_wait: bool
) -> tuple[Graph, PhaseCarryReport]:
    """The phase-carrying vocoder graph of ``source`` (derived once, :func:`ensure_phase_hift`)
    opened as a checked :class:`~...graphs.Graph`, and its report.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: not derivable, not valid or
            not loadable (the caller falls back to ``source``).
    """
    path, report = ensure_phase_hift(source, cache_dir)
    graph = Graph(path, PHASE_HIFT, threads, providers, spin_wait=spin_wait)
    logger.info(
        "vocoder: phase-carrying graph of %s (windowed call off by %.2g of one call; %.2g "
        "with the phase restarted)", source.name, report.window_rel, report.window_rel_without,
    )
    return graph, report


def load_phase_hift(
    source: Path, cache_dir: Path, threads: int, providers: tuple[str, ...], spin_wait: bool
) -> tuple[Graph, PhaseCarryReport] | None:
    """:func:`open_phase_hift`, or None after ONE warning (:data:`PHASE_WARNING`)."""
    form = Form("phase-carrying vocoder", warning=PHASE_WARNING, open=lambda _cache: (
        open_phase_hift(source, cache_dir, threads, providers, spin_wait)))
    return form.attempt(source.parent, cache_dir)
