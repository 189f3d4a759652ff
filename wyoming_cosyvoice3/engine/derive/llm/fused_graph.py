"""Build the fused-operator LLM graph from :class:`~.llm_weights.LlmWeights`.

Same contract as the published llm*.onnx (spec section 1), with a batch axis B where the
published graph has 1: ``inputs_embeds`` float32 [B, S, H], ``attention_mask`` int64
[B, past + S], ``position_ids`` int64 [B, S], ``past_key_values.{i}.{key,value}`` float32
[B, kv_heads, past, head_dim] -> ``logits`` float32 [B, vocab] (last position) and
``present.{i}.{key,value}`` float32 [B, kv_heads, past + S, head_dim] (keys after RoPE, as the
published graph stores them, so caches made by either graph can be continued by the other).
B > 1 decodes several sequences in one pass over the weights
(:mod:`wyoming_cosyvoice3.engine.llm.tokens`): a row whose mask ends in zeros is a shorter
sequence, right-padded (``GroupQueryAttention`` reads each row's length from ``seqlens_k``).

One decoder layer is 11 onnxruntime nodes instead of about 90 (onnxruntime contrib operators,
domain ``com.microsoft``; documented in onnxruntime ``docs/ContribOperators.md``):

* ``SkipSimplifiedLayerNormalization``: residual add + RMSNorm in one kernel (the first norm
  of the graph is ``SimplifiedLayerNormalization``);
* ``MatMulNBits`` with 8-bit weights (blocks of ``block_size`` along K, one float scale and
  uint8 zero point per block) for the fused q|k|v projection (with its bias), o_proj, the
  fused gate|up projection, down_proj and the head; ``accuracy_level`` 4 quantises the
  activations to int8 per block and multiplies in int8 (MLAS), 0 computes in float32 from the
  dequantised weights;
* ``GroupQueryAttention`` on the packed q|k|v output: RoPE (``do_rotary``, half-split layout,
  tables from the source graph, looked up at ``position_ids``), the KV-cache concat and causal
  attention with ``num_heads / kv_num_heads`` query heads per KV head, scale 1/sqrt(head_dim).
  ``seqlens_k`` = sum(attention_mask) - 1 per row: keys whose mask is 0 are *not* masked
  individually, only a row's trailing zeros shorten it (the engine sends each row's valid
  positions as ones followed by zeros; Qwen2 upstream decoding sends all ones).
* SiLU gate: ``Split`` of the gate|up output, ``Sigmoid``, two ``Mul``.

Weights: from an int8 source the per-column int8 weights map exactly onto 8-bit blocks
(stored value ``w + 128``, zero point ``zp + 128``, the column's scale in every block); from
an fp32 source they are quantised per block with onnxruntime's ``quantize_matmul_8bits``
(asymmetric, min/max).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..common.graph import Linear
from .weights import LlmWeights

MS_DOMAIN = "com.microsoft"
KERNELS = ("fp32", "int8", "dequant", "nbits8", "nbits4")
"""Projection kernels: ``fp32`` = ``MatMul`` (+ ``Add`` bias) with float weights; ``int8`` =
``DynamicQuantizeMatMul`` with per-column int8 weights (per-tensor uint8 activations, exactly
as the published int8 graph quantises them); ``dequant`` = ``MatMul`` with
``DequantizeLinear`` of the int8 weights (float activations; validation only);
``nbits8`` / ``nbits4`` = ``MatMulNBits`` with 8-/4-bit blocked weights."""
OPSET = 17


def pack_int8_columns(
    lin: Linear | list[Linear],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``DynamicQuantizeMatMul`` tensors of one linear (or several concatenated along N).

    int8 sources are used as they are; fp32 weights are quantised per column, symmetric
    (onnxruntime ``quantize_dynamic(per_channel=True)`` convention: scale = max|w| / 127).

    Returns:
        (B int8 [K, N], scale float32 [N], zero point int8 [N], bias float32 [N] or None).
    """
    parts = lin if isinstance(lin, list) else [lin]
    qs, ss, zs = [], [], []
    for p in parts:
        if p.qweight is not None:
            assert p.scale is not None and p.zero_point is not None
            qs.append(p.qweight)
            ss.append(p.scale)
            zs.append(p.zero_point)
        else:
            w = p.dequantized()
            scale = np.maximum(np.abs(w).max(axis=0), 1e-30) / 127.0
            qs.append(np.clip(np.round(w / scale), -127, 127).astype(np.int8))
            ss.append(scale.astype(np.float32))
            zs.append(np.zeros(p.n, np.int8))
    return (
        np.ascontiguousarray(np.concatenate(qs, axis=1)),
        np.concatenate(ss).astype(np.float32),
        np.concatenate(zs).astype(np.int8),
        _bias(parts),
    )


