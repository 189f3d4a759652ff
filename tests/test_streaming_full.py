"""One DiT graph for chunk-causal streaming and full attention (issue 11, memory).

With a ``flow_chunk_causal`` ``EngineOptions.preset`` the engine opens the derived streaming
DiT at start and runs the full-attention passes (final chunks, one-shot requests) through it, so the
published estimator of that precision is never loaded. The tiny model's DiT is upstream's
architecture, so the streaming derivation works on it; a convolutional estimator
(broken_graphs.py) does not have that structure, so the engine falls back with one warning.
The parity tests (test_parity_flow_chunked.py) check the same path against upstream's
outputs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from broken_graphs import convolutional_estimator
from decoding_support import FixedDecoding, fixed_decoding

from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions, SynthesisOptions
from wyoming_cosyvoice3.engine.derive.flow.estimator_split import SplitEstimator
from wyoming_cosyvoice3.engine.derive.flow.full_attention import FullAttentionDiT
from wyoming_cosyvoice3.engine.errors import SynthesisFailed
from wyoming_cosyvoice3.engine.graphs import ESTIMATOR
from wyoming_cosyvoice3.engine.options import PRESETS

TEXT = "The kitchen lights are on and the front door is locked."


def _engine(model_dir: Path, cache: Path, one_graph: bool,
            split_estimator: bool = True) -> CosyVoice3Engine:
    return CosyVoice3Engine.load(model_dir, EngineOptions(
        threads=1, llm_precision="fp32", cache_dir=cache, split_estimator=split_estimator,
        preset=SynthesisOptions(flow_chunk_causal=one_graph)))


@pytest.fixture
def conv_dit_copy(tiny_model_copy: Path) -> Path:
    """The tiny model with a convolutional estimator: no DiT blocks to stream."""
    onnx.save(convolutional_estimator(), str(tiny_model_copy / ESTIMATOR.file))
    return tiny_model_copy


@pytest.fixture(scope="module")
def engines(tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path
            ) -> tuple[CosyVoice3Engine, CosyVoice3Engine]:
    """(one DiT graph, published split estimator + streaming graph); the session's derived
    files."""
    cache = tiny_dit_cache_dir
    return _engine(tiny_dit_model_dir, cache, True), _engine(tiny_dit_model_dir, cache, False)


def _audio(engine: CosyVoice3Engine, model_dir: Path, streaming: bool) -> list[np.ndarray]:
    voice = engine.prepare_voice(model_dir / "voices" / "en-male.wav", "A test voice.")
    options = PRESETS["quality"].replace(euler_steps=3, streaming=streaming, vocoder_defer=False,
                                         seed=3)
    with fixed_decoding(engine, 2.0):
        return [c.samples for c in engine.synthesize(TEXT, voice, options)]


def test_one_graph_is_loaded_instead_of_the_published_estimator(
    engines: tuple[CosyVoice3Engine, CosyVoice3Engine]
) -> None:
    one, two = engines
    assert isinstance(one.model.estimator, FullAttentionDiT)
    assert one.model.estimator.streaming is one.model.streaming_estimator("fp32")
    assert list(one.model._estimators) == ["fp32"]  # no split estimator was opened
    assert isinstance(two.model.estimator, SplitEstimator)


@pytest.mark.parametrize("streaming", [False, True])
def test_one_graph_gives_the_two_graph_audio(
    engines: tuple[CosyVoice3Engine, CosyVoice3Engine], tiny_dit_model_dir: Path,
    streaming: bool
) -> None:
    """One-shot (one full-attention pass) and streamed (chunk-causal chunks, then the final
    full-attention chunk): same chunk bounds, audio equal up to float rounding."""
    one, two = engines
    got = _audio(one, tiny_dit_model_dir, streaming)
    ref = _audio(two, tiny_dit_model_dir, streaming)
    assert len(got) == len(ref) >= (3 if streaming else 1)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        assert np.abs(b).max() > 1e-3
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)


def test_full_attention_view_rejects_what_it_cannot_compute(
    engines: tuple[CosyVoice3Engine, CosyVoice3Engine]
) -> None:
    view = engines[0].model.estimator
    assert isinstance(view, FullAttentionDiT)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((2, 80, 20)).astype(np.float32) for k in ("x", "mu", "cond")}
    feeds["spks"] = rng.standard_normal((2, 80)).astype(np.float32)
    feeds["t"] = np.full(2, 0.5, np.float32)
    feeds["mask"] = np.ones((2, 1, 20), np.float32)
    out = view.run(feeds, ["estimator_out"])["estimator_out"]
    assert out.shape == (2, 80, 20) and np.isfinite(out).all()
    padded = dict(feeds, mask=np.concatenate([np.ones((2, 1, 15)), np.zeros((2, 1, 5))], 2))
    with pytest.raises(SynthesisFailed, match="padding"):
        view.run(padded, ["estimator_out"])
    with pytest.raises(SynthesisFailed, match="one flow time"):
        view.run(dict(feeds, t=np.array([0.5, 0.6], np.float32)), ["estimator_out"])


def test_without_the_streaming_structure_the_published_estimator_is_used(
    conv_dit_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A convolutional estimator: one warning, the published estimator (the split form,
    which fails on it too, is switched off to keep this test to one derivation)."""
    with caplog.at_level(logging.WARNING):
        engine = _engine(conv_dit_copy, tmp_path / "cache", True, split_estimator=False)
        assert engine.chunked.get("fp32") is None
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "DiT" in r.getMessage()]
    assert len(warnings) == 1 and "chunk-causal streaming flow (fp32)" in warnings[0]
    assert not isinstance(engine.model.estimator, FullAttentionDiT)


