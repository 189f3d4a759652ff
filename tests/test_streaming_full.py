"""One DiT graph for chunk-causal streaming and full attention (one graph's memory, not two).

With a ``chunk_causal`` ``EngineOptions.flow`` the engine opens the derived streaming
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from broken_graphs import convolutional_estimator
from decoding_support import fixed_decoding

from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions, SynthesisOptions
from wyoming_cosyvoice3.engine.derive.flow.full_attention import FullAttentionDiT
from wyoming_cosyvoice3.engine.errors import SynthesisFailed
from wyoming_cosyvoice3.engine.options import PRESETS, FlowPreset
from wyoming_cosyvoice3.engine.sessions import ESTIMATOR, Graph

TEXT = "The kitchen lights are on and the front door is locked."


def _engine(model_dir: Path, cache: Path, one_graph: bool) -> CosyVoice3Engine:
    return CosyVoice3Engine.load(model_dir, EngineOptions(
        threads=1, llm_precision="fp32", cache_dir=cache,
        flow=FlowPreset(chunk_causal=one_graph)))


@pytest.fixture
def conv_dit_copy(tiny_model_copy: Path) -> Path:
    """The tiny model with a convolutional estimator: no DiT blocks to stream."""
    onnx.save(convolutional_estimator(), str(tiny_model_copy / ESTIMATOR.file))
    return tiny_model_copy


@pytest.fixture(scope="module")
def engines(tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path
            ) -> tuple[CosyVoice3Engine, CosyVoice3Engine]:
    """(one DiT graph, the published estimator + the streaming graph for chunks only); the
    session's derived files. The second engine is loaded as if the streaming DiT were not
    wanted at start, so its full-attention passes run the published graph; its chunk-causal
    chunks load the streaming DiT on first use."""
    from wyoming_cosyvoice3.engine import model

    cache = tiny_dit_cache_dir
    one = _engine(tiny_dit_model_dir, cache, True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "wants_streaming", lambda _options, _precision: False)
        two = _engine(tiny_dit_model_dir, cache, False)
        two.model.estimator_for("fp32")
    return one, two


def _audio(engine: CosyVoice3Engine, model_dir: Path, streaming: bool) -> list[np.ndarray]:
    voice = engine.prepare_voice(model_dir / "voices" / "en-male.wav", "A test voice.")
    options = PRESETS["quality"].replace(
        streaming=streaming, seed=3, flow={"schedule": {"steps": 3}}, vocoder={"defer": False})
    with fixed_decoding(engine, 2.0):
        return [c.samples for c in engine.synthesize(TEXT, voice, options)]


def test_one_graph_is_loaded_instead_of_the_published_estimator(
    engines: tuple[CosyVoice3Engine, CosyVoice3Engine]
) -> None:
    one, two = engines
    assert isinstance(one.model.estimator, FullAttentionDiT)
    assert one.model.estimator.streaming is one.model.streaming_estimator("fp32")
    assert list(one.model._estimators) == ["fp32"]  # the published graph was not opened
    assert type(two.model.estimator) is Graph and two.model.estimator.path.name == ESTIMATOR.file


def _run(engine: CosyVoice3Engine, model_dir: Path, streaming: bool,
         monkeypatch: pytest.MonkeyPatch, mels: list[np.ndarray] | None = None,
         ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the new mel frames of every flow pass, the audio chunks) of :func:`_audio`; with
    ``mels``, the flow passes hand on those instead of their own (in order)."""
    from wyoming_cosyvoice3.engine.flow.stream import MelStream

    seen: list[np.ndarray] = []
    real = MelStream.next_mel

    def recording(self: MelStream, *args: Any, **kwargs: Any) -> np.ndarray:
        mel = real(self, *args, **kwargs)
        if mels is not None:
            mel = mels[len(seen)]
        seen.append(mel)
        return mel

    with monkeypatch.context() as patch:
        patch.setattr(MelStream, "next_mel", recording)
        audio = _audio(engine, model_dir, streaming)
    return seen, audio


