"""The int8 and 4-bit rewrites of the synthetic LLM against onnxruntime and numpy oracles."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from synthetic.quant import (
    dequantize_q4,
    pack_q4,
    quantize_int8,
    quantize_q4,
)


def two_matmuls(k: int = 48, n: int = 40) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(k, n)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(n, 7)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
            helper.make_node("Tanh", ["h"], ["a"]),
            helper.make_node("MatMul", ["a", "w2"], ["y"], name="second"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "s", 7])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


def test_int8_rewrite_matches_onnxruntime_quantize_dynamic(tmp_path: Path) -> None:
    model = two_matmuls()
    onnx.save_model(model, str(tmp_path / "fp32.onnx"))
    logging.disable(logging.WARNING)  # the quantiser's pre-processing hint
    try:
        quantize_dynamic(
            tmp_path / "fp32.onnx",
            tmp_path / "ort.onnx",
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            weight_type=QuantType.QInt8,
        )
    finally:
        logging.disable(logging.NOTSET)
    reference = onnx.load_model(str(tmp_path / "ort.onnx"))
    ours = quantize_int8(model)
    ref_init = {i.name: numpy_helper.to_array(i) for i in reference.graph.initializer}
    our_init = {i.name: numpy_helper.to_array(i) for i in ours.graph.initializer}
    for name in ("w1_quantized", "w2_quantized", "w1_zero_point"):
        np.testing.assert_array_equal(our_init[name], ref_init[name])
    np.testing.assert_allclose(our_init["w1_scale"], ref_init["w1_scale"], rtol=1e-6)
    x = np.random.default_rng(1).normal(size=(1, 5, 48)).astype(np.float32)
    np.testing.assert_allclose(run(ours, x), run(reference, x), rtol=1e-5, atol=1e-5)
    assert sorted(n.op_type for n in ours.graph.node) == sorted(
        n.op_type for n in reference.graph.node
    )


def test_int8_exclude_keeps_float_matmul() -> None:
    ours = quantize_int8(two_matmuls(), exclude=("second",))
    ops = [n.op_type for n in ours.graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("MatMul") == 1


@pytest.mark.parametrize(("k", "n"), [(64, 70), (40, 3)])
def test_q4_pack_round_trip_error_is_half_a_step(k: int, n: int) -> None:
    weight = np.random.default_rng(2).normal(size=(k, n)).astype(np.float32)
    packed, scales = pack_q4(weight)
    blocks = -(-k // 32)
    assert packed.shape == (n, blocks, 16) and packed.dtype == np.uint8
    assert scales.shape == (n * blocks,)
    restored = dequantize_q4(packed, scales, k)
    step = np.repeat(scales.reshape(n, blocks), 32, axis=1)[:, :k].T  # [K, N]
    assert np.all(np.abs(restored - weight) <= step / 2 + 1e-6)
    # the largest weight of each block is exact (scale = max|w| / 7)
    col = int(np.argmax(np.abs(weight[:, 0])))
    assert restored[col, 0] == pytest.approx(weight[col, 0], rel=1e-6)


def test_q4_matmulnbits_equals_dequantised_numpy_matmul() -> None:
    model = two_matmuls()
    ours = quantize_q4(model)
    assert [n.op_type for n in ours.graph.node].count("MatMulNBits") == 2
    weights = {i.name: numpy_helper.to_array(i) for i in ours.graph.initializer}
    w1 = dequantize_q4(weights["w1_q4"], weights["w1_scales"], 48)
    w2 = dequantize_q4(weights["w2_q4"], weights["w2_scales"], 40)
    x = np.random.default_rng(3).normal(size=(1, 6, 48)).astype(np.float32)
    expected = np.tanh(x @ w1) @ w2
    np.testing.assert_allclose(run(ours, x), expected, rtol=1e-4, atol=1e-4)
