"""Build the chunk-causal streaming DiT graphs from weights read by :mod:`.dit_structure`.

Two ONNX graphs are written:

* the *time graph*: the source graph's nodes that depend on ``t`` alone (TimestepEmbedding and
  every AdaLayerNormZero linear layer), copied unchanged, with the modulation vectors cut into
  their chunks as outputs (``mod_<i>_<j>``, ``mod_final_<j>``, below). ``t`` has one value (the
  batch rows of a CFG call share their time). Run once per distinct ``t`` and cached.
* the *main graph*: the per-frame computation of upstream's ``DiT.forward``
  (cosyvoice/flow/DiT/dit.py) for ``n`` new frames that attend to ``m`` cached frames.

Main graph signature (B = batch, 1 or 2; H heads of head_dim dh; n new frames; m cached
frames):

==============================  ================================================================
input                           meaning
==============================  ================================================================
``x``, ``mu``, ``cond``         float32 [B, 80, n]: the new frames (as the original estimator)
``spks``                        float32 [B, 80]
``mod_<i>_<j>``                 float32 [D]: block i's modulation chunk j (upstream's
                                ``AdaLayerNormZero`` order: shift, 1 + scale and gate of the
                                attention, then of the feed-forward; the scales with 1 added)
``mod_final_<j>``               float32 [D]: the final norm's 1 + scale (j = 0) and shift (1)
``rope_cos``, ``rope_sin``      float32 [n, head_dim]: rotary tables of the new frames'
                                absolute positions (x-transformers ``RotaryEmbedding``),
                                host-computed (:func:`...dit_runner.rope_tables`)
``attn_bias``                   float32 [1 or B, 1, n, m + n]: 0 where a new frame may attend
                                a key, -inf where not (upstream's chunk mask, or all zeros)
``conv1_past``, ``conv2_past``  float32 [B, D, K - 1]: the inputs of the two causal position
                                convolutions for the K - 1 frames before the new ones (zeros
                                at frame 0, which is what upstream's left zero padding gives)
``prompt_key_<i>``,             float32 [B, H, mp, dh] / [B, H, mh, dh]: cached keys (after
``prompt_value_<i>``,           rotary) and values of block i, head-major, for the prompt
``hist_key_<i>``,               frames and the history frames (either may have 0 frames)
``hist_value_<i>``
==============================  ================================================================

Outputs: ``velocity`` [B, 80, n]; ``conv1_next``, ``conv2_next`` [B, D, K - 1] (the past
inputs for the frames after these); ``new_key_<i>``, ``new_value_<i>`` [B, H, n, dh]: this
call's keys and values, which the host appends to its history.

Attention is onnxruntime's contrib ``MultiHeadAttention`` (com.microsoft domain) with the
keys and values given head-major: one concatenation and one fused kernel per block instead of
the plain-operator form's concatenation, gathers, transposes, two products and softmax (2.9
against 4.1 ms per block for 40 new frames over 300 cached at the published width, 2 threads,
on the 2-core test machine). With m = 0, zero convolution pasts,
positions 0..n-1 and an all-zero bias, the main graph computes what the original estimator
computes (validated when derived). Attention as ``F.scaled_dot_product_attention``
(softmax(q k^T / sqrt(head_dim) + bias) v); LayerNorm without affine, eps from the
source, then x (1 + scale) + shift: one ``LayerNormalization`` with the modulation chunks as
its scale and bias;
FeedForward GELU with the tanh approximation (modules.py ``FeedForward(approximate="tanh")``,
contrib ``FastGelu``);
the two grouped position convolutions as 2-D ones over a height of 1 (a [1, K] kernel),
Mish after each.
The rotary "rotate half" is a constant signed permutation matrix (exact: one non-zero per
column), so both rotary layouts (x-transformers' pairs and halves) are one code path.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..common.graph import Linear
from .dit_structure import FINAL_MOD_CHUNKS, MOD_CHUNKS, DitWeights

SCALE_CHUNKS = (1, 4)
"""The scale chunks of a block's modulation (upstream's ``AdaLayerNormZero``: shift_msa,
scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp), which the time graph hands out as
1 + scale."""
FINAL_SCALE_CHUNKS = (0,)
"""The final norm's scale chunk (``AdaLayerNormZero_Final``: scale, shift)."""

