"""The lean generator rewrite (engine/derive/vocoder/hift_lean.py): upsampling convolutions at
the low rate and Snakes without their scalings give hift.onnx's numbers up to float rounding, on
the tiny synthetic vocoder, the parity vocoder exported from upstream's classes, and small
graphs where each rewrite's edge cases show (every phase of the interleave, a one-frame input,
an alpha too small to fold); the streamed graph derived from it pads its zero-padded
convolution inputs in the Concat with the state (no Pad node left there)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from parity_support import load_parity

from wyoming_cosyvoice3.engine.derive.common.files import validation_session
from wyoming_cosyvoice3.engine.derive.vocoder import hift_lean
from wyoming_cosyvoice3.engine.derive.vocoder.hift_exact import probe_feeds
from wyoming_cosyvoice3.engine.sessions import HIFT

MAX_REL = 1e-5
"""Largest accepted |lean - published| relative to the output's peak: float32 rounding of
regrouped sums (a few ulp per layer), far below the streamed form's 1e-4 on the audio."""


@pytest.fixture(scope="module", params=["tiny", "parity"])
def vocoder(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Path:
    # the parity set: skips, or fails in CI, without one (tests/parity_support.py)
    return load_parity().model_dir / HIFT.file if request.param == "parity" else (
        tiny_model_dir / HIFT.file)


def _run(model: object, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    return [np.asarray(x) for x in validation_session(model).run(names, feeds)]


@pytest.mark.parametrize("frames", [1, 7, 48])
def test_lean_vocoder_is_the_published_within_rounding(vocoder: Path, frames: int) -> None:
    published = onnx.load(str(vocoder))
    lean = onnx.load(str(vocoder))
    counts = hift_lean.lean_generator(lean)
    assert counts.upsamplings == 3  # upstream's three upsampling stages
    assert counts.snakes > 0 and counts.snakes_from_conv > 0
    # every Snake folded: its square goes straight into the sum (no 1 / a pass)
    readers: dict[str, list[str]] = {}
    for node in lean.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    squares = [n.output[0] for n in lean.graph.node if n.op_type in ("Mul", "Pow")
               and n.input[0].endswith(tuple(s.output[0] for s in lean.graph.node
                                             if s.op_type == "Sin"))]
    assert sum(readers.get(name) == ["Add"] for name in squares) == counts.snakes
    assert counts.snakes == sum(n.op_type == "Sin" for n in published.graph.node) - 2
    feeds = probe_feeds(frames, seed=frames)
    want = _run(published, feeds, ["magnitude"])[0]
    got = _run(lean, feeds, ["magnitude"])[0]
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= MAX_REL * np.abs(want).max()


def _upsample_model(r: int, k: int, cin: int, cout: int) -> object:
    """x [1, cin, T] -> repeat r times (Unsqueeze, Tile, Reshape as exported) -> causal Conv of
    k taps -> y."""
    rng = np.random.default_rng(r * 100 + k)
    inits = [
        numpy_helper.from_array(rng.standard_normal((cout, cin, k)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([3], np.int64), "axes"),
        numpy_helper.from_array(np.array([1, 1, 1, r], np.int64), "reps"),
        numpy_helper.from_array(np.array([0, 0, -1], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
        helper.make_node("Tile", ["u", "reps"], ["t"]),
        helper.make_node("Reshape", ["t", "shape"], ["up"]),
        helper.make_node("Conv", ["up", "w", "b"], ["y"], kernel_shape=[k], pads=[k - 1, 0],
                         strides=[1], dilations=[1], group=1),
    ]
    graph = helper.make_graph(
        nodes, "upsample", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [1, cin, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("r", "k"), [(8, 16), (5, 11), (3, 7), (2, 2), (4, 9)])
@pytest.mark.parametrize("frames", [1, 2, 13])
def test_low_rate_upsampling_equals_repeat_then_conv(r: int, k: int, frames: int) -> None:
    model = _upsample_model(r, k, cin=6, cout=5)
    lean = onnx.ModelProto()
    lean.CopyFrom(model)
    assert hift_lean._low_rate_upsampling(lean) == 1
    assert {n.op_type for n in lean.graph.node} >= {"Conv", "Transpose"}
    assert not any(n.op_type == "Tile" for n in lean.graph.node)
    x = np.random.default_rng(frames).standard_normal((1, 6, frames)).astype(np.float32)
    want = _run(model, {"x": x}, ["y"])[0]
    got = _run(lean, {"x": x}, ["y"])[0]
    assert got.shape == want.shape == (1, 5, r * frames)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _snake_model(alpha: np.ndarray) -> object:
    """x -> Conv -> Snake(alpha) -> Conv -> y, as upstream's Snake is exported."""
    c = alpha.size
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((c, c, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((c, c, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(alpha.astype(np.float32), "alpha"),
        numpy_helper.from_array(np.array([0, 2], np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-9, np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["h"], kernel_shape=[3], pads=[2, 0]),
        helper.make_node("Unsqueeze", ["alpha", "axes"], ["a"]),
        helper.make_node("Mul", ["h", "a"], ["ax"]),
        helper.make_node("Sin", ["ax"], ["s"]),
        helper.make_node("Mul", ["s", "s"], ["s2"]),
        helper.make_node("Add", ["a", "eps"], ["ae"]),
        helper.make_node("Div", ["s2", "ae"], ["d"]),
        helper.make_node("Add", ["h", "d"], ["snake"]),
        helper.make_node("Conv", ["snake", "w2"], ["y"], kernel_shape=[3], pads=[2, 0]),
    ]
    graph = helper.make_graph(
        nodes, "snake", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("alpha", "folded"), [
    (np.array([0.8, 1.3, -0.9, 2.0]), True),
    (np.array([0.8, 1.3, 1e-4, 2.0]), False),  # a + 1e-9 is not a in float32
    (np.array([0.8, 0.0, 0.9, 2.0]), False),
])
def test_snake_folds_only_where_exact(alpha: np.ndarray, folded: bool) -> None:
    model = _snake_model(alpha)
    lean = onnx.ModelProto()
    lean.CopyFrom(model)
    counts = hift_lean.lean_generator(lean)
    assert (counts.snakes, counts.snakes_from_conv) == ((1, 1) if folded else (0, 0))
    ops = [n.op_type for n in lean.graph.node]
    assert ("Div" in ops) != folded
    x = np.random.default_rng(2).standard_normal((1, alpha.size, 21)).astype(np.float32)
    want = _run(model, {"x": x}, ["y"])[0]
    got = _run(lean, {"x": x}, ["y"])[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
