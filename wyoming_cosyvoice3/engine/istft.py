"""The iSTFT and its periodic Hann window: pure numpy.

Used by the voice features, the vocoder and the derivations (the streamed vocoder's check
compares audio). The iSTFT follows FunAudioLLM/CosyVoice ace7c47,
``cosyvoice/hifigan/generator.py`` ``HiFTGenerator._istft`` (``torch.istft``, n_fft 16, hop 4,
periodic Hann, centred) and the magnitude clip at 100 (``torch.clip(magnitude, max=1e2)``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from . import constants as C

F32 = npt.NDArray[np.float32]


def periodic_hann(length: int) -> npt.NDArray[np.float64]:
    """Periodic Hann window ``0.5 - 0.5 cos(2 pi n / length)``, float64 ``[length]``.

    Equals ``torch.hann_window(length)`` and ``scipy.signal.get_window("hann", length,
    fftbins=True)``, the windows used by whisper, matcha and HiFT.
    """
    n = np.arange(length, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * n / length)


def istft(magnitude: npt.ArrayLike, phase: npt.ArrayLike) -> F32:
    """Inverse STFT of HiFT's output: ``torch.istft`` with n_fft 16, hop 4, centre (spec 6).

    Upstream ``generator.py HiFTGenerator._istft``: the magnitude is clipped at 100, the
    spectrum ``m cos(p) + i m sin(p)`` is inverted frame by frame (inverse real FFT of 16
    points), each frame is multiplied by the periodic Hann window of 16 and overlap-added with
    hop 4; the sum is divided by the overlap-added squared window; ``n_fft // 2`` = 8 samples
    are dropped at each end (``center=True``).

    Args:
        magnitude: float ``[9, F]`` or ``[1, 9, F]`` (frequency bins x STFT frames).
        phase: same shape as ``magnitude``, radians.

    Returns:
        float32 ``[4 * (F - 1)]`` samples (``480 * M`` for the ``120 * M + 1`` frames HiFT
        returns for M mel frames); not clamped to the audio limit.

    Raises:
        ValueError: shapes differ or the bin count is not 9.
    """
    mag = np.asarray(magnitude, dtype=np.float32)
    ph = np.asarray(phase, dtype=np.float32)
    if mag.shape != ph.shape:
        raise ValueError(f"istft: magnitude {mag.shape} and phase {ph.shape} differ")
    if mag.ndim == 3 and mag.shape[0] == 1:
        mag, ph = mag[0], ph[0]
    bins = C.ISTFT_N_FFT // 2 + 1
    if mag.ndim != 2 or mag.shape[0] != bins:
        raise ValueError(f"istft: expected [{bins}, frames], got {mag.shape}")
    count = mag.shape[1]
    if count < 2:
        return np.zeros(0, dtype=np.float32)
    mag = np.minimum(mag, np.float32(C.MAGNITUDE_CLIP))
    spectrum = np.empty(mag.shape, dtype=np.complex64)
    spectrum.real = mag * np.cos(ph)
    spectrum.imag = mag * np.sin(ph)
    # inverse real FFT per frame (column), then the periodic Hann window: [16, F] float32
    frames = np.fft.irfft(spectrum, n=C.ISTFT_N_FFT, axis=0).astype(np.float32, copy=False)
    frames *= periodic_hann(C.ISTFT_N_FFT).astype(np.float32)[:, np.newaxis]
    signal = _overlap_add(frames, C.ISTFT_HOP)
    envelope = _window_envelope(count)
    trim = C.ISTFT_N_FFT // 2
    return np.ascontiguousarray(signal[trim:-trim] / envelope[trim:-trim], dtype=np.float32)


def _overlap_add(frames: npt.NDArray[np.floating], hop: int) -> F32:
    """Overlap-add frames given as columns ``[n_fft, F]`` at ``hop`` (n_fft a multiple of hop).

    Returns float32 ``[n_fft + hop * (F - 1)]``: frame ``f`` starts at sample ``hop * f``.
    """
    n_fft, count = frames.shape
    parts = n_fft // hop
    blocks = np.zeros((count + parts - 1, hop), dtype=np.float32)
    for part in range(parts):  # 4 shifted additions, each vectorised over all frames
        blocks[part : part + count] += frames[part * hop : (part + 1) * hop].T
    return blocks.reshape(-1)


def _window_envelope(count: int) -> F32:
    """Overlap-added squared periodic Hann window of ``count`` frames (n_fft 16, hop 4).

    This is the ``window_envelop`` that ``torch.istft`` divides by: constant (1.5) inside,
    smaller in the first and last three hops where fewer frames overlap.

    Returns:
        float32 ``[16 + 4 * (count - 1)]``.
    """
    hop = C.ISTFT_HOP
    squared = (periodic_hann(C.ISTFT_N_FFT) ** 2).reshape(-1, hop)  # [parts, hop]
    parts = squared.shape[0]
    total_blocks = count + parts - 1
    blocks = np.empty((total_blocks, hop), dtype=np.float32)
    blocks[:] = squared.sum(axis=0)
    edge_blocks = set(range(min(parts - 1, total_blocks)))
    edge_blocks |= set(range(max(count, 0), total_blocks))
    for block in sorted(edge_blocks):  # at most 2 * (parts - 1) blocks
        first = max(0, block - count + 1)
        last = min(parts - 1, block)
        blocks[block] = squared[first : last + 1].sum(axis=0)
    return blocks.reshape(-1)
