"""Reading reference clips and resampling audio.

Upstream reads prompts with ``cosyvoice/utils/file_utils.py load_wav`` (torchaudio: average of
the channels, then resampling to the feature rate) and refuses clips over 30 s
(``frontend.py _extract_speech_token``). This module does the same with soundfile (libsndfile:
WAV incl. extra chunks, FLAC, OGG/Vorbis/Opus, MP3, PCM 16/24/32 and float) and resamples with
upstream's own filter (:mod:`.resample`: torchaudio's default windowed-sinc ``Resample``, so the
features start from the samples upstream computes them from), and turns every problem with the
file into a :class:`~.errors.VoiceError` that names the file and says how to fix it.
"""

from __future__ import annotations

import io
import logging
import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt
import soundfile as sf

from .. import constants as C
from ..errors import VoiceError
from .resample import resample_like_upstream

_LOGGER = logging.getLogger(__name__)

MAX_CLIP_BYTES = 64 * 1024 * 1024
"""Largest reference clip file accepted (64 MiB: over a minute of 96 kHz 32-bit stereo)."""
SILENCE_PEAK = 1e-4
"""Clips whose absolute peak stays below this (-80 dBFS) are refused as silent."""
_MAX_RIFF_CHUNKS = 256
"""Chunks inspected when checking a WAV header for truncation (bounded walk)."""


def read_clip_bytes(path: Path, max_bytes: int = MAX_CLIP_BYTES) -> bytes:
    """Read a clip file whole, refusing missing, unreadable and oversized files.

    Raises:
        VoiceError: the file is missing, not a regular file, unreadable or over ``max_bytes``.
    """
    try:
        size = path.stat().st_size
    except OSError as err:
        raise VoiceError(
            f"reference clip {path} cannot be opened ({err.strerror or err}); check the path"
        ) from err
    if not path.is_file():
        raise VoiceError(f"reference clip {path} is not a file; give the path of an audio file")
    if size > max_bytes:
        raise VoiceError(
            f"reference clip {path} is {size / 1e6:.1f} MB, more than the {max_bytes / 1e6:.0f} MB "
            "limit; use a 3-30 s clip (mono 16-bit WAV or FLAC)"
        )
    try:
        return path.read_bytes()
    except OSError as err:
        raise VoiceError(
            f"reference clip {path} cannot be read ({err}); check its permissions"
        ) from err


def _wav_truncation(data: bytes) -> tuple[int, int] | None:
    """For a RIFF/WAVE file whose ``data`` chunk is cut short: (declared, present) bytes.

    Returns None for other formats, intact files, or a data size left open by a streaming
    writer (0 or 0xFFFFFFFF).
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    offset = 12
    for _ in range(_MAX_RIFF_CHUNKS):
        if offset + 8 > len(data):
            return None
        chunk_id = data[offset : offset + 4]
        (chunk_size,) = struct.unpack_from("<I", data, offset + 4)
        body = offset + 8
        if chunk_id == b"data":
            present = len(data) - body
            if chunk_size in (0, 0xFFFFFFFF) or chunk_size <= present:
                return None
            return chunk_size, present
        offset = body + chunk_size + (chunk_size & 1)
    return None


def decode_clip(
    data: bytes, name: str, max_s: float = C.MAX_PROMPT_SECONDS
) -> tuple[npt.NDArray[np.float32], int]:
    """Decode an encoded clip held in memory to mono float32 samples.

    Args:
        data: the file's bytes.
        name: the file name used in messages and logs.
        max_s: longer clips are cut to their first ``max_s`` seconds (one warning).

    Returns:
        (float32 ``[N]`` mono samples in the file's scale, [-1, 1] for PCM; sample rate in Hz).
        Channels are averaged (upstream ``load_wav``: ``speech.mean(dim=0)``).

    Raises:
        VoiceError: not audio, truncated, undecodable, rate below 16 kHz, shorter than 1 s,
            silent (peak below -80 dBFS), or containing non-finite samples.
    """
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise VoiceError(
            f"reference clip {name} is not a readable audio file ({err}); "
            "use WAV, FLAC or OGG audio"
        ) from err
    rate_hz = int(info.samplerate)
    if rate_hz < C.MIN_PROMPT_SAMPLE_RATE_HZ:
        raise VoiceError(
            f"reference clip {name}: {rate_hz / 1000:g} kHz clip: record at >= "
            f"{C.MIN_PROMPT_SAMPLE_RATE_HZ // 1000} kHz (24 kHz or more is best); a low rate "
            "leaves the speaker's voice without high frequencies"
        )
    truncated = _wav_truncation(data)
    if truncated is not None:
        declared, present = truncated
        raise VoiceError(
            f"reference clip {name} is truncated: its header announces {declared} bytes of "
            f"audio but only {present} are present; copy or record the file again"
        )
    max_frames = max(1, round(max_s * rate_hz))
    try:
        frames = sf.read(io.BytesIO(data), frames=max_frames, dtype="float32", always_2d=True)[0]
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise VoiceError(
            f"reference clip {name} cannot be decoded ({err}); the file is damaged, "
            "record or convert it again"
        ) from err
    samples = np.ascontiguousarray(frames.mean(axis=1, dtype=np.float32), dtype=np.float32)
    duration_s = samples.shape[0] / rate_hz
    if duration_s < C.MIN_PROMPT_SECONDS:
        raise VoiceError(
            f"reference clip {name} is {duration_s:.2f} s long, shorter than "
            f"{C.MIN_PROMPT_SECONDS:g} s; use 3-30 s of clear speech"
        )
    if not np.all(np.isfinite(samples)):
        raise VoiceError(f"reference clip {name} contains NaN or infinite samples; export it again")
    peak = float(np.abs(samples).max())
    if peak < SILENCE_PEAK:
        raise VoiceError(
            f"reference clip {name} is silent (peak {peak:.1e}); use a recording of clear speech"
        )
    if info.frames > max_frames:
        _LOGGER.warning(
            "Reference clip %s is %.1f s long; using its first %.1f s (the speech tokenizer "
            "takes at most 30 s)",
            name,
            info.frames / rate_hz,
            max_frames / rate_hz,
        )
    return samples, rate_hz


def load_clip(
    path: Path, max_s: float = C.MAX_PROMPT_SECONDS, max_bytes: int = MAX_CLIP_BYTES
) -> tuple[npt.NDArray[np.float32], int]:
    """Load a reference clip as mono float32 samples at its own rate.

    See :func:`decode_clip` for the checks; the file must also be at most ``max_bytes``.

    Returns:
        (float32 ``[N]`` samples, sample rate in Hz), ``N <= max_s * rate``.

    Raises:
        VoiceError: naming ``path``, with the fix.
    """
    path = Path(path)
    return decode_clip(read_clip_bytes(path, max_bytes), str(path), max_s)


def resample(audio: npt.ArrayLike, from_hz: int, to_hz: int) -> npt.NDArray[np.float32]:
    """Resample float ``[N]`` audio from ``from_hz`` to ``to_hz`` exactly as upstream does.

    Upstream ``load_wav`` uses ``torchaudio.transforms.Resample(from_hz, to_hz)`` with its
    defaults; see :func:`.resample.resample_like_upstream` (equal to it within 2e-7 on the
    shared reference clips).

    Returns:
        float32 ``[ceil(N * to_hz / from_hz)]`` (a float32 copy when the rates are equal).

    Raises:
        ValueError: ``audio`` is not 1-D or a rate is not a positive integer.
    """
    return resample_like_upstream(audio, from_hz, to_hz)
