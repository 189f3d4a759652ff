"""Operation counts of the ONNX graphs, as functions of their dynamic input sizes.

A graph's multiply-accumulate work is read from its nodes after ONNX shape inference with
concrete input sizes: ``MatMul``/``Gemm``/``FusedMatMul`` cost 2 x M x K x N, ``Conv`` 2 x output
elements x (C_in / group) x kernel size, ``ConvTranspose`` 2 x input elements x (C_out / group)
x kernel size; ``MatMulInteger`` (the ``quantize_dynamic`` pattern) counts as int8 operations,
``MatMulNBits`` (4-bit weights) as int8 with ``accuracy_level`` 4 and fp32 otherwise;
the contrib ``MultiHeadAttention`` as its two products, 2 x 2 x (query elements) x (key
frames), fp32.
Element-wise work (norms, activations, softmax) is not counted: it is small next to the
matrix products and not what the MatMul throughput measures.

Counting a graph needs its structure only: large weights are lifted out of the loaded proto
as graph inputs (their byte sizes are kept: a run reads every weight once, which bounds
memory-bound runs such as LLM decoding). Fitting counts to input sizes: :mod:`.costmodel`.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FP32_OPS = frozenset({"MatMul", "Gemm", "FusedMatMul", "Conv", "FusedConv", "ConvTranspose"})
INT8_OPS = frozenset(
    {"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul",
     "ConvInteger", "QLinearConv"}
)
NBITS_OP = "MatMulNBits"
ATTENTION_OP = "MultiHeadAttention"
_KEEP_ELEMENTS = 64
"""Initializers up to this size keep their values (shape tensors for Reshape and friends)."""


class FlopCountError(RuntimeError):
    """A graph's work could not be counted (unknown shapes after inference, bad fit)."""


@dataclass(frozen=True)
class OpCount:
    """Work of one graph run: float operations and int8 operations (1 MAC = 2 operations)."""

    fp32: float = 0.0
    int8: float = 0.0

    def __add__(self, other: OpCount) -> OpCount:
        return OpCount(self.fp32 + other.fp32, self.int8 + other.int8)

    def scaled(self, factor: float) -> OpCount:
        return OpCount(self.fp32 * factor, self.int8 * factor)


@dataclass
class StrippedGraph:
    """A graph proto without its large weights, plus what the weights weigh.

    Attributes:
        model: the ``onnx.ModelProto`` (large initializers emptied).
        weight_bytes_fp32: bytes of float weights feeding counted float ops.
        weight_bytes_int8: bytes of quantized weights (int8 / 4-bit + scales) feeding int8 ops.
    """

    model: Any
    weight_bytes_fp32: int
    weight_bytes_int8: int


def _tensor_bytes(tensor: Any) -> int:
    import onnx

    itemsize = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize)
    return int(math.prod(tensor.dims)) * itemsize


def load_stripped(path: Path) -> StrippedGraph:
    """Load ``path`` without its large weights; measure what the weights weigh.

    Large initializers (and large ``Constant`` nodes) become graph inputs of the same dtype and
    shape, so shape inference sees their shapes and never their values; small ones (shape
    tensors) keep their values, read from external data if needed.
    """
    import onnx
    from onnx import TensorProto, external_data_helper, helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    sizes: dict[str, int] = {}
    kept, lifted = [], []
    for init in graph.initializer:
        sizes[init.name] = _tensor_bytes(init)
        if math.prod(init.dims) > _KEEP_ELEMENTS:
            lifted.append((init.name, init.data_type, list(init.dims)))
            continue
        if init.data_location == TensorProto.EXTERNAL:
            external_data_helper.load_external_data_for_tensor(init, str(path.parent))
            init.data_location = TensorProto.DEFAULT
            del init.external_data[:]
        kept.append(init)
    nodes = []
    for node in graph.node:
        value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
        big = value is not None and math.prod(value.dims) > _KEEP_ELEMENTS
        if node.op_type == "Constant" and value is not None and big:
            sizes[node.output[0]] = _tensor_bytes(value)
            lifted.append((node.output[0], value.data_type, list(value.dims)))
            continue
        nodes.append(node)
    fp32, int8 = _weight_bytes(nodes, sizes)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.extend(helper.make_tensor_value_info(n, t, d) for n, t, d in lifted)
    return StrippedGraph(model, fp32, int8)


def _weight_bytes(nodes: Iterable[Any], sizes: Mapping[str, int]) -> tuple[int, int]:
    """Bytes of the constant tensors (traced through constant-only nodes) used by counted ops."""
    roots: dict[str, frozenset[str]] = {name: frozenset([name]) for name in sizes}
    used: dict[str, str] = {}
    for node in nodes:
        inputs = [name for name in node.input if name]
        if node.op_type == "Constant":  # a small one (shape, slice bounds): no weight bytes
            roots.update((out, frozenset()) for out in node.output)
            continue
        if node.op_type in FP32_OPS or node.op_type in INT8_OPS or node.op_type == NBITS_OP:
            kind = "fp32" if node.op_type in FP32_OPS else "int8"
            for name in inputs:
                for root in roots.get(name, frozenset()):
                    used.setdefault(root, kind)
        elif inputs and all(name in roots for name in inputs):
            joined = frozenset().union(*(roots[name] for name in inputs))
            for out in node.output:
                roots[out] = joined
    fp32 = sum(sizes[name] for name, kind in used.items() if kind == "fp32")
    int8 = sum(sizes[name] for name, kind in used.items() if kind == "int8")
    return fp32, int8


