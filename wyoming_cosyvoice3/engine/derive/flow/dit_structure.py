"""Read the DiT estimator's weights from its ONNX graph by structure (no node names).

The published ``flow.decoder.estimator.fp32.onnx`` is upstream's ``DiT``
(FunAudioLLM/CosyVoice ``cosyvoice/flow/DiT/dit.py``, ``DiT/modules.py``) traced by
``cosyvoice/bin/export_onnx.py`` with ``streaming=False``. Its parts, as found here:

* ``InputEmbedding``: one linear layer on ``concat(x, cond, mu, spks)`` (the order is read
  from the graph by tracing the concat's inputs back to the graph inputs), then
  ``CausalConvPositionEmbedding``: two grouped Conv1d (kernel 31, 16 groups, left padding 30)
  each followed by Mish, added to the projection.
* ``depth`` ``DiTBlock``: AdaLayerNormZero (a linear layer on SiLU(time embedding) giving
  shift/scale/gate for attention and feed-forward, ``torch.chunk(6)`` order), attention
  (q, k, v, out linear layers, rotary embedding on the first ``head_dim`` channels of q and k
  as x-transformers ``apply_rotary_pos_emb`` does before the heads are split), FeedForward
  (two linear layers, tanh-GELU).
* ``AdaLayerNormZero_Final`` (scale, shift: ``torch.chunk(2)`` order) and ``proj_out``.

How each part is recognised: a *linear layer* is a MatMul (or Gemm) with a constant 2-D
weight, with the bias Add that follows it. Linear layers whose input depends on ``t`` alone are
the time path; of those, outputs ``6 x dim`` wide are the blocks' modulation and the one
``2 x dim`` wide the final modulation. The per-frame linear layers come in graph order
``proj_in, (q, k, v, out, ff1, ff2) x depth, proj_out``; q, k and v share their input and are
told apart by where their outputs enter the attention products. The rotary frequencies are the
1-D constant multiplied with the ``Range`` of positions. Anything that does not fit raises
:class:`StructureError` (callers fall back to the unmodified estimator); the derived graph is
validated against the original anyway (:mod:`.streaming_estimator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..common.graph import (
    GraphIndex,
    Linear,
    StructureError,
    forward_reach,
    is_dynamic_matmul,
    source_has_op,
    source_input,
    source_reaches,
    time_dependent,
)

FloatArray = np.ndarray

FRAME_INPUTS = ("x", "cond", "mu")
"""Per-frame estimator inputs [B, 80, F] (export_onnx.py input names)."""
SPEAKER_INPUT = "spks"
TIME_INPUT = "t"
MOD_CHUNKS = 6
"""AdaLayerNormZero chunks: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp."""
FINAL_MOD_CHUNKS = 2
"""AdaLayerNormZero_Final chunks: scale, shift (modules.py, in that order)."""


@dataclass
class Block:
    """One DiTBlock's weights."""

    mod: Linear
    q: Linear
    k: Linear
    v: Linear
    out: Linear
    ff1: Linear
    ff2: Linear


@dataclass
class DitWeights:
    """Everything the streaming estimator is built from.

    Attributes:
        dim: model width D; heads, head_dim: attention heads and their width.
        proj_in: input projection [sum(widths), D]; input_order: graph input names in the
            order of the projection's input columns; input_widths: their widths.
        conv: [(weight [D, D / groups, K], bias [D])] for the two position convolutions.
        conv_groups: groups of those convolutions; kernel = K (left context K - 1 each).
        blocks: the DiT blocks; final_mod: the final modulation [D, 2D]; proj_out: [D, 80].
        inv_freq: rotary inverse frequencies float32 [head_dim / 2]; freq_div: divisor
            applied to ``position * inv_freq`` (x-transformers ``interpolation_factor``).
        layout_hint: "interleaved" (x-transformers pairs (2i, 2i + 1)) or "half" (halves).
        eps: LayerNorm epsilons: per block (attention norm, ff norm), then the final one.
        mod_outputs: source-graph tensor names of the block modulations, then the final one.
    """

    dim: int
    heads: int
    head_dim: int
    proj_in: Linear
    input_order: list[str]
    input_widths: list[int]
    conv: list[tuple[FloatArray, FloatArray]]
    conv_groups: int
    kernel: int
    blocks: list[Block]
    final_mod: Linear
    proj_out: Linear
    inv_freq: FloatArray
    freq_div: float
    layout_hint: str
    eps: list[float] = field(default_factory=list)
    mod_outputs: list[str] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


