"""HiFT's source phase computed the same at every call length: a rewrite of the nodes
upstream of the accumulated phase.

Why: the harmonic source (upstream CosyVoice ace7c47 ``cosyvoice/hifigan/generator.py``
``SineGen2``) runs the f0 predictor's output through ``rad = (f0 h / 24000) mod 1``, a linear
downsampling by 480, a running sum over the frames and a multiplication by 2 pi x 480. One
ulp of a rad value stays in every later partial sum, so a last-bit difference in f0 moves
the source by about 1e-3 rad after a few seconds. onnxruntime makes such differences
depending on how many frames a call has, so a streamed call and one call over the whole mel
rounded f0 differently (measured: 2.4e-4 to 1.25e-3 max abs on the audio). Three causes,
found by exposing intermediate tensors as outputs (one call over 30 frames against one over
90; streamed calls against one call):

* MLAS SGEMM (under onnxruntime's Conv and MatMul) adds the K products of an output in
  blocks and the block partial sums one after another; the block length depends on the
  output columns N of the call (``MlasSgemmOperation``, ``MlasConvOperation``: StrideK 128
  for N > 64, doubled while StrideN halves down to N, up to 1024 for N <= 16; with several
  threads, on the N of each thread's segment). K = input channels x taps is 320 for the
  first f0 convolution (80 mel bins x 4 taps), 96 to 1536 for the others (32 to 512
  channels x 3 taps) on the models here.
* MLAS takes a GEMV kernel with its own summation order for one output column (N = 1) or
  one output row (M = 1): a one-frame call.
* the linear ``Resize`` that takes the per-sample rad values to the frame rate computes
  each output's interpolation weight from a float32 coordinate ``(j + 0.5) / scale - 0.5``
  of its position j, so the same frame at another position (a streamed call starts at
  0) adds its two equal samples with other weights and can differ in the last bit.

The rewrite (applied to the graph the product runs for one call and to the streamed graph,
so both compute the same sums):

* each ``Conv`` upstream of the ``CumSum`` whose K exceeds :data:`MAX_BLOCK_K` is cut into
  Convs over groups of whole input channels with at most :data:`MAX_BLOCK_K` products each,
  added in channel order, the bias last: each piece is one MLAS block for every N. When the
  taps divide 128 the groups are MLAS's own 128-blocks, so such a Conv gives the published
  graph's numbers for one call over more than 64 frames on one thread;
* those Convs and the MatMuls there get one zero frame more on the time axis, its output
  dropped: N and M are never 1;
* a linear, half-pixel ``Resize`` there that downsamples the last axis by an integer factor
  r becomes the mean of its two (r even) or its one (r odd) source samples at ``r j + (r -
  1) / 2``: torch's weights for upstream's ``interpolate(scale_factor=1/480, mode="linear")``
  exactly (0.5 and 0.5), at every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import constants as C
from ..common.graph import GraphIndex
from .hift_lean import lean_generator, phase_path

MAX_BLOCK_K = 128
"""Products per Conv piece: MLAS's smallest K block (``MLAS_SGEMM_STRIDEK``), so a piece is
never cut into blocks, whatever the call's frames."""
PROBE_FRAMES = 48
"""Mel frames of the run that reads the weight shapes."""
MAX_RAD_DIFFERENCE = 1e-5
"""Largest accepted |rewritten - published| of the CumSum's input (rad values, cycles per
sample, in [0, 1)): float rounding of f0 (a few ulp) times h / 24000, and the Resize's last
bit; measured 0 to 3e-7 on the parity and full-size synthetic models."""


@dataclass(frozen=True)
class ExactCounts:
    """What :func:`exact_phase_path` changed: Convs cut into pieces, Convs and MatMuls given a
    spare frame, Resizes replaced."""

    split_convs: int
    padded: int
    resizes: int


