"""The generator of ``hift.onnx`` rewritten to do less work for the same numbers (up to float
rounding), before the streamed form is derived from it (:mod:`.hift_stream`).

Why: the streamed vocoder's time is mostly its convolutions and the elementwise passes of the
Snake activations between them (BENCHMARKS.md "The streamed vocoder"). Two rewrites, each
exact in real arithmetic and found by structure:

* **Upsampling at the low rate.** Upstream's ``CausalConv1dUpsample`` (CosyVoice ace7c47,
  ``cosyvoice/transformer/convolution.py``) repeats every frame r times (nearest) and runs a
  causal convolution of k taps over the result (``Unsqueeze``, ``Tile``, ``Reshape``, ``Conv``
  with pads ``[k - 1, 0]`` in the export). Output phase p of low-rate frame n reads only
  ``ceil((k - 1) / r) + 1`` distinct input frames, so the same output is one convolution over
  the low-rate input with r x Cout output channels and that many taps (each tap the sum of the
  original taps that read the same frame), its outputs interleaved. Zeros padded before the
  repeated signal are zeros padded before the input: the left edge is the same. The products
  fall from k to ``ceil((k - 1) / r) + 1`` per output (16 to 3, 11 to 3, 7 to 3 upstream),
  and the r times longer repeated tensor is never written.
* **Snake without its scalings.** ``Snake(x) = x + sin(a x)^2 / (a + 1e-9)`` (upstream
  ``cosyvoice/transformer/activation.py``), per channel a. Where ``a + 1e-9`` rounds to a in
  float32, ``Snake(x) = (a x + sin(a x)^2) / a``: the ``1 / a`` goes into the weights of the
  convolutions that read the activation (per input channel), and where x is a convolution's
  output read by nothing else, ``a x`` comes from that convolution with its weights and bias
  scaled by a (per output channel). Two to three of the five elementwise passes per Snake are
  left (the sine, its square, the sum, and ``a x`` where x is the residual stream).

Both are found in the two export forms seen: weight norm folded into constant weights, the
repetition as ``Unsqueeze``/``Tile``/``Reshape`` and the Snake as ``Mul(s, s)`` and ``Div``
(the synthetic models); or weight norm computed in the graph, the repetition as a nearest
``Resize`` and a zero ``Pad``, the Snake as ``Pow(s, 2)`` times ``1 / (a + eps)`` (a
``torch.onnx`` export of upstream's classes, the parity model). Tensors computed from
constants only are first replaced by their values (what onnxruntime folds them to at load).
Nodes upstream of the source's ``CumSum`` (the phase path, :mod:`.hift_exact`) are left as
they are. The derived graph is validated against one call of the unchanged ``hift.onnx`` (its
exact rewrite) when it is made (:func:`.hift_stream.validate`), so a rounding these rewrites
add is checked against the same bound as the streaming itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..common.graph import GraphIndex


def phase_path(gr: GraphIndex) -> set[str]:
    """Output names of the nodes upstream of a ``CumSum`` (its data input's producers)."""
    seen: set[str] = set()
    stack = [node.input[0] for node in gr.nodes if node.op_type == "CumSum"]
    nodes: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = gr.producer.get(name)
        if node is None:
            continue
        nodes.add(node.output[0])
        stack.extend(i for i in node.input if i)
    return nodes


@dataclass(frozen=True)
class LeanCounts:
    """What :func:`lean_generator` changed: upsampling convolutions run at the low rate,
    Snakes without their division, of those also without the multiplication."""

    upsamplings: int
    snakes: int
    snakes_from_conv: int


def lean_generator(model: Any) -> LeanCounts:
    """Apply both rewrites (module doc) to ``model`` (onnx.ModelProto, changed in place)."""
    _materialise_constants(model)
    ups = _low_rate_upsampling(model)
    snakes, from_conv = _fold_snakes(model)
    return LeanCounts(ups, snakes, from_conv)


CONST_READERS = {"Conv": (1, 2), "Mul": (0, 1), "Div": (1,), "Pad": (1, 2), "Pow": (1,)}
"""Inputs read as constants by the patterns below (which of each op's inputs)."""


def _materialise_constants(model: Any) -> int:
    """Tensors the patterns read as constants but the graph computes from constants only
    (an export's weight norm, ``1 / (a + eps)``, a Pad's widths) become initializers of the
    values one run computes (with the kernels the graph's session would fold them with).
    Nothing upstream of the source's ``CumSum`` is touched. Returns how many."""
    from onnx import numpy_helper

    from ..common.files import validation_session

    gr = GraphIndex(model)
    on_phase = phase_path(gr)
    inputs = gr.inputs - set(gr.inits)
    free: dict[str, bool] = {}

    def input_free(name: str) -> bool:
        """Whether ``name`` depends on no graph input (iterative: graphs are deep)."""
        stack = [name]
        while stack:
            top = stack[-1]
            if top in free:
                stack.pop()
                continue
            if top in inputs:
                free[top] = False
                stack.pop()
                continue
            node = gr.producer.get(top)
            if node is None:
                free[top] = True
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in free]
            if pending:
                stack.extend(pending)
                continue
            free[top] = all(free[i] for i in node.input if i)
            stack.pop()
        return free[name]

    wanted: list[str] = []
    for node in gr.nodes:
        if node.output[0] in on_phase:
            continue
        for k in CONST_READERS.get(node.op_type, ()):
            if k < len(node.input) and node.input[k]:
                name = node.input[k]
                producer = gr.producer.get(name)
                if (producer is not None and producer.op_type != "Constant"
                        and len(producer.output) == 1 and producer.output[0] not in on_phase
                        and input_free(name)):
                    wanted.append(name)
    wanted = list(dict.fromkeys(wanted))
    if not wanted:
        return 0
    import onnx
    from onnx import helper

    # the nodes these values need (none reads a graph input), run on their own
    needed: set[int] = set()
    stack = list(wanted)
    while stack:
        node = gr.producer.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(i for i in node.input if i)
    nodes = [n for n in gr.nodes if id(n) in needed]
    read = {i for n in nodes for i in n.input}
    probe = helper.make_model(
        helper.make_graph(nodes, "constants", [], [onnx.ValueInfoProto(name=n) for n in wanted],
                          initializer=[i for i in model.graph.initializer if i.name in read]),
        opset_imports=model.opset_import, ir_version=model.ir_version)
    values = validation_session(probe, optimize=False).run(wanted, {})
    drop = {id(gr.producer[n]) for n in wanted}
    kept = [n for n in gr.nodes if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.graph.initializer.extend(
        numpy_helper.from_array(np.asarray(v), n) for n, v in zip(wanted, values, strict=True))
    _drop_dead_nodes(model)
    return len(wanted)


def _const(gr: GraphIndex, name: str) -> np.ndarray | None:
    """A constant, also through ``Unsqueeze`` of a constant by constant axes."""
    value = gr.const(name)
    if value is not None:
        return value
    node = gr.producer.get(name)
    if node is not None and node.op_type == "Unsqueeze" and len(node.input) == 2:
        x, axes = gr.const(node.input[0]), gr.const(node.input[1])
        if x is not None and axes is not None:
            return np.expand_dims(x, tuple(int(a) for a in np.asarray(axes).reshape(-1)))
    return None


def _only_users(gr: GraphIndex, name: str, nodes: list[Any]) -> bool:
    """Whether ``nodes`` are exactly the readers of ``name`` (not a graph output)."""
    if name in {o.name for o in gr.g.output}:
        return False
    users = gr.consumers.get(name, [])
    return len(users) == len(nodes) and all(any(u is n for n in nodes) for u in users)


def _weight_users(gr: GraphIndex, name: str) -> int:
    return len(gr.consumers.get(name, []))


def _conv_attrs_plain(gr: GraphIndex, node: Any) -> bool:
    """A 1-d Conv, group 1, stride 1, dilation 1."""
    return (
        list(gr.attr(node, "strides", [1])) == [1]
        and list(gr.attr(node, "dilations", [1])) == [1]
        and int(gr.attr(node, "group", 1)) == 1
        and gr.attr(node, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    )


def _low_rate_upsampling(model: Any) -> int:
    """Upsampling by repetition + causal Conv -> a Conv at the low rate, interleaved."""
    from onnx import helper, numpy_helper

    gr = GraphIndex(model)
    g = model.graph
    on_phase = phase_path(gr)
    replaced: dict[int, list[Any]] = {}  # node index -> nodes instead of it
    dropped: set[int] = set()
    count = 0
    for conv in gr.nodes:
        if conv.op_type != "Conv" or conv.output[0] in on_phase or len(conv.input) < 2:
            continue
        weight = gr.const(conv.input[1])
        bias = gr.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
        if weight is None or weight.ndim != 3 or not _conv_attrs_plain(gr, conv):
            continue
        cout, cin, k = weight.shape
        found = _repeated(gr, conv, k)
        if found is None or _weight_users(gr, conv.input[1]) != 1:
            continue
        x, r, chain = found
        taps = -((-(k - 1)) // r) + 1  # ceil((k - 1) / r) + 1
        low = np.zeros((r, cout, cin, taps), np.float64)
        for p in range(r):
            for j in range(k):
                offset = (p - (k - 1) + j) // r  # in [-(taps - 1), 0]
                low[p, :, :, offset + taps - 1] += weight[:, :, j]
        low32 = low.reshape(r * cout, cin, taps).astype(np.float32)
        stem = conv.output[0] + "/lowrate"
        w_name, b_name = stem + "/weight", stem + "/bias"
        g.initializer.append(numpy_helper.from_array(low32, w_name))
        inputs = [x, w_name]
        if bias is not None:
            g.initializer.append(numpy_helper.from_array(
                np.tile(np.asarray(bias, np.float32), r), b_name))
            inputs.append(b_name)
        names = {s: f"{stem}/{s}" for s in ("y", "shape", "t", "tr", "rate", "split",
                                            "outshape", "phased", "moved", "one")}

        def c(name: str, values: list[int]) -> Any:
            return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
                np.asarray(values, np.int64), name))

        # [1, r Cout, T] -> [1, r, Cout, T] -> [1, Cout, T, r] -> [1, Cout, r T]: phase p of
        # frame n is output frame r n + p
        nodes = [
            helper.make_node("Conv", inputs, [names["y"]], kernel_shape=[taps],
                             pads=[taps - 1, 0], strides=[1], dilations=[1], group=1),
            helper.make_node("Shape", [names["y"]], [names["t"]], start=2, end=3),
            c(names["split"], [1, r, cout]),
            helper.make_node("Concat", [names["split"], names["t"]], [names["shape"]], axis=0),
            helper.make_node("Reshape", [names["y"], names["shape"]], [names["phased"]]),
            helper.make_node("Transpose", [names["phased"]], [names["moved"]],
                             perm=[0, 2, 3, 1]),
            c(names["rate"], [r]),
            helper.make_node("Mul", [names["t"], names["rate"]], [names["tr"]]),
            c(names["one"], [1, cout]),
            helper.make_node("Concat", [names["one"], names["tr"]], [names["outshape"]], axis=0),
            helper.make_node("Reshape", [names["moved"], names["outshape"]], [conv.output[0]]),
        ]
        replaced[gr.order[id(conv)]] = nodes
        dropped.update(gr.order[id(n)] for n in chain)
        count += 1
    if count:
        ordered: list[Any] = []
        for index, node in enumerate(gr.nodes):
            if index in dropped:
                continue
            ordered.extend(replaced.get(index, [node]))
        del g.node[:]
        g.node.extend(ordered)
        _drop_unused_initializers(model)
    return count


def _repeated(gr: GraphIndex, conv: Any, k: int) -> tuple[str, int, list[Any]] | None:
    """``(x, r, nodes)`` when ``conv`` (k taps) reads x repeated r times (nearest) with k - 1
    zeros before it, by ``nodes`` that nothing else reads; else None. Two exported forms:
    ``Unsqueeze``, ``Tile``, ``Reshape`` and the Conv's own pads ``[k - 1, 0]``; or a nearest
    ``Resize`` (asymmetric, floor) by ``[1, 1, r]`` and a zero ``Pad`` of ``k - 1`` frames on
    the left of the time axis."""
    pads = list(gr.attr(conv, "pads", [0, 0]))
    last = gr.producer.get(conv.input[0])
    if last is None:
        return None
    if last.op_type == "Reshape" and pads == [k - 1, 0]:
        tile = gr.producer.get(last.input[0])
        if tile is None or tile.op_type != "Tile":
            return None
        unsq = gr.producer.get(tile.input[0])
        if unsq is None or unsq.op_type != "Unsqueeze" or len(unsq.input) != 2:
            return None
        axes, reps, shape = (gr.const(n) for n in (unsq.input[1], tile.input[1], last.input[1]))
        if axes is None or reps is None or shape is None:
            return None
        reps, shape = np.asarray(reps).reshape(-1), np.asarray(shape).reshape(-1)
        if (np.asarray(axes).reshape(-1).tolist() not in ([3], [-1]) or len(reps) != 4
                or reps[:3].tolist() != [1, 1, 1] or shape.tolist() != [0, 0, -1]):
            return None
        chain = [unsq, tile, last]
        x, r = unsq.input[0], int(reps[3])
    elif last.op_type == "Pad" and pads == [0, 0]:
        resize = gr.producer.get(last.input[0])
        widths = gr.const(last.input[1]) if len(last.input) > 1 else None
        value = gr.const(last.input[2]) if len(last.input) > 2 and last.input[2] else None
        if (resize is None or resize.op_type != "Resize" or widths is None
                or gr.attr(last, "mode", b"constant") not in (b"constant", "constant")
                or (value is not None and np.any(value != 0)) or len(last.input) > 3):
            return None
        if np.asarray(widths).reshape(-1).tolist() != [0, 0, k - 1, 0, 0, 0]:
            return None
        text = {a: gr.attr(resize, a, b"") for a in ("mode", "coordinate_transformation_mode",
                                                     "nearest_mode")}
        text = {a: v.decode() if isinstance(v, bytes) else str(v) for a, v in text.items()}
        if text != {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                    "nearest_mode": "floor"} or len(resize.input) != 3:
            return None
        scales = gr.const(resize.input[2]) if resize.input[2] else None
        if scales is None or resize.input[1]:
            return None
        scales = np.asarray(scales).reshape(-1)
        if (len(scales) != 3 or scales[:2].tolist() != [1, 1] or scales[2] != round(scales[2])):
            return None
        chain = [resize, last]
        x, r = resize.input[0], int(scales[2])
    else:
        return None
    if r < 2:
        return None
    for node, reader in zip(chain, [*chain[1:], conv], strict=True):
        if not _only_users(gr, node.output[0], [reader]):
            return None
    return x, r, chain


def _fold_snakes(model: Any) -> tuple[int, int]:
    """Snake without its division (and multiplication where a Conv makes x); module doc."""
    from onnx import numpy_helper

    gr = GraphIndex(model)
    on_phase = phase_path(gr)
    inits = {i.name: i for i in model.graph.initializer}
    new_weights: dict[str, np.ndarray] = {}
    drop: set[int] = set()
    folded = from_conv = 0

    def weight(name: str) -> np.ndarray:
        if name not in new_weights:
            new_weights[name] = np.asarray(numpy_helper.to_array(inits[name]), np.float32).copy()
        return new_weights[name]

    # weights already scaled per input / per output channel (each at most once per axis)
    touched_in: set[str] = set()
    touched_out: set[str] = set()
    for sin in gr.nodes:
        if sin.op_type != "Sin" or sin.output[0] in on_phase:
            continue
        mul = gr.producer.get(sin.input[0])
        if mul is None or mul.op_type != "Mul":
            continue
        x_k = next((k for k in (0, 1) if _const(gr, mul.input[1 - k]) is not None), None)
        if x_k is None:
            continue
        x, alpha = mul.input[x_k], _const(gr, mul.input[1 - x_k])
        if alpha is None:
            continue
        a = np.asarray(alpha, np.float32)
        if a.ndim != 3 or a.shape[0] != 1 or a.shape[2] != 1:
            continue
        a = a.reshape(-1)
        if not np.all(np.isfinite(a)) or np.any(a == 0):
            continue
        found = _snake_tail(gr, sin, x, a)
        if found is None:
            continue
        square, div, add = found
        # a Shape of the activation reads its size only, which the scaling keeps
        readers = [_conv_through_zero_pad(gr, r, add.output[0])
                   for r in gr.consumers.get(add.output[0], []) if r.op_type != "Shape"]
        if (not readers or add.output[0] in {o.name for o in gr.g.output}
                or any(r is None or r.op_type != "Conv"
                       or r.input[1] not in inits or _weight_users(gr, r.input[1]) != 1
                       or r.input[1] in touched_in or int(gr.attr(r, "group", 1)) != 1
                       for r in readers)):
            continue
        for reader in readers:
            assert reader is not None
            w = weight(reader.input[1])
            if w.ndim != 3 or w.shape[1] != a.size:
                break
        else:
            producer = gr.producer.get(x)
            fold_in = (
                producer is not None and producer.op_type == "Conv"
                and producer.output[0] not in on_phase
                and _only_users(gr, x, [mul, add])
                and producer.input[1] in inits and _weight_users(gr, producer.input[1]) == 1
                and producer.input[1] not in touched_out
                and int(gr.attr(producer, "group", 1)) == 1
                and (len(producer.input) < 3 or not producer.input[2]
                     or (producer.input[2] in inits
                         and _weight_users(gr, producer.input[2]) == 1))
                and weight(producer.input[1]).shape[0] == a.size
            )
            for reader in readers:
                assert reader is not None
                new_weights[reader.input[1]] = weight(reader.input[1]) / a[None, :, None]
                touched_in.add(reader.input[1])
            if fold_in:
                assert producer is not None
                new_weights[producer.input[1]] = weight(producer.input[1]) * a[:, None, None]
                touched_out.add(producer.input[1])
                if len(producer.input) > 2 and producer.input[2]:
                    new_weights[producer.input[2]] = weight(producer.input[2]) * a
                    touched_out.add(producer.input[2])
                sin.input[0] = x  # the Conv now writes a x
                add.input[:] = [x, square.output[0]]
                drop.update(gr.order[id(n)] for n in (mul, div))
                from_conv += 1
            else:
                add.input[:] = [mul.output[0], square.output[0]]
                drop.add(gr.order[id(div)])
            folded += 1
    for name, value in new_weights.items():
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
    if drop:
        kept = [n for i, n in enumerate(gr.nodes) if i not in drop]
        del model.graph.node[:]
        model.graph.node.extend(kept)
        _drop_dead_nodes(model)
    return folded, from_conv


def _conv_through_zero_pad(gr: GraphIndex, node: Any, y: str) -> Any | None:
    """The Conv reading ``y`` as its data: ``node`` itself, or the only reader of ``node``
    when ``node`` only pads y with zeros (a constant ``Pad``, or a ``Concat`` with blocks of
    ``ConstantOfShape`` zeros: zeros scale to zeros); else None."""
    if node.op_type == "Conv":
        return node if node.input[0] == y and list(node.input).count(y) == 1 else None
    if node.op_type == "Pad":
        mode = gr.attr(node, "mode", b"constant")
        value = gr.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        widths = gr.const(node.input[1]) if len(node.input) > 1 else None
        if node.input[0] != y or mode not in (b"constant", "constant") or (
                value is not None and np.any(value != 0)) or widths is None:
            return None
        widths = np.asarray(widths).reshape(2, -1)  # only the time axis (last) may be padded
        if widths.shape[1] != 3 or np.any(widths[:, :2]):
            return None
    elif node.op_type == "Concat":
        if int(gr.attr(node, "axis", 0)) not in (2, -1):
            return None
        for other in node.input:
            if other == y:
                continue
            block = gr.producer.get(other)
            while block is not None and block.op_type == "Cast":
                block = gr.producer.get(block.input[0])
            fill = gr.attr(block, "value") if block is not None else None
            if (block is None or block.op_type != "ConstantOfShape" or (
                    fill is not None and np.any(np.asarray(gr._np.to_array(fill)) != 0))):
                return None
        if list(node.input).count(y) != 1:
            return None
    else:
        return None
    readers = gr.consumers.get(node.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Conv" or readers[0].input[0] != node.output[0]:
        return None
    return readers[0]


def _snake_tail(gr: GraphIndex, sin: Any, x: str, a: np.ndarray) -> tuple[Any, Any, Any] | None:
    """``(square, scale, add)`` of ``x + sin(a x)^2 / (a + eps)`` after ``sin``, where the
    scale is exactly what dividing by a gives in float32; else None. Exported forms:
    ``Mul(s, s)`` or ``Pow(s, 2)``; ``Div(square, a + eps)`` or ``Mul(1 / (a + eps), square)``
    (constants)."""
    # a square that reads the sine twice is listed twice among its readers
    readers = list({id(n): n for n in gr.consumers.get(sin.output[0], [])}.values())
    if len(readers) != 1:
        return None
    square = readers[0]
    exponent = gr.const(square.input[1]) if square.op_type == "Pow" else None
    if not ((square.op_type == "Mul" and list(square.input) == [sin.output[0]] * 2)
            or (square.op_type == "Pow" and square.input[0] == sin.output[0]
                and exponent is not None and exponent.size == 1 and float(exponent) == 2.0)):
        return None
    scale = gr.consumers.get(square.output[0], [])
    if len(scale) != 1:
        return None
    scale = scale[0]
    other = [i for i in scale.input if i != square.output[0]]
    value = _const(gr, other[0]) if len(other) == 1 else None
    if value is None or np.asarray(value).size != a.size:
        return None
    value = np.asarray(value, np.float32).reshape(-1)
    if scale.op_type == "Div" and scale.input[0] == square.output[0]:
        exact = np.array_equal(value, a)  # a + eps rounds to a
    elif scale.op_type == "Mul":
        exact = np.array_equal(value, np.float32(1) / a)  # 1 / (a + eps) rounds to 1 / a
    else:
        return None
    add = gr.consumers.get(scale.output[0], [])
    if (not exact or len(add) != 1 or add[0].op_type != "Add"
            or set(add[0].input) != {x, scale.output[0]}):
        return None
    return square, scale, add[0]


def _drop_dead_nodes(model: Any) -> None:
    """Remove nodes none of whose outputs is read (the Snakes' ``a + eps`` and ``Unsqueeze``)."""
    g = model.graph
    while True:
        read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        kept = [n for n in g.node if any(o in read for o in n.output)]
        if len(kept) == len(g.node):
            break
        del g.node[:]
        g.node.extend(kept)
    _drop_unused_initializers(model)


def _drop_unused_initializers(model: Any) -> None:
    g = model.graph
    read = {i for n in g.node for i in n.input}
    kept = [i for i in g.initializer if i.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)
