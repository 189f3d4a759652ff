"""The phase-carrying vocoder graph (engine/derive/hift_phase.py) and the windowed vocoder
stream that uses it.

Derivation and streaming run on the upstream-exported parity model's hift.onnx (the fixture set
that tests/parity_support.py finds); the fallback on the tiny synthetic model, whose stand-in
vocoder has no harmonic source.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from decoding_support import FixedDecoding
from parity_support import load_parity

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.derive.vocoder import hift_exact, hift_phase
from wyoming_cosyvoice3.engine.derive.vocoder.hift_phase import (
    PHASE_HIFT,
    ensure_phase_hift,
    load_phase_hift,
)
from wyoming_cosyvoice3.engine.dsp import GrowingNoise
from wyoming_cosyvoice3.engine.errors import ModelLoadError
from wyoming_cosyvoice3.engine.graphs import HIFT, Graph
from wyoming_cosyvoice3.engine.loaders import load_hift
from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.engine.vocoder.hift import HiftRunner, VocoderStream


@pytest.fixture(scope="module")
def parity_hift() -> Path:
    """The parity model's hift.onnx (skips, or fails in CI, without a fixture set)."""
    return load_parity().model_dir / "hift.onnx"


@pytest.fixture(scope="module")
def derived(parity_hift: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, hift_phase.PhaseCarryReport]:
    return ensure_phase_hift(parity_hift, tmp_path_factory.mktemp("phase"))


def _noise() -> GrowingNoise:
    return GrowingNoise(np.random.default_rng(5), C.HARMONIC_CHANNELS, "uniform", 480 * 64)


def _mel(frames: int, seed: int = 2) -> np.ndarray:
    """Smooth random log-mel [80, frames] (slow changes, like speech, so f0 varies slowly)."""
    rng = np.random.default_rng(seed)
    knots = rng.standard_normal((80, frames // 10 + 2))
    x = np.linspace(0, knots.shape[1] - 1, frames)
    rows = [np.interp(x, np.arange(knots.shape[1]), k) for k in knots]
    return (np.array(rows) - 5.0).astype(np.float32)


def _stream(runner: HiftRunner, mel: np.ndarray, cuts: list[int], window: int) -> np.ndarray:
    stream, parts, prev = VocoderStream(runner, _noise(), window_frames=window), [], 0
    for cut in cuts:
        parts.append(stream.push(mel[:, prev:cut], final=False))
        prev = cut
    parts.append(stream.push(mel[:, prev:], final=True))
    return np.concatenate(parts)


def _snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    err = float(np.sum((reference.astype(np.float64) - test) ** 2))
    return 10.0 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / err)


def test_derivation_finds_the_source_and_validates(
    derived: tuple[Path, hift_phase.PhaseCarryReport], parity_hift: Path
) -> None:
    path, report = derived
    # upstream SineGen2: phase = 2 pi 480 cumsum(rad), so one period is 1/480 CumSum units
    assert report.period == pytest.approx(1.0 / C.SAMPLES_PER_MEL_FRAME, rel=1e-6)
    assert report.harmonics == C.HARMONIC_CHANNELS and report.exact_rel == 0.0
    # the source's rad values (in [0, 1)) moved from hift.onnx's by float rounding only
    assert report.published_rad <= 64 * float(np.finfo(np.float32).eps)
    assert report.window_rel < 1e-3 < 0.01 < report.window_rel_without
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input][-1] == hift_phase.CARRY_INPUT
    assert hift_phase.PHASE_OUTPUT in [o.name for o in model.graph.output]
    # cached: a second call derives nothing and returns the stored report
    again = ensure_phase_hift(parity_hift, path.parent)
    assert again == (path, report)


def test_without_a_carry_it_is_the_one_call_graph(
    derived: tuple[Path, hift_phase.PhaseCarryReport], parity_hift: Path, tmp_path: Path
) -> None:
    """W = 0: exactly one call of hift.onnx with the f0-path rewrite (engine/derive/vocoder/
    hift_exact.py) that the streamed vocoder shares; tests/test_hift_stream.py holds that
    graph to hift.onnx within float rounding."""
    path, report = derived
    model, _, _ = hift_exact.exact_one_call(onnx.load(str(parity_hift)))
    onnx.save(model, str(tmp_path / HIFT.file))
    one_call = HiftRunner(Graph(tmp_path / HIFT.file, HIFT, threads=1))
    carried = HiftRunner(Graph(path, PHASE_HIFT, threads=1), report.period)
    mel = _mel(90)
    noise = _noise().take(480 * 90)
    samples, phase = carried.run(mel, noise)
    np.testing.assert_array_equal(samples, one_call.waveform(mel, noise))
    assert phase is not None and phase.shape == (90, C.HARMONIC_CHANNELS)
    assert np.all((phase >= 0) & (phase < report.period))
    # the exact stream (window 0) of either graph gives the same samples
    exact = _stream(one_call, mel, [20, 60], 0)
    np.testing.assert_array_equal(_stream(carried, mel, [20, 60], 0), exact)


