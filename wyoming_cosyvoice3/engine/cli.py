"""``cosyvoice3-synth``: synthesise one text to a WAV file without the Wyoming server.

Example::

    cosyvoice3-synth --model-dir ./model --clip ref.wav --transcript "What the clip says." \\
        --text "Hello from CosyVoice." --out hello.wav

Writes 24 kHz mono PCM16 and prints first-chunk latency, audio length, RTF and per-stage times.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from . import constants as C
from .errors import CosyVoiceError
from .options import LLM_FILES, PRESETS, EngineOptions, SynthesisOptions, SynthesisResult

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cosyvoice3-synth``."""
    p = argparse.ArgumentParser(
        prog="cosyvoice3-synth",
        description="Synthesise text with Fun-CosyVoice3-0.5B (ONNX) into a 24 kHz WAV file.",
    )
    p.add_argument("--model-dir", type=Path, required=True, help="directory of the ONNX model")
    p.add_argument("--clip", type=Path, required=True, help="reference clip of the voice (>= 1 s)")
    p.add_argument("--transcript", help="what the clip says (zero-shot mode)")
    p.add_argument("--instruction", help="style instruction (instruct mode)")
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--out", type=Path, required=True, help="output WAV path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="balanced")
    p.add_argument("--speed", type=float, help="speaking rate 0.5..2.0 (default 1.0)")
    p.add_argument("--seed", type=int, help="random seed (default 0)")
    p.add_argument("--llm-precision", choices=sorted(LLM_FILES), default="int8")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0 = auto)")
    p.add_argument("--no-streaming", action="store_true", help="one flow/vocoder pass per piece")
    p.add_argument("--voice-cache-dir", type=Path, help="cache voice features here")
    p.add_argument("--cache-dir", type=Path,
                   help="derived files (int8 DiT, split estimator, text table) and failure "
                   "markers; default ~/.cache/wyoming-cosyvoice3/engine-cache (never the model "
                   "directory)")
    p.add_argument("--debug", action="store_true", help="log per-stage details")
    return p


DEFAULT_CACHE_DIR = Path.home() / ".cache" / "wyoming-cosyvoice3" / "engine-cache"
"""Where ``cosyvoice3-synth`` keeps derived files unless ``--cache-dir`` says otherwise."""


def _options(args: argparse.Namespace) -> SynthesisOptions:
    changes: dict[str, object] = {}
    if args.speed is not None:
        changes["speed"] = args.speed
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.no_streaming:
        changes["streaming"] = False
    return PRESETS[args.preset].replace(**changes)


def _report(result: SynthesisResult, out: Path) -> str:
    t = result.times
    first = "n/a" if result.first_chunk_s is None else f"{result.first_chunk_s * 1e3:.0f} ms"
    ms_per_token = t.llm_decode_s * 1e3 / t.llm_tokens if t.llm_tokens else 0.0
    lines = [
        f"wrote {out} ({result.audio_s:.2f} s of audio, {result.pieces} piece(s))",
        f"first chunk: {first}",
        f"total: {result.total_s:.2f} s, RTF {result.rtf:.3f}",
        f"frontend: {t.frontend_s * 1e3:.1f} ms",
        f"LLM prefill: {t.llm_prefill_s * 1e3:.1f} ms",
        f"LLM decode: {t.llm_tokens} tokens in {t.llm_decode_s:.3f} s "
        f"({ms_per_token:.2f} ms/token)",
        f"flow: {t.flow_calls} call(s) in {t.flow_s:.3f} s",
        f"vocoder: {t.vocoder_calls} call(s) in {t.vocoder_s:.3f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the process exit code (0 ok, 1 engine error, 2 bad options)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # imported here so --help works without onnxruntime and the model stack
    from .pipeline import CosyVoice3Engine

    try:
        options = _options(args)
        options.validate()
        engine_options = EngineOptions(
            llm_precision=args.llm_precision,
            threads=args.threads,
            voice_cache_dir=args.voice_cache_dir,
            cache_dir=args.cache_dir or DEFAULT_CACHE_DIR,
            flow=options.flow,  # its DiT (and streaming DiT) are opened at start
            read_numbers=options.read_numbers,
        )
        engine_options.validate()
    except ValueError as exc:
        print(f"cosyvoice3-synth: {exc}", file=sys.stderr)
        return 2
    try:
        engine = CosyVoice3Engine.load(args.model_dir, engine_options)
        voice = engine.prepare_voice(args.clip, args.transcript, args.instruction, name="cli")
        result = SynthesisResult()
        chunks = [
            np.asarray(chunk.samples, dtype=np.float32)
            for chunk in engine.synthesize(args.text, voice, options, result=result)
        ]
    except CosyVoiceError as exc:
        print(f"cosyvoice3-synth: {exc}", file=sys.stderr)
        return 1
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(args.out), audio, C.OUTPUT_SAMPLE_RATE_HZ, subtype="PCM_16")
    if not chunks:
        print("nothing speakable in the text; wrote an empty WAV", file=sys.stderr)
    print(_report(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
