"""Voice prompts: features of a reference clip, computed once and cached (spec section 2).

Upstream computes them in ``cosyvoice/cli/frontend.py`` ``CosyVoiceFrontEnd.frontend_zero_shot``
on every request: speech tokens (``_extract_speech_token``), the CAM++ speaker embedding
(``_extract_spk_embedding``) and the 24 kHz prompt mel (``_extract_speech_feat``), then trims
both so that the mel has exactly two frames per token. Here they are computed once per
(clip, transcript, instruction, model) and kept in memory and, optionally, on disk as ``.npz``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..options import VoiceFeatures, VoicePrompt
from .audio_io import MAX_CLIP_BYTES, decode_clip, read_clip_bytes
from .encoders import align_features, features_from_audio, read_only, run_voice_encoders

__all__ = [
    "FEATURE_FORMAT_VERSION",
    "FeatureWorker",
    "VoiceFeatureExtractor",
    "align_features",
    "cache_key",
]

_LOGGER = logging.getLogger(__name__)

FEATURE_FORMAT_VERSION = 2
"""Bumped whenever the computed features or the cache file layout change (part of the key).

2: clips are resampled with upstream's filter (torchaudio's default ``Resample``) instead of
soxr, which changed the features above about 7 kHz and some speech tokens; caches of version 1
are never looked up again and are rebuilt."""
MEMORY_CACHE_ENTRIES = 32
"""Prepared voices kept in memory (least recently used dropped first)."""


class VoiceModel(Protocol):
    """What this module needs of :class:`.model.CosyVoice3Model`."""

    @property
    def options(self) -> Any: ...

    def voice_encoders(self) -> tuple[Any, Any]: ...

    def release_voice_encoders(self) -> None: ...

    def fingerprint(self) -> str: ...


class FeatureWorker(Protocol):
    """Computes voice features away from the caller (:class:`.worker.VoiceWorker`)."""

    def compute(self, clip_bytes: bytes, clip_name: str) -> VoiceFeatures:
        """Features of an encoded clip; raises ``VoiceError`` / ``SynthesisFailed``."""
        ...


def _blank_to_none(text: str | None) -> str | None:
    return text if text is not None and text.strip() else None


def cache_key(
    clip_bytes: bytes, transcript: str | None, instruction: str | None, model_fingerprint: str
) -> str:
    """sha256 hex key of a voice: clip bytes, transcript, instruction, model, format version.

    Each field is length-prefixed, and ``None`` differs from every string.
    """
    digest = hashlib.sha256()
    digest.update(b"wyoming-cosyvoice3 voice features\0")
    fields: list[bytes | None] = [
        str(FEATURE_FORMAT_VERSION).encode(),
        model_fingerprint.encode(),
        clip_bytes,
        None if transcript is None else transcript.encode("utf-8"),
        None if instruction is None else instruction.encode("utf-8"),
    ]
    for value in fields:
        if value is None:
            digest.update(b"N")
        else:
            digest.update(b"S" + len(value).to_bytes(8, "little") + value)
    return digest.hexdigest()


class VoiceFeatureExtractor:
    """Turns reference clips into :class:`VoicePrompt` objects, with memory and disk caches.

    Thread-safe: the caches are guarded by a lock and feature computation is serialised (the
    voice encoders may be loaded and released around each computation). Returned arrays are
    read-only and shared between callers.

    Args:
        model: the loaded model (``voice_encoders()``, ``release_voice_encoders()``,
            ``fingerprint()``, ``options.load_voice_encoders``).
        cache_dir: directory of ``<sha256>.npz`` feature files; ``None`` keeps them in memory only.
        max_clip_bytes: larger clip files are refused.
        worker: computes features of a clip's bytes elsewhere (the voice encoder process of
            :mod:`.worker`); ``None`` computes them in this process with ``model``'s encoders.
            The caches stay here either way.
    """

    def __init__(
        self,
        model: VoiceModel,
        cache_dir: Path | None,
        max_clip_bytes: int = MAX_CLIP_BYTES,
        worker: FeatureWorker | None = None,
    ) -> None:
        self._model = model
        self._worker = worker
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._max_clip_bytes = max_clip_bytes
        self._memory: OrderedDict[str, VoiceFeatures] = OrderedDict()
        self._memory_lock = threading.Lock()
        self._compute_lock = threading.RLock()

    def release_encoders(self) -> None:
        """Drop the voice encoders until the next voice needs them (the voice encoder
        process exits); kept with ``options.load_voice_encoders``."""
        if getattr(self._model.options, "load_voice_encoders", False):
            return
        release = getattr(self._worker, "release", None)
        if callable(release):
            release()
        self._model.release_voice_encoders()

    def close(self) -> None:
        """Stop the voice encoder process now (a preparation in flight fails); later
        preparations that miss the caches fail with ``SynthesisFailed``."""
        close = getattr(self._worker, "close", None)
        if callable(close):
            close()

    @property
    def worker(self) -> FeatureWorker | None:
        """Where features are computed (None: in this process)."""
        return self._worker

    @property
    def cache_dir(self) -> Path | None:
        """Directory of the disk cache, or None."""
        return self._cache_dir

    def prepare(
        self,
        clip_path: Path,
        transcript: str | None = None,
        instruction: str | None = None,
        name: str = "voice",
    ) -> VoicePrompt:
        """Features of ``clip_path`` wrapped in a :class:`VoicePrompt`.

        Args:
            clip_path: reference clip (any format soundfile reads, >= 16 kHz, >= 1 s; the first
                30 s are used).
            transcript: what the clip says (zero-shot mode); blank counts as None.
            instruction: style instruction (instruct mode); blank counts as None.
            name: voice id for logs.

        Raises:
            VoiceError: the clip is unusable (message names the file).
            SynthesisFailed: a voice encoder graph failed or returned values out of range.
        """
        clip_path = Path(clip_path)
        transcript = _blank_to_none(transcript)
        instruction = _blank_to_none(instruction)
        data = read_clip_bytes(clip_path, self._max_clip_bytes)
        key = cache_key(data, transcript, instruction, self._model.fingerprint())
        features = self._lookup(key)
        if features is None:
            with self._compute_lock:  # one computation per key even when callers race
                # a racer that computed it has remembered it; the disk was read just above
                features = self._lookup(key, disk=False)
                if features is None:
                    features = self._compute_and_store(key, data, clip_path, name)
        else:
            _LOGGER.debug("Voice %s (%s) served from the feature cache", name, clip_path)
        return VoicePrompt(
            features=features, transcript=transcript, instruction=instruction, name=name
        )

    def _compute_and_store(
        self, key: str, data: bytes, clip_path: Path, name: str
    ) -> VoiceFeatures:
        started = time.perf_counter()
        if self._worker is not None:
            features = self._worker.compute(data, str(clip_path))
        else:
            samples, rate_hz = decode_clip(data, str(clip_path))
            features = self.compute_features(samples, rate_hz, clip_name=str(clip_path))
        _LOGGER.info(
            "Prepared voice %s from %s in %.2f s%s: %d speech tokens, %d mel frames",
            name,
            clip_path,
            time.perf_counter() - started,
            "" if self._worker is None else " (voice encoder process)",
            features.speech_tokens.shape[0],
            features.prompt_mel.shape[0],
        )
        self._remember(key, features)
        self._write_disk(key, features)
        return features

    # --- feature computation in this process ----------------------------------------------

    def compute_features(
        self,
        samples: npt.NDArray[np.float32],
        sample_rate_hz: int,
        clip_name: str = "the reference clip",
    ) -> VoiceFeatures:
        """Features of mono float32 ``[N]`` audio at ``sample_rate_hz``, computed in this
        process with the model's voice encoders (no caching; see
        :func:`.encoders.features_from_audio`). The encoders are released afterwards unless
        ``options.load_voice_encoders``.

        Raises:
            VoiceError: the clip yields no speech tokens.
            SynthesisFailed: an encoder output has the wrong size, token ids out of range,
                or non-finite values.
        """
        return features_from_audio(samples, sample_rate_hz, self._run_encoders, clip_name)

    def _run_encoders(
        self, log_mel: npt.NDArray[np.float32], fbank: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """(speech tokens, speaker embedding), checked; the sessions live only in this call."""
        dims = getattr(self._model, "dims", None)
        speaker_dim = int(getattr(dims, "speaker_dim", C.SPEAKER_EMBEDDING_DIM))
        with self._compute_lock:
            try:
                campplus, tokenizer = self._model.voice_encoders()
                return run_voice_encoders(campplus, tokenizer, log_mel, fbank, speaker_dim)
            finally:
                # the sessions are unreferenced here, so releasing frees their weights
                if not getattr(self._model.options, "load_voice_encoders", False):
                    self._model.release_voice_encoders()

    # --- caches --------------------------------------------------------------------------------

    def _lookup(self, key: str, disk: bool = True) -> VoiceFeatures | None:
        with self._memory_lock:
            features = self._memory.get(key)
            if features is not None:
                self._memory.move_to_end(key)
                return features
        if not disk:
            return None
        features = self._read_disk(key)
        if features is not None:
            self._remember(key, features)
        return features

    def _remember(self, key: str, features: VoiceFeatures) -> None:
        with self._memory_lock:
            self._memory[key] = features
            self._memory.move_to_end(key)
            while len(self._memory) > MEMORY_CACHE_ENTRIES:
                self._memory.popitem(last=False)

    def cache_file(self, key: str) -> Path | None:
        """Path of the disk cache file of ``key`` (None without a cache directory)."""
        return None if self._cache_dir is None else self._cache_dir / f"{key}.npz"

    def _read_disk(self, key: str) -> VoiceFeatures | None:
        path = self.cache_file(key)
        if path is None or not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as stored:
                version = int(stored["format_version"])
                stored_key = str(stored["key"])
                tokens = np.array(stored["speech_tokens"], dtype=np.int64)
                embedding = np.array(stored["speaker_embedding"], dtype=np.float32)
                mel = np.array(stored["prompt_mel"], dtype=np.float32)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            _LOGGER.warning("Ignoring damaged voice cache file %s (%s); recomputing", path, err)
            return None
        problem = None
        if version != FEATURE_FORMAT_VERSION or stored_key != key:
            problem = "written for other features"
        elif tokens.ndim != 1 or tokens.shape[0] == 0 or embedding.ndim != 1:
            problem = "bad shapes"
        elif mel.ndim != 2 or mel.shape != (C.TOKEN_MEL_RATIO * tokens.shape[0], C.MEL_BINS):
            problem = "bad mel shape"
        elif not (np.all(np.isfinite(mel)) and np.all(np.isfinite(embedding))):
            problem = "non-finite values"
        if problem is not None:
            _LOGGER.warning("Ignoring voice cache file %s (%s); recomputing", path, problem)
            return None
        return VoiceFeatures(
            speech_tokens=read_only(tokens),
            speaker_embedding=read_only(embedding),
            prompt_mel=read_only(mel),
        )

    def _write_disk(self, key: str, features: VoiceFeatures) -> None:
        path = self.cache_file(key)
        if path is None:
            return
        temp_name: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temp_name = tempfile.mkstemp(
                dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp"
            )
            with os.fdopen(handle, "wb") as stream:
                np.savez(
                    stream,
                    format_version=np.array(FEATURE_FORMAT_VERSION),
                    key=np.array(key),
                    speech_tokens=features.speech_tokens,
                    speaker_embedding=features.speaker_embedding,
                    prompt_mel=features.prompt_mel,
                )
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temp_name, path)
            temp_name = None
        except OSError as err:
            _LOGGER.warning("Cannot write voice cache file %s (%s); continuing without", path, err)
        finally:
            if temp_name is not None:
                try:
                    os.unlink(temp_name)
                except OSError:
                    _LOGGER.debug("Could not remove temporary file %s", temp_name)
