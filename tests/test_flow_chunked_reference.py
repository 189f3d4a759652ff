"""The chunk-causal streaming flow against an uncached reference, without ``../shared``.

:class:`~wyoming_cosyvoice3.engine.flow.solver.ChunkedFlow` (the flow of the presets
``balanced``, ``fast`` and ``quality``) runs each streamed chunk on its new frames only,
attending to cached keys/values of the prompt and of earlier chunks. Upstream's PyTorch
streaming (cosyvoice/cli/model.py ``token2wav`` -> ``flow.inference(streaming=True)``) instead
runs the DiT on the prompt and every token so far in every chunk, under the static 50-frame
chunk mask (dit.py ``DiT.forward``: frame i attends to frame j iff
``j < (i // 50 + 1) * 50``), and keeps the new frames. The reference here is that uncached
computation, written in this file: its own attention mask, cosine time schedule, CFG
combination and Euler update (spec section 5); the only network it runs is the derived
streaming DiT graph itself, called uncached (start 0, no keys/values, no convolution state),
and the flow encoder for ``mu``. Under the chunk mask both are the same computation, so the
cached chunks must equal the reference up to float32 rounding (:data:`TOL`). The DiT is
the tiny model's with its attention amplified (:data:`AMPLIFY`), so that attention errors
show.

The scene is chosen so that each part of the cache bookkeeping matters: 37 prompt tokens
(74 prompt frames, of which only the whole chunks ending before the 3 lookahead tokens'
frames, 50, are in the prompt cache: the first chunk also runs the 24 uncached prompt-tail
frames, with the fixed prompt noise), chunks ending on the 25-token grid as upstream's
schedule does (first hop 25 + 13 padding, then 25, then 50), CFG in the first 2 of 4 Euler
steps (batch 2, then batch 1), and a request noise that is not the prompt noise. With a
bounded left context (``balanced`` and ``fast``) the engine drops old history frames and the
reference masks them instead.

The pipeline check at the end runs ``synthesize`` with the ``balanced`` preset on the tiny model
and checks that every flow call went through the chunk-causal flow with the preset's bounds.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions
from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import ensure_streaming_estimator
from wyoming_cosyvoice3.engine.dit_runner import StreamingEstimator, _session
from wyoming_cosyvoice3.engine.flow.solver import (
    ChunkedFlow,
    FlowCall,
    KvCache,
    cacheable_prompt_frames,
)
from wyoming_cosyvoice3.engine.flow.stream import prompt_noise
from wyoming_cosyvoice3.engine.options import PRESETS, EulerSchedule, VoiceFeatures, VoicePrompt

ESTIMATOR = "flow.decoder.estimator.fp32.onnx"
CHUNK = 50
"""Upstream's static chunk in mel frames (cosyvoice3.yaml ``static_chunk_size``)."""
LOOKAHEAD = 3
"""Pre-lookahead tokens: a non-final chunk passes 3 more tokens and drops their 6 mu frames."""
PROMPT_TOKENS = 37
PROMPT_FRAMES = 2 * PROMPT_TOKENS
PROMPT_CACHE_FRAMES = 2 * (PROMPT_TOKENS - LOOKAHEAD) // CHUNK * CHUNK
"""50: whole chunks ending before the frames of the last 3 prompt tokens, whose mu depends on
the generated tokens (the encoder's pre-lookahead layer); 24 prompt frames remain uncached."""
CHUNK_ENDS = (38, 63, 113)
"""Generated tokens at each chunk's end: first hop 25 padded to the 25-token grid
(37 + 38 = 75), then hops of 25 and 50: new frames [50, 150), [150, 200), [200, 300)."""
STEPS, CFG_RATE = 4, 0.7
LEFT_CONTEXT = 60
"""History frames kept in the bounded case (not a multiple of 50: the visible history starts
inside a chunk; 60 < 100 so the second and third chunks really lose frames)."""
AMPLIFY = 1.2
"""Factor on the tiny DiT's attention projections (q, k, v, out) and time MLP in the DiT copy
used here: std 0.1 x 1.2, the attention scale of the DiT this test was tuned on (std 0.02
x 6), at which the left-context bound, the chunk mask and the rotary start each change the
mel far above float rounding (the mutation tests below) while cached vs uncached stays at
float rounding (:data:`TOL`). Unamplified std 0.02 weights move the velocity through
attention by about 1e-5 only, so a wrong mask or rotary position would hide in rounding."""
TOL = 2e-5
"""Max abs mel difference allowed (mel magnitude about 4). Cached and uncached runs do the
same float32 arithmetic in other blockings (attention over split key sets, convolution context
carried instead of recomputed); measured 4.8e-7-7.2e-7, i.e. a few float32 ulps of 4. 2e-5
leaves 30x room for other CPUs' kernels and stays 300x below the smallest mutation effect."""