def _linear_at(gr: GraphIndex, node: Any) -> Linear | None:
    """The linear layer of a MatMul/Gemm node with a constant 2-D weight, else None."""
    if node.op_type == "MatMul" and len(node.input) == 2:
        dims = gr.weight_dims(node.input[1])
        if dims is None or len(dims) != 2 or gr.is_const(node.input[0]):
            return None
        weight = np.asarray(gr.const(node.input[1]), dtype=np.float32)
        out = node.output[0]
        bias = None
        users = gr.consumers.get(out, [])
        if len(users) == 1 and users[0].op_type == "Add":
            other = [i for i in users[0].input if i != out]
            if len(other) == 1 and gr.is_const(other[0]):
                value = gr.const(other[0])
                if value is not None and value.reshape(-1).shape[0] == weight.shape[1]:
                    bias = np.asarray(value, dtype=np.float32).reshape(-1)
                    out = users[0].output[0]
        return Linear(out, weight, bias)
    if node.op_type == "Gemm" and len(node.input) >= 2:
        dims = gr.weight_dims(node.input[1])
        if dims is None or len(dims) != 2 or gr.attr(node, "transA", 0):
            return None
        if float(gr.attr(node, "alpha", 1.0)) != 1.0 or float(gr.attr(node, "beta", 1.0)) != 1.0:
            return None
        weight = np.asarray(gr.const(node.input[1]), dtype=np.float32)
        if gr.attr(node, "transB", 0):
            weight = weight.T
        bias = None
        if len(node.input) > 2 and node.input[2]:
            value = gr.const(node.input[2])
            if value is None:
                return None
            bias = np.asarray(value, dtype=np.float32).reshape(-1)
        return Linear(node.output[0], np.ascontiguousarray(weight), bias)
    return None


def _qkv_roles(gr: GraphIndex, lins: list[Linear]) -> tuple[Linear, Linear, Linear]:
    """Order three linear layers sharing an input as (q, k, v) by where they enter the
    attention products: q -> scores input 0, k -> scores input 1, v -> output input 1."""
    roles: dict[str, Linear] = {}
    for lin in lins:
        hit = forward_reach(gr, lin.y, lambda n, _i: is_dynamic_matmul(gr, n))
        if hit is None:
            raise StructureError("an attention projection reaches no attention product")
        node, via = hit
        # which input slot of the product does this path feed?
        slot0 = source_reaches(gr, node.input[0], lin.y)
        slot1 = source_reaches(gr, node.input[1], lin.y)
        from_softmax = source_has_op(gr, node.input[0], "Softmax")
        if from_softmax and slot1:
            roles["v"] = lin
        elif slot0 and not slot1:
            roles["q"] = lin
        elif slot1 and not slot0:
            roles["k"] = lin
        del via
    if set(roles) != {"q", "k", "v"}:
        raise StructureError(f"cannot tell q, k and v apart (found {sorted(roles)})")
    return roles["q"], roles["k"], roles["v"]


