"""Performance levers on the tiny synthetic model: each exact lever gives the same output as
the plain path, each approximating lever does what its option says (no timing assertions)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import TinyEngines

from synthetic.audio import write_clip
from wyoming_cosyvoice3.engine import (
    CosyVoice3Engine,
    EngineOptions,
    SynthesisOptions,
    VoicePrompt,
)
from wyoming_cosyvoice3.engine.flow.solver import cacheable_prompt_frames
from wyoming_cosyvoice3.engine.flow.stream import flow_prompt_features
from wyoming_cosyvoice3.engine.options import PRESETS, VoiceFeatures

TEXT = "The kitchen lights are on. The front door is locked for the night."


@pytest.fixture(scope="module")
def engine(bare_engine: CosyVoice3Engine) -> CosyVoice3Engine:
    return bare_engine


@pytest.fixture(scope="module")
def voice(bare_voice: VoicePrompt) -> VoicePrompt:
    return bare_voice


def audio(engine: CosyVoice3Engine, voice: VoicePrompt, **opts: Any) -> np.ndarray:
    chunks = list(engine.synthesize(TEXT, voice, SynthesisOptions().replace(**opts)))
    assert chunks and chunks[-1].is_last
    return np.concatenate([c.samples for c in chunks])


# -- flow.prompt_tokens ---------------------------------------------------------------------


def test_flow_prompt_features_keeps_the_last_tokens_and_their_frames() -> None:
    tokens = np.arange(10, dtype=np.int64)
    mel = np.arange(20 * 80, dtype=np.float32).reshape(20, 80)
    emb = np.ones(192, dtype=np.float32)
    full = VoiceFeatures(tokens, emb, mel)
    trimmed = flow_prompt_features(full, 4)
    np.testing.assert_array_equal(trimmed.speech_tokens, [6, 7, 8, 9])
    np.testing.assert_array_equal(trimmed.prompt_mel, mel[12:])
    assert trimmed.speaker_embedding is emb
    assert flow_prompt_features(full, 0) is full
    assert flow_prompt_features(full, 10) is full


def test_balanced_caches_its_whole_flow_prompt() -> None:
    """``balanced``'s flow prompt length leaves no prompt frame to run again in each piece:
    the frames before the 3 lookahead tokens (2 mel frames per token, spec section 2d) fill
    whole 50-frame chunks of upstream's static chunk mask, and all of them are cached."""
    prompt_tokens = PRESETS["balanced"].flow.prompt_tokens
    independent_frames = 2 * (prompt_tokens - 3)
    assert independent_frames % 50 == 0
    assert cacheable_prompt_frames(prompt_tokens) == independent_frames == 200


