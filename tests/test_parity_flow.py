"""Parity of the flow, the vocoder and the streamed output with upstream CosyVoice3.

References: ``../shared/parity/refs/flow.npz`` (see its ``manifest.json``): per case, prompt
tokens/mel/embedding and generated tokens fed to upstream's ``CosyVoice3Model`` in place of the
LLM, with the engine's own noise buffers for the request seed. Here the engine's LLM is replaced
by the same generated tokens. Upstream audio has no fade-in; the engine fades in the first
``FADE_IN_MS``, so references are multiplied by the same gain.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from parity_support import (
    Parity,
    assert_close,
    assert_identical,
    faded,
    parity_cases,
    parity_engine,
    quality_options,
)

from wyoming_cosyvoice3.engine import SynthesisOptions, VoiceFeatures, VoicePrompt
from wyoming_cosyvoice3.engine.flow.solver import FlowCall
from wyoming_cosyvoice3.engine.options import EulerSchedule, SynthesisResult
from wyoming_cosyvoice3.engine.pipeline import RequestState
from wyoming_cosyvoice3.engine.vocoder.hift import VocoderStream

FLOW = "flow.npz"
CASES = parity_cases("flow")
TEXT = "Hello."
"""Any one-piece speakable text: the LLM is replaced, so only the piece count matters."""


@pytest.fixture(scope="module")
def engine(parity: Parity) -> Any:
    return parity_engine(parity)


def _voice(parity: Parity, case: str) -> VoicePrompt:
    features = VoiceFeatures(
        speech_tokens=parity.array(FLOW, f"{case}_prompt_tokens").astype(np.int64),
        speaker_embedding=parity.array(FLOW, f"{case}_embedding").astype(np.float32),
        prompt_mel=parity.array(FLOW, f"{case}_prompt_mel").astype(np.float32),
    )
    return VoicePrompt(features=features, name=f"parity-{case}")


def _flow_call(parity: Parity) -> FlowCall:
    return FlowCall(EulerSchedule(parity.euler_steps, parity.cfg_rate))


def _options(parity: Parity, **changes: Any) -> SynthesisOptions:
    """The spec-exact ``quality`` preset with the fixture's seed, Euler steps and CFG rate
    (no vocoder deferral: :func:`parity_support.quality_options`)."""
    return quality_options(parity, **changes)  # type: ignore[no-any-return]


def _with_tokens(engine: Any, monkeypatch: pytest.MonkeyPatch, tokens: np.ndarray) -> None:
    """Replace the engine's LLM by a decoder that yields ``tokens`` for every piece."""

    def decode(*_args: Any, **_kwargs: Any) -> Iterator[int]:
        yield from (int(t) for t in tokens)

    monkeypatch.setattr(engine.llm, "decode", decode)


_faded = faded


def _synthesize(engine: Any, voice: VoicePrompt, options: SynthesisOptions) -> list[np.ndarray]:
    return [chunk.samples for chunk in engine.synthesize(TEXT, voice, options)]


def _request(parity: Parity) -> RequestState:
    return RequestState.create(_options(parity), None, SynthesisResult())


# --- noise buffers ---------------------------------------------------------------------------


def test_parity_noise_buffers_are_the_requests_own(parity: Parity) -> None:
    """Upstream ran with the engine's flow and vocoder noise of the request seed."""
    flow_noise = parity.array(FLOW, "flow_noise")
    vocoder_noise = parity.array(FLOW, "vocoder_noise")
    assert parity.tolerance("noise_buffers") == 0.0
    req = _request(parity)
    assert_identical(req.flow_noise.take(flow_noise.shape[1]).T, flow_noise, "flow noise")
    assert_identical(req.vocoder_noise.take(vocoder_noise.shape[0]), vocoder_noise, "vocoder noise")


# --- one-shot: flow mel, vocoder, whole engine --------------------------------------------


def test_parity_full_attention_runs_through_the_streaming_dit(engine: Any) -> None:
    """The engine is loaded as the server loads ``quality`` (``flow.chunk_causal``): the
    one-shot and full-attention tests below run the derived streaming DiT, and no published
    estimator is open (test_parity_flow_chunked.py covers the published one)."""
    from wyoming_cosyvoice3.engine.derive.flow.full_attention import FullAttentionDiT

    assert isinstance(engine.model.estimator, FullAttentionDiT)
    assert list(engine.model._estimators) == ["fp32"]


@pytest.mark.parametrize("case", CASES)
def test_parity_oneshot_flow_mel(parity: Parity, engine: Any, case: str) -> None:
    """flow encoder + Euler/CFG DiT on prompt ++ generated tokens (``mel_for_tokens``)."""
    voice = _voice(parity, case).features
    tokens = np.concatenate(
        [voice.speech_tokens, parity.array(FLOW, f"{case}_gen_tokens").astype(np.int64)]
    )
    noise = parity.array(FLOW, "flow_noise").astype(np.float32)
    mel = engine.flow.mel_for_tokens(tokens, voice, noise, _flow_call(parity))
    assert_close(
        mel, parity.array(FLOW, f"{case}_oneshot_mel"), parity.tolerance("mel"), f"{case} mel"
    )


@pytest.mark.parametrize("case", CASES)
def test_parity_hift_istft_audio(parity: Parity, engine: Any, case: str) -> None:
    """hift.onnx + host iSTFT + clamps on upstream's own mel gives upstream's audio."""
    mel = parity.array(FLOW, f"{case}_oneshot_mel").astype(np.float32)
    reference = parity.array(FLOW, f"{case}_oneshot_audio")
    noise = parity.array(FLOW, "vocoder_noise")[: reference.shape[0]].astype(np.float32)
    audio = engine.hift.waveform(mel, noise)
    assert_close(audio, reference, parity.tolerance("audio"), f"{case} HiFT+iSTFT audio")


