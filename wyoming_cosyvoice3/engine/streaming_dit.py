"""Upstream's static chunk mask for the streaming DiT, as an additive attention bias.

cosyvoice/flow/DiT/dit.py ``DiT.forward(streaming=True)`` builds
``add_optional_chunk_mask(x, mask, False, False, 0, static_chunk_size=50, -1)``
(cosyvoice/utils/mask.py ``subsequent_chunk_mask``): mel frame i may attend to frame j iff
``j < (i // 50 + 1) * 50``, chunks counted from frame 0 of the prompt, every left chunk kept.
Shared by the derivation (:mod:`.derive.flow.streaming_estimator`, validation) and the chunked flow
solver.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

CHUNK_FRAMES = 50
"""Static chunk in mel frames (cosyvoice3.yaml DiT ``static_chunk_size``; model.py:
"token_hop_len must match training static_chunk_size", 25 tokens x 2 frames)."""
NEG_INF = np.float32(-np.inf)


def chunk_attention_bias(
    start: int, count: int, cached: int, chunk_frames: int = CHUNK_FRAMES
) -> npt.NDArray[np.float32]:
    """Additive attention bias float32 [1, 1, count, cached + count].

    Rows: new frames ``start .. start + count - 1`` (absolute indices); columns: the
    ``cached`` frames just before ``start``, then the new frames. 0 where the static chunk
    mask allows attention, -inf elsewhere. Cached frames are always visible (they belong to
    earlier chunks when ``start`` is on the chunk grid, which upstream's schedule guarantees).
    ``chunk_frames <= 0``: full attention (all zeros).
    """
    bias = np.zeros((1, 1, count, cached + count), dtype=np.float32)
    if chunk_frames <= 0 or count == 0:
        return bias
    rows = np.arange(start, start + count)
    keys = np.arange(start, start + count)
    limit = (rows // chunk_frames + 1) * chunk_frames
    bias[0, 0, :, cached:][keys[None, :] >= limit[:, None]] = NEG_INF
    return bias
