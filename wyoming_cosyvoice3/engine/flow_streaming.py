"""Wiring of the chunk-causal streaming flow: derived estimator per precision + chunk schedule.

The pipeline asks :class:`ChunkedFlows` for a :class:`~.flow.chunked.ChunkedFlow` of the
request's DiT precision. The streaming estimator is derived from the model directory once
(``derive/streaming_estimator.py``) and opened by the model, at start with
``EngineOptions.flow_chunk_causal`` (it then also serves the full-attention passes), else on
first use; when that fails (a graph without
upstream's DiT structure, such as the tiny test model; out of memory; a failed validation) one
warning is logged and the pipeline keeps the full-attention path for that precision.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from . import constants as C
from .chunkmask import CHUNK_FRAMES
from .flow.chunked import ChunkedFlow
from .flow.solver import FlowRunner
from .options import EngineOptions, SynthesisOptions
from .request import PieceState, RequestState
from .types import SynthesisResult, VoiceFeatures

logger = logging.getLogger(__name__)

PROMPT_NOISE_SEED = 0
"""The prompt frames of chunk-causal streaming use the flow noise of this request seed (the
default seed, so a default request sees exactly its own noise there, as upstream does)."""
GRID_TOKENS = CHUNK_FRAMES // C.TOKEN_MEL_RATIO
"""25 speech tokens per static chunk (model.py ``token_hop_len`` = static_chunk_size / 2)."""


def prompt_noise(frames: int) -> np.ndarray:
    """float32 [80, frames]: the first frames of the seed-0 request flow noise (the stream
    :class:`~.request.RequestState` draws for seed 0)."""
    noise = RequestState.create(
        SynthesisOptions(seed=PROMPT_NOISE_SEED), None, SynthesisResult()
    ).flow_noise
    return np.ascontiguousarray(noise.take(frames).T)


def first_hop_tokens(options: SynthesisOptions, prompt_tokens: int) -> int:
    """Tokens of a piece's first streamed chunk.

    With ``first_hop_on_chunk_grid`` the hop is padded so that prompt + first hop end on the
    25-token grid (model.py ``CosyVoice2Model.tts``: ``prompt_token_pad = ceil(P / 25) * 25
    - P``, first hop ``token_hop_len + prompt_token_pad``); otherwise ``first_hop_tokens``.
    """
    hop = options.first_hop_tokens
    if options.first_hop_on_chunk_grid:
        hop += -(-prompt_tokens // GRID_TOKENS) * GRID_TOKENS - prompt_tokens
    return hop


class ChunkedFlows:
    """Lazily derived chunk-causal flows, one per DiT precision (thread-safe).

    Args:
        runner: the engine's full-attention flow runner.
        model: the loaded model (``model_dir`` is read).
        options: engine options (cache dir, threads, providers, voice cache dir).
    """

    def __init__(self, runner: FlowRunner, model: Any, options: EngineOptions) -> None:
        self.runner = runner
        self.model = model
        self.options = options
        self._flows: dict[str, ChunkedFlow | None] = {}
        self._lock = threading.Lock()

    def get(self, precision: str) -> ChunkedFlow | None:
        """The chunked flow for ``precision``, or None (full attention; the model warned
        once, :meth:`~.model.CosyVoice3Model.streaming_estimator`)."""
        with self._lock:
            if precision not in self._flows:
                est = self.model.streaming_estimator(precision)
                self._flows[precision] = None if est is None else self._flow(precision, est)
            return self._flows[precision]

    def _flow(self, precision: str, est: Any) -> ChunkedFlow:
        tag = precision if est.path is None else f"{precision}-{est.path.stem.rsplit('-', 2)[-2]}"
        return ChunkedFlow(self.runner, est, prompt_noise, self.options.voice_cache_dir, tag)

    def loaded(self) -> dict[str, bool]:
        """Precision -> whether its chunked flow is available (only precisions asked for)."""
        with self._lock:
            return {k: v is not None for k, v in self._flows.items()}



def chunk_causal_mel(
    flow: ChunkedFlow,
    piece: PieceState,
    features: VoiceFeatures,
    tokens: np.ndarray,
    noise: np.ndarray,
    drop_frames: int,
    req: RequestState,
) -> np.ndarray:
    """New mel frames [80, n] of ``piece``'s next chunk under the chunk mask.

    ``tokens`` = the flow prompt tokens ++ every token of the piece so far (3 lookahead tokens
    included in a non-final chunk, whose ``drop_frames`` = 6 mu frames are dropped; 0 for a
    final chunk under ``flow_final_chunk_causal``); ``noise`` float32 [80, N], column = frame.
    The piece's history cache is created on its first chunk; ``flow_left_context_tokens`` > 0
    bounds the attended and stored history.
    """
    opts = req.options
    if piece.flow_history is None:
        piece.flow_history = flow.new_history(opts.euler_steps, opts.cfg_rate, opts.cfg_steps)
    left = opts.flow_left_context_tokens
    return flow.chunk_mel(
        tokens,
        features,
        noise,
        piece.flow_history,
        opts.euler_steps,
        opts.cfg_rate,
        opts.cfg_steps,
        drop_frames,
        req.check,
        C.TOKEN_MEL_RATIO * left if left > 0 else None,
        req.times,
        store_history=drop_frames > 0,  # a final chunk's keys/values are never attended
    )


def full_attention_mel(
    flow: FlowRunner,
    flow_tokens: np.ndarray,
    features: VoiceFeatures,
    noise: np.ndarray,
    drop: int,
    start: int,
    offset: int,
    req: RequestState,
) -> np.ndarray:
    """A streamed chunk's new mel frames with the exported (full-attention) estimator.

    Args:
        flow: the model's flow runner.
        flow_tokens: int64 [P + n]: the flow's prompt tokens, then the piece's tokens from
            ``start`` up to the chunk's end (lookahead included).
        features: the flow's voice features (``flow_prompt_tokens`` applied).
        noise: float32 [80, frames] flow noise for prompt + tokens (column = frame).
        drop: lookahead mel frames to drop at the end (6 for a non-final chunk, else 0).
        start: first generated token the flow sees (``flow_left_context_tokens``).
        offset: first token of this chunk (frames before it were emitted earlier).
        req: the request (options, cancellation, stage times).

    Returns:
        float32 [80, 2 x (tokens of the chunk)] mel frames (spec section 7, model.py
        ``token2wav``: flow on prompt + all tokens so far, the new frames kept).
    """
    opts = req.options
    mel = flow.mel_for_tokens(
        flow_tokens,
        features,
        noise,
        steps=opts.euler_steps,
        cfg_rate=opts.cfg_rate,
        cfg_steps=opts.cfg_steps,
        drop_lookahead_frames=drop,
        should_stop=req.check,
        times=req.times,
        generated_offset_tokens=start,
        precision=opts.flow_precision,
    )
    return np.asarray(mel[:, C.TOKEN_MEL_RATIO * (offset - start) :], dtype=np.float32)
