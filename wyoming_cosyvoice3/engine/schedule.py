"""The Euler time schedule of the flow, shared by the flow solver and the loaders that
compute a derived DiT's time conditioning ahead of the requests.

Source: FunAudioLLM/CosyVoice ``cosyvoice/flow/flow_matching.py``
``CausalConditionalCFM.forward`` (``t_scheduler == "cosine"``).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt


def cosine_t_schedule(n_steps: int) -> npt.NDArray[np.float32]:
    """Time points of the Euler solver: ``t_k = 1 - cos(k / n * pi / 2)``, k = 0..n.

    Args:
        n_steps: number of Euler steps n (>= 1).

    Returns:
        float32 [n + 1], from 0 to 1 (flow_matching.py ``t_scheduler == "cosine"``).
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    k = np.arange(n_steps + 1, dtype=np.float64)
    return (1.0 - np.cos(k / n_steps * (math.pi / 2.0))).astype(np.float32)
