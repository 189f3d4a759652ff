"""DiT seconds per streamed chunk: chunk-causal (cached prompt/history) vs full attention.

``python -m bench.flow_chunks --model-dir DIR --cache-dir CACHE
[--prompt-s 5 15] [--gen-tokens 300] [--steps 10] [--precision fp32] [--out flow_chunks.json]``
or ``... --first-audio --clip CLIP [--runs N] [--text TEXT]`` (see :func:`first_audio`).

In process, no LLM: the flow runs upstream's streaming schedule (first hop 25 tokens padded to
the 25-token grid, then 50, 100, 100, ...; 3 lookahead tokens; the last chunk has the rest)
on random speech tokens with a voice prompt of ``--prompt-s`` seconds (random prompt tokens,
prompt mel and embedding: the cost depends only on the lengths). For every non-final chunk it
times

* ``chunk-causal``: :meth:`ChunkedFlow.chunk_mel` (new frames only; the prompt cache is built
  before the first chunk and timed separately as ``prompt_cache_s``), and
* ``full attention``: :meth:`FlowRunner.mel_for_tokens` on prompt ++ every token so far (what
  every streamed chunk costs today),

plus the final chunk (full attention in both, as upstream). It reports the prompt cache and
the history cache sizes. Timings on a shared machine are noisy: both paths run alternately in
the same process.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.flow.solver import FlowCall
from wyoming_cosyvoice3.engine.flow.stream import GRID_TOKENS, prompt_noise
from wyoming_cosyvoice3.engine.options import (
    EngineOptions,
    EulerSchedule,
    FlowPreset,
    VoiceFeatures,
)
from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine

from .recorder import FixedDecoding


def schedule(prompt_tokens: int, gen_tokens: int, max_hop: int = 100) -> list[tuple[int, bool]]:
    """(tokens seen incl. lookahead, final) per flow call (model.py ``CosyVoice2Model.tts``)."""
    pad = -(-prompt_tokens // GRID_TOKENS) * GRID_TOKENS - prompt_tokens
    calls, offset, hop = [], 0, GRID_TOKENS
    while True:
        this = hop + pad if offset == 0 else hop
        if gen_tokens - offset < this + C.PRE_LOOKAHEAD_TOKENS:
            break
        calls.append((offset + this + C.PRE_LOOKAHEAD_TOKENS, False))
        offset += this
        hop = min(max_hop, hop * 2)
    calls.append((gen_tokens, True))
    return calls


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = CosyVoice3Engine.load(Path(args.model_dir),
                                   EngineOptions(cache_dir=Path(args.cache_dir),
                                                 flow=FlowPreset(precision=args.precision)))
    chunked = engine.chunked.get(args.precision)
    if chunked is None:
        raise SystemExit("the streaming estimator is not available for this model")
    rng = np.random.default_rng(0)
    euler = EulerSchedule(args.steps, C.DEFAULT_CFG_RATE)
    full_call = FlowCall(euler, args.precision)
    results: dict[str, Any] = {"steps": args.steps, "precision": args.precision, "runs": []}
    for prompt_s in args.prompt_s:
        p_tokens = round(prompt_s * C.SPEECH_TOKEN_RATE_HZ)
        voice = VoiceFeatures(
            speech_tokens=rng.integers(0, C.SPEECH_TOKEN_VOCAB, p_tokens).astype(np.int64),
            speaker_embedding=rng.standard_normal(192).astype(np.float32),
            prompt_mel=rng.standard_normal((2 * p_tokens, 80)).astype(np.float32),
        )
        gen = rng.integers(0, C.SPEECH_TOKEN_VOCAB, args.gen_tokens).astype(np.int64)
        noise = prompt_noise(2 * (p_tokens + args.gen_tokens) + 100)
        started = time.perf_counter()
        prompt = chunked.prompt_cache(voice, euler)
        prompt_cache_s = time.perf_counter() - started
        history = chunked.new_history(euler)
        rows = []
        done = 0
        for n_tokens, final in schedule(p_tokens, args.gen_tokens):
            tokens = np.concatenate([voice.speech_tokens, gen[:n_tokens]])
            drop = 0 if final else C.TOKEN_MEL_RATIO * C.PRE_LOOKAHEAD_TOKENS
            t0 = time.perf_counter()
            full = engine.flow.mel_for_tokens(tokens, voice, noise, full_call, drop)
            full_s = time.perf_counter() - t0
            new_frames = full.shape[1] - done
            causal_s = None
            if not final:
                t0 = time.perf_counter()
                mel = chunked.chunk_mel(tokens, voice, noise, history, FlowCall(euler),
                                        drop)
                causal_s = time.perf_counter() - t0
                assert mel.shape[1] == new_frames
            rows.append({"tokens": n_tokens, "final": final, "new_frames": new_frames,
                         "frames_full": int(2 * p_tokens + full.shape[1]),
                         "full_attention_s": round(full_s, 3),
                         "chunk_causal_s": None if causal_s is None else round(causal_s, 3),
                         "history_mb": round(history.nbytes / 1e6, 1)})
            done = full.shape[1]
            print(prompt_s, rows[-1], flush=True)
        results["runs"].append({
            "prompt_s": prompt_s, "prompt_tokens": p_tokens,
            "prompt_cache_frames": prompt.frames, "prompt_cache_s": round(prompt_cache_s, 2),
            "prompt_cache_mb": round(prompt.nbytes / 1e6, 1), "chunks": rows,
        })
    results["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    return results


SENTENCE = "The living room lights are on and the front door is locked now."
"""A 60-character sentence (the benchmark's first-audio workload)."""
TOKENS_PER_CHAR = 25.0 / 15.0
"""Speech tokens decoded per character (the benchmark's fixed decoding length)."""


def first_audio(args: argparse.Namespace) -> dict[str, Any]:
    """First-audio latency and RTF of the ``quality`` preset streamed, chunk-causal (new)
    against full attention with main's schedule (first hop 25 unpadded: the code path of
    main before this change), alternating, ``--runs`` times each, in one process."""
    from wyoming_cosyvoice3.engine.options import PRESETS

    engine = CosyVoice3Engine.load(Path(args.model_dir), EngineOptions(
        cache_dir=Path(args.cache_dir), load_voice_encoders=True,
        observer=FixedDecoding(TOKENS_PER_CHAR)))
    voice = engine.prepare_voice(Path(args.clip), name="bench")
    new = PRESETS["quality"]
    old = new.replace(flow={"chunk_causal": False, "first_hop_on_chunk_grid": False})
    for _ in engine.synthesize("Hello.", voice, new):  # warm-up: derivation, prompt cache
        pass
    rows: dict[str, list[dict[str, float]]] = {"chunk_causal": [], "full_attention": []}
    for _ in range(args.runs):
        for label, options in (("chunk_causal", new), ("full_attention", old)):
            started = time.perf_counter()
            first = None
            audio = 0
            for chunk in engine.synthesize(args.text, voice, options):
                if first is None and len(chunk.samples):
                    first = time.perf_counter() - started
                audio += len(chunk.samples)
            total = time.perf_counter() - started
            rows[label].append({"first_audio_s": round(first or total, 2),
                                "total_s": round(total, 2),
                                "rtf": round(total / (audio / C.OUTPUT_SAMPLE_RATE_HZ), 2)})
            print(label, rows[label][-1], flush=True)
    return {"text": args.text, "clip": Path(args.clip).name, "runs": rows,
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--prompt-s", type=float, nargs="+", default=[5.0, 15.0])
    parser.add_argument("--gen-tokens", type=int, default=300)
    parser.add_argument("--steps", type=int, default=C.DEFAULT_EULER_STEPS)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "int8"])
    parser.add_argument("--out", default="flow_chunks.json")
    parser.add_argument("--first-audio", action="store_true",
                        help="measure quality first audio / RTF instead (needs --clip)")
    parser.add_argument("--clip", help="voice clip for --first-audio")
    parser.add_argument("--text", default=SENTENCE)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    results = first_audio(args) if args.first_audio else run(args)
    Path(args.out).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
