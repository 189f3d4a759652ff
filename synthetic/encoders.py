"""Stand-ins for the voice encoders: campplus.onnx and speech_tokenizer_v3.onnx.

Both upstream files are opaque exports (no architecture is published next to them), and they
run only while a new voice is prepared. The stand-ins keep the contract's interface (input
and output dtypes and shapes; the engine feeds both by position) and, at the ``full`` widths
given below, a realistic size:

* campplus.onnx: Kaldi fbank float32 [1,T,80] -> embedding float32 [1,192]. A CAM++-like conv
  stack (3D-Speaker CAM++: 2-D conv front end over frequency, TDNN layers, statistics pooling,
  dense 192): 4 Conv2d 3x3 with 32 channels (frequency 80 -> 10 by three stride-2 convs),
  Conv1d 320 -> 512 (kernel 5, time stride 2), 8 residual dilated Conv1d 512 -> 512
  (kernel 3), mean and standard deviation over time, Linear 1024 -> 192. 7.3 M parameters
  (29.4 MB; published 28.3 MB). CAM++'s dense blocks are narrower but deeper; the cost per
  second of audio is of the same order (measure, do not assume).
* speech_tokenizer_v3.onnx: Whisper log-mel float32 [1,128,T], feats_length int32 [1] ->
  indices int32 [1, (L+3)//4]. A Whisper-style encoder at 25 Hz: Conv1d 128 -> 1280 and
  1280 -> 1280 (kernel 3, stride 2 each, GELU), sinusoidal positions, ``tokenizer_layers``
  pre-LayerNorm transformer layers (width 1280, 20 heads, FF 5120, GELU), final LayerNorm,
  Linear 1280 -> 8 FSQ digits (tanh, rounded to -1/0/1) and the code ``sum((d_i+1) 3^i)``
  in 0..6560. 12 layers give 241.5 M parameters (966 MB; published 969 MB).
"""

from __future__ import annotations

import numpy as np
import onnx

from .config import ParamSpec, ParamTable, SyntheticConfig, Weights, fan_in_std
from .nn import Net, conv_params, linear_params
from .onnx_builder import GraphBuilder

CAMPPLUS_FILE = "campplus.onnx"
TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
FBANK_BINS = 80
FRONT_CONVS = 4
"""Conv2d layers of the campplus front end; all but the first halve the frequency axis."""


def campplus_params(cfg: SyntheticConfig) -> ParamTable:
    """Parameters of the campplus stand-in."""
    ch, width = cfg.campplus_front_channels, cfg.campplus_channels
    table: ParamTable = {}
    for i in range(FRONT_CONVS):
        n_in = 1 if i == 0 else ch
        table[f"head.conv{i}.weight"] = ParamSpec((ch, n_in, 3, 3), fan_in_std(9 * n_in))
        table[f"head.conv{i}.bias"] = ParamSpec((ch,), 0.0)
    freq = FBANK_BINS // 2 ** (FRONT_CONVS - 1)
    conv_params(table, "tdnn", width, ch * freq, 5)
    for i in range(cfg.campplus_layers):
        conv_params(table, f"layers.{i}", width, width, 3, gain=0.5)
    linear_params(table, "dense", 2 * width, cfg.speaker_dim, None)
    return table