def test_balanced_without_the_streaming_dit_falls_back_to_smaller_bounds(
    conv_dit_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the streaming DiT, ``balanced`` runs full attention with its fallback bounds
    (25 prompt tokens, 10 of history) instead of the 100 / 50 it caches when chunk-causal."""
    from wyoming_cosyvoice3.engine import pipeline
    from wyoming_cosyvoice3.engine.flow.stream import MelStream

    engine = _engine(conv_dit_copy, tmp_path / "cache", True, split_estimator=False)
    assert engine.chunked.get("int8") is None
    prompts: list[int] = []
    starts: list[int] = []
    offsets: list[int] = []
    real_features, real_mel = pipeline.flow_prompt_features, engine.flow.mel_for_tokens
    real_next_mel = MelStream.next_mel

    def features(voice: object, tokens: int) -> object:
        prompts.append(tokens)
        return real_features(voice, tokens)  # type: ignore[arg-type]

    def mel(*args: Any, **kwargs: Any) -> np.ndarray:
        starts.append(int(kwargs["generated_offset_tokens"]))
        return real_mel(*args, **kwargs)

    def next_mel(self: MelStream, *args: Any, **kwargs: Any) -> np.ndarray:
        offsets.append(self.offset_tokens)
        return real_next_mel(self, *args, **kwargs)

    monkeypatch.setattr(pipeline, "flow_prompt_features", features)
    monkeypatch.setattr(engine.flow, "mel_for_tokens", mel)
    monkeypatch.setattr(MelStream, "next_mel", next_mel)
    voice = engine.prepare_voice(conv_dit_copy / "voices" / "en-male.wav", "A test voice.")
    options = PRESETS["balanced"].replace(vocoder_defer=False)
    with fixed_decoding(engine, 4.0):
        chunks = list(engine.synthesize(TEXT, voice, options))
    assert chunks and chunks[-1].is_last
    assert prompts == [25]
    pairs = list(zip(starts, offsets, strict=True))  # one full-attention pass per chunk
    assert len(pairs) >= 3 and pairs[0] == (0, 0)
    assert all(start == max(0, offset - 10) for start, offset in pairs)
    assert any(start > 0 for start, _ in pairs)  # history really was cut
    assert PRESETS["balanced"].fallback().flow_chunk_causal is False
    assert PRESETS["quality"].fallback() == PRESETS["quality"].replace(flow_chunk_causal=False)


def test_bench_dit_forms_compares_the_two_forms(tiny_dit_model_dir: Path,
                                                tiny_dit_cache_dir: Path, tmp_path: Path
                                                ) -> None:
    """``python -m bench.dit_forms`` (BENCHMARKS.md) on tiny-dit."""
    import json

    from bench.dit_forms import main

    out = tmp_path / "forms.json"
    assert main(["--model-dir", str(tiny_dit_model_dir), "--cache-dir", str(tiny_dit_cache_dir),
                 "--frames", "30", "--repeats", "2", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["median_s"]) == {"split", "streaming"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["seconds"].values())
    assert result["max_abs_velocity"] > 0.1
    assert result["max_abs_diff"] <= 1e-4 * max(1.0, result["max_abs_velocity"])


@pytest.fixture(scope="module")
def int8_engine(tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path) -> CosyVoice3Engine:
    """The engine of today's ``balanced`` and ``fast`` (int8 streaming DiT, chunk-causal)."""
    return CosyVoice3Engine.load(tiny_dit_model_dir, EngineOptions(
        threads=1, cache_dir=tiny_dit_cache_dir, observer=FixedDecoding(2.0),
        preset=SynthesisOptions(flow_precision="int8", flow_chunk_causal=True)))


@pytest.mark.parametrize("preset", ["balanced", "fast"])
def test_case_c5_chunk_causal_presets_keep_their_caches_bounded(
        int8_engine: CosyVoice3Engine, tiny_dit_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """Case C5 on today's `balanced` and `fast` (chunk-causal, int8): a long one-shot text
    streams in chunks through the streaming DiT while every chunk's stored history stays
    within the preset's bound (50 / 5 tokens: 100 / 10 mel frames) and the prompt cache
    within its last 100 / 15 prompt tokens."""
    from wyoming_cosyvoice3.engine import constants as C
    from wyoming_cosyvoice3.engine.flow.solver import cacheable_prompt_frames

    opts = PRESETS[preset]
    assert opts.flow_chunk_causal and opts.flow_final_chunk_causal
    engine = int8_engine
    voice = engine.prepare_voice(tiny_dit_model_dir / "voices" / "en-male.wav", "A test voice.")
    flow = engine.chunked.get("int8")
    assert flow is not None
    monkeypatch.setattr(flow, "_prompts", OrderedDict())  # no prompt cache of the other preset
    stored: list[int] = []
    seen: list[int] = []
    chunk_mel = flow.chunk_mel

    def recording(*args: object, **kwargs: object) -> np.ndarray:
        mel = chunk_mel(*args, **kwargs)  # type: ignore[arg-type]
        history = args[3]
        stored.append(max(s.frames for s in history.steps))  # type: ignore[attr-defined]
        seen.append(history.frames)  # type: ignore[attr-defined]
        return mel

    monkeypatch.setattr(flow, "chunk_mel", recording)
    text = ("The kitchen lights are on and the front door is locked and the heating is set "
            "to twenty one degrees for the rest of the evening in every room of the house")
    options = opts.replace(vocoder_defer=False)
    chunks = list(engine.synthesize(text, voice, options))
    bound = C.TOKEN_MEL_RATIO * opts.flow_left_context_tokens
    assert len(chunks) >= 5 and chunks[-1].is_last
    assert max(seen) > 2 * bound  # the piece is long enough for the bound to act
    assert 0 < max(stored) <= bound
    prompt = next(iter(flow._prompts.values()))
    assert prompt.frames == cacheable_prompt_frames(
        min(len(voice.features.speech_tokens), opts.flow_prompt_tokens))


def test_int8_streaming_graph_uses_fused_kernels_and_quantises_every_block_layer(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path
) -> None:
    """The derived graph attends with the contrib ``MultiHeadAttention`` and ``FastGelu``
    (one each per block) and its int8 variant still quantises all six linear layers of every
    block: onnx's shape inference gives contrib outputs no shape, so the graph declares them
    (without that the output projection and the second feed-forward layer stay fp32)."""
    import onnx

    from wyoming_cosyvoice3.engine.derive.flow.dit_structure import read_dit
    from wyoming_cosyvoice3.engine.derive.flow.quantize import per_frame_matmuls
    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import ensure_streaming_estimator

    source = tiny_dit_model_dir / "flow.decoder.estimator.fp32.onnx"
    depth = read_dit(onnx.load(str(source))).depth
    main, _time = ensure_streaming_estimator(source, tiny_dit_cache_dir, "int8", in_process=True)
    ops = [n.op_type for n in onnx.load(str(main)).graph.node]
    assert ops.count("MultiHeadAttention") == depth and ops.count("FastGelu") == depth
    assert "Softmax" not in ops and "Tanh" not in ops
    fp32, _ = ensure_streaming_estimator(source, tiny_dit_cache_dir, "fp32", in_process=True)
    selected = per_frame_matmuls(onnx.load(str(fp32)))
    assert len(selected) >= 6 * depth
    assert ops.count("MatMulInteger") == len(selected)


def test_quality_frees_the_history_before_its_full_attention_final_chunk(
    engines: tuple[CosyVoice3Engine, CosyVoice3Engine], tiny_dit_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``quality``'s final chunk runs full attention, which never reads the chunk-causal
    history: the piece's history cache is released before that pass (its largest), not
    after it, so the two are never resident together."""
    import gc
    import weakref

    engine = engines[0]
    flow = engine.chunked.get("fp32")
    assert flow is not None
    histories: list[weakref.ref[object]] = []
    alive_at_final: list[bool] = []
    chunk_mel, full_mel = flow.chunk_mel, engine.flow.mel_for_tokens

    def recording(*args: object, **kwargs: object) -> np.ndarray:
        histories.append(weakref.ref(args[3]))
        return chunk_mel(*args, **kwargs)  # type: ignore[arg-type]

    def final(*args: Any, **kwargs: Any) -> np.ndarray:
        gc.collect()
        alive_at_final.append(any(ref() is not None for ref in histories))
        return full_mel(*args, **kwargs)

    monkeypatch.setattr(flow, "chunk_mel", recording)
    monkeypatch.setattr(engine.flow, "mel_for_tokens", final)
    voice = engine.prepare_voice(tiny_dit_model_dir / "voices" / "en-male.wav", "A test voice.")
    options = PRESETS["quality"].replace(euler_steps=2, vocoder_defer=False)
    with fixed_decoding(engine, 3.0):
        assert list(engine.synthesize(TEXT, voice, options))[-1].is_last
    assert histories and alive_at_final == [False]