OPSET = 18
MS_DOMAIN = "com.microsoft"


class _Builder:
    """Minimal ONNX graph builder (unique names, constants as initializers)."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.h = helper
        self.nh = numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.value_info: list[Any] = []
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, value: Any, base: str = "c") -> str:
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        name = self.name(base)
        self.inits.append(self.nh.from_array(arr.copy(order="C"), name))
        return name

    def op_multi(self, op_type: str, inputs: list[str], outs: list[str], **attrs: Any
                 ) -> list[str]:
        node = self.h.make_node(op_type, inputs, outs, name=self.name(f"n_{op_type}"), **attrs)
        self.nodes.append(node)
        return outs

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        return self.op_multi(op_type, inputs, [out or self.name(op_type.lower())], **attrs)[0]

    def linear(self, x: str, lin: Linear, base: str) -> str:
        y = self.op("MatMul", [x, self.const(lin.dequantized(), f"{base}.weight")], self.name(base))
        if lin.bias is not None:
            y = self.op("Add", [y, self.const(lin.bias, f"{base}.bias")])
        return y

    def modulated_norm(self, x: str, eps: float, scale_1p: str, shift: str) -> str:
        """LayerNorm(x) (1 + scale) + shift in one kernel (``scale_1p`` = 1 + scale, [D])."""
        return self.op("LayerNormalization", [x, scale_1p, shift], epsilon=eps, axis=-1)


def rotate_half_matrix(head_dim: int, layout: str) -> np.ndarray:
    """[head_dim, head_dim] P with ``x @ P == rotate_half(x)``.

    "interleaved" (x-transformers ``rotate_half``: pairs (x1, x2) -> (-x2, x1)); "half"
    (concat(-x[h:], x[:h])).
    """
    p = np.zeros((head_dim, head_dim), dtype=np.float32)
    half = head_dim // 2
    for i in range(half):
        if layout == "interleaved":
            p[2 * i + 1, 2 * i] = -1.0
            p[2 * i, 2 * i + 1] = 1.0
        else:
            p[i + half, i] = -1.0
            p[i, i + half] = 1.0
    return p


def build_main(w: DitWeights, layout: str) -> Any:
    """The main (per-frame) streaming graph as an onnx.ModelProto; see the module docstring."""
    from onnx import TensorProto

    b = _Builder()
    h = b.h
    dim, inner, dh, kk = w.dim, w.inner, w.head_dim, w.kernel
    f32 = TensorProto.FLOAT
    inputs = [
        h.make_tensor_value_info(name, f32, ["B", width, "n"])
        for name, width in zip(w.input_order, w.input_widths, strict=True)
        if name != "spks"
    ]
    spk_width = w.input_widths[w.input_order.index("spks")]
    inputs.append(h.make_tensor_value_info("spks", f32, ["B", spk_width]))
    inputs += [h.make_tensor_value_info(f"mod_{i}_{j}", f32, [dim])
               for i in range(w.depth) for j in range(MOD_CHUNKS)]
    inputs += [h.make_tensor_value_info(f"mod_final_{j}", f32, [dim])
               for j in range(FINAL_MOD_CHUNKS)]
    inputs += [h.make_tensor_value_info(n, f32, ["n", dh]) for n in ("rope_cos", "rope_sin")]
    inputs.append(h.make_tensor_value_info("attn_bias", f32, ["Ba", 1, "n", "mn"]))
    inputs += [h.make_tensor_value_info(n, f32, ["B", dim, kk - 1])
               for n in ("conv1_past", "conv2_past")]
    for i in range(w.depth):
        inputs += [h.make_tensor_value_info(f"{part}_{kind}_{i}", f32,
                                            ["B", w.heads, "mp" if part == "prompt" else "mh", dh])
                   for part in ("prompt", "hist") for kind in ("key", "value")]

    # InputEmbedding: proj(concat(x, cond, mu, spks)) + CausalConvPositionEmbedding
    parts: list[str | None] = []
    first = None
    for name in w.input_order:
        if name == "spks":
            parts.append(None)
            continue
        t = b.op("Transpose", [name], perm=[0, 2, 1])
        first = first or t
        parts.append(t)
    assert first is not None
    bn = b.op("Slice", [b.op("Shape", [first]), b.const([0]), b.const([2])])
    spk_shape = b.op("Concat", [bn, b.const([spk_width])], axis=0)
    spk = b.op("Expand", [b.op("Unsqueeze", ["spks", b.const([1])]), spk_shape])
    joined = b.op("Concat", [p if p is not None else spk for p in parts], axis=2)
    hid = b.linear(joined, w.proj_in, "proj_in")  # [B, n, D]
    c = b.op("Transpose", [hid], perm=[0, 2, 1])
    nexts = []
    for idx, (past, (cw, cb)) in enumerate(zip(("conv1_past", "conv2_past"), w.conv,
                                              strict=True)):
        full = b.op("Concat", [past, c], axis=2)
        nexts.append(b.op("Slice", [full, b.const([-(kk - 1)]), b.const([2**62]),
                                    b.const([2])], out=f"conv{idx + 1}_next"))
        # as a 2-D convolution over [B, D, 1, T] with a [1, K] kernel: the same sums, and
        # onnxruntime's grouped 2-D kernel is the faster one at a stream's small chunks
        # (BENCHMARKS.md "The position convolutions in 2-D")
        wide = b.op("Unsqueeze", [full, b.const([2])])
        c = b.op("Conv", [wide, b.const(cw[:, :, None, :], "conv.weight"),
                          b.const(cb, "conv.bias")],
                 group=w.conv_groups, kernel_shape=[1, kk], pads=[0, 0, 0, 0])
        c = b.op("Mish", [b.op("Squeeze", [c, b.const([2])])])
    hid = b.op("Add", [b.op("Transpose", [c], perm=[0, 2, 1]), hid])

    rot = b.const(rotate_half_matrix(dh, layout), "rotate_half")
    heads_shape = b.const([0, 0, w.heads, dh])
    new_outputs: list[Any] = []

    def rope(t: str) -> str:
        head = b.op("Slice", [t, b.const([0]), b.const([dh]), b.const([-1])])
        rest = b.op("Slice", [t, b.const([dh]), b.const([inner]), b.const([-1])])
        rotated = b.op("Add", [b.op("Mul", [head, "rope_cos"]),
                               b.op("Mul", [b.op("MatMul", [head, rot]), "rope_sin"])])
        return b.op("Concat", [rotated, rest], axis=-1)

    for i, blk in enumerate(w.blocks):
        chunks = [f"mod_{i}_{j}" for j in range(MOD_CHUNKS)]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
        xn = b.modulated_norm(hid, w.eps[2 * i], scale_msa, shift_msa)
        q = rope(b.linear(xn, blk.q, f"b{i}.q"))
        k = rope(b.linear(xn, blk.k, f"b{i}.k"))
        v = b.linear(xn, blk.v, f"b{i}.v")
        # head-major new keys/values (an output: the host appends them to its history),
        # then onnxruntime's fused attention (contrib MultiHeadAttention, keys/values given
        # head-major): softmax(q k^T / sqrt(head_dim) + attn_bias) v over prompt ++ history
        # ++ new frames
        kv_all = []
        for kind, t in (("key", k), ("value", v)):
            new = b.op("Transpose", [b.op("Reshape", [t, heads_shape])], f"new_{kind}_{i}",
                       perm=[0, 2, 1, 3])
            new_outputs.append(h.make_tensor_value_info(new, f32, ["B", w.heads, "n", dh]))
            kv_all.append(b.op("Concat", [f"prompt_{kind}_{i}", f"hist_{kind}_{i}", new],
                               axis=2))
        ctx = b.op("MultiHeadAttention", [q, *kv_all, "", "", "attn_bias"],
                   domain=MS_DOMAIN, num_heads=w.heads, scale=1.0 / math.sqrt(dh))
        b.value_info.append(h.make_tensor_value_info(ctx, f32, ["B", "n", inner]))
        attn = b.linear(ctx, blk.out, f"b{i}.out")
        hid = b.op("Add", [hid, b.op("Mul", [gate_msa, attn])])
        xn = b.modulated_norm(hid, w.eps[2 * i + 1], scale_mlp, shift_mlp)
        ff = _gelu_tanh(b, b.linear(xn, blk.ff1, f"b{i}.ff1"))
        # contrib outputs get no shape from onnx's inference: declared, so the int8 recipe
        # (which quantises MatMuls of rank-3 activations) still finds the next layer
        b.value_info.append(h.make_tensor_value_info(ff, f32, ["B", "n", blk.ff1.n]))
        hid = b.op("Add", [hid, b.op("Mul", [gate_mlp, b.linear(ff, blk.ff2, f"b{i}.ff2")])])

    fscale, fshift = (f"mod_final_{j}" for j in range(FINAL_MOD_CHUNKS))
    out = b.linear(b.modulated_norm(hid, w.eps[-1], fscale, fshift), w.proj_out, "proj_out")
    b.op("Transpose", [out], out="velocity", perm=[0, 2, 1])
    mel = w.proj_out.n
    outputs = [
        h.make_tensor_value_info("velocity", f32, ["B", mel, "n"]),
        h.make_tensor_value_info("conv1_next", f32, ["B", dim, kk - 1]),
        h.make_tensor_value_info("conv2_next", f32, ["B", dim, kk - 1]),
        *new_outputs,
    ]
    graph = h.make_graph(b.nodes, "dit_streaming_main", inputs, outputs, b.inits,
                         value_info=b.value_info)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET),
                                               h.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 8
    meta = {
        "rope_layout": layout,
        "rope_inv_freq": ",".join(repr(float(f)) for f in w.inv_freq),
        "rope_freq_div": repr(w.freq_div),
        "depth": str(w.depth),
        "dim": str(dim),
        "inner": str(inner),
        "head_dim": str(dh),
        "heads": str(w.heads),
        "conv_context_frames": str(kk - 1),
    }
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    return model


def _gelu_tanh(b: _Builder, x: str) -> str:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (torch GELU approximate="tanh"), as
    onnxruntime's contrib ``FastGelu`` (the same formula in one kernel: 0.14 against 0.36 ms
    for the seven-operator form on [2, 50, 2048], max difference from a float64 reference
    7.7e-7 for both)."""
    return b.op("FastGelu", [x], domain=MS_DOMAIN)


