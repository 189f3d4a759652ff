"""Synthetic flow graphs: flow_encoder.onnx and the DiT estimator, random weights (widths
below are the ``full`` size's, :class:`.config.SyntheticConfig`).

flow_encoder.onnx (cosyvoice/flow/flow.py CausalMaskedDiffWithDiT.inference with
``finalize=True``; transformer/upsample_encoder.py PreLookaheadLayer; cosyvoice3.yaml):
token int64 [1,T], embedding float32 [1,192] -> mu float32 [1,80,2T], spks float32 [1,80].
Token embedding 6561 x 80; pre-lookahead layer: conv 80 -> 1024 (kernel 4) over the token and
3 tokens of right context (zero padded), LeakyReLU, causal conv 1024 -> 80 (kernel 3), plus
the residual; each token repeated twice (``token_mel_ratio`` 2). spks = Linear(192 -> 80) of
the L2-normalised embedding (``F.normalize`` then ``spk_embed_affine_layer``).

flow.decoder.estimator.fp32.onnx (cosyvoice/flow/DiT/dit.py DiT and DiT/modules.py; inputs
and output named as cosyvoice/bin/export_onnx.py): x, mu, cond float32 [2,80,F], mask [2,1,F],
t [2], spks [2,80] -> estimator_out [2,80,F] (CFG batch 2, dynamic F).

* TimestepEmbedding: sinusoidal features of 1000 t (256 wide) -> Linear 1024 -> SiLU -> Linear.
* InputEmbedding: Linear(concat(x, cond, mu, spks broadcast) = 320 -> 1024), plus
  CausalConvPositionEmbedding (two grouped convs, kernel 31, 16 groups, left padding 30, Mish).
* 22 DiTBlocks: AdaLayerNormZero (Linear(SiLU(t)) -> shift/scale/gate for attention and FF),
  16-head self-attention of 64 over all F frames with keys masked by ``mask`` and the output
  zeroed on masked frames; rotary embedding (x-transformers RotaryEmbedding(64), theta 1e4,
  half-split) applied to the first 64 channels of the 1024-wide q and k, as upstream applies
  it before splitting heads; FeedForward 1024 -> 2048 -> 1024 with tanh-GELU.
* AdaLayerNormZero_Final (scale, shift) and Linear 1024 -> 80.

No long skip connection (the yaml leaves ``long_skip_connection`` False). Parameter count
331.1 M (1.325 GB fp32) against the published 1.326 GB file.
"""

from __future__ import annotations

import numpy as np
import onnx

from .config import ParamSpec, ParamTable, SyntheticConfig, Weights
from .nn import Net, conv_params, linear_params, rotate_half
from .onnx_builder import GraphBuilder

FLOW_ENCODER_FILE = "flow_encoder.onnx"
ESTIMATOR_FILE = "flow.decoder.estimator.fp32.onnx"
NEG_BIAS = -1.0e9
ADALN_CHUNKS = 6
"""AdaLayerNormZero outputs: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp."""


def flow_encoder_params(cfg: SyntheticConfig) -> ParamTable:
    """Parameters of flow_encoder.onnx (nn.Embedding default init N(0, 1))."""
    table: ParamTable = {
        "input_embedding.weight": ParamSpec((cfg.speech_vocab, cfg.flow_embed_dim), 1.0)
    }
    linear_params(table, "spk_embed_affine_layer", cfg.speaker_dim, cfg.mel_bins, None)
    emb, ch = cfg.flow_embed_dim, cfg.flow_lookahead_channels
    conv_params(table, "pre_lookahead_layer.conv1", ch, emb, cfg.flow_lookahead_tokens + 1)
    conv_params(table, "pre_lookahead_layer.conv2", emb, ch, 3)
    return table


