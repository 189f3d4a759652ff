"""VoiceFeatureExtractor (voice.py) with recording stand-in encoder graphs: what the graphs
are fed, alignment, encoder release, output checks, and the memory and disk caches."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wyoming_cosyvoice3.engine.errors import SynthesisFailed, VoiceError
from wyoming_cosyvoice3.engine.voice import features as dsp
from wyoming_cosyvoice3.engine.voice.audio_io import load_clip, resample
from wyoming_cosyvoice3.engine.voice.prepare import (
    FEATURE_FORMAT_VERSION,
    VoiceFeatureExtractor,
    align_features,
    cache_key,
)


@dataclass(frozen=True)
class _Spec:
    file: str
    inputs: dict[str, str]
    outputs: dict[str, str]


@dataclass
class _RecordingGraph:
    """Stand-in for graphs.Graph: records feeds, answers with a function of them."""

    path: Path
    spec: _Spec
    answer: object
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)

    def run(self, feeds, output_names=None):
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return {next(iter(self.spec.outputs)): self.answer(feeds)}


def _tokens_from_mel(feeds):
    mel = feeds["feats"]
    frames = int(feeds["feats_length"][0])
    means = mel[0, :, :frames].mean(axis=0)
    count = frames // 4
    return (np.abs(means[: count * 4 : 4]) * 1000).astype(np.int32)[None] % 6561


def _embedding_from_fbank(feeds):
    fbank = feeds["input"][0]
    return np.tile(fbank.std(axis=0), 3)[None, :192].astype(np.float32)


@dataclass
class _Options:
    load_voice_encoders: bool = False


@dataclass
class _Dims:
    speaker_dim: int = 192


class _FakeModel:
    def __init__(self, tmp: Path, keep_loaded: bool = False, token_answer=_tokens_from_mel):
        self.options = _Options(load_voice_encoders=keep_loaded)
        self.dims = _Dims()
        self.campplus = _RecordingGraph(
            tmp / "campplus.onnx",
            _Spec("campplus.onnx", {"input": "float32"}, {"output": "float32"}),
            _embedding_from_fbank,
        )
        self.tokenizer = _RecordingGraph(
            tmp / "speech_tokenizer_v3.onnx",
            _Spec(
                "speech_tokenizer_v3.onnx",
                {"feats": "float32", "feats_length": "int32"},
                {"indices": "int32"},
            ),
            token_answer,
        )
        self.loads = 0
        self.releases = 0
        self.model_fingerprint = "model-a"

    def voice_encoders(self):
        self.loads += 1
        return self.campplus, self.tokenizer

    def release_voice_encoders(self):
        self.releases += 1

    def fingerprint(self):
        return self.model_fingerprint

    @property
    def graph_calls(self) -> int:
        return len(self.campplus.feeds) + len(self.tokenizer.feeds)


def _clip(path: Path, seconds: float = 2.3, rate_hz: int = 44100, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    f0 = 150 + 25 * np.sin(2 * np.pi * 2.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate_hz
    audio = sum(np.sin(k * phase) / k for k in range(1, 9)) * (0.6 + 0.4 * np.sin(2 * np.pi * t))
    audio = 0.25 * audio + 0.01 * rng.standard_normal(t.shape[0])
    sf.write(path, audio.astype(np.float32), rate_hz, subtype="PCM_16")
    return path


@pytest.fixture
def model(tmp_path):
    return _FakeModel(tmp_path)


@pytest.fixture
def clip(tmp_path):
    return _clip(tmp_path / "kitchen.wav")


# --- features -------------------------------------------------------------------------------


def test_graphs_get_spec_features_of_the_resampled_clip(model, clip):
    prompt = VoiceFeatureExtractor(model, None).prepare(clip, transcript="Hello there.", name="k")
    samples, rate = load_clip(clip)
    audio_16k = resample(samples, rate, 16000)
    audio_24k = resample(samples, rate, 24000)

    (tok_feeds,) = model.tokenizer.feeds
    expected_mel = dsp.whisper_log_mel(audio_16k)
    assert tok_feeds["feats"].shape == (1, 128, audio_16k.shape[0] // 160)
    assert tok_feeds["feats"].dtype == np.float32
    np.testing.assert_array_equal(tok_feeds["feats"][0], expected_mel)
    assert tok_feeds["feats_length"].dtype == np.int32
    assert tok_feeds["feats_length"].tolist() == [expected_mel.shape[1]]

    (spk_feeds,) = model.campplus.feeds
    np.testing.assert_array_equal(spk_feeds["input"][0], dsp.kaldi_fbank(audio_16k))

    features = prompt.features
    tokens = _tokens_from_mel(tok_feeds)[0].astype(np.int64)
    mel = dsp.prompt_mel(audio_24k)
    length = min(mel.shape[0] // 2, tokens.shape[0])
    np.testing.assert_array_equal(features.speech_tokens, tokens[:length])
    np.testing.assert_array_equal(features.prompt_mel, mel[: 2 * length])
    np.testing.assert_array_equal(features.speaker_embedding, _embedding_from_fbank(spk_feeds)[0])
    assert features.speech_tokens.dtype == np.int64
    assert features.speaker_embedding.dtype == np.float32
    assert features.speaker_embedding.shape == (192,)
    assert features.prompt_mel.shape == (2 * length, 80)
    assert (prompt.transcript, prompt.instruction, prompt.name) == ("Hello there.", None, "k")


@pytest.mark.parametrize(("tokens", "frames", "expected"), [(10, 30, 10), (20, 30, 15), (5, 11, 5)])
def test_alignment_keeps_two_mel_frames_per_token(tokens, frames, expected):
    token_ids = np.arange(tokens, dtype=np.int64)
    mel = np.arange(frames * 80, dtype=np.float32).reshape(frames, 80)
    kept_tokens, kept_mel = align_features(token_ids, mel)
    np.testing.assert_array_equal(kept_tokens, token_ids[:expected])
    np.testing.assert_array_equal(kept_mel, mel[: 2 * expected])


def test_encoders_released_after_use_unless_kept_loaded(tmp_path, clip):
    lazy = _FakeModel(tmp_path, keep_loaded=False)
    VoiceFeatureExtractor(lazy, None).prepare(clip)
    assert (lazy.loads, lazy.releases) == (1, 1)
    kept = _FakeModel(tmp_path, keep_loaded=True)
    VoiceFeatureExtractor(kept, None).prepare(clip)
    assert (kept.loads, kept.releases) == (1, 0)


def test_encoders_released_even_when_a_graph_fails(tmp_path, clip):
    def broken(feeds):
        raise SynthesisFailed("speech_tokenizer_v3.onnx failed")

    failing = _FakeModel(tmp_path, token_answer=broken)
    with pytest.raises(SynthesisFailed):
        VoiceFeatureExtractor(failing, None).prepare(clip)
    assert failing.releases == 1


def test_token_ids_out_of_range_are_refused(tmp_path, clip):
    bad = _FakeModel(tmp_path, token_answer=lambda feeds: np.array([[1, 2, 7000]], np.int32))
    with pytest.raises(SynthesisFailed, match=r"outside 0\.\.6560"):
        VoiceFeatureExtractor(bad, None).prepare(clip)


def test_wrong_embedding_size_is_refused(tmp_path, clip):
    bad = _FakeModel(tmp_path)
    bad.campplus.answer = lambda feeds: np.zeros((1, 100), np.float32)
    with pytest.raises(SynthesisFailed, match="expected 192"):
        VoiceFeatureExtractor(bad, None).prepare(clip)


def test_clip_without_tokens_is_a_voice_error(tmp_path, clip):
    empty = _FakeModel(tmp_path, token_answer=lambda feeds: np.zeros((1, 0), np.int32))
    with pytest.raises(VoiceError, match=r"kitchen\.wav"):
        VoiceFeatureExtractor(empty, None).prepare(clip)


def test_bad_clip_is_rejected_before_any_graph_runs(tmp_path, model):
    short = _clip(tmp_path / "short.wav", seconds=0.4)
    with pytest.raises(VoiceError, match="short"):
        VoiceFeatureExtractor(model, tmp_path / "cache").prepare(short)
    assert model.graph_calls == 0 and model.loads == 0


# --- caches ---------------------------------------------------------------------------------


def test_second_prepare_is_a_memory_hit(model, clip):
    extractor = VoiceFeatureExtractor(model, None)
    first = extractor.prepare(clip, transcript="Hi.")
    second = extractor.prepare(clip, transcript="Hi.")
    assert model.graph_calls == 2
    assert second.features is first.features
    assert not second.features.prompt_mel.flags.writeable
    assert not second.features.speech_tokens.flags.writeable


def test_disk_cache_hit_gives_identical_arrays_without_graphs(tmp_path, clip):
    cache = tmp_path / "cache"
    first_model = _FakeModel(tmp_path)
    first = VoiceFeatureExtractor(first_model, cache).prepare(clip, transcript="Hi.")
    files = sorted(cache.iterdir())
    assert [f.suffix for f in files] == [".npz"]  # no temporary files left behind

    second_model = _FakeModel(tmp_path)
    second = VoiceFeatureExtractor(second_model, cache).prepare(clip, transcript="Hi.")
    assert second_model.graph_calls == 0 and second_model.loads == 0
    for name in ("speech_tokens", "speaker_embedding", "prompt_mel"):
        ours, theirs = getattr(first.features, name), getattr(second.features, name)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
    "change",
    ["transcript", "instruction", "model", "clip"],
)
def test_key_changes_with_each_input(tmp_path, clip, change):
    cache = tmp_path / "cache"
    model = _FakeModel(tmp_path)
    extractor = VoiceFeatureExtractor(model, cache)
    extractor.prepare(clip, transcript="Hi.")
    calls = model.graph_calls
    transcript, instruction = "Hi.", None
    if change == "transcript":
        transcript = "Hi!"
    elif change == "instruction":
        instruction = "Speak slowly."
    elif change == "model":
        model.model_fingerprint = "model-b"
    else:
        clip.write_bytes(_clip(tmp_path / "other.wav", seed=9).read_bytes())
    prompt = extractor.prepare(clip, transcript=transcript, instruction=instruction)
    assert model.graph_calls == calls + 2
    assert len(list(cache.glob("*.npz"))) == 2
    assert prompt.transcript == transcript and prompt.instruction == instruction


def test_cache_of_an_earlier_feature_version_is_rebuilt(tmp_path, clip, monkeypatch):
    """Version 1 caches hold features of soxr-resampled clips: never served again."""
    from wyoming_cosyvoice3.engine.voice import prepare

    cache = tmp_path / "cache"
    model = _FakeModel(tmp_path)
    monkeypatch.setattr(prepare, "FEATURE_FORMAT_VERSION", FEATURE_FORMAT_VERSION - 1)
    VoiceFeatureExtractor(model, cache).prepare(clip)
    monkeypatch.undo()
    calls = model.graph_calls
    VoiceFeatureExtractor(model, cache).prepare(clip)  # a fresh extractor: disk cache only
    assert model.graph_calls == calls + 2
    assert len(list(cache.glob("*.npz"))) == 2


def test_cache_key_fields_are_separated():
    clip = b"RIFF...."
    keys = {
        cache_key(clip, "ab", "c", "m"),
        cache_key(clip, "a", "bc", "m"),
        cache_key(clip, None, "abc", "m"),
        cache_key(clip, "abc", None, "m"),
        cache_key(clip, "", None, "m"),
        cache_key(clip, None, None, "m"),
    }
    assert len(keys) == 6
    assert cache_key(clip, "a", None, "m") == cache_key(clip, "a", None, "m")
    assert FEATURE_FORMAT_VERSION >= 1


def test_blank_transcript_counts_as_none(model, clip):
    extractor = VoiceFeatureExtractor(model, None)
    assert extractor.prepare(clip, transcript="   ").transcript is None
    extractor.prepare(clip)
    assert model.graph_calls == 2  # same key: one computation


@pytest.mark.parametrize("damage", ["garbage", "half", "wrong-shape", "empty"])
def test_damaged_cache_file_is_recomputed(tmp_path, clip, caplog, damage):
    cache = tmp_path / "cache"
    reference = VoiceFeatureExtractor(_FakeModel(tmp_path), cache).prepare(clip)
    (path,) = cache.glob("*.npz")
    intact = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x00not a zip archive" * 10)
    elif damage == "half":
        path.write_bytes(intact[: len(intact) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        with np.load(path) as stored:
            arrays = dict(stored)
        arrays["prompt_mel"] = arrays["prompt_mel"][:-1]
        with path.open("wb") as stream:
            np.savez(stream, **arrays)

    model = _FakeModel(tmp_path)
    with caplog.at_level(logging.WARNING, logger="wyoming_cosyvoice3.engine.voice.prepare"):
        again = VoiceFeatureExtractor(model, cache).prepare(clip)
    assert model.graph_calls == 2
    # one warning per damaged file, not one per cache lookup
    assert sum(str(path) in r.getMessage() for r in caplog.records) == 1
    np.testing.assert_array_equal(again.features.prompt_mel, reference.features.prompt_mel)
    # the file was rewritten whole: a third extractor hits it
    third = _FakeModel(tmp_path)
    VoiceFeatureExtractor(third, cache).prepare(clip)
    assert third.graph_calls == 0


def test_unwritable_cache_dir_only_logs(tmp_path, clip, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    model = _FakeModel(tmp_path)
    with caplog.at_level(logging.WARNING, logger="wyoming_cosyvoice3.engine.voice.prepare"):
        prompt = VoiceFeatureExtractor(model, blocker).prepare(clip)
    assert prompt.features.speech_tokens.shape[0] > 0
    assert any("Cannot write voice cache" in r.getMessage() for r in caplog.records)


def test_concurrent_prepares_agree(model, clip):
    extractor = VoiceFeatureExtractor(model, None)
    results: list[np.ndarray] = []
    lock = threading.Lock()

    def work():
        prompt = extractor.prepare(clip, transcript="Hi.")
        with lock:
            results.append(prompt.features.prompt_mel)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 4
    assert model.graph_calls == 2  # computed once, the other three waited and hit the cache
    for mel in results[1:]:
        np.testing.assert_array_equal(mel, results[0])
