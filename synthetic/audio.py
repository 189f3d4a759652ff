"""Speech-like synthetic clips for the built-in voices and for tests.

A clip is a sum of harmonics of a moving fundamental (declining pitch with a slow wobble),
shaped by three formant-like resonances, gated by a syllable envelope (about 4 syllables per
second with short pauses), plus breath noise. It is not speech, but it exercises the same
code paths as a reference clip: voiced frames, silence, a 16 kHz and a 24 kHz resampling,
and a mel spectrum with energy where speech has it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

SYLLABLES_PER_S = 4.0
FORMANTS_HZ = (700.0, 1200.0, 2600.0)


BUILT_IN_VOICES: dict[str, tuple[float, float]] = {
    "voices/zh-female.wav": (4.6, 220.0),
    "voices/en-male.wav": (4.2, 115.0),
}
"""Built-in voice clips: relative path -> (seconds, mean f0 in Hz)."""


def speech_like(
    seconds: float,
    sample_rate_hz: int = 24000,
    f0_hz: float = 150.0,
    seed: int = 0,
) -> npt.NDArray[np.float32]:
    """Return float32 [round(seconds * rate)] mono samples, peak about 0.5.

    Args:
        seconds: duration in seconds (> 0).
        sample_rate_hz: sample rate of the result.
        f0_hz: mean fundamental frequency (e.g. 220 for a female, 120 for a male voice).
        seed: seed of the numpy Generator (syllable timing, noise); same seed, same clip.
    """
    rng = np.random.default_rng(seed)
    n = max(1, round(seconds * sample_rate_hz))
    t = np.arange(n) / sample_rate_hz
    wobble = 0.08 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 2 * np.pi))
    declination = 0.15 * (0.5 - t / max(seconds, 1e-3))
    f0 = f0_hz * (1.0 + wobble + declination)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate_hz
    voiced = np.zeros(n)
    nyquist = sample_rate_hz / 2
    for k in range(1, 40):
        freq = k * f0
        gain = sum(1.0 / (1.0 + ((freq - fc) / (0.15 * fc)) ** 2) for fc in FORMANTS_HZ)
        gain = gain * (freq < nyquist) / k**0.5
        voiced += gain * np.sin(k * phase)

    envelope = np.zeros(n)
    start = 0.15 + rng.uniform(0, 0.05)
    while start < seconds - 0.2:
        length = rng.uniform(0.12, 0.26)
        centre = start + length / 2
        envelope += np.exp(-0.5 * ((t - centre) / (length / 3.5)) ** 2)
        gap = 0.35 if rng.random() < 0.12 else 0.02
        start += length + gap + rng.uniform(0.0, 1.0 / SYLLABLES_PER_S - 0.2)
    envelope = np.minimum(envelope, 1.0)
    noise = rng.normal(0.0, 1.0, n)
    signal = voiced * envelope + 0.05 * noise * (0.2 + envelope)
    peak = np.max(np.abs(signal))
    return (0.5 * signal / max(peak, 1e-9)).astype(np.float32)


def write_clip(
    path: Path,
    seconds: float = 3.0,
    sample_rate_hz: int = 24000,
    channels: int = 1,
    subtype: str = "PCM_16",
    f0_hz: float = 150.0,
    seed: int = 0,
) -> Path:
    """Write a speech-like clip with soundfile; extra channels are slightly delayed copies.

    Returns ``path``. The format follows the suffix (``.wav``, ``.flac``, ``.ogg``).
    """
    import soundfile

    mono = speech_like(seconds, sample_rate_hz, f0_hz, seed)
    if channels > 1:
        columns = [np.roll(mono, 7 * c) * (1.0 - 0.1 * c) for c in range(channels)]
        data: npt.NDArray[np.float32] = np.stack(columns, axis=1).astype(np.float32)
    else:
        data = mono
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), data, sample_rate_hz, subtype=subtype)
    return path