def test_windowed_stream_continues_the_phase(
    derived: tuple[Path, hift_phase.PhaseCarryReport], parity_hift: Path
) -> None:
    """A 16-frame window with the carried phase gives the one-call audio up to float
    rounding (upstream's own float32 phase); the published graph restarts the phase at each
    window and lands near 25 dB."""
    path, report = derived
    published = HiftRunner(Graph(parity_hift, HIFT, threads=1))
    carried = HiftRunner(Graph(path, PHASE_HIFT, threads=1), report.period)
    mel = _mel(214)
    reference = _stream(published, mel, [], 0)  # one call
    cuts = [20, 60, 140]  # flow chunks of 20, 40, 80, 74 frames, as `balanced` makes them
    with_carry = _snr_db(reference, _stream(carried, mel, cuts, 16))
    restarted = _snr_db(reference, _stream(published, mel, cuts, 16))
    assert with_carry > 60.0 and restarted < 40.0
    assert with_carry > restarted + 25.0
    # the stream keeps only one window of phase rows, however long the utterance
    stream = VocoderStream(carried, _noise(), window_frames=16)
    for start in range(0, 200, 40):
        stream.push(mel[:, start : start + 40], final=False)
    assert stream._phase.shape == (16, C.HARMONIC_CHANNELS)


