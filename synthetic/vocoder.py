"""Synthetic hift.onnx: mel -> iSTFT magnitude and phase with CausalHiFTGenerator's context.

Contract (model card): speech_feat float32 [1,80,F], noise float32 [1,480F,9] uniform [0,1)
-> magnitude, phase float32 [1,9,120F+1] (n_fft 16, hop 4: 480 / 4 = 120 STFT frames per mel
frame, plus one from the centred STFT).

Context (upstream hifigan/generator.py CausalHiFTGenerator: conv_pre looks 3 mel frames
ahead; the rest of the stack adds a further right context of 4 frames):

* ``conv_pre``: kernel 6, zero padding (2 left, 3 right) -> frame m sees mel m-2..m+3;
* a second conv: kernel 7, padding (2, 4) -> frame m sees mel m-4..m+7 in total;
* each mel frame becomes 120 STFT frames (plus a learned within-frame pattern); the extra
  last frame (index 120F) repeats frame 120F-1;
* the noise is folded in per STFT frame: frame j reads noise samples 4j..4j+3.

So STFT frames of mel frame m depend on mel frames up to m+7 only. With the iSTFT (window 16,
hop 4, centre) output sample s depends on STFT frames up to (s+8)/4, hence samples before
480*(M-8) depend on mel frames < M only: the host's streaming rule "emit up to 480*(M-8)
until the final chunk" (constants.VOCODER_RIGHT_CONTEXT_FRAMES) never emits a sample that
changes when more mel arrives.

magnitude = exp(1.2 tanh(.) - 1.8), in [0.05, 0.55] (the host clips at 100 anyway);
phase = pi tanh(.) in (-pi, pi).
"""

from __future__ import annotations

import numpy as np
import onnx

from wyoming_cosyvoice3.engine import constants as C

from .config import SyntheticConfig
from .onnx_builder import GraphBuilder

CONV_PRE_PADS = (2, C.PRE_LOOKAHEAD_TOKENS)
"""Zero padding of the first conv: 3 frames of lookahead as upstream conv_pre."""
SECOND_CONV_PADS = (2, 4)
"""Padding of the second conv: the further 4 frames of right context."""
STFT_FRAMES_PER_MEL = C.SAMPLES_PER_MEL_FRAME // C.ISTFT_HOP
"""120 STFT frames per 480-sample mel frame."""


def hift_right_context_frames() -> int:
    """Mel frames of right context of the synthetic hift graph (3 + 4 = 7)."""
    return CONV_PRE_PADS[1] + SECOND_CONV_PADS[1]


def build_hift(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """hift.onnx; see the module docstring."""
    mels, ch, bins = cfg.mel_bins, cfg.hift_channels, C.HARMONIC_CHANNELS
    per_mel = STFT_FRAMES_PER_MEL
    g = GraphBuilder("hift")
    g.input("speech_feat", "float32", [1, mels, "num_frames"])
    g.input("noise", "float32", [1, "num_samples", bins])

    # log-mel values are roughly -11..2: centre them before the convs
    x = g.shift("speech_feat", 5.0)
    k1 = sum(CONV_PRE_PADS) + 1
    w1 = rng.normal(0.0, 1.0 / np.sqrt(mels * k1), (ch, mels, k1))
    h = g.op("LeakyRelu", [g.conv1d(x, w1, np.zeros(ch), CONV_PRE_PADS)], alpha=0.1)
    k2 = sum(SECOND_CONV_PADS) + 1
    w2 = rng.normal(0.0, 1.0 / np.sqrt(ch * k2), (ch, ch, k2))
    h = g.op("LeakyRelu", [g.conv1d(h, w2, np.zeros(ch), SECOND_CONV_PADS)], alpha=0.1)

    tiled = g.op("Tile", [g.op("Unsqueeze", [h, g.const([3])]), g.const([1, 1, 1, per_mel])])
    pattern = rng.normal(0.0, 0.5, (1, ch, 1, per_mel)).astype(np.float32)
    tiled = g.op("Add", [tiled, g.const(pattern)])
    frames = g.op("Reshape", [tiled, g.const([0, 0, -1])])  # [1, ch, 120F]

    per_frame_noise = g.op("Reshape", ["noise", g.const([1, -1, C.ISTFT_HOP * bins])])
    w_noise = rng.normal(0.0, 0.3, (C.ISTFT_HOP * bins, ch)).astype(np.float32)
    noise_feat = g.op(
        "Transpose", [g.matmul(g.shift(per_frame_noise, -0.5), w_noise)], perm=[0, 2, 1]
    )
    frames = g.op("Add", [frames, noise_feat])
    frames = g.op("Pad", [frames, g.const([0, 0, 0, 0, 0, 1])], mode="edge")  # [1, ch, 120F+1]

    w_mag = rng.normal(0.0, 1.0 / np.sqrt(ch), (bins, ch, 1))
    log_mag = g.op("Tanh", [g.conv1d(frames, w_mag, rng.normal(0.0, 0.2, bins), (0, 0))])
    g.op("Exp", [g.shift(g.scale(log_mag, 1.2), -1.8)], out="magnitude")
    w_ph = rng.normal(0.0, 1.0 / np.sqrt(ch), (bins, ch, 1))
    phase = g.op("Tanh", [g.conv1d(frames, w_ph, None, (0, 0))])
    g.op("Mul", [phase, g.const(float(np.pi))], out="phase")
    g.output("magnitude", "float32", [1, bins, "num_stft_frames"])
    g.output("phase", "float32", [1, bins, "num_stft_frames"])
    return g.model()
