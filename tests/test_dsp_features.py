"""Prompt feature extractors (dsp.py) against library oracles: librosa, kaldi-native-fbank and an
independent numpy implementation of Kaldi's fbank recipe (torchaudio.compliance.kaldi.fbank)."""

from __future__ import annotations

import kaldi_native_fbank as knf
import librosa
import numpy as np
import pytest

from wyoming_cosyvoice3.engine.voice import features as dsp


def _speechy(seconds: float, rate_hz: int, seed: int = 0) -> np.ndarray:
    """Harmonic tone with vibrato plus noise, in [-1, 1]: energy across the whole band."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    f0 = 140.0 + 30.0 * np.sin(2 * np.pi * 3.0 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate_hz
    tone = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 2.0 * t) ** 2
    audio = 0.2 * envelope * tone + 0.01 * rng.standard_normal(t.shape[0])
    return (audio / np.abs(audio).max() * 0.8).astype(np.float32)


# --- Slaney mel filters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate_hz", "n_fft", "n_mels", "fmax_hz"),
    [
        (16000, 400, 128, None),
        (24000, 1920, 80, None),
        (24000, 1920, 80, 8000.0),
        (22050, 1024, 80, None),
    ],
)
def test_slaney_filters_equal_librosa(rate_hz, n_fft, n_mels, fmax_hz):
    ours = dsp.slaney_mel_filters(rate_hz, n_fft, n_mels, 0.0, fmax_hz)
    oracle = librosa.filters.mel(
        sr=rate_hz, n_fft=n_fft, n_mels=n_mels, fmin=0.0, fmax=fmax_hz, htk=False, norm="slaney"
    )
    assert ours.shape == oracle.shape == (n_mels, n_fft // 2 + 1)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, oracle, rtol=1e-5, atol=1e-8)


def test_prompt_filters_reach_nyquist_not_8k():
    filters = dsp.slaney_mel_filters(24000, 1920, 80)
    bin_hz = np.linspace(0, 12000, 961)
    assert bin_hz[filters[-1] > 0].max() > 11000  # fmax null = 12 kHz (cosyvoice3.yaml)


# --- Whisper log-mel ------------------------------------------------------------------------


def _whisper_oracle(audio_16k: np.ndarray) -> np.ndarray:
    stft = librosa.stft(
        audio_16k.astype(np.float64),
        n_fft=400,
        hop_length=160,
        window="hann",
        center=True,
        pad_mode="reflect",
    )
    power = np.abs(stft[:, :-1]) ** 2
    mel = librosa.filters.mel(sr=16000, n_fft=400, n_mels=128) @ power
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


@pytest.mark.parametrize("num_samples", [16000, 16000 * 3 + 77, 48159])
def test_whisper_log_mel_matches_librosa_oracle(num_samples):
    audio = _speechy(num_samples / 16000, 16000)[:num_samples]
    ours = dsp.whisper_log_mel(audio)
    oracle = _whisper_oracle(audio)
    assert ours.shape == (128, num_samples // 160) == oracle.shape
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, oracle, atol=2e-5)


def test_whisper_log_mel_dynamic_range_is_8():
    audio = _speechy(2.0, 16000)
    audio[:8000] = 0.0  # silence drives values to the floor max - 8 (in log10 units, /4)
    ours = dsp.whisper_log_mel(audio)
    assert ours.max() - ours.min() == pytest.approx(2.0, abs=1e-5)


# --- Kaldi fbank ----------------------------------------------------------------------------


def _kaldi_fbank_oracle(audio_16k: np.ndarray) -> np.ndarray:
    """Kaldi's fbank recipe written out (torchaudio.compliance.kaldi.fbank with upstream's
    arguments num_mel_bins=80, dither=0, sample_frequency=16000; other defaults)."""
    frame, shift, fft = 400, 160, 512
    x = audio_16k.astype(np.float64)
    count = 1 + (x.shape[0] - frame) // shift
    frames = np.stack([x[i * shift : i * shift + frame] for i in range(count)])
    frames = frames - frames.mean(axis=1, keepdims=True)
    shifted = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - 0.97 * shifted
    n = np.arange(frame)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * n / (frame - 1))) ** 0.85
    power = np.abs(np.fft.rfft(frames * povey, n=fft, axis=1)) ** 2
    power = power[:, : fft // 2]  # Kaldi's mel banks ignore the Nyquist bin

    def mel(f):
        return 1127.0 * np.log(1.0 + f / 700.0)

    low, high = mel(20.0), mel(8000.0)
    delta = (high - low) / 81
    bin_mel = mel(np.arange(fft // 2) * 16000 / fft)
    banks = np.zeros((80, fft // 2))
    for b in range(80):
        left, centre, right = low + b * delta, low + (b + 1) * delta, low + (b + 2) * delta
        up = (bin_mel - left) / (centre - left)
        down = (right - bin_mel) / (right - centre)
        inside = (bin_mel > left) & (bin_mel < right)
        banks[b] = np.where(inside, np.where(bin_mel <= centre, up, down), 0.0)
    energies = power @ banks.T
    return np.log(np.maximum(energies, np.finfo(np.float32).eps))


def test_kaldi_fbank_shape_and_zero_mean():
    audio = _speechy(2.5, 16000)
    feats = dsp.kaldi_fbank(audio)
    assert feats.shape == (1 + (audio.shape[0] - 400) // 160, 80)
    assert feats.dtype == np.float32
    np.testing.assert_allclose(feats.mean(axis=0), 0.0, atol=1e-4)
    assert feats.std(axis=0).min() > 0.1  # real content, not a constant


def test_kaldi_fbank_equals_kaldi_native_fbank_minus_mean():
    audio = _speechy(2.0, 16000, seed=3)
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = 16000
    opts.mel_opts.num_bins = 80
    computer = knf.OnlineFbank(opts)
    computer.accept_waveform(16000, audio.tolist())
    computer.input_finished()
    raw = np.stack([computer.get_frame(i) for i in range(computer.num_frames_ready)])
    np.testing.assert_allclose(dsp.kaldi_fbank(audio), raw - raw.mean(axis=0), atol=1e-5)


def test_kaldi_fbank_matches_numpy_kaldi_recipe_on_float_scale():
    """Options and input scale against the recipe. Silent and very quiet frames reach the
    epsilon floor, where the input scale ([-1, 1], as upstream feeds torchaudio) shows: an
    int16-scaled oracle disagrees there, the float-scaled one agrees everywhere."""
    audio = _speechy(1.5, 16000, seed=5)
    audio[:4000] = 0.0
    audio[4000:6000] *= 1e-4
    ours = dsp.kaldi_fbank(audio)
    oracle = _kaldi_fbank_oracle(audio)
    oracle -= oracle.mean(axis=0)
    assert ours.shape == oracle.shape
    np.testing.assert_allclose(ours, oracle, atol=1e-3)
    int16_scale = _kaldi_fbank_oracle(audio * 32768.0)
    int16_scale -= int16_scale.mean(axis=0)
    assert np.abs(ours - int16_scale).max() > 1.0


# --- prompt mel -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_samples", [24000, 24000 * 2 + 333, 72000])
def test_prompt_mel_matches_librosa_oracle(num_samples):
    audio = _speechy(num_samples / 24000 + 0.1, 24000)[:num_samples]
    padded = np.pad(audio.astype(np.float64), 720, mode="reflect")
    stft = librosa.stft(
        padded, n_fft=1920, hop_length=480, win_length=1920, window="hann", center=False
    )
    magnitude = np.sqrt(stft.real**2 + stft.imag**2 + 1e-9)
    mel = librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, fmin=0, fmax=None) @ magnitude
    oracle = np.log(np.maximum(mel, 1e-5)).T
    ours = dsp.prompt_mel(audio)
    assert ours.shape == (num_samples // 480, 80) == oracle.shape
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, oracle, atol=2e-5)


def test_prompt_mel_floor_is_ln_1e5():
    silence = np.zeros(24000, dtype=np.float32)
    mel = dsp.prompt_mel(silence)
    # sqrt(1e-9) magnitude through the filters stays below 1e-5: every value is the floor
    np.testing.assert_allclose(mel, np.log(1e-5), rtol=1e-6)

