"""The derived streaming DiT serving full-attention passes: one DiT graph per precision.

A preset that streams chunk-causally (``FlowPreset.chunk_causal``, e.g. ``quality``)
also runs full-attention passes: a piece's final chunk (upstream's ``finalize=True`` runs
``flow.inference(streaming=False)``, cosyvoice/cli/model.py ``CosyVoice2Model.tts``) and
one-shot requests. Running them on the published estimator would keep a second copy of the DiT
weights (0.76 GB fp32 at full size), so this is the estimator's one derived form
(:mod:`...loaders`). The streaming graph (:mod:`.streaming_estimator`) computes the same thing
when it runs without a cache, with an all-zero attention bias and rotary positions from frame
0: that is validation check 1, made when the graph is derived (max abs error <= ``FP32_TOL``
relative to the published graph; 7e-7 on the full-size synthetic model).
:class:`FullAttentionDiT` gives it the estimator's ``run`` interface, so the flow solver uses
it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...dit_runner import chunk_attention_bias
from ...errors import SynthesisFailed
from ...sessions import ESTIMATOR, GraphSpec

VELOCITY = next(iter(ESTIMATOR.outputs))
"""The contract's output name (``estimator_out``, upstream export_onnx.py)."""


class FullAttentionDiT:
    """A :class:`~...dit_runner.StreamingEstimator` run as the published estimator.

    Args:
        streaming: the streaming DiT (``run(frames, t, start_frame, attn_bias)``).

    ``run(feeds, names)`` takes the contract's feeds: ``x``, ``mu``, ``cond`` float32
    [B, 80, F], ``spks`` [B, 80], ``t`` [B] (one flow time for every row) and ``mask``
    [B, 1, F] (all ones: the flow solver never pads), and returns ``{"estimator_out":
    float32 [B, 80, F]}``. B is 1 or 2 (the streaming graph has a free batch).
    """

    def __init__(self, streaming: Any) -> None:
        self.streaming = streaming
        self.spec: GraphSpec = ESTIMATOR
        self.path: Path | None = getattr(streaming, "path", None)

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """The velocity for ``feeds`` (see the class docstring).

        Raises:
            SynthesisFailed: a padding mask (zeros in ``mask``), rows at different flow
                times, or an onnxruntime failure.
        """
        mask = np.asarray(feeds["mask"])
        if not np.all(mask == 1.0):
            raise SynthesisFailed(
                "the streaming DiT serves full attention without padding only (mask has zeros)"
            )
        t = np.asarray(feeds["t"], dtype=np.float32).reshape(-1)
        if t.size == 0 or not np.all(t == t[0]):
            raise SynthesisFailed(f"one flow time per call expected, got t={t.tolist()}")
        frames = {name: np.ascontiguousarray(feeds[name], dtype=np.float32)
                  for name in ("x", "mu", "cond", "spks")}
        n_frames = frames["x"].shape[2]
        out = self.streaming.run(frames, float(t[0]), 0, chunk_attention_bias(0, n_frames, 0, 0))
        return {VELOCITY: np.asarray(out.velocity, dtype=np.float32)}

    def __repr__(self) -> str:
        return f"FullAttentionDiT({self.path})"
