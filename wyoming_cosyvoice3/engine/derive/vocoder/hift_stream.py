"""The streamed vocoder graph: ``hift.onnx`` with its convolution context carried as state.

Why: a streamed vocoder call over a left window re-runs the window's frames and holds back
the right-context frames (about 1.3x the one-call cost, BENCHMARKS.md "Streamed vocoder").
CausalHiFTGenerator (FunAudioLLM/CosyVoice ace7c47, ``cosyvoice/hifigan/generator.py``) is a
chain of convolutions whose only long-range state is the harmonic source's accumulated phase;
each convolution's padding is zeros (``cosyvoice/transformer/convolution.py`` ``CausalConv1d``,
``CausalConv1dUpsample``, ``CausalConv1dDownSample``) or a reflection (the source STFT's
``center=True`` in ``HiFTGenerator._stft``, ``reflection_pad`` in ``decode``). With the
context each convolution needs carried between calls, every call runs only its new mel
frames and the concatenated outputs equal one call over the whole mel.

The derived graph is ``hift.onnx`` plus these inputs and outputs:

* ``stream_first``, ``stream_final`` int64 [1] (0 or 1): this call is the utterance's first /
  last. Left paddings are applied on the first call only, right paddings on the last only;
  a call that is both computes exactly what the one-call graph computes (``hift.onnx`` with
  the rewrite below, :func:`.hift_exact.exact_one_call`).
* ``stream_state_in.<i>`` / ``stream_state_out.<i>`` float32 (the time axis dynamic): one
  per state, fed back unchanged on the next call; every state starts empty (time length 0):
  ``state_shapes`` in the report gives the other dims. Three kinds:

  - convolution context: the convolution's padded input not yet consumed by its output
    frames (``k_eff - stride`` frames in steady state; strided convolutions keep the stride
    phase because the state is exactly the unconsumed tail);
  - delay line: at a node joining two streams with different look-ahead (the generator's
    main path waits for ``conv_pre``'s 4 right frames, the source path only for the f0
    predictor's 3, plus the STFT's half window), the earlier stream is delayed by the
    difference; the last call flushes it;
  - phase carry: the source's ``CumSum`` continues from the last accumulated value of the
    previous call (prepended to its input, so the float32 sums are the one call's).

``speech_feat`` takes the call's new mel frames and ``noise`` their 480 noise rows per frame
(the graph's ``Slice`` of ``noise`` to the source length is bypassed: each call's noise
matches its mel). ``magnitude`` and ``phase`` return the next STFT frames of the one-call
output: after M mel frames in non-final calls, ``120 (M - lookahead) + 1`` frames in total
(``lookahead_frames``: 4 upstream), and the rest on the final call.

The nodes upstream of the source's ``CumSum`` are rewritten as in the one-call graph the
product runs (:mod:`.hift_exact`: onnxruntime's Conv, MatMul and linear Resize otherwise round
the f0 path differently per call length, and the accumulated phase multiplies one ulp of it
into up to 1e-3 of audio); streamed calls and one call then add the same numbers in the same
order on that path, and elsewhere differ only by float rounding that nothing amplifies.

The generator is first rewritten to do less work for the same numbers up to float rounding
(:mod:`.hift_lean`: upsampling convolutions at the low rate, Snakes without their scalings), as
in the one-call graph; the validation also bounds that graph's audio against the one-call graph
without these rewrites (the same :data:`MAX_ABS`).

Found by structure: padding sites are the ``pads`` attribute of a ``Conv``, a ``Pad`` node,
or a ``Concat`` on the last axis with a zero ``ConstantOfShape`` block; the look-ahead of
each stream at every joining node is measured on the published graph by perturbing the last
mel frames (and their noise) and finding the first output frame that changes. Validated when
derived (:func:`validate`) on the audio the host makes (magnitude clipped at 100, iSTFT n_fft 16
hop 4, clamp at 0.99; :func:`_audio`): streamed calls for several random splits (1-frame chunks
and a split inside the look-ahead included) equal one call of the one-call graph within
:data:`MAX_ABS`. The raw ``phase`` output is not compared: it is an angle (a wrap moves it by
2 pi at no audio change) and where the magnitude is small its rounding does not reach the
audio. Any failure raises :class:`ModelLoadError`; the caller keeps the windowed vocoder with
one warning.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ... import constants as C
from ...errors import ModelLoadError
from ...istft import istft
from ...sessions import HIFT, Graph, GraphSpec
from ..common.files import derive_reported, run_child, validation_session
from ..common.forms import Form
from ..common.graph import GraphIndex
from .hift_exact import (
    MAX_RAD_DIFFERENCE,
    exact_one_call,
    exact_phase_path,
    probe_feeds,
    rad_difference,
    weight_shapes,
)
from .hift_lean import lean_generator

logger = logging.getLogger(__name__)

STREAM_TAG = "stream4"
"""File tag of the derived graph (bumped when the recipe changes)."""
FIRST_INPUT = "stream_first"
FINAL_INPUT = "stream_final"
STATE_IN = "stream_state_in."
STATE_OUT = "stream_state_out."
INT_END = 2**62
PROBE_FRAMES = 48
"""Mel frames of the look-ahead probe (longer than any receptive field's right part)."""
VALIDATION_FRAMES = 90
MAX_ABS = 1e-4
"""Accepted |streamed - one call| on the audio (full scale 1). Measured (90 frames, seed 1,
one thread): 1e-6 on the upstream-exported parity models, 2.4e-5 on the full-size synthetic
model (its random weights amplify the rest of the generator's rounding); without the
:mod:`.hift_exact` rewrite 2.4e-4, 4.2e-4 and 1.25e-3."""
FLOOR_PREFIXES = (0.25, 0.4, 0.5, 0.6, 0.75)
"""Prefixes (fractions of the validation mel) whose one call of ``hift.onnx`` measures its own
rounding per call length (recorded in the report, not a bound)."""
MAX_FIRST_FRAMES = 32
"""Largest first call searched for the smallest one that runs (reflection pads need some)."""
ELEMENTWISE_JOIN = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Concat"})
"""Nodes whose data inputs must cover the same frames (a delay line aligns them)."""


@dataclass(frozen=True)
class StreamReport:
    """What the derivation found and measured.

    Attributes:
        state_shapes: per state index, its dims with the time axis as -1 (start empty).
        state_axes: per state index, its time axis.
        state_kinds: per state index, ``conv``, ``delay``, ``phase`` or ``pad``.
        lookahead_frames: mel frames a non-final call holds back (4 upstream: ``conv_pre``).
        min_first_frames: fewest mel frames the first non-final call needs.
        max_abs_audio: largest |streamed - one call| over the validation splits, on the
            host's samples (magnitude clipped at 100, iSTFT, clamp at 0.99; full scale 1).
        floor_prefix_audio: the same for one call of ``hift.onnx`` over prefixes of the mel
            (:data:`FLOOR_PREFIXES`) against one call of it over all of it (onnxruntime's own
            rounding per call length, which the rewrite of :mod:`.hift_exact` removes).
        published_audio: one call of the one-call graph against one call of ``hift.onnx``.
        lean_audio: one call of the one-call graph against one call of it without
            :mod:`.hift_lean`'s rewrites (their rounding; checked against ``allowed_audio``).
        published_rad: the same on the source's rad values (the CumSum's input).
        allowed_audio: the bound ``max_abs_audio`` was checked against (:data:`MAX_ABS`).
        splits: the validated splits (mel frames per call).
        derive_s: seconds to derive and validate.
    """

    state_shapes: list[list[int]]
    state_axes: list[int]
    state_kinds: list[str]
    lookahead_frames: int
    min_first_frames: int
    max_abs_audio: float
    floor_prefix_audio: float
    published_audio: float
    published_rad: float
    allowed_audio: float
    splits: list[list[int]] = field(default_factory=list)
    derive_s: float = 0.0
    lean_audio: float = 0.0


def stream_spec(n_states: int) -> GraphSpec:
    """Signature of the derived graph with ``n_states`` states."""
    inputs = {**HIFT.inputs, FIRST_INPUT: "int64", FINAL_INPUT: "int64"}
    outputs = dict(HIFT.outputs)
    for i in range(n_states):
        inputs[f"{STATE_IN}{i}"] = "float32"
        outputs[f"{STATE_OUT}{i}"] = "float32"
    return GraphSpec(HIFT.file, inputs, outputs)


@dataclass
class _PadSite:
    """One padding on the last axis: ``x`` padded by ``left``/``right`` frames (zeros or
    reflection) into ``out``; ``conv`` is the Conv that consumes it (its data input), if
    that is the only consumer."""

    node: Any
    form: str  # "attr" (Conv pads), "pad" (Pad node), "concat" (Concat with a zero block)
    x: str
    out: str
    left: int
    right: int
    mode: str
    conv: Any | None


def _zero_block(gr: GraphIndex, name: str) -> bool:
    """Whether ``name`` is a block of zeros made by ConstantOfShape (through Casts)."""
    node = gr.producer.get(name)
    while node is not None and node.op_type == "Cast":
        node = gr.producer.get(node.input[0])
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = gr.attr(node, "value")
    if value is None:
        return True
    from onnx import numpy_helper

    return bool(np.all(numpy_helper.to_array(value) == 0))


def _pad_candidates(gr: GraphIndex, data: set[str]) -> list[_PadSite]:
    """Padding sites on data tensors (before their widths are known for Pad/Concat)."""
    sites: list[_PadSite] = []
    for node in gr.g.node:
        if node.op_type == "Conv" and node.input[0] in data:
            pads = list(gr.attr(node, "pads", [0, 0]))
            if len(pads) != 2:
                raise ModelLoadError("a Conv is not one-dimensional")
            if gr.attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise ModelLoadError("a Conv uses auto_pad")
            if any(pads):
                sites.append(_PadSite(node, "attr", node.input[0], node.input[0],
                                      pads[0], pads[1], "constant", node))
        elif node.op_type == "Pad" and node.input[0] in data:
            mode = gr.attr(node, "mode", b"constant")
            mode = mode.decode() if isinstance(mode, bytes) else str(mode)
            if mode not in ("constant", "reflect"):
                raise ModelLoadError(f"a Pad in mode {mode}")
            if mode == "constant" and len(node.input) > 2 and node.input[2]:
                value = gr.const(node.input[2])
                if value is None or np.any(value != 0):
                    raise ModelLoadError("a constant Pad with a non-zero value")
            sites.append(_PadSite(node, "pad", node.input[0], node.output[0], -1, -1, mode, None))
        elif node.op_type == "Concat" and len(node.input) == 2:
            axis = gr.attr(node, "axis")
            a, b = node.input
            zero_a, zero_b = _zero_block(gr, a), _zero_block(gr, b)
            if axis in (2, -1) and (zero_a != zero_b) and (a in data or b in data):
                x = b if zero_a else a
                sites.append(_PadSite(node, "concat", x, node.output[0], -1 if zero_a else 0,
                                      0 if zero_a else -1, "constant", None))
    for site in sites:
        if site.conv is None:
            users = gr.consumers.get(site.out, [])
            if len(users) == 1 and users[0].op_type == "Conv" and users[0].input[0] == site.out:
                if any(gr.attr(users[0], "pads", [0, 0])):
                    raise ModelLoadError("a Conv padded both outside and inside")
                site.conv = users[0]
    return sites


def _data_tensors(gr: GraphIndex, sources: tuple[str, ...]) -> set[str]:
    """Tensors computed from ``sources`` through data edges (Shape outputs are sizes)."""
    data = set(sources)
    for node in gr.g.node:
        if node.op_type in ("Shape", "Size", "Constant"):
            continue
        if any(i in data for i in node.input if i):
            data.update(node.output)
    return data


def _run_probe(model: Any, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Run ``model`` (onnx.ModelProto, not changed) with ``names`` exposed as outputs."""
    import onnx

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
            existing.add(name)
    session = validation_session(probe, optimize=False)
    return dict(zip(names, session.run(names, feeds), strict=True))


@dataclass
class _Plan:
    sites: list[_PadSite]
    widths: dict[int, tuple[int, int]]  # site index -> (left, right)
    channels: dict[int, list[int]]  # site index -> shape of x (time axis included)
    joins: list[tuple[str, list[int], int, list[list[int]]]]  # node output, inputs, axis, shapes
    delays: list[tuple[str, int, int, int, list[int]]]  # node output, input, axis, frames, shape
    lookahead_frames: int
    cumsum_shapes: dict[str, list[int]]  # CumSum output -> its input's shape on the probe


def _plan(model: Any, seed: int = 0) -> _Plan:
    """Find the padding sites, their widths, and the delays at joining nodes (module doc).

    Raises:
        ModelLoadError: the structure does not fit.
    """
    gr = GraphIndex(model)
    if set(HIFT.inputs) - gr.inputs:
        raise ModelLoadError(f"the vocoder lacks the inputs {sorted(HIFT.inputs)}")
    data = _data_tensors(gr, ("speech_feat", "noise"))
    sites = _pad_candidates(gr, data)
    if not any(site.conv is not None for site in sites):
        raise ModelLoadError("no padded convolution found")
    joins = [
        node for node in gr.g.node
        if node.op_type in ELEMENTWISE_JOIN
        and sum(1 for i in node.input if i in data) >= 2
        and node.output[0] not in {site.node.output[0] for site in sites}
    ]
    names: list[str] = []
    for site in sites:
        names.append(site.x)
        if site.form == "pad":
            names.append(site.node.input[1])
        elif site.form == "concat":
            names.append(site.node.input[0] if site.left else site.node.input[1])
    for node in joins:
        names.extend(i for i in node.input if i in data)
    cumsums = [node for node in gr.g.node if node.op_type == "CumSum"]
    names.extend(node.input[0] for node in cumsums)
    names.extend(HIFT.outputs)
    names = list(dict.fromkeys(names))
    rng = np.random.default_rng(seed)
    frames, spf = PROBE_FRAMES, C.SAMPLES_PER_MEL_FRAME

    def inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
        mel = (rng.standard_normal((1, C.MEL_BINS, n)) - 5.0).astype(np.float32)
        noise = rng.random((1, spf * n, C.HARMONIC_CHANNELS), dtype=np.float32)
        return mel, noise

    mel, noise = inputs(frames)
    longer_mel, longer_noise = inputs(frames + 8)
    try:
        run_a = _run_probe(model, names, {"speech_feat": mel, "noise": noise})
        run_c = _run_probe(model, names, {"speech_feat": longer_mel, "noise": longer_noise})
    except Exception as exc:  # onnxruntime raises untyped errors
        raise ModelLoadError(f"the vocoder does not run for probing: {exc}") from exc

    def time_axis(name: str) -> int | None:
        a, c = np.asarray(run_a[name]), np.asarray(run_c[name])
        axes = [i for i in range(a.ndim) if a.shape[i] != c.shape[i]]
        if len(axes) > 1:
            raise ModelLoadError(f"{name} has more than one time axis")
        return axes[0] if axes else None

    widths: dict[int, tuple[int, int]] = {}
    shapes: dict[int, list[int]] = {}
    for i, site in enumerate(sites):
        x = np.asarray(run_a[site.x])
        if time_axis(site.x) != x.ndim - 1:
            raise ModelLoadError("a padding is not on the time axis (last)")
        shapes[i] = list(x.shape)
        if site.form == "attr":
            widths[i] = (site.left, site.right)
        elif site.form == "pad":
            pads = np.asarray(run_a[site.node.input[1]]).reshape(-1).astype(int)
            half = len(pads) // 2
            if len(pads) != 2 * x.ndim or np.any(pads[: half - 1]) or np.any(pads[half:-1]):
                raise ModelLoadError(f"a Pad pads other axes than time ({pads.tolist()})")
            widths[i] = (int(pads[half - 1]), int(pads[-1]))
        else:
            block = site.node.input[0] if site.left else site.node.input[1]
            width = int(np.asarray(run_a[block]).shape[-1])
            if time_axis(block) is not None:
                raise ModelLoadError("a zero block grows with the input")
            widths[i] = (width, 0) if site.left else (0, width)
        if min(widths[i]) < 0:
            raise ModelLoadError("a negative padding")
    join_specs: list[tuple[str, list[int], int, list[list[int]]]] = []
    for node in joins:
        timed = [(k, i) for k, i in enumerate(node.input) if i in data]
        axes = {time_axis(i) for _, i in timed}
        if None in axes:
            continue  # a per-channel parameter or a constant block: nothing to align
        if len(axes) != 1:
            raise ModelLoadError(f"a {node.op_type} joins streams on different time axes")
        axis = axes.pop()
        assert axis is not None
        ndim = np.asarray(run_a[timed[0][1]]).ndim
        if node.op_type == "Concat" and int(gr.attr(node, "axis")) % ndim == axis:
            raise ModelLoadError("a Concat joins streams along time")
        join_specs.append((node.output[0], [k for k, _ in timed], axis,
                           [list(np.asarray(run_a[i]).shape) for _, i in timed]))
    cumsum_shapes = {node.output[0]: list(np.asarray(run_a[node.input[0]]).shape)
                     for node in cumsums}
    return _Plan(sites, widths, shapes, join_specs, [], 0, cumsum_shapes)


States = list[tuple[list[int], int, str]]
"""Per state: its shape with -1 on the time axis, the time axis, its kind."""


def add_stream_state(model: Any, seed: int = 0, lean: bool = True
                     ) -> tuple[Any, _Plan, States]:
    """Rewrite ``model`` (onnx.ModelProto, changed in place) into the streamed graph; ``lean``:
    from the generator with :func:`.hift_lean.lean_generator`'s rewrites (less work, the same
    numbers up to float rounding).

    Returns:
        (the model, the plan, per state: (shape with -1 on the time axis, axis, kind)).

    Raises:
        ModelLoadError: structure not recognised.
    """
    import onnx

    try:
        shapes = weight_shapes(model, probe_feeds(PROBE_FRAMES, seed))
    except Exception as exc:  # onnxruntime raises untyped errors
        raise ModelLoadError(f"the vocoder does not run for probing: {exc}") from exc
    if lean:
        lean_generator(model)
    plan = _plan(model, seed)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    _rewrite(probe, plan, probe=True)
    _measure_delays(probe, plan, seed)
    del probe
    states = _rewrite(model, plan, probe=False)
    exact_phase_path(model, shapes)  # as the one-call graph (hift_exact.exact_one_call)
    return model, plan, states


def _measure_delays(probe: Any, plan: _Plan, seed: int) -> None:
    """Fill ``plan.delays`` and ``plan.lookahead_frames`` from one first call of the probe
    form (every join cut to its shortest input): a join input longer than the shortest is
    ahead by the difference, for good (each call adds the same frames to every stream).

    Raises:
        ModelLoadError: the probe does not run or the output is not whole mel frames.
    """
    rng = np.random.default_rng(seed)
    frames, spf = PROBE_FRAMES, C.SAMPLES_PER_MEL_FRAME
    gr = GraphIndex(probe)
    names: list[str] = []

    def uncut(out: str, k: int) -> str:  # the join's input before the probe's cut
        return str(gr.producer[gr.producer[out].input[k]].input[0])

    for out, inputs, _, _ in plan.joins:
        names.extend(uncut(out, k) for k in inputs)
    names = list(dict.fromkeys(names))
    feeds: dict[str, np.ndarray] = {
        "speech_feat": (rng.standard_normal((1, C.MEL_BINS, frames)) - 5.0).astype(np.float32),
        "noise": rng.random((1, spf * frames, C.HARMONIC_CHANNELS), dtype=np.float32),
        FIRST_INPUT: np.array([1], np.int64),
        FINAL_INPUT: np.array([0], np.int64),
    }
    for value in probe.graph.input:
        if value.name.startswith(STATE_IN):
            dims = [d.dim_value if d.HasField("dim_value") else 0
                    for d in value.type.tensor_type.shape.dim]
            feeds[value.name] = np.zeros(dims, np.float32)
    try:
        got = _run_probe(probe, [*names, "magnitude"], feeds)
    except Exception as exc:  # onnxruntime raises untyped errors
        raise ModelLoadError(f"the state-carrying vocoder does not run: {exc}") from exc
    for out, inputs, axis, shapes in plan.joins:
        lengths = [np.asarray(got[uncut(out, k)]).shape[axis] for k in inputs]
        ready = min(lengths)
        for k, length, shape in zip(inputs, lengths, shapes, strict=True):
            if length > ready:
                plan.delays.append((out, k, axis, length - ready, shape))
    per_frame = C.SAMPLES_PER_MEL_FRAME // C.ISTFT_HOP
    ready_out = np.asarray(got["magnitude"]).shape[-1]
    plan.lookahead_frames = frames - (ready_out - 1) // per_frame
    if (ready_out - 1) % per_frame or not 0 <= plan.lookahead_frames < frames // 2:
        raise ModelLoadError(
            f"the streamed vocoder's first call returns {ready_out} frames for {frames} mel "
            "frames: not whole mel frames"
        )


def _rewrite(model: Any, plan: _Plan, probe: bool) -> States:
    """Rewrite ``model`` in place (module doc); ``probe``: cut every join to its shortest
    input instead of the delay lines (for :func:`_measure_delays`). Returns the states."""
    from onnx import TensorProto, helper, numpy_helper

    gr = GraphIndex(model)
    g = model.graph
    for name in (FIRST_INPUT, FINAL_INPUT):
        if name in gr.inputs:
            raise ModelLoadError(f"the graph already has an input {name}")
    new_nodes: dict[float, list[Any]] = {}  # before node index i; i + 0.5: after it
    states: States = []
    counter = [0]

    def uniq(stem: str) -> str:
        counter[0] += 1
        return f"stream/{stem}_{counter[0]}"

    def const(values: list[int]) -> tuple[Any, str]:
        name = uniq("c")
        array = np.asarray(values, dtype=np.int64)
        tensor = numpy_helper.from_array(array, name)
        return helper.make_node("Constant", [], [name], value=tensor), name

    def add_state(shape: list[int], axis: int, kind: str) -> tuple[str, str]:
        index = len(states)
        states.append(([-1 if i == axis else d for i, d in enumerate(shape)], axis, kind))
        dims: list[Any] = [f"state{index}_t" if i == axis else d for i, d in enumerate(shape)]
        for values, name in ((g.input, STATE_IN), (g.output, STATE_OUT)):
            values.append(helper.make_tensor_value_info(f"{name}{index}", TensorProto.FLOAT, dims))
        return f"{STATE_IN}{index}", f"{STATE_OUT}{index}"

    order = {node.output[0]: i for i, node in enumerate(g.node)}  # wrappers are not stable
    by_output = {node.output[0]: node for node in g.node}

    def at(node: Any) -> list[Any]:
        return new_nodes.setdefault(order[node.output[0]], [])

    removed: list[str] = []  # first outputs of the replaced padding nodes
    for i, site in enumerate(plan.sites):
        left, right = plan.widths[i]
        shape = plan.channels[i]
        ndim = len(shape)
        nodes = at(by_output[site.node.output[0]])
        # pads = [0.., left * first, 0.., right * final] on the last axis
        c_left, n_left = const([left])
        c_right, n_right = const([right])
        c_zero, n_zero = const([0] * (ndim - 1))
        l_now, r_now, pads = uniq("l"), uniq("r"), uniq("pads")
        nodes += [c_left, c_right, c_zero,
                  helper.make_node("Mul", [n_left, FIRST_INPUT], [l_now]),
                  helper.make_node("Mul", [n_right, FINAL_INPUT], [r_now]),
                  helper.make_node("Concat", [n_zero, l_now, n_zero, r_now], [pads], axis=0)]
        padded = uniq("padded") if site.conv is not None else site.out
        pad_inputs = [site.x, pads]
        nodes.append(helper.make_node("Pad", pad_inputs, [padded], mode=site.mode))
        if site.form != "attr":
            removed.append(site.node.output[0])
        if site.conv is None:
            continue
        conv = by_output[site.conv.output[0]]  # this model's node, not the plan's
        for attr in conv.attribute:
            if attr.name == "pads":
                attr.ints[:] = [0, 0]
        state_in, state_out = add_state(shape, ndim - 1, "conv")
        joined = uniq("joined")
        k, d, s = (int(next(iter(gr.attr(conv, name, [1]))))
                   for name in ("kernel_shape", "dilations", "strides"))
        c_keff, n_keff = const([(k - 1) * d + 1])
        c_s, n_s = const([s])
        c_one, n_one = const([1])
        c_axis, n_axis = const([ndim - 1])
        c_end, n_end = const([INT_END])
        length, n_out, used, start = uniq("len"), uniq("nout"), uniq("nout1"), uniq("start")
        diff = uniq("diff")
        conv_nodes = at(conv)
        conv_nodes += [
            c_keff, c_s, c_one, c_axis, c_end,
            helper.make_node("Concat", [state_in, padded], [joined], axis=ndim - 1),
            helper.make_node("Shape", [joined], [length], start=ndim - 1, end=ndim),
            helper.make_node("Sub", [length, n_keff], [diff]),
            helper.make_node("Div", [diff, n_s], [n_out]),
            helper.make_node("Add", [n_out, n_one], [used]),
            helper.make_node("Mul", [used, n_s], [start]),
            helper.make_node("Slice", [joined, start, n_end, n_axis], [state_out]),
        ]
        conv.input[0] = joined

    if probe:
        for out, inputs, axis, _ in plan.joins:
            node = by_output[out]
            c_axis, n_axis = const([axis])
            c_zero, n_zero = const([0])
            lengths = []
            nodes = at(node)
            nodes += [c_axis, c_zero]
            for k in inputs:
                length = uniq("jlen")
                nodes.append(helper.make_node("Shape", [node.input[k]], [length],
                                              start=axis, end=axis + 1))
                lengths.append(length)
            shortest = uniq("jmin")
            nodes.append(helper.make_node("Min", lengths, [shortest]))
            for k in inputs:
                cut = uniq("jcut")
                nodes.append(helper.make_node("Slice", [node.input[k], n_zero, shortest, n_axis],
                                              [cut]))
                node.input[k] = cut
    for out_name, k, axis, frames, shape in plan.delays:
        node = by_output[out_name]
        state_in, state_out = add_state(shape, axis, "delay")
        x = node.input[k]
        c_d, n_d = const([frames])
        c_one, n_one = const([1])
        c_zero, n_zero = const([0])
        c_axis, n_axis = const([axis])
        c_end, n_end = const([INT_END])
        joined, length, keep, open_, cut, out = (uniq(s) for s in
                                                 ("dj", "dlen", "keep", "open", "cut", "dout"))
        at(node).extend([
            c_d, c_one, c_zero, c_axis, c_end,
            helper.make_node("Concat", [state_in, x], [joined], axis=axis),
            helper.make_node("Shape", [joined], [length], start=axis, end=axis + 1),
            helper.make_node("Sub", [n_one, FINAL_INPUT], [open_]),
            helper.make_node("Mul", [n_d, open_], [keep]),
            helper.make_node("Sub", [length, keep], [cut]),
            helper.make_node("Slice", [joined, n_zero, cut, n_axis], [out]),
            helper.make_node("Slice", [joined, cut, n_end, n_axis], [state_out]),
        ])
        node.input[k] = out

    # the source's CumSum continues from the previous call's last accumulated value
    cumsums = [n for n in g.node if n.op_type == "CumSum"]
    for node in cumsums:
        axis_value = gr.const(node.input[1])
        if axis_value is None or gr.attr(node, "exclusive", 0) or gr.attr(node, "reverse", 0):
            raise ModelLoadError("a CumSum that is not a plain running sum over a constant axis")
        axis = int(np.asarray(axis_value).reshape(-1)[0])
        probe_shape = plan.cumsum_shapes[node.output[0]]
        axis = axis % len(probe_shape)
        state_in, state_out = add_state(probe_shape, axis, "phase")
        raw = node.output[0]
        joined, summed, carried = uniq("pj"), uniq("ps"), uniq("pc")
        c_axis, n_axis = const([axis])
        c_end, n_end = const([INT_END])
        c_last, n_last = const([-1])
        nodes = at(node)
        nodes += [c_axis, c_end, c_last,
                  helper.make_node("Concat", [state_in, node.input[0]], [joined], axis=axis),
                  helper.make_node("Shape", [state_in], [carried], start=axis, end=axis + 1)]
        node.input[0] = joined
        node.output[0] = summed
        after = new_nodes.setdefault(order[raw] + 0.5, [])
        after += [
            helper.make_node("Slice", [summed, carried, n_end, n_axis], [raw]),
            helper.make_node("Slice", [summed, n_last, n_end, n_axis], [state_out]),
        ]
    # each call's noise is its own: the graph's cut of the noise to the source length goes
    for node in g.node:
        if node.op_type == "Slice" and node.input[0] == "noise":
            starts = gr.const(node.input[1])
            if starts is None or np.any(starts != 0):
                raise ModelLoadError("the noise is sliced from a non-zero start")
            node.op_type = "Identity"
            del node.input[1:]

    ordered: list[Any] = []
    for index, node in enumerate(list(g.node)):
        ordered.extend(new_nodes.get(index, []))
        if node.output[0] not in removed:
            ordered.append(node)
        ordered.extend(new_nodes.get(index + 0.5, []))
    del g.node[:]
    g.node.extend(ordered)
    g.input.extend([
        helper.make_tensor_value_info(FIRST_INPUT, TensorProto.INT64, [1]),
        helper.make_tensor_value_info(FINAL_INPUT, TensorProto.INT64, [1]),
    ])
    return states


def stream_run(
    session: Any,
    mel: np.ndarray,
    noise: np.ndarray,
    splits: list[int],
    state_shapes: list[list[int]],
    state_axes: list[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Run the streamed graph over ``mel`` cut into calls of ``splits`` frames (the last call
    final); the concatenated magnitude and phase, float32 [1, 9, 120 M + 1] each.

    Args:
        session: an onnxruntime session of the streamed graph.
        mel: float32 [1, 80, M]; noise: float32 [1, 480 M, 9].
        splits: frames per call, summing to M.
        state_shapes, state_axes: from the report.
    """
    spf = C.SAMPLES_PER_MEL_FRAME
    states = [np.zeros([0 if d < 0 else d for d in shape], np.float32) for shape in state_shapes]
    names = ["magnitude", "phase"] + [f"{STATE_OUT}{i}" for i in range(len(states))]
    mags, phases, start = [], [], 0
    for call, n in enumerate(splits):
        feeds: dict[str, np.ndarray] = {
            "speech_feat": np.ascontiguousarray(mel[:, :, start : start + n]),
            "noise": np.ascontiguousarray(noise[:, spf * start : spf * (start + n)]),
            FIRST_INPUT: np.array([int(call == 0)], np.int64),
            FINAL_INPUT: np.array([int(call == len(splits) - 1)], np.int64),
        }
        feeds.update({f"{STATE_IN}{i}": state for i, state in enumerate(states)})
        out = session.run(names, feeds)
        mags.append(out[0])
        phases.append(out[1])
        states = list(out[2:])
        start += n
    del state_axes  # states come back in the shape the next call takes
    return np.concatenate(mags, axis=-1), np.concatenate(phases, axis=-1)


def _splits(rng: np.random.Generator, total: int, first: int) -> list[list[int]]:
    """Validation splits: random sizes, 1-frame calls, and a cut inside the look-ahead."""
    out = [[total]]
    sizes = [first]
    while sum(sizes) < total:
        sizes.append(int(rng.integers(1, 24)))
    sizes[-1] -= sum(sizes) - total
    out.append([s for s in sizes if s > 0])
    ones = [first] + [1] * 12
    out.append([*ones, total - sum(ones)])
    out.append([first, total - first - 2, 2])  # the final call is inside the look-ahead
    return out


def _audio(magnitude: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """The host's samples for HiFT's output: float32 [4 (F - 1)] from [1, 9, F] magnitude and
    phase (the magnitude clip at 100, the iSTFT and the clamp at +-0.99, as
    ``vocoder.hift.HiftRunner.waveform`` does)."""
    clipped = np.minimum(magnitude, np.float32(C.MAGNITUDE_CLIP))
    return np.clip(istft(clipped, phase), -C.AUDIO_LIMIT, C.AUDIO_LIMIT)


def validate(
    source: Path, derived: Any, states: States, plan: _Plan,
    seed: int = 0,
) -> StreamReport:
    """Streamed calls against one call of the one-call graph (``hift.onnx`` with
    :func:`~.hift_exact.exact_one_call`'s rewrite, what the product runs) on seeded random mel
    (module doc), compared on the audio the host makes of them (:func:`_audio`).

    Raises:
        ModelLoadError: a check failed.
    """
    import onnx

    started = time.perf_counter()
    rng = np.random.default_rng(seed + 1)
    frames, spf = VALIDATION_FRAMES, C.SAMPLES_PER_MEL_FRAME
    mel = (rng.standard_normal((1, C.MEL_BINS, frames)) - 5.0).astype(np.float32)
    noise = rng.random((1, spf * frames, C.HARMONIC_CHANNELS), dtype=np.float32)
    feeds = {"speech_feat": mel, "noise": noise}
    try:
        exact, _, _ = exact_one_call(onnx.load(str(source)))
        rad = rad_difference(onnx.load(str(source)), exact, feeds)
    except Exception as exc:  # onnxruntime raises untyped errors
        raise ModelLoadError(f"the one-call vocoder does not run: {exc}") from exc
    if not rad <= MAX_RAD_DIFFERENCE:
        raise ModelLoadError(f"the one-call vocoder's source differs from hift.onnx's by {rad:.3g}")
    one, published, ours = (validation_session(m) for m in (exact, source, derived))
    magnitude, phase = one.run(["magnitude", "phase"], feeds)
    reference = _audio(magnitude, phase)
    try:
        plain, _, _ = exact_one_call(onnx.load(str(source)), lean=False)
        lean_audio = float(np.abs(
            _audio(*validation_session(plain).run(["magnitude", "phase"], feeds)) - reference
        ).max())
    except Exception as exc:  # onnxruntime raises untyped errors
        raise ModelLoadError(f"the one-call vocoder does not run: {exc}") from exc
    whole = _audio(*published.run(["magnitude", "phase"], feeds))
    shapes, axes = [s for s, _, _ in states], [a for _, a, _ in states]
    first = 0
    for n in range(1, MAX_FIRST_FRAMES + 1):
        try:
            stream_run(ours, mel[:, :, : n + 1], noise[:, : spf * (n + 1)], [n, 1], shapes, axes)
        except Exception:  # onnxruntime raises untyped errors; too short for a reflection
            continue
        first = n
        break
    if not first:
        raise ModelLoadError(f"the streamed hift does not run with up to {MAX_FIRST_FRAMES} frames")
    first = max(first, plan.lookahead_frames + 1)
    splits = _splits(rng, frames, first)

    # what the rewrite removes: one call of hift.onnx over a prefix against one call over the
    # whole mel, on the samples the prefix's missing right context does not reach
    floor_prefix = 0.0
    for part in FLOOR_PREFIXES:
        n = int(frames * part)
        prefix = published.run(
            ["magnitude", "phase"], {"speech_feat": mel[:, :, :n], "noise": noise[:, : spf * n]}
        )
        cut = spf * (n - 2 * plan.lookahead_frames)
        got = float(np.abs(_audio(prefix[0], prefix[1])[:cut] - whole[:cut]).max())
        floor_prefix = max(floor_prefix, got)
    del published, one
    worst = 0.0
    for split in splits:
        try:
            mag, ph = stream_run(ours, mel, noise, split, shapes, axes)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise ModelLoadError(f"the streamed hift does not run ({split}): {exc}") from exc
        if mag.shape != magnitude.shape or ph.shape != phase.shape:
            raise ModelLoadError(
                f"the streamed hift returns {mag.shape[-1]} frames for {split}, one call "
                f"{magnitude.shape[-1]}"
            )
        worst = max(worst, float(np.abs(_audio(mag, ph) - reference).max()))
    report = StreamReport(
        state_shapes=shapes, state_axes=axes, state_kinds=[k for _, _, k in states],
        lookahead_frames=plan.lookahead_frames, min_first_frames=first,
        max_abs_audio=worst, floor_prefix_audio=floor_prefix,
        published_audio=float(np.abs(whole - reference).max()), published_rad=rad,
        allowed_audio=MAX_ABS, splits=splits, derive_s=time.perf_counter() - started,
        lean_audio=lean_audio,
    )
    if not report.lean_audio <= MAX_ABS:
        raise ModelLoadError(
            f"the lean one-call vocoder's audio differs from the one without the lean rewrite by "
            f"{report.lean_audio:.3g} (allowed {MAX_ABS})"
        )
    if not worst <= MAX_ABS:
        raise ModelLoadError(
            f"the streamed hift's audio differs from one call's by {worst:.3g} (allowed "
            f"{MAX_ABS}; hift.onnx over a prefix differs from it over the whole mel by "
            f"{floor_prefix:.3g})"
        )
    return report


def write_stream_hift(source: Path, graph: Path, report_json: Path) -> StreamReport:
    """Derive, validate and write the streamed graph of ``source`` and its report (run in the
    derivation child process, :mod:`..child`).

    Raises:
        ModelLoadError: structure not recognised or a check failed.
    """
    import onnx

    started = time.perf_counter()
    model, plan, states = add_stream_state(onnx.load(str(source)))
    report = validate(source, model, states, plan)
    report = StreamReport(**{**asdict(report), "derive_s": time.perf_counter() - started})
    onnx.save(model, str(graph))
    report_json.write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    return report


def ensure_stream_hift(
    source: Path, cache_dir: Path, *, in_process: bool = False
) -> tuple[Path, StreamReport]:
    """Path of the streamed graph of ``source`` (derived and validated once, in a child
    process unless ``in_process``; :func:`~..common.files.derive_reported`) and its report.

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: not derivable or not valid (now or in an earlier attempt).
    """

    def make(tmps: list[Path]) -> None:
        report_json, graph = tmps
        if in_process:
            write_stream_hift(source, graph, report_json)
        else:
            run_child(["hift-stream", str(source), str(graph), str(report_json)])

    (_, target), report = derive_reported(
        source, cache_dir, [(STREAM_TAG, ".onnx.json"), (STREAM_TAG, ".onnx")], make,
        StreamReport, report_index=0, name="streamed vocoder",
    )
    return target, report


STREAM_WARNING = ("streamed vocoder not used (%s); streaming re-runs hift.onnx over the mel "
                  "(or the preset's window of it) per chunk")
"""The fallback warning of this form (:class:`~..common.forms.Form`)."""


def open_stream_hift(
    source: Path, cache_dir: Path, threads: int, providers: tuple[str, ...], spin_wait: bool
) -> tuple[Graph, StreamReport]:
    """The streamed vocoder graph of ``source`` (derived once, :func:`ensure_stream_hift`)
    opened as a checked :class:`~...sessions.Graph`, and its report.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: not derivable, not valid or
            not loadable (streaming then uses the windowed vocoder).
    """
    path, report = ensure_stream_hift(source, cache_dir)
    spec = stream_spec(len(report.state_shapes))
    graph = Graph(path, spec, threads, providers, spin_wait=spin_wait)
    logger.info(
        "vocoder: streamed graph of %s (%d states, look-ahead %d frames; off one call by "
        "%.2g; hift.onnx's own rounding per call length %.2g)", source.name,
        len(report.state_shapes), report.lookahead_frames, report.max_abs_audio,
        report.floor_prefix_audio,
    )
    return graph, report


def load_stream_hift(
    source: Path, cache_dir: Path, threads: int, providers: tuple[str, ...], spin_wait: bool
) -> tuple[Graph, StreamReport] | None:
    """:func:`open_stream_hift`, or None after ONE warning (:data:`STREAM_WARNING`)."""
    form = Form("streamed vocoder", warning=STREAM_WARNING, open=lambda _cache: (
        open_stream_hift(source, cache_dir, threads, providers, spin_wait)))
    return form.attempt(source.parent, cache_dir)
