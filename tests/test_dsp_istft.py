"""The vocoder's inverse STFT against scipy.signal.istft and by reconstruction."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal

from wyoming_cosyvoice3.engine import istft as vdsp


def _scipy_istft(magnitude: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """scipy's istft with torch.istft's conventions: periodic Hann 16, hop 4, boundary trim 8.

    scipy scales each inverse FFT by the window sum (scaling="spectrum"); dividing the input
    by that sum cancels it, leaving window * irfft, overlap-add, / sum of squared windows.
    """
    window = scipy.signal.get_window("hann", 16, fftbins=True)
    spectrum = np.minimum(magnitude, 100.0) * np.exp(1j * phase) / window.sum()
    _, signal = scipy.signal.istft(
        spectrum,
        window="hann",
        nperseg=16,
        noverlap=12,
        nfft=16,
        input_onesided=True,
        boundary=True,
    )
    return signal


def _stft_16(signal: np.ndarray) -> np.ndarray:
    """Centred STFT (reflect pad 8, periodic Hann 16, hop 4): [9, 1 + N // 4]."""
    padded = np.pad(signal, 8, mode="reflect")
    count = 1 + (padded.shape[0] - 16) // 4
    frames = np.stack([padded[i * 4 : i * 4 + 16] for i in range(count)])
    return np.fft.rfft(frames * vdsp.periodic_hann(16), axis=1).T


@pytest.mark.parametrize("mel_frames", [1, 3, 10])
def test_istft_matches_scipy_and_gives_480_samples_per_mel_frame(mel_frames):
    rng = np.random.default_rng(mel_frames)
    frames = 120 * mel_frames + 1
    magnitude = rng.uniform(0.0, 4.0, (9, frames))
    phase = rng.uniform(-np.pi, np.pi, (9, frames))
    ours = vdsp.istft(magnitude, phase)
    oracle = _scipy_istft(magnitude, phase)
    assert ours.shape == (480 * mel_frames,) == oracle.shape
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, oracle, atol=1e-5)


def test_istft_accepts_batch_axis():
    rng = np.random.default_rng(7)
    magnitude = rng.uniform(0.0, 2.0, (1, 9, 241))
    phase = rng.uniform(-np.pi, np.pi, (1, 9, 241))
    np.testing.assert_array_equal(vdsp.istft(magnitude, phase), vdsp.istft(magnitude[0], phase[0]))


def test_istft_reconstructs_a_signal_through_stft():
    rng = np.random.default_rng(11)
    t = np.arange(4800) / 24000
    signal = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.shape[0])
    spectrum = _stft_16(signal)
    rebuilt = vdsp.istft(np.abs(spectrum), np.angle(spectrum))
    assert rebuilt.shape == signal.shape
    np.testing.assert_allclose(rebuilt, signal, atol=1e-6)


def test_istft_clips_magnitude_at_100():
    rng = np.random.default_rng(2)
    magnitude = rng.uniform(0.0, 50.0, (9, 121))
    magnitude[3, 40:60] = 1e4
    phase = rng.uniform(-np.pi, np.pi, (9, 121))
    clipped = magnitude.copy()
    clipped[3, 40:60] = 100.0
    np.testing.assert_array_equal(vdsp.istft(magnitude, phase), vdsp.istft(clipped, phase))
    assert not np.array_equal(vdsp.istft(magnitude * 0.5, phase), vdsp.istft(clipped, phase))


def test_istft_rejects_bad_shapes():
    with pytest.raises(ValueError, match="differ"):
        vdsp.istft(np.zeros((9, 10)), np.zeros((9, 11)))
    with pytest.raises(ValueError, match="expected"):
        vdsp.istft(np.zeros((8, 10)), np.zeros((8, 10)))


@pytest.mark.parametrize("frames", [2, 3, 4, 5, 7])
def test_istft_edges_of_short_inputs_match_scipy(frames):
    """Few frames: the window envelope is partial everywhere near the two edges."""
    rng = np.random.default_rng(100 + frames)
    magnitude = rng.uniform(0.1, 3.0, (9, frames))
    phase = rng.uniform(-np.pi, np.pi, (9, frames))
    ours = vdsp.istft(magnitude, phase)
    assert ours.shape == (4 * (frames - 1),)
    np.testing.assert_allclose(ours, _scipy_istft(magnitude, phase), atol=1e-5)
