"""The lossy levers of the chunk-causal flow, on the upstream-exported parity model.

* ``flow.left_context_tokens`` with ``flow.chunk_causal``: the history cache stores only the
  frames a later chunk can attend, and dropping the older ones changes no output.
* ``flow.final_chunk_causal``: the final chunk runs on its new frames only (the cache) instead
  of upstream's full-attention pass; the streamed chunks before it are unchanged.

The fixture set is the one ``parity_support`` selects (skipped without it, failed in CI); the
engine is shared with test_parity_flow_chunked.py. Cases, flow settings and geometry come from
its manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parity_support import (
    Parity,
    flow_case_voice,
    parity_cases,
    parity_engine,
    quality_options,
)

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.dit_runner import StreamingEstimator, _session, chunk_attention_bias
from wyoming_cosyvoice3.engine.flow import solver
from wyoming_cosyvoice3.engine.flow.solver import ChunkedFlow, FlowCall, StepKv
from wyoming_cosyvoice3.engine.flow.stream import prompt_noise
from wyoming_cosyvoice3.engine.options import EulerSchedule, VoiceFeatures, VoicePrompt
from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine

CASES = parity_cases("flow")


@pytest.fixture(scope="module")
def flow_refs(parity: Parity) -> Any:
    return parity.refs("flow.npz")


@pytest.fixture(scope="module")
def engine(parity: Parity, parity_streaming_files: tuple[Path, Path]) -> CosyVoice3Engine:
    del parity_streaming_files
    return parity_engine(parity, published_estimator=True)  # type: ignore[no-any-return]


def _off_grid_case(parity: Parity) -> str:
    """The case whose first chunk upstream pads (prompt off the chunk grid), else the first."""
    cases = parity.flow_cases
    return next((c for c, info in cases.items() if info.get("prompt_token_pad")), next(iter(cases)))


_voice = flow_case_voice


def _stream(parity: Parity, case: str, flow: ChunkedFlow, voice: VoiceFeatures,
            gen: np.ndarray, hops: list[int], left_frames: int | None
            ) -> tuple[list[np.ndarray], list[int], int]:
    """Non-final chunks of ``hops`` tokens (the set's Euler steps and CFG rate); returns the
    mel of each chunk, the stored history frames after each, and the frames seen."""
    steps, cfg = parity.euler_steps, parity.cfg_rate
    ratio, lookahead = parity.token_mel_ratio(case), parity.lookahead_tokens(case)
    drop = ratio * lookahead
    noise = prompt_noise(ratio * (len(voice.speech_tokens) + len(gen)))
    schedule = EulerSchedule(steps, cfg)
    history = flow.new_history(schedule, left_frames)
    mels, stored = [], []
    end = 0
    for hop in hops:
        end += hop
        tokens = np.concatenate([voice.speech_tokens, gen[: end + lookahead]])
        mels.append(flow.chunk_mel(tokens, voice, noise, history, FlowCall(schedule), drop))
        stored.append(max(s.frames for s in history.steps))
    return mels, stored, history.frames


def _lever_hops(tokens: int) -> list[int]:
    """Four non-final chunks (tokens) for the left-context lever, not upstream's schedule:
    h, h, 1.5 h, 1.5 h with h = 10, or less when the case has fewer than 5 h ``tokens``
    (generated tokens that can end a non-final chunk: the last lookahead ones cannot)."""
    hop = min(10, tokens // 5)
    assert hop >= 2, f"{tokens} generated tokens are too few for four streamed chunks"
    return [hop, hop, hop + hop // 2, hop + hop // 2]


def test_bounded_left_context_stores_only_what_is_attended(
    parity: Parity, flow_refs: Any, engine: CosyVoice3Engine,
    parity_streaming_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dropping history frames outside the left context gives the same mel as keeping them
    and masking them out of the attention, and the stored history stays within the bound."""
    main, time_graph = parity_streaming_files
    flow = ChunkedFlow(engine.flow, StreamingEstimator(_session(main), None, time_graph),
                       prompt_noise)
    case = _off_grid_case(parity)
    voice = _voice(flow_refs, case)
    gen = np.asarray(flow_refs[f"{case}_gen_tokens"], dtype=np.int64)
    ratio = parity.token_mel_ratio(case)
    hops = _lever_hops(len(gen) - parity.lookahead_tokens(case))
    left = ratio * hops[0] + ratio * 2  # frames: one hop and a bit, so frames really drop
    tol = parity.tolerance("mel")
    bounded, stored, seen = _stream(parity, case, flow, voice, gen, hops, left)
    assert all(n <= left for n in stored)
    prompt_cached = parity.cacheable_prompt_frames(case)
    assert seen == voice.prompt_mel.shape[0] - prompt_cached + ratio * sum(hops)
    # reference: every frame stored, the ones before the last ``left`` masked (-inf bias)
    append = StepKv.append
    monkeypatch.setattr(StepKv, "append",
                        lambda self, new, conv, keep_frames=None: append(self, new, conv))

    def masked_bias(start: int, count: int, cached: int) -> np.ndarray:
        bias = chunk_attention_bias(start, count, cached)
        history = cached - prompt_cached
        bias[..., prompt_cached : prompt_cached + max(0, history - left)] = -np.inf
        return bias

    monkeypatch.setattr(solver, "chunk_attention_bias", masked_bias)
    kept, stored_all, seen_all = _stream(parity, case, flow, voice, gen, hops, left)
    assert stored_all[-1] == seen_all > left  # the reference kept every frame
    for a, b in zip(bounded, kept, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol)
    # the bound is a real lever: attending the whole history changes later chunks
    monkeypatch.setattr(solver, "chunk_attention_bias", chunk_attention_bias)
    whole, _, _ = _stream(parity, case, flow, voice, gen, hops, None)
    assert float(np.abs(whole[-1] - bounded[-1]).max()) > tol


@pytest.mark.parametrize("case", CASES)
def test_final_chunk_causal_changes_only_the_final_chunk(
    case: str, parity: Parity, flow_refs: Any, engine: CosyVoice3Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``quality`` with ``flow_final_chunk_causal``: same chunk bounds, the chunks before the
    last one equal the exact (upstream) stream, the last one is new audio of the same
    length from the cached path."""
    gen = [int(t) for t in flow_refs[f"{case}_gen_tokens"]]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))
    voice = VoicePrompt(features=_voice(flow_refs, case), name=f"levers-{case}")
    exact_options = quality_options(parity)
    exact = [c.samples for c in engine.synthesize("Hello.", voice, exact_options)]
    calls: list[int] = []
    real = engine.chunked.get("fp32")
    assert real is not None
    original = real.chunk_mel

    def counting(*args: Any, **kwargs: Any) -> np.ndarray:
        calls.append(int(args[5] if len(args) > 5 else kwargs["drop_lookahead_frames"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(real, "chunk_mel", counting)
    options = exact_options.replace(flow={"final_chunk_causal": True})
    lever = [c.samples for c in engine.synthesize("Hello.", voice, options)]
    assert [len(c) for c in lever] == [len(c) for c in exact]
    drop = parity.token_mel_ratio(case) * parity.lookahead_tokens(case)
    n_calls = len(parity.flow_case(case)["stream_chunkmask"]["flow_calls"])
    assert calls == [drop] * (n_calls - 1) + [0]  # the final chunk was causal, nothing dropped
    for a, b in zip(exact[:-2], lever[:-2], strict=True):
        np.testing.assert_array_equal(a, b)  # the same computation before the final chunk
    tol = parity.tolerance("audio")
    tail = np.concatenate(lever[-2:])
    assert np.isfinite(tail).all()
    assert float(np.abs(tail - np.concatenate(exact[-2:])).max()) > tol


@pytest.mark.parametrize("speed", [1.5, 0.75])
def test_chunk_causal_stream_scales_with_speed(
    speed: float, parity: Parity, flow_refs: Any, engine: CosyVoice3Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Case C14 on the chunk-causal path (``quality``, streamed, final chunk causal too):
    the audio length scales by 1/speed within one mel frame per chunk."""
    case = _off_grid_case(parity)
    gen = [int(t) for t in flow_refs[f"{case}_gen_tokens"]]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))
    voice = VoicePrompt(features=_voice(flow_refs, case), name="levers-speed")
    base = quality_options(parity, flow={"final_chunk_causal": True})
    normal = sum(len(c.samples) for c in engine.synthesize("Hello.", voice, base))
    chunks = list(engine.synthesize("Hello.", voice, base.replace(speed=speed)))
    scaled = sum(len(c.samples) for c in chunks)
    assert chunks[-1].is_last and np.isfinite(np.concatenate([c.samples for c in chunks])).all()
    assert abs(scaled - normal / speed) <= C.SAMPLES_PER_MEL_FRAME * len(chunks)
