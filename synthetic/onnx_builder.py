"""A small helper around ``onnx.helper`` for writing the synthetic graphs.

Only the builder of synthetic model directories imports this module (it needs the optional
``onnx`` package, extra ``synthetic``); the engine itself never does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
"""Default-domain opset of every synthetic graph (upstream export_onnx.py uses 18 as well)."""
IR_VERSION = 9
"""ONNX IR version; 9 loads in every onnxruntime >= 1.16."""
MS_DOMAIN = "com.microsoft"

Dim = int | str
ELEM_TYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
}


class GraphBuilder:
    """Collects nodes, initializers and graph inputs/outputs, then emits a ModelProto.

    Names of intermediate values are generated (``<prefix>_<n>``) unless given explicitly,
    which keeps the output deterministic for the same sequence of calls.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counter = 0
        self._uses_ms_domain = False

    def _fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}_{self._counter}"

    def input(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        """Declare a graph input; ``shape`` mixes ints and symbolic dim names."""
        self.inputs.append(helper.make_tensor_value_info(name, ELEM_TYPES[dtype], list(shape)))
        return name

    def output(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        """Declare a graph output (some node must produce ``name``)."""
        self.outputs.append(helper.make_tensor_value_info(name, ELEM_TYPES[dtype], list(shape)))
        return name

    def const(self, value: np.ndarray | float | int | Sequence[int], name: str = "") -> str:
        """Add an initializer; Python ints become int64 and floats float32 arrays."""
        if isinstance(value, np.ndarray):
            array = value
        elif isinstance(value, float):
            array = np.asarray(value, dtype=np.float32)
        else:
            array = np.asarray(value, dtype=np.int64)
        tensor_name = name or self._fresh("const")
        self.initializers.append(numpy_helper.from_array(array, tensor_name))
        return tensor_name

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        out: str = "",
        domain: str = "",
        name: str = "",
        **attrs: Any,
    ) -> str:
        """Append one single-output node (named ``name`` if given); return its output name."""
        out_name = out or self._fresh(op_type.lower())
        self.nodes.append(
            helper.make_node(
                op_type,
                list(inputs),
                [out_name],
                name=name or self._fresh(f"n_{op_type}"),
                domain=domain or None,
                **attrs,
            )
        )
        if domain == MS_DOMAIN:
            self._uses_ms_domain = True
        return out_name

    # --- frequently used compositions -------------------------------------------------
    def matmul(
        self, x: str, weight: np.ndarray, bias: np.ndarray | None = None, name: str = ""
    ) -> str:
        """``x @ weight (+ bias)`` with the weight as an initializer (quantisable MatMul)."""
        y = self.op("MatMul", [x, self.const(weight.astype(np.float32))], name=name)
        if bias is not None:
            y = self.op("Add", [y, self.const(bias.astype(np.float32))])
        return y

    def conv1d(
        self, x: str, weight: np.ndarray, bias: np.ndarray | None, pads: tuple[int, int]
    ) -> str:
        """1-D convolution over [B, C_in, T] with asymmetric zero padding ``(left, right)``."""
        ins = [x, self.const(weight.astype(np.float32))]
        if bias is not None:
            ins.append(self.const(bias.astype(np.float32)))
        return self.op("Conv", ins, pads=list(pads), kernel_shape=[int(weight.shape[2])])

    def scale(self, x: str, factor: float) -> str:
        return self.op("Mul", [x, self.const(float(factor))])

    def shift(self, x: str, offset: float) -> str:
        return self.op("Add", [x, self.const(float(offset))])

    def dim(self, x: str, axis: int) -> str:
        """int64 [1] holding ``x.shape[axis]``."""
        return self.op("Shape", [x], start=axis, end=axis + 1)

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers
        )
        opsets = [helper.make_opsetid("", OPSET)]
        if self._uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="wyoming-cosyvoice3")
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        return model


def save_model(model: onnx.ModelProto, path: Path, external_data: bool = False) -> None:
    """Write ``model`` to ``path``; with ``external_data`` the weights go to ``<name>.data``.

    The external data layout matches the real export (``llm.onnx`` + ``llm.onnx.data``).
    ``model`` itself is left untouched (onnx converts the tensors of what it saves).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
        data_path = path.with_name(path.name + ".data")
        if data_path.exists():
            data_path.unlink()
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data_path.name,
            size_threshold=1024,
        )
        # onnx writes the data file with mode 0600; give it the .onnx file's mode (umask)
        data_path.chmod(path.stat().st_mode & 0o777)
    else:
        onnx.save_model(model, str(path))
