"""Parity of the chunk-causal streaming flow with upstream's PyTorch streaming (variant b).

Fixtures: ``../shared/parity`` next to the repository (README there): a model directory
exported from upstream's classes (random weights) and upstream's outputs. ``flow.npz``
variant (b) is upstream's streaming loop as it runs in PyTorch: non-final chunks with the
DiT's static 50-frame chunk mask, the final chunk with full attention. Tolerances and chunk
calls are read from ``refs/manifest.json``. Skipped with the reason when the fixtures are
absent (a clone without ../shared).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parity_support import PARITY_DIR, flow_case_voice

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.chunkmask import CHUNK_FRAMES
from wyoming_cosyvoice3.engine.chunkmask import chunk_attention_bias as chunk_bias
from wyoming_cosyvoice3.engine.derive.dit_structure import StructureError, read_dit
from wyoming_cosyvoice3.engine.derive.streaming_estimator import (
    StreamingEstimator,
    _session,
    ensure_streaming_estimator,
)
from wyoming_cosyvoice3.engine.errors import ModelLoadError
from wyoming_cosyvoice3.engine.flow.chunked import ChunkedFlow, cacheable_prompt_frames
from wyoming_cosyvoice3.engine.flow_streaming import prompt_noise
from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine

PARITY = PARITY_DIR
ESTIMATOR = "flow.decoder.estimator.fp32.onnx"

pytestmark = pytest.mark.skipif(
    not (PARITY / "refs" / "manifest.json").is_file(),
    reason=f"parity fixtures not found at {PARITY} (../shared/parity next to the repository)",
)


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return dict(json.loads((PARITY / "refs" / "manifest.json").read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def flow_refs() -> Any:
    return np.load(PARITY / "refs" / "flow.npz")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("derived")


@pytest.fixture(scope="module")
def streaming_files(cache_dir: Path) -> tuple[Path, Path]:
    return ensure_streaming_estimator(PARITY / "model" / ESTIMATOR, cache_dir, "fp32",
                                      in_process=True)


@pytest.fixture(scope="module")
def engine(cache_dir: Path) -> CosyVoice3Engine:
    return CosyVoice3Engine.load(PARITY / "model", EngineOptions(cache_dir=cache_dir))


@pytest.fixture(scope="module")
def chunked(engine: CosyVoice3Engine, streaming_files: tuple[Path, Path]) -> ChunkedFlow:
    main, time_graph = streaming_files
    return ChunkedFlow(engine.flow, StreamingEstimator(_session(main), None, time_graph),
                       prompt_noise)


_voice = flow_case_voice


def test_parity_structure_read_from_the_upstream_export(manifest: dict[str, Any]) -> None:
    import onnx

    dims = read_dit(onnx.load(str(PARITY / "model" / ESTIMATOR)))
    dit = manifest["dims"]["flow"]["dit"] if "flow" in manifest["dims"] else None
    assert dims.depth == 2 and dims.dim == 256 and dims.heads == 4 and dims.head_dim == 64
    assert dims.input_order == ["x", "cond", "mu", "spks"]  # modules.py InputEmbedding order
    assert dims.kernel == 31 and dims.conv_groups == 16
    assert dims.layout_hint == "interleaved"  # x-transformers pairs
    if dit is not None and "depth" in dit:
        assert dims.depth == dit["depth"]


def test_parity_derived_graph_equals_source_and_cache_is_exact(
    streaming_files: tuple[Path, Path],
) -> None:
    """Full attention without cache equals the published graph; a cached second chunk equals
    the uncached chunk-masked run (both also checked when the file is derived)."""
    main, time_graph = streaming_files
    est = StreamingEstimator(_session(main), _session(time_graph))
    source = _session(PARITY / "model" / ESTIMATOR)
    rng = np.random.default_rng(3)
    frames = 120
    probe = {n: rng.standard_normal((2, 80, frames)).astype(np.float32)
             for n in ("x", "mu", "cond")}
    probe["spks"] = rng.standard_normal((2, 80)).astype(np.float32)
    t = 0.61
    ref = source.run(None, {**probe, "t": np.full(2, t, np.float32),
                            "mask": np.ones((2, 1, frames), np.float32)})[0]
    full = est.run(probe, t, 0, chunk_bias(0, frames, 0, 0)).velocity
    assert np.abs(full - ref).max() < 1e-4
    masked = est.run(probe, t, 0, chunk_bias(0, frames, 0, CHUNK_FRAMES)).velocity
    assert np.abs(masked - ref).max() > 1e-2  # the mask changes the result
    split = 2 * CHUNK_FRAMES
    head = est.run({k: v[..., :split] if v.ndim == 3 else v for k, v in probe.items()}, t, 0,
                   chunk_bias(0, split, 0, CHUNK_FRAMES))
    tail = est.run({k: v[..., split:] if v.ndim == 3 else v for k, v in probe.items()}, t,
                   split, chunk_bias(split, frames - split, split, CHUNK_FRAMES),
                   (head.conv1_next, head.conv2_next), None, head.new)
    assert np.abs(tail.velocity - masked[..., split:]).max() < 1e-4
    # batch 1 (steps without CFG) gives row 0 of batch 2
    one = est.run({k: v[:1] for k, v in probe.items()}, t, 0, chunk_bias(0, frames, 0, 0))
    assert np.abs(one.velocity[0] - full[0]).max() < 1e-4


def test_parity_prompt_cache_covers_whole_chunks_before_the_lookahead() -> None:
    assert cacheable_prompt_frames(50) == 50  # 100 frames, the last 6 depend on new tokens
    assert cacheable_prompt_frames(37) == 50
    assert cacheable_prompt_frames(28) == 50
    assert cacheable_prompt_frames(27) == 0
    assert cacheable_prompt_frames(0) == 0


@pytest.mark.parametrize("case", ["A", "B"])
def test_parity_chunkmask_mel_per_chunk(
    case: str,
    manifest: dict[str, Any],
    flow_refs: Any,
    engine: CosyVoice3Engine,
    chunked: ChunkedFlow,
) -> None:
    """Variant (b): each streamed flow call's new mel frames match upstream's."""
    tol = float(manifest["tolerances"]["mel"])
    voice = _voice(flow_refs, case)
    gen = np.asarray(flow_refs[f"{case}_gen_tokens"], dtype=np.int64)
    ref_noise = np.asarray(flow_refs["flow_noise"])
    noise = prompt_noise(ref_noise.shape[1])  # the fixed prompt noise == seed-0 request noise
    np.testing.assert_array_equal(noise, ref_noise)
    calls = manifest["flow_cases"][case]["stream_chunkmask"]["flow_calls"]
    history = chunked.new_history(C.DEFAULT_EULER_STEPS, C.DEFAULT_CFG_RATE, None)
    ref = np.asarray(flow_refs[f"{case}_stream_chunkmask_mel"])
    done = 0
    for n_tokens, finalize, streaming, frames_after in calls:
        tokens = np.concatenate([voice.speech_tokens, gen[:n_tokens]])
        if finalize:
            assert not streaming  # upstream's last chunk: full attention
            mel = engine.flow.mel_for_tokens(tokens, voice, noise)[:, done:]
        else:
            assert streaming
            mel = chunked.chunk_mel(tokens, voice, noise, history, C.DEFAULT_EULER_STEPS,
                                    C.DEFAULT_CFG_RATE, None,
                                    C.TOKEN_MEL_RATIO * C.PRE_LOOKAHEAD_TOKENS)
        assert done + mel.shape[1] == frames_after
        err = float(np.abs(mel - ref[:, done:frames_after]).max())
        assert err < tol, f"case {case} chunk ending at frame {frames_after}: {err:.3g}"
        done = frames_after
    # the history cache holds every non-final chunk's frames for every Euler step
    streamed = sum(c[3] - (calls[i - 1][3] if i else 0) for i, c in enumerate(calls[:-1]))
    prompt_frames = C.TOKEN_MEL_RATIO * len(voice.speech_tokens)
    cached_prompt = cacheable_prompt_frames(len(voice.speech_tokens))
    assert history.frames == streamed + prompt_frames - cached_prompt
    assert len(history.steps) == C.DEFAULT_EULER_STEPS


def test_parity_tiny_synthetic_dit_is_refused_cleanly(tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    """A graph without upstream's DiT structure raises StructureError, and the cached
    derivation reports ModelLoadError (the caller's fallback signal) and a failure marker."""
    import onnx

    with pytest.raises(StructureError):
        read_dit(onnx.load(str(tiny_model_dir / ESTIMATOR)))
    with pytest.raises(ModelLoadError):
        ensure_streaming_estimator(tiny_model_dir / ESTIMATOR, tmp_path, "fp32", in_process=True)
    assert list(tmp_path.glob("*.failed"))
    with pytest.raises(ModelLoadError, match="earlier attempt"):
        ensure_streaming_estimator(tiny_model_dir / ESTIMATOR, tmp_path, "fp32", in_process=True)


def test_parity_prompt_cache_on_disk_gives_the_same_chunk(
    tmp_path: Path, flow_refs: Any, engine: CosyVoice3Engine, streaming_files: tuple[Path, Path]
) -> None:
    """The prompt cache written next to the voice features is read back by a new instance
    (no recomputation) and gives the same first chunk; a damaged file is recomputed."""
    main, time_graph = streaming_files
    voice = _voice(flow_refs, "B")
    gen = np.asarray(flow_refs["B_gen_tokens"], dtype=np.int64)
    tokens = np.concatenate([voice.speech_tokens, gen[:41]])
    noise = prompt_noise(400)
    drop = C.TOKEN_MEL_RATIO * C.PRE_LOOKAHEAD_TOKENS

    def first_chunk(flow: ChunkedFlow) -> np.ndarray:
        history = flow.new_history(4, 0.7, 2)  # CFG in the first 2 of 4 steps: batch 2, 1
        return flow.chunk_mel(tokens, voice, noise, history, 4, 0.7, 2, drop)

    def make() -> ChunkedFlow:
        est = StreamingEstimator(_session(main), None, time_graph)
        return ChunkedFlow(engine.flow, est, prompt_noise, disk_dir=tmp_path, disk_tag="fp32")

    written = first_chunk(make())
    files = list(tmp_path.glob("flowkv2-*.npz"))
    assert len(files) == 1
    reader = make()
    reread = first_chunk(reader)
    np.testing.assert_array_equal(reread, written)
    cache = reader.prompt_cache(voice, 4, 0.7, 2)
    assert cache.frames == cacheable_prompt_frames(len(voice.speech_tokens))
    assert [s.kv[0][0].shape[0] for s in cache.steps if s.kv] == [2, 2, 1, 1]  # CFG rows
    assert {s.kv[0][0].shape[2] for s in cache.steps if s.kv} == {cache.frames}
    files[0].write_bytes(b"not an npz")
    np.testing.assert_array_equal(first_chunk(make()), written)


AUDIO_TOL = 2e-3
"""Issue 11's bound for variant (b) audio (the manifest's generic audio tolerance is 3e-3)."""


@pytest.mark.parametrize("case", ["A", "B"])
def test_parity_chunkmask_engine_audio_quality_preset(
    case: str,
    manifest: dict[str, Any],
    flow_refs: Any,
    engine: CosyVoice3Engine,
    streaming_files: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``synthesize`` with the ``quality`` preset (LLM replaced by the case's tokens) streams
    upstream's chunk-masked PyTorch streaming: same sample bounds per chunk, same audio."""
    from wyoming_cosyvoice3.engine.options import PRESETS
    from wyoming_cosyvoice3.engine.types import VoicePrompt
    from wyoming_cosyvoice3.engine.vocoder.hift import fade_in_gain

    del streaming_files  # derived into the engine's cache dir before the engine needs it
    gen = [int(t) for t in flow_refs[f"{case}_gen_tokens"]]
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter(gen))
    seed = int(manifest["seeds"]["request_seed_of_noise_buffers"])
    # no vocoder deferral: it follows the wall clock, and these bounds are upstream's
    options = PRESETS["quality"].replace(seed=seed, vocoder_defer=False)
    voice = VoicePrompt(features=_voice(flow_refs, case), name=f"parity-{case}")
    chunks = [c.samples for c in engine.synthesize("Hello.", voice, options)]
    assert engine.chunked.loaded() == {"fp32": True}
    bounds = np.cumsum([len(c) for c in chunks])
    np.testing.assert_array_equal(bounds, flow_refs[f"{case}_stream_chunkmask_bounds"])
    ref = np.asarray(flow_refs[f"{case}_stream_chunkmask_audio"])
    fade = round(C.FADE_IN_MS * C.OUTPUT_SAMPLE_RATE_HZ / 1000.0)
    expected = ref * fade_in_gain(0, ref.shape[0], fade)
    tol = min(AUDIO_TOL, float(manifest["tolerances"]["audio"]))
    for i, (lo, hi) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)):
        err = float(np.abs(np.concatenate(chunks)[lo:hi] - expected[lo:hi]).max())
        assert err < tol, f"case {case} chunk {i} ({lo}..{hi}): {err:.3g}"


