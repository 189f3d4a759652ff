"""The rewrite of HiFT's phase path (engine/derive/vocoder/hift_exact.py) on inputs where each
of its parts changes the numbers, so that a mistake in any part fails a test.

On the tiny and parity vocoders the Resize reads 480 equal samples per frame (f0 is upsampled
by repetition before it), and their MatMul's weight is a constant that onnxruntime packs (one
kernel for every call length), so a wrong tap or a missing spare row does not show there.
Here a Resize reads samples that differ within each window, and a MatMul reads a weight that is
not a constant, through small graphs of that structure ending in a ``CumSum`` (the rewrite
changes only what is upstream of one), run by the sessions the derivations use.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from wyoming_cosyvoice3.engine.derive.common.files import validation_session
from wyoming_cosyvoice3.engine.derive.vocoder.hift_exact import exact_phase_path, weight_shapes


def _model(nodes: list, inputs: list, initializers: list) -> object:
    graph = helper.make_graph(
        nodes, "phase-path", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("phase", TensorProto.FLOAT, None)],
        initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _resize_model(factor: int) -> object:
    """x [1, 1, S] -> linear half-pixel Resize by 1/factor (upstream's
    ``interpolate(scale_factor=1/480, mode="linear")`` as exported) -> y -> CumSum."""
    scales = numpy_helper.from_array(np.array([1, 1, 1 / factor], np.float32), "scales")
    axis = numpy_helper.from_array(np.array(2, np.int64), "axis")
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("CumSum", ["y", "axis"], ["phase"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "S"])]
    return _model(nodes, inputs, [scales, axis])


@pytest.mark.parametrize("factor", [480, 6, 3])
def test_the_resize_becomes_torchs_taps(factor: int) -> None:
    """Output j of a linear half-pixel downsampling by an integer r sits at source
    coordinate r j + (r - 1) / 2: the mean of samples r j + r/2 - 1 and r j + r/2 (r even;
    torch's weights 0.5 and 0.5) or sample r j + (r - 1) / 2 itself (r odd)."""
    frames = 40
    rng = np.random.default_rng(factor)
    x = rng.random((1, 1, factor * frames), dtype=np.float32)  # differs inside every window
    model = _resize_model(factor)
    counts = exact_phase_path(model, {})
    assert counts.resizes == 1
    assert "Resize" not in [node.op_type for node in model.graph.node]
    got = validation_session(model).run(["y"], {"x": x})[0]
    windows = x.reshape(frames, factor)
    if factor % 2 == 0:
        left, right = windows[:, factor // 2 - 1], windows[:, factor // 2]
        expected = (left + right) * np.float32(0.5)  # float32, as the graph adds and halves
    else:
        expected = windows[:, (factor - 1) // 2]
    assert got.shape == (1, 1, frames)
    np.testing.assert_array_equal(got.reshape(-1), expected)


def _matmul_model() -> object:
    """x [1, T, 512] @ w [512, 8] (w an input: a weight computed in the graph, which
    onnxruntime cannot pack ahead) -> y -> CumSum over T."""
    axis = numpy_helper.from_array(np.array(1, np.int64), "axis")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("CumSum", ["y", "axis"], ["phase"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 512]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [512, 8])]
    return _model(nodes, inputs, [axis])


def test_a_one_frame_call_rounds_as_the_same_frame_in_a_longer_call() -> None:
    """onnxruntime multiplies one row (a one-frame call) by a weight it did not pack with
    another kernel than several rows, summing the 512 products in another order (measured:
    476 of 512 values differ in their last bits between 64 one-frame calls and 8 calls of 8
    frames, on AVX-512 with and without AMX and on AVX2); the rewritten MatMul gets a spare
    zero row, so every frame is the same float32 number whatever the call's length. (A
    constant weight is packed when the session starts and then one kernel serves every
    length: the f0 classifier of the tiny and parity vocoders.)"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 512)).astype(np.float32)
    w = rng.standard_normal((512, 8)).astype(np.float32)
    model = _matmul_model()
    published = validation_session(model)

    def alone_and_among_eight(session: object) -> tuple[np.ndarray, np.ndarray]:
        def run(frames: slice) -> np.ndarray:
            return session.run(["y"], {"x": x[:, frames], "w": w})[0]  # type: ignore[attr-defined]

        alone = np.concatenate([run(slice(t, t + 1)) for t in range(64)], axis=1)
        among = np.concatenate([run(slice(t, t + 8)) for t in range(0, 64, 8)], axis=1)
        return alone, among

    counts = exact_phase_path(model, weight_shapes(model, {"x": x[:, :8], "w": w}))
    assert counts.padded == 1
    alone, among = alone_and_among_eight(validation_session(model))
    np.testing.assert_array_equal(alone, among)
    # the same products as the published graph, summed in some order: each result within
    # the float32 summation bound (K - 1) u sum |x_k w_k| of the exact sum, so two results
    # within twice that (u = 2^-24, K = 512)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    bound = 2 * 511 * 2.0**-24 * (np.abs(x64) @ np.abs(w64))
    reference = published.run(["y"], {"x": x, "w": w})[0]
    assert np.all(np.abs(among - reference) <= bound)
    assert np.all(np.abs(among - x64 @ w64) <= bound / 2)