def test_a_misread_phase_scale_fails_validation(
    parity_hift: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = hift_phase.find_phase_cumsum

    def doubled(gr: object) -> tuple[object, float]:
        node, radians = real(gr)  # type: ignore[arg-type]
        return node, 2.0 * radians

    monkeypatch.setattr(hift_phase, "find_phase_cumsum", doubled)
    with pytest.raises(ModelLoadError, match="does not continue the phase"):
        ensure_phase_hift(parity_hift, tmp_path, in_process=True)
    assert not list(tmp_path.glob("*.onnx"))


def _without_harmonic_source(model_dir: Path) -> None:
    """Replace the CumSum of ``model_dir``'s hift.onnx (the harmonic phase) by an Identity:
    a vocoder without a phase to carry."""
    model = onnx.load(str(model_dir / HIFT.file))
    node = next(n for n in model.graph.node if n.op_type == "CumSum")
    node.CopyFrom(onnx.helper.make_node("Identity", [node.input[0]], list(node.output)))
    onnx.save(model, str(model_dir / HIFT.file))


def test_a_vocoder_without_harmonic_source_falls_back_with_one_warning(
    tiny_model_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No harmonic source: hift.onnx is used, one warning, and the failure is remembered (no
    second attempt)."""
    _without_harmonic_source(tiny_model_copy)
    with caplog.at_level(logging.WARNING):
        graph, period = load_hift(tiny_model_copy, EngineOptions(cache_dir=tmp_path))
    assert period is None and graph.path == tiny_model_copy / HIFT.file
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "has no CumSum" in warnings[0].getMessage()
    assert list(tmp_path.glob("*.failed"))
    assert load_phase_hift(tiny_model_copy / HIFT.file, tmp_path, 1, ("CPUExecutionProvider",),
                           False) is None


def test_the_tiny_vocoder_derives_and_off_derives_nothing(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        graph, period = load_hift(tiny_model_dir, EngineOptions(cache_dir=tmp_path))
    assert period == pytest.approx(1.0 / C.SAMPLES_PER_MEL_FRAME)  # 2 pi 480 cumsum(rad)
    assert graph.path.parent == tmp_path
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # off by option or without a cache directory: nothing derived, nothing written
    graph, period = load_hift(tiny_model_dir, EngineOptions())
    assert period is None and graph.path == tiny_model_dir / HIFT.file
    other = tmp_path / "off"
    load_hift(tiny_model_dir, EngineOptions(cache_dir=other, phase_vocoder=False))
    assert not other.exists() or not list(other.iterdir())


def _engine_audio(model_dir: Path, cache: Path, phase_vocoder: bool,
                  windows: tuple[int, ...]) -> list[np.ndarray]:
    """The audio of one text through one engine, once per vocoder window in ``windows``."""
    from wyoming_cosyvoice3.engine.options import SynthesisOptions
    from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine

    options = EngineOptions(cache_dir=cache, phase_vocoder=phase_vocoder, stream_vocoder=False,
                            observer=FixedDecoding(2.0))
    engine = CosyVoice3Engine.load(model_dir, options)
    assert (engine.model.hift_phase_period is not None) == phase_vocoder
    voice = engine.prepare_voice(model_dir / "voices" / "en-male.wav", "A test voice.")
    audio = []
    for window in windows:
        request = SynthesisOptions(seed=3, vocoder_window_frames=window).replace(
            flow={"first_hop_tokens": 5, "max_hop_tokens": 20}, vocoder={"defer": False})
        chunks = engine.synthesize("The lights in the kitchen are off now.", voice, request)
        audio.append(np.concatenate([c.samples for c in chunks]))
    return audio


def test_engine_windowed_vocoder_matches_the_exact_stream(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path
) -> None:
    """Through the engine (tiny-dit: upstream-structured vocoder, 5-token first hop): the
    16-frame windowed vocoder with the phase carried is within float rounding of the exact
    stream; with the published graph it is a different waveform. (Derived graphs from the
    session's cache: the derivation is tested above.)"""
    exact, carried = _engine_audio(tiny_dit_model_dir, tiny_dit_cache_dir, True, (0, 16))
    assert len(exact) > 480 * 140 and np.abs(exact).max() > 1e-3
    [restarted] = _engine_audio(tiny_dit_model_dir, tiny_dit_cache_dir, False, (16,))
    assert carried.shape == restarted.shape == exact.shape
    print(f"tiny-dit engine: SNR carried {_snr_db(exact, carried):.1f} dB, restarted "
          f"{_snr_db(exact, restarted):.1f} dB")
    assert _snr_db(exact, carried) > 40.0 > _snr_db(exact, restarted) + 10.0


@pytest.fixture(scope="module")
def carrying_engine(tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path) -> object:
    from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine

    # the windowed vocoder is the fallback of the streamed one: without it, the phase-carrying
    # form is derived and the presets' windows carry the phase
    engine = CosyVoice3Engine.load(tiny_dit_model_dir, EngineOptions(
        cache_dir=tiny_dit_cache_dir, observer=FixedDecoding(2.0), stream_vocoder=False))
    assert engine.model.hift_phase_period is not None and engine.model.hift_stream is None
    return engine


@pytest.mark.parametrize("preset", ["balanced", "fast"])
@pytest.mark.parametrize("streaming", [True, False])
def test_cases_c14_c15_with_the_phase_carried(
    carrying_engine: Any, tiny_dit_model_dir: Path, preset: str, streaming: bool
) -> None:
    """Cases C14 and C15 on the presets' windowed vocoder with the phase carried: the audio
    length scales by 1/speed within one mel frame per chunk; "Hello." and "Hello" both end
    with the final vocoder samples (480 per mel frame, nothing cut) and start faded in."""
    from wyoming_cosyvoice3.engine.options import PRESETS

    voice = carrying_engine.prepare_voice(tiny_dit_model_dir / "voices" / "en-male.wav",
                                          "A test voice.")
    base = PRESETS[preset].replace(streaming=streaming, seed=2, vocoder={"defer": False})
    text = "The lights in the kitchen are off now, and the door is locked."
    normal = list(carrying_engine.synthesize(text, voice, base))
    normal_samples = sum(len(c.samples) for c in normal)
    for speed in (1.5, 0.75):
        chunks = list(carrying_engine.synthesize(text, voice, base.replace(speed=speed)))
        audio = np.concatenate([c.samples for c in chunks])
        assert chunks[-1].is_last and np.isfinite(audio).all()
        assert abs(len(audio) - normal_samples / speed) <= C.SAMPLES_PER_MEL_FRAME * len(chunks)
    for hello in ("Hello.", "Hello"):
        chunks = list(carrying_engine.synthesize(hello, voice, base))
        audio = np.concatenate([c.samples for c in chunks])
        exact = np.concatenate([c.samples for c in carrying_engine.synthesize(
            hello, voice, base.replace(vocoder_window_frames=0))])
        assert chunks[-1].is_last and len(audio) == len(exact)
        assert len(audio) % (C.SAMPLES_PER_MEL_FRAME * C.TOKEN_MEL_RATIO) == 0  # whole tokens
        # the last mel frame's samples are there and are the exact vocoder's
        np.testing.assert_allclose(audio[-480:], exact[-480:], atol=1e-3)
        assert abs(float(audio[0])) < 1e-3 < float(np.abs(audio[-480:]).max())