def test_parity_quality_preset_pads_the_first_hop_to_the_chunk_grid(
    manifest: dict[str, Any],
) -> None:
    from wyoming_cosyvoice3.engine.flow_streaming import first_hop_tokens
    from wyoming_cosyvoice3.engine.options import PRESETS

    quality = PRESETS["quality"]
    for case in ("A", "B"):
        info = manifest["flow_cases"][case]
        first_call_tokens = info["stream_chunkmask"]["flow_calls"][0][0]
        hop = first_hop_tokens(quality, info["prompt_tokens"])
        assert hop == 25 + info["prompt_token_pad"]
        assert hop + C.PRE_LOOKAHEAD_TOKENS == first_call_tokens
    assert first_hop_tokens(quality.replace(first_hop_on_chunk_grid=False), 37) == 25


def test_parity_warm_up_builds_the_voice_prompt_cache(
    flow_refs: Any, engine: CosyVoice3Engine, streaming_files: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wyoming_cosyvoice3.engine.options import PRESETS
    from wyoming_cosyvoice3.engine.types import VoicePrompt

    del streaming_files
    monkeypatch.setattr(engine.llm, "decode", lambda *_a, **_k: iter([1, 2, 3]))
    voice = VoicePrompt(features=_voice(flow_refs, "A"), name="warm")
    quality = PRESETS["quality"]
    engine.warm_up(voice, quality)
    flow = engine.chunked.get("fp32")
    assert flow is not None
    started = time.perf_counter()
    cache = flow.prompt_cache(voice.features, quality.euler_steps, quality.cfg_rate, None)
    assert time.perf_counter() - started < 0.5  # from memory, not recomputed
    assert cache.frames == 50 and len(cache.steps) == quality.euler_steps
    # frames x steps x CFG rows x (key, value) x blocks x inner width x 4 bytes
    assert cache.nbytes == 50 * quality.euler_steps * 2 * 2 * 2 * 256 * 4
