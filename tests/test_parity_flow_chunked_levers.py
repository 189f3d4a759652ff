"""The lossy levers of the chunk-causal flow, on the upstream-exported parity model.

* ``flow_left_context_tokens`` with ``flow_chunk_causal``: the history cache stores only the
  frames a later chunk can attend, and dropping the older ones changes no output.
* ``flow_final_chunk_causal``: the final chunk runs on its new frames only (the cache) instead
  of upstream's full-attention pass; the streamed chunks before it are unchanged.

Skipped with the reason when ``../shared/parity`` is absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parity_support import PARITY_DIR, flow_case_voice

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.chunkmask import chunk_attention_bias
from wyoming_cosyvoice3.engine.derive.streaming_estimator import (
    StreamingEstimator,
    _session,
    ensure_streaming_estimator,
)
from wyoming_cosyvoice3.engine.flow import chunked
from wyoming_cosyvoice3.engine.flow.chunked import ChunkedFlow, StepKv, cacheable_prompt_frames
from wyoming_cosyvoice3.engine.flow_streaming import prompt_noise
from wyoming_cosyvoice3.engine.options import PRESETS, EngineOptions
from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine
from wyoming_cosyvoice3.engine.types import VoiceFeatures, VoicePrompt

PARITY = PARITY_DIR
ESTIMATOR = "flow.decoder.estimator.fp32.onnx"

pytestmark = pytest.mark.skipif(
    not (PARITY / "refs" / "manifest.json").is_file(),
    reason=f"parity fixtures not found at {PARITY} (../shared/parity next to the repository)",
)


@pytest.fixture(scope="module")
def flow_refs() -> Any:
    return np.load(PARITY / "refs" / "flow.npz")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("derived")
    ensure_streaming_estimator(PARITY / "model" / ESTIMATOR, path, "fp32", in_process=True)
    return path


@pytest.fixture(scope="module")
def engine(cache_dir: Path) -> CosyVoice3Engine:
    return CosyVoice3Engine.load(PARITY / "model", EngineOptions(cache_dir=cache_dir))


_voice = flow_case_voice


def _stream(flow: ChunkedFlow, voice: VoiceFeatures, gen: np.ndarray, hops: list[int],
            left_frames: int | None) -> tuple[list[np.ndarray], list[int], int]:
    """Non-final chunks of ``hops`` tokens (4 Euler steps, CFG in the first 2); returns the
    mel of each chunk, the stored history frames after each, and the frames seen."""
    noise = prompt_noise(2 * (len(voice.speech_tokens) + len(gen)))
    history = flow.new_history(4, 0.7, 2)
    mels, stored = [], []
    end = 0
    for hop in hops:
        end += hop
        tokens = np.concatenate([voice.speech_tokens, gen[: end + C.PRE_LOOKAHEAD_TOKENS]])
        mels.append(flow.chunk_mel(tokens, voice, noise, history, 4, 0.7, 2,
                                   C.TOKEN_MEL_RATIO * C.PRE_LOOKAHEAD_TOKENS,
                                   left_context_frames=left_frames))
        stored.append(max(s.frames for s in history.steps))
    return mels, stored, history.frames


def test_bounded_left_context_stores_only_what_is_attended(
    flow_refs: Any, engine: CosyVoice3Engine, cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dropping history frames outside the left context gives the same mel as keeping them
    and masking them out of the attention, and the stored history stays within the bound."""
    main = next(cache_dir.glob("*stream2main*.onnx"))
    time_graph = next(cache_dir.glob("*stream1time*.onnx"))
    flow = ChunkedFlow(engine.flow, StreamingEstimator(_session(main), None, time_graph),
                       prompt_noise)
    voice = _voice(flow_refs, "B")
    gen = np.asarray(flow_refs["B_gen_tokens"], dtype=np.int64)
    hops = [10, 10, 15, 15]
    left = 24  # frames: less than one chunk's history, so frames really are dropped
    bounded, stored, seen = _stream(flow, voice, gen, hops, left)
    assert all(n <= left for n in stored)
    prompt_frames = C.TOKEN_MEL_RATIO * len(voice.speech_tokens)
    assert seen == prompt_frames - cacheable_prompt_frames(len(voice.speech_tokens)) + (
        C.TOKEN_MEL_RATIO * sum(hops))
    # reference: every frame stored, the ones before the last ``left`` masked (-inf bias)
    append = StepKv.append
    monkeypatch.setattr(StepKv, "append",
                        lambda self, new, conv, keep_frames=None: append(self, new, conv))
    prompt_cached = cacheable_prompt_frames(len(voice.speech_tokens))

    def masked_bias(start: int, count: int, cached: int) -> np.ndarray:
        bias = chunk_attention_bias(start, count, cached)
        history = cached - prompt_cached
        bias[..., prompt_cached : prompt_cached + max(0, history - left)] = -np.inf
        return bias

    monkeypatch.setattr(chunked, "chunk_attention_bias", masked_bias)
    kept, stored_all, seen_all = _stream(flow, voice, gen, hops, left)
    assert stored_all[-1] == seen_all > left  # the reference kept every frame
    for a, b in zip(bounded, kept, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # the bound is a real lever: attending the whole history changes later chunks
    monkeypatch.setattr(chunked, "chunk_attention_bias", chunk_attention_bias)
    whole, _, _ = _stream(flow, voice, gen, hops, None)
    assert float(np.abs(whole[-1] - bounded[-1]).max()) > 1e-3


@pytest.mark.parametrize("case", ["A", "B"])
def test_final_chunk_causal_changes_only_the_final_chunk(
    case: str, flow_refs: Any, engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``quality`` with ``flow_final_chunk_causal``: same chunk bounds, the chunks before the
    last one equal the exact (upstream) stream, the last one is new audio of the same
    length from the cached path."""
    gen = [int(t) for t in flow_refs[f"{case}_gen_tokens"]]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))
    voice = VoicePrompt(features=_voice(flow_refs, case), name=f"levers-{case}")
    # vocoder deferral follows the wall clock; without it the chunk bounds are fixed
    exact_options = PRESETS["quality"].replace(vocoder_defer=False)
    exact = [c.samples for c in engine.synthesize("Hello.", voice, exact_options)]
    calls: list[int] = []
    real = engine.chunked.get("fp32")
    assert real is not None
    original = real.chunk_mel

    def counting(*args: Any, **kwargs: Any) -> np.ndarray:
        calls.append(int(args[7] if len(args) > 7 else kwargs["drop_lookahead_frames"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(real, "chunk_mel", counting)
    options = exact_options.replace(flow_final_chunk_causal=True)
    lever = [c.samples for c in engine.synthesize("Hello.", voice, options)]
    assert [len(c) for c in lever] == [len(c) for c in exact]
    assert calls[-1] == 0 and all(d == 6 for d in calls[:-1])  # the final chunk was causal
    for a, b in zip(exact[:-2], lever[:-2], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    tail = np.concatenate(lever[-2:])
    assert np.isfinite(tail).all()
    assert float(np.abs(tail - np.concatenate(exact[-2:])).max()) > 1e-4


@pytest.mark.parametrize("speed", [1.5, 0.75])
def test_chunk_causal_stream_scales_with_speed(
    speed: float, flow_refs: Any, engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Case C14 on the chunk-causal path (``quality``, streamed, final chunk causal too):
    the audio length scales by 1/speed within one mel frame per chunk."""
    gen = [int(t) for t in flow_refs["B_gen_tokens"]]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))
    voice = VoicePrompt(features=_voice(flow_refs, "B"), name="levers-speed")
    base = PRESETS["quality"].replace(flow_final_chunk_causal=True)
    normal = sum(len(c.samples) for c in engine.synthesize("Hello.", voice, base))
    chunks = list(engine.synthesize("Hello.", voice, base.replace(speed=speed)))
    scaled = sum(len(c.samples) for c in chunks)
    assert chunks[-1].is_last and np.isfinite(np.concatenate([c.samples for c in chunks])).all()
    assert abs(scaled - normal / speed) <= C.SAMPLES_PER_MEL_FRAME * len(chunks)