def _bias(parts: list[Linear]) -> np.ndarray | None:
    if all(p.bias is None for p in parts):
        return None
    return np.concatenate(
        [p.bias if p.bias is not None else np.zeros(p.n, np.float32) for p in parts]
    ).astype(np.float32)


def pack_nbits(
    lin: Linear | list[Linear], bits: int, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits tensors of one linear (or several concatenated along N).

    8-bit from int8 per-column weights is exact (stored ``w + 128``, zero point ``zp + 128``,
    the column scale in each block); otherwise the float weights are quantised per block
    (asymmetric min/max) by onnxruntime's ``quantize_matmul_{4,8}bits``.

    Returns:
        (B uint8 [N, K / block, block * bits / 8], scales float32 [N * K / block],
        zero points uint8 [N * ceil(K / block * bits / 8)], bias float32 [N] or None).

    Raises:
        ValueError: K is not a multiple of ``block_size``.
    """
    parts = lin if isinstance(lin, list) else [lin]
    k = parts[0].k
    if k % block_size:
        raise ValueError(f"K={k} is not a multiple of block size {block_size}")
    blocks = k // block_size
    bs, ss, zs = [], [], []
    for p in parts:
        if p.qweight is not None and bits == 8:
            assert p.scale is not None and p.zero_point is not None
            q = (p.qweight.astype(np.int16) + 128).astype(np.uint8).T  # [N, K]
            bs.append(q.reshape(p.n, blocks, block_size))
            ss.append(np.repeat(p.scale.astype(np.float32), blocks))
            zs.append(np.repeat((p.zero_point.astype(np.int16) + 128).astype(np.uint8), blocks))
        else:
            b, s, z = _quantize_blocks(p.dequantized(), bits, block_size)
            bs.append(b)
            ss.append(s)
            zs.append(z)
    return (
        np.ascontiguousarray(np.concatenate(bs, axis=0)),
        np.concatenate(ss),
        np.concatenate(zs),
        _bias(parts),
    )


def _quantize_blocks(
    w: np.ndarray, bits: int, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from onnxruntime.capi import _pybind_state as ort_c

    quantize = ort_c.quantize_matmul_4bits if bits == 4 else ort_c.quantize_matmul_8bits
    k, n = w.shape
    blocks = k // block_size
    packed = np.zeros((n, blocks, block_size * bits // 8), np.uint8)
    scales = np.zeros(n * blocks, np.float32)
    zeros = np.zeros(n * ((blocks * bits + 7) // 8), np.uint8)
    quantize(packed, np.ascontiguousarray(w, np.float32), scales, zeros, block_size, n, k, False)
    return packed, scales, zeros


class _Builder:
    def __init__(self, w: LlmWeights, kernel: str, block_size: int, accuracy_level: int) -> None:
        self.w = w
        self.kernel = kernel
        self.bits = 4 if kernel == "nbits4" else 8
        self.block_size = block_size
        self.accuracy_level = accuracy_level
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, value: np.ndarray, stem: str) -> str:
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(
        self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any
    ) -> list[str]:
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, domain=domain or None, **attrs))
        return outs

    def linear(self, x: str, lin: Linear | list[Linear], stem: str) -> str:
        if self.kernel == "int8":
            return self._dynamic_int8(x, lin, stem)
        if self.kernel == "dequant":
            q, scale, zp, bias = pack_int8_columns(lin)
            wf = self.op(
                "DequantizeLinear",
                [
                    self.const(q, f"{stem}.qweight"),
                    self.const(scale, f"{stem}.scale"),
                    self.const(zp, f"{stem}.zero_point"),
                ],
                axis=1,
            )[0]
            y = self.op("MatMul", [x, wf])[0]
            return y if bias is None else self.op("Add", [y, self.const(bias, f"{stem}.bias")])[0]
        if self.kernel == "fp32":
            parts = lin if isinstance(lin, list) else [lin]
            weight = np.concatenate([p.dequantized() for p in parts], axis=1)
            y = self.op("MatMul", [x, self.const(weight, f"{stem}.weight")])[0]
            bias = _bias(parts)
            return y if bias is None else self.op("Add", [y, self.const(bias, f"{stem}.bias")])[0]
        b, scales, zeros, bias = pack_nbits(lin, self.bits, self.block_size)
        n, k = int(b.shape[0]), int(b.shape[1] * b.shape[2] * 8 // self.bits)
        inputs = [
            x,
            self.const(b, f"{stem}.qweight"),
            self.const(scales, f"{stem}.scales"),
            self.const(zeros, f"{stem}.zero_points"),
        ]
        if bias is not None:
            inputs += ["", self.const(bias, f"{stem}.bias")]
        return self.op(
            "MatMulNBits",
            inputs,
            domain=MS_DOMAIN,
            K=k,
            N=n,
            bits=self.bits,
            block_size=self.block_size,
            accuracy_level=self.accuracy_level,
        )[0]

    def _dynamic_int8(self, x: str, lin: Linear | list[Linear], stem: str) -> str:
        q, scale, zp, bias = pack_int8_columns(lin)
        inputs = [
            x,
            self.const(q, f"{stem}.qweight"),
            self.const(scale, f"{stem}.scale"),
            self.const(zp, f"{stem}.zero_point"),
        ]
        if bias is not None:
            inputs.append(self.const(bias, f"{stem}.bias"))
        return self.op("DynamicQuantizeMatMul", inputs, domain=MS_DOMAIN)[0]


def build_fused_llm(
    w: LlmWeights, *, kernel: str = "int8", block_size: int = 32, accuracy_level: int = 4
) -> onnx.ModelProto:
    """The fused graph (module docstring) with the weights as initializers.

    Raises:
        ValueError: a projection's K is not a multiple of ``block_size``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    g = _Builder(w, kernel, block_size, accuracy_level)
    n_layers = len(w.layers)
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("inputs_embeds", f32,
                                      ["batch", "sequence_length", w.hidden]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                      ["batch", "total_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64,
                                      ["batch", "sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", w.vocab])]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", f32,
                    ["batch", w.kv_heads, "past_length", w.head_dim]
                )
            )
            outputs.append(
                helper.make_tensor_value_info(
                    f"present.{i}.{kind}", f32,
                    ["batch", w.kv_heads, "total_length", w.head_dim]
                )
            )
    # GQA bookkeeping: seqlens_k = sum(mask) - 1 (int32 [B]), total length (int32 scalar)
    total = g.op(
        "ReduceSum", ["attention_mask", g.const(np.array([1], np.int64), "axis")], keepdims=0
    )[0]
    seqlens = g.op(
        "Cast",
        [g.op("Sub", [total, g.const(np.array(1, np.int64), "one")])[0]],
        to=TensorProto.INT32,
    )[0]
    shape = g.op("Shape", ["attention_mask"])[0]
    total_len = g.op("Gather", [shape, g.const(np.array(1, np.int64), "axis1")], axis=0)[0]
    total_len = g.op("Cast", [total_len], to=TensorProto.INT32)[0]
    cos = g.const(w.cos, "cos_cache")
    sin = g.const(w.sin, "sin_cache")
    eps = float(w.eps)
    h = "inputs_embeds"
    x = g.op(
        "SimplifiedLayerNormalization", [h, g.const(w.layers[0].ln1, "ln1")], epsilon=eps, axis=-1
    )[0]
    for i, layer in enumerate(w.layers):
        qkv = g.linear(x, [layer.q, layer.k, layer.v], f"layers.{i}.qkv")
        attn = g.name("attn")
        g.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    qkv,
                    "",
                    "",
                    f"past_key_values.{i}.key",
                    f"past_key_values.{i}.value",
                    seqlens,
                    total_len,
                    cos,
                    sin,
                    "position_ids",
                ],
                [attn, f"present.{i}.key", f"present.{i}.value"],
                domain=MS_DOMAIN,
                num_heads=w.heads,
                kv_num_heads=w.kv_heads,
                do_rotary=1,
                rotary_interleaved=0,
            )
        )
        o = g.linear(attn, layer.o, f"layers.{i}.o")
        x, _, _, h = g.op(
            "SkipSimplifiedLayerNormalization",
            [o, h, g.const(layer.ln2, "ln2")],
            n_out=4,
            domain=MS_DOMAIN,
            epsilon=eps,
        )
        gu = g.linear(x, [layer.gate, layer.up], f"layers.{i}.gate_up")
        inter = layer.gate.n
        gate, up = g.op(
            "Split", [gu, g.const(np.array([inter, inter], np.int64), "split")], n_out=2, axis=-1
        )
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate])[0]])[0]
        down = g.linear(g.op("Mul", [act, up])[0], layer.down, f"layers.{i}.down")
        gamma = w.layers[i + 1].ln1 if i + 1 < n_layers else w.norm
        x, _, _, h = g.op(
            "SkipSimplifiedLayerNormalization",
            [down, h, g.const(gamma, "ln")],
            n_out=4,
            domain=MS_DOMAIN,
            epsilon=eps,
        )
    last = g.op(
        "Slice",
        [
            x,
            g.const(np.array([-1], np.int64), "start"),
            g.const(np.array([2**62], np.int64), "end"),
            g.const(np.array([1], np.int64), "axes"),
        ],
    )[0]
    logits = g.linear(last, w.head, "head")
    g.nodes.append(
        helper.make_node(
            "Reshape", [logits, g.const(np.array([-1, w.vocab], np.int64), "shape")], ["logits"]
        )
    )
    graph = helper.make_graph(g.nodes, "cosyvoice3_llm_fused", inputs, outputs, g.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    )
    model.ir_version = 8
    return model


