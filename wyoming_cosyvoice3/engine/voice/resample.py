"""Resampling of reference clips exactly as upstream does it (windowed-sinc, torchaudio defaults).

Upstream loads every prompt clip with ``cosyvoice/utils/file_utils.py load_wav``, which calls
``torchaudio.transforms.Resample(orig_freq, new_freq)`` with its defaults: method
``sinc_interp_hann``, ``lowpass_filter_width`` 6, ``rolloff`` 0.99, kernel computed in float64
and stored as float32 (``torchaudio/transforms/_transforms.py Resample``). The model was trained
on features of audio resampled that way, so the features of a voice prompt (Whisper log-mel,
Kaldi fbank, 24 kHz prompt mel) must start from the same samples; a different resampler (soxr)
changes them above about 7 kHz enough to change prompt speech tokens.

The filter, after torchaudio ``functional/functional.py`` ``_get_sinc_resample_kernel`` and
``_apply_sinc_resample_kernel`` (Smith, "Digital Audio Resampling",
https://ccrma.stanford.edu/~jos/resample/): both rates are divided by their gcd (``o`` input,
``n`` output samples per period). The cutoff is ``base = min(o, n) * rolloff`` (in units where
the input rate is ``o``); output sample ``j`` of a period (``0 <= j < n``) is

    y[q n + j] = sum_i x[q o + i] h_j(i),
    h_j(i) = (base / o) sin(pi t) / (pi t) cos^2(pi t / (2 w)),
    t = clamp((i / o - j / n) base, -w, w)  (h = base / o at t = 0)

with ``w = lowpass_filter_width`` zero crossings on each side, ``x`` zero outside the clip
(``width = ceil(w o / base)`` input samples of zero padding on the left), and
``ceil(n N / o)`` output samples for ``N`` input samples. torchaudio evaluates ``h_j`` over a
dense ``[n, 2 width + o]`` kernel applied by a strided convolution; only about ``2 width + 1``
taps per phase are non-zero (the rest underflow to exactly 0 in float32), so this module keeps
those taps per phase (``[n, 2 width + 2]``) and applies each phase as a strided dot product
(or, for rate pairs with very many phases such as 22051 -> 16000 Hz, gathers each output's
inputs in bounded blocks): the same values, with memory bounded for any rate pair.
``j / n`` is rounded to float32 before it enters the float64 kernel, as torchaudio's
``torch.arange(...) / new_freq`` does (on the shared 22.05 kHz clip this takes the distance
to upstream's 16 kHz waveform from 4.6e-6 to 1.2e-7); sums are taken in float64 (torch sums
float32 products in float32), so results agree with torchaudio to float32 rounding (~1e-7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

LOWPASS_FILTER_WIDTH = 6
"""Zero crossings of the sinc on each side (torchaudio ``Resample`` default)."""
ROLLOFF = 0.99
"""Cutoff as a fraction of the lower Nyquist frequency (torchaudio ``Resample`` default)."""
BLOCK_OUTPUT_SAMPLES = 1 << 16
"""Output samples per block of the gather path (bounds its ``[block, taps]`` arrays, ~10 MB)."""
PHASE_LOOP_MAX_PHASES = 2048
"""Up to this many output phases (reduced output rate), one strided dot product per phase
(every common rate pair: 22.05/44.1/48 kHz -> 16/24 kHz have at most 320); beyond it, the
per-phase loop would cost more than gathering every output's inputs."""


@dataclass(frozen=True)
class SincKernel:
    """Per-phase taps of torchaudio's windowed-sinc resampling kernel for one rate pair.

    Attributes:
        orig: input samples per period (input rate / gcd).
        new: output samples per period (output rate / gcd).
        width: zero padding before the clip in input samples (torchaudio ``width``).
        taps: float32 ``[new, L]`` non-zero part of each phase's row of torchaudio's kernel.
        starts: int64 ``[new]`` index of ``taps[j, 0]`` in torchaudio's kernel row, i.e. the
            input sample ``q * orig + starts[j] - width`` feeds ``taps[j, 0]``.
    """

    orig: int
    new: int
    width: int
    taps: npt.NDArray[np.float32]
    starts: npt.NDArray[np.int64]


