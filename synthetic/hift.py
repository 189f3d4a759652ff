"""Synthetic hift.onnx: CausalHiFTGenerator (channel counts below are the ``full`` size's).

Contract (model card): speech_feat float32 [1,80,F], noise
float32 [1,480F,9] uniform [0,1) -> magnitude, phase float32 [1,9,120F+1].

Architecture (cosyvoice/hifigan/generator.py CausalHiFTGenerator, SineGen2 and
SourceModuleHnNSF with ``causal=True``; hifigan/f0_predictor.py CausalConvRNNF0Predictor;
transformer/convolution.py CausalConv1d, CausalConv1dUpsample, CausalConv1dDownSample;
cosyvoice3.yaml ``hift``), weight norm folded away as in an export:

* f0 predictor: conv 80 -> 512 (kernel 4, 3 frames of right padding), ELU, 4 x (causal conv
  512 -> 512 kernel 3, ELU), Linear 512 -> 1, abs: f0 in Hz per mel frame.
* source (SineGen2, causal): per frame ``rad = (f0 h / 24000) mod 1`` for harmonics
  h = 1..9, phase = 2 pi 480 cumsum(rad) over frames, held for the frame's 480 samples
  (upstream's nearest upsampling); sines 0.1 sin(phase) where f0 > 10 Hz, plus
  ``noise * (0.003 voiced | 0.1/3 unvoiced)`` with ``noise`` the graph input (upstream's
  fixed ``sine_waves`` buffer); Linear 9 -> 1 and tanh; STFT (n_fft 16, hop 4, periodic Hann,
  centred with reflect padding) -> 18 channels (9 real, 9 imaginary) x (120F+1) frames.
* decoder: conv_pre 80 -> 512 (kernel 5, 4 frames of right padding); three stages of
  LeakyReLU(0.1), nearest upsampling x8, x5, x3 and a causal conv (kernels 16, 11, 7;
  512 -> 256 -> 128 -> 64); after the last stage a one-sample reflection pad on the left; each
  stage adds the source branch (causal strided conv of the 18 STFT channels: kernel 30 stride
  15, kernel 6 stride 3, kernel 1; then a causal ResBlock with kernels 7, 7, 11) and averages
  three causal ResBlocks (kernels 3, 7, 11; dilations 1, 3, 5; Snake activations);
  LeakyReLU(0.01); causal conv_post 64 -> 18 (kernel 7); magnitude = exp(first 9),
  phase = sin(last 9).

Right context: output frames of mel frame m depend on mel frames up to m + 4 (conv_pre) and,
through f0 and the source STFT, up to m + 1 + 3; in samples, everything before
480 (M - 5) is final once M mel frames are known, so the host's rule (emit up to
480 (M - 8) until the final chunk) never emits a sample that later changes.

Random weights: convs are drawn with std 1/sqrt(fan in) (conv_post 0.1/sqrt(fan in), so the
log-magnitude stays near 0), Snake alphas around 1, and the f0 classifier has a bias of
150 Hz so the source is voiced. 20.77 M parameters (83.1 MB fp32; published file 83.4 MB).
"""

from __future__ import annotations

import numpy as np
import onnx

from .config import ParamSpec, ParamTable, SyntheticConfig, Weights
from .nn import Net, conv_params, linear_params
from .onnx_builder import GraphBuilder

HIFT_FILE = "hift.onnx"
SAMPLES_PER_FRAME = 480
"""24 kHz samples per mel frame = prod(upsample_rates) * hop = 8 * 5 * 3 * 4."""


def _resblock_params(
    table: ParamTable, prefix: str, channels: int, kernel: int, dilations: tuple[int, ...]
) -> None:
    for j, _ in enumerate(dilations):
        for convs, acts in (("convs1", "activations1"), ("convs2", "activations2")):
            conv_params(table, f"{prefix}.{convs}.{j}", channels, channels, kernel)
            table[f"{prefix}.{acts}.{j}.alpha"] = ParamSpec((channels,), 0.1, 1.0)


