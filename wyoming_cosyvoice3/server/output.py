"""Audio output helpers shared by the one-shot and streaming paths: PCM conversion, stats."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..engine.constants import OUTPUT_SAMPLE_RATE_HZ

_LOGGER = logging.getLogger(__name__)

SAMPLE_WIDTH_BYTES = 2
"""16-bit PCM: every audio event carries rate 24000, width 2, channels 1."""
CHANNELS = 1


class ClientGone(Exception):
    """The client disconnected; the request stops quietly."""


def pcm16(samples: np.ndarray) -> bytes:
    """Samples -> little-endian 16-bit PCM bytes (``len`` always a multiple of 2).

    Args:
        samples: float32 [N] in [-1, 1] (NaN becomes 0, values are clipped), or int16 [N].
    """
    if samples.dtype == np.int16:
        return samples.astype("<i2", copy=False).tobytes()
    clipped = np.clip(np.nan_to_num(samples.astype(np.float32, copy=False)), -1.0, 1.0)
    return np.round(clipped * 32767.0).astype("<i2").tobytes()


@dataclass
class RequestStats:
    """Figures of one request for its single INFO log line.

    Attributes:
        kind: ``synthesize`` (one-shot) or ``stream``.
        first_chunk_s: seconds from the request (one-shot) or from the first complete
            sentence (stream) to the first audio-chunk sent: the first-chunk latency.
        audio_samples: 24 kHz samples sent.
        compute_s: seconds the request held a synthesis worker (for the RTF).
    """

    kind: str
    voice: str = "-"
    chars: int = 0
    sentences: int = 0
    first_chunk_s: float | None = None
    audio_samples: int = 0
    compute_s: float = 0.0

    @property
    def audio_s(self) -> float:
        return self.audio_samples / OUTPUT_SAMPLE_RATE_HZ

    @property
    def rtf(self) -> float:
        """Real-time factor: compute seconds per audio second (0 without audio)."""
        return self.compute_s / self.audio_s if self.audio_s > 0 else 0.0

    def log(self, outcome: str) -> None:
        first = f"{self.first_chunk_s:.3f}s" if self.first_chunk_s is not None else "-"
        _LOGGER.info(
            "%s %s: voice=%s chars=%d sentences=%d first_chunk=%s audio=%.2fs rtf=%.2f",
            self.kind, outcome, self.voice, self.chars, self.sentences, first, self.audio_s,
            self.rtf,
        )