def build_projection_stack(
    kernel: str, widths: tuple[int, int, int], layers: int, *, block_size: int = 32,
    accuracy_level: int = 4, seed: int = 0,
) -> onnx.ModelProto:
    """A graph of the decoder layers' four projections only, for timing the ``kernel`` on
    this machine (the preset choice's probe, :mod:`...machine`): per layer
    ``hidden -> qkv``, ``hidden -> hidden``, ``hidden -> 2 ffn`` (gate|up) and
    ``ffn -> hidden``, chained through slices, with random per-column int8 weights packed
    exactly as :func:`build_fused_llm` packs a published int8 graph's.

    Args:
        kernel: one of :data:`KERNELS` except ``dequant``.
        widths: (hidden, qkv output, ffn) widths, e.g. (896, 1152, 4864) for the published
            Qwen2-0.5B LLM.
        layers: layers in the chain.
        block_size, accuracy_level: as :func:`build_fused_llm`.
        seed: weight seed (the values do not change the speed).

    Input ``x`` float32 [M, hidden]; output ``y`` float32 [M, hidden].

    Raises:
        ValueError: unknown kernel, or a width not a multiple of ``block_size``.
    """
    if kernel not in KERNELS or kernel == "dequant":
        raise ValueError(f"kernel must be one of {KERNELS[:2] + KERNELS[3:]}, got {kernel!r}")
    hidden, qkv_width, ffn = widths
    rng = np.random.default_rng(seed)

    def linear(k: int, n: int) -> Linear:
        # one random block repeated: quick to make, and the values do not change the speed
        block = rng.integers(-127, 128, size=(min(k, 64), n), dtype=np.int8)
        return Linear("", qweight=np.resize(block, (k, n)),
                      scale=np.full(n, 0.02 / 127, np.float32), zero_point=np.zeros(n, np.int8))

    g = _Builder(None, kernel, block_size, accuracy_level)  # type: ignore[arg-type]
    x = "x"
    for i in range(layers):
        qkv = g.linear(x, linear(hidden, qkv_width), f"probe.{i}.qkv")
        head = g.op("Slice", [qkv, g.const(np.array([0]), "s0"), g.const(np.array([hidden]), "s1"),
                              g.const(np.array([1]), "ax")])[0]
        o = g.linear(head, linear(hidden, hidden), f"probe.{i}.o")
        gate_up = g.linear(o, linear(hidden, 2 * ffn), f"probe.{i}.gate_up")
        gate = g.op("Slice", [gate_up, g.const(np.array([0]), "s0"), g.const(np.array([ffn]), "s1"),
                              g.const(np.array([1]), "ax")])[0]
        x = g.linear(gate, linear(ffn, hidden), f"probe.{i}.down")
    graph = helper.make_graph(
        g.nodes, "projection_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", hidden])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["m", hidden])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 8  # as build_fused_llm's graphs
    return model
