"""The vocoder's last step on the host: inverse STFT of HiFT's magnitude and phase, and the
onset fade-in. Pure numpy.

Source: FunAudioLLM/CosyVoice ace7c47, ``cosyvoice/hifigan/generator.py``
``HiFTGenerator._istft`` (``torch.istft``, n_fft 16, hop 4, periodic Hann, centred) and the
magnitude clip at 100 (``torch.clip(magnitude, max=1e2)``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..dsp import istft, periodic_hann

F32 = npt.NDArray[np.float32]
__all__ = ["fade_in", "istft", "periodic_hann"]
"""``istft`` lives in :mod:`..dsp` (the derivations use it too); re-exported here."""


def fade_in(samples: npt.NDArray[np.float32], duration_ms: float, sample_rate_hz: int) -> F32:
    """Return a copy of ``samples`` (float32 ``[N]``) with a raised-cosine fade-in.

    The first ``duration_ms`` ms rise from 0 to 1 (half a Hann period), against the click at
    the start of an utterance (spec section 6). Samples after the ramp are unchanged.
    """
    out = np.array(samples, dtype=np.float32, copy=True)
    length = min(out.shape[0], round(duration_ms * sample_rate_hz / 1000.0))
    if length > 0:
        ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(length, dtype=np.float64) / length)
        out[:length] *= ramp.astype(np.float32)
    return out