# -- the reference (this file's own formulas) -------------------------------------------------
def cosine_times(steps: int) -> npt.NDArray[np.float32]:
    """flow_matching.py ``t_scheduler == "cosine"``: ``t_k = 1 - cos(pi/2 * k / steps)`` as
    upstream computes it, every operation in float32 (``torch.linspace`` counts the first half
    up from 0 and the second half down from 1; the cosine rounded once)."""
    f32, step = np.float32, np.float32(1.0) / np.float32(steps)
    times = []
    for k in range(steps + 1):
        t = f32(k) * step if k < (steps + 1) // 2 else f32(1.0) - f32(steps - k) * step
        angle = f32(f32(t * f32(0.5)) * f32(math.pi))
        times.append(f32(1.0) - f32(math.cos(float(angle))))
    return np.array(times, dtype=np.float32)


def chunk_mask_bias(frames: int, call_start: npt.NDArray[np.int64],
                    left: int | None) -> npt.NDArray[np.float32]:
    """Additive bias [1, 1, frames, frames] of the uncached run over frames 0..frames-1.

    Upstream's static chunk mask: i attends to j iff ``j < (i // 50 + 1) * 50``. With a
    bounded left context ``left``, frame i made by the chunk call that started at frame
    ``call_start[i]`` also loses the history frames that call no longer held: the engine keeps
    the prompt-cache frames (0 .. 49) always and, of the frames after them, only the last
    ``left`` before the call's first new frame (solver.py ``StepKv.append``).
    """
    i = np.arange(frames)[:, None]
    j = np.arange(frames)[None, :]
    allowed = j < (i // CHUNK + 1) * CHUNK
    if left is not None:
        allowed &= (j < PROMPT_CACHE_FRAMES) | (j >= call_start[:, None] - left)
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)[None, None]


def reference_chunks(encode: Any, estimator: StreamingEstimator, voice: VoiceFeatures,
                     gen: npt.NDArray[np.int64], noise: npt.NDArray[np.float32],
                     left: int | None) -> list[npt.NDArray[np.float32]]:
    """Upstream's streaming: per chunk, the whole prompt + tokens so far solved uncached under
    the chunk mask; the chunk's new frames kept (the first chunk's start after the prompt)."""
    call_start = np.zeros(2 * (PROMPT_TOKENS + CHUNK_ENDS[-1]), dtype=np.int64)
    t = cosine_times(STEPS)
    done = PROMPT_FRAMES
    first_new = PROMPT_CACHE_FRAMES  # the prompt cache's frames were made by a call at 0
    out = []
    for n in CHUNK_ENDS:
        tokens = np.concatenate([voice.speech_tokens, gen[: n + LOOKAHEAD]])
        mu, spks = encode(tokens, voice.speaker_embedding)
        end = 2 * (PROMPT_TOKENS + n)
        mu = np.ascontiguousarray(mu[:, :end])  # the lookahead tokens' 6 frames dropped
        call_start[first_new:end] = first_new
        bias = chunk_mask_bias(end, call_start[:end], left)
        # x0: the fixed prompt noise on the prompt frames, the request's noise (column =
        # frame) after them; cond: the prompt mel on the prompt frames, zeros after
        x = np.concatenate([prompt_noise(PROMPT_FRAMES), noise[:, PROMPT_FRAMES:end]], axis=1)
        cond = np.zeros((80, end), dtype=np.float32)
        cond[:, :PROMPT_FRAMES] = voice.prompt_mel.T
        for k in range(STEPS):
            rows = [(mu, cond, spks), (0 * mu, 0 * cond, 0 * spks)]
            feeds = {"x": np.stack([x] * len(rows)),
                     "mu": np.stack([r[0] for r in rows]),
                     "cond": np.stack([r[1] for r in rows]),
                     "spks": np.stack([r[2] for r in rows])}
            v = estimator.run(feeds, float(t[k]), 0, bias, keep=False).velocity
            vel = (1.0 + CFG_RATE) * v[0] - CFG_RATE * v[1]
            x = (x + (t[k + 1] - t[k]) * vel).astype(np.float32)
        out.append(x[:, done:end])
        done = first_new = end
    return out


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chunked-ref")