def build_flow_encoder(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """flow_encoder.onnx; see the module docstring."""
    g = GraphBuilder("flow_encoder")
    g.input("token", "int64", [1, "num_tokens"])
    g.input("embedding", "float32", [1, cfg.speaker_dim])
    net = Net(g, Weights(flow_encoder_params(cfg), seed, FLOW_ENCODER_FILE))
    emb = g.op("Gather", [net.param("input_embedding.weight"), "token"], axis=0)  # [1, T, E]
    x = g.op("Transpose", [emb], perm=[0, 2, 1])  # [1, E, T]
    h = net.conv1d(x, "pre_lookahead_layer.conv1", pads=(0, cfg.flow_lookahead_tokens))
    h = g.op("LeakyRelu", [h], alpha=0.01)
    h = g.op("Add", [net.conv1d(h, "pre_lookahead_layer.conv2", pads=(2, 0)), x])  # [1, E, T]
    ratio = cfg.token_mel_ratio
    tiled = g.op("Tile", [g.op("Unsqueeze", [h, g.const([3])]), g.const([1, 1, 1, ratio])])
    g.op("Reshape", [tiled, g.const([0, 0, -1])], out="mu")  # token t -> frames 2t, 2t+1
    norm = g.op("ReduceL2", ["embedding", g.const([1])], keepdims=1)
    unit = g.op("Div", ["embedding", g.op("Max", [norm, g.const(1e-12)])])
    g.op(
        "Add",
        [
            g.op("MatMul", [unit, net.param("spk_embed_affine_layer.weight")]),
            net.param("spk_embed_affine_layer.bias"),
        ],
        out="spks",
    )
    g.output("mu", "float32", [1, cfg.mel_bins, "num_frames"])
    g.output("spks", "float32", [1, cfg.mel_bins])
    net.w.check_all_used()
    return g.model()


def estimator_params(cfg: SyntheticConfig) -> ParamTable:
    """Parameters of the DiT estimator (module names as upstream dit.py)."""
    dim, std = cfg.dit_dim, cfg.dit_init_std
    table: ParamTable = {}
    linear_params(table, "time_embed.time_mlp.0", cfg.dit_time_freq_dim, dim, std)
    linear_params(table, "time_embed.time_mlp.2", dim, dim, std)
    linear_params(table, "input_embed.proj", 4 * cfg.mel_bins, dim, std)
    for conv in ("conv1", "conv2"):
        conv_params(
            table,
            f"input_embed.conv_pos_embed.{conv}.0",
            dim,
            dim,
            cfg.dit_conv_pos_kernel,
            groups=cfg.dit_conv_pos_groups,
        )
    inner = cfg.dit_heads * cfg.dit_head_dim
    for i in range(cfg.dit_depth):
        p = f"transformer_blocks.{i}"
        linear_params(table, f"{p}.attn_norm.linear", dim, ADALN_CHUNKS * dim, std)
        for name in ("to_q", "to_k", "to_v"):
            linear_params(table, f"{p}.attn.{name}", dim, inner, std)
        linear_params(table, f"{p}.attn.to_out.0", inner, dim, std)
        linear_params(table, f"{p}.ff.ff.0.0", dim, cfg.dit_ff_mult * dim, std)
        linear_params(table, f"{p}.ff.ff.2", cfg.dit_ff_mult * dim, dim, std)
    linear_params(table, "norm_out.linear", dim, 2 * dim, std)
    linear_params(table, "proj_out", dim, cfg.mel_bins, std)
    return table


def _estimator_io(g: GraphBuilder, mels: int) -> None:
    """Inputs and output exactly as upstream export_onnx.py names them."""
    for name in ("x", "mask", "mu", "t", "spks", "cond"):
        shape: list[int | str]
        if name == "mask":
            shape = [2, 1, "seq_len"]
        elif name == "t":
            shape = [2]
        elif name == "spks":
            shape = [2, mels]
        else:
            shape = [2, mels, "seq_len"]
        g.input(name, "float32", shape)
    g.output("estimator_out", "float32", [2, mels, "seq_len"])


def _time_embedding(net: Net, cfg: SyntheticConfig) -> str:
    """TimestepEmbedding(t) [2, dim] (modules.py SinusPositionEmbedding, scale 1000)."""
    g = net.g
    half = cfg.dit_time_freq_dim // 2
    freqs = np.exp(np.arange(half) * -(np.log(10000.0) / (half - 1))).astype(np.float32)
    args = g.op("Mul", [g.op("Unsqueeze", ["t", g.const([1])]), g.const(1000.0 * freqs)])
    feats = g.op("Concat", [g.op("Sin", [args]), g.op("Cos", [args])], axis=1)  # [2, 256]
    hidden = net.silu(net.linear(feats, "time_embed.time_mlp.0"))
    return net.linear(hidden, "time_embed.time_mlp.2")


def _rope_first_head(g: GraphBuilder, x: str, cos: str, sin: str, rot: int, width: int) -> str:
    """Rotate channels [0, rot) of [2, F, width] (x-transformers apply_rotary_pos_emb)."""
    head = g.op("Slice", [x, g.const([0]), g.const([rot]), g.const([-1])])
    rest = g.op("Slice", [x, g.const([rot]), g.const([width]), g.const([-1])])
    rotated = g.op("Add", [g.op("Mul", [head, cos]), g.op("Mul", [rotate_half(g, head, rot), sin])])
    return g.op("Concat", [rotated, rest], axis=-1)


def _modulated_norm(net: Net, x: str, width: int, eps: float, scale: str, shift: str) -> str:
    """``LayerNorm(x) * (1 + scale) + shift`` (LayerNorm without affine)."""
    g = net.g
    normed = net.layer_norm(x, width, eps)
    return g.op("Add", [g.op("Mul", [normed, g.shift(scale, 1.0)]), shift])


def build_estimator(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """flow.decoder.estimator.fp32.onnx; see the module docstring."""
    g = GraphBuilder("flow_decoder_estimator_dit")
    _estimator_io(g, cfg.mel_bins)
    net = Net(g, Weights(estimator_params(cfg), seed, ESTIMATOR_FILE))
    dim, heads, head_dim = cfg.dit_dim, cfg.dit_heads, cfg.dit_head_dim
    inner, eps = heads * head_dim, cfg.dit_norm_eps

    frames = {n: g.op("Transpose", [n], perm=[0, 2, 1]) for n in ("x", "cond", "mu")}
    spk = g.op("Expand", [g.op("Unsqueeze", ["spks", g.const([1])]), g.op("Shape", [frames["x"]])])
    joined = g.op("Concat", [frames["x"], frames["cond"], frames["mu"], spk], axis=2)
    h = net.linear(joined, "input_embed.proj")  # [2, F, dim]
    pad = cfg.dit_conv_pos_kernel - 1
    c = g.op("Transpose", [h], perm=[0, 2, 1])
    for conv in ("conv1", "conv2"):
        c = net.conv1d(
            c,
            f"input_embed.conv_pos_embed.{conv}.0",
            pads=(pad, 0),
            groups=cfg.dit_conv_pos_groups,
        )
        c = g.op("Mish", [c])
    h = g.op("Add", [g.op("Transpose", [c], perm=[0, 2, 1]), h])

    t_act = net.silu(_time_embedding(net, cfg))  # SiLU(t) feeds every AdaLN linear

    # rotary tables for positions 0..F-1, 64 channels, half-split
    rot = head_dim
    inv_freq = 1.0 / cfg.dit_rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    n_frames = g.op("Squeeze", [g.dim("x", 2)])
    zero, one = g.const(np.asarray(0, np.int64)), g.const(np.asarray(1, np.int64))
    pos = g.op("Cast", [g.op("Range", [zero, n_frames, one])], to=onnx.TensorProto.FLOAT)
    angles = g.op(
        "Mul", [g.op("Unsqueeze", [pos, g.const([1])]), g.const(inv_freq.astype(np.float32))]
    )
    both = g.op("Concat", [angles, angles], axis=-1)  # [F, 64]
    cos, sin = g.op("Cos", [both]), g.op("Sin", [both])

    key_bias = g.scale(g.op("Sub", [g.const(1.0), "mask"]), NEG_BIAS)  # [2, 1, F]
    key_bias = g.op("Unsqueeze", [key_bias, g.const([1])])  # [2, 1, 1, F]
    frame_mask = g.op("Transpose", ["mask"], perm=[0, 2, 1])  # [2, F, 1]

    for i in range(cfg.dit_depth):
        p = f"transformer_blocks.{i}"
        mod = net.linear(t_act, f"{p}.attn_norm.linear")  # [2, 6 dim]
        mod = g.op("Reshape", [mod, g.const([0, ADALN_CHUNKS, 1, dim])])
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            g.op("Gather", [mod, g.const(np.asarray(k, np.int64))], axis=1)
            for k in range(ADALN_CHUNKS)
        )  # each [2, 1, dim]
        x = _modulated_norm(net, h, dim, eps, scale_msa, shift_msa)
        q = _rope_first_head(g, net.linear(x, f"{p}.attn.to_q"), cos, sin, rot, inner)
        k = _rope_first_head(g, net.linear(x, f"{p}.attn.to_k"), cos, sin, rot, inner)
        v = net.linear(x, f"{p}.attn.to_v")
        context = net.attention(
            net.split_heads(q, heads, head_dim),
            net.split_heads(k, heads, head_dim),
            net.split_heads(v, heads, head_dim),
            head_dim,
            key_bias,
        )
        attn = net.linear(net.merge_heads(context, inner), f"{p}.attn.to_out.0")
        attn = g.op("Mul", [attn, frame_mask])
        h = g.op("Add", [h, g.op("Mul", [gate_msa, attn])])
        x = _modulated_norm(net, h, dim, eps, scale_mlp, shift_mlp)
        ff = net.linear(net.gelu_tanh(net.linear(x, f"{p}.ff.ff.0.0")), f"{p}.ff.ff.2")
        h = g.op("Add", [h, g.op("Mul", [gate_mlp, ff])])

    final = g.op("Reshape", [net.linear(t_act, "norm_out.linear"), g.const([0, 2, 1, dim])])
    scale = g.op("Gather", [final, g.const(np.asarray(0, np.int64))], axis=1)
    shift = g.op("Gather", [final, g.const(np.asarray(1, np.int64))], axis=1)
    out = net.linear(_modulated_norm(net, h, dim, eps, scale, shift), "proj_out")  # [2, F, 80]
    g.op("Transpose", [out], out="estimator_out", perm=[0, 2, 1])
    net.w.check_all_used()
    return g.model()


def estimator_flops_per_frame(cfg: SyntheticConfig) -> float:
    """Approximate FLOPs of one estimator row per mel frame, attention scores excluded
    (2 per multiply-add of every per-frame linear layer and the position convs)."""
    dim, inner = cfg.dit_dim, cfg.dit_heads * cfg.dit_head_dim
    per_block = 4 * dim * inner + 2 * dim * cfg.dit_ff_mult * dim
    conv = 2 * dim * (dim // cfg.dit_conv_pos_groups) * cfg.dit_conv_pos_kernel
    return 2.0 * (cfg.dit_depth * per_block + 4 * cfg.mel_bins * dim + conv + dim * cfg.mel_bins)