@lru_cache(maxsize=8)
def sinc_kernel(
    from_hz: int,
    to_hz: int,
    lowpass_filter_width: int = LOWPASS_FILTER_WIDTH,
    rolloff: float = ROLLOFF,
) -> SincKernel:
    """The windowed-sinc (Hann) kernel torchaudio's ``Resample(from_hz, to_hz)`` uses.

    Raises:
        ValueError: a rate is not a positive integer, or ``lowpass_filter_width <= 0``.
    """
    if int(from_hz) != from_hz or int(to_hz) != to_hz or from_hz <= 0 or to_hz <= 0:
        raise ValueError(f"resample: rates must be positive integers, got {from_hz} -> {to_hz}")
    if lowpass_filter_width <= 0:
        raise ValueError(f"resample: lowpass_filter_width must be > 0, got {lowpass_filter_width}")
    gcd = math.gcd(int(from_hz), int(to_hz))
    orig, new = int(from_hz) // gcd, int(to_hz) // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    phases = np.arange(new, dtype=np.int64)
    # Row j of torchaudio's kernel is non-zero only near column (j * orig) // new + width: the
    # taps width + 1 before and after it have |t| >= lowpass_filter_width, where the Hann window
    # is cos(pi/2)^2 ~ 4e-33 and the float32 kernel value is exactly 0.
    count = 2 * width + 2
    starts = (phases * orig) // new
    columns = starts[:, None] + np.arange(count, dtype=np.int64)[None, :]
    inside = columns < 2 * width + orig  # torchaudio's kernel has 2 * width + orig columns
    idx = (columns - width).astype(np.float64) / orig  # torchaudio: arange(-width, ...) / orig
    # torchaudio: torch.arange(0, -new, -1) / new is an int64 tensor divided in float32
    phase_offset = (np.float32(-1.0) * phases.astype(np.float32)) / np.float32(new)
    t = phase_offset.astype(np.float64)[:, None] + idx
    t *= base
    t = np.clip(t, -lowpass_filter_width, lowpass_filter_width)
    window = np.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    safe = np.where(t == 0.0, 1.0, t)
    kernel = np.where(t == 0.0, 1.0, np.sin(safe) / safe)
    kernel *= window * (base / orig)
    kernel[~inside] = 0.0
    taps = np.ascontiguousarray(kernel, dtype=np.float32)
    taps.setflags(write=False)
    starts.setflags(write=False)
    return SincKernel(orig=orig, new=new, width=width, taps=taps, starts=starts)


def output_length(input_samples: int, from_hz: int, to_hz: int) -> int:
    """Samples torchaudio's resampler returns: ``ceil(to_hz * N / from_hz)`` (reduced rates)."""
    gcd = math.gcd(int(from_hz), int(to_hz))
    orig, new = int(from_hz) // gcd, int(to_hz) // gcd
    return math.ceil(new * input_samples / orig)


def resample_like_upstream(
    audio: npt.ArrayLike,
    from_hz: int,
    to_hz: int,
    lowpass_filter_width: int = LOWPASS_FILTER_WIDTH,
    rolloff: float = ROLLOFF,
) -> npt.NDArray[np.float32]:
    """Resample float ``[N]`` audio as ``torchaudio.transforms.Resample(from_hz, to_hz)`` does.

    Args:
        audio: 1-D float samples (any float dtype; computed from their float32 values).
        from_hz, to_hz: integer sample rates in Hz.
        lowpass_filter_width, rolloff: torchaudio's filter parameters (defaults as upstream).

    Returns:
        float32 ``[ceil(N * to_hz / from_hz)]`` (with reduced rates; a float32 copy when the
        rates are equal, as torchaudio returns its input unchanged).

    Raises:
        ValueError: ``audio`` is not 1-D, or a rate is not a positive integer.
    """
    samples = np.ascontiguousarray(audio, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"resample: expected 1-D samples, got shape {samples.shape}")
    kernel = sinc_kernel(from_hz, to_hz, lowpass_filter_width, rolloff)
    if from_hz == to_hz:
        return samples.copy()
    total = output_length(samples.shape[0], from_hz, to_hz)
    count = kernel.taps.shape[1]
    # zeros: width before the clip (torchaudio's padding), enough after it for the last taps
    padded = np.zeros(kernel.width + samples.shape[0] + kernel.width + kernel.orig + count)
    padded[kernel.width : kernel.width + samples.shape[0]] = samples
    if kernel.new <= PHASE_LOOP_MAX_PHASES:
        return _apply_by_phase(padded, kernel, total)
    return _apply_by_gather(padded, kernel, total)


def _apply_by_phase(
    padded: npt.NDArray[np.float64], kernel: SincKernel, total: int
) -> npt.NDArray[np.float32]:
    """Each phase j as one strided dot product: y[q n + j] = window(q o + start_j) . taps[j]."""
    count = kernel.taps.shape[1]
    periods = -(-total // kernel.new)
    windows = np.lib.stride_tricks.sliding_window_view(padded, count)
    out = np.empty((periods, kernel.new), dtype=np.float64)
    for phase in range(kernel.new):
        rows = windows[int(kernel.starts[phase]) :: kernel.orig][:periods]
        out[:, phase] = np.einsum("qk,k->q", rows, kernel.taps[phase].astype(np.float64))
    return np.ascontiguousarray(out.reshape(-1)[:total], dtype=np.float32)


def _apply_by_gather(
    padded: npt.NDArray[np.float64], kernel: SincKernel, total: int
) -> npt.NDArray[np.float32]:
    """Blocks of outputs, each gathering its taps' inputs (many phases: no per-phase loop)."""
    taps = kernel.taps.astype(np.float64)
    offsets = np.arange(taps.shape[1], dtype=np.int64)[None, :]
    out = np.empty(total, dtype=np.float32)
    for begin in range(0, total, BLOCK_OUTPUT_SAMPLES):
        index = np.arange(begin, min(begin + BLOCK_OUTPUT_SAMPLES, total), dtype=np.int64)
        period, phase = np.divmod(index, kernel.new)
        first = period * kernel.orig + kernel.starts[phase]
        gathered = padded[first[:, None] + offsets]
        out[begin : begin + index.shape[0]] = np.einsum("bk,bk->b", gathered, taps[phase])
    return out
