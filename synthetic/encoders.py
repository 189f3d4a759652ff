"""Synthetic voice encoders: campplus.onnx and speech_tokenizer_v3.onnx.

Upstream cosyvoice/cli/frontend.py feeds both graphs by position
(``session.get_inputs()[0].name``), so their names are not part of any contract. The names
used here are those that public C++ hosts of CosyVoice pass by name to the upstream files
(RWKV mobile runtime, cosyvoice frontend: campplus ``input`` -> ``output``; speech tokenizer
``feats`` + ``feats_length`` -> ``indices``). The graph wrappers of the engine check only
the input count and dtypes of these two graphs (see graphs.py), so a renamed upstream release
still loads.

campplus: Kaldi fbank float32 [1,T,80] (mean-normalised) -> float32 [1,192]: per-bin mean and
standard deviation over time, an affine map and tanh, scaled to a norm of about 10.

speech_tokenizer_v3: Whisper log-mel float32 [1,128,T], length int32 [1] -> int32 [1,ceil(L/4)]
with L the length: 4x average pooling over time (100 Hz mel -> 25 Hz tokens, as the two
stride-2 convs of the real encoder), a projection to 8 FSQ digits rounded to {-1,0,1}, and
the token id ``sum((d_i + 1) * 3**i)`` in 0..6560 (the 3**8 = 6561 FSQ codebook of
llm.py CosyVoice3LM). The output dtype of the real graph is not documented (public hosts read
int32 or int64); the engine casts to int64.
"""

from __future__ import annotations

import numpy as np
import onnx

from wyoming_cosyvoice3.engine import constants as C

from .config import SyntheticConfig
from .onnx_builder import GraphBuilder

WHISPER_MEL_BINS = 128
"""Mel bins of the speech tokenizer's input (frontend.py _extract_speech_token, n_mels 128)."""
TOKEN_POOL_FRAMES = 4
"""100 Hz mel frames per 25 Hz speech token."""


def build_campplus(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """campplus.onnx; see the module docstring."""
    bins, dim = 80, cfg.speaker_dim
    g = GraphBuilder("campplus")
    g.input("input", "float32", [1, "num_frames", bins])
    mean = g.op("ReduceMean", ["input", g.const([1])], keepdims=0)  # [1, 80]
    centred = g.op("Sub", ["input", g.op("Unsqueeze", [mean, g.const([1])])])
    var = g.op("ReduceMean", [g.op("Mul", [centred, centred]), g.const([1])], keepdims=0)
    std = g.op("Sqrt", [g.shift(var, 1e-6)])
    stats = g.op("Concat", [mean, std], axis=1)  # [1, 160]
    weight = rng.normal(0.0, 1.0 / np.sqrt(2 * bins), (2 * bins, dim)).astype(np.float32)
    z = g.op("Tanh", [g.matmul(stats, weight, rng.normal(0.0, 0.5, dim).astype(np.float32))])
    g.op("Mul", [z, g.const(10.0 / np.sqrt(dim / 2.0))], out="output")
    g.output("output", "float32", [1, dim])
    return g.model()


def build_speech_tokenizer(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """speech_tokenizer_v3.onnx; see the module docstring."""
    digits = cfg.tokenizer_codes
    if 3**digits != C.SPEECH_TOKEN_VOCAB:
        raise ValueError("tokenizer_codes must give 3**n == 6561 codes")
    g = GraphBuilder("speech_tokenizer_v3")
    g.input("feats", "float32", [1, WHISPER_MEL_BINS, "num_frames"])
    g.input("feats_length", "int32", [1])
    pooled = g.op(
        "AveragePool",
        ["feats"],
        kernel_shape=[TOKEN_POOL_FRAMES],
        strides=[TOKEN_POOL_FRAMES],
        ceil_mode=1,
    )  # [1, 128, ceil(T/4)]
    w = rng.normal(0.0, 3.0 / np.sqrt(WHISPER_MEL_BINS), (digits, WHISPER_MEL_BINS, 1))
    proj = g.conv1d(pooled, w, rng.normal(0.0, 0.5, digits), pads=(0, 0))  # [1, 8, N]
    level = g.op("Clip", [g.op("Round", [proj]), g.const(-1.0), g.const(1.0)])
    powers = (3.0 ** np.arange(digits)).astype(np.float32).reshape(1, digits)
    code = g.op("MatMul", [g.const(powers), g.shift(level, 1.0)])  # [1, 1, N]... per batch
    code = g.op("Reshape", [code, g.const([1, -1])])
    code = g.op("Cast", [code], to=onnx.TensorProto.INT32)
    n_tokens = g.op(
        "Cast",
        [g.op("Div", [g.op("Add", ["feats_length", g.const(np.asarray([3], np.int32))]),
                      g.const(np.asarray([4], np.int32))])],
        to=onnx.TensorProto.INT64,
    )  # fmt: skip
    g.op("Slice", [code, g.const([0]), n_tokens, g.const([1])], out="indices")
    g.output("indices", "int32", [1, "num_tokens"])
    return g.model()
