"""Parity of the chunk-causal streaming flow with upstream's PyTorch streaming (variant b).

Fixtures: the set ``parity_support`` selects (README there): a model directory exported from
upstream's classes (random weights) and upstream's outputs. ``flow.npz`` variant (b) is
upstream's streaming loop as it runs in PyTorch: non-final chunks with the DiT's static chunk
mask (``dims.flow.dit.static_chunk_size`` frames), the final chunk with full attention. Cases,
chunk calls, flow settings, DiT geometry, seeds and tolerances are read from
``refs/manifest.json``.

The prompt-noise convention (a statement of these tests): upstream draws one fixed noise
buffer for every frame of every request (the fixtures store it: the engine's flow noise of the
manifest's request seed). The engine's chunk-causal path caches the prompt frames' keys and
values per voice, so it fixes their noise at the seed-0 request's (``PROMPT_NOISE_SEED``) and
draws the generated frames from the request's seed. A seed-0 request therefore streams exactly
upstream's chunk-masked reference, and another seed is another, equally valid draw: different
generated frames over the same seed-0 prompt frames.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parity_support import (
    Parity,
    assert_close,
    assert_identical,
    faded,
    flow_case_voice,
    parity_cases,
    parity_engine,
    quality_options,
)

from wyoming_cosyvoice3.engine.derive.flow.dit_structure import StructureError, read_dit
from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import ensure_streaming_estimator
from wyoming_cosyvoice3.engine.dit_runner import StreamingEstimator, _session
from wyoming_cosyvoice3.engine.dit_runner import chunk_attention_bias as chunk_bias
from wyoming_cosyvoice3.engine.errors import ModelLoadError
from wyoming_cosyvoice3.engine.flow.solver import ChunkedFlow, FlowCall, cacheable_prompt_frames
from wyoming_cosyvoice3.engine.flow.stream import prompt_noise
from wyoming_cosyvoice3.engine.options import (
    EulerSchedule,
    SynthesisOptions,
    SynthesisResult,
    VoicePrompt,
)
from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine, RequestState

ESTIMATOR = "flow.decoder.estimator.fp32.onnx"
FLOW = "flow.npz"
CASES = parity_cases("flow")
TEXT = "Hello."
"""Any one-piece speakable text: the LLM is replaced, so only the piece count matters."""
PROMPT_SEED = 0
"""The convention under test: chunk-causal prompt frames use the seed-0 request's flow noise
(engine/flow/stream.py ``PROMPT_NOISE_SEED``; stated here, not read from the engine)."""


@pytest.fixture(scope="module")
def flow_refs(parity: Parity) -> Any:
    return parity.refs(FLOW)


@pytest.fixture(scope="module")
def engine(parity: Parity, parity_streaming_files: tuple[Path, Path]) -> CosyVoice3Engine:
    """Full attention on the published estimator; chunk-causal flow on first use (from
    the streaming DiT ``parity_streaming_files`` derived into the shared cache directory)."""
    del parity_streaming_files
    return parity_engine(parity, published_estimator=True)  # type: ignore[no-any-return]


def _upstream_noise(flow_refs: Any) -> Callable[[int], np.ndarray]:
    """``frames -> float32 [80, frames]``: upstream's fixed noise (``flow_noise``) as the
    prompt noise, so the chunk-causal mechanics meet upstream for any request seed."""
    noise = np.asarray(flow_refs["flow_noise"], dtype=np.float32)
    return lambda frames: np.ascontiguousarray(noise[:, :frames])


@pytest.fixture(scope="module")
def chunked(engine: CosyVoice3Engine, flow_refs: Any,
            parity_streaming_files: tuple[Path, Path]) -> ChunkedFlow:
    main, time_graph = parity_streaming_files
    return ChunkedFlow(engine.flow, StreamingEstimator(_session(main), None, time_graph),
                       _upstream_noise(flow_refs))


def _off_grid_case(parity: Parity) -> str:
    """The case whose first chunk upstream pads (prompt off the chunk grid), else the first."""
    cases = parity.flow_cases
    return next((c for c, info in cases.items() if info.get("prompt_token_pad")), next(iter(cases)))


def _with_tokens(engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch,
                 tokens: Any) -> None:
    gen = [int(t) for t in tokens]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))


def _bounds(chunks: list[np.ndarray]) -> np.ndarray:
    return np.cumsum([len(c) for c in chunks])


# --- the derived streaming DiT -------------------------------------------------------------


def test_parity_structure_read_from_the_upstream_export(parity: Parity) -> None:
    import onnx

    dims = read_dit(onnx.load(str(parity.model_dir / ESTIMATOR)))
    dit = parity.dit
    assert (dims.depth, dims.dim, dims.heads, dims.head_dim) == (
        dit["depth"], dit["dim"], dit["heads"], dit["dim_head"])
    assert dims.input_order == ["x", "cond", "mu", "spks"]  # modules.py InputEmbedding order
    # modules.py ConvPositionEmbedding(kernel_size=31, groups=16): upstream code, not the set
    assert dims.kernel == 31 and dims.conv_groups == 16
    assert dims.layout_hint == "interleaved"  # x-transformers pairs


def test_parity_derived_graph_equals_source_and_cache_is_exact(
    parity: Parity, parity_streaming_files: tuple[Path, Path],
) -> None:
    """Full attention without cache equals the published graph; a cached chunk equals the
    uncached chunk-masked run (both also checked when the file is derived)."""
    main, time_graph = parity_streaming_files
    est = StreamingEstimator(_session(main), _session(time_graph))
    source = _session(parity.model_dir / ESTIMATOR)
    dit, tol = parity.dit, parity.tolerance("mel")
    chunk = int(dit["static_chunk_size"])
    rng = np.random.default_rng(3)
    frames = 2 * chunk + chunk // 3 + 1  # two whole chunks and a part of a third
    probe = {"x": rng.standard_normal((2, dit["mel_dim"], frames)).astype(np.float32),
             "mu": rng.standard_normal((2, dit["mu_dim"], frames)).astype(np.float32),
             "cond": rng.standard_normal((2, dit["mel_dim"], frames)).astype(np.float32),
             "spks": rng.standard_normal((2, dit["spk_dim"])).astype(np.float32)}
    t = 0.61
    ref = source.run(None, {**probe, "t": np.full(2, t, np.float32),
                            "mask": np.ones((2, 1, frames), np.float32)})[0]
    full = est.run(probe, t, 0, chunk_bias(0, frames, 0, 0)).velocity
    assert_close(full, ref, tol, "streaming DiT, full attention vs published")
    masked = est.run(probe, t, 0, chunk_bias(0, frames, 0, chunk)).velocity
    assert float(np.abs(masked - ref).max()) > tol  # the mask changes the result
    split = 2 * chunk
    head = est.run({k: v[..., :split] if v.ndim == 3 else v for k, v in probe.items()}, t, 0,
                   chunk_bias(0, split, 0, chunk))
    tail = est.run({k: v[..., split:] if v.ndim == 3 else v for k, v in probe.items()}, t,
                   split, chunk_bias(split, frames - split, split, chunk),
                   (head.conv1_next, head.conv2_next), None, head.new)
    assert_close(tail.velocity, masked[..., split:], tol, "cached chunk vs uncached mask")
    # batch 1 (steps without CFG) gives row 0 of batch 2
    one = est.run({k: v[:1] for k, v in probe.items()}, t, 0, chunk_bias(0, frames, 0, 0))
    assert_close(one.velocity[0], full[0], tol, "batch 1 vs row 0 of batch 2")


def test_parity_prompt_cache_covers_whole_chunks_before_the_lookahead(parity: Parity) -> None:
    """The engine caches the prompt frames the manifest's geometry says are independent of
    the generated tokens: whole static chunks ending before the lookahead frames."""
    for case, info in parity.flow_cases.items():
        assert cacheable_prompt_frames(int(info["prompt_tokens"])) == (
            parity.cacheable_prompt_frames(case)), case
    case = next(iter(parity.flow_cases))
    chunk, ratio = int(parity.dit["static_chunk_size"]), parity.token_mel_ratio(case)
    smallest = chunk // ratio + parity.lookahead_tokens(case)  # one whole chunk, no more
    assert cacheable_prompt_frames(smallest) == chunk
    assert cacheable_prompt_frames(smallest - 1) == 0
    assert cacheable_prompt_frames(0) == 0


def test_parity_estimator_without_dit_blocks_is_refused_cleanly(tmp_path: Path) -> None:
    """A graph without upstream's DiT structure (a convolutional estimator) raises
    StructureError, and the cached derivation reports ModelLoadError (the caller's fallback
    signal) and a failure marker."""
    import onnx
    from broken_graphs import convolutional_estimator

    path = tmp_path / "model" / ESTIMATOR
    path.parent.mkdir()
    onnx.save(convolutional_estimator(), str(path))
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(StructureError):
        read_dit(onnx.load(str(path)))
    with pytest.raises(ModelLoadError):
        ensure_streaming_estimator(path, cache, "fp32", in_process=True)
    assert list(cache.glob("*.failed"))
    with pytest.raises(ModelLoadError, match="earlier attempt"):
        ensure_streaming_estimator(path, cache, "fp32", in_process=True)


# --- chunk-causal flow: mel per chunk, caches ----------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_parity_chunkmask_mel_per_chunk(
    case: str, parity: Parity, flow_refs: Any, engine: CosyVoice3Engine, chunked: ChunkedFlow,
) -> None:
    """Variant (b): each streamed flow call's new mel frames match upstream's, with
    upstream's fixed noise for every frame (any request seed; the engine's own prompt noise
    is the subject of the seed tests below)."""
    steps, cfg = parity.euler_steps, parity.cfg_rate
    voice = flow_case_voice(flow_refs, case)
    gen = np.asarray(flow_refs[f"{case}_gen_tokens"], dtype=np.int64)
    noise = np.asarray(flow_refs["flow_noise"], dtype=np.float32)
    calls = parity.flow_case(case)["stream_chunkmask"]["flow_calls"]
    drop = parity.token_mel_ratio(case) * parity.lookahead_tokens(case)
    schedule = EulerSchedule(steps, cfg)
    history = chunked.new_history(schedule)
    ref = np.asarray(flow_refs[f"{case}_stream_chunkmask_mel"])
    done = 0
    for n_tokens, finalize, streaming, frames_after in calls:
        tokens = np.concatenate([voice.speech_tokens, gen[:n_tokens]])
        if finalize:
            assert not streaming  # upstream's last chunk: full attention
            mel = engine.flow.mel_for_tokens(tokens, voice, noise,
                                             FlowCall(schedule))[:, done:]
        else:
            assert streaming
            mel = chunked.chunk_mel(tokens, voice, noise, history, FlowCall(schedule), drop)
        assert done + mel.shape[1] == frames_after
        assert_close(mel, ref[:, done:frames_after], parity.tolerance("mel"),
                     f"{case} chunk-masked mel, chunk ending at frame {frames_after}")
        done = frames_after
    # the history cache holds every non-final chunk's frames for every Euler step
    streamed = sum(c[3] - (calls[i - 1][3] if i else 0) for i, c in enumerate(calls[:-1]))
    prompt_frames = voice.prompt_mel.shape[0]
    assert history.frames == streamed + prompt_frames - parity.cacheable_prompt_frames(case)
    assert len(history.steps) == steps


def test_parity_prompt_cache_on_disk_gives_the_same_chunk(
    tmp_path: Path, parity: Parity, flow_refs: Any, engine: CosyVoice3Engine,
    parity_streaming_files: tuple[Path, Path]
) -> None:
    """The prompt cache written next to the voice features is read back by a new instance
    (no recomputation) and gives the same first chunk; a damaged file is recomputed. The
    schedule guides only the first half of the Euler steps, so CFG and plain rows mix."""
    main, time_graph = parity_streaming_files
    case = _off_grid_case(parity)
    voice = flow_case_voice(flow_refs, case)
    gen = np.asarray(flow_refs[f"{case}_gen_tokens"], dtype=np.int64)
    first_call = parity.flow_case(case)["stream_chunkmask"]["flow_calls"][0][0]
    tokens = np.concatenate([voice.speech_tokens, gen[:first_call]])
    noise = np.asarray(flow_refs["flow_noise"], dtype=np.float32)
    drop = parity.token_mel_ratio(case) * parity.lookahead_tokens(case)
    steps, cfg = parity.euler_steps, parity.cfg_rate
    schedule = EulerSchedule(steps, cfg)

    def first_chunk(flow: ChunkedFlow) -> np.ndarray:
        history = flow.new_history(schedule)
        return flow.chunk_mel(tokens, voice, noise, history, FlowCall(schedule), drop)

    def make() -> ChunkedFlow:
        est = StreamingEstimator(_session(main), None, time_graph)
        return ChunkedFlow(engine.flow, est, prompt_noise, disk_dir=tmp_path, disk_tag="fp32")

    written = first_chunk(make())
    files = list(tmp_path.glob("flowkv2-*.npz"))
    assert len(files) == 1
    reader = make()
    solves = _count_solves(reader)
    reread = first_chunk(reader)
    assert [start for start, _ in solves] == [parity.cacheable_prompt_frames(case)]  # no prompt
    np.testing.assert_array_equal(reread, written)
    cache = reader.prompt_cache(voice, schedule)
    assert cache.frames == parity.cacheable_prompt_frames(case)
    rows = [_cfg_rows(parity)] * steps  # CFG rows per Euler step
    assert [s.kv[0][0].shape[0] for s in cache.steps if s.kv] == rows
    assert {s.kv[0][0].shape[2] for s in cache.steps if s.kv} == {cache.frames}
    files[0].write_bytes(b"not an npz")
    np.testing.assert_array_equal(first_chunk(make()), written)


def _cfg_rows(parity: Parity) -> int:
    """Rows of a guided Euler step: conditional and unconditional with the set's CFG rate,
    the conditional one only when the rate is 0 (solver.py runs no unconditional row then)."""
    return 2 if parity.cfg_rate else 1


def _count_solves(flow: ChunkedFlow,
                  monkeypatch: pytest.MonkeyPatch | None = None) -> list[tuple[int, np.ndarray]]:
    """Record ``(start frame, x0)`` of every Euler solve ``flow`` runs from now on (the prompt
    cache's solve starts at frame 0; a chunk's at the first frame after the caches); through
    ``monkeypatch`` when given (a shared engine's flow), else on the instance."""
    calls: list[tuple[int, np.ndarray]] = []
    solve = flow._solve

    def recording(x0: np.ndarray, given: Any, start: int, *args: Any,
                  **kwargs: Any) -> np.ndarray:
        calls.append((int(start), np.array(x0, copy=True)))
        return solve(x0, given, start, *args, **kwargs)

    if monkeypatch is None:
        flow._solve = recording  # type: ignore[method-assign]
    else:
        monkeypatch.setattr(flow, "_solve", recording)
    return calls


# --- the engine: quality preset, prompt-noise convention, warm-up ---------------------------


@pytest.mark.parametrize("case", CASES)
def test_parity_chunkmask_engine_audio_quality_preset(
    case: str, parity: Parity, flow_refs: Any, engine: CosyVoice3Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seed-0 request: ``synthesize`` with the ``quality`` preset (LLM replaced by the
    case's tokens) streams upstream's chunk-masked PyTorch streaming exactly: same sample
    bounds per chunk, same audio. Only for a set whose upstream noise is the seed-0 request's
    (the engine's fixed prompt noise, module docstring)."""
    if parity.request_seed != PROMPT_SEED:
        pytest.skip(
            f"the set's upstream noise is request seed {parity.request_seed}'s, the engine's "
            f"chunk-causal prompt noise is seed {PROMPT_SEED}'s: no reference for the "
            "engine's stream (the mechanics are compared in test_parity_chunkmask_mel_per_chunk)"
        )
    _with_tokens(engine, monkeypatch, flow_refs[f"{case}_gen_tokens"])
    voice = VoicePrompt(features=flow_case_voice(flow_refs, case), name=f"parity-{case}")
    chunks = [c.samples for c in engine.synthesize(TEXT, voice, quality_options(parity))]
    assert engine.chunked.loaded() == {"fp32": True}
    bounds = _bounds(chunks)
    assert_identical(bounds, flow_refs[f"{case}_stream_chunkmask_bounds"], f"{case} bounds")
    expected = faded(np.asarray(flow_refs[f"{case}_stream_chunkmask_audio"]))
    audio = np.concatenate(chunks)
    for i, (lo, hi) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)):
        assert_close(audio[lo:hi], expected[lo:hi], parity.tolerance("audio"),
                     f"{case} chunk-masked stream, chunk {i} ({lo}..{hi})")


def _seed_noise(seed: int, frames: int) -> np.ndarray:
    """float32 [80, frames]: the flow noise a request of ``seed`` draws (RequestState's
    stream; test_parity_flow.py checks it against the set's stored buffers)."""
    state = RequestState.create(SynthesisOptions(seed=seed), None, SynthesisResult())
    return np.ascontiguousarray(state.flow_noise.take(frames).T)


def test_parity_other_seed_draws_new_frames_over_the_seed0_prompt_noise(
    parity: Parity, flow_refs: Any, engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request of another seed: the prompt frames (prompt cache and the first chunk's
    uncached prompt frames) are solved from the seed-0 noise, the generated frames from the
    request's own noise, so the stream keeps upstream's chunk bounds but is another draw: its
    audio differs from upstream's reference beyond the audio tolerance in every chunk. (One
    case: the off-grid one, whose first chunk also solves uncached prompt frames.)"""
    case = _off_grid_case(parity)
    seed = max(PROMPT_SEED, parity.request_seed) + 1  # neither seed 0 nor upstream's
    _with_tokens(engine, monkeypatch, flow_refs[f"{case}_gen_tokens"])
    voice = VoicePrompt(features=flow_case_voice(flow_refs, case), name=f"seed-{case}")
    flow = engine.chunked.get("fp32")
    assert flow is not None
    monkeypatch.setattr(flow, "_prompts", OrderedDict())  # the prompt cache is solved here
    calls = _count_solves(flow, monkeypatch)
    options = quality_options(parity, seed=seed)
    chunks = [c.samples for c in engine.synthesize(TEXT, voice, options)]
    assert_identical(_bounds(chunks), flow_refs[f"{case}_stream_chunkmask_bounds"],
                     f"{case} bounds, seed {seed}")
    prompt_frames = voice.features.prompt_mel.shape[0]
    cached = parity.cacheable_prompt_frames(case)
    total = prompt_frames + parity.token_mel_ratio(case) * len(flow_refs[f"{case}_gen_tokens"])
    if parity.request_seed == PROMPT_SEED:  # upstream's noise is the seed-0 one
        seed0 = np.asarray(flow_refs["flow_noise"], dtype=np.float32)[:, :total]
    else:
        seed0 = _seed_noise(PROMPT_SEED, total)
    own = _seed_noise(seed, total)
    starts = [start for start, _ in calls]
    n_streamed = len(parity.flow_case(case)["stream_chunkmask"]["flow_calls"]) - 1
    assert starts[: 1 + bool(cached)] == ([0] if cached else []) + [cached], starts
    assert len(calls) == bool(cached) + n_streamed  # the final chunk: full attention
    if cached:
        np.testing.assert_array_equal(calls[0][1], seed0[:, :cached])
    first = calls[int(bool(cached))][1]
    np.testing.assert_array_equal(first[:, : prompt_frames - cached],
                                  seed0[:, cached:prompt_frames])
    for start, x0 in calls[int(bool(cached)):]:
        generated = x0[:, max(0, prompt_frames - start):]
        lo = max(start, prompt_frames)
        np.testing.assert_array_equal(generated, own[:, lo : lo + generated.shape[1]])
        assert not np.array_equal(generated, seed0[:, lo : lo + generated.shape[1]])
    expected = faded(np.asarray(flow_refs[f"{case}_stream_chunkmask_audio"]))
    audio, bounds = np.concatenate(chunks), _bounds(chunks)
    for i, (lo, hi) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)):
        err = float(np.abs(audio[lo:hi] - expected[lo:hi]).max())
        assert err > parity.tolerance("audio"), f"{case} chunk {i}: seed {seed} gave upstream's"


def test_parity_quality_preset_pads_the_first_hop_to_the_chunk_grid(parity: Parity) -> None:
    from wyoming_cosyvoice3.engine.flow.stream import first_hop_tokens
    from wyoming_cosyvoice3.engine.options import PRESETS

    quality = PRESETS["quality"]
    for case, info in parity.flow_cases.items():
        grid = int(parity.dit["static_chunk_size"]) // parity.token_mel_ratio(case)
        first_call_tokens = info["stream_chunkmask"]["flow_calls"][0][0]
        hop = first_hop_tokens(quality.flow, info["prompt_tokens"])
        assert hop == grid + info["prompt_token_pad"], case
        assert hop + parity.lookahead_tokens(case) == first_call_tokens, case
        unpadded = first_hop_tokens(
            quality.replace(flow={"first_hop_on_chunk_grid": False}).flow, info["prompt_tokens"])
        assert unpadded == quality.flow.first_hop_tokens == grid, case


def test_parity_warm_up_builds_the_voice_prompt_cache(
    parity: Parity, flow_refs: Any, engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``warm_up`` with a chunk-causal preset solves the voice's prompt cache (one Euler
    solve of the cacheable prompt frames), so the first request's chunk finds it in memory:
    asking for it afterwards runs the streaming estimator zero times. Cached frames and the
    cache's size follow the set's DiT geometry."""
    # the case with the most cacheable prompt frames; fewer tokens than its first streamed
    # call (hop + lookahead) make one final chunk, so nothing but the prompt is chunk-causal
    case = max(parity.flow_cases, key=parity.cacheable_prompt_frames)
    few = parity.lookahead_tokens(case)
    assert few < parity.flow_case(case)["stream_chunkmask"]["flow_calls"][0][0]
    _with_tokens(engine, monkeypatch, flow_refs[f"{case}_gen_tokens"][:few])
    voice = VoicePrompt(features=flow_case_voice(flow_refs, case), name="warm")
    quality = quality_options(parity)
    flow = engine.chunked.get("fp32")
    assert flow is not None
    monkeypatch.setattr(flow, "_prompts", OrderedDict())  # no cache from earlier tests
    runs: list[int] = []
    run = flow.estimator.run
    monkeypatch.setattr(flow.estimator, "run",
                        lambda *a, **k: runs.append(int(a[2])) or run(*a, **k))
    solves = _count_solves(flow, monkeypatch)
    cached = parity.cacheable_prompt_frames(case)
    assert cached > 0, "no flow case has a prompt of one cacheable chunk or more"
    engine.warm_up(voice, quality)
    assert [start for start, _ in solves] == [0]  # the prompt cache, nothing else chunked
    assert solves[0][1].shape[1] == cached
    assert runs == [0] * parity.euler_steps  # one estimator run per Euler step
    runs.clear()
    cache = flow.prompt_cache(voice.features, quality.flow.schedule)
    assert runs == [] and len(solves) == 1  # from memory, not recomputed
    assert cache.frames == cached and len(cache.steps) == parity.euler_steps
    dit = parity.dit
    rows = _cfg_rows(parity)
    # frames x steps x CFG rows x (key, value) x blocks x inner width x 4 bytes
    assert cache.nbytes == (cached * parity.euler_steps * rows * 2 * dit["depth"]
                            * dit["heads"] * dit["dim_head"] * 4)
