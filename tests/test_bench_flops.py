"""Operation counting of ONNX graphs (bench.flops / costmodel)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import flops
from bench.costmodel import (
    FAMILIES,
    CostModel,
    concrete_dims,
    family_of,
    fit_cost_model,
    load_cost_models,
)


def _save(tmp_path: Path, nodes, inputs, outputs, inits, name="g.onnx") -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _f32(shape) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_matmul_gemm_conv_convtranspose_counts(tmp_path: Path) -> None:
    m, k, n = 5, 96, 80
    nodes = [
        helper.make_node("MatMul", ["a", "w1"], ["y1"]),                        # 2 m k n
        helper.make_node("Gemm", ["y1", "w2"], ["y2"], transB=1),               # 2 m n 40
        helper.make_node("Unsqueeze", ["y2", "axes"], ["y3"]),                  # [1, m, 40]
        helper.make_node("Conv", ["y3", "wc"], ["y4"], group=1, pads=[1, 1]),   # [1, 8, 40]
        helper.make_node("ConvTranspose", ["y4", "wt"], ["y5"], strides=[2]),   # in 8 x 40
    ]
    inits = [
        numpy_helper.from_array(_f32((k, n)), "w1"),
        numpy_helper.from_array(_f32((40, n)), "w2"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "axes"),
        numpy_helper.from_array(_f32((8, m, 3)), "wc"),
        numpy_helper.from_array(_f32((8, 4, 4)), "wt"),
    ]
    path = _save(tmp_path, nodes, [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                 [helper.make_tensor_value_info("y5", TensorProto.FLOAT, None)], inits)
    stripped = flops.load_stripped(path)
    count = flops.count_ops(stripped.model, {"a": [m, k]})
    expected = (2 * m * k * n + 2 * m * n * 40 + 2 * (8 * 40) * (m * 3)
                + 2 * (8 * 40) * (4 * 4))
    assert count.fp32 == pytest.approx(expected)
    assert count.int8 == 0
    # every weight feeding a counted op, in bytes (the 1-element axes tensor is not one)
    assert stripped.weight_bytes_fp32 == 4 * (k * n + 40 * n + 8 * m * 3 + 8 * 4 * 4)
    # large weights are lifted to graph inputs: the stripped proto holds no weight data
    assert not any(len(init.raw_data) > 1000 for init in stripped.model.graph.initializer)


def test_matmulinteger_counts_as_int8(tmp_path: Path) -> None:
    m, k, n = 3, 64, 128
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["a"], ["aq", "sa", "za"]),
        helper.make_node("MatMulInteger", ["aq", "w", "za", "zw"], ["acc"]),
    ]
    inits = [numpy_helper.from_array(np.ones((k, n), dtype=np.int8), "w"),
             numpy_helper.from_array(np.zeros((), dtype=np.int8), "zw")]
    path = _save(tmp_path, nodes, [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                 [helper.make_tensor_value_info("acc", TensorProto.INT32, None)], inits)
    stripped = flops.load_stripped(path)
    count = flops.count_ops(stripped.model, {})
    assert count.int8 == 2 * m * k * n and count.fp32 == 0
    assert stripped.weight_bytes_int8 == k * n + 1 and stripped.weight_bytes_fp32 == 0


@pytest.mark.parametrize("level", [0, 1, 4])
def test_matmulnbits_uses_k_and_accuracy_level(level: int) -> None:
    node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft",
                            K=256, N=64, bits=4, block_size=32, accuracy_level=level)
    shapes = {"a": [1, 7, 256], "b": [64, 8, 16], "y": [1, 7, 64]}
    ops = 2 * 7 * 64 * 256
    expected = flops.OpCount(int8=ops) if level == 4 else flops.OpCount(fp32=ops)
    assert flops.node_ops(node, shapes) == expected


def test_unknown_shapes_raise() -> None:
    node = helper.make_node("MatMul", ["a", "w"], ["y"])
    with pytest.raises(flops.FlopCountError):
        flops.node_ops(node, {"a": [1, None, 8], "w": [8, 4], "y": [1, None, 4]})


def _attention_like(tmp_path: Path, batch: int, dim: int) -> Path:
    """x [B, 80, F] -> h = x^T W [B, F, dim] -> h h^T [B, F, F] (the estimator's input names)."""
    names = ("x", "mask", "mu", "cond")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, 80, "F"])
              for n in names]
    inputs += [helper.make_tensor_value_info("t", TensorProto.FLOAT, [batch]),
               helper.make_tensor_value_info("spks", TensorProto.FLOAT, [batch, 80])]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["xt", "w"], ["h"]),
        helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "ht"], ["scores"]),
    ]
    inits = [numpy_helper.from_array(_f32((80, dim)), "w")]
    return _save(tmp_path, nodes, inputs,
                 [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], inits,
                 name="flow.decoder.estimator.fp32.onnx")


def test_fit_is_exact_for_quadratic_cost(tmp_path: Path) -> None:
    dim = 48
    stripped = flops.load_stripped(_attention_like(tmp_path, 2, dim))
    model = fit_cost_model(stripped, FAMILIES["estimator"])
    assert model.batch_static == 2
    assert model.fp32_coef == pytest.approx((0.0, 2 * 80 * dim, 2 * dim), abs=1e-3)
    for frames in (7, 100, 333):
        direct = flops.count_ops(stripped.model, concrete_dims(
            stripped.model, FAMILIES["estimator"], {"B": 2, "F": frames}))
        fitted = model.ops({"x": [2, 80, frames]})
        assert fitted.fp32 == pytest.approx(direct.fp32, rel=1e-9)
    # a static CFG batch of 2 is what runs, whatever batch the caller reports
    assert model.ops({"x": [1, 80, 50]}).fp32 == pytest.approx(model.ops({"x": [2, 80, 50]}).fp32)


