"""Measure the engine's performance levers one by one, in process, on a (full-size) model.

``python -m bench.levers --model-dir DIR [--clip CLIP] [--out levers.json]
[--only NAMES]``

For every lever (a :class:`SynthesisOptions` change on top of the spec-exact ``quality``
preset, or a whole preset) this reports:

* time: first-chunk latency of a 60-character sentence and wall time / RTF of a longer text
  (LLM decoding fixed to 25 tokens per 15 characters, as the benchmark does: random weights
  never stop sensibly);
* deviation from the spec-exact path on the same weights and the same speech tokens: mel SNR
  and waveform SNR in dB (``10 log10(sum ref^2 / sum (ref - x)^2)``), the tokens being
  replayed so that only the flow/vocoder side differs; plus the SNR of the log-mel of the two
  waveforms (``dsp.prompt_mel``), which ignores the phase of the vocoder's harmonic source
  (any mel change shifts its f0 and with it the phase of every later sample, so sample SNR
  falls even for inaudible changes);
* peak RSS of the process (``ru_maxrss``; run one lever per process with ``--only`` for
  per-lever memory figures).

``--set levers`` (default) applies each lever alone to the spec-exact preset; ``--set
ablations`` starts from the default preset and reverts one lever at a time (for timing). The
server-driven benchmark (``benchmarks/run.py``) measures the presets end to end; this script
isolates each lever. Results go to ``--out`` as JSON and to stdout as a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions, SynthesisOptions
from wyoming_cosyvoice3.engine.options import PRESETS, SynthesisResult, VoicePrompt
from wyoming_cosyvoice3.engine.vocoder.hift import VocoderStream
from wyoming_cosyvoice3.engine.voice.features import prompt_mel

from .recorder import FixedDecoding

SENTENCE = "The kitchen lights are on and the front door is locked now."  # 60 characters
PARAGRAPH = (
    "Good evening. The living room lights are on and the kitchen is at twenty one degrees. "
    "The front door has been locked for the night, and the garden sprinklers will run until "
    "six in the morning. Tomorrow will be cloudy with a chance of rain in the afternoon. "
    "The washing machine finished its cycle an hour ago, and the dishwasher is still running. "
    "Your next calendar event is a dentist appointment at nine thirty."
)
"""About 27 s of speech at the fixed decoding rate."""
TOKENS_PER_CHAR = 25.0 / 15.0
"""25 speech tokens per 15 characters: one second of speech per 15 characters."""
TRANSCRIPT = "This is the reference voice speaking for about five seconds."

QUALITY = PRESETS["quality"]


def lever(base: SynthesisOptions, vocoder_window_frames: int | None = None,
          **flow: Any) -> SynthesisOptions:
    """``base`` with fields of its flow record changed (``schedule`` by a mapping of its
    fields), and the vocoder window when given."""
    changed = base.replace(flow=flow)
    if vocoder_window_frames is not None:
        changed = changed.replace(vocoder_window_frames=vocoder_window_frames)
    return changed


LEVERS: dict[str, SynthesisOptions] = {
    "quality (spec-exact)": QUALITY,
    "flow_chunk_causal=False (full attention in every chunk)": lever(
        QUALITY, chunk_causal=False, first_hop_on_chunk_grid=False),
    "flow_final_chunk_causal": lever(QUALITY, final_chunk_causal=True),
    "first_hop_tokens=10": lever(QUALITY, first_hop_tokens=10),
    "flow_left_context_tokens=50": lever(QUALITY, left_context_tokens=50),
    "flow_left_context_tokens=25": lever(QUALITY, left_context_tokens=25),
    "flow_prompt_tokens=50": lever(QUALITY, prompt_tokens=50),
    "flow_prompt_tokens=25": lever(QUALITY, prompt_tokens=25),
    "euler_steps=6": lever(QUALITY, schedule={"steps": 6}),
    "euler_steps=4": lever(QUALITY, schedule={"steps": 4}),
    "euler_steps=2": lever(QUALITY, schedule={"steps": 2}),
    "flow_precision=int8": lever(QUALITY, precision="int8"),
    "vocoder_window_frames=32": lever(QUALITY, vocoder_window_frames=32),
    "vocoder_window_frames=24": lever(QUALITY, vocoder_window_frames=24),
    "vocoder_window_frames=16": lever(QUALITY, vocoder_window_frames=16),
    "flow_prompt_tokens=15": lever(QUALITY, prompt_tokens=15),
    "vocoder_window_frames=8": lever(QUALITY, vocoder_window_frames=8),
    "preset balanced": PRESETS["balanced"],
    "preset fast": PRESETS["fast"],
    "fast, full attention in every chunk (before it was made chunk-causal)": lever(
        PRESETS["fast"], chunk_causal=False, final_chunk_causal=False),
}
"""Each lever alone on top of the spec-exact preset (deviation is measured against it)."""

BALANCED = PRESETS["balanced"]
ABLATIONS: dict[str, SynthesisOptions] = {
    "preset quality": QUALITY,
    "preset balanced": BALANCED,
    "preset fast": PRESETS["fast"],
    "balanced, fp32 DiT": lever(BALANCED, precision="fp32"),
    "balanced, 10 Euler steps": lever(BALANCED, schedule={"steps": 10}),
    "balanced, whole prompt in the flow": lever(BALANCED, prompt_tokens=0),
    "balanced, whole history in the flow": lever(BALANCED, left_context_tokens=0),
    "balanced, first hop 25": lever(BALANCED, first_hop_tokens=25),
    "balanced, exact vocoder": lever(BALANCED, vocoder_window_frames=0),
}
"""Timing: the default preset with one lever reverted (or added) at a time."""
SETS = {"levers": LEVERS, "ablations": ABLATIONS}

def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """SNR of ``test`` against ``ref`` in dB (inf when identical); lengths must match."""
    ref64, test64 = ref.astype(np.float64), test.astype(np.float64)
    noise = float(np.sum((ref64 - test64) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(float(np.sum(ref64**2)) / noise)


class MelTap:
    """Records the mel frames every VocoderStream receives (wraps ``push``)."""

    def __init__(self) -> None:
        self.frames: list[np.ndarray] = []
        self._orig = VocoderStream.push

    def __enter__(self) -> MelTap:
        orig, frames = self._orig, self.frames

        def push(stream: VocoderStream, new_mel: np.ndarray, *a: Any, **k: Any) -> np.ndarray:
            frames.append(np.array(new_mel, copy=True))
            return orig(stream, new_mel, *a, **k)

        VocoderStream.push = push  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        VocoderStream.push = self._orig  # type: ignore[method-assign]

    def mel(self) -> np.ndarray:
        return np.concatenate(self.frames, axis=1) if self.frames else np.zeros((80, 0))


class TokenReplay:
    """Makes ``engine.llm.decode`` replay recorded token lists (one per piece, in order)."""

    def __init__(self, engine: CosyVoice3Engine, pieces: list[list[int]]) -> None:
        self.engine, self.pieces = engine, pieces
        self._orig = engine.llm.decode

    def __enter__(self) -> TokenReplay:
        queue = list(self.pieces)

        def decode(*a: Any, **k: Any) -> Iterator[int]:
            yield from queue.pop(0)

        self.engine.llm.decode = decode  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.llm.decode = self._orig  # type: ignore[method-assign]


def record_tokens(engine: CosyVoice3Engine, text: str, voice: VoicePrompt) -> list[list[int]]:
    """Decode ``text`` once with the fixed-length benchmark rule and keep the tokens."""
    pieces: list[list[int]] = []
    orig = engine.llm.decode

    def decode(*a: Any, **k: Any) -> Iterator[int]:
        tokens: list[int] = []
        pieces.append(tokens)
        for tok in orig(*a, **k):
            tokens.append(tok)
            yield tok

    engine.llm.decode = decode  # type: ignore[method-assign]
    try:
        opts = QUALITY.replace(flow={"schedule": {"steps": 1}}, max_request_s=7200.0)
        for _ in engine.synthesize(text, voice, opts):
            pass
    finally:
        engine.llm.decode = orig  # type: ignore[method-assign]
    return pieces


def render(
    engine: CosyVoice3Engine, text: str, voice: VoicePrompt, opts: SynthesisOptions, tokens: Any
) -> tuple[np.ndarray, np.ndarray]:
    """(mel [80, F], waveform) of ``text`` with the LLM replaying ``tokens``."""
    with MelTap() as tap, TokenReplay(engine, tokens):
        wave = [c.samples for c in engine.synthesize(text, voice, opts)]
    return tap.mel(), np.concatenate(wave)


def timed(
    engine: CosyVoice3Engine, text: str, voice: VoicePrompt, opts: SynthesisOptions
) -> dict[str, Any]:
    result = SynthesisResult()
    arrivals = [
        (chunk.elapsed_s, len(chunk.samples) / chunk.sample_rate_hz)
        for chunk in engine.synthesize(text, voice, opts, result=result)
    ]
    t = result.times
    return {
        "stalls": count_stalls(arrivals),
        "first_chunk_s": result.first_chunk_s,
        "total_s": result.total_s,
        "audio_s": result.audio_s,
        "rtf": result.rtf,
        "llm_prefill_s": t.llm_prefill_s,
        "llm_ms_per_token": 1e3 * t.llm_decode_s / max(t.llm_tokens, 1),
        "flow_s": t.flow_s,
        "flow_calls": t.flow_calls,
        "vocoder_s": t.vocoder_s,
    }


def count_stalls(arrivals: list[tuple[float, float]]) -> int:
    """Times a player that starts at the first chunk and plays in real time runs dry.

    ``arrivals``: (arrival time s, audio duration s) per chunk in order.
    """
    stalls, play_end = 0, None
    for arrived, duration in arrivals:
        if play_end is None:
            play_end = arrived + duration
            continue
        if arrived > play_end + 1e-3:
            stalls, play_end = stalls + 1, arrived
        play_end += duration
    return stalls


def metric_floor(engine: CosyVoice3Engine, mel: np.ndarray) -> dict[str, float]:
    """Waveform SNRs between two vocoder passes over the same mel that differ only in the
    source-noise draw: the level below which the waveform columns cannot tell levers apart
    with random vocoder weights."""
    rng = np.random.default_rng(1)
    noise = [rng.random((480 * mel.shape[1], 9), dtype=np.float32) for _ in range(2)]
    a, b = (engine.hift.waveform(mel, n) for n in noise)
    return {"wave_snr_db": snr_db(a, b), "wave_logmel_snr_db": snr_db(prompt_mel(a), prompt_mel(b))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--clip", type=Path, help="5 s voice clip (default voices/en-male.wav)")
    p.add_argument("--cache-dir", type=Path, help="EngineOptions.cache_dir (default model dir)")
    p.add_argument("--out", type=Path, default=Path("levers.json"))
    p.add_argument("--only", nargs="*", help="lever names to run (default all)")
    p.add_argument("--no-timing", action="store_true", help="deviation only")
    p.add_argument("--no-deviation", action="store_true", help="timing only")
    p.add_argument("--long-text", action="store_true", help="also time the paragraph")
    p.add_argument("--set", choices=sorted(SETS), default="levers", help="which option sets")
    args = p.parse_args()
    table = SETS[args.set]
    names = args.only or list(table)
    cache = args.cache_dir or args.model_dir
    engine = CosyVoice3Engine.load(args.model_dir, EngineOptions(
        cache_dir=cache, observer=FixedDecoding(TOKENS_PER_CHAR)))
    clip = args.clip or args.model_dir / "voices" / "en-male.wav"
    voice = engine.prepare_voice(clip, TRANSCRIPT, name="bench")
    engine.model.release_voice_encoders()
    print(f"voice: {len(voice.features.speech_tokens)} prompt tokens", flush=True)
    tokens = record_tokens(engine, SENTENCE, voice)
    reference: tuple[np.ndarray, np.ndarray] | None = None
    if not args.no_deviation:
        reference = render(engine, SENTENCE, voice, QUALITY.replace(max_request_s=7200.0), tokens)
        print(json.dumps({"metric_floor": metric_floor(engine, reference[0])}), flush=True)
    rows: list[dict[str, Any]] = []
    for name in names:
        opts = table[name].replace(max_request_s=7200.0)
        row: dict[str, Any] = {"lever": name, "options": asdict(opts)}
        engine.warm_up(voice, opts)
        if reference is not None:
            mel, wave = render(engine, SENTENCE, voice, opts, tokens)
            n_mel = min(mel.shape[1], reference[0].shape[1])
            n_wave = min(len(wave), len(reference[1]))
            row["mel_snr_db"] = snr_db(reference[0][:, :n_mel], mel[:, :n_mel])
            row["wave_snr_db"] = snr_db(reference[1][:n_wave], wave[:n_wave])
            row["wave_logmel_snr_db"] = snr_db(
                prompt_mel(reference[1][:n_wave]), prompt_mel(wave[:n_wave])
            )
        if not args.no_timing:
            started = time.perf_counter()
            row["sentence"] = timed(engine, SENTENCE, voice, opts)
            if args.long_text:
                row["paragraph"] = timed(engine, PARAGRAPH, voice, opts)
            row["timing_wall_s"] = time.perf_counter() - started
        row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "options"}), flush=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
