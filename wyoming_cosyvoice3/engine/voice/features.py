"""Features of the voice prompt: pure numpy functions.

Every function reproduces one upstream feature extractor of Fun-CosyVoice3 without torch:

* :func:`whisper_log_mel` - input of ``speech_tokenizer_v3.onnx``
  (upstream: ``whisper.log_mel_spectrogram(speech, n_mels=128)`` called by
  ``cosyvoice/cli/frontend.py`` ``CosyVoiceFrontEnd._extract_speech_token``).
* :func:`kaldi_fbank` - input of ``campplus.onnx``
  (upstream: ``torchaudio.compliance.kaldi.fbank(speech, num_mel_bins=80, dither=0,
  sample_frequency=16000)`` minus its mean, ``frontend.py _extract_spk_embedding``).
* :func:`prompt_mel` - the flow's prompt mel (upstream: ``matcha.utils.audio.mel_spectrogram``
  with the ``feat_extractor`` settings of ``cosyvoice3.yaml``;
  ``frontend.py _extract_speech_feat``).

All audio is float32 in [-1, 1] (what ``torchaudio.load`` returns and upstream feeds to each
extractor). Arrays are 1-D ``[N]`` samples unless stated otherwise.
"""

from __future__ import annotations

from functools import lru_cache

import kaldi_native_fbank as knf
import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..istft import periodic_hann

F32 = npt.NDArray[np.float32]

# --- Whisper log-mel (openai-whisper audio.py: N_FFT, HOP_LENGTH, log_mel_spectrogram) -------
WHISPER_N_FFT = 400
WHISPER_HOP_SAMPLES = 160
WHISPER_MEL_BINS = 128
WHISPER_LOG_FLOOR = 1e-10
WHISPER_DYNAMIC_RANGE = 8.0
"""log10 units kept below the maximum (whisper audio.py ``log_spec.max() - 8.0``)."""

# --- Kaldi fbank (torchaudio.compliance.kaldi.fbank defaults, frontend.py arguments) --------
FBANK_MEL_BINS = 80
FBANK_FRAME_LENGTH_MS = 25.0
FBANK_FRAME_SHIFT_MS = 10.0
FBANK_PREEMPHASIS = 0.97
FBANK_LOW_HZ = 20.0
FBANK_HIGH_HZ = 0.0
"""0 means the Nyquist frequency in Kaldi's convention (torchaudio ``high_freq=0.0``)."""

# --- Matcha mel of the 24 kHz prompt (cosyvoice3.yaml feat_extractor) ----------------------
PROMPT_N_FFT = 1920
PROMPT_HOP_SAMPLES = C.SAMPLES_PER_MEL_FRAME
PROMPT_PAD_SAMPLES = (PROMPT_N_FFT - PROMPT_HOP_SAMPLES) // 2
"""Reflect padding on each side, 720 (matcha audio.py ``(n_fft - hop_size) / 2``)."""
PROMPT_MAGNITUDE_EPS = 1e-9
"""Added under the square root of the magnitude (matcha audio.py ``spec.pow(2).sum(-1) + 1e-9``)."""
PROMPT_LOG_FLOOR = 1e-5
"""Floor before the natural log (matcha audio.py ``dynamic_range_compression_torch`` clip_val)."""


def _hz_to_slaney_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's mel scale (Auditory Toolbox): linear to 1 kHz (3 mel per 200 Hz), then log."""
    linear_step_hz = 200.0 / 3.0
    knee_hz = 1000.0
    knee_mel = knee_hz / linear_step_hz
    log_step = np.log(6.4) / 27.0
    mel = hz / linear_step_hz
    above = hz >= knee_hz
    mel[above] = knee_mel + np.log(hz[above] / knee_hz) / log_step
    return mel


