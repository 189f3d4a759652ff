"""Graphs with the contract's signature but a structure a derivation cannot use, for the
tests of the fallbacks (the tiny model itself derives every graph)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def convolutional_estimator() -> onnx.ModelProto:
    """A graph with the estimator's contract but no MatMul at all (one Conv over x, mu and
    cond, masked): nothing the int8, split or streaming derivations can work on."""
    names = ("x", "mask", "mu", "t", "spks", "cond")
    shapes: dict[str, list[int | str]] = {"mask": [2, 1, "F"], "t": [2], "spks": [2, 80]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes.get(n, [2, 80, "F"]))
              for n in names]
    kernel = np.random.default_rng(0).normal(0, 0.05, (80, 240, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Concat", ["x", "mu", "cond"], ["xmc"], axis=1),
        helper.make_node("Conv", ["xmc", "kernel"], ["conv"], pads=[1, 1]),
        helper.make_node("Mul", ["conv", "mask"], ["estimator_out"]),
    ]
    out = helper.make_tensor_value_info("estimator_out", TensorProto.FLOAT, [2, 80, "F"])
    graph = helper.make_graph(nodes, "conv_estimator", inputs, [out],
                              [numpy_helper.from_array(kernel, "kernel")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
