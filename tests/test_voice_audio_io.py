"""Reference clip loading (case C12) and resampling (audio_io.py)."""

from __future__ import annotations

import io
import logging
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wyoming_cosyvoice3.engine.errors import VoiceError
from wyoming_cosyvoice3.engine.voice.audio_io import load_clip, resample


def _signal(seconds: float, rate_hz: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate_hz)) / rate_hz
    columns = [
        0.4 * np.sin(2 * np.pi * (180 + 40 * c) * t) + 0.02 * rng.standard_normal(t.shape[0])
        for c in range(channels)
    ]
    return np.stack(columns, axis=1).astype(np.float32)


def _write(path: Path, seconds: float, rate_hz: int, channels: int = 1, subtype="PCM_16", **kw):
    data = _signal(seconds, rate_hz, channels)
    sf.write(path, data, rate_hz, subtype=subtype, **kw)
    return path


def _reference(path: Path) -> tuple[np.ndarray, int]:
    data, rate = sf.read(path, dtype="float32", always_2d=True)
    return data.mean(axis=1), rate


def _riff_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, offset = [], 12
    while offset + 8 <= len(data):
        chunk_id = data[offset : offset + 4]
        (size,) = struct.unpack_from("<I", data, offset + 4)
        chunks.append((chunk_id, data[offset + 8 : offset + 8 + size]))
        offset += 8 + size + (size & 1)
    return chunks