def _slaney_mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Inverse of :func:`_hz_to_slaney_mel`."""
    linear_step_hz = 200.0 / 3.0
    knee_hz = 1000.0
    knee_mel = knee_hz / linear_step_hz
    log_step = np.log(6.4) / 27.0
    hz = mel * linear_step_hz
    above = mel >= knee_mel
    hz[above] = knee_hz * np.exp(log_step * (mel[above] - knee_mel))
    return hz


@lru_cache(maxsize=8)
def slaney_mel_filters(
    sample_rate_hz: int, n_fft: int, n_mels: int, fmin_hz: float = 0.0, fmax_hz: float | None = None
) -> F32:
    """Triangular mel filterbank on Slaney's scale with Slaney area normalisation.

    Same definition as ``librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax, htk=False,
    norm="slaney")``, which whisper (``mel_filters.npz``) and matcha (``librosa_mel_fn``) use:
    ``n_mels + 2`` points equally spaced in mel between ``fmin_hz`` and ``fmax_hz`` (default
    Nyquist) give the corners of each triangle over the FFT bin frequencies; each triangle is
    scaled by ``2 / (upper_hz - lower_hz)``.

    Returns:
        float32 ``[n_mels, n_fft // 2 + 1]`` (read-only; cached per argument set).
    """
    top_hz = sample_rate_hz / 2.0 if fmax_hz is None else float(fmax_hz)
    bin_hz = np.linspace(0.0, sample_rate_hz / 2.0, n_fft // 2 + 1)
    mel_edges = np.linspace(
        _hz_to_slaney_mel(np.array([float(fmin_hz)]))[0],
        _hz_to_slaney_mel(np.array([top_hz]))[0],
        n_mels + 2,
    )
    corner_hz = _slaney_mel_to_hz(mel_edges)
    width_hz = np.diff(corner_hz)  # [n_mels + 1]
    offsets = corner_hz[:, None] - bin_hz[None, :]  # [n_mels + 2, bins]
    rising = -offsets[:-2] / width_hz[:-1, None]
    falling = offsets[2:] / width_hz[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (corner_hz[2:] - corner_hz[:-2]))[:, None]
    out = weights.astype(np.float32)
    out.setflags(write=False)
    return out


def _frames(padded: npt.NDArray[np.float64], n_fft: int, hop: int) -> npt.NDArray[np.float64]:
    """View ``[num_frames, n_fft]`` of a 1-D signal, ``1 + (len - n_fft) // hop`` frames."""
    count = 1 + (padded.shape[0] - n_fft) // hop
    if count <= 0:
        return np.zeros((0, n_fft), dtype=padded.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(padded, n_fft)
    return windows[: (count - 1) * hop + 1 : hop]


def _as_mono_f64(audio: npt.ArrayLike, name: str) -> npt.NDArray[np.float64]:
    samples = np.asarray(audio, dtype=np.float64)
    if samples.ndim != 1:
        raise ValueError(f"{name}: expected 1-D samples, got shape {samples.shape}")
    return samples


def whisper_log_mel(audio_16k: npt.ArrayLike) -> F32:
    """Whisper 128-bin log-mel of 16 kHz audio: the speech tokenizer's input.

    Follows openai-whisper ``audio.py log_mel_spectrogram`` (called with ``n_mels=128`` by
    ``frontend.py _extract_speech_token``): ``torch.stft`` with n_fft 400, hop 160, periodic
    Hann, ``center=True`` (reflect pad 200 each side); power ``|X|^2``; the last frame is
    dropped; Slaney mel filters (sr 16000, n_fft 400, 128 bins); ``log10(max(x, 1e-10))``;
    values more than 8 below the maximum are raised to ``max - 8``; then ``(x + 4) / 4``.

    Args:
        audio_16k: float ``[N]`` samples at 16 kHz in [-1, 1], N >= 2.

    Returns:
        float32 ``[128, N // 160]`` (mel bins x frames, 100 frames/s).
    """
    samples = _as_mono_f64(audio_16k, "whisper_log_mel")
    pad = WHISPER_N_FFT // 2
    padded = np.pad(samples, pad, mode="reflect")
    frames = _frames(padded, WHISPER_N_FFT, WHISPER_HOP_SAMPLES)[:-1]  # drop the last frame
    spectrum = np.fft.rfft(frames * periodic_hann(WHISPER_N_FFT), axis=1)
    power = spectrum.real**2 + spectrum.imag**2  # [T, 201]
    filters = slaney_mel_filters(C.FEATURE_SAMPLE_RATE_HZ, WHISPER_N_FFT, WHISPER_MEL_BINS)
    mel = filters.astype(np.float64) @ power.T  # [128, T]
    log_mel = np.log10(np.maximum(mel, WHISPER_LOG_FLOOR))
    if log_mel.size:
        log_mel = np.maximum(log_mel, log_mel.max() - WHISPER_DYNAMIC_RANGE)
    return ((log_mel + 4.0) / 4.0).astype(np.float32)


def fbank_options() -> knf.FbankOptions:
    """kaldi-native-fbank options equal to upstream's ``kaldi.fbank`` call.

    ``torchaudio.compliance.kaldi.fbank`` defaults plus ``num_mel_bins=80, dither=0,
    sample_frequency=16000`` (``frontend.py _extract_spk_embedding``): 25 ms frames every 10 ms,
    ``snip_edges`` (only whole frames), DC removal, pre-emphasis 0.97, Povey window, FFT size
    rounded up to 512, power spectrum, Kaldi mel bins 20 Hz .. Nyquist, no energy term, natural
    log with a float32-epsilon floor.
    """
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = float(C.FEATURE_SAMPLE_RATE_HZ)
    opts.frame_opts.frame_length_ms = FBANK_FRAME_LENGTH_MS
    opts.frame_opts.frame_shift_ms = FBANK_FRAME_SHIFT_MS
    opts.frame_opts.dither = 0.0
    opts.frame_opts.preemph_coeff = FBANK_PREEMPHASIS
    opts.frame_opts.remove_dc_offset = True
    opts.frame_opts.window_type = "povey"
    opts.frame_opts.round_to_power_of_two = True
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = FBANK_MEL_BINS
    opts.mel_opts.low_freq = FBANK_LOW_HZ
    opts.mel_opts.high_freq = FBANK_HIGH_HZ
    opts.use_energy = False
    opts.use_log_fbank = True
    opts.use_power = True
    return opts


def kaldi_fbank(audio_16k: npt.ArrayLike) -> F32:
    """Mean-normalised 80-bin Kaldi fbank of 16 kHz audio: the CAM++ speaker encoder's input.

    Computed with kaldi-native-fbank using :func:`fbank_options`. Upstream passes the float
    waveform in [-1, 1] without scaling to 16-bit range, and so does this function. The mean of
    each bin over time is subtracted afterwards (``feat - feat.mean(dim=0, keepdim=True)``).

    Args:
        audio_16k: float ``[N]`` samples at 16 kHz in [-1, 1].

    Returns:
        float32 ``[T, 80]`` with ``T = 1 + (N - 400) // 160`` (0 rows when N < 400).
    """
    samples = np.ascontiguousarray(_as_mono_f64(audio_16k, "kaldi_fbank"), dtype=np.float32)
    computer = knf.OnlineFbank(fbank_options())
    computer.accept_waveform(float(C.FEATURE_SAMPLE_RATE_HZ), samples)
    computer.input_finished()
    count = computer.num_frames_ready
    feats = np.empty((count, FBANK_MEL_BINS), dtype=np.float32)
    for index in range(count):
        feats[index] = computer.get_frame(index)
    if count:
        feats -= feats.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32)
    return feats


def prompt_mel(audio_24k: npt.ArrayLike) -> F32:
    """80-bin natural-log mel of 24 kHz audio at 50 frames/s: the flow's prompt mel.

    Follows ``matcha/utils/audio.py mel_spectrogram`` with ``cosyvoice3.yaml`` ``feat_extractor``
    (n_fft 1920, hop 480, win 1920, 80 mels, fmin 0, fmax null = 12 kHz, center False):
    reflect pad 720 samples on both sides; STFT with a periodic Hann window and no centring;
    magnitude ``sqrt(re^2 + im^2 + 1e-9)``; Slaney mel filters (sr 24000, n_fft 1920);
    ``ln(max(x, 1e-5))``.

    Args:
        audio_24k: float ``[N]`` samples at 24 kHz in [-1, 1], N > 720.

    Returns:
        float32 ``[N // 480, 80]`` (frames x mel bins).
    """
    samples = _as_mono_f64(audio_24k, "prompt_mel")
    padded = np.pad(samples, PROMPT_PAD_SAMPLES, mode="reflect")
    frames = _frames(padded, PROMPT_N_FFT, PROMPT_HOP_SAMPLES)
    spectrum = np.fft.rfft(frames * periodic_hann(PROMPT_N_FFT), axis=1)
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + PROMPT_MAGNITUDE_EPS)  # [F, 961]
    filters = slaney_mel_filters(C.OUTPUT_SAMPLE_RATE_HZ, PROMPT_N_FFT, C.MEL_BINS)
    mel = magnitude @ filters.T.astype(np.float64)  # [F, 80]
    return np.log(np.maximum(mel, PROMPT_LOG_FLOOR)).astype(np.float32)
