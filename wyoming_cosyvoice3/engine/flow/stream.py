"""The flow stage of one text piece: speech tokens in, the next chunk's mel frames out.

A :class:`MelStream` is opened when a piece starts. It decides once whether the piece runs
the chunk-causal flow (:class:`.solver.ChunkedFlow`: upstream's ``streaming=True`` with the
static chunk mask, prompt and history keys/values cached) or full attention
(:class:`.solver.FlowRunner`: prompt ++ every token so far through the exported estimator),
and owns what the piece's flow carries from chunk to chunk: the tokens, the offset of the
next chunk, the hop schedule and the key/value history.

Chunk schedule (cosyvoice/cli/model.py ``CosyVoice2Model.tts``): a streamed chunk covers
``hop`` tokens and the flow also sees the next 3 (``pre_lookahead_len``), whose 6 mu frames are
dropped; the hop doubles after every chunk up to ``max_hop_tokens`` (``token_hop_len``,
``stream_scale_factor``, ``token_max_hop_len``); the piece's last chunk covers every remaining
token.

A request's flow is a :class:`FlowRequest`, opened from the request's
:class:`~..options.FlowPreset`: it decides once which form runs, trims the voice's prompt to
what the flow sees (``FlowPreset.prompt_tokens``) and keeps the request's noise aligned with
the whole prompt; each piece then opens its :class:`MelStream` from it. The streaming
estimator of a precision is derived from the model directory once
(``derive/flow/streaming_estimator.py``) and opened by the model, at start when the load
record ``EngineOptions.flow`` has ``chunk_causal``, else on first use; when that fails
(a graph without upstream's DiT structure, such as the tiny test model; out of memory; a
failed validation) the model logs one warning and the request runs full attention with the
preset's fallback bounds (:meth:`~..options.FlowPreset.full_attention`).

The piece's mel frames are then resampled for ``speed`` (:class:`SpeedResampler`; source:
cosyvoice/cli/model.py ``CosyVoice3Model.token2wav``, ``F.interpolate(mode="linear")`` to
``int(frames / speed)`` frames).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..dit_runner import CHUNK_FRAMES
from ..noise import GrowingNoise, request_streams
from ..options import EngineOptions, FlowPreset, ShouldStop, StageTimes, VoiceFeatures
from .solver import ChunkedFlow, FlowCall, FlowRunner, KvCache

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]

PROMPT_NOISE_SEED = 0
"""The prompt frames of chunk-causal streaming use the flow noise of this request seed (the
default seed, so a default request sees exactly its own noise there, as upstream does)."""
GRID_TOKENS = CHUNK_FRAMES // C.TOKEN_MEL_RATIO
"""25 speech tokens per static chunk (model.py ``token_hop_len`` = static_chunk_size / 2)."""


def prompt_noise(frames: int) -> FloatArray:
    """float32 [80, frames]: the first frames of the flow noise of a request with seed
    :data:`PROMPT_NOISE_SEED` (:func:`..noise.request_streams`)."""
    noise = request_streams(PROMPT_NOISE_SEED)[1]
    return np.ascontiguousarray(noise.take(frames).T)


def first_hop_tokens(options: FlowPreset, prompt_tokens: int) -> int:
    """Tokens of a piece's first streamed chunk.

    With ``first_hop_on_chunk_grid`` the hop is padded so that prompt + first hop end on the
    25-token grid (model.py ``CosyVoice2Model.tts``: ``prompt_token_pad = ceil(P / 25) * 25
    - P``, first hop ``token_hop_len + prompt_token_pad``); otherwise ``first_hop_tokens``.
    """
    hop = options.first_hop_tokens
    if options.first_hop_on_chunk_grid:
        hop += -(-prompt_tokens // GRID_TOKENS) * GRID_TOKENS - prompt_tokens
    return hop


def flow_prompt_features(features: VoiceFeatures, prompt_tokens: int) -> VoiceFeatures:
    """The voice features the flow sees with ``FlowPreset.prompt_tokens``.

    ``prompt_tokens`` <= 0 or >= the voice's L tokens: ``features`` unchanged (spec-exact).
    Otherwise the last ``prompt_tokens`` speech tokens and the last ``2 * prompt_tokens``
    prompt-mel frames (they stay aligned: the prompt mel has exactly 2L frames, spec section
    2d); the speaker embedding is unchanged. The DiT runs on every prompt frame in every Euler
    step (spec section 7), so this bounds the fixed cost of each chunk.
    """
    tokens = np.asarray(features.speech_tokens, dtype=np.int64).reshape(-1)
    if prompt_tokens <= 0 or prompt_tokens >= len(tokens):
        return features
    frames = C.TOKEN_MEL_RATIO * prompt_tokens
    return VoiceFeatures(
        speech_tokens=tokens[-prompt_tokens:],
        speaker_embedding=features.speaker_embedding,
        prompt_mel=np.asarray(features.prompt_mel, dtype=np.float32)[-frames:],
    )


class ChunkedFlows:
    """The engine's flows: the full-attention runner and, per DiT precision, the lazily
    derived chunk-causal flow (thread-safe).

    Args:
        runner: the engine's full-attention flow runner.
        model: the loaded model (``streaming_estimator(precision)`` is asked once per
            precision).
        options: engine options (``voice_cache_dir`` holds the prompt key/value caches).
    """

    def __init__(self, runner: FlowRunner, model: Any, options: EngineOptions) -> None:
        self.runner = runner
        self.model = model
        self.options = options
        self._flows: dict[str, ChunkedFlow | None] = {}
        self._lock = threading.Lock()

    def get(self, precision: str) -> ChunkedFlow | None:
        """The chunked flow for ``precision``, or None (full attention; the model warned
        once, :meth:`~..model.CosyVoice3Model.streaming_estimator`)."""
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

    def warm_up(self, preset: FlowPreset, features: VoiceFeatures) -> None:
        """Compute (or read from disk) the voice's prompt keys/values for a chunk-causal
        ``preset``, so that the first request does not."""
        chunked = self.get(preset.precision) if preset.chunk_causal else None
        if chunked is not None:
            chunked.prompt_cache(flow_prompt_features(features, preset.prompt_tokens),
                                 preset.schedule)


class FlowRequest:
    """The flow of one request: the preset it runs, the voice as the flow sees it and the
    request's noise, shared by its pieces' :class:`MelStream`.

    Args:
        flows: the engine's flows.
        preset: the request's flow record. When it asks for the chunk-causal flow and the
            streaming DiT of its precision is not available (the model warned once), the
            request runs :meth:`~..options.FlowPreset.full_attention` instead.
        features: the voice's whole features (trimmed here to ``preset.prompt_tokens``).
        noise: the request's flow noise (N(0,1), 80 bins per frame).
        streaming: pieces emit chunks while tokens arrive (False: one chunk per piece).

    Attributes:
        preset: the flow record that runs (the fallback applied).
        voice: the flow's voice features (:func:`flow_prompt_features` applied).
        noise_skip_frames: noise frames before the flow's prompt (the prompt frames the
            trimming cut): every frame reads the noise column it reads with the whole prompt.
    """

    def __init__(self, flows: ChunkedFlows, preset: FlowPreset, features: VoiceFeatures,
                 noise: GrowingNoise, streaming: bool) -> None:
        self.chunked = flows.get(preset.precision) if preset.chunk_causal else None
        if preset.chunk_causal and self.chunked is None:
            preset = preset.full_attention()
        self.preset = preset
        self.runner = flows.runner
        self.voice = flow_prompt_features(features, self.preset.prompt_tokens)
        self.noise = noise
        self.noise_skip_frames = int(features.prompt_mel.shape[0]) - int(
            self.voice.prompt_mel.shape[0])
        self.streaming = streaming

    def piece(self, middle: bool) -> MelStream:
        """The flow of the next piece; a ``middle`` piece (neither the request's first nor
        its last) runs in one chunk when the preset has ``whole_middle_pieces``."""
        whole = middle and self.preset.whole_middle_pieces
        return MelStream(self, self.streaming and not whole)


class MelStream:
    """The flow of one text piece: fed speech tokens, asked for each chunk's new mel frames.

    Args:
        flow: the request's flow (preset, the flow's voice, noise; :meth:`FlowRequest.piece`).
        streaming: emit chunks while tokens arrive (False: one chunk at the piece's end).

    Attributes:
        tokens: the piece's speech tokens so far.
        offset_tokens: the first token of the next chunk (earlier frames were returned).
        hop_tokens: tokens of the next streamed chunk.
    """

    def __init__(self, flow: FlowRequest, streaming: bool) -> None:
        self.preset = preset = flow.preset
        self.streaming = streaming
        self._flow = flow
        self._prompt_tokens = np.asarray(flow.voice.speech_tokens, dtype=np.int64).reshape(-1)
        self._history: KvCache | None = None
        self.tokens: list[int] = []
        self.offset_tokens = 0
        self.hop_tokens = first_hop_tokens(preset, len(self._prompt_tokens))
        # the hop before the first chunk's grid padding doubles (model.py token_hop_len)
        self._base_hop_tokens = preset.first_hop_tokens

    def push(self, token: int) -> bool:
        """Append a speech token; True when a streamed chunk is due (``hop`` tokens and the
        3 lookahead tokens after them are in)."""
        self.tokens.append(token)
        pending = len(self.tokens) - self.offset_tokens
        return self.streaming and pending >= self.hop_tokens + C.PRE_LOOKAHEAD_TOKENS

    def next_mel(self, final: bool, should_stop: ShouldStop, times: StageTimes) -> FloatArray:
        """The next chunk's new mel frames, then the offset and the hop move on.

        Args:
            final: the piece's last chunk (every remaining token; the LLM has ended the
                piece). Otherwise ``hop`` tokens, with the 3 lookahead tokens seen and their
                frames dropped.
            should_stop: checked before the encoder and every Euler step.
            times: ``flow_s`` and ``flow_calls`` are added to.

        Returns:
            float32 [80, 2 x (tokens of the chunk)] (spec section 7, model.py ``token2wav``).

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
            SynthesisFailed: a graph failed.
        """
        preset, flow = self.preset, self._flow
        offset = self.offset_tokens
        if final:
            end, drop, advance = len(self.tokens), 0, len(self.tokens) - offset
        else:
            end = offset + self.hop_tokens + C.PRE_LOOKAHEAD_TOKENS
            drop = C.TOKEN_MEL_RATIO * C.PRE_LOOKAHEAD_TOKENS
            advance = self.hop_tokens
        chunked = flow.chunked if not final or preset.final_chunk_causal else None
        left = preset.left_context_tokens
        start = max(0, offset - left) if left > 0 and chunked is None else 0
        flow_tokens = np.concatenate(
            [self._prompt_tokens, np.asarray(self.tokens[start:end], dtype=np.int64)]
        )
        skip = flow.noise_skip_frames
        noise_frames = skip + int(flow.voice.prompt_mel.shape[0]) + C.TOKEN_MEL_RATIO * end
        noise = flow.noise.take(noise_frames)[skip:].T
        call = FlowCall(preset.schedule, preset.precision, should_stop, times)
        if chunked is not None:  # chunk mask; prompt and history keys/values cached
            if self._history is None:
                keep = C.TOKEN_MEL_RATIO * left if left > 0 else None
                self._history = chunked.new_history(preset.schedule, keep)
            mel = chunked.chunk_mel(flow_tokens, flow.voice, noise, self._history, call, drop)
        else:
            # a full-attention pass never reads the chunk-causal history: free it first (up
            # to 3.6 MB per generated frame for quality's final chunk, which is the largest
            # pass of the piece)
            self._history = None
            mel = flow.runner.mel_for_tokens(flow_tokens, flow.voice, noise, call,
                                             drop_lookahead_frames=drop,
                                             generated_offset_tokens=start)
            # the frames before ``offset`` were returned by earlier chunks
            mel = np.asarray(mel[:, C.TOKEN_MEL_RATIO * (offset - start):], dtype=np.float32)
        self.offset_tokens = offset + advance
        self._base_hop_tokens = min(preset.max_hop_tokens, self._base_hop_tokens * 2)
        self.hop_tokens = self._base_hop_tokens
        return mel


# -- speed resampling -------------------------------------------------------------------------

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