def probe_feeds(frames: int = PROBE_FRAMES, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random ``speech_feat`` float32 [1, 80, frames] (log mel around -5) and
    ``noise`` float32 [1, 480 frames, 9] (U[0, 1))."""
    rng = np.random.default_rng(seed)
    return {
        "speech_feat": (rng.standard_normal((1, C.MEL_BINS, frames)) - 5.0).astype(np.float32),
        "noise": rng.random((1, C.SAMPLES_PER_MEL_FRAME * frames, C.HARMONIC_CHANNELS),
                            dtype=np.float32),
    }


def exact_one_call(model: Any, lean: bool = True
                   ) -> tuple[Any, dict[str, list[int]], ExactCounts]:
    """``model`` (the published ``hift.onnx`` as an onnx.ModelProto, changed in place) with
    :func:`~.hift_lean.lean_generator`'s and :func:`exact_phase_path`'s rewrites: the vocoder
    the product runs for one call (the streamed form's first-and-final call computes exactly
    this; ``lean`` False: without the lean rewrites, for checking them). Returns (the model,
    :func:`weight_shapes`, the counts)."""
    shapes = weight_shapes(model, probe_feeds())
    if lean:
        lean_generator(model)
    return model, shapes, exact_phase_path(model, shapes)


def rad_difference(published: Any, rewritten: Any, feeds: dict[str, np.ndarray]) -> float:
    """Max |difference| of the CumSum's input between two graphs (onnx.ModelProto, not
    changed; the CumSum's input keeps its name) on ``feeds``; 0.0 without a CumSum."""
    import onnx

    from ..common.files import validation_session

    cumsums = [node for node in published.graph.node if node.op_type == "CumSum"]
    if not cumsums:
        return 0.0
    name = cumsums[0].input[0]
    values = []
    for model in (published, rewritten):
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        probe.graph.output.append(onnx.ValueInfoProto(name=name))
        values.append(np.asarray(validation_session(probe).run([name], feeds)[0], np.float64))
    return float(np.abs(values[0] - values[1]).max())


def weight_shapes(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """Shapes of the Conv weights and MatMul inputs upstream of the ``CumSum`` (computed
    weights included: weight norm runs in the graph), from one run of ``model`` on
    ``feeds``; the rewritten graphs keep these tensor names."""
    import onnx

    from ..common.files import validation_session

    gr = GraphIndex(model)
    path = phase_path(gr)
    names: list[str] = []
    for node in gr.nodes:
        if node.output[0] in path and node.op_type in ("Conv", "MatMul"):
            names.extend(node.input[:2])
    names = list(dict.fromkeys(names))
    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in existing)
    session = validation_session(probe, optimize=False)
    return {n: list(np.asarray(v).shape) for n, v in zip(names, session.run(names, feeds),
                                                         strict=True)}


def exact_phase_path(model: Any, shapes: dict[str, list[int]]) -> ExactCounts:
    """Rewrite ``model`` (onnx.ModelProto, changed in place) as the module doc says.

    Args:
        model: ``hift.onnx`` or a graph derived from it (names of the nodes upstream of the
            ``CumSum`` kept).
        shapes: :func:`weight_shapes` of the published graph.

    Nodes of another structure (grouped or 2-D Convs, a Resize that is not an integer
    linear downsampling of the last axis) are left as they are; the derivations' validation
    measures what remains.
    """
    from onnx import helper, numpy_helper

    gr = GraphIndex(model)
    g = model.graph
    path = phase_path(gr)
    counter = [0]
    split = padded = resizes = 0

    def uniq(stem: str) -> str:
        counter[0] += 1
        return f"exact/{stem}_{counter[0]}"

    def const(values: Any, dtype: Any = np.int64) -> tuple[Any, str]:
        name = uniq("c")
        tensor = numpy_helper.from_array(np.asarray(values, dtype=dtype), name)
        return helper.make_node("Constant", [], [name], value=tensor), name

    replaced: dict[str, list[Any]] = {}
    for node in gr.nodes:
        if node.output[0] not in path:
            continue
        if node.op_type == "Conv":
            dims = shapes.get(node.input[1])
            if dims is None or len(dims) != 3 or int(gr.attr(node, "group", 1)) != 1:
                continue
            nodes, pieces = _conv(node, dims, gr, uniq, const)
            replaced[node.output[0]] = nodes
            split += pieces > 1
            padded += 1
        elif node.op_type == "MatMul":
            dims = shapes.get(node.input[0])
            if dims is None or len(dims) < 2:
                continue
            replaced[node.output[0]] = _spare_row(node, len(dims), uniq, const)
            padded += 1
        elif node.op_type == "Resize":
            nodes_r = _resize(node, gr, uniq, const)
            if nodes_r is not None:
                replaced[node.output[0]] = nodes_r
                resizes += 1
    if replaced:
        ordered: list[Any] = []
        for node in list(g.node):
            ordered.extend(replaced.get(node.output[0], [node]) if node.output else [node])
        del g.node[:]
        g.node.extend(ordered)
    return ExactCounts(split, padded, resizes)


def _pad_end(x: str, rank: int, axis: int, frames: int, uniq: Any, const: Any
             ) -> tuple[list[Any], str]:
    """``x`` with ``frames`` zero frames appended on ``axis`` (a Pad node)."""
    from onnx import helper

    pads = [0] * (2 * rank)
    pads[rank + axis] = frames
    c_pads, n_pads = const(pads)
    out = uniq("padded")
    return [c_pads, helper.make_node("Pad", [x, n_pads], [out], mode="constant")], out


def _drop_last(y: str, out: str, axis: int, const: Any) -> list[Any]:
    """``out = y`` without its last frame on ``axis``."""
    from onnx import helper

    c_start, n_start = const([0])
    c_end, n_end = const([-1])
    c_axis, n_axis = const([axis])
    return [c_start, c_end, c_axis, helper.make_node("Slice", [y, n_start, n_end, n_axis], [out])]


def _conv(node: Any, dims: list[int], gr: GraphIndex, uniq: Any, const: Any
          ) -> tuple[list[Any], int]:
    """A 1-D Conv as pieces of at most :data:`MAX_BLOCK_K` products with a spare frame."""
    from onnx import helper

    out_channels, in_channels, taps = dims
    stride = int(next(iter(gr.attr(node, "strides", [1]))))
    nodes, x = _pad_end(node.input[0], 3, 2, stride, uniq, const)  # one output frame more
    per = max(1, MAX_BLOCK_K // taps)
    attrs = list(node.attribute)
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if in_channels * taps <= MAX_BLOCK_K:
        whole = uniq("conv")
        conv = helper.make_node("Conv", [x, *node.input[1:]], [whole], name=uniq("Conv"))
        conv.attribute.extend(attrs)
        nodes.append(conv)
        return nodes + _drop_last(whole, node.output[0], 2, const), 1
    c_one, n_one = const([1])
    nodes.append(c_one)
    total = ""
    pieces = 0
    for start in range(0, in_channels, per):
        stop = min(in_channels, start + per)
        c_start, n_start = const([start])
        c_stop, n_stop = const([stop])
        xs, ws, ys = uniq("x"), uniq("w"), uniq("y")
        conv = helper.make_node("Conv", [xs, ws], [ys], name=uniq("Conv"))
        conv.attribute.extend(attrs)
        nodes += [c_start, c_stop,
                  helper.make_node("Slice", [x, n_start, n_stop, n_one], [xs]),
                  helper.make_node("Slice", [node.input[1], n_start, n_stop, n_one], [ws]),
                  conv]
        if total:
            summed = uniq("sum")
            nodes.append(helper.make_node("Add", [total, ys], [summed]))
            total = summed
        else:
            total = ys
        pieces += 1
    if has_bias:
        c_shape, n_shape = const([out_channels, 1])
        column, biased = uniq("bias"), uniq("biased")
        nodes += [c_shape, helper.make_node("Reshape", [node.input[2], n_shape], [column]),
                  helper.make_node("Add", [total, column], [biased])]
        total = biased
    return nodes + _drop_last(total, node.output[0], 2, const), pieces


def _spare_row(node: Any, rank: int, uniq: Any, const: Any) -> list[Any]:
    """A MatMul with one zero row more on its first input's row axis, that row dropped."""
    from onnx import helper

    nodes, a = _pad_end(node.input[0], rank, rank - 2, 1, uniq, const)
    product = uniq("mm")
    nodes.append(helper.make_node("MatMul", [a, node.input[1]], [product]))
    return nodes + _drop_last(product, node.output[0], rank - 2, const)


def _resize(node: Any, gr: GraphIndex, uniq: Any, const: Any) -> list[Any] | None:
    """A linear half-pixel Resize downsampling the last axis by an integer as taps, or None."""
    from onnx import helper

    def text(name: str, default: str) -> str:
        value = gr.attr(node, name, default)
        return value.decode() if isinstance(value, bytes) else str(value)

    if text("mode", "nearest") != "linear" or int(gr.attr(node, "antialias", 0)):
        return None
    if text("coordinate_transformation_mode", "half_pixel") not in ("half_pixel",
                                                                      "pytorch_half_pixel"):
        return None
    if len(node.input) < 3 or not node.input[2] or (len(node.input) > 3 and node.input[3]):
        return None
    scales = gr.const(node.input[2])
    if scales is None or scales.ndim != 1 or np.any(scales[:-1] != 1) or not 0 < scales[-1] < 1:
        return None
    factor = round(1.0 / float(scales[-1]))
    if factor < 2 or abs(factor * float(scales[-1]) - 1.0) > 1e-6:
        return None
    rank = int(scales.shape[0])
    c_frames, n_frames = const([0] * (rank - 1) + [-1, factor])
    c_flat, n_flat = const([0] * (rank - 1) + [-1])
    c_axis, n_axis = const([rank])
    frames = uniq("frames")
    nodes = [c_frames, c_flat, c_axis,
             helper.make_node("Reshape", [node.input[0], n_frames], [frames])]
    centre = (factor - 1) // 2  # the left tap (r even) or the only one (r odd)
    taps = [centre, centre + 1] if factor % 2 == 0 else [centre]
    picked = []
    for tap in taps:
        c_lo, n_lo = const([tap])
        c_hi, n_hi = const([tap + 1])
        one = uniq("tap")
        nodes += [c_lo, c_hi, helper.make_node("Slice", [frames, n_lo, n_hi, n_axis], [one])]
        picked.append(one)
    if len(picked) == 2:
        summed, half = uniq("sum"), uniq("half")
        c_half, n_half = const(0.5, np.float32)
        nodes += [c_half, helper.make_node("Add", picked, [summed]),
                  helper.make_node("Mul", [summed, n_half], [half])]
        picked = [half]
    nodes.append(helper.make_node("Reshape", [picked[0], n_flat], [node.output[0]]))
    return nodes
