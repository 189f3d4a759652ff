"""Reading an ONNX graph by structure (no node names): the one index every derivation uses.

:class:`GraphIndex` gives producer/consumer maps and constant lookup; :class:`Linear` is one
projection ``y = x @ W (+ bias)`` found in a source graph (the DiT's and the LLM's readers,
:mod:`..flow.dit_structure` and :mod:`..llm.patterns`, both return it). The functions below
are bounded breadth-first searches along data edges (``Shape`` outputs are sizes, not data,
and are not followed) and the set of tensors that depend on one input only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

IDENTITY_HOPS = 4
"""Identity nodes followed back to a constant when the index is built with
``follow_identity`` (quantised LLM exports alias shared weights through Identity)."""


class StructureError(ValueError):
    """A graph lacks the structure a derivation reads (callers fall back to the source)."""


@dataclass
class Linear:
    """One projection ``y = x @ W (+ bias)`` of a source graph.

    Attributes:
        y: output tensor name in the source graph (after the bias ``Add`` when there is one).
        weight: float32 [K, N]; None for an int8 source (then ``qweight`` is set).
        bias: float32 [N] when an ``Add`` of a constant [N] follows, else None.
        x: input tensor name ("" when the reader does not need it).
        order: index of the ``MatMul``/``MatMulInteger`` node in the source graph (-1: unset).
        qweight: int8 [K, N] (int8 source), with ``scale`` float32 [N] and ``zero_point``
            int8 [N]: ``W = (qweight - zero_point) * scale`` per column.
        raw_y: the product before the bias ``Add``; pattern: indices of the nodes of an int8
            pattern (``MatMulInteger``, ``Cast``, ``Mul``); weight_name: the weight tensor.
    """

    y: str
    weight: np.ndarray | None = None
    bias: np.ndarray | None = None
    x: str = ""
    order: int = -1
    qweight: np.ndarray | None = None
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None
    raw_y: str = ""
    pattern: tuple[int, ...] = ()
    weight_name: str = ""

    @property
    def k(self) -> int:
        """Input width K."""
        return int(self._matrix().shape[0])

    @property
    def n(self) -> int:
        """Output width N."""
        return int(self._matrix().shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N)."""
        return self.k, self.n

    def _matrix(self) -> np.ndarray:
        matrix = self.weight if self.weight is not None else self.qweight
        if matrix is None:
            raise ValueError("a Linear without weights")
        return matrix

    def dequantized(self) -> np.ndarray:
        """float32 [K, N] weights."""
        if self.weight is not None:
            return self.weight
        if self.qweight is None or self.scale is None or self.zero_point is None:
            raise ValueError("an int8 Linear without its scale and zero point")
        centred = self.qweight.astype(np.float32) - self.zero_point.astype(np.float32)[None, :]
        return centred * self.scale[None, :]


