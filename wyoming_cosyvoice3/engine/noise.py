"""A request's seeded random streams: pure numpy.

One seed gives three independent streams (:func:`request_streams`): RAS sampling (used only by
the LLM decoder, which may run in a producer thread), the flow noise and the vocoder noise (both
used only by the consumer), so overlapping decoding with the flow leaves every stream's draws
unchanged. The flow and the vocoder draw from per-request noise buffers (:class:`GrowingNoise`;
source: FunAudioLLM/CosyVoice ace7c47, ``cosyvoice/flow/flow_matching.py``
``CausalConditionalCFM.rand_noise`` and ``cosyvoice/hifigan/generator.py``, the source noise of
``SineGen2``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from . import constants as C

F32 = npt.NDArray[np.float32]

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
