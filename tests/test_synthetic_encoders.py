"""Synthetic voice encoders, tokenizer.json and speech-like clips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
from tokenizers import Tokenizer

from synthetic.audio import speech_like
from synthetic.tokenizer import (
    PARALINGUISTIC_TAGS,
    cosyvoice3_added_tokens,
)
from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.sessions import CAMPPLUS, SPEECH_TOKENIZER, Graph


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def test_special_token_ids_follow_cosyvoice3(tokenizer: Tokenizer) -> None:
    assert tokenizer.token_to_id("<|endoftext|>") == 151643
    assert tokenizer.token_to_id("<|im_start|>") == 151644
    assert tokenizer.token_to_id("<|im_end|>") == 151645
    assert tokenizer.token_to_id("<|endofprompt|>") == 151646
    assert tokenizer.token_to_id("[breath]") == 151647
    assert tokenizer.token_to_id("<strong>") == 151648
    assert tokenizer.token_to_id("<|endofsystem|>") == 151646 + 1 + len(PARALINGUISTIC_TAGS)
    end_of_system = tokenizer.token_to_id("<|endofsystem|>")
    assert end_of_system is not None and tokenizer.token_to_id("[AA]") == end_of_system + 1
    added = cosyvoice3_added_tokens()
    assert len(added) == len(set(added)) == 278
    last = tokenizer.token_to_id(added[-1])
    assert last == 151646 + 277 and last < 151936  # below the text embedding rows
    assert tokenizer.get_vocab_size() == last + 1


def test_plain_text_encodes_to_ordinary_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Die Temperatur beträgt 21,5 Grad. 今天天气很好。").ids
    assert ids and max(ids) < 151643
    assert tokenizer.decode(ids) == "Die Temperatur beträgt 21,5 Grad. 今天天气很好。"
    # Qwen2.5's extra tokens are gone: plain BPE pieces, not one id
    assert len(tokenizer.encode("<tool_call>").ids) > 1
    prompt = tokenizer.encode(C.SYSTEM_PROMPT + "Hello").ids
    assert prompt.count(151646) == 1 and prompt[-2] == 151646


def test_speech_tokenizer_gives_one_token_per_four_frames(tiny_model_dir: Path) -> None:
    graph = Graph(tiny_model_dir / SPEECH_TOKENIZER.file, SPEECH_TOKENIZER)
    rng = np.random.default_rng(0)
    for frames in (1, 4, 5, 13, 401):
        feats = rng.normal(0.0, 0.5, (1, 128, frames)).astype(np.float32)
        out = graph.run({"feats": feats, "feats_length": np.asarray([frames], np.int32)})
        tokens = out["indices"]
        assert tokens.shape == (1, -(-frames // 4))
        assert tokens.dtype == np.int32
        assert tokens.min() >= 0 and tokens.max() < C.SPEECH_TOKEN_VOCAB
    feats = rng.normal(0.0, 0.5, (1, 128, 40)).astype(np.float32)
    out = graph.run({"feats": feats, "feats_length": np.asarray([20], np.int32)})
    assert out["indices"].shape == (1, 5)  # the length input bounds the output
    spread = graph.run({"feats": feats, "feats_length": np.asarray([40], np.int32)})["indices"]
    assert len(np.unique(spread)) > 3


def test_campplus_embedding(tiny_model_dir: Path) -> None:
    graph = Graph(tiny_model_dir / CAMPPLUS.file, CAMPPLUS)
    rng = np.random.default_rng(1)
    fbank = rng.normal(0.0, 1.0, (1, 200, 80)).astype(np.float32)
    emb = graph.run({"input": fbank})["output"]
    assert emb.shape == (1, 192) and emb.dtype == np.float32
    assert np.all(np.isfinite(emb)) and np.linalg.norm(emb) > 0.1
    short = graph.run({"input": fbank[:, :57]})["output"]  # utterance-level pooling
    assert short.shape == (1, 192) and np.abs(short - emb).max() > 1e-3
    other = graph.run({"input": 2.0 * fbank + 0.5})["output"]
    assert np.abs(other - emb).max() > 0.1


def _autocorr_f0(frame: np.ndarray, rate: int) -> float:
    frame = frame - frame.mean()
    corr = np.correlate(frame, frame, mode="full")[len(frame) - 1 :]
    lo, hi = rate // 400, rate // 60
    return rate / (lo + int(np.argmax(corr[lo:hi])))


@pytest.mark.parametrize("f0_hz", [115.0, 220.0])
def test_speech_like_clip_has_pitch_syllables_and_pauses(f0_hz: float) -> None:
    rate = 24000
    clip = speech_like(4.0, rate, f0_hz=f0_hz, seed=3)
    assert clip.shape == (4 * rate,) and clip.dtype == np.float32
    assert np.abs(clip).max() == pytest.approx(0.5, abs=1e-6)
    frames = clip[: len(clip) // 480 * 480].reshape(-1, 480)  # 20 ms
    rms = np.sqrt((frames**2).mean(axis=1))
    assert (rms < 0.1 * rms.max()).mean() > 0.05  # pauses and syllable gaps
    assert (rms > 0.3 * rms.max()).mean() > 0.3  # voiced syllables
    loud = clip[int(np.argmax(rms)) * 480 :][:960]
    assert _autocorr_f0(loud, rate) == pytest.approx(f0_hz, rel=0.25)
    spectrum = np.abs(np.fft.rfft(clip)) ** 2
    freqs = np.fft.rfftfreq(len(clip), 1 / rate)
    assert spectrum[freqs < 4000].sum() > 0.9 * spectrum.sum()
    np.testing.assert_array_equal(clip, speech_like(4.0, rate, f0_hz=f0_hz, seed=3))
    assert np.abs(clip - speech_like(4.0, rate, f0_hz=f0_hz, seed=4)).max() > 0.01


def test_make_clip_writes_requested_format(make_clip, tmp_path: Path) -> None:
    path = make_clip(
        tmp_path / "a.wav", seconds=1.5, sample_rate_hz=44100, channels=2, subtype="FLOAT"
    )
    info = soundfile.info(str(path))
    assert (info.samplerate, info.channels, info.subtype) == (44100, 2, "FLOAT")
    assert info.frames == round(1.5 * 44100)
    data, _ = soundfile.read(str(path))
    assert np.abs(data[:, 0] - data[:, 1]).max() > 0  # two distinct channels
    path16 = make_clip(tmp_path / "b.wav", seconds=0.3, sample_rate_hz=8000)
    info16 = soundfile.info(str(path16))
    assert (info16.samplerate, info16.channels, info16.subtype) == (8000, 1, "PCM_16")