class GraphIndex:
    """Producer/consumer maps and constant lookup over one onnx ModelProto.

    Attributes:
        model, g: the model and its graph; nodes: the graph's nodes in order.
        inits: initializer name -> TensorProto; inputs: graph input names.
        producer: tensor name -> the node writing it; consumers: tensor name -> nodes reading it.
        order: ``id(node)`` -> its index; position: tensor name -> index of its producer.

    Args:
        model: the onnx ModelProto (not changed).
        follow_identity: :meth:`const` follows up to :data:`IDENTITY_HOPS` ``Identity``
            nodes back to a constant (the LLM reader); the DiT and vocoder readers take an
            Identity output as data.
    """

    def __init__(self, model: Any, follow_identity: bool = False) -> None:
        from onnx import numpy_helper

        self.model = model
        self.g = model.graph
        self.nodes = list(self.g.node)
        self._np = numpy_helper
        self._follow_identity = follow_identity
        self.inits = {i.name: i for i in self.g.initializer}
        self.producer: dict[str, Any] = {}
        self.position: dict[str, int] = {}
        self.consumers: dict[str, list[Any]] = {}
        self.order = {id(n): i for i, n in enumerate(self.nodes)}
        for index, node in enumerate(self.nodes):
            for out in node.output:
                self.producer[out] = node
                self.position[out] = index
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.inputs = {i.name for i in self.g.input}

    def const(self, name: str) -> np.ndarray | None:
        """Value of an initializer or ``Constant`` output (through ``Identity`` when the index
        follows it), else None."""
        for _ in range(IDENTITY_HOPS if self._follow_identity else 1):
            value = self._own_const(name)
            if value is not None or not self._follow_identity:
                return value
            node = self.producer.get(name)
            if node is None or node.op_type != "Identity":
                return None
            name = node.input[0]
        return None

    def _own_const(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return np.asarray(self._np.to_array(self.inits[name]))
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return np.asarray(self._np.to_array(attr.t))
                if attr.name == "value_float":
                    return np.asarray(attr.f, dtype=np.float32)
                if attr.name == "value_floats":
                    return np.asarray(list(attr.floats), dtype=np.float32)
        return None

    def is_const(self, name: str) -> bool:
        """Whether ``name`` is an initializer or a ``Constant`` output."""
        if name in self.inits:
            return True
        node = self.producer.get(name)
        return node is not None and node.op_type == "Constant"

    def weight_dims(self, name: str) -> list[int] | None:
        """Dims of a constant, or None."""
        if name in self.inits:
            return list(self.inits[name].dims)
        value = self.const(name) if self.is_const(name) else None
        return None if value is None else list(value.shape)

    def attr(self, node: Any, name: str, default: Any = None) -> Any:
        """The value of ``node``'s attribute ``name``, else ``default``."""
        from onnx import helper

        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def node_of(self, name: str) -> Any | None:
        """The node writing ``name``, or None (a graph input or initializer)."""
        return self.producer.get(name)

    def users(self, name: str) -> list[Any]:
        """The nodes reading ``name``."""
        return list(self.consumers.get(name, []))


def time_dependent(gr: GraphIndex, source: str) -> set[str]:
    """Tensors computed from graph input ``source`` and constants only."""
    dep = {source}
    for node in gr.g.node:
        ins = [i for i in node.input if i]
        if (
            node.op_type != "Constant"
            and any(i in dep for i in ins)
            and all(i in dep or gr.is_const(i) for i in ins)
        ):
            dep.update(node.output)
    return dep


def forward_reach(gr: GraphIndex, start: str, stop: Any, limit: int = 400) -> Any:
    """First node (BFS from the consumers of ``start``) for which ``stop(node, input)`` is
    truthy; returns ``(node, input_name)`` or None."""
    seen = {start}
    queue = deque([start])
    while queue and limit > 0:
        name = queue.popleft()
        for node in gr.consumers.get(name, []):
            limit -= 1
            if stop(node, name):
                return node, name
            if node.op_type == "Shape":  # sizes only: not a data path
                continue
            for out in node.output:
                if out not in seen:
                    seen.add(out)
                    queue.append(out)
    return None


def source_input(gr: GraphIndex, name: str, wanted: set[str], limit: int = 40) -> str | None:
    """The graph input among ``wanted`` that ``name`` is computed from (BFS backwards)."""
    seen = {name}
    queue = deque([name])
    while queue and limit > 0:
        cur = queue.popleft()
        limit -= 1
        if cur in wanted:
            return cur
        node = gr.producer.get(cur)
        if node is None:
            continue
        for i in node.input:
            if i and i not in seen and not gr.is_const(i):
                seen.add(i)
                queue.append(i)
    return None


def is_dynamic_matmul(gr: GraphIndex, node: Any) -> bool:
    return node.op_type == "MatMul" and not any(gr.is_const(i) for i in node.input)


def source_reaches(gr: GraphIndex, name: str, target: str, limit: int = 200) -> bool:
    """True when tensor ``name`` is computed from ``target`` (bounded BFS backwards)."""
    seen = {name}
    queue = deque([name])
    while queue and limit > 0:
        cur = queue.popleft()
        limit -= 1
        if cur == target:
            return True
        node = gr.producer.get(cur)
        if node is None or node.op_type in ("MatMul", "Gemm", "LayerNormalization", "Shape"):
            continue
        for i in node.input:
            if i and i not in seen:
                seen.add(i)
                queue.append(i)
    return False


def source_has_op(gr: GraphIndex, name: str, op: str, limit: int = 12) -> bool:
    seen = {name}
    queue = deque([name])
    while queue and limit > 0:
        cur = queue.popleft()
        limit -= 1
        node = gr.producer.get(cur)
        if node is None:
            continue
        if node.op_type == op:
            return True
        for i in node.input:
            if i and i not in seen:
                seen.add(i)
                queue.append(i)
    return False
