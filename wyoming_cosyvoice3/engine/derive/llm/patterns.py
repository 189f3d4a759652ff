"""Graph patterns of a published Qwen2 LLM export, found by structure (no node names).

Used by :mod:`.weights`: a producer/consumer index with constant lookup, the
*linear* patterns (``MatMul`` with a constant 2-D weight; the onnxruntime ``quantize_dynamic``
int8 pattern ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(scale)``), the walk back
from a KV-cache output to its projection, RMSNorm weight and epsilon, the rotary tables
(evaluated from the graph's own subgraph), and the float-activation form of an int8 graph
used as the exact reference when a fused graph is validated.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..common.graph import GraphIndex, Linear, StructureError


class LlmStructureError(StructureError):
    """The graph is not a Qwen2-style LLM this module can read."""


def llm_index(model: onnx.ModelProto) -> GraphIndex:
    """The shared :class:`~..common.graph.GraphIndex` as the LLM reader uses it: constants are
    followed through ``Identity`` nodes (quantised exports alias shared weights that way)."""
    return GraphIndex(model, follow_identity=True)


def find_linears(ix: GraphIndex) -> list[Linear]:
    found: list[Linear] = []
    for i, node in enumerate(ix.nodes):
        if node.op_type == "MatMul":
            w = ix.const(node.input[1])
            if w is None or w.ndim != 2 or w.dtype != np.float32:
                continue
            found.append(
                Linear(
                    node.output[0],
                    weight=w,
                    x=node.input[0],
                    order=i,
                    raw_y=node.output[0],
                    pattern=(i,),
                    weight_name=node.input[1],
                )
            )
        elif node.op_type == "MatMulInteger":
            lin = _int8_linear(ix, i, node)
            if lin is not None:
                found.append(lin)
        elif node.op_type == "MatMulNBits":
            raise LlmStructureError("MatMulNBits (q4) source graphs are not supported")
    for lin in found:
        users = ix.users(lin.y)
        if len(users) == 1 and users[0].op_type == "Add":
            other = [t for t in users[0].input if t != lin.y]
            bias = ix.const(other[0]) if other else None
            if bias is not None and bias.shape == (lin.n,):
                lin.bias = bias.astype(np.float32)
                lin.y = users[0].output[0]
    return found


def _int8_linear(ix: GraphIndex, i: int, node: onnx.NodeProto) -> Linear | None:
    """``MatMulInteger(DQL(x).y, Wq, DQL(x).zp, Wzp) -> Cast -> Mul(Mul(DQL.scale, Ws))``."""
    dql = ix.node_of(node.input[0])
    wq = ix.const(node.input[1])
    wzp = ix.const(node.input[3]) if len(node.input) > 3 else None
    if dql is None or dql.op_type != "DynamicQuantizeLinear" or wq is None or wq.ndim != 2:
        return None
    if wq.dtype != np.int8:
        raise LlmStructureError(f"int8 weights expected, found {wq.dtype}")
    users = ix.users(node.output[0])
    if len(users) != 1 or users[0].op_type != "Cast":
        return None
    muls = ix.users(users[0].output[0])
    if len(muls) != 1 or muls[0].op_type != "Mul":
        return None
    scale_name = next(t for t in muls[0].input if t != users[0].output[0])
    scale_node = ix.node_of(scale_name)
    if scale_node is None or scale_node.op_type != "Mul":
        return None
    scales = [ix.const(t) for t in scale_node.input if t != dql.output[1]]
    if len(scales) != 1 or scales[0] is None:
        return None
    n = wq.shape[1]
    scale = np.broadcast_to(scales[0].astype(np.float32).reshape(-1), (n,)).copy()
    zp = np.zeros(n, np.int8) if wzp is None else np.broadcast_to(wzp.reshape(-1), (n,)).copy()
    pattern = (i, ix.position[users[0].output[0]], ix.position[muls[0].output[0]])
    return Linear(
        muls[0].output[0],
        x=dql.input[0],
        order=i,
        qweight=wq,
        scale=scale,
        zero_point=zp,
        raw_y=muls[0].output[0],
        pattern=pattern,
        weight_name=node.input[1],
    )


_DATA_FIRST = {"Reshape", "Slice", "Expand", "Unsqueeze", "Squeeze", "Gather", "Transpose", "Cast"}
"""Ops whose inputs after the first are indices or shapes, not data."""


def walk_back_to_linear(ix: GraphIndex, start: str, by_output: dict[str, Linear]) -> Linear:
    """The single linear reached walking producers back from ``start`` (bounded search)."""
    seen: set[str] = set()
    queue = deque([start])
    hits: list[Linear] = []
    while queue and len(seen) < 200:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        if name in by_output:
            hits.append(by_output[name])
            continue
        node = ix.node_of(name)
        if node is None or node.op_type in ("Shape", "Size", "ConstantOfShape"):
            continue  # shape computations carry no data
        data = node.input[:1] if node.op_type in _DATA_FIRST else node.input
        queue.extend(t for t in data if t and ix.const(t) is None)
    unique = {id(h): h for h in hits}
    if len(unique) != 1:
        raise LlmStructureError(f"expected one projection behind {start}, found {len(unique)}")
    return next(iter(unique.values()))


def rms_norm_params(ix: GraphIndex, normed: str, hidden: int) -> tuple[np.ndarray, float]:
    """(weight [H], eps) of the RMSNorm whose output is ``normed``."""
    node = ix.node_of(normed)
    while node is not None and node.op_type in ("Gather", "Slice", "Squeeze", "Reshape", "Cast"):
        node = ix.node_of(node.input[0])
    if node is None or node.op_type != "Mul":
        raise LlmStructureError(f"no RMSNorm weight Mul before {normed}")
    weight, other = None, None
    for t in node.input:
        value = ix.const(t)
        if value is not None and value.size == hidden:
            weight = value.reshape(hidden).astype(np.float32)
        else:
            other = t
    if weight is None or other is None:
        raise LlmStructureError(f"no RMSNorm weight [{hidden}] before {normed}")
    queue, seen = deque([other]), set[str]()
    while queue and len(seen) < 20:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        prod = ix.node_of(name)
        if prod is None:
            continue
        if prod.op_type == "Add":
            ins = [prod.input[0], prod.input[1]]
            values = [ix.const(t) for t in ins]
            feeds_mean = [ix.node_of(t) for t in ins]
            if any(n is not None and n.op_type == "ReduceMean" for n in feeds_mean):
                eps = [v for v in values if v is not None and v.size == 1]
                if eps:
                    return weight, float(eps[0].reshape(()))
        queue.extend(t for t in prod.input if t)
    raise LlmStructureError(f"no RMSNorm epsilon before {normed}")


def rope_tables(model: onnx.ModelProto, ix: GraphIndex, positions: int) -> tuple[np.ndarray, ...]:
    """cos, sin float32 [positions, head_dim / 2] computed by the graph's own rotary subgraph.

    The tensor evaluated is the output of the single ``Cos`` (``Sin``) node followed forward
    through elementwise ops with constant operands (attention scaling, casts, unsqueezes), which
    is what multiplies the queries and keys. The table must be ``cat(freqs, freqs)`` (the
    half-split layout of ``rotate_half``); its first half is returned.
    """
    import onnxruntime as ort

    tables = []
    for op in ("Cos", "Sin"):
        nodes = [n for n in ix.nodes if n.op_type == op]
        if len(nodes) != 1:
            raise LlmStructureError(
                f"expected one {op} node (shared rotary table), found {len(nodes)}"
            )
        name = nodes[0].output[0]
        for _ in range(6):
            users = ix.users(name)
            if len(users) != 1 or users[0].op_type not in ("Mul", "Cast", "Unsqueeze", "Identity"):
                break
            others = [t for t in users[0].input[1:] if t != name] + [
                t for t in users[0].input[:1] if t != name
            ]
            if users[0].op_type == "Mul" and any(ix.const(t) is None for t in others):
                break
            name = users[0].output[0]
        tables.append(name)
    try:
        sub = subgraph(model, ix, "position_ids", tables)
        session = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
        feed = {"position_ids": np.arange(positions, dtype=np.int64)[None, :]}
        cos, sin = session.run(None, feed)
    except Exception as exc:  # onnx / onnxruntime raise many types here
        raise LlmStructureError(f"rotary tables could not be evaluated alone: {exc}") from exc
    out = []
    for table in (cos, sin):
        flat = np.asarray(table, np.float32).reshape(positions, -1)
        half = flat.shape[1] // 2
        if not np.array_equal(flat[:, :half], flat[:, half:]):
            raise LlmStructureError("rotary table is not cat(freqs, freqs) (half-split layout)")
        out.append(np.ascontiguousarray(flat[:, :half]))
    return tuple(out)


def subgraph(
    model: onnx.ModelProto, ix: GraphIndex, source: str, targets: list[str]
) -> onnx.ModelProto:
    """A model computing ``targets`` from the graph input ``source`` alone.

    Raises:
        LlmStructureError: the targets depend on another graph input.
    """
    needed: set[int] = set()
    stack = list(targets)
    graph_inputs = {i.name for i in model.graph.input}
    while stack:
        name = stack.pop()
        if name in graph_inputs and name != source:
            raise LlmStructureError(f"the rotary table depends on {name}")
        i = ix.position.get(name)
        if i is None or i in needed:
            continue
        needed.add(i)
        stack.extend(t for t in ix.nodes[i].input if t)
    nodes = [ix.nodes[i] for i in sorted(needed)]
    used = {t for n in nodes for t in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]
    source_info = next(i for i in model.graph.input if i.name == source)
    outputs = [onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in targets]
    graph = onnx.helper.make_graph(nodes, "rotary", [source_info], outputs, inits)
    return onnx.helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )


def float_activation_reference(source: Path) -> onnx.ModelProto:
    """The published int8 graph with float activations: every ``DynamicQuantizeLinear ->
    MatMulInteger -> Cast -> Mul`` becomes ``MatMul(x, DequantizeLinear(Wq, scale, zp))``.

    Same weights, no activation quantisation: the exact reference for a fused graph built
    with the ``dequant`` kernel. Run it with graph optimisations disabled, so the weights stay
    int8 in memory and are dequantised per run. An fp32 source is returned unchanged.

    Raises:
        LlmStructureError: as :func:`read_llm_weights`.
    """
    model = onnx.load(str(source))
    ix = llm_index(model)
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    extra: list[onnx.TensorProto] = []
    for k, lin in enumerate(find_linears(ix)):
        if lin.qweight is None:
            continue
        assert lin.scale is not None and lin.zero_point is not None
        scale, zp, wf = f"_ref{k}_scale", f"_ref{k}_zp", f"_ref{k}_w"
        extra += [
            numpy_helper.from_array(lin.scale, scale),
            numpy_helper.from_array(lin.zero_point, zp),
        ]
        replace[lin.pattern[0]] = [
            onnx.helper.make_node("DequantizeLinear", [lin.weight_name, scale, zp], [wf], axis=1),
            onnx.helper.make_node("MatMul", [lin.x, wf], [lin.raw_y]),
        ]
        drop.update(lin.pattern[1:])
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(ix.nodes):
        if i in replace:
            nodes.extend(replace[i])
        elif i not in drop:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(extra)
    return model