@pytest.fixture(scope="module")
def engine(tiny_dit_model_dir: Path, cache_dir: Path) -> CosyVoice3Engine:
    """tiny-dit engine; its int8 streaming DiT (``balanced``) derived here in-process."""
    # its own engine: its cache directory is the one the reference estimator reads
    ensure_streaming_estimator(tiny_dit_model_dir / ESTIMATOR, cache_dir, "int8",
                               in_process=True)
    return CosyVoice3Engine.load(tiny_dit_model_dir, EngineOptions(
        threads=1, llm_precision="fp32", cache_dir=cache_dir,
        mmap_embeddings=False))


@pytest.fixture(scope="module")
def estimator(tiny_dit_model_dir: Path, cache_dir: Path) -> StreamingEstimator:
    """The fp32 streaming DiT derived from a copy of tiny-dit's estimator with attention
    amplified (:data:`AMPLIFY`); derived once per module."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(tiny_dit_model_dir / ESTIMATOR))
    scaled = 0
    for init in model.graph.initializer:
        name = init.name
        if name.endswith(("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight",
                          "attn.to_out.0.weight")) or (
                name.startswith("time_embed.time_mlp.") and name.endswith(".weight")):
            weight = numpy_helper.to_array(init) * np.float32(AMPLIFY)
            init.CopyFrom(numpy_helper.from_array(weight.astype(np.float32), name))
            scaled += 1
    assert scaled >= 4 * 2 + 2  # 4 projections per block (2 blocks) and the time MLP
    source = cache_dir / "amplified" / ESTIMATOR
    source.parent.mkdir()
    onnx.save(model, str(source))
    main, time_graph = ensure_streaming_estimator(source, source.parent, "fp32", in_process=True)
    return StreamingEstimator(_session(main), None, time_graph)


@pytest.fixture(scope="module")
def scene() -> tuple[VoiceFeatures, npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """(voice with 37 prompt tokens, generated tokens, request noise [80, frames])."""
    rng = np.random.default_rng(24)
    voice = VoiceFeatures(
        speech_tokens=rng.integers(2400, 6561, PROMPT_TOKENS).astype(np.int64),
        speaker_embedding=rng.standard_normal(192).astype(np.float32),
        prompt_mel=(rng.standard_normal((PROMPT_FRAMES, 80)) - 4.0).astype(np.float32),
    )
    gen = rng.integers(2400, 6561, CHUNK_ENDS[-1] + LOOKAHEAD).astype(np.int64)
    noise = rng.standard_normal((80, 2 * (PROMPT_TOKENS + CHUNK_ENDS[-1]))).astype(np.float32)
    return voice, gen, noise


@pytest.fixture(scope="module")
def references(engine: CosyVoice3Engine, estimator: StreamingEstimator,
               scene: tuple[VoiceFeatures, Any, Any]) -> dict[int | None, list[np.ndarray]]:
    """Reference chunks for the whole history (None) and for :data:`LEFT_CONTEXT`."""
    return {left: reference_chunks(engine.flow.encode, estimator, *scene, left)
            for left in (None, LEFT_CONTEXT)}


def engine_chunks(engine: CosyVoice3Engine, estimator: StreamingEstimator,
                  scene: tuple[VoiceFeatures, Any, Any], left: int | None
                  ) -> tuple[list[np.ndarray], KvCache]:
    """The chunks as the pipeline asks for them: ``chunk_mel`` per chunk with one history."""
    voice, gen, noise = scene
    flow = ChunkedFlow(engine.flow, estimator, prompt_noise)
    schedule = EulerSchedule(STEPS, CFG_RATE)
    history = flow.new_history(schedule, left)
    mels = [flow.chunk_mel(np.concatenate([voice.speech_tokens, gen[: n + LOOKAHEAD]]), voice,
                           noise, history, FlowCall(schedule), 2 * LOOKAHEAD)
            for n in CHUNK_ENDS]
    return mels, history


def _assert_chunks_equal(got: list[np.ndarray], ref: list[np.ndarray]) -> None:
    widths = [2 * (b - a) for a, b in zip((0, *CHUNK_ENDS[:-1]), CHUNK_ENDS, strict=True)]
    assert [r.shape for r in ref] == [(80, w) for w in widths] == [(80, 76), (80, 50), (80, 100)]
    for index, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape, f"chunk {index}"
        assert np.isfinite(r).all() and np.abs(r).max() > 1.0
        err = float(np.abs(g - r).max())
        assert err <= TOL, f"chunk {index}: max abs error {err:.3g} > {TOL}"


# -- tests ------------------------------------------------------------------------------------
def test_scene_runs_uncached_prompt_tail() -> None:
    """The scene's premises: 37 prompt tokens leave 24 of the 74 prompt frames outside the
    prompt cache (the first chunk solves them), and chunk ends sit on the 50-frame grid as
    upstream's padded schedule puts them (else cached and uncached would legitimately
    differ)."""
    assert cacheable_prompt_frames(PROMPT_TOKENS) == PROMPT_CACHE_FRAMES == 50
    assert PROMPT_FRAMES - PROMPT_CACHE_FRAMES == 24
    assert all(2 * (PROMPT_TOKENS + n) % CHUNK == 0 for n in CHUNK_ENDS)


def test_cached_chunks_equal_the_uncached_reference_with_the_whole_history(
    engine: CosyVoice3Engine, estimator: StreamingEstimator,
    scene: tuple[VoiceFeatures, Any, Any], references: dict[int | None, list[np.ndarray]],
) -> None:
    """(a) ``quality``'s form: the whole history cached. Each chunk's new mel frames equal
    upstream's uncached chunk-masked solve; the history holds every frame after the prompt
    cache, per Euler step, with 2 CFG rows."""
    got, history = engine_chunks(engine, estimator, scene, None)
    _assert_chunks_equal(got, references[None])
    end = 2 * (PROMPT_TOKENS + CHUNK_ENDS[-1])
    assert history.frames == end - PROMPT_CACHE_FRAMES
    assert [s.frames for s in history.steps] == [end - PROMPT_CACHE_FRAMES] * STEPS
    assert [s.dropped for s in history.steps] == [0] * STEPS
    assert [s.kv[0][0].shape[0] for s in history.steps if s.kv] == [2] * STEPS


def test_cached_chunks_equal_the_uncached_reference_with_a_bounded_left_context(
    engine: CosyVoice3Engine, estimator: StreamingEstimator,
    scene: tuple[VoiceFeatures, Any, Any], references: dict[int | None, list[np.ndarray]],
) -> None:
    """(b) ``balanced``'s and ``fast``'s form: only the last 60 history frames kept. The
    engine drops older history frames (the prompt cache stays); the reference masks the same
    frames, and the chunks agree. The bound really acts: frames were dropped, and it changes
    the second and third chunks far beyond the tolerance."""
    got, history = engine_chunks(engine, estimator, scene, LEFT_CONTEXT)
    ref = references[LEFT_CONTEXT]
    _assert_chunks_equal(got, ref)
    end = 2 * (PROMPT_TOKENS + CHUNK_ENDS[-1])
    assert [s.frames for s in history.steps] == [LEFT_CONTEXT] * STEPS
    assert [s.dropped for s in history.steps] == [end - PROMPT_CACHE_FRAMES - LEFT_CONTEXT] * STEPS
    assert history.frames == end - PROMPT_CACHE_FRAMES  # next frame index unchanged
    full = references[None]
    np.testing.assert_array_equal(ref[0], full[0])  # nothing dropped before the first chunk
    effect = [float(np.abs(a - b).max()) for a, b in zip(ref[1:], full[1:], strict=True)]
    assert min(effect) > 100 * TOL


def test_balanced_preset_streams_every_flow_call_chunk_causally(
    engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``synthesize`` with the default preset ``balanced`` (LLM replaced by 120 fixed tokens)
    on tiny-dit: the int8 streaming DiT is loaded, and every flow call of the piece, the final
    one too (``flow.final_chunk_causal``), goes through :meth:`ChunkedFlow.chunk_mel` with one
    history, the preset's last prompt tokens (103), a 100-frame (50-token) left context and the hop
    schedule 10, 20, 40, then the rest; no full-attention pass runs. The audio covers
    exactly the mel frames those calls returned (480 samples per frame)."""
    opts = PRESETS["balanced"]
    assert opts.flow.precision == "int8" and opts.flow.final_chunk_causal
    rng = np.random.default_rng(7)
    prompt_tokens, gen_count = 130, 120
    features = VoiceFeatures(
        speech_tokens=rng.integers(2400, 6561, prompt_tokens).astype(np.int64),
        speaker_embedding=rng.standard_normal(192).astype(np.float32),
        prompt_mel=(rng.standard_normal((2 * prompt_tokens, 80)) - 4.0).astype(np.float32),
    )
    voice = VoicePrompt(features=features, transcript="A test voice.", name="ref")
    gen = [int(t) for t in rng.integers(2400, 6561, gen_count)]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))

    def no_full_attention(*_a: object, **_k: object) -> np.ndarray:
        raise AssertionError("balanced ran a full-attention flow pass")

    monkeypatch.setattr(engine.flow, "mel_for_tokens", no_full_attention)
    flow = engine.chunked.get("int8")
    assert flow is not None and engine.chunked.loaded() == {"int8": True}
    assert flow.estimator.path is not None and "int8" in flow.estimator.path.name
    calls: list[dict[str, Any]] = []
    chunk_mel = flow.chunk_mel
    signature = inspect.signature(chunk_mel)

    def recording(*args: Any, **kwargs: Any) -> np.ndarray:
        mel = chunk_mel(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments, frames=mel.shape[1]))
        return mel

    monkeypatch.setattr(flow, "chunk_mel", recording)
    options = opts.replace(vocoder={"defer": False})
    chunks = list(engine.synthesize("The kitchen lights are on.", voice, options))

    assert chunks and chunks[-1].is_last and all(c.piece_index == 0 for c in chunks)
    gen_ends = [13, 33, 73, 120]  # hops 10, 20, 40 (+3 lookahead each), then the final chunk
    flow_prompt = opts.flow.prompt_tokens
    assert flow_prompt == 103 < prompt_tokens
    assert [len(c["tokens"]) - flow_prompt for c in calls] == gen_ends
    for c, end in zip(calls, gen_ends, strict=True):
        np.testing.assert_array_equal(c["tokens"][:flow_prompt],
                                      features.speech_tokens[-flow_prompt:])
        np.testing.assert_array_equal(c["tokens"][flow_prompt:], gen[:end])
        np.testing.assert_array_equal(c["voice"].prompt_mel,
                                      features.prompt_mel[-2 * flow_prompt:])
        assert c["history"] is calls[0]["history"]
        assert c["call"].schedule == opts.flow.schedule
        assert opts.flow.schedule.steps == 4
        # the final chunk drops no lookahead frames, and so stores no keys/values
        assert c["drop_lookahead_frames"] == (0 if end == gen_count else 2 * LOOKAHEAD)
        assert c["history"].keep_frames == 100
    assert [c["frames"] for c in calls] == [20, 40, 80, 100]
    history = calls[0]["history"]
    assert max(s.frames for s in history.steps) == 100 and history.steps[0].dropped > 0
    assert sum(len(c.samples) for c in chunks) == 480 * 2 * gen_count