def stage_channels(cfg: SyntheticConfig) -> list[int]:
    """Output channels of the upsampling stages: 256, 128, 64."""
    return [cfg.hift_base_channels // 2 ** (i + 1) for i in range(len(cfg.hift_upsample_rates))]


def source_down_strides(cfg: SyntheticConfig) -> list[int]:
    """Stride of the source branch per stage: 15, 3, 1 (cumulative rates, reversed)."""
    rates = [1, *list(cfg.hift_upsample_rates[::-1][:-1])]
    return [int(x) for x in np.cumprod(rates)[::-1]]


def hift_params(cfg: SyntheticConfig) -> ParamTable:
    """Parameters of hift.onnx (module names as upstream)."""
    table: ParamTable = {}
    mels, f0_ch = cfg.mel_bins, cfg.hift_f0_channels
    conv_params(table, "f0_predictor.condnet.0", f0_ch, mels, cfg.hift_f0_look_right + 1)
    for layer in range(1, cfg.hift_f0_layers):
        conv_params(table, f"f0_predictor.condnet.{2 * layer}", f0_ch, f0_ch, 3)
    table["f0_predictor.classifier.weight"] = ParamSpec((f0_ch, 1), 0.02)
    table["f0_predictor.classifier.bias"] = ParamSpec((1,), 0.0, cfg.hift_f0_bias_hz)
    linear_params(table, "m_source.l_linear", cfg.hift_harmonics, 1, None)
    conv_params(table, "conv_pre", cfg.hift_base_channels, mels, cfg.hift_conv_pre_look_right + 1)
    stft_channels = cfg.hift_n_fft + 2
    channels_in = cfg.hift_base_channels
    dilations = cfg.hift_resblock_dilations
    for i, (ch, kernel) in enumerate(
        zip(stage_channels(cfg), cfg.hift_upsample_kernels, strict=True)
    ):
        conv_params(table, f"ups.{i}", ch, channels_in, kernel)
        stride = source_down_strides(cfg)[i]
        conv_params(table, f"source_downs.{i}", ch, stft_channels, 1 if stride == 1 else 2 * stride)
        _resblock_params(
            table, f"source_resblocks.{i}", ch, cfg.hift_source_resblock_kernels[i], dilations
        )
        for j, rk in enumerate(cfg.hift_resblock_kernels):
            _resblock_params(
                table, f"resblocks.{i * len(cfg.hift_resblock_kernels) + j}", ch, rk, dilations
            )
        channels_in = ch
    conv_params(table, "conv_post", stft_channels, channels_in, 7, gain=0.1)
    return table


def _resblock(net: Net, x: str, prefix: str, kernel: int, dilations: tuple[int, ...]) -> str:
    """Causal ResBlock: per dilation, Snake -> dilated conv -> Snake -> conv, residual."""
    for j, d in enumerate(dilations):
        xt = net.snake(x, f"{prefix}.activations1.{j}.alpha")
        xt = net.conv1d(xt, f"{prefix}.convs1.{j}", pads=((kernel - 1) * d, 0), dilation=d)
        xt = net.snake(xt, f"{prefix}.activations2.{j}.alpha")
        xt = net.conv1d(xt, f"{prefix}.convs2.{j}", pads=(kernel - 1, 0))
        x = net.g.op("Add", [xt, x])
    return x


def _upsample_nearest(g: GraphBuilder, x: str, factor: int) -> str:
    """[1, C, T] -> [1, C, T * factor], each step repeated ``factor`` times."""
    tiled = g.op("Tile", [g.op("Unsqueeze", [x, g.const([3])]), g.const([1, 1, 1, factor])])
    return g.op("Reshape", [tiled, g.const([0, 0, -1])])


def _f0(net: Net, cfg: SyntheticConfig) -> str:
    """f0 in Hz per mel frame, [1, F, 1] (CausalConvRNNF0Predictor, finalize form)."""
    g = net.g
    h = net.conv1d("speech_feat", "f0_predictor.condnet.0", pads=(0, cfg.hift_f0_look_right))
    h = g.op("Elu", [h])
    for layer in range(1, cfg.hift_f0_layers):
        h = g.op("Elu", [net.conv1d(h, f"f0_predictor.condnet.{2 * layer}", pads=(2, 0))])
    frames = g.op("Transpose", [h], perm=[0, 2, 1])  # [1, F, C]
    return g.op("Abs", [net.linear(frames, "f0_predictor.classifier")])


def _stft_kernel(n_fft: int) -> np.ndarray:
    """Conv kernel [n_fft + 2, 1, n_fft]: windowed cos rows then -sin rows (torch.stft)."""
    n = np.arange(n_fft)
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / n_fft)  # periodic Hann
    k = np.arange(n_fft // 2 + 1)[:, None]
    angle = 2.0 * np.pi * k * n[None, :] / n_fft
    rows = np.concatenate([window * np.cos(angle), -window * np.sin(angle)], axis=0)
    return rows[:, None, :].astype(np.float32)


def _source_stft(net: Net, cfg: SyntheticConfig, f0: str) -> str:
    """STFT of the harmonic source, [1, n_fft + 2, 120F + 1]."""
    g = net.g
    harmonics = np.arange(1, cfg.hift_harmonics + 1, dtype=np.float32)
    rad = g.op(
        "Mod",
        [g.scale(g.op("Mul", [f0, g.const(harmonics)]), 1.0 / cfg.hift_sample_rate_hz),
         g.const(1.0)],
        fmod=1,
    )  # fmt: skip
    phase = g.op("CumSum", [rad, g.const(np.asarray(1, np.int64))])  # [1, F, 9]
    sines = g.op("Sin", [g.scale(phase, 2.0 * np.pi * SAMPLES_PER_FRAME)])
    uv = g.op("Cast", [g.op("Greater", [f0, g.const(cfg.hift_voiced_threshold_hz)])], to=1)

    def per_sample(x: str, width: int) -> str:  # [1, F, w] -> [1, 480F, w]
        tiled = g.op(
            "Tile", [g.op("Unsqueeze", [x, g.const([2])]), g.const([1, 1, SAMPLES_PER_FRAME, 1])]
        )
        return g.op("Reshape", [tiled, g.const([1, -1, width])])

    sines_s = per_sample(g.scale(sines, cfg.hift_sine_amp), cfg.hift_harmonics)
    uv_s = per_sample(uv, 1)
    unvoiced = g.op("Sub", [g.const(1.0), uv_s])
    noise_amp = g.op(
        "Add",
        [g.scale(uv_s, cfg.hift_noise_std), g.scale(unvoiced, cfg.hift_sine_amp / 3.0)],
    )
    waves = g.op("Add", [g.op("Mul", [sines_s, uv_s]), g.op("Mul", ["noise", noise_amp])])
    source = g.op("Tanh", [net.linear(waves, "m_source.l_linear")])  # [1, 480F, 1]
    source = g.op("Transpose", [source], perm=[0, 2, 1])  # [1, 1, 480F]
    half = cfg.hift_n_fft // 2
    padded = g.op("Pad", [source, g.const([0, 0, half, 0, 0, half])], mode="reflect")
    kernel = g.const(_stft_kernel(cfg.hift_n_fft))
    return g.op("Conv", [padded, kernel], kernel_shape=[cfg.hift_n_fft], strides=[cfg.hift_hop])


def build_hift(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """hift.onnx; see the module docstring."""
    g = GraphBuilder("hift_causal")
    g.input("speech_feat", "float32", [1, cfg.mel_bins, "num_frames"])
    g.input("noise", "float32", [1, "num_samples", cfg.hift_harmonics])
    net = Net(g, Weights(hift_params(cfg), seed, HIFT_FILE))
    s_stft = _source_stft(net, cfg, _f0(net, cfg))

    x = net.conv1d("speech_feat", "conv_pre", pads=(0, cfg.hift_conv_pre_look_right))
    n_kernels = len(cfg.hift_resblock_kernels)
    dilations = cfg.hift_resblock_dilations
    strides = source_down_strides(cfg)
    n_stages = len(cfg.hift_upsample_rates)
    for i, (rate, kernel) in enumerate(
        zip(cfg.hift_upsample_rates, cfg.hift_upsample_kernels, strict=True)
    ):
        x = g.op("LeakyRelu", [x], alpha=0.1)
        x = net.conv1d(_upsample_nearest(g, x, rate), f"ups.{i}", pads=(kernel - 1, 0))
        if i == n_stages - 1:
            x = g.op("Pad", [x, g.const([0, 0, 1, 0, 0, 0])], mode="reflect")
        stride = strides[i]
        if stride == 1:
            si = net.conv1d(s_stft, f"source_downs.{i}")
        else:
            si = net.conv1d(s_stft, f"source_downs.{i}", pads=(stride - 1, 0), stride=stride)
        source_kernel = cfg.hift_source_resblock_kernels[i]
        si = _resblock(net, si, f"source_resblocks.{i}", source_kernel, dilations)
        x = g.op("Add", [x, si])
        outs = [
            _resblock(net, x, f"resblocks.{i * n_kernels + j}", rk, dilations)
            for j, rk in enumerate(cfg.hift_resblock_kernels)
        ]
        x = g.scale(g.op("Sum", outs), 1.0 / n_kernels)
    x = g.op("LeakyRelu", [x], alpha=0.01)
    x = net.conv1d(x, "conv_post", pads=(6, 0))  # [1, n_fft + 2, 120F + 1]
    bins = cfg.hift_n_fft // 2 + 1
    log_mag = g.op("Slice", [x, g.const([0]), g.const([bins]), g.const([1])])
    g.op("Exp", [log_mag], out="magnitude")
    phase = g.op("Slice", [x, g.const([bins]), g.const([2 * bins]), g.const([1])])
    g.op("Sin", [phase], out="phase")
    g.output("magnitude", "float32", [1, bins, "num_stft_frames"])
    g.output("phase", "float32", [1, bins, "num_stft_frames"])
    net.w.check_all_used()
    return g.model()
