"""The benchmark's minimum counts what the engine runs: the streamed vocoder,
counted call by call on a real streamed run (the graph with its flags fixed, its states as
the run passed them), does hift.onnx's work per frame (counted directly on hift.onnx) plus a
small fixed part per call, and an utterance's calls add up to one hift.onnx call over the same
frames plus those parts; the benchmark's cost model of the streamed graph gives the same per
middle call and the same per utterance; MatMulNBits (the 4- and 8-bit fused LLM graphs) counts
int8 operations and int8 weight bytes; weights sliced by constant bounds count."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import flops
from bench.costmodel import (
    FAMILIES,
    CostModel,
    concrete_dims,
    family_of,
    fit_streamed_vocoder,
    load_cost_models,
)
from bench.flops import FlopCountError
from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.derive.vocoder import hift_lean, hift_stream
from wyoming_cosyvoice3.engine.sessions import HIFT

SPLIT = [9, 7, 12, 1, 20, 5]
"""Mel frames per streamed call: a first call, middle calls (one of a single frame), a final."""


@pytest.fixture(scope="module")
def streamed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, list[dict[str, Any]]]:
    """(the tiny model's streamed vocoder graph, per call of :data:`SPLIT`: its feeds)."""
    path, report_ = hift_stream.ensure_stream_hift(
        tiny_model_dir / HIFT.file, tmp_path_factory.mktemp("stream"), in_process=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    spf = C.SAMPLES_PER_MEL_FRAME
    total = sum(SPLIT)
    mel = (rng.standard_normal((1, C.MEL_BINS, total)) - 5.0).astype(np.float32)
    noise = rng.uniform(size=(1, spf * total, C.HARMONIC_CHANNELS)).astype(np.float32)
    states = [np.zeros([0 if d < 0 else d for d in shape], np.float32)
              for shape in report_.state_shapes]
    names = [f"{hift_stream.STATE_OUT}{i}" for i in range(len(states))]
    calls, start = [], 0
    for index, frames in enumerate(SPLIT):
        feeds = {
            "speech_feat": mel[:, :, start:start + frames],
            "noise": noise[:, spf * start:spf * (start + frames)],
            hift_stream.FIRST_INPUT: np.array([int(index == 0)], np.int64),
            hift_stream.FINAL_INPUT: np.array([int(index == len(SPLIT) - 1)], np.int64),
            **{f"{hift_stream.STATE_IN}{i}": s for i, s in enumerate(states)},
        }
        calls.append(feeds)
        states = session.run(names, feeds)
        start += frames
    return path, calls


def _own_count(path: Path, feeds: dict[str, Any]) -> flops.OpCount:
    """Operations of one call of the streamed graph, counted on the graph itself: its flag
    inputs become constants of the call's values (shape inference then knows which paddings
    the call applies), every other input takes the call's shape. Written here, apart from
    bench.costmodel's fit, from the run's own feeds."""
    stripped = flops.load_stripped(path).model
    flags = (hift_stream.FIRST_INPUT, hift_stream.FINAL_INPUT)
    inputs = [i for i in stripped.graph.input if i.name not in flags]
    del stripped.graph.input[:]
    stripped.graph.input.extend(inputs)
    stripped.graph.initializer.extend(numpy_helper.from_array(feeds[f], f) for f in flags)
    return flops.count_ops(stripped, {k: list(np.shape(v)) for k, v in feeds.items()
                                      if k not in flags})


def _hift_count(tiny_model_dir: Path, frames: int) -> flops.OpCount:
    """One call of hift.onnx with the lean rewrite the streamed form is derived from
    (engine/derive/vocoder/hift_lean.py) over ``frames`` mel frames, counted directly (no
    fit)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = onnx.load(str(tiny_model_dir / HIFT.file))
        hift_lean.lean_generator(model)
        onnx.save(model, str(Path(tmp) / HIFT.file))
        stripped = flops.load_stripped(Path(tmp) / HIFT.file).model
    dims = concrete_dims(stripped, FAMILIES["hift"], {"F": frames})
    return flops.count_ops(stripped, dims)


def _shapes(feeds: dict[str, Any]) -> dict[str, list[int]]:
    return {k: [int(d) for d in np.shape(v)] for k, v in feeds.items()}


@pytest.fixture(scope="module")
def own_counts(streamed: tuple[Path, list[dict[str, Any]]]) -> list[flops.OpCount]:
    path, calls = streamed
    return [_own_count(path, feeds) for feeds in calls]


def test_streamed_vocoder_does_hift_onnx_work_per_frame(
    tiny_model_dir: Path, streamed: tuple[Path, list[dict[str, Any]]],
    own_counts: list[flops.OpCount],
) -> None:
    """Each middle call does hift.onnx's work per frame times its new frames (every frame
    once), plus the same fixed part, less than one frame's work (the zero frame the f0 path's
    convolutions get per call, engine/derive/vocoder/hift_exact.py); all calls together do
    what one call of hift.onnx over all frames does plus one fixed part per call."""
    _path, calls = streamed
    per_frame = _hift_count(tiny_model_dir, 41).fp32 - _hift_count(tiny_model_dir, 40).fp32
    assert per_frame > 0
    fixed = [count.fp32 - per_frame * feeds["speech_feat"].shape[2]
             for feeds, count in zip(calls[1:-1], own_counts[1:-1], strict=True)]
    assert max(fixed) - min(fixed) <= 1e-9 * per_frame  # one fixed part: per frame as hift
    assert 0 <= fixed[0] < per_frame
    assert all(count.int8 == 0 for count in own_counts)
    whole = _hift_count(tiny_model_dir, sum(SPLIT))
    assert sum(c.fp32 for c in own_counts) == pytest.approx(
        whole.fp32 + len(SPLIT) * fixed[0], rel=1e-9)


def test_benchmark_counts_the_streamed_vocoder_as_it_runs(
    streamed: tuple[Path, list[dict[str, Any]]], own_counts: list[flops.OpCount],
    tmp_path: Path,
) -> None:
    """The benchmark's cost model of the streamed graph (fitted on the graph alone, the
    states of a middle call found by shape inference) gives each middle call what the graph
    counts for the run's own states, and the utterance what its calls count together."""
    path, calls = streamed
    assert family_of(path.name) is FAMILIES["hift_stream"]
    costs = load_cost_models({path.name: path}, tmp_path / "cache.json")
    model = costs[path.name]
    assert isinstance(model, CostModel), model
    counted = [model.ops(_shapes(feeds)) for feeds in calls]
    for count, own in zip(counted[1:-1], own_counts[1:-1], strict=True):
        assert count.fp32 == pytest.approx(own.fp32, rel=1e-9)
    assert sum(c.fp32 for c in counted) == pytest.approx(sum(c.fp32 for c in own_counts),
                                                         rel=1e-9)
    assert counted[0].fp32 > own_counts[0].fp32  # the final call's extra work, counted first
    # every call reads the graph's weights once
    assert model.weight_bytes_fp32 == flops.load_stripped(path).weight_bytes_fp32 > 0
    # cached
    assert load_cost_models({path.name: path}, tmp_path / "cache.json")[path.name] == model


