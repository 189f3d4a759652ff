"""Mel-side helpers of the flow stage: speed resampling.

Source (FunAudioLLM/CosyVoice, commit ace7c47): ``cosyvoice/cli/model.py``
``CosyVoice3Model.token2wav`` (``speed`` resamples the mel with ``F.interpolate(mode="linear")``
to ``int(frames / speed)`` frames).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]


def resample_mel_linear(
    mel: FloatArray, n_out_frames: int, scale: float | None = None
) -> FloatArray:
    """Linear resampling along time, like ``F.interpolate(mode="linear", align_corners=False)``.

    Output frame j reads the input at ``src = max(scale * (j + 0.5) - 0.5, 0)`` and mixes frames
    ``floor(src)`` and ``floor(src) + 1`` (clamped to the last frame).

    Args:
        mel: float32 [80, F_in] (F_in >= 1).
        n_out_frames: output frames.
        scale: input frames per output frame; ``None`` uses ``F_in / n_out_frames`` (what
            PyTorch does when given ``size``).

    Returns:
        float32 [80, n_out_frames].
    """
    n_in = mel.shape[1]
    if n_out_frames <= 0 or n_in == 0:
        return np.zeros((mel.shape[0], 0), dtype=np.float32)
    step = n_in / n_out_frames if scale is None else scale
    return _interpolate_frames(mel, np.arange(n_out_frames), step)


def _interpolate_frames(mel: FloatArray, out_idx: npt.NDArray[np.int_], scale: float) -> FloatArray:
    n_in = mel.shape[1]
    src = np.maximum(scale * (out_idx.astype(np.float64) + 0.5) - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    hi = np.minimum(lo + 1, n_in - 1)
    lam = (src - lo).astype(np.float32)
    out = mel[:, lo] * (1.0 - lam) + mel[:, hi] * lam
    return np.asarray(out, dtype=np.float32)


class SpeedResampler:
    """Per-request, per-utterance mel resampler for ``speed != 1`` that also works streamed.

    Upstream (model.py ``CosyVoice3Model.token2wav``) supports speed only in one-shot mode. Here
    a one-shot call (the first push is final) matches ``F.interpolate`` exactly (scale
    ``F_in / int(F_in / speed)``); streamed pushes use the constant scale ``speed`` and emit an
    output frame as soon as both input frames it mixes exist. Either way the utterance ends with
    ``int(F_total / speed)`` frames.
    """

    def __init__(self, speed: float) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.speed = float(speed)
        self._mel: FloatArray | None = None
        self._emitted_frames = 0
        self._pushed = False

    def push(self, new_mel: FloatArray, final: bool) -> FloatArray:
        """Add float32 [80, k] mel frames; return the resampled frames that became ready."""
        first_push = not self._pushed
        self._pushed = True
        mel = new_mel if self._mel is None else np.concatenate([self._mel, new_mel], axis=1)
        self._mel = mel
        if self.speed == 1.0:
            self._mel = mel[:, :0]
            return new_mel
        n_in = mel.shape[1]
        if n_in == 0:
            return mel
        if final:
            end = int(n_in / self.speed)
            if first_push:
                return resample_mel_linear(mel, end)
        else:
            # frame j needs input frame floor(src_j) + 1 <= n_in - 1
            end = math.floor((n_in - 1.5) / self.speed - 0.5) + 1
            end = min(max(end, 0), int(n_in / self.speed))
        if end <= self._emitted_frames:
            return mel[:, :0]
        out = _interpolate_frames(mel, np.arange(self._emitted_frames, end), self.speed)
        self._emitted_frames = end
        return out
