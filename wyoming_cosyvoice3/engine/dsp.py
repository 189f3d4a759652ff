"""Signals shared by the stages and the derivations: pure numpy.

* The iSTFT and its periodic Hann window, used by the voice features, the vocoder and the
  derivations (the streamed vocoder's check compares audio). The iSTFT follows
  FunAudioLLM/CosyVoice ace7c47, ``cosyvoice/hifigan/generator.py`` ``HiFTGenerator._istft``
  (``torch.istft``, n_fft 16, hop 4, periodic Hann, centred) and the magnitude clip at 100
  (``torch.clip(magnitude, max=1e2)``).
* A request's seeded random streams (:func:`request_streams`): one seed gives three
  independent streams, RAS sampling (used only by the LLM decoder, which may run in a producer
  thread), the flow noise and the vocoder noise (both used only by the consumer), so
  overlapping decoding with the flow leaves every stream's draws unchanged. The flow and the
  vocoder draw from per-request noise buffers (:class:`GrowingNoise`; source: the same commit,
  ``cosyvoice/flow/flow_matching.py`` ``CausalConditionalCFM.rand_noise`` and
  ``cosyvoice/hifigan/generator.py``, the source noise of ``SineGen2``).
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


# -- a request's seeded noise streams ---------------------------------------------------------

FLOW_NOISE_BLOCK_FRAMES = 1000
VOCODER_NOISE_BLOCK_SAMPLES = 480 * 500


class GrowingNoise:
    """A per-request noise buffer that grows in fixed blocks, so its prefix never changes.

    Streamed and one-shot synthesis of the same request read identical noise for every frame,
    whatever lengths they ask for: upstream keeps one fixed buffer for the same reason
    (flow_matching.py ``CausalConditionalCFM.rand_noise``; generator.py source noise).

    Args:
        rng: the request's generator for this buffer (not shared with sampling).
        channels: values per frame (80 mel bins for the flow, 9 for the vocoder).
        kind: ``"normal"`` (N(0,1)) or ``"uniform"`` (U[0,1)).
        block_frames: frames drawn at a time.
    """

    def __init__(
        self, rng: np.random.Generator, channels: int, kind: str, block_frames: int = 1000
    ) -> None:
        if kind not in ("normal", "uniform"):
            raise ValueError(f"kind must be normal or uniform, got {kind!r}")
        self._rng = rng
        self.channels = channels
        self.kind = kind
        self.block_frames = block_frames
        self._data = np.zeros((0, channels), dtype=np.float32)

    def take(self, n_frames: int) -> F32:
        """float32 [n_frames, channels], the first ``n_frames`` frames of the buffer (a view)."""
        if n_frames > self._data.shape[0]:
            missing = n_frames - self._data.shape[0]
            n_blocks = -(-missing // self.block_frames)
            blocks = [self._data]
            for _ in range(n_blocks):
                shape = (self.block_frames, self.channels)
                if self.kind == "normal":
                    blocks.append(self._rng.standard_normal(shape, dtype=np.float32))
                else:
                    blocks.append(self._rng.random(shape, dtype=np.float32))
            self._data = np.concatenate(blocks, axis=0)
        return self._data[:n_frames]


def request_streams(seed: int) -> tuple[np.random.Generator, GrowingNoise, GrowingNoise]:
    """The three independent random streams of a request with ``seed``: the RAS sampling
    generator, the flow noise (N(0,1), 80 mel bins per frame) and the vocoder source noise
    (U[0,1), 9 harmonic channels per sample), spawned from one ``SeedSequence(seed)``.

    Separate streams let the LLM decode in its own thread (it draws only from the first)
    while the flow and the vocoder draw from theirs, so every stream's draws stay the same.
    """
    sampling_seq, flow_seq, voc_seq = np.random.SeedSequence(seed).spawn(3)
    return (
        np.random.default_rng(sampling_seq),
        GrowingNoise(
            np.random.default_rng(flow_seq), C.MEL_BINS, "normal", FLOW_NOISE_BLOCK_FRAMES
        ),
        GrowingNoise(
            np.random.default_rng(voc_seq),
            C.HARMONIC_CHANNELS,
            "uniform",
            VOCODER_NOISE_BLOCK_SAMPLES,
        ),
    )
