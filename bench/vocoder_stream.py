"""Streamed vocoder against one call over the same mel: cost and deviation.

``python -m bench.vocoder_stream --model-dir DIR`` runs ``hift.onnx`` of DIR
the way the engine streams one utterance (:class:`~wyoming_cosyvoice3.engine.vocoder.hift.
VocoderStream`) for several left-context windows and call schedules, and once over the whole
mel, and prints a markdown table:

* **cost**: CPU seconds of the process (``time.process_time``) with one onnxruntime thread,
  so other processes on a shared machine change the figures little; the ratio to one call
  over the same frames is the figure of issue 12 (target <= 1.10);
* **frames run**: mel frames the graph ran in total (each call runs its left window, the new
  frames and the 8 held-back right-context frames again);
* **deviation** from the one-call samples: max abs difference, SNR over the utterance and the
  lowest SNR within +-20 ms of a seam (a call boundary), in dB.

Windowed rows run twice with ``--graphs published phase-carry`` (default): ``hift.onnx`` as
published (the harmonic source restarts its phase at each window start; seams cross-faded)
and its phase-carrying form (:mod:`~wyoming_cosyvoice3.engine.derive.vocoder.hift_phase`, derived
once into ``--cache-dir``; the window's frames get their source phase from earlier calls).

The mel is smooth random log-mel (a stand-in; with random weights only lengths and numerics
matter). Schedules: flow chunks as the engine produces them (first hop 2 x ``first_hop``
frames, doubling up to 200 frames; upstream model.py ``token_hop_len``, ``stream_scale_factor``),
and a vocoder call after every chunk (``per-chunk``), after every second chunk, or only after
the first and the last chunk (``first+last``, what a lead-aware scheduler does when the audio
already sent lasts until the utterance is complete).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.derive.vocoder.hift_phase import PHASE_HIFT, ensure_phase_hift
from wyoming_cosyvoice3.engine.graphs import HIFT, Graph
from wyoming_cosyvoice3.engine.request import GrowingNoise
from wyoming_cosyvoice3.engine.vocoder.hift import HiftRunner, VocoderStream

FloatArray = npt.NDArray[np.float32]
SEAM_MS = 20.0
MAX_HOP_FRAMES = 200
"""Upstream token_max_hop_len 100 tokens x token_mel_ratio 2."""


def flow_chunks(total_frames: int, first_frames: int) -> list[int]:
    """Mel frames per flow chunk of one utterance: first_frames, doubling up to 200, rest last."""
    sizes: list[int] = []
    hop, done = first_frames, 0
    while done + hop < total_frames:
        sizes.append(hop)
        done += hop
        hop = min(MAX_HOP_FRAMES, hop * 2)
    sizes.append(total_frames - done)
    return sizes


def schedule_calls(chunks: Sequence[int], policy: str) -> list[bool]:
    """Per chunk: True when the vocoder runs after it (the last chunk always runs)."""
    n = len(chunks)
    if policy == "per-chunk":
        return [True] * n
    if policy == "every-2":
        return [i == 0 or i == n - 1 or i % 2 == 0 for i in range(n)]
    if policy == "first+last":
        return [i in (0, n - 1) for i in range(n)]
    raise ValueError(f"unknown policy {policy!r}")


def smooth_mel(frames: int, seed: int = 0) -> FloatArray:
    """float32 [80, frames] random log-mel, smoothed over 5 frames, around -6 +- 2."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((C.MEL_BINS, frames + 4)).astype(np.float32)
    kernel = np.ones(5, dtype=np.float32) / 5.0
    mel = np.stack([np.convolve(row, kernel, mode="valid") for row in raw])
    return (mel * 4.0 - 6.0).astype(np.float32)


@dataclass
class StreamRun:
    samples: FloatArray
    cpu_s: float
    calls: int
    frames_run: int
    seams: list[int]