@pytest.mark.parametrize("streaming", [False, True])
def test_one_graph_gives_the_two_graph_mel_and_the_same_mel_the_same_audio(
    engines: tuple[CosyVoice3Engine, CosyVoice3Engine], tiny_dit_model_dir: Path,
    streaming: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One-shot (one full-attention pass) and streamed (chunk-causal chunks, then the final
    full-attention chunk): the same chunks; the mel equal within the rounding the derivation
    accepts for the one graph; and everything after the flow the same, so the two-graph mel
    gives the two-graph audio bit for bit through the one-graph engine.

    The audio of the two is not compared: the vocoder's harmonic source sums f0 over every
    sample (480 per frame), so a last-bit difference in the mel moves the phase by an amount
    that grows with time. On AVX-512 CPUs (Zen 4, Xeon with AMX) the one-shot audio differs by
    up to 1.1e-3 from 1.5 s on: rounding, not a property of the graphs.
    The mel bound: the derivation accepts the one graph when its velocity is within
    FP32_TOL (1e-4) of the published graph's, relative to the velocity's scale; the Euler
    steps add dt x velocity (the dt sum to 1) after the CFG mix (1 + r) v - r v_uncond
    (r = 0.7), so at first order the mel moves by at most (1 + 2 r) FP32_TOL x that scale,
    taken here as max(1, |mel|) (the mel and the velocity, target minus noise, are of one
    size): 1.7e-3 here, where the two mels differ by 2.7e-6 (one-shot, 220 frames) and 1.9e-6
    (the streamed final chunk) on an AVX-512 Xeon; a misread graph moves them by O(1)."""
    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import FP32_TOL

    one, two = engines
    mel_one, got = _run(one, tiny_dit_model_dir, streaming, monkeypatch)
    mel_two, ref = _run(two, tiny_dit_model_dir, streaming, monkeypatch)
    assert len(got) == len(ref) >= (3 if streaming else 1)
    assert len(mel_one) == len(mel_two) == (len(ref) if streaming else 1)
    cfg = PRESETS["quality"].flow.schedule.cfg_rate
    for a, b in zip(mel_one, mel_two, strict=True):
        assert a.shape == b.shape and a.shape[1] > 0
        bound = (1 + 2 * cfg) * FP32_TOL * max(1.0, float(np.abs(b).max()))
        error = float(np.abs(a - b).max())
        print(f"mel of {a.shape[1]} frames: one graph off the two by {error:.3g} "
              f"(bound {bound:.3g})")
        assert error <= bound
    if streaming:  # the chunk-causal chunks run the same streaming graph in both engines
        for a, b in zip(mel_one[:-1], mel_two[:-1], strict=True):
            assert np.array_equal(a, b)
    _, same = _run(one, tiny_dit_model_dir, streaming, monkeypatch, mels=mel_two)
    for a, b in zip(same, ref, strict=True):
        assert a.shape == b.shape and np.abs(b).max() > 1e-3
        assert np.array_equal(a, b)


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
    """A convolutional estimator: one warning, the published estimator (no other derived
    form is tried)."""
    with caplog.at_level(logging.WARNING):
        engine = _engine(conv_dit_copy, tmp_path / "cache", True)
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
    from wyoming_cosyvoice3.engine.flow import stream
    from wyoming_cosyvoice3.engine.flow.stream import MelStream

    engine = _engine(conv_dit_copy, tmp_path / "cache", True)
    assert engine.chunked.get("int8") is None
    prompts: list[int] = []
    starts: list[int] = []
    offsets: list[int] = []
    real_features, real_mel = stream.flow_prompt_features, engine.flow.mel_for_tokens
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

    monkeypatch.setattr(stream, "flow_prompt_features", features)
    monkeypatch.setattr(engine.flow, "mel_for_tokens", mel)
    monkeypatch.setattr(MelStream, "next_mel", next_mel)
    voice = engine.prepare_voice(conv_dit_copy / "voices" / "en-male.wav", "A test voice.")
    options = PRESETS["balanced"].replace(vocoder={"defer": False})
    with fixed_decoding(engine, 4.0):
        chunks = list(engine.synthesize(TEXT, voice, options))
    assert chunks and chunks[-1].is_last
    assert prompts == [25]
    pairs = list(zip(starts, offsets, strict=True))  # one full-attention pass per chunk
    assert len(pairs) >= 3 and pairs[0] == (0, 0)
    assert all(start == max(0, offset - 10) for start, offset in pairs)
    assert any(start > 0 for start, _ in pairs)  # history really was cut
    assert PRESETS["balanced"].flow.full_attention().chunk_causal is False
    quality = PRESETS["quality"]
    assert quality.flow.full_attention() == quality.replace(flow={"chunk_causal": False}).flow


@pytest.fixture
def int8_engine(engine_balanced: CosyVoice3Engine) -> Iterator[CosyVoice3Engine]:
    """The engine of ``balanced`` (``fast`` loads the same graphs: int8 streaming DiT,
    chunk-causal), decoding a fixed length."""
    with fixed_decoding(engine_balanced, 2.0):
        yield engine_balanced


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
    assert opts.flow.chunk_causal and opts.flow.final_chunk_causal
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
    options = opts.replace(vocoder={"defer": False})
    chunks = list(engine.synthesize(text, voice, options))
    bound = C.TOKEN_MEL_RATIO * opts.flow.left_context_tokens
    assert len(chunks) >= 5 and chunks[-1].is_last
    assert max(seen) > 2 * bound  # the piece is long enough for the bound to act
    assert 0 < max(stored) <= bound
    prompt = next(iter(flow._prompts.values()))
    assert prompt.frames == cacheable_prompt_frames(
        min(len(voice.features.speech_tokens), opts.flow.prompt_tokens))


@pytest.mark.parametrize("preset", ["balanced", "fast"])
def test_whole_middle_pieces_equal_the_one_shot_pieces_chunk_causally(
        int8_engine: CosyVoice3Engine, tiny_dit_model_dir: Path, preset: str) -> None:
    """``balanced`` and ``fast`` run a one-shot piece chunk-causally, its one (final) chunk
    too; a whole middle piece (``whole_middle_pieces``: one chunk, as the server asks when it
    holds pieces) must run that same flow, so it is sample-equal to the piece of a one-shot
    request (test_pipeline_engine.py checks the full-attention presets)."""
    opts = PRESETS[preset]
    assert opts.flow.chunk_causal and opts.flow.final_chunk_causal
    opts = opts.replace(seed=4, max_piece_tokens=12, vocoder={"defer": False})
    engine = int8_engine
    voice = engine.prepare_voice(tiny_dit_model_dir / "voices" / "en-male.wav", "A test voice.")
    text = ("The kitchen lights are on now. The front door is locked for the night. "
            "The heating is set to twenty degrees. Good night.")

    def by_piece(options: SynthesisOptions) -> dict[int, list[Any]]:
        pieces: dict[int, list[Any]] = {}
        for c in engine.synthesize(text, voice, options):
            pieces.setdefault(c.piece_index, []).append(c)
        return pieces

    whole = by_piece(opts.replace(flow={"whole_middle_pieces": True}))
    one_shot = by_piece(opts.replace(streaming=False, flow={"whole_middle_pieces": False}))
    last = len(whole) - 1
    assert last >= 2 and sorted(whole) == sorted(one_shot)
    for index in range(1, last):
        assert len(whole[index]) == 1 and whole[index][0].piece_done
        samples, reference = whole[index][0].samples, one_shot[index][0].samples
        assert samples.shape == reference.shape and np.abs(reference).max() > 1e-3
        assert np.array_equal(samples, reference)
    assert len(whole[0]) > 1 and len(whole[last]) > 1  # the first and last stream


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


def test_streaming_graph_runs_the_position_convolutions_in_2d(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path
) -> None:
    """Both grouped position convolutions of the derived graph are 2-D with a [1, K] kernel
    (onnxruntime's grouped 2-D kernel is the faster one at a stream's small chunks,
    BENCHMARKS.md "The position convolutions in 2-D"); K is the source's kernel."""
    import onnx

    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import ensure_streaming_estimator

    source = tiny_dit_model_dir / "flow.decoder.estimator.fp32.onnx"
    def kernels(path: Path) -> list[list[int]]:
        return [list(a.ints) for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"
                for a in n.attribute if a.name == "kernel_shape"]

    main, _time = ensure_streaming_estimator(source, tiny_dit_cache_dir, "int8", in_process=True)
    (k1,), (k2,) = kernels(source)
    assert kernels(main) == [[1, k1], [1, k2]]


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
    options = PRESETS["quality"].replace(flow={"schedule": {"steps": 2}}, vocoder={"defer": False})
    with fixed_decoding(engine, 3.0):
        assert list(engine.synthesize(TEXT, voice, options))[-1].is_last
    assert histories and alive_at_final == [False]