def _rotary(gr: GraphIndex) -> tuple[FloatArray, float, str]:
    """(inv_freq, divisor, layout hint) of the rotary embedding."""
    ranges = [n for n in gr.g.node if n.op_type == "Range"]
    if len(ranges) != 1:
        raise StructureError(f"expected one Range (rotary positions), found {len(ranges)}")

    def freq_node(node: Any, _via: str) -> bool:
        if node.op_type not in ("Einsum", "Mul", "MatMul"):
            return False
        vals = [gr.const(i) for i in node.input if gr.is_const(i)]
        return any(v is not None and v.ndim == 1 and v.size > 1 for v in vals)

    hit = forward_reach(gr, ranges[0].output[0], freq_node, limit=40)
    if hit is None:
        raise StructureError("no rotary frequency product after the position Range")
    node = hit[0]
    inv = next(
        v for v in (gr.const(i) for i in node.input if gr.is_const(i))
        if v is not None and v.ndim == 1 and v.size > 1
    )
    out = node.output[0]
    div = 1.0
    users = gr.consumers.get(out, [])
    if len(users) == 1 and users[0].op_type == "Div" and gr.is_const(users[0].input[1]):
        div = float(np.asarray(gr.const(users[0].input[1])).reshape(-1)[0])
        out = users[0].output[0]
    # x-transformers: stack((f, f), -1) + rearrange -> Unsqueeze/Concat/Reshape (pairs);
    # concat((f, f), -1) -> one Concat of the same tensor twice (halves)
    layout = "interleaved"
    for user in gr.consumers.get(out, []):
        if user.op_type == "Concat" and len(set(user.input)) == 1:
            layout = "half"
    return np.asarray(inv, dtype=np.float32), div, layout


def _convs(gr: GraphIndex) -> tuple[list[tuple[FloatArray, FloatArray]], int, int]:
    convs = [n for n in gr.g.node if n.op_type == "Conv"]
    if len(convs) != 2:
        raise StructureError(f"expected the two position convolutions, found {len(convs)} Conv")
    out: list[tuple[FloatArray, FloatArray]] = []
    groups, kernel = 0, 0
    for node in convs:
        w = gr.const(node.input[1])
        b = gr.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if w is None or w.ndim != 3 or b is None:
            raise StructureError("a position convolution has no constant weight and bias")
        g = int(gr.attr(node, "group", 1))
        k = int(w.shape[2])
        strides, dilations = gr.attr(node, "strides", [1]), gr.attr(node, "dilations", [1])
        if list(strides) != [1] or list(dilations) != [1]:
            raise StructureError("position convolution with stride or dilation")
        pads = list(gr.attr(node, "pads", [0, 0]))
        if pads not in ([0, 0], [k - 1, 0]):
            raise StructureError(f"position convolution pads {pads} are not causal")
        groups, kernel = g, k
        out.append((np.asarray(w, np.float32), np.asarray(b, np.float32).reshape(-1)))
    return out, groups, kernel


def _layer_norm_eps(gr: GraphIndex, time_dep: set[str]) -> list[float]:
    eps: list[float] = []
    for node in gr.g.node:
        if node.op_type != "LayerNormalization" or node.input[0] in time_dep:
            continue
        if int(gr.attr(node, "axis", -1)) != -1:
            raise StructureError("LayerNormalization over an axis other than the last")
        for idx, neutral in ((1, 1.0), (2, 0.0)):
            if len(node.input) > idx and node.input[idx]:
                value = gr.const(node.input[idx])
                if value is None or not np.all(value == neutral):
                    raise StructureError("LayerNormalization with an affine transform")
        eps.append(float(gr.attr(node, "epsilon", 1e-5)))
    return eps