def build_campplus(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """campplus.onnx stand-in; see the module docstring."""
    g = GraphBuilder("campplus_standin")
    g.input("input", "float32", [1, "num_frames", FBANK_BINS])
    net = Net(g, Weights(campplus_params(cfg), seed, CAMPPLUS_FILE))
    x = g.op("Unsqueeze", [g.op("Transpose", ["input"], perm=[0, 2, 1]), g.const([1])])
    for i in range(FRONT_CONVS):  # [1, C, freq, T]
        x = g.op(
            "Conv",
            [x, net.param(f"head.conv{i}.weight"), net.param(f"head.conv{i}.bias")],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[1 if i == 0 else 2, 1],
        )
        x = g.op("Relu", [x])
    shape = g.op("Concat", [g.const([1, -1]), g.dim(x, 3)], axis=0)
    x = g.op("Reshape", [x, shape])  # [1, C * freq, T]
    x = g.op("Relu", [net.conv1d(x, "tdnn", pads=(2, 2), stride=2)])
    for i in range(cfg.campplus_layers):
        dilation = 1 + i % 3
        h = net.conv1d(x, f"layers.{i}", pads=(dilation, dilation), dilation=dilation)
        x = g.op("Add", [x, g.op("Relu", [h])])
    mean = g.op("ReduceMean", [x, g.const([2])], keepdims=0)  # [1, C]
    centred = g.op("Sub", [x, g.op("Unsqueeze", [mean, g.const([2])])])
    var = g.op("ReduceMean", [g.op("Mul", [centred, centred]), g.const([2])], keepdims=0)
    stats = g.op("Concat", [mean, g.op("Sqrt", [g.shift(var, 1e-5)])], axis=1)  # [1, 2C]
    g.op(
        "Add",
        [g.op("MatMul", [stats, net.param("dense.weight")]), net.param("dense.bias")],
        out="output",
    )
    g.output("output", "float32", [1, cfg.speaker_dim])
    net.w.check_all_used()
    return g.model()


def tokenizer_params(cfg: SyntheticConfig) -> ParamTable:
    """Parameters of the speech-tokenizer stand-in."""
    width, ff = cfg.tokenizer_width, cfg.tokenizer_ff
    table: ParamTable = {}
    conv_params(table, "conv1", width, cfg.tokenizer_mel_bins, 3)
    conv_params(table, "conv2", width, width, 3)
    ln_weight, ln_bias = ParamSpec((width,), 0.0, 1.0), ParamSpec((width,), 0.0)
    for i in range(cfg.tokenizer_layers):
        p = f"blocks.{i}"
        table[f"{p}.attn_ln.weight"], table[f"{p}.attn_ln.bias"] = ln_weight, ln_bias
        for name in ("query", "key", "value", "out"):
            linear_params(table, f"{p}.attn.{name}", width, width, None)
        table[f"{p}.mlp_ln.weight"], table[f"{p}.mlp_ln.bias"] = ln_weight, ln_bias
        linear_params(table, f"{p}.mlp.0", width, ff, None)
        linear_params(table, f"{p}.mlp.2", ff, width, fan_in_std(ff, 0.5))
    table["ln_post.weight"], table["ln_post.bias"] = ln_weight, ln_bias
    linear_params(table, "fsq_proj", width, cfg.tokenizer_digits, fan_in_std(width, 2.0))
    return table


def _sinusoids(g: GraphBuilder, n_tokens: str, width: int) -> str:
    """Whisper-style sinusoidal positions [N, width] for a dynamic length."""
    half = width // 2
    inv = np.exp(-np.log(10000.0) / (half - 1) * np.arange(half)).astype(np.float32)
    zero, one = g.const(np.asarray(0, np.int64)), g.const(np.asarray(1, np.int64))
    pos = g.op("Cast", [g.op("Range", [zero, n_tokens, one])], to=onnx.TensorProto.FLOAT)
    angles = g.op("Mul", [g.op("Unsqueeze", [pos, g.const([1])]), g.const(inv)])
    return g.op("Concat", [g.op("Sin", [angles]), g.op("Cos", [angles])], axis=1)


def build_speech_tokenizer(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """speech_tokenizer_v3.onnx stand-in; see the module docstring."""
    if 3**cfg.tokenizer_digits != cfg.speech_vocab:
        raise ValueError("tokenizer_digits must give 3**n == 6561 codes")
    width, heads = cfg.tokenizer_width, cfg.tokenizer_heads
    g = GraphBuilder("speech_tokenizer_v3_standin")
    g.input("feats", "float32", [1, cfg.tokenizer_mel_bins, "num_frames"])
    g.input("feats_length", "int32", [1])
    net = Net(g, Weights(tokenizer_params(cfg), seed, TOKENIZER_FILE))
    x = net.gelu(net.conv1d("feats", "conv1", pads=(1, 1), stride=2))
    x = net.gelu(net.conv1d(x, "conv2", pads=(1, 1), stride=2))  # [1, W, ceil(T/4)]
    x = g.op("Transpose", [x], perm=[0, 2, 1])  # [1, N, W]
    x = g.op("Add", [x, _sinusoids(g, g.op("Squeeze", [g.dim(x, 1)]), width)])
    head_dim = width // heads
    for i in range(cfg.tokenizer_layers):
        p = f"blocks.{i}"
        h = net.layer_norm(x, width, 1e-5, f"{p}.attn_ln")
        q, k, v = (
            net.split_heads(net.linear(h, f"{p}.attn.{n}"), heads, head_dim)
            for n in ("query", "key", "value")
        )
        context = net.merge_heads(net.attention(q, k, v, head_dim, None), width)
        x = g.op("Add", [x, net.linear(context, f"{p}.attn.out")])
        h = net.layer_norm(x, width, 1e-5, f"{p}.mlp_ln")
        x = g.op("Add", [x, net.linear(net.gelu(net.linear(h, f"{p}.mlp.0")), f"{p}.mlp.2")])
    x = net.layer_norm(x, width, 1e-5, "ln_post")
    digits = g.op("Tanh", [net.linear(x, "fsq_proj")])  # [1, N, 8]
    level = g.op("Clip", [g.op("Round", [digits]), g.const(-1.0), g.const(1.0)])
    powers = (3.0 ** np.arange(cfg.tokenizer_digits)).astype(np.float32)[:, None]
    code = g.op("MatMul", [g.shift(level, 1.0), g.const(powers)])  # [1, N, 1]
    code = g.op("Cast", [g.op("Reshape", [code, g.const([1, -1])])], to=onnx.TensorProto.INT32)
    length = g.op("Add", ["feats_length", g.const(np.asarray([3], np.int32))])
    n_tokens = g.op("Div", [length, g.const(np.asarray([4], np.int32))])
    n_tokens = g.op("Cast", [n_tokens], to=onnx.TensorProto.INT64)
    g.op("Slice", [code, g.const([0]), n_tokens, g.const([1])], out="indices")
    g.output("indices", "int32", [1, "num_tokens"])
    net.w.check_all_used()
    return g.model()