def _riff(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"WAVE"
    for chunk_id, payload in chunks:
        body += chunk_id + struct.pack("<I", len(payload)) + payload
        if len(payload) & 1:
            body += b"\0"
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _list_info_chunk() -> tuple[bytes, bytes]:
    def sub(chunk_id: bytes, text: bytes) -> bytes:
        return chunk_id + struct.pack("<I", len(text)) + text + (b"\0" if len(text) & 1 else b"")

    info = b"INFO" + sub(b"INAM", b"Kitchen voice\0") + sub(b"ISFT", b"Lavf60.3.100\0")
    return b"LIST", info


# --- rejected clips -------------------------------------------------------------------------


def test_8khz_clip_is_rejected_naming_the_file(tmp_path):
    path = _write(tmp_path / "phone_8k.wav", 3.0, 8000)
    with pytest.raises(VoiceError) as caught:
        load_clip(path)
    message = str(caught.value)
    assert str(path) in message
    assert "8 kHz clip" in message and ">= 16 kHz" in message


def test_short_clip_is_rejected_naming_the_file(tmp_path):
    path = _write(tmp_path / "blip.wav", 0.3, 24000)
    with pytest.raises(VoiceError) as caught:
        load_clip(path)
    assert str(path) in str(caught.value)
    assert "0.30 s" in str(caught.value)


@pytest.mark.parametrize(
    "content",
    [b"", b"this is not audio at all" * 40, b"RIFF\x24\x00\x00\x00WAVEfmt "],
    ids=["empty", "garbage", "cut-header"],
)
def test_unreadable_files_raise_voice_error(tmp_path, content):
    path = tmp_path / "broken.wav"
    path.write_bytes(content)
    with pytest.raises(VoiceError, match=r"broken\.wav"):
        load_clip(path)


def test_wav_cut_inside_the_data_is_rejected_as_truncated(tmp_path):
    path = _write(tmp_path / "whole.wav", 4.0, 24000)
    cut = tmp_path / "cut.wav"
    cut.write_bytes(path.read_bytes()[: 24000 * 2 * 2])  # about 2 s of the 4 s present
    with pytest.raises(VoiceError, match="truncated") as caught:
        load_clip(cut)
    assert str(cut) in str(caught.value)


def test_missing_file_and_directory_raise_voice_error(tmp_path):
    with pytest.raises(VoiceError, match=r"missing\.wav"):
        load_clip(tmp_path / "missing.wav")
    with pytest.raises(VoiceError, match="not a file"):
        load_clip(tmp_path)


def test_file_over_the_byte_limit_is_rejected(tmp_path):
    path = _write(tmp_path / "big.wav", 2.0, 24000)
    with pytest.raises(VoiceError, match=r"big\.wav"):
        load_clip(path, max_bytes=path.stat().st_size - 1)
    samples, _ = load_clip(path, max_bytes=path.stat().st_size)
    assert samples.shape == (48000,)


def test_nan_samples_are_rejected(tmp_path):
    data = _signal(2.0, 24000)
    data[100] = np.nan
    path = tmp_path / "nan.wav"
    sf.write(path, data, 24000, subtype="FLOAT")
    with pytest.raises(VoiceError, match="NaN"):
        load_clip(path)


def test_silent_clip_is_rejected(tmp_path):
    path = tmp_path / "silence.wav"
    sf.write(path, np.zeros(48000, dtype=np.float32), 24000, subtype="PCM_16")
    with pytest.raises(VoiceError, match="silent") as caught:
        load_clip(path)
    assert str(path) in str(caught.value)


def test_quiet_clip_is_accepted(tmp_path):
    path = tmp_path / "quiet.wav"
    sf.write(path, _signal(2.0, 24000) * 0.01, 24000, subtype="PCM_16")  # about -48 dBFS
    samples, _ = load_clip(path)
    assert 1e-3 < np.abs(samples).max() < 1e-2


# --- accepted clips -------------------------------------------------------------------------


def test_stereo_44k1_is_downmixed_by_averaging(tmp_path):
    path = _write(tmp_path / "stereo.wav", 2.5, 44100, channels=2)
    samples, rate = load_clip(path)
    reference, _ = _reference(path)
    assert rate == 44100
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert samples.shape == (int(2.5 * 44100),)
    np.testing.assert_allclose(samples, reference, atol=1e-7)
    raw = sf.read(path, dtype="float32")[0]
    assert not np.allclose(samples, raw[:, 0])  # both channels contribute


def test_float32_48k_keeps_values(tmp_path):
    data = _signal(2.0, 48000)[:, 0]
    path = tmp_path / "float.wav"
    sf.write(path, data, 48000, subtype="FLOAT")
    samples, rate = load_clip(path)
    assert rate == 48000
    np.testing.assert_array_equal(samples, data)


@pytest.mark.parametrize("where", ["before-data", "after-data"])
def test_wav_with_list_chunk_loads_like_the_plain_file(tmp_path, where):
    plain = _write(tmp_path / "plain.wav", 2.0, 22050)
    chunks = _riff_chunks(plain.read_bytes())
    names = [chunk_id for chunk_id, _ in chunks]
    assert names == [b"fmt ", b"data"]
    position = 1 if where == "before-data" else 2
    chunks.insert(position, _list_info_chunk())
    tagged = tmp_path / "tagged.wav"
    tagged.write_bytes(_riff(chunks))
    assert sf.info(tagged).frames == sf.info(plain).frames  # libsndfile sees a valid file
    samples, rate = load_clip(tagged)
    expected, expected_rate = load_clip(plain)
    assert rate == expected_rate == 22050
    np.testing.assert_array_equal(samples, expected)


@pytest.mark.parametrize(
    ("fmt", "subtype", "suffix"),
    [("WAV", "PCM_24", ".wav"), ("WAV", "PCM_32", ".wav"), ("FLAC", "PCM_16", ".flac")],
)
def test_other_lossless_formats_load_exactly(tmp_path, fmt, subtype, suffix):
    path = _write(tmp_path / f"clip{suffix}", 1.5, 32000, subtype=subtype, format=fmt)
    samples, rate = load_clip(path)
    reference, _ = _reference(path)
    assert rate == 32000
    np.testing.assert_array_equal(samples, reference)


def test_ogg_vorbis_loads(tmp_path):
    path = _write(tmp_path / "clip.ogg", 2.0, 24000, subtype="VORBIS", format="OGG")
    samples, rate = load_clip(path)
    assert rate == 24000
    assert abs(samples.shape[0] - 48000) <= 1024
    original = _signal(2.0, 24000)[:, 0]
    n = min(samples.shape[0], original.shape[0])
    correlation = np.corrcoef(samples[:n], original[:n])[0, 1]
    assert correlation > 0.9


def test_31s_clip_is_trimmed_to_30s_with_one_warning(tmp_path, caplog):
    path = _write(tmp_path / "long.wav", 31.0, 16000)
    reference, _ = _reference(path)
    with caplog.at_level(logging.WARNING, logger="wyoming_cosyvoice3.engine.voice.audio_io"):
        samples, rate = load_clip(path)
    assert rate == 16000
    assert samples.shape == (30 * 16000,)
    np.testing.assert_array_equal(samples, reference[: 30 * 16000])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "long.wav" in warnings[0].getMessage() and "31.0 s" in warnings[0].getMessage()


def test_clip_at_the_limits_is_accepted_without_warning(tmp_path, caplog):
    path = _write(tmp_path / "edge.wav", 1.0, 16000)
    with caplog.at_level(logging.WARNING):
        samples, rate = load_clip(path)
    assert (samples.shape[0], rate) == (16000, 16000)
    assert not caplog.records


# --- resampling -----------------------------------------------------------------------------


@pytest.mark.parametrize(("from_hz", "to_hz"), [(44100, 16000), (48000, 24000), (16000, 24000)])
def test_resample_keeps_a_sine(from_hz, to_hz):
    seconds, freq = 1.0, 440.0
    source = (0.5 * np.sin(2 * np.pi * freq * np.arange(int(seconds * from_hz)) / from_hz)).astype(
        np.float32
    )
    out = resample(source, from_hz, to_hz)
    assert out.dtype == np.float32
    assert abs(out.shape[0] - seconds * to_hz) <= 1
    expected = 0.5 * np.sin(2 * np.pi * freq * np.arange(out.shape[0]) / to_hz)
    middle = slice(to_hz // 10, -to_hz // 10)  # away from the edge transients
    np.testing.assert_allclose(out[middle], expected[middle], atol=2e-3)


def test_resample_removes_content_above_the_new_nyquist():
    rate = 48000
    t = np.arange(rate) / rate
    tone = np.sin(2 * np.pi * 11000 * t).astype(np.float32)  # above 8 kHz
    out = resample(tone, rate, 16000)
    # upstream's filter (Hann-windowed sinc, 6 zero crossings, cutoff 0.99 x 8 kHz): -49 dB here
    assert np.abs(out[1600:-1600]).max() < 5e-3


def test_resample_same_rate_returns_a_copy():
    audio = np.linspace(-1, 1, 100, dtype=np.float32)
    out = resample(audio, 24000, 24000)
    np.testing.assert_array_equal(out, audio)
    assert out is not audio


def test_clip_bytes_in_memory_decode_like_files(tmp_path):
    """load_clip decodes the bytes it read; an in-memory BytesIO round trip gives the same."""
    path = _write(tmp_path / "mem.wav", 1.2, 24000)
    samples, _ = load_clip(path)
    direct = sf.read(io.BytesIO(path.read_bytes()), dtype="float32")[0]
    np.testing.assert_array_equal(samples, direct)