def test_cost_models_cache_and_roundtrip(tmp_path: Path) -> None:
    path = _attention_like(tmp_path, 2, 16)
    cache = tmp_path / "cache.json"
    first = load_cost_models({path.name: path, "speech_embedding.onnx": path}, cache)
    model = first[path.name]
    assert isinstance(model, CostModel)
    assert isinstance(first["speech_embedding.onnx"], str)  # lookup-only
    assert CostModel.from_json(model.to_json()) == model
    again = load_cost_models({path.name: path}, cache)
    assert again[path.name] == model
    # a derived graph deleted after the run (e.g. a re-keyed int8 estimator) keeps its count
    path.unlink()
    assert load_cost_models({path.name: path}, cache)[path.name] == model
    assert isinstance(load_cost_models({"hift.onnx": tmp_path / "hift.onnx"}, cache)["hift.onnx"],
                      str)


def test_tiny_llm_costs_match_its_weights(tiny_model_dir: Path) -> None:
    """Per new position the LLM does 2 x (all MatMul weights) operations minus the speech head,
    which only runs on the last position (constant term); attention grows with S x T."""
    path = tiny_model_dir / "llm.onnx"
    stripped = flops.load_stripped(path)
    model = fit_cost_model(stripped, FAMILIES["llm"])
    proto = onnx.load(str(path), load_external_data=False)
    weights = {i.name: int(np.prod(i.dims)) for i in proto.graph.initializer}
    matmul_weights = sum(weights.get(n.input[1], 0) for n in proto.graph.node
                         if n.op_type == "MatMul")
    constant, per_position, per_pair = model.fp32_coef
    assert constant + per_position == pytest.approx(2 * matmul_weights)
    assert per_pair > 0
    assert model.weight_bytes_fp32 == 4 * matmul_weights
    assert family_of("llm_int8.onnx") is FAMILIES["llm"]
    assert family_of("flow.decoder.estimator.int8-1-2.onnx") is FAMILIES["estimator"]
    assert family_of("flow.decoder.estimator.int8main-1-2.onnx") is FAMILIES["estimator"]
    assert family_of("flow.decoder.estimator.time-1-2.onnx") is FAMILIES["dit_time"]
    assert family_of("text_embedding_fp16.onnx") is None


def test_streaming_dit_costs_match_the_published_estimator(
    tiny_dit_model_dir: Path, tmp_path: Path
) -> None:
    """The derived streaming DiT: without a cache it does the published estimator's work
    (plus its rotary tables, bias and convolution context: 0.1 % at full size, a few % at
    these tiny dims); each cached frame adds attention work only."""
    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import ensure_streaming_estimator

    main, _time = ensure_streaming_estimator(
        tiny_dit_model_dir / "flow.decoder.estimator.fp32.onnx", tmp_path, "fp32",
        in_process=True)
    assert family_of(main.name) is FAMILIES["stream_estimator"]
    assert family_of(_time.name) is FAMILIES["dit_time"]
    time_cost = fit_cost_model(flops.load_stripped(_time), FAMILIES["dit_time"])
    # one time value a run (a CFG call's two rows share it): a run's work, the same whatever
    # batch the fit tried
    assert time_cost.ops({"t": [1]}).fp32 > 0
    assert time_cost.ops({"t": [1]}).fp32 == time_cost.ops({"t": [2]}).fp32
    stream = fit_cost_model(flops.load_stripped(main), FAMILIES["stream_estimator"])
    published = fit_cost_model(
        flops.load_stripped(tiny_dit_model_dir / "flow.decoder.estimator.fp32.onnx"),
        FAMILIES["estimator"])
    empty = [2, 2, 0, 64]
    for frames in (20, 90):
        alone = stream.ops({"x": [2, 80, frames], "prompt_key_0": empty, "hist_key_0": empty})
        reference = published.ops({"x": [2, 80, frames]}).fp32
        assert reference <= alone.fp32 <= 1.05 * reference
        cached = stream.ops({"x": [2, 80, frames], "prompt_key_0": [2, 2, 30, 64],
                             "hist_key_0": [2, 2, 20, 64]})
        per_cached = stream.fp32_coef[3] * 2 * frames * 50
        assert per_cached > 0 and cached.fp32 == pytest.approx(alone.fp32 + per_cached)
    # batch 1 (Euler steps without CFG) costs half: the streaming graph's batch is free
    assert stream.batch_static == 0


def test_derived_llm_is_counted_as_its_source(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A fused LLM graph's shapes cannot be inferred (contrib operators); its derivation
    report names the source, whose matrix products it runs, and that is counted."""
    from bench.costmodel import derived_source

    fused = tmp_path / "llm.fused1-1-2.onnx"
    fused.write_bytes(b"not a graph onnx can read")
    (tmp_path / "llm.fused1-1-2.onnx.json").write_text('{"source": "llm.onnx"}')
    beside = [tiny_model_dir / "flow_encoder.onnx"]
    assert derived_source(fused, beside) == tiny_model_dir / "llm.onnx"
    assert derived_source(tiny_model_dir / "llm.onnx", beside) is None  # no report
    models = load_cost_models({fused.name: fused, "flow_encoder.onnx": beside[0]},
                              tmp_path / "cache.json")
    direct = fit_cost_model(flops.load_stripped(tiny_model_dir / "llm.onnx"), FAMILIES["llm"])
    assert models[fused.name] == direct
    alone = load_cost_models({fused.name: fused}, tmp_path / "cache2.json")
    assert isinstance(alone[fused.name], str)  # no model directory to find the source in
