"""Dimensions, parameter tables and seeded weights of the synthetic models.

Every size has the architecture of Fun-CosyVoice3-0.5B (the graphs the published files hold,
op for op) with random weights; only widths and depths differ (:data:`SIZES`):

* ``full``: the real widths and depths, for benchmarks on machines without the real files
  (about 4.8 GB, minutes).
* ``full-mini``: every width real, 2 LLM layers, 2 DiT blocks, 1 speech-tokenizer layer.
* ``tiny``: the test model (about 30 MB, seconds): LLM hidden 64, 2 layers, 4 query heads
  over 2 KV heads of 32; DiT width 128, 2 blocks; vocoder channels 32. The interface widths
  the engine does not read from the graphs stay published: 80 mel bins, 192-wide speaker
  embedding, 6761 speech rows, the Qwen2 text vocabulary. Its LLM also ends speech by
  itself (``llm_stop_tokens_per_text_token``, see :mod:`.llm`).

Every graph builder first describes its parameters as a :data:`ParamTable` (name -> shape and
initial distribution) and then emits the graph from exactly those tensors, so
:func:`count_params` of a table is the parameter count of the graph it builds, without building
it. Weights are drawn per parameter from a generator seeded with ``(seed, file, name)``: the
same seed gives byte-identical files, independent of build order.

Sources of the dimensions (FunAudioLLM/CosyVoice at commit ace7c47):
examples/libritts/cosyvoice3/conf/cosyvoice3.yaml (flow, DiT, HiFT sections), Qwen2-0.5B's
config (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, RMSNorm eps 1e-6, RoPE theta
1e6, vocab 151936), cosyvoice/llm/llm.py CosyVoice3LM (speech head 896 -> 6761 without bias,
speech embedding 6761 x 896).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

PUBLISHED_BYTES: dict[str, int] = {
    "llm.onnx.data": 1455799296,
    "flow.decoder.estimator.fp32.onnx": 1326216933,
    "hift.onnx": 83437283,
    "flow_encoder.onnx": 4468501,
    "speech_embedding.onnx": 24231610,
    "text_embedding_fp16.onnx": 272269531,
    "campplus.onnx": 28303423,
    "speech_tokenizer_v3.onnx": 969451503,
}
"""Sizes of the published files (download manifests of Masterx/Fun-CosyVoice3-0.5B-2512-ONNX
and FunAudioLLM/Fun-CosyVoice3-0.5B-2512), for the parameter-count checks."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: ``shape`` drawn as ``mean + std * N(0, 1)`` (float32)."""

    shape: tuple[int, ...]
    std: float
    mean: float = 0.0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


ParamTable = dict[str, ParamSpec]
"""Ordered parameter name -> spec of one graph."""


def count_params(table: Mapping[str, ParamSpec]) -> int:
    """Number of scalar parameters in ``table``."""
    return sum(spec.size for spec in table.values())


def fan_in_std(fan_in: int, gain: float = 1.0) -> float:
    """``gain / sqrt(fan_in)``: keeps activations at unit scale through a random layer."""
    return gain / float(np.sqrt(fan_in))