def test_flow_sees_only_the_trimmed_prompt_and_llm_the_whole(
    engine: CosyVoice3Engine, voice: VoicePrompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_flow: list[np.ndarray] = []
    seen_llm: list[np.ndarray] = []
    mel_for_tokens, decode = engine.flow.mel_for_tokens, engine.llm.decode

    def spy_flow(tokens: np.ndarray, features: VoiceFeatures, *a: Any, **k: Any) -> Any:
        seen_flow.append(np.asarray(features.speech_tokens))
        assert features.prompt_mel.shape[0] == 2 * len(features.speech_tokens)
        np.testing.assert_array_equal(tokens[: len(features.speech_tokens)], seen_flow[-1])
        return mel_for_tokens(tokens, features, *a, **k)

    def spy_decode(prompt: Any, *a: Any, **k: Any) -> Any:
        seen_llm.append(np.asarray(prompt.prompt_speech_tokens))
        return decode(prompt, *a, **k)

    monkeypatch.setattr(engine.flow, "mel_for_tokens", spy_flow)
    monkeypatch.setattr(engine.llm, "decode", spy_decode)
    all_tokens = np.asarray(voice.features.speech_tokens)
    audio(engine, voice, flow={"prompt_tokens": 5}, max_decode_tokens=40)
    assert seen_flow and seen_llm
    for tokens in seen_flow:
        np.testing.assert_array_equal(tokens, all_tokens[-5:])
    for tokens in seen_llm:
        np.testing.assert_array_equal(tokens, all_tokens)


# -- prefix KV cache ------------------------------------------------------------------------


def test_prefix_cache_gives_the_same_tokens_as_no_cache(
    tiny_model_dir: Path, voice: VoicePrompt
) -> None:
    # its own engine: the test resizes and clears the prefix cache
    eng = CosyVoice3Engine.load(tiny_model_dir, EngineOptions(threads=1, llm_precision="int8"))
    prompt = eng.frontend.build_prompt("Turn on the hallway light please.", voice)

    def tokens() -> list[int]:
        rng = np.random.default_rng(7)
        return list(eng.llm.decode(prompt, rng, max_tokens=60))

    eng.llm.prefix_cache.max_entries = 0
    eng.llm.prefix_cache.clear()
    uncached = tokens()
    eng.llm.prefix_cache.max_entries = 4
    first, second = tokens(), tokens()
    assert eng.llm.prefix_cache.hits >= 1 and len(eng.llm.prefix_cache) == 1
    assert uncached == first == second
    assert len(uncached) > 10


def test_prefix_cache_state_is_not_changed_by_requests(engine: CosyVoice3Engine) -> None:
    prompt_ids = np.array([5, 6, 7], dtype=np.int64)
    state = engine.llm.new_state()
    engine.llm.prefill(state, engine.llm.embed_text(prompt_ids))
    engine.llm.prefix_cache.put(b"k", state)
    fork = engine.llm.prefix_cache.get(b"k")
    assert fork is not None
    engine.llm.step(fork, 3)
    again = engine.llm.prefix_cache.get(b"k")
    assert again is not None and again.past_len == 3 and fork.past_len == 4


# -- presets --------------------------------------------------------------------------------


def test_quality_preset_is_spec_exact() -> None:
    q = PRESETS["quality"]
    assert (q.flow.schedule.steps, q.flow.schedule.cfg_rate) == (10, 0.7)
    assert (q.flow.precision, q.flow.left_context_tokens, q.flow.prompt_tokens) == ("fp32", 0, 0)
    # upstream's PyTorch streaming: chunk mask, schedule 25 (+ grid padding) -> 50 -> 100
    assert (q.flow.chunk_causal, q.flow.first_hop_on_chunk_grid) == (True, True)
    assert (q.flow.first_hop_tokens, q.flow.max_hop_tokens) == (25, 100)
    assert q.vocoder_window_frames == 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates_and_synthesises(
    tiny_engines: TinyEngines, tmp_path: Path, name: str
) -> None:
    """Each preset on the engine a server of that preset loads (on the model with an
    upstream-structured DiT, its streaming DiTs derived into the session's cache) runs with
    its own DiT precision."""
    from wyoming_cosyvoice3.engine.derive.flow.full_attention import FullAttentionDiT

    engine = tiny_engines.preset(name)
    voice = engine.prepare_voice(write_clip(tmp_path / "ref.wav", seconds=3.0),
                                 transcript="This is a reference clip.", name="perf")
    opts = PRESETS[name].replace(max_decode_tokens=30)
    opts.validate()
    assert len(audio(engine, voice, **_fields(opts))) > 0
    estimator = engine.model.estimator_for(opts.flow.precision)
    assert isinstance(estimator, FullAttentionDiT)  # no fallback to the published graph
    assert estimator.path is not None
    assert ("int8main" in estimator.path.name) is (opts.flow.precision == "int8")


def _fields(opts: SynthesisOptions) -> dict[str, Any]:
    return {k: getattr(opts, k) for k in opts.__dataclass_fields__}


# -- windowed vocoder -----------------------------------------------------------------------


class _RecordingHift:
    """Wraps a graph's ``run`` and records the mel frames of every call."""

    def __init__(self, graph: Any) -> None:
        self.graph, self.spec = graph, graph.spec
        self.frames: list[int] = []

    def run(self, feeds: dict[str, np.ndarray], output_names: Any = None) -> Any:
        self.frames.append(int(feeds["speech_feat"].shape[2]))
        return self.graph.run(feeds, output_names)


def _stream(engine: CosyVoice3Engine, mel: np.ndarray, window: int, hops: list[int],
            runner: Any = None) -> Any:
    from wyoming_cosyvoice3.engine import constants as C
    from wyoming_cosyvoice3.engine.noise import GrowingNoise
    from wyoming_cosyvoice3.engine.vocoder.hift import HiftRunner, VocoderStream

    graph = _RecordingHift(engine.model.hift)
    noise = GrowingNoise(np.random.default_rng(1), C.HARMONIC_CHANNELS, "uniform", 4800)
    stream = VocoderStream(runner or HiftRunner(graph), noise,  # type: ignore[arg-type]
                           window_frames=window)
    out, start = [], 0
    for i, hop in enumerate(hops):
        out.append(stream.push(mel[:, start : start + hop], i == len(hops) - 1))
        start += hop
    return np.concatenate(out), graph.frames


def _snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    error = np.sum((other.astype(np.float64) - reference) ** 2)
    return float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / max(error, 1e-30)))