@pytest.mark.parametrize("case", CASES)
def test_parity_oneshot_engine_audio(
    parity: Parity, engine: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The whole engine, one-shot, with the LLM replaced by the case's generated tokens."""
    _with_tokens(engine, monkeypatch, parity.array(FLOW, f"{case}_gen_tokens"))
    chunks = _synthesize(engine, _voice(parity, case), _options(parity, streaming=False))
    assert len(chunks) == 1
    reference = _faded(parity.array(FLOW, f"{case}_oneshot_audio"))
    assert_close(chunks[0], reference, parity.tolerance("audio"), f"{case} one-shot audio")


def _speed_refs(parity: Parity) -> list[tuple[str, float, str]]:
    """``(case, speed, key)`` for every ``<case>_speed<x>_oneshot_audio`` in the manifest."""
    found = []
    for key in parity.keys(FLOW):
        match = re.fullmatch(r"(.+)_speed([0-9.]+)_oneshot_audio", key)
        if match:
            found.append((match.group(1), float(match.group(2)), key))
    return found


def test_parity_speed_oneshot_audio(
    parity: Parity, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``speed`` != 1: the mel is linearly resampled before the vocoder, as upstream."""
    refs = _speed_refs(parity)
    assert refs, "the manifest describes no <case>_speed<x>_oneshot_audio reference"
    for case, speed, key in refs:
        _with_tokens(engine, monkeypatch, parity.array(FLOW, f"{case}_gen_tokens"))
        options = _options(parity, streaming=False, speed=speed)
        chunks = _synthesize(engine, _voice(parity, case), options)
        reference = _faded(parity.array(FLOW, key))
        assert_close(
            np.concatenate(chunks), reference, parity.tolerance("audio"), f"{case} speed {speed}"
        )


# --- streaming, variant (a): DiT with full attention ----------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_parity_stream_full_attention_upstream_schedule(
    parity: Parity, engine: Any, case: str
) -> None:
    """The engine's streaming stages driven with upstream's own chunk bounds.

    For every flow call upstream made (manifest ``flow_cases.<case>.stream_full.flow_calls``:
    tokens seen incl. the lookahead tokens, finalize flag, mel frames after it), the engine's
    flow runs on prompt ++ those tokens, drops the lookahead frames unless final (as the
    pipeline does), and its new frames go through the engine's streaming vocoder. Chunk mels,
    chunk bounds and audio must match upstream, including a prompt whose length is off the
    25-token grid (upstream pads the first chunk).
    """
    schedule = parity.flow_cases[case]["stream_full"]
    voice = _voice(parity, case).features
    gen = parity.array(FLOW, f"{case}_gen_tokens").astype(np.int64)
    call = _flow_call(parity)
    req = _request(parity)
    vocoder = VocoderStream(engine.hift, req.vocoder_noise)
    prompt_frames = int(voice.prompt_mel.shape[0])
    ratio = parity.token_mel_ratio(case)
    mels: list[np.ndarray] = []
    chunks: list[np.ndarray] = []
    done_frames = 0
    for n_tokens, finalize, _chunk_masked, mel_end in schedule["flow_calls"]:
        drop = 0 if finalize else ratio * parity.lookahead_tokens(case)
        noise = req.flow_noise.take(prompt_frames + ratio * n_tokens).T
        mel = engine.flow.mel_for_tokens(
            np.concatenate([voice.speech_tokens, gen[:n_tokens]]),
            voice,
            noise,
            call,
            drop_lookahead_frames=drop,
        )
        assert mel.shape[1] == mel_end, f"flow call on {n_tokens} tokens: frames"
        mels.append(mel[:, done_frames:])
        done_frames = mel_end
        chunks.append(vocoder.push(mels[-1], bool(finalize)))
    bounds = np.cumsum([len(c) for c in chunks])
    assert_identical(bounds, parity.array(FLOW, f"{case}_stream_full_bounds"), f"{case} bounds")
    assert_identical(bounds, [call[2] for call in schedule["hift_calls"]], f"{case} hift calls")
    assert_close(
        np.concatenate(mels, axis=1),
        parity.array(FLOW, f"{case}_stream_full_mel"),
        parity.tolerance("mel"),
        f"{case} streamed mel (upstream schedule)",
    )
    assert_close(
        np.concatenate(chunks),
        _faded(parity.array(FLOW, f"{case}_stream_full_audio")),
        parity.tolerance("audio"),
        f"{case} streamed audio (upstream schedule)",
    )


@pytest.mark.parametrize("case", CASES)
def test_parity_stream_full_attention_quality_schedule(
    parity: Parity, engine: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """``synthesize`` with the ``quality`` preset's schedule (upstream's: first chunk padded
    to the 25-token grid, then 25 -> 50 -> 100) but full attention in every chunk
    (``flow.chunk_causal`` False) streams variant (a): upstream's chunks and audio with the
    DiT forced to full attention, what the exported estimator computes. The preset itself
    (chunk-causal, variant b) is tested in test_parity_flow_chunked.py.
    """
    _with_tokens(engine, monkeypatch, parity.array(FLOW, f"{case}_gen_tokens"))
    options = _options(parity, flow={"chunk_causal": False})
    chunks = _synthesize(engine, _voice(parity, case), options)
    bounds = np.cumsum([len(c) for c in chunks])
    assert_identical(bounds, parity.array(FLOW, f"{case}_stream_full_bounds"), f"{case} bounds")
    assert_close(
        np.concatenate(chunks),
        _faded(parity.array(FLOW, f"{case}_stream_full_audio")),
        parity.tolerance("audio"),
        f"{case} streamed audio (quality schedule, full attention)",
    )
