"""Synthetic flow graphs: flow_encoder.onnx and flow.decoder.estimator.fp32.onnx.

flow_encoder (model card; upstream flow.py CausalMaskedDiffWithDiT.inference and
transformer/upsample_encoder.py PreLookaheadLayer): token int64 [1,T], embedding float32 [1,192]
-> mu float32 [1,80,2T], spks float32 [1,80]. Structure as upstream: token embedding; a
pre-lookahead conv whose output at token t sees tokens t..t+3 (right zero padding, the
"finalize" form, so the last 3 tokens see zeros), LeakyReLU, a causal conv (kernel 3), a
residual; each token repeated twice (token_mel_ratio 2); a 1x1 projection to 80 channels
squashed into a log-mel-like range. spks = affine map of the L2-normalised embedding
(upstream ``F.normalize`` then ``spk_embed_affine_layer``).

estimator (upstream cosyvoice/bin/export_onnx.py: inputs x, mask, mu, t, spks, cond; output
``estimator_out``; batch 2 for CFG; dynamic frame axis): a velocity field that drives x
towards ``target = A mu + B cond + W spks + D t_features + G masked_mean_over_frames(x)``::

    estimator_out = mask * (target - x) / (1.05 - t)

the ideal velocity of a straight-line path, so 10 Euler steps on the cosine schedule land
near ``target``: mel values in the usual natural-log range. The masked mean over all frames
plays the role of the DiT's full attention: every output frame depends on every input frame,
so the chunk size changes the result as it does for the real DiT.
"""

from __future__ import annotations

import numpy as np
import onnx

from wyoming_cosyvoice3.engine import constants as C

from .config import SyntheticConfig
from .onnx_builder import GraphBuilder


def build_flow_encoder(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """flow_encoder.onnx; see the module docstring."""
    mels, emb_dim = cfg.mel_bins, cfg.flow_embed_dim
    lookahead = C.PRE_LOOKAHEAD_TOKENS
    g = GraphBuilder("flow_encoder")
    g.input("token", "int64", [1, "num_tokens"])
    g.input("embedding", "float32", [1, cfg.speaker_dim])

    table = rng.normal(0.0, 1.0, (C.SPEECH_TOKEN_VOCAB, emb_dim)).astype(np.float32)
    emb = g.op("Gather", [g.const(table), "token"], axis=0)  # [1, T, E]
    x = g.op("Transpose", [emb], perm=[0, 2, 1])  # [1, E, T]
    w1 = rng.normal(0.0, 1.0 / np.sqrt(emb_dim * (lookahead + 1)), (mels, emb_dim, lookahead + 1))
    h = g.conv1d(x, w1, np.zeros(mels), pads=(0, lookahead))  # sees tokens t..t+3
    h = g.op("LeakyRelu", [h], alpha=0.01)
    w2 = rng.normal(0.0, 1.0 / np.sqrt(mels * 3), (mels, mels, 3))
    h = g.conv1d(h, w2, np.zeros(mels), pads=(2, 0))  # causal, kernel 3
    residual = g.conv1d(
        x, rng.normal(0.0, 1.0 / np.sqrt(emb_dim), (mels, emb_dim, 1)), None, (0, 0)
    )
    h = g.op("Add", [h, residual])  # [1, 80, T]
    pair = g.op("Unsqueeze", [h, g.const([3])])
    doubled = g.op("Concat", [pair, pair], axis=3)  # [1, 80, T, 2]
    frames = g.op("Reshape", [doubled, g.const([0, 0, -1])])  # token t -> frames 2t, 2t+1
    w_mu = rng.normal(0.0, 1.0 / np.sqrt(mels), (mels, mels, 1))
    proj = g.conv1d(frames, w_mu, rng.normal(0.0, 0.3, mels), pads=(0, 0))
    g.op("Add", [g.scale(g.op("Tanh", [proj]), 3.0), g.const(-5.0)], out="mu")

    norm = g.op("ReduceL2", ["embedding", g.const([1])], keepdims=1)
    unit = g.op("Div", ["embedding", g.op("Max", [norm, g.const(1e-12)])])
    w_spk = rng.normal(0.0, 1.0, (cfg.speaker_dim, mels)).astype(np.float32)
    g.op("Add", [g.op("MatMul", [unit, g.const(w_spk)]), g.const(-1.0)], out="spks")
    g.output("mu", "float32", [1, mels, "num_frames"])
    g.output("spks", "float32", [1, mels])
    return g.model()


def _frame_map(g: GraphBuilder, x: str, weight: np.ndarray) -> str:
    """Frame-wise linear map of [B, C, F] (a 1x1 conv)."""
    return g.conv1d(x, weight[:, :, None], None, pads=(0, 0))


def build_estimator(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """flow.decoder.estimator.fp32.onnx; see the module docstring."""
    mels = cfg.mel_bins
    g = GraphBuilder("flow_decoder_estimator")
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

    eye = np.eye(mels, dtype=np.float32)
    a = 0.6 * eye + rng.normal(0.0, 0.01, (mels, mels))
    b = 0.4 * eye + rng.normal(0.0, 0.01, (mels, mels))
    target = g.op("Add", [_frame_map(g, "mu", a), _frame_map(g, "cond", b)])
    w_spk = rng.normal(0.0, 0.03, (mels, mels)).astype(np.float32)
    spk = g.op("Unsqueeze", [g.op("MatMul", ["spks", g.const(w_spk)]), g.const([2])])
    n_time = cfg.estimator_time_dim
    freqs = (np.pi * 2.0 ** np.arange(n_time // 2)).astype(np.float32)
    angles = g.op("Mul", [g.op("Unsqueeze", ["t", g.const([1])]), g.const(freqs)])  # [2, n/2]
    t_feat = g.op("Concat", [g.op("Sin", [angles]), g.op("Cos", [angles])], axis=1)
    w_t = rng.normal(0.0, 0.05, (n_time, mels)).astype(np.float32)
    t_term = g.op("Unsqueeze", [g.op("MatMul", [t_feat, g.const(w_t)]), g.const([2])])
    masked = g.op("Mul", ["x", "mask"])
    total = g.op("ReduceSum", [masked, g.const([2])], keepdims=1)  # [2, 80, 1]
    count = g.op("Max", [g.op("ReduceSum", ["mask", g.const([2])], keepdims=1), g.const(1.0)])
    mean = g.op("Div", [total, count])
    w_ctx = rng.normal(0.0, 0.2 / np.sqrt(mels), (mels, mels)).astype(np.float32)
    context = g.op("MatMul", [g.const(w_ctx), mean])
    target = g.op("Add", [g.op("Add", [target, spk]), g.op("Add", [t_term, context])])
    rate = g.op("Sub", [g.const(1.05), g.op("Unsqueeze", ["t", g.const([1, 2])])])
    velocity = g.op("Div", [g.op("Sub", [target, "x"]), rate])
    g.op("Mul", [velocity, "mask"], out="estimator_out")
    g.output("estimator_out", "float32", [2, mels, "seq_len"])
    return g.model()
