"""Voice features of decoded audio: the DSP, the two voice encoder graphs and their checks.

Upstream computes them in ``cosyvoice/cli/frontend.py`` ``CosyVoiceFrontEnd``:
``_extract_speech_token`` (speech_tokenizer_v3 on the 16 kHz Whisper log-mel),
``_extract_spk_embedding`` (campplus on the mean-normalised 16 kHz fbank) and
``_extract_speech_feat`` (the 24 kHz prompt mel), then ``frontend_zero_shot`` trims tokens and
mel to two mel frames per token. Used in the server's process by
:class:`.prepare.VoiceFeatureExtractor` and in the voice encoder process by :mod:`.worker`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..errors import SynthesisFailed, VoiceError
from ..options import VoiceFeatures
from . import features as dsp
from .audio_io import resample

EncoderRun = Callable[
    [npt.NDArray[np.float32], npt.NDArray[np.float32]],
    tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]],
]
"""(Whisper log-mel ``[128, T]``, fbank ``[T', 80]``) -> checked (speech tokens ``[N]`` int64,
speaker embedding ``[speaker_dim]`` float32)."""


class GraphLike(Protocol):
    """What this module needs of :class:`..sessions.Graph`."""

    path: Path

    @property
    def spec(self) -> Any: ...

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]: ...


def align_features(
    speech_tokens: npt.NDArray[np.int64], prompt_mel: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Trim tokens and mel so that the mel has exactly two frames per token.

    ``L = min(F // 2, n_tokens)``; returns ``(tokens[:L], mel[:2L])`` (upstream
    ``frontend.py frontend_zero_shot``: "force speech_feat % speech_token = 2").
    """
    length = min(prompt_mel.shape[0] // C.TOKEN_MEL_RATIO, speech_tokens.shape[0])
    return speech_tokens[:length], prompt_mel[: C.TOKEN_MEL_RATIO * length]


def read_only(array: np.ndarray) -> np.ndarray:
    """``array``, flagged read-only (prepared features are shared between requests)."""
    array.setflags(write=False)
    return array


def features_from_audio(
    samples: npt.NDArray[np.float32],
    sample_rate_hz: int,
    run_encoders: EncoderRun,
    clip_name: str = "the reference clip",
) -> VoiceFeatures:
    """Features of mono float32 ``[N]`` audio at ``sample_rate_hz`` (no caching).

    Resamples separately to 16 kHz (speech tokens, speaker embedding) and 24 kHz (prompt
    mel), hands the Whisper log-mel ``[128, T]`` and the fbank ``[T', 80]`` to
    ``run_encoders``, then aligns tokens and mel (:func:`align_features`).

    Raises:
        VoiceError: the clip yields no speech tokens.
        SynthesisFailed: from ``run_encoders`` (see :func:`run_voice_encoders`).
    """
    audio_16k = resample(samples, sample_rate_hz, C.FEATURE_SAMPLE_RATE_HZ)
    audio_24k = resample(samples, sample_rate_hz, C.OUTPUT_SAMPLE_RATE_HZ)
    log_mel = dsp.whisper_log_mel(audio_16k)
    fbank = dsp.kaldi_fbank(audio_16k)
    mel = dsp.prompt_mel(audio_24k)
    tokens, embedding = run_encoders(log_mel, fbank)
    tokens, mel = align_features(tokens, mel)
    if tokens.shape[0] == 0:
        raise VoiceError(
            f"reference clip {clip_name} yields no speech tokens; use 3-30 s of clear speech"
        )
    return VoiceFeatures(
        speech_tokens=read_only(np.ascontiguousarray(tokens)),
        speaker_embedding=read_only(embedding),
        prompt_mel=read_only(np.ascontiguousarray(mel)),
    )


def run_voice_encoders(
    campplus: GraphLike,
    tokenizer: GraphLike,
    log_mel: npt.NDArray[np.float32],
    fbank: npt.NDArray[np.float32],
    speaker_dim: int = C.SPEAKER_EMBEDDING_DIM,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Run speech_tokenizer_v3 on the log-mel (``[1, 128, T]`` with length ``[T]``) and
    campplus on the fbank (``[1, T', 80]``); return (tokens ``[N]`` int64, embedding
    ``[speaker_dim]`` float32).

    Raises:
        SynthesisFailed: a graph failed, its inputs are not the contract's, token ids are out
            of range, or the embedding has the wrong size or non-finite values.
    """
    raw_tokens = _first_output(
        tokenizer, tokenizer.run(_speech_tokenizer_feeds(tokenizer, log_mel))
    )
    raw_embedding = _first_output(
        campplus, campplus.run({_single_input_name(campplus): fbank[np.newaxis]})
    )
    return _check_tokens(tokenizer, raw_tokens), _check_embedding(
        campplus, raw_embedding, speaker_dim
    )


def _first_output(graph: GraphLike, outputs: dict[str, np.ndarray]) -> np.ndarray:
    names = list(getattr(graph.spec, "outputs", {}) or {})
    for name in names:
        if name in outputs:
            return outputs[name]
    return next(iter(outputs.values()))


def _speech_tokenizer_feeds(
    graph: GraphLike, log_mel: npt.NDArray[np.float32]
) -> dict[str, np.ndarray]:
    """Feeds of speech_tokenizer_v3: the float32 input gets the mel, the int32 one its length."""
    inputs: dict[str, str] = dict(getattr(graph.spec, "inputs", {}) or {})
    mel_names = [name for name, dtype in inputs.items() if dtype == "float32"]
    length_names = [name for name, dtype in inputs.items() if dtype.startswith("int")]
    if len(mel_names) != 1 or len(length_names) != 1:
        raise SynthesisFailed(
            f"{graph.path}: expected one float32 mel input and one int32 length input, "
            f"found {inputs}; use the upstream speech_tokenizer_v3.onnx"
        )
    length_dtype = np.dtype(inputs[length_names[0]])
    return {
        mel_names[0]: log_mel[np.newaxis],
        length_names[0]: np.array([log_mel.shape[1]], dtype=length_dtype),
    }


def _single_input_name(graph: GraphLike) -> str:
    inputs = list(getattr(graph.spec, "inputs", {}) or {})
    if len(inputs) != 1:
        raise SynthesisFailed(f"{graph.path}: expected one input, found {inputs}")
    return inputs[0]


def _check_tokens(graph: GraphLike, raw: np.ndarray) -> npt.NDArray[np.int64]:
    values = np.asarray(raw)
    if not np.issubdtype(values.dtype, np.integer):
        raise SynthesisFailed(
            f"{graph.path} returned {values.dtype} tokens, expected integers; "
            "use the upstream speech_tokenizer_v3.onnx"
        )
    tokens = values.reshape(-1).astype(np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= C.SPEECH_TOKEN_VOCAB):
        raise SynthesisFailed(
            f"{graph.path} returned token ids {tokens.min()}..{tokens.max()}, outside "
            f"0..{C.SPEECH_TOKEN_VOCAB - 1}; use the upstream speech_tokenizer_v3.onnx"
        )
    return tokens


def _check_embedding(graph: GraphLike, raw: np.ndarray, expected: int) -> npt.NDArray[np.float32]:
    embedding = np.asarray(raw, dtype=np.float32).reshape(-1).copy()
    if embedding.shape[0] != expected or not np.all(np.isfinite(embedding)):
        raise SynthesisFailed(
            f"{graph.path} returned a speaker embedding of {embedding.shape[0]} values "
            f"(finite: {bool(np.all(np.isfinite(embedding)))}), expected {expected} finite "
            "values; use the upstream campplus.onnx"
        )
    return embedding
