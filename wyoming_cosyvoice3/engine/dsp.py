"""Signal-processing helpers shared by the voice features and the vocoder: pure numpy."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def periodic_hann(length: int) -> npt.NDArray[np.float64]:
    """Periodic Hann window ``0.5 - 0.5 cos(2 pi n / length)``, float64 ``[length]``.

    Equals ``torch.hann_window(length)`` and ``scipy.signal.get_window("hann", length,
    fftbins=True)``, the windows used by whisper, matcha and HiFT.
    """
    n = np.arange(length, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * n / length)
