"""Streamed vocoder against one call over the same mel: cost and deviation.

``python -m bench.vocoder_stream --model-dir DIR --cache-dir CACHE`` measures the product's
vocoder as the engine loads it (:func:`~wyoming_cosyvoice3.engine.loaders.load_hift_stream`,
one onnxruntime thread): the
streamed form of ``hift.onnx`` (:mod:`~wyoming_cosyvoice3.engine.derive.vocoder.hift_stream`,
tag ``stream4``: each mel frame runs once, convolution context and source phase carried)
pushed flow chunk by flow chunk through :class:`~wyoming_cosyvoice3.engine.vocoder.hift.
VocoderStream`, against one call over the same mel and the same source noise of the graph the
streamed form is validated against: ``hift.onnx`` rewritten to round alike at every call
length (:func:`~wyoming_cosyvoice3.engine.derive.vocoder.hift_exact.exact_one_call`, written
beside the streamed form as ``hift.exact-*.onnx``). Both are made once into ``--cache-dir``
(a temporary directory by default) and reused from there. Per utterance length it prints a
markdown table:

* **CPU s**: CPU seconds of the process (``time.process_time``) per run, so other processes
  on a shared machine change the figures little (they still do: caches, memory bandwidth);
  median over ``--rounds`` rounds after one untimed run of each; the two runs of a round
  alternate their order (one call first in even rounds);
* **streamed / one call**: the median of the per-round ratios (paired: both runs of a round
  saw the same machine) and the ratio of the medians. The target: at most 1.10;
* **max abs diff**: largest |streamed - one call| of the samples (full scale 1; the target:
  at most 1e-4, the bound the derivation validates,
  :data:`~wyoming_cosyvoice3.engine.derive.vocoder.hift_stream.MAX_ABS`).

``--json OUT`` also writes the figures (one object per utterance length) as JSON.

``--windowed`` instead measures the fallback used when the streamed form cannot be derived:
windowed calls (``SynthesisOptions.vocoder_window_frames``) of ``hift.onnx`` as published
(the harmonic source restarts its phase at each window start; seams cross-faded), for several
left-context windows (``--windows``, 0 = all mel so far) and
call schedules (``--policies``), against one call of ``hift.onnx``; its table adds the
mel frames run in total (each call re-runs its left window, the new frames and the 8
held-back right-context frames), the SNR over the utterance and the lowest SNR within
+-20 ms of a seam (a call boundary), in dB.

The mel is smooth random log-mel (a stand-in; with random weights only lengths and numerics
matter). Flow chunks as the engine produces them (first hop ``--first-frames``, 2 x
``first_hop_tokens``, doubling up to 200 frames; upstream model.py ``token_hop_len``,
``stream_scale_factor``, ``token_max_hop_len``). Windowed schedules: a vocoder call after every
chunk (``per-chunk``), after every second chunk, or only after the first and the last chunk
(``first+last``, what a lead-aware scheduler does when the audio already sent lasts until the
utterance is complete).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.derive.common.files import keyed_name
from wyoming_cosyvoice3.engine.derive.vocoder.hift_stream import STREAM_TAG
from wyoming_cosyvoice3.engine.loaders import load_hift_stream
from wyoming_cosyvoice3.engine.noise import request_streams
from wyoming_cosyvoice3.engine.options import EngineOptions, StageTimes
from wyoming_cosyvoice3.engine.sessions import HIFT, Graph
from wyoming_cosyvoice3.engine.vocoder.hift import HiftRunner, VocoderStream

FloatArray = npt.NDArray[np.float32]
EXACT_TAG = "exact"
"""Tag of the one-call reference graph this benchmark writes (not a product form)."""
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
    """Stream ``mel`` in ``chunks``; the vocoder runs after chunk i when ``calls[i]``.

    The source noise is a request's (:func:`~wyoming_cosyvoice3.engine.noise.
    request_streams` of ``seed``), so runs with the same seed see the same noise. ``cpu_s``
    is the process CPU time of the pushes (noise drawing included, as in the engine).
    """
    noise = request_streams(seed)[2]
    stream = VocoderStream(runner, noise, window_frames=window_frames)
    times = StageTimes()  # counts the graph's calls (a streamed call may emit nothing yet)
    outs: list[FloatArray] = []
    seams: list[int] = []
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
        out = stream.push(pending, final, times=times)
        pending = np.zeros((C.MEL_BINS, 0), dtype=np.float32)
        if len(out):
            if outs:
                seams.append(emitted)
            outs.append(out)
    cpu = time.process_time() - started
    return StreamRun(np.concatenate(outs), cpu, times.vocoder_calls, stream.frames_run,
                     seams)


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


def measure_windowed(
    model_dir: Path, frames: int, first_frames: int, windows: Sequence[int],
    policies: Sequence[str], repeats: int,
) -> list[str]:
    """``--windowed``: markdown lines (see the module docstring); medians of ``repeats`` CPU
    times."""
    runner = HiftRunner(Graph(model_dir / HIFT.file, HIFT, threads=1, spin_wait=False))
    mel = smooth_mel(frames)
    chunks = flow_chunks(frames, first_frames)
    one = [run_stream(runner, mel, [frames], [True], 0, 1) for _ in range(repeats + 1)][1:]
    reference = one[0].samples
    one_cpu = float(np.median([r.cpu_s for r in one]))
    rows = [
        f"| one call | - | 1 | {frames} | {one_cpu:.3f} | 1.00 | 0 | inf | - |",
    ]
    for window in windows:
        for policy in policies:
            calls = schedule_calls(chunks, policy)
            runs = [run_stream(runner, mel, chunks, calls, window, 1)
                    for _ in range(repeats)]
            run = runs[0]
            cpu = float(np.median([r.cpu_s for r in runs]))
            diff = float(np.max(np.abs(run.samples - reference)))
            rows.append(
                f"| window {window or 'all (exact)'} | {policy} | {run.calls} | "
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


@dataclass
class ProductCost:
    """The product's streamed vocoder against its one call over one utterance.

    Attributes:
        frames: mel frames of the utterance.
        chunks: mel frames per flow chunk (one streamed vocoder call each).
        one_call_graph, streamed_graph: file names of the two derived graphs.
        streamed_calls: graph calls of the streamed run.
        one_call_frames_run, streamed_frames_run: mel frames each run's graph ran over
            (each frame once for both: the streamed form re-runs nothing).
        one_call_cpu_s, streamed_cpu_s: process CPU seconds per round.
        max_abs: largest |streamed - one call| over the samples (full scale 1).
    """

    frames: int
    chunks: list[int]
    one_call_graph: str
    streamed_graph: str
    streamed_calls: int
    one_call_frames_run: int
    streamed_frames_run: int
    one_call_cpu_s: list[float]
    streamed_cpu_s: list[float]
    max_abs: float

    @property
    def round_ratios(self) -> list[float]:
        """Streamed / one-call CPU time of each round."""
        return [s / o for s, o in zip(self.streamed_cpu_s, self.one_call_cpu_s, strict=True)]

    @property
    def paired_ratio(self) -> float:
        """Median of :attr:`round_ratios`."""
        return float(np.median(self.round_ratios))

    @property
    def ratio_of_medians(self) -> float:
        """Median streamed CPU time over median one-call CPU time."""
        return float(np.median(self.streamed_cpu_s) / np.median(self.one_call_cpu_s))

    def as_json(self) -> dict[str, object]:
        """The attributes plus the three ratios, for ``--json``."""
        return {**asdict(self), "round_ratios": self.round_ratios,
                "paired_ratio": self.paired_ratio, "ratio_of_medians": self.ratio_of_medians}


def product_runners(model_dir: Path, cache_dir: Path) -> tuple[HiftRunner, HiftRunner]:
    """(one-call runner, streamed runner), one onnxruntime thread. The streamed runner is the
    engine's (``HiftRunner(hift, streamed graph)``, :class:`~wyoming_cosyvoice3.engine.
    pipeline.CosyVoice3Engine`), loaded by the engine's loader (derived into ``cache_dir``
    once, in a child process; reused from there); the one-call runner runs the exact
    rewrite of ``hift.onnx`` (module docstring), written into ``cache_dir`` once.

    Raises:
        RuntimeError: the streamed form could not be derived or loaded (the loader logged
            why); the comparison is then not the product's.
    """
    import onnx

    from wyoming_cosyvoice3.engine.derive.vocoder.hift_exact import exact_one_call

    options = EngineOptions(threads=1, spin_wait=False, cache_dir=cache_dir)
    source = model_dir / HIFT.file
    exact = cache_dir / keyed_name(source, EXACT_TAG, ".onnx")
    if not exact.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        onnx.save(exact_one_call(onnx.load(str(source)))[0], str(exact))
    hift = Graph(exact, HIFT, threads=1, spin_wait=False)
    streamed = load_hift_stream(model_dir, options)
    if streamed is None or STREAM_TAG not in streamed.graph.path.name:
        raise RuntimeError(f"the {STREAM_TAG} streamed vocoder of {model_dir} did not load "
                           "(see the warning above)")
    return HiftRunner(hift), HiftRunner(hift, streamed)


def measure_product(
    one_call: HiftRunner, streamed: HiftRunner, frames: int, first_frames: int, rounds: int,
) -> ProductCost:
    """Time ``streamed`` pushed per flow chunk against one call of ``one_call`` over the same
    mel and noise: one untimed run of each (whose samples are compared), then ``rounds``
    rounds of one timed run each, the order alternating (one call first in even rounds).

    Raises:
        ValueError: ``frames`` < 1 or ``rounds`` < 1.
        RuntimeError: the two runs returned different numbers of samples.
    """
    if frames < 1 or rounds < 1:
        raise ValueError(f"frames and rounds must be >= 1, got {frames} and {rounds}")
    if streamed.stream is None:
        raise ValueError("the streamed runner has no streamed graph")
    mel = smooth_mel(frames)
    chunks = flow_chunks(frames, first_frames)
    per_chunk = [True] * len(chunks)

    def one() -> StreamRun:
        return run_stream(one_call, mel, [frames], [True], 0, 1)

    def chunked() -> StreamRun:
        return run_stream(streamed, mel, chunks, per_chunk, 0, 1)

    reference, test = one(), chunked()
    if len(reference.samples) != len(test.samples):
        raise RuntimeError(f"streamed run gave {len(test.samples)} samples, one call "
                           f"{len(reference.samples)}")
    cpu: dict[str, list[float]] = {"one": [], "streamed": []}
    for i in range(rounds):
        order = [("one", one), ("streamed", chunked)]
        for name, run in order if i % 2 == 0 else order[::-1]:
            cpu[name].append(run().cpu_s)
    return ProductCost(
        frames=frames, chunks=chunks, one_call_graph=one_call.graph.path.name,
        streamed_graph=streamed.stream.graph.path.name, streamed_calls=test.calls,
        one_call_frames_run=reference.frames_run, streamed_frames_run=test.frames_run,
        one_call_cpu_s=cpu["one"], streamed_cpu_s=cpu["streamed"],
        max_abs=float(np.max(np.abs(test.samples - reference.samples))),
    )


def product_table(cost: ProductCost) -> list[str]:
    """Markdown lines of :func:`measure_product`'s figures (see the module docstring)."""
    def cpu(values: list[float]) -> str:
        return f"{np.median(values):.3f} | {min(values):.3f}-{max(values):.3f}"

    ratios = cost.round_ratios
    return [
        f"Utterance {cost.frames} mel frames ({cost.frames / C.MEL_RATE_HZ:.2f} s), flow chunks "
        f"{cost.chunks} frames; one onnxruntime thread; {len(ratios)} interleaved rounds after "
        "one untimed run each; CPU s of the process (time.process_time).",
        "",
        "| vocoder | form | calls | frames run | CPU s median | CPU s min-max |",
        "|---|---|---|---|---|---|",
        f"| one call | {EXACT_TAG} | 1 | {cost.one_call_frames_run} | "
        f"{cpu(cost.one_call_cpu_s)} |",
        f"| streamed per flow chunk | {STREAM_TAG} | {cost.streamed_calls} | "
        f"{cost.streamed_frames_run} | {cpu(cost.streamed_cpu_s)} |",
        "",
        "| streamed against one call | value | target |",
        "|---|---|---|",
        f"| CPU ratio, median of per-round ratios | {cost.paired_ratio:.3f} (rounds "
        f"{min(ratios):.3f}-{max(ratios):.3f}) | <= 1.10 |",
        f"| CPU ratio of the medians | {cost.ratio_of_medians:.3f} | <= 1.10 |",
        f"| max abs difference of the samples | {cost.max_abs:.2e} | <= 1e-4 |",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--frames", type=int, nargs="+", default=[214, 300],
                   help="utterance lengths in mel frames (default: a 4.3 s sentence, 6 s)")
    p.add_argument("--first-frames", type=int, default=20,
                   help="first flow chunk in mel frames (balanced: 10 tokens = 20)")
    p.add_argument("--rounds", "--repeats", type=int, default=7,
                   help="timed rounds (--windowed: runs per row, median)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the derived vocoder graphs go and are reused from (default: a "
                        "temporary directory)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write the figures as JSON (not with --windowed)")
    p.add_argument("--windowed", action="store_true",
                   help="measure the windowed fallback instead (options below)")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 16, 8])
    p.add_argument("--policies", nargs="+", default=["per-chunk", "every-2", "first+last"])
    args = p.parse_args(argv)
    if args.windowed and args.json is not None:
        p.error("--json is for the streamed-vocoder comparison, not --windowed")
    with tempfile.TemporaryDirectory() as scratch:
        cache = args.cache_dir or Path(scratch)
        if args.windowed:
            for frames in args.frames:
                lines = measure_windowed(
                    args.model_dir, frames, args.first_frames, args.windows, args.policies,
                    args.rounds)
                print("\n".join(lines), end="\n\n", flush=True)
            return
        one_call, streamed = product_runners(args.model_dir, cache)
        results = []
        for frames in args.frames:
            cost = measure_product(one_call, streamed, frames, args.first_frames, args.rounds)
            results.append(cost.as_json())
            print("\n".join(product_table(cost)), end="\n\n", flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
