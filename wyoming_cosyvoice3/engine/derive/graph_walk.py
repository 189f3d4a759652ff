"""Graph-walking helpers for reading an ONNX graph by structure (no node names).

Producer/consumer maps, constants (initializers and Constant nodes), the set of tensors that
depend on one input only, and bounded breadth-first searches along data edges (``Shape``
outputs are sizes, not data, and are not followed). Used by :mod:`.dit_structure`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class GraphIndex:
    """Producer/consumer maps and constant lookup over an onnx GraphProto."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        self.g = model.graph
        self._np = numpy_helper
        self.inits = {i.name: i for i in self.g.initializer}
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = {}
        self.order = {id(n): i for i, n in enumerate(self.g.node)}
        for node in self.g.node:
            for out in node.output:
                self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.inputs = {i.name for i in self.g.input}

    def const(self, name: str) -> np.ndarray | None:
        """Value of an initializer or Constant output, else None."""
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
        if name in self.inits:
            return True
        node = self.producer.get(name)
        return node is not None and node.op_type == "Constant"

    def weight_dims(self, name: str) -> list[int] | None:
        if name in self.inits:
            return list(self.inits[name].dims)
        value = self.const(name) if self.is_const(name) else None
        return None if value is None else list(value.shape)

    def attr(self, node: Any, name: str, default: Any = None) -> Any:
        from onnx import helper

        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default


def time_dependent(gr: GraphIndex, source: str) -> set[str]:
    """Tensors computed from graph input ``source`` and constants only (cf. estimator_split)."""
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