def build_time(model: Any, w: DitWeights) -> Any:
    """The time graph: ``t`` [1] -> ``mod_<i>_<j>`` and ``mod_final_<j>`` [D] each.

    The source graph's nodes needed for the modulation tensors (all depend on ``t`` and
    constants only), copied unchanged with the initializers they read.
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    targets = list(w.mod_outputs)
    producer = {o: n for n in g.node for o in n.output}
    needed: list[Any] = []
    seen: set[str] = set()
    stack = list(targets)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            continue
        needed.append(node)
        stack.extend(i for i in node.input if i)
    keep = {id(n) for n in needed}
    nodes = [n for n in g.node if id(n) in keep]
    inits = [i for i in g.initializer if i.name in seen]
    renames = {name: f"mod_{i}" for i, name in enumerate(targets[:-1])}
    renames[targets[-1]] = "mod_final"
    outs = []
    for name, new in renames.items():
        chunks, scale_chunks = ((MOD_CHUNKS, SCALE_CHUNKS) if new != "mod_final"
                                else (FINAL_MOD_CHUNKS, FINAL_SCALE_CHUNKS))
        flat = f"{new}_flat"  # [1, chunks x D] -> [chunks x D]: fails for more than one t
        inits.append(numpy_helper.from_array(np.array([chunks * w.dim], np.int64),
                                             f"{new}_shape"))
        nodes.append(helper.make_node("Reshape", [name, f"{new}_shape"], [flat]))
        for j in range(chunks):
            out = f"{new}_{j}"
            bounds = [f"{out}_start", f"{out}_end"]
            for bound, at in zip(bounds, (j * w.dim, (j + 1) * w.dim), strict=True):
                inits.append(numpy_helper.from_array(np.array([at], np.int64), bound))
            part = f"{out}_scale" if j in scale_chunks else out
            nodes.append(helper.make_node("Slice", [flat, *bounds], [part]))
            if j in scale_chunks:
                inits.append(numpy_helper.from_array(np.array(1.0, np.float32), f"{out}_one"))
                nodes.append(helper.make_node("Add", [part, f"{out}_one"], [out]))
            outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [w.dim]))
    t_in = helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])
    graph = helper.make_graph(nodes, "dit_streaming_time", [t_in], outs, inits)
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    return out
