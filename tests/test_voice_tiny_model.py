"""Voice preparation through the real graph contract (tiny synthetic campplus and
speech_tokenizer_v3 from tests/conftest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from wyoming_cosyvoice3.engine.errors import VoiceError
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.engine.voice import features as dsp
from wyoming_cosyvoice3.engine.voice.audio_io import load_clip, resample
from wyoming_cosyvoice3.engine.voice.prepare import VoiceFeatureExtractor


@pytest.fixture(scope="module")
def tiny_model(bare_model):
    return bare_model


class _CountingModel:
    """Delegates to a real model and counts voice-encoder loads."""

    def __init__(self, model):
        self._model = model
        self.loads = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def voice_encoders(self):
        self.loads += 1
        return self._model.voice_encoders()


def test_stereo_44k1_clip_gives_contract_features(tiny_model, make_clip, tmp_path):
    clip = make_clip(tmp_path / "stereo.wav", seconds=3.0, sample_rate_hz=44100, channels=2)
    prompt = VoiceFeatureExtractor(tiny_model, None).prepare(clip, transcript="Hello.")
    features = prompt.features
    tokens, embedding, mel = features.speech_tokens, features.speaker_embedding, features.prompt_mel

    samples, rate = load_clip(clip)
    full_mel = dsp.prompt_mel(resample(samples, rate, 24000))
    assert full_mel.shape == (150, 80)  # 3 s at 50 frames/s
    length = tokens.shape[0]
    assert 0 < length <= 75  # 25 tokens/s
    assert mel.shape == (2 * length, 80)
    np.testing.assert_array_equal(mel, full_mel[: 2 * length])
    assert tokens.dtype == np.int64 and tokens.min() >= 0 and tokens.max() < 6561
    assert embedding.shape == (tiny_model.dims.speaker_dim,) == (192,)
    assert embedding.dtype == np.float32 and np.all(np.isfinite(embedding))
    assert np.abs(embedding).max() > 0


def test_features_are_deterministic(tiny_model, make_clip, tmp_path):
    clip = make_clip(tmp_path / "a.wav", seconds=2.0, sample_rate_hz=24000)
    first = VoiceFeatureExtractor(tiny_model, None).prepare(clip).features
    second = VoiceFeatureExtractor(tiny_model, None).prepare(clip).features
    np.testing.assert_array_equal(first.speech_tokens, second.speech_tokens)
    np.testing.assert_array_equal(first.speaker_embedding, second.speaker_embedding)


def test_different_voices_give_different_features(tiny_model, make_clip, tmp_path):
    low = make_clip(tmp_path / "low.wav", seconds=2.0, f0_hz=110.0, seed=1)
    high = make_clip(tmp_path / "high.wav", seconds=2.0, f0_hz=230.0, seed=2)
    extractor = VoiceFeatureExtractor(tiny_model, None)
    a, b = extractor.prepare(low).features, extractor.prepare(high).features
    assert not np.allclose(a.speaker_embedding, b.speaker_embedding)
    assert not np.allclose(a.prompt_mel[:50], b.prompt_mel[:50])


def test_encoders_are_released_unless_kept(tiny_model, tiny_model_dir, make_clip, tmp_path):
    clip = make_clip(tmp_path / "c.wav", seconds=1.5)
    VoiceFeatureExtractor(tiny_model, None).prepare(clip)
    assert not tiny_model.voice_encoders_loaded
    kept = CosyVoice3Model.load(  # its own model: the encoders stay loaded
        tiny_model_dir, EngineOptions(llm_precision="fp32", load_voice_encoders=True)
    )
    VoiceFeatureExtractor(kept, None).prepare(clip)
    assert kept.voice_encoders_loaded


def test_disk_cache_skips_the_encoders(tiny_model, make_clip, tmp_path):
    clip = make_clip(tmp_path / "cached.flac", seconds=2.0, sample_rate_hz=48000)
    cache = tmp_path / "cache"
    first_model = _CountingModel(tiny_model)
    first = VoiceFeatureExtractor(first_model, cache).prepare(clip, transcript="Hi.")
    second_model = _CountingModel(tiny_model)
    second = VoiceFeatureExtractor(second_model, cache).prepare(clip, transcript="Hi.")
    assert (first_model.loads, second_model.loads) == (1, 0)
    for name in ("speech_tokens", "speaker_embedding", "prompt_mel"):
        np.testing.assert_array_equal(getattr(first.features, name), getattr(second.features, name))


def test_changed_encoder_file_invalidates_the_cache(tiny_model_copy, make_clip, tmp_path):
    clip = make_clip(tmp_path / "d.wav", seconds=1.5)
    cache = tmp_path / "cache"
    # its own model on a copy: the test changes an encoder file
    model = CosyVoice3Model.load(tiny_model_copy, EngineOptions(llm_precision="fp32"))
    VoiceFeatureExtractor(model, cache).prepare(clip)
    encoder = tiny_model_copy / "campplus.onnx"
    stat = encoder.stat()
    os.utime(encoder, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    counting = _CountingModel(model)
    VoiceFeatureExtractor(counting, cache).prepare(clip)
    assert counting.loads == 1
    assert len(list(cache.glob("*.npz"))) == 2


@pytest.mark.parametrize("name", ["zh-female.wav", "en-male.wav"])
def test_bundled_voices_prepare(tiny_model, tiny_model_dir, name):
    prompt = VoiceFeatureExtractor(tiny_model, None).prepare(tiny_model_dir / "voices" / name)
    assert prompt.features.speech_tokens.shape[0] >= 25  # at least 1 s
    assert prompt.features.prompt_mel.shape == (2 * prompt.features.speech_tokens.shape[0], 80)


def test_8khz_clip_is_refused_before_the_encoders(tiny_model, make_clip, tmp_path):
    clip = make_clip(tmp_path / "phone.wav", seconds=3.0, sample_rate_hz=8000)
    counting = _CountingModel(tiny_model)
    with pytest.raises(VoiceError, match="8 kHz"):
        VoiceFeatureExtractor(counting, tmp_path / "cache").prepare(clip)
    assert counting.loads == 0
