"""The upstream (torchaudio default) windowed-sinc resampler of voice/resample.py.

Against upstream's real outputs: ``test_parity_features.py``. Here: the per-phase implementation
against a direct evaluation of the interpolation formula (every output sample as a sum over
every input sample), lengths, rate pairs with a large reduced rate, and bad input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from wyoming_cosyvoice3.engine.voice.resample import (
    output_length,
    resample_like_upstream,
    sinc_kernel,
)

# The filter upstream's load_wav gets from ``torchaudio.transforms.Resample(orig, new)``: its
# defaults resampling_method="sinc_interp_hann", lowpass_filter_width=6, rolloff=0.99
# (pytorch/audio, src/torchaudio/transforms/_transforms.py, ``Resample.__init__``). Written
# out here, not imported from the module under test, so a changed constant there fails.
TORCHAUDIO_LOWPASS_FILTER_WIDTH = 6
TORCHAUDIO_ROLLOFF = 0.99


def direct_resample(x: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """y[m] = sum_i x[i] (base/o) sinc(pi t) cos^2(pi t / 2w), t = (i/o - m/n) base, |t| < w.

    (with m = q n + j, ``m / n`` is taken as ``q + float32(j / n)``, as torchaudio does).

    o, n: rates over their gcd; base = min(o, n) * rolloff; length ceil(n N / o). An O(N M)
    evaluation of the formula torchaudio's Resample implements (functional.py
    ``_get_sinc_resample_kernel`` comments), independent of the per-phase bookkeeping.
    """
    gcd = math.gcd(from_hz, to_hz)
    o, n = from_hz // gcd, to_hz // gcd
    base = min(o, n) * TORCHAUDIO_ROLLOFF
    w = TORCHAUDIO_LOWPASS_FILTER_WIDTH
    q, j = np.divmod(np.arange(math.ceil(n * len(x) / o)), n)
    # torchaudio rounds j / n to float32 (an int tensor divided by an int): up to 2e-5 here
    phase = (np.float32(-1) * j.astype(np.float32) / np.float32(n)).astype(np.float64)
    t = ((np.arange(len(x))[None, :] - q[:, None] * o) / o + phase[:, None]) * base
    inside = np.abs(t) < w
    kernel = np.where(inside, np.sinc(t) * np.cos(np.pi * t / (2 * w)) ** 2, 0.0) * base / o
    return kernel @ x.astype(np.float64)


RATE_PAIRS = [
    (24000, 16000),
    (22050, 16000),
    (22050, 24000),
    (44100, 16000),
    (44100, 24000),
    (48000, 16000),
    (16000, 24000),
    (32000, 24000),
    (22051, 16000),  # reduced rates 22051/16000: a dense kernel would hold 353 M values
]


@pytest.mark.parametrize(("from_hz", "to_hz"), RATE_PAIRS)
def test_resample_equals_the_sinc_interpolation_formula(from_hz: int, to_hz: int) -> None:
    rng = np.random.default_rng(from_hz + to_hz)
    x = (0.5 * rng.standard_normal(1500)).astype(np.float32)
    y = resample_like_upstream(x, from_hz, to_hz)
    expected = direct_resample(x, from_hz, to_hz)
    assert y.dtype == np.float32 and y.shape == expected.shape
    # float32 kernel and float32 rounding of j / n, as torchaudio
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("n_samples", [0, 1, 2, 440, 441, 442, 10_000])
def test_resample_length_is_ceil_of_the_rate_ratio(n_samples: int) -> None:
    x = np.ones(n_samples, dtype=np.float32)
    y = resample_like_upstream(x, 44100, 16000)
    assert y.shape == (math.ceil(n_samples * 160 / 441),)
    assert output_length(n_samples, 44100, 16000) == y.shape[0]


def test_resample_gather_blocks_join_seamlessly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gather path (many phases) computed in small blocks equals the one-block result."""
    from wyoming_cosyvoice3.engine.voice import resample as module

    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    whole = resample_like_upstream(x, 22051, 16000)
    monkeypatch.setattr(module, "BLOCK_OUTPUT_SAMPLES", 97)
    np.testing.assert_array_equal(resample_like_upstream(x, 22051, 16000), whole)


@pytest.mark.parametrize(("from_hz", "to_hz"), [(48000, 16000), (22050, 24000)])
def test_resample_phase_and_gather_paths_agree(
    monkeypatch: pytest.MonkeyPatch, from_hz: int, to_hz: int
) -> None:
    from wyoming_cosyvoice3.engine.voice import resample as module

    x = np.random.default_rng(4).standard_normal(7000).astype(np.float32)
    by_phase = resample_like_upstream(x, from_hz, to_hz)
    monkeypatch.setattr(module, "PHASE_LOOP_MAX_PHASES", 0)
    np.testing.assert_allclose(resample_like_upstream(x, from_hz, to_hz), by_phase, atol=1e-7)


def test_kernel_keeps_only_the_non_zero_taps_per_phase() -> None:
    kernel = sinc_kernel(22051, 16000)
    assert (kernel.orig, kernel.new) == (22051, 16000)
    assert kernel.taps.shape == (16000, 2 * kernel.width + 2)
    assert kernel.taps.dtype == np.float32
    # every phase's taps sum to about 1 (unit DC gain up to the windowed-sinc ripple)
    np.testing.assert_allclose(kernel.taps.sum(axis=1), 1.0, atol=0.02)


def test_resample_keeps_a_tone_below_the_cutoff_and_removes_one_above() -> None:
    rate = 48000
    t = np.arange(rate) / rate
    low = resample_like_upstream(np.sin(2 * np.pi * 1000 * t).astype(np.float32), rate, 16000)
    expected = np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000)
    np.testing.assert_allclose(low[800:-800], expected[800:-800], atol=2e-3)
    high = resample_like_upstream(np.sin(2 * np.pi * 11000 * t).astype(np.float32), rate, 16000)
    assert np.abs(high[800:-800]).max() < 0.01  # Hann-windowed sinc, 6 zero crossings


def test_resample_same_rate_returns_a_float32_copy() -> None:
    x = np.linspace(-1, 1, 100)
    y = resample_like_upstream(x, 24000, 24000)
    assert y.dtype == np.float32 and y is not x
    np.testing.assert_array_equal(y, x.astype(np.float32))


@pytest.mark.parametrize(
    ("audio", "from_hz", "to_hz", "match"),
    [
        (np.zeros((2, 10), np.float32), 24000, 16000, "1-D"),
        (np.zeros(10, np.float32), 0, 16000, "positive integers"),
        (np.zeros(10, np.float32), 24000, -1, "positive integers"),
        (np.zeros(10, np.float32), 22050.5, 16000, "positive integers"),
    ],
)
def test_resample_rejects_bad_input(audio, from_hz, to_hz, match) -> None:
    with pytest.raises(ValueError, match=match):
        resample_like_upstream(audio, from_hz, to_hz)