def test_vocoder_window_bounds_each_call_and_keeps_the_length(engine: CosyVoice3Engine) -> None:
    rng = np.random.default_rng(0)
    mel = (rng.standard_normal((80, 120)) - 4.0).astype(np.float32)
    hops = [20, 20, 40, 40]
    exact, exact_frames = _stream(engine, mel, 0, hops)
    windowed, frames = _stream(engine, mel, 10, hops)
    assert exact_frames == [20, 40, 80, 120]
    # each call: <= 10 emitted frames of context + the 8 held back + the new frames
    assert all(f <= 10 + 8 + hop for f, hop in zip(frames, hops, strict=True))
    assert frames[1:] != exact_frames[1:]  # later calls really were cut
    assert len(windowed) == len(exact) == 480 * 120
    # the first call is identical (no earlier context to drop)
    first = 480 * (20 - 8)
    np.testing.assert_array_equal(windowed[:first], exact[:first])
    # hift.onnx as published restarts the harmonic source's phase at each window, so the
    # later calls differ from the exact ones (the tiny model has the real source path)
    assert 0.0 < _snr_db(exact, windowed) < 60.0


class _LevelRunner:
    """A vocoder stand-in whose every sample shows which mel frame its call started at and
    which noise it read: ``mel[0, 0] + 1e-3 * noise[:, 0]`` for the whole call."""

    stream = None  # no streamed graph (HiftRunner.stream): the windowed calls under test

    def waveform(self, mel: np.ndarray, noise: np.ndarray) -> np.ndarray:
        n = 480 * mel.shape[1]
        return (mel[0, 0] + 1e-3 * noise[:n, 0]).astype(np.float32)


def test_vocoder_window_seams_are_cross_faded(engine: CosyVoice3Engine) -> None:
    """Where two windowed calls disagree, the seam is a 20 ms (480-sample) monotone blend
    from the earlier call's samples to the later call's, with no jump; away from the seams
    each call's samples come from its own window start and the absolute noise columns."""
    mel = np.zeros((80, 120), dtype=np.float32)
    mel[0] = 1.0 + np.arange(120)  # level = 1 + the frame a call starts at
    hops = [20, 20, 40, 40]
    exact, _ = _stream(engine, mel, 0, hops, _LevelRunner())
    windowed, _ = _stream(engine, mel, 10, hops, _LevelRunner())
    noise = exact - 1.0  # exact: every call starts at frame 0
    fade_in = 480  # FADE_IN_MS of the utterance start
    # emitted frame bounds of the calls, and the frame each windowed call starts at
    bounds = [0, 12, 32, 72, 120]
    starts = [0, 12 - 10, 32 - 10, 72 - 10]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        level = 1.0 + starts[i]
        lo = 480 * a + (480 if i else fade_in)  # past the seam (or the fade-in)
        np.testing.assert_allclose(windowed[lo : 480 * b] - level, noise[lo : 480 * b],
                                   atol=1e-5)
        if i == 0:
            continue
        seam = windowed[480 * a : 480 * a + 480]
        before, after = 1.0 + starts[i - 1], level
        step = after - before
        assert abs(seam[0] - before) < 0.01 * step and abs(seam[-1] - after) < 0.02 * step
        smooth = seam - noise[480 * a : 480 * a + 480]
        assert np.all(np.diff(smooth) >= -1e-5)  # monotone from the old level to the new
        # no jump: the largest sample step is a small part of the level change
        assert np.abs(np.diff(windowed[480 * a - 1 : 480 * a + 481])).max() < 0.01 * step


def test_vocoder_window_longer_than_the_utterance_is_exact(engine: CosyVoice3Engine) -> None:
    rng = np.random.default_rng(2)
    mel = (rng.standard_normal((80, 60)) - 4.0).astype(np.float32)
    exact, _ = _stream(engine, mel, 0, [20, 20, 20])
    windowed, _ = _stream(engine, mel, 1000, [20, 20, 20])
    # only the seam cross-fades blend two runs that agree up to float rounding
    np.testing.assert_allclose(windowed, exact, atol=1e-5)


def test_trimmed_flow_prompt_reads_the_same_noise_columns(
    engine: CosyVoice3Engine, voice: VoicePrompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, np.ndarray]] = []
    mel_for_tokens = engine.flow.mel_for_tokens

    def spy(tokens: np.ndarray, features: VoiceFeatures, noise: np.ndarray, *a: Any, **k: Any):
        seen.append((int(features.prompt_mel.shape[0]), np.array(noise)))
        return mel_for_tokens(tokens, features, noise, *a, **k)

    monkeypatch.setattr(engine.flow, "mel_for_tokens", spy)
    audio(engine, voice, streaming=False, max_decode_tokens=30, seed=5)
    audio(engine, voice, streaming=False, max_decode_tokens=30, seed=5,
          flow={"prompt_tokens": 4})
    (full_p, full_noise), (trim_p, trim_noise) = seen
    assert trim_p == 8 and full_p > trim_p
    # prompt frames: the last 8 of the whole prompt's columns; generated: identical columns
    np.testing.assert_array_equal(trim_noise[:, :trim_p], full_noise[:, full_p - trim_p : full_p])
    n = min(trim_noise.shape[1] - trim_p, full_noise.shape[1] - full_p)
    assert n > 0
    np.testing.assert_array_equal(
        trim_noise[:, trim_p : trim_p + n], full_noise[:, full_p : full_p + n]
    )