def read_dit(model: Any) -> DitWeights:
    """Find the DiT's weights in an estimator ``model`` (onnx.ModelProto).

    Raises:
        StructureError: the graph is not upstream's DiT as described in the module docstring.
    """
    gr = GraphIndex(model)
    missing = {*FRAME_INPUTS, SPEAKER_INPUT, TIME_INPUT} - gr.inputs
    if missing:
        raise StructureError(f"estimator inputs {sorted(missing)} missing")
    time_dep = time_dependent(gr, TIME_INPUT)
    linears = [(n, lin) for n in gr.g.node if (lin := _linear_at(gr, n)) is not None]
    frame = [(n, lin) for n, lin in linears if n.input[0] not in time_dep]
    timed = [lin for n, lin in linears if n.input[0] in time_dep]
    if len(frame) < 8 or (len(frame) - 2) % 6:
        raise StructureError(f"{len(frame)} per-frame linear layers do not make DiT blocks")
    proj_in, proj_out = frame[0][1], frame[-1][1]
    dim = proj_in.n
    depth = (len(frame) - 2) // 6
    mods = [lin for lin in timed if lin.shape == (dim, MOD_CHUNKS * dim)]
    finals = [lin for lin in timed if lin.shape == (dim, FINAL_MOD_CHUNKS * dim)]
    if len(mods) != depth or len(finals) != 1:
        raise StructureError(
            f"{len(mods)} block modulations and {len(finals)} final ones for {depth} blocks"
        )
    blocks: list[Block] = []
    for b in range(depth):
        part = frame[1 + 6 * b : 7 + 6 * b]
        qkv_nodes = part[:3]
        if len({n.input[0] for n, _ in qkv_nodes}) != 1:
            raise StructureError(f"block {b}: q, k, v do not share their input")
        q, k, v = _qkv_roles(gr, [lin for _, lin in qkv_nodes])
        out, ff1, ff2 = (lin for _, lin in part[3:])
        inner = q.n
        if (
            k.shape != q.shape
            or v.shape != q.shape
            or out.shape != (inner, dim)
            or ff1.k != dim
            or ff2.shape != (ff1.n, dim)
        ):
            raise StructureError(f"block {b}: linear layer shapes do not fit a DiT block")
        blocks.append(Block(mods[b], q, k, v, out, ff1, ff2))
    inv_freq, div, layout = _rotary(gr)
    head_dim = 2 * inv_freq.size
    inner = blocks[0].q.n
    if inner % head_dim:
        raise StructureError(f"attention width {inner} is no multiple of head dim {head_dim}")
    conv, groups, kernel = _convs(gr)
    eps = _layer_norm_eps(gr, time_dep)
    if len(eps) != 2 * depth + 1:
        raise StructureError(f"{len(eps)} LayerNormalization nodes for {depth} blocks")
    order, widths = _input_order(gr, frame[0][0])
    if sum(widths) != proj_in.k:
        raise StructureError("input projection width does not match its inputs")
    if proj_out.k != dim:
        raise StructureError("output projection does not read the model width")
    return DitWeights(
        dim=dim,
        heads=inner // head_dim,
        head_dim=head_dim,
        proj_in=proj_in,
        input_order=order,
        input_widths=widths,
        conv=conv,
        conv_groups=groups,
        kernel=kernel,
        blocks=blocks,
        final_mod=finals[0],
        proj_out=proj_out,
        inv_freq=inv_freq,
        freq_div=div,
        layout_hint=layout,
        eps=eps,
        mod_outputs=[blk.mod.y for blk in blocks] + [finals[0].y],
    )


def _input_order(gr: GraphIndex, proj_node: Any) -> tuple[list[str], list[int]]:
    """Graph inputs feeding the input projection's Concat, in column order, and widths."""
    src = gr.producer.get(proj_node.input[0])
    while src is not None and src.op_type in ("Cast", "Identity"):
        src = gr.producer.get(src.input[0])
    if src is None or src.op_type != "Concat":
        raise StructureError("the input projection does not read a Concat")
    wanted = {*FRAME_INPUTS, SPEAKER_INPUT}
    order: list[str] = []
    for name in src.input:
        found = source_input(gr, name, wanted)
        if found is None or found in order:
            raise StructureError("cannot trace the input projection's Concat to the inputs")
        order.append(found)
    if set(order) != wanted:
        raise StructureError(f"input projection reads {order}")
    shapes = {i.name: i.type.tensor_type.shape.dim for i in gr.g.input}
    widths = [int(shapes[name][1].dim_value) for name in order]
    if any(w <= 0 for w in widths):
        raise StructureError("input channel counts are not static")
    return order, widths