def _shape_map(model: Any) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    graph = model.graph
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
            continue
        shapes[info.name] = [
            int(d.dim_value) if d.HasField("dim_value") else None
            for d in info.type.tensor_type.shape.dim
        ]
    for init in graph.initializer:
        shapes[init.name] = [int(d) for d in init.dims]
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    shapes[node.output[0]] = [int(d) for d in attr.t.dims]
    return shapes


def _known(shape: Sequence[int | None] | None) -> bool:
    return shape is not None and all(d is not None and d >= 0 for d in shape)


def _attr(node: Any, name: str, default: Any) -> Any:
    import onnx

    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def node_ops(node: Any, shapes: Mapping[str, list[int | None]]) -> OpCount:
    """Operations of one node (0 for uncounted op types).

    Raises:
        FlopCountError: a counted node's shapes are unknown.
    """
    op = node.op_type
    if op == ATTENTION_OP:
        return _attention_ops(node, shapes)
    if op not in FP32_OPS and op not in INT8_OPS and op != NBITS_OP:
        return OpCount()
    a = shapes.get(node.input[0])
    w = shapes.get(node.input[1]) if len(node.input) > 1 else None
    out = shapes.get(node.output[0])
    if not (_known(a) and _known(out)) or (op != NBITS_OP and not _known(w)):
        raise FlopCountError(f"{op} node {node.name!r}: shapes unknown (in {a}, w {w}, out {out})")
    assert a is not None and out is not None  # narrowed by _known
    out_elems = math.prod(d or 0 for d in out)
    if op in ("Conv", "FusedConv", "ConvInteger", "QLinearConv"):
        weight = w if op != "QLinearConv" else shapes.get(node.input[3])
        assert weight is not None
        ops = 2.0 * out_elems * math.prod(d or 0 for d in weight[1:])
    elif op == "ConvTranspose":
        assert w is not None
        ops = 2.0 * math.prod(d or 0 for d in a) * math.prod(d or 0 for d in w[1:])
    elif op == NBITS_OP:
        ops = 2.0 * out_elems * int(_attr(node, "K", 0))
    elif op == "Gemm":
        k = a[0] if _attr(node, "transA", 0) else a[1]
        ops = 2.0 * out_elems * (k or 0)
    else:  # MatMul-like: out [..., M, N], contraction over A's last axis
        ops = 2.0 * out_elems * (a[-1] or 0)
    int8 = op in INT8_OPS or (op == NBITS_OP and int(_attr(node, "accuracy_level", 0)) == 4)
    return OpCount(int8=ops) if int8 else OpCount(fp32=ops)


def _attention_ops(node: Any, shapes: Mapping[str, list[int | None]]) -> OpCount:
    """q k^T and p v of a ``MultiHeadAttention`` node: query [B, S, hidden], key [B, T,
    hidden] or head-major [B, H, T, head_dim] (past keys/values are not used by the
    project's graphs)."""
    query = shapes.get(node.input[0])
    key = shapes.get(node.input[1]) if len(node.input) > 1 else None
    if not (_known(query) and _known(key)) or query is None or key is None:
        raise FlopCountError(f"{node.op_type} node {node.name!r}: shapes unknown "
                             f"(query {query}, key {key})")
    frames = key[2] if len(key) == 4 else key[1]
    return OpCount(fp32=4.0 * math.prod(d or 0 for d in query) * (frames or 0))


def _infer(model: Any, symbolic: bool) -> Any:
    from onnx import shape_inference

    if not symbolic:
        return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # when it gives up, the tool saves its partial model as sym_shape_infer_temp.onnx in the
    # working directory: run it in a scratch directory (process-wide; the bench is one thread)
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True)


def count_ops(stripped: Any, input_dims: Mapping[str, Sequence[int]]) -> OpCount:
    """Operations of one run of a (stripped) graph with the given input sizes.

    Shapes come from onnxruntime's symbolic shape inference (it follows shape arithmetic
    such as ``Shape -> Range -> Expand``), or from ONNX shape inference with data propagation
    when the former fails on a graph.

    Args:
        stripped: ``onnx.ModelProto`` (e.g. :attr:`StrippedGraph.model`); not modified.
        input_dims: graph input name -> concrete shape; inputs left out keep their declared
            dims (symbolic ones become 1).

    Raises:
        FlopCountError: a counted node's shapes stay unknown after both inferences.
    """
    return count_ops_and_outputs(stripped, input_dims)[0]


def count_ops_and_outputs(
    stripped: Any, input_dims: Mapping[str, Sequence[int]]
) -> tuple[OpCount, dict[str, list[int | None]]]:
    """:func:`count_ops`, and the inferred shapes of the graph's outputs (None: unknown)."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(stripped)
    for inp in model.graph.input:
        dims = inp.type.tensor_type.shape.dim
        wanted = input_dims.get(inp.name)
        for axis, dim in enumerate(dims):
            value = wanted[axis] if wanted is not None else (dim.dim_value or 1)
            dim.Clear()
            dim.dim_value = int(value)
    problems = []
    for symbolic in (True, False):
        try:
            inferred = _infer(model, symbolic)
            shapes = _shape_map(inferred)
            total = OpCount()
            for node in inferred.graph.node:
                total = total + node_ops(node, shapes)
            return total, {out.name: shapes.get(out.name, []) for out in model.graph.output}
        except Exception as err:  # the inference tools raise bare Exceptions
            problems.append(f"{'symbolic' if symbolic else 'onnx'} inference: {err}")
    raise FlopCountError("; ".join(problems))
