"""Streaming vocoder: chunked output equals one offline pass; fade-in; emission offsets."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.errors import SynthesisCancelled
from wyoming_cosyvoice3.engine.istft import istft
from wyoming_cosyvoice3.engine.noise import GrowingNoise
from wyoming_cosyvoice3.engine.vocoder.hift import HiftRunner, VocoderStream, fade_in_gain

FRAMES_PER_MEL = C.SAMPLES_PER_MEL_FRAME // C.ISTFT_HOP  # 120 STFT frames per mel frame


class FakeHift:
    """A numpy stand-in for hift.onnx with HiFT's dependency structure.

    STFT frame f (mel frame m = f // 120) reads mel frames m-2 .. m+7 (7 frames of right
    context, like conv_pre's lookahead plus the f0 predictor's), its phase accumulates over all
    earlier frames (like the harmonic source), and it reads the source noise of its samples.
    Magnitudes reach above 100 so the host clip matters.
    """

    def __init__(self) -> None:
        self.spec = SimpleNamespace(
            file="hift.onnx",
            inputs={"speech_feat": "float32", "noise": "float32"},
            outputs={"magnitude": "float32", "phase": "float32"},
        )
        self.calls: list[int] = []

    def run(self, feeds, output_names=None):
        mel = feeds["speech_feat"][0].astype(np.float64)
        noise = feeds["noise"][0].astype(np.float64)
        n_mel = mel.shape[1]
        assert noise.shape == (480 * n_mel, 9)
        self.calls.append(n_mel)
        level = mel[0] + mel[1]
        n_frames = 120 * n_mel + 1
        m = np.minimum(np.arange(n_frames) // FRAMES_PER_MEL, n_mel - 1)
        ctx = np.zeros(n_frames)
        for d in range(-2, 8):
            j = m + d
            ok = (j >= 0) & (j < n_mel)
            ctx[ok] += level[j[ok]]
        noise_rows = noise[np.minimum(np.arange(n_frames) * 4, 480 * n_mel - 1)]
        bins = np.arange(9)[:, None]
        mag = np.exp(0.3 * ctx)[None, :] * (1.0 + 0.1 * noise_rows.T) / (1.0 + bins)
        mag[3, ::50] = 250.0
        step = 0.05 + 0.01 * np.tanh(ctx)
        phase = np.cumsum(step)[None, :] * (bins + 1) + noise_rows.T
        return {
            "magnitude": (0.05 * mag)[None].astype(np.float32),
            "phase": phase[None].astype(np.float32),
        }


def make_noise(seed: int = 7) -> GrowingNoise:
    return GrowingNoise(np.random.default_rng(seed), C.HARMONIC_CHANNELS, "uniform", 480 * 37)


def offline(runner: HiftRunner, mel: np.ndarray, seed: int = 7) -> np.ndarray:
    return VocoderStream(runner, make_noise(seed)).push(mel, final=True)


def test_waveform_clips_magnitude_and_clamps() -> None:
    hift = FakeHift()
    runner = HiftRunner(hift)  # type: ignore[arg-type]
    mel = np.random.default_rng(0).standard_normal((80, 12)).astype(np.float32)
    noise = make_noise().take(480 * 12)
    samples = runner.waveform(mel, noise)
    assert samples.shape == (480 * 12,) and samples.dtype == np.float32
    out = hift.run({"speech_feat": mel[None], "noise": noise[None]})
    expected = np.clip(istft(np.minimum(out["magnitude"], 100.0), out["phase"]), -0.99, 0.99)
    assert np.allclose(samples, expected, atol=1e-7)
    assert np.max(np.abs(samples)) <= 0.99


def test_magnitude_clipped_at_100_before_istft(monkeypatch: pytest.MonkeyPatch) -> None:
    hift = FakeHift()
    runner = HiftRunner(hift)  # type: ignore[arg-type]
    mel = np.random.default_rng(0).standard_normal((80, 4)).astype(np.float32)
    noise = make_noise().take(480 * 4)
    out = hift.run({"speech_feat": mel[None], "noise": noise[None]})
    big = {"magnitude": out["magnitude"] * 10.0, "phase": out["phase"]}  # spikes at 125
    assert big["magnitude"].max() > 100.0
    hift.run = lambda feeds, names=None: big  # type: ignore[method-assign]
    seen: list[np.ndarray] = []

    def spy(magnitude, phase):
        seen.append(np.asarray(magnitude))
        return istft(magnitude, phase)

    monkeypatch.setattr("wyoming_cosyvoice3.engine.vocoder.hift.istft", spy)
    runner.waveform(mel, noise)
    assert seen[0].max() == 100.0
    assert np.array_equal(seen[0], np.minimum(big["magnitude"][0], 100.0))


@pytest.mark.parametrize("cuts", [[10, 20, 30], [1, 2, 3, 9, 17, 40], [9], [8, 16, 24, 32, 40]])
def test_streamed_equals_offline(cuts: list[int]) -> None:
    runner = HiftRunner(FakeHift())  # type: ignore[arg-type]
    mel = np.random.default_rng(1).standard_normal((80, 45)).astype(np.float32)
    ref = offline(runner, mel)
    assert ref.shape == (480 * 45,)
    stream = VocoderStream(runner, make_noise())
    parts, prev = [], 0
    for c in cuts:
        part = stream.push(mel[:, prev:c], final=False)
        assert len(part) == max(0, 480 * (c - 8)) - sum(len(p) for p in parts)
        parts.append(part)
        prev = c
    parts.append(stream.push(mel[:, prev:], final=True))
    streamed = np.concatenate(parts)
    assert streamed.shape == ref.shape
    assert np.max(np.abs(streamed - ref)) <= 1e-6
    assert stream.emitted_samples == 480 * 45


def test_no_graph_call_when_nothing_is_ready() -> None:
    hift = FakeHift()
    stream = VocoderStream(HiftRunner(hift), make_noise())  # type: ignore[arg-type]
    mel = np.zeros((80, 8), dtype=np.float32)
    assert len(stream.push(mel, final=False)) == 0  # 8 frames = all right context
    assert hift.calls == []
    assert len(stream.push(mel[:, :1], final=False)) == 480
    assert hift.calls == [9]
    with pytest.raises(SynthesisCancelled):
        stream.push(mel[:, :2], final=False, should_stop=lambda: True)
    with pytest.raises(RuntimeError):
        s2 = VocoderStream(HiftRunner(hift), make_noise())  # type: ignore[arg-type]
        s2.push(mel, final=True)
        s2.push(mel, final=True)


def test_fade_in_applied_to_first_20_ms() -> None:
    runner = HiftRunner(FakeHift())  # type: ignore[arg-type]
    mel = np.random.default_rng(3).standard_normal((80, 20)).astype(np.float32)
    raw = runner.waveform(mel, make_noise().take(480 * 20))
    out = offline(runner, mel)
    fade = 480  # 20 ms at 24 kHz
    gain = 0.5 - 0.5 * np.cos(np.pi * np.arange(fade) / fade)
    assert np.allclose(out[:fade], raw[:fade] * gain, atol=1e-7)
    assert out[0] == 0.0
    assert np.array_equal(out[fade:], raw[fade:])
    assert np.allclose(fade_in_gain(470, 20, 480)[10:], 1.0)
    assert fade_in_gain(0, 3, 480)[1] == pytest.approx(0.5 - 0.5 * np.cos(np.pi / 480), abs=1e-7)


def test_streamed_equals_offline_with_tiny_hift(tiny_model_dir) -> None:
    """The synthetic hift.onnx has HiFT's structure: the held-back 8 frames cover its right
    context, so every streamed sample equals the one offline pass up to the rounding that
    the call length changes in onnxruntime's kernels on the published f0 path (1.1e-5;
    the derived forms remove it: test_hift_stream.py), within the 1e-4 the derivation
    validates."""
    from wyoming_cosyvoice3.engine.sessions import HIFT, Graph

    runner = HiftRunner(Graph(tiny_model_dir / HIFT.file, HIFT, threads=1))
    rng = np.random.default_rng(11)
    mel = (rng.standard_normal((80, 70)) - 5.0).astype(np.float32)
    ref = offline(runner, mel)
    assert ref.shape == (480 * 70,) and np.max(np.abs(ref)) > 1e-3
    for cuts in ([12, 30, 50], [9, 10, 69]):
        stream = VocoderStream(runner, make_noise())
        parts, prev = [], 0
        for c in cuts:
            parts.append(stream.push(mel[:, prev:c], final=False))
            prev = c
        parts.append(stream.push(mel[:, prev:], final=True))
        streamed = np.concatenate(parts)
        assert np.max(np.abs(streamed - ref)) <= 1e-4
    # a partial pass: the frames before the held-back 8 are final
    partial = runner.waveform(mel[:, :30], make_noise().take(480 * 30))
    assert np.max(np.abs(partial[480 : 480 * 22] - ref[480 : 480 * 22])) <= 1e-4
    # the last 4 frames of a partial pass are within HiFT's right context: they change
    assert np.max(np.abs(partial[480 * 26 : 480 * 30] - ref[480 * 26 : 480 * 30])) > 1e-2


def test_deferred_calls_equal_offline_and_run_fewer_frames() -> None:
    """Deferring pushes (decoupled vocoder calls) keeps the exact samples and
    runs fewer frames than a call per flow chunk."""
    from wyoming_cosyvoice3.engine.options import StageTimes

    mel = np.random.default_rng(3).standard_normal((80, 140)).astype(np.float32)
    cuts = [20, 60, 140]  # flow chunks of 20, 40, 80 frames
    ref = offline(HiftRunner(FakeHift()), mel)  # type: ignore[arg-type]
    runs = {}
    for defer in (False, True):
        hift = FakeHift()
        stream = VocoderStream(HiftRunner(hift), make_noise())  # type: ignore[arg-type]
        times, parts, prev = StageTimes(), [], 0
        for k, c in enumerate(cuts):
            final = c == cuts[-1]
            parts.append(stream.push(mel[:, prev:c], final, times=times, defer=defer and k == 1))
            prev = c
        runs[defer] = (np.concatenate(parts), hift.calls, times)
    (plain, plain_calls, plain_times), (deferred, deferred_calls, deferred_times) = (
        runs[False], runs[True])
    assert plain_calls == [20, 60, 140] and deferred_calls == [20, 140]
    assert (plain_times.vocoder_frames, deferred_times.vocoder_frames) == (220, 160)
    assert np.max(np.abs(plain - ref)) <= 1e-6 and np.max(np.abs(deferred - ref)) <= 1e-6


def test_frames_for_call_counts_window() -> None:
    stream = VocoderStream(HiftRunner(FakeHift()), make_noise(),  # type: ignore[arg-type]
                           window_frames=16)
    mel = np.zeros((80, 40), dtype=np.float32)
    assert stream.frames_for_call(40) == 40
    stream.push(mel, final=False)  # emits 32 frames
    assert stream.frames_for_call(20) == 20 + 8 + 16  # new + held + window
    exact = VocoderStream(HiftRunner(FakeHift()), make_noise())  # type: ignore[arg-type]
    exact.push(mel, final=False)
    assert exact.frames_for_call(20) == 60


def test_may_defer_rule() -> None:
    from wyoming_cosyvoice3.engine.vocoder.hift import may_defer

    # 3 s in hand; next chunk ~2 x 0.5 s, vocoder 0.01 s/frame x 100 frames: 1.5 x 2 s = 3 s
    assert not may_defer(3.0, 0.5, 0.01, 100)
    assert may_defer(3.01, 0.5, 0.01, 100)
    assert not may_defer(10.0, 0.5, None, 100)  # nothing measured yet
    assert not may_defer(0.0, 0.0, 0.0, 0)


def test_request_lead_counts_from_the_first_chunk() -> None:
    from wyoming_cosyvoice3.engine.options import SynthesisOptions, SynthesisResult
    from wyoming_cosyvoice3.engine.pipeline import RequestState

    req = RequestState.create(SynthesisOptions(), None, SynthesisResult())
    req.samples_out = 48000
    assert req.lead_s() == 0.0  # no chunk yet: nothing is playing
    req.result.first_chunk_s = req.now() - 0.5
    assert 1.4 < req.lead_s() <= 1.5  # 2 s emitted, 0.5 s played