@dataclass(frozen=True)
class SyntheticConfig:
    """Widths and depths of the synthetic graphs (defaults: the published ``full`` model).

    LLM (Qwen2-0.5B + CosyVoice3LM): ``llm_*``. Flow encoder (flow.py CausalMaskedDiffWithDiT,
    upsample_encoder.py PreLookaheadLayer): ``flow_*``. DiT estimator (flow/DiT/dit.py and
    modules.py): ``dit_*``. Vocoder (hifigan/generator.py CausalHiFTGenerator,
    f0_predictor.py CausalConvRNNF0Predictor): ``hift_*``. Voice-encoder stand-ins:
    ``campplus_*`` and ``tokenizer_*`` (no public architecture for the exported files).
    """

    llm_hidden: int = 896
    llm_layers: int = 24
    llm_heads: int = 14
    llm_kv_heads: int = 2
    llm_head_dim: int = 64
    llm_intermediate: int = 4864
    llm_rms_eps: float = 1e-6
    llm_rope_theta: float = 1.0e6
    llm_init_std: float = 0.02
    """Qwen2 ``initializer_range``."""
    llm_stop_tokens_per_text_token: float | None = None
    """None: random weights throughout, so the LLM never predicts a sensible end of speech (a
    benchmark fixes the decoding length on the host side). A number: a few weights are set so
    that EOS wins once about this many speech tokens per text token are in the context
    (:func:`.llm.stop_counter`), so the engine's own stopping runs."""
    text_rows: int = 151936
    speech_rows: int = 6761
    speech_vocab: int = 6561

    mel_bins: int = 80
    speaker_dim: int = 192
    flow_embed_dim: int = 80
    flow_lookahead_channels: int = 1024
    flow_lookahead_tokens: int = 3
    token_mel_ratio: int = 2

    dit_dim: int = 1024
    dit_depth: int = 22
    dit_heads: int = 16
    dit_head_dim: int = 64
    dit_ff_mult: int = 2
    dit_time_freq_dim: int = 256
    dit_conv_pos_kernel: int = 31
    dit_conv_pos_groups: int = 16
    dit_rope_theta: float = 10000.0
    dit_norm_eps: float = 1e-6
    dit_init_std: float = 0.02

    hift_base_channels: int = 512
    hift_upsample_rates: tuple[int, ...] = (8, 5, 3)
    hift_upsample_kernels: tuple[int, ...] = (16, 11, 7)
    hift_resblock_kernels: tuple[int, ...] = (3, 7, 11)
    hift_resblock_dilations: tuple[int, ...] = (1, 3, 5)
    hift_source_resblock_kernels: tuple[int, ...] = (7, 7, 11)
    hift_n_fft: int = 16
    hift_hop: int = 4
    hift_harmonics: int = 9
    """Fundamental + 8 harmonics (``nb_harmonics: 8``)."""
    hift_conv_pre_look_right: int = 4
    """``conv_pre_look_right: 4`` -> CausalConv1d kernel 5 padded 4 frames on the right."""
    hift_f0_channels: int = 512
    hift_f0_layers: int = 5
    hift_f0_look_right: int = 3
    """f0 predictor's first conv: kernel 4, causal_type right -> 3 frames of right padding."""
    hift_sample_rate_hz: int = 24000
    hift_sine_amp: float = 0.1
    hift_noise_std: float = 0.003
    hift_voiced_threshold_hz: float = 10.0
    hift_f0_bias_hz: float = 150.0
    """Bias of the random f0 classifier so the source is voiced (a trained model predicts f0)."""

    campplus_front_channels: int = 32
    campplus_channels: int = 512
    campplus_layers: int = 8

    tokenizer_mel_bins: int = 128
    tokenizer_width: int = 1280
    tokenizer_layers: int = 12
    tokenizer_heads: int = 20
    tokenizer_ff: int = 5120
    tokenizer_digits: int = 8


SIZES: dict[str, SyntheticConfig] = {
    "full": SyntheticConfig(),
    "full-mini": replace(SyntheticConfig(), llm_layers=2, dit_depth=2, tokenizer_layers=1),
    "tiny": replace(
        SyntheticConfig(),
        llm_hidden=64, llm_layers=2, llm_heads=4, llm_kv_heads=2, llm_head_dim=32,
        llm_intermediate=128, llm_stop_tokens_per_text_token=5.0,
        flow_lookahead_channels=64,
        # std 0.1: at Qwen-like 0.02 the attention of so narrow a DiT is so flat that a frame
        # moves another 59 frames away by 1e-6; at 0.1 by 1e-2 (the full-attention and
        # chunk-causal forms then differ measurably)
        dit_dim=128, dit_depth=2, dit_heads=2, dit_head_dim=64, dit_init_std=0.1,
        hift_base_channels=32, hift_f0_channels=32,
        campplus_front_channels=8, campplus_channels=32, campplus_layers=1,
        tokenizer_width=32, tokenizer_layers=1, tokenizer_heads=2, tokenizer_ff=64,
    ),
}
"""Known sizes (see the module docstring)."""


def get_config(size: str) -> SyntheticConfig:
    """Config of ``size``; ``ValueError`` names the known sizes otherwise."""
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown synthetic size {size!r}; known: {sorted(SIZES)}") from None


class Weights:
    """Seeded float32 tensors of one graph's :data:`ParamTable`, drawn on first use.

    ``take(name)`` returns the tensor and records the name, so a builder can check that it
    used every parameter of its table (:meth:`check_all_used`). ``adjust(name, value)``, when
    given, may change a drawn tensor in place before it is returned (the tiny LLM's stop
    counter, :func:`.llm.stop_counter`).
    """

    def __init__(
        self,
        table: ParamTable,
        seed: int,
        file: str,
        adjust: Callable[[str, np.ndarray], None] | None = None,
    ) -> None:
        self.table = table
        self.seed = seed
        self.file = file
        self.adjust = adjust
        self.used: set[str] = set()

    def take(self, name: str) -> np.ndarray:
        spec = self.table[name]
        key = zlib.crc32(f"{self.file}/{name}".encode())
        rng = np.random.default_rng([self.seed, key])
        value = rng.standard_normal(spec.shape, dtype=np.float32)
        if spec.std != 1.0:
            value *= np.float32(spec.std)
        if spec.mean != 0.0:
            value += np.float32(spec.mean)
        if self.adjust is not None:
            self.adjust(name, value)
        self.used.add(name)
        return value

    def check_all_used(self) -> None:
        """Raise ``RuntimeError`` if a parameter of the table never reached the graph."""
        unused = [name for name in self.table if name not in self.used]
        if unused:
            raise RuntimeError(f"{self.file}: parameters declared but not used: {unused[:5]}")
