"""hift.onnx of the tiny model: shapes, ranges and CausalHiFTGenerator's right context."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.sessions import HIFT, Graph

PER_MEL = C.SAMPLES_PER_MEL_FRAME // C.ISTFT_HOP  # 120 STFT frames per mel frame


@pytest.fixture(scope="module")
def hift(tiny_model_dir: Path) -> Graph:
    return Graph(tiny_model_dir / HIFT.file, HIFT)


def run(hift: Graph, mel: np.ndarray, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    frames = mel.shape[1]
    out = hift.run(
        {"speech_feat": mel[None], "noise": noise[None, : frames * C.SAMPLES_PER_MEL_FRAME]}
    )
    return out["magnitude"][0], out["phase"][0]


def istft(magnitude: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """Reference iSTFT (n_fft 16, hop 4, periodic Hann, centre): overlap-add / window power."""
    n_fft, hop = C.ISTFT_N_FFT, C.ISTFT_HOP
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    frames = np.fft.irfft(magnitude * np.exp(1j * phase), n=n_fft, axis=0) * window[:, None]
    n_frames = frames.shape[1]
    length = n_fft + hop * (n_frames - 1)
    out, norm = np.zeros(length), np.zeros(length)
    for j in range(n_frames):
        out[j * hop : j * hop + n_fft] += frames[:, j]
        norm[j * hop : j * hop + n_fft] += window**2
    half = n_fft // 2
    return (out / np.maximum(norm, 1e-11))[half : length - half]


def random_inputs(seed: int, frames: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mel = rng.uniform(-10.0, 0.0, (80, frames)).astype(np.float32)
    noise = rng.uniform(0.0, 1.0, (frames * C.SAMPLES_PER_MEL_FRAME, 9)).astype(np.float32)
    return mel, noise


def test_output_shapes_and_ranges(hift: Graph) -> None:
    mel, noise = random_inputs(0, 17)
    magnitude, phase = run(hift, mel, noise)
    assert magnitude.shape == phase.shape == (9, 120 * 17 + 1)
    assert magnitude.min() > 0.0 and magnitude.max() < C.MAGNITUDE_CLIP
    assert np.abs(phase).max() <= np.pi
    samples = istft(magnitude, phase)
    assert samples.shape == (17 * C.SAMPLES_PER_MEL_FRAME,)
    assert 0.01 < np.abs(samples).max() < 5.0


@pytest.mark.parametrize("changed", [3, 15, 28])
def test_a_mel_frame_reaches_four_frames_back(hift: Graph, changed: int) -> None:
    """conv_pre looks 4 mel frames ahead (``conv_pre_look_right: 4``) and the f0 predictor 3:
    a change in mel frame c changes STFT frames of mel frames c - 4 on (the causal convs carry
    it to the end), never earlier."""
    frames = 30
    mel, noise = random_inputs(1, frames)
    base, _ = run(hift, mel, noise)
    other = mel.copy()
    other[:, changed] += 2.0
    diff = np.abs(run(hift, other, noise)[0] - base).max(axis=0)
    first = int(np.flatnonzero(diff > 1e-6)[0])
    assert first // PER_MEL == max(0, changed - 4)


@pytest.mark.parametrize(("mel_frames", "more"), [(12, 1), (30, 20), (64, 7)])
def test_streaming_rule_samples_before_480_m_minus_8_never_change(
    hift: Graph, mel_frames: int, more: int
) -> None:
    """Upstream-style streaming: vocode all mel so far, emit [0, 480*(M-8)) until final."""
    mel_long, noise = random_inputs(3, mel_frames + more)
    short = istft(*run(hift, mel_long[:, :mel_frames], noise))
    long = istft(*run(hift, mel_long, noise))
    stable = C.SAMPLES_PER_MEL_FRAME * (mel_frames - C.VOCODER_RIGHT_CONTEXT_FRAMES)
    # (1e-4: the harmonic phase is a float32 cumulative sum, rounded per call length)
    np.testing.assert_allclose(short[:stable], long[:stable], rtol=0, atol=1e-4)
    # the last 4 frames do change: conv_pre looks 4 frames ahead
    tail = slice(C.SAMPLES_PER_MEL_FRAME * (mel_frames - 4), C.SAMPLES_PER_MEL_FRAME * mel_frames)
    assert np.abs(short[tail] - long[tail]).max() > 1e-3