def test_a_graph_without_stream_states_is_not_a_streamed_vocoder(tiny_model_dir: Path) -> None:
    with pytest.raises(FlopCountError, match="stream_state_in"):
        fit_streamed_vocoder(flops.load_stripped(tiny_model_dir / HIFT.file))


def test_streamed_first_call_is_the_one_with_empty_states() -> None:
    model = CostModel("hift_stream", (5.0, 100.0, 7.0), (0.0, 0.0, 0.0), 0, 12, 0)
    state = {"speech_feat": [1, 80, 4], "stream_state_in.0": [1, 80, 3],
             "stream_state_in.1": [1, 0, 9]}
    empty = {"speech_feat": [1, 80, 4], "stream_state_in.0": [1, 80, 0],
             "stream_state_in.1": [1, 0, 9]}
    assert model.ops(state).fp32 == 33.0
    assert model.ops(empty).fp32 == 133.0


@pytest.mark.parametrize("bits", [4, 8])
def test_matmulnbits_counts_int8_operations_and_weight_bytes(tmp_path: Path, bits: int) -> None:
    """The fused LLM's quantised products (``fused-q4``: 4 bits, ``fused-b8``: 8 bits,
    accuracy_level 4 as engine/derive/llm/fused_graph.py builds them): 2 M K N int8
    operations, and their packed weights, scales and zero points are int8 weight bytes."""
    m, k, n, block = 3, 256, 64, 32
    blocks = k // block
    packed = np.zeros((n, blocks, block * bits // 8), np.uint8)
    scales = np.ones(n * blocks, np.float32)
    zeros = np.zeros(n * ((blocks * bits + 7) // 8), np.uint8)
    node = helper.make_node("MatMulNBits", ["a", "b", "s", "z"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s"),
         numpy_helper.from_array(zeros, "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "nbits.onnx"
    onnx.save(model, str(path))
    stripped = flops.load_stripped(path)
    assert stripped.weight_bytes_int8 == packed.nbytes + scales.nbytes + zeros.nbytes
    assert stripped.weight_bytes_fp32 == 0
    count = flops.count_ops(stripped.model, {"a": [m, k]})
    assert count.int8 == 2.0 * m * k * n and count.fp32 == 0


def test_weights_read_through_a_slice_with_constant_bounds_count(tmp_path: Path) -> None:
    """The streamed vocoder's f0 convolutions take channel groups of their weights through
    ``Slice`` nodes whose bounds are ``Constant`` nodes (engine/derive/vocoder/hift_exact.py):
    those weights are read every call and count."""
    weight = np.ones((8, 16, 3), np.float32)

    def const(name: str, value: list[int]) -> Any:
        return helper.make_node("Constant", [], [name],
                                value=numpy_helper.from_array(np.array(value, np.int64)))

    nodes = [const("starts", [0]), const("ends", [8]), const("axes", [1]),
             helper.make_node("Slice", ["w", "starts", "ends", "axes"], ["w_lo"]),
             helper.make_node("Conv", ["x", "w_lo"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")])
    path = tmp_path / "sliced.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert flops.load_stripped(path).weight_bytes_fp32 == weight.nbytes