def run_stream(
    runner: HiftRunner,
    mel: FloatArray,
    chunks: Sequence[int],
    calls: Sequence[bool],
    window_frames: int,
    seed: int,
) -> StreamRun:
    """Stream ``mel`` in ``chunks``; the vocoder runs after chunk i when ``calls[i]``."""
    noise = GrowingNoise(np.random.default_rng(seed), C.HARMONIC_CHANNELS, "uniform", 480 * 500)
    stream = VocoderStream(runner, noise, window_frames=window_frames)
    outs: list[FloatArray] = []
    seams: list[int] = []
    frames_run = n_calls = 0
    pending = np.zeros((C.MEL_BINS, 0), dtype=np.float32)
    start = 0
    started = time.process_time()
    for size, run in zip(chunks, calls, strict=True):
        pending = np.concatenate([pending, mel[:, start : start + size]], axis=1)
        start += size
        final = start >= mel.shape[1]
        if not run and not final:
            continue
        emitted = stream.emitted_samples
        first = 0 if window_frames == 0 else max(0, emitted // 480 - window_frames)
        out = stream.push(pending, final)
        pending = np.zeros((C.MEL_BINS, 0), dtype=np.float32)
        if len(out):
            n_calls += 1
            frames_run += stream.mel_frames - first
            if outs:
                seams.append(emitted)
            outs.append(out)
    cpu = time.process_time() - started
    return StreamRun(np.concatenate(outs), cpu, n_calls, frames_run, seams)


def snr_db(reference: FloatArray, test: FloatArray) -> float:
    """10 log10(sum ref^2 / sum (ref - test)^2); inf when equal."""
    err = float(np.sum((reference.astype(np.float64) - test) ** 2))
    power = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if err == 0.0 else 10.0 * np.log10(power / err)


def seam_snr_db(reference: FloatArray, test: FloatArray, seams: Sequence[int]) -> float:
    """Lowest SNR within +-20 ms of any seam; inf without seams or when equal."""
    half = round(SEAM_MS * C.OUTPUT_SAMPLE_RATE_HZ / 1000.0)
    values = [
        snr_db(reference[max(0, s - half) : s + half], test[max(0, s - half) : s + half])
        for s in seams
    ]
    return min(values, default=float("inf"))


def measure(
    model_dir: Path, frames: int, first_frames: int, windows: Sequence[int],
    policies: Sequence[str], repeats: int, cache_dir: Path | None = None,
) -> list[str]:
    """Markdown rows (see the module docstring); medians of ``repeats`` CPU times. With
    ``cache_dir`` the windowed rows also run the phase-carrying graph (derived there)."""
    runner = HiftRunner(Graph(model_dir / HIFT.file, HIFT, threads=1, spin_wait=False))
    runners = {"": runner}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path, report = ensure_phase_hift(model_dir / HIFT.file, cache_dir, in_process=True)
        carried = Graph(path, PHASE_HIFT, threads=1, spin_wait=False)
        runners[" (phase carried)"] = HiftRunner(carried, report.period)
    mel = smooth_mel(frames)
    chunks = flow_chunks(frames, first_frames)
    one = [run_stream(runner, mel, [frames], [True], 0, 1) for _ in range(repeats + 1)][1:]
    reference = one[0].samples
    one_cpu = float(np.median([r.cpu_s for r in one]))
    rows = [
        f"| one call | - | 1 | {frames} | {one_cpu:.3f} | 1.00 | 0 | inf | - |",
    ]
    cases = [(w, label, r) for w in windows for label, r in runners.items() if w or not label]
    for window, label, case_runner in cases:
        for policy in policies:
            calls = schedule_calls(chunks, policy)
            runs = [run_stream(case_runner, mel, chunks, calls, window, 1)
                    for _ in range(repeats)]
            run = runs[0]
            cpu = float(np.median([r.cpu_s for r in runs]))
            diff = float(np.max(np.abs(run.samples - reference)))
            rows.append(
                f"| window {window or 'all (exact)'}{label} | {policy} | {run.calls} | "
                f"{run.frames_run} | {cpu:.3f} | {cpu / one_cpu:.2f} | {diff:.2e} | "
                f"{snr_db(reference, run.samples):.1f} | "
                f"{seam_snr_db(reference, run.samples, run.seams):.1f} |"
            )
    header = [
        f"Utterance {frames} mel frames ({frames / C.MEL_RATE_HZ:.2f} s), flow chunks "
        f"{chunks} frames.",
        "",
        "| vocoder | calls after | calls | frames run | CPU s | ratio | max abs diff | "
        "SNR dB | seam SNR dB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return header + rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--frames", type=int, nargs="+", default=[214, 300],
                   help="utterance lengths in mel frames (default: a 4.3 s sentence, 6 s)")
    p.add_argument("--first-frames", type=int, default=20,
                   help="first flow chunk in mel frames (balanced: 10 tokens = 20)")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 16, 8])
    p.add_argument("--policies", nargs="+", default=["per-chunk", "every-2", "first+last"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--graphs", nargs="+", choices=["published", "phase-carry"],
                   default=["published", "phase-carry"],
                   help="windowed rows: hift.onnx as published and/or its phase-carrying form")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the phase-carrying graph is derived (default: a temporary dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        cache = (args.cache_dir or Path(scratch)) if "phase-carry" in args.graphs else None
        for frames in args.frames:
            lines = measure(args.model_dir, frames, args.first_frames, args.windows,
                            args.policies, args.repeats, cache)
            print("\n".join(lines), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
