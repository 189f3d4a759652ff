"""int8 and 4-bit variants of the synthetic LLM (llm_int8.onnx, llm_q4.onnx).

* int8: dynamic quantisation with per-channel int8 weights of every MatMul with a constant
  weight, the node pattern of ``onnxruntime.quantization.quantize_dynamic``, as the export's
  model card describes ("dynamic int8 MatMul (per-channel)").
* q4: every MatMul with a constant [K, N] weight becomes a ``com.microsoft`` ``MatMulNBits``
  node (bits 4, block 32, symmetric, no zero-point input so the implicit zero point is 8), as
  the model card describes ("MatMulNBits 4-bit (block 32, symmetric)"). The packing is done
  here with numpy because onnxruntime's own 4-bit quantiser needs the extra ``onnx_ir``
  package; layout per the MatMulNBits contrib-op documentation: B uint8 [N, K/32, 16] with
  the first of two consecutive K elements in the low nibble, scales float32 [N * K/32].
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .onnx_builder import MS_DOMAIN

Q4_BLOCK = 32
Q4_BITS = 4


def quantize_int8(model: onnx.ModelProto, exclude: tuple[str, ...] = ()) -> onnx.ModelProto:
    """Return the dynamic-int8 (per-channel) version of ``model``.

    Every MatMul with a constant 2-D weight (not named in ``exclude``) becomes the node pattern
    ``onnxruntime.quantization.quantize_dynamic(per_channel=True, weight_type=QInt8)`` emits:
    ``DynamicQuantizeLinear(x)`` (uint8, per tensor, at run time) -> ``MatMulInteger`` with the
    int8 weight (symmetric per output column, ``scale = max|w| / 127``, zero point 0) ->
    ``Cast`` to float -> ``Mul`` by ``x_scale * w_scale``. Rewritten here with numpy because
    onnxruntime's quantiser handles per-channel weights one column at a time in Python
    (~10 s for a small LLM); the result is checked against it in the tests.
    """
    out = _copy(model)
    graph = out.graph
    weights = {init.name: init for init in graph.initializer}
    new_nodes: list[onnx.NodeProto] = []
    dropped: set[str] = set()
    for node in graph.node:
        init = _constant_weight(node, weights, exclude)
        if init is None:
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(init).astype(np.float32)
        scales = np.abs(weight).max(axis=0) / 127.0
        safe = np.where(scales == 0.0, 1.0, scales)
        q = np.clip(np.rint(weight / safe), -127, 127).astype(np.int8)
        base, x = node.name or init.name, node.input[0]
        names = {key: f"{base}_{key}" for key in ("xq", "xs", "xz", "acc", "accf", "scale")}
        graph.initializer.extend(
            [
                numpy_helper.from_array(q, f"{init.name}_quantized"),
                numpy_helper.from_array(scales.astype(np.float32), f"{init.name}_scale"),
                numpy_helper.from_array(np.zeros_like(q[0]), f"{init.name}_zero_point"),
            ]
        )
        dropped.add(init.name)
        new_nodes.extend(
            [
                helper.make_node(
                    "DynamicQuantizeLinear", [x], [names["xq"], names["xs"], names["xz"]]
                ),
                helper.make_node("Mul", [names["xs"], f"{init.name}_scale"], [names["scale"]]),
                helper.make_node(
                    "MatMulInteger",
                    [names["xq"], f"{init.name}_quantized", names["xz"], f"{init.name}_zero_point"],
                    [names["acc"]],
                ),
                helper.make_node(
                    "Cast", [names["acc"]], [names["accf"]], to=onnx.TensorProto.FLOAT
                ),
                helper.make_node("Mul", [names["accf"], names["scale"]], list(node.output)),
            ]
        )
    _replace(graph, new_nodes, dropped)
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _constant_weight(
    node: onnx.NodeProto, weights: dict[str, onnx.TensorProto], exclude: tuple[str, ...]
) -> onnx.TensorProto | None:
    """The 2-D initializer used as B of a MatMul ``node``, else None."""
    if node.op_type != "MatMul" or node.name in exclude:
        return None
    init = weights.get(node.input[1])
    return init if init is not None and len(init.dims) == 2 else None


def _replace(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], dropped: set[str]) -> None:
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [init for init in graph.initializer if init.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def pack_q4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a float32 [K, N] weight to (packed uint8 [N, K/32, 16], scales float32 [N*K/32]).

    Symmetric per block of 32 along K: ``scale = max|w| / 7``, ``q = clip(round(w/scale),
    -8, 7) + 8``; dequantised ``(q - 8) * scale``. K is zero-padded to a multiple of 32.
    """
    k, n = weight.shape
    n_blocks = -(-k // Q4_BLOCK)
    padded = np.zeros((n_blocks * Q4_BLOCK, n), np.float32)
    padded[:k] = weight
    blocks = padded.T.reshape(n, n_blocks, Q4_BLOCK)
    scales = np.abs(blocks).max(axis=2) / 7.0
    safe = np.where(scales == 0.0, 1.0, scales)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -8, 7).astype(np.int16) + 8
    q = q.astype(np.uint8)
    packed = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8)
    return packed, scales.astype(np.float32).reshape(-1)


def dequantize_q4(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """Inverse of :func:`pack_q4`: float32 [K, N] (for tests and checks)."""
    n, n_blocks, _ = packed.shape
    q = np.empty((n, n_blocks, Q4_BLOCK), np.int16)
    q[:, :, 0::2] = packed & 0x0F
    q[:, :, 1::2] = packed >> 4
    values = (q - 8).astype(np.float32) * scales.reshape(n, n_blocks)[:, :, None]
    return values.reshape(n, n_blocks * Q4_BLOCK).T[:k]


def quantize_q4(model: onnx.ModelProto, exclude: tuple[str, ...] = ()) -> onnx.ModelProto:
    """Return ``model`` with every constant-weight 2-D MatMul replaced by MatMulNBits, except
    the nodes named in ``exclude``."""
    out = _copy(model)
    graph = out.graph
    weights = {init.name: init for init in graph.initializer}
    new_nodes: list[onnx.NodeProto] = []
    dropped: set[str] = set()
    for node in graph.node:
        init = _constant_weight(node, weights, exclude)
        if init is None:
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(init).astype(np.float32)
        k, n = weight.shape
        packed, scales = pack_q4(weight)
        b_name, s_name = f"{init.name}_q4", f"{init.name}_scales"
        graph.initializer.extend(
            [numpy_helper.from_array(packed, b_name), numpy_helper.from_array(scales, s_name)]
        )
        dropped.add(init.name)
        new_nodes.append(
            helper.make_node(
                "MatMulNBits",
                [node.input[0], b_name, s_name],
                list(node.output),
                name=f"{node.name}_q4",
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=Q4_BITS,
                block_size=Q4_BLOCK,
            )
        )
    _replace(graph, new_nodes, dropped)
    if not any(op.domain == MS_DOMAIN for op in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out
