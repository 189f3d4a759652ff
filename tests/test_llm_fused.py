"""The fused-operator LLM graph: weights found by structure, validation, cache, fallback.

The tiny synthetic model's LLM is a Qwen2 stack (hidden 64, 2 layers, 4 query heads over 2 KV
heads of 32, MLP 128, 6761 logits; synthetic/config.py): the fused graph derives from it. The
fallback runs on a copy whose LLM has one projection that the reader cannot see (its weight
is computed in the graph, not a constant).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from synthetic.onnx_builder import save_model
from synthetic.quant import quantize_int8
from wyoming_cosyvoice3.engine.derive.llm import fused as llm_fused
from wyoming_cosyvoice3.engine.derive.llm.fused import (
    EXACT_MAX_ABS_LOGP,
    ensure_fused_llm,
    teacher_forced_logp,
    validation_embeddings,
)
from wyoming_cosyvoice3.engine.derive.llm.fused_graph import build_fused_llm
from wyoming_cosyvoice3.engine.derive.llm.weights import LlmStructureError, read_llm_weights
from wyoming_cosyvoice3.engine.errors import ModelLoadError
from wyoming_cosyvoice3.engine.llm.decoder import LlmDecoder
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, MLP = 64, 4, 2, 32, 2, 128


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dir: Path) -> Path:
    """The tiny model directory: its llm.onnx / llm_int8.onnx are 2-layer Qwen2 stacks."""
    return tiny_model_dir


def hide_one_projection(source: Path, target: Path) -> None:
    """Write ``source``'s graph to ``target`` with layer 1's up projection weight stored
    transposed and transposed back in the graph: the same numbers, but that MatMul has no
    constant weight, so the structure reader counts one projection too few."""
    model = onnx.load(str(source))
    node = next(n for n in model.graph.node if n.name == "layers.1.up_proj.matmul")
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).T.copy(), init.name + "_t"))
    model.graph.node.insert(0, helper.make_node("Transpose", [init.name], [node.input[1]]))
    save_model(model, target, external_data=True)


def _session(path: Path) -> object:
    return llm_fused._session(path)


@pytest.mark.parametrize("source", ["llm.onnx", "llm_int8.onnx"])
def test_weights_are_found_by_structure(qwen_dir: Path, source: str) -> None:
    w = read_llm_weights(qwen_dir / source)
    assert (w.hidden, w.heads, w.kv_heads, w.head_dim, w.vocab) == (
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 6761
    )
    assert len(w.layers) == LAYERS and w.layers[0].gate.n == MLP
    assert w.eps == pytest.approx(1e-6) and w.int8 == (source == "llm_int8.onnx")
    # rotary table of theta 1e6 (Qwen2), read from the graph's own Cos subgraph
    inv_freq = 1.0 / 1e6 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    np.testing.assert_allclose(w.cos[7], np.cos(7 * inv_freq), atol=1e-6)
    assert w.layers[0].q.bias is not None and w.layers[0].o.bias is None


@pytest.mark.parametrize("source", ["llm.onnx", "llm_int8.onnx"])
def test_fused_graph_is_validated_and_matches_the_published_graph(
    qwen_dir: Path, tmp_path: Path, source: str
) -> None:
    path, report = ensure_fused_llm(qwen_dir / source, tmp_path, "fused")
    assert report.structure_max_abs_logp < EXACT_MAX_ABS_LOGP
    # 11 nodes per layer (+1 bias Add with float weights) + 10 outside the layers
    assert report.nodes <= 10 + 12 * LAYERS < report.source_nodes / 3
    assert report.greedy_agreement == 1.0
    embeds = validation_embeddings(HIDDEN, seed=5)
    ours = teacher_forced_logp(_session(path), embeds)
    theirs = teacher_forced_logp(_session(qwen_dir / source), embeds)
    tolerance = 1e-4 if source == "llm.onnx" else max(1e-4, report.int8_noise_max_abs_logp)
    assert np.abs(ours - theirs).max() < tolerance
    ops = {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    # second call: the cached file and its stored report, nothing derived again
    again, cached = ensure_fused_llm(qwen_dir / source, tmp_path, "fused")
    assert again == path and cached == report
    # an unreadable report (e.g. from an older version) makes it derive again
    path.with_name(path.name + ".json").write_text("{}", encoding="utf-8")
    _, fresh = ensure_fused_llm(qwen_dir / source, tmp_path, "fused")
    assert fresh.max_abs_logp == report.max_abs_logp and fresh.nodes == report.nodes


def head_scaled(source: Path, target: Path, factor: float) -> Path:
    """Write ``source`` (the float LLM) to ``target`` with its head's weights times ``factor``:
    the logits, and the 4-bit form's error in log-probs with them, grow about as much
    (the tiny model's fused-q4 from llm.onnx, one AVX-512 CPU: x0.25 0.27, x1 1.08, x4 4.31,
    x8 8.61, x16 17.2; beyond, float rounding of the larger logits fails the structure
    check: x32 1.5e-3)."""
    weights = read_llm_weights(source)
    model = onnx.load(str(source))
    init = next(i for i in model.graph.initializer if i.name == weights.head.weight_name)
    scaled = numpy_helper.to_array(init) * np.float32(factor)
    init.CopyFrom(numpy_helper.from_array(scaled, init.name))
    save_model(model, target, external_data=True)
    return target


@pytest.fixture(scope="module")
def small_head_dir(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLM with its head x0.25, as llm.onnx and requantised as llm_int8.onnx: a
    model whose 4-bit form stays far below LOSSY_MAX_ABS_LOGP on any kernel (the tiny model
    itself loses 1.6 from its int8 graph, near the line)."""
    directory = tmp_path_factory.mktemp("small-head")
    head_scaled(qwen_dir / "llm.onnx", directory / "llm.onnx", 0.25)
    save_model(quantize_int8(onnx.load(str(directory / "llm.onnx"))),
               directory / "llm_int8.onnx", external_data=True)
    return directory


def test_fused_q4_is_lossy_and_records_its_deviation(
    small_head_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_here(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("derived in the calling process")

    # the derivation runs in the child process: this process's copy is never called
    monkeypatch.setattr(llm_fused, "derive_fused_llm", not_here)
    path, report = ensure_fused_llm(small_head_dir / "llm_int8.onnx", tmp_path, "fused-q4")
    # lossy (measured 0.41 from the int8 graph, whose own activation error is 0.10), and
    # accepted far below the line
    assert 1e-3 < report.max_abs_logp < llm_fused.LOSSY_MAX_ABS_LOGP / 2
    assert report.int8_noise_max_abs_logp > 0
    ops = [node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 2 * 4 + 1


@pytest.mark.parametrize(("factor", "accepted"), [(0.25, True), (8.0, False)])
def test_the_q4_gate_decides_graphs_far_from_its_line(
    qwen_dir: Path, tmp_path: Path, factor: float, accepted: bool
) -> None:
    """LOSSY_MAX_ABS_LOGP (2 nats) on graphs whose outcome no CPU's 4-bit kernel changes:
    the tiny LLM with its head x0.25 loses 0.27 (accepted), with its head x8 8.6 (refused;
    its structure check, float rounding only, still passes)."""
    source = head_scaled(qwen_dir / "llm.onnx", tmp_path / "model" / "llm.onnx", factor)
    (tmp_path / "cache").mkdir()
    if accepted:
        _, report = ensure_fused_llm(source, tmp_path / "cache", "fused-q4", in_process=True)
        assert 1e-3 < report.max_abs_logp < llm_fused.LOSSY_MAX_ABS_LOGP / 4
    else:
        with pytest.raises(ModelLoadError, match=r"fused-q4 graph .* differs from it by "
                                                 r"([4-9]|[1-9]\d)\.\d+ in log-probs"):
            ensure_fused_llm(source, tmp_path / "cache", "fused-q4", in_process=True)


def test_the_q4_gate_accepts_up_to_its_line(
    qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate compares the measured error with the line: the line put just below the
    error this CPU's kernel makes refuses the graph, just above it accepts it."""
    measured: list[float] = []
    for name, share in (("free", None), ("below", 0.95), ("above", 1.05)):
        line = float("inf") if share is None else share * measured[0]
        monkeypatch.setattr(llm_fused, "LOSSY_MAX_ABS_LOGP", line)
        (tmp_path / name).mkdir()
        if share is not None and share < 1:
            with pytest.raises(ModelLoadError, match="in log-probs"):
                ensure_fused_llm(qwen_dir / "llm.onnx", tmp_path / name, "fused-q4",
                                 in_process=True)
            continue
        _, report = ensure_fused_llm(qwen_dir / "llm.onnx", tmp_path / name, "fused-q4",
                                     in_process=True)
        measured.append(report.max_abs_logp)
    assert measured[0] > 0.01 and measured[1] == measured[0]  # one kernel: the same error


def test_a_misread_structure_fails_validation_and_is_not_retried(
    qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = llm_fused.read_llm_weights

    def swapped(path: Path, max_positions: int = 32768) -> object:
        w = real(path, max_positions)
        w.layers[1].gate, w.layers[1].up = w.layers[1].up, w.layers[1].gate
        return w

    monkeypatch.setattr(llm_fused, "read_llm_weights", swapped)
    with pytest.raises(ModelLoadError, match="structure was misread"):
        ensure_fused_llm(qwen_dir / "llm.onnx", tmp_path, "fused", in_process=True)
    monkeypatch.setattr(llm_fused, "read_llm_weights", real)
    with pytest.raises(ModelLoadError, match="earlier attempt"):
        ensure_fused_llm(qwen_dir / "llm.onnx", tmp_path, "fused", in_process=True)
    assert not list(tmp_path.glob("*.onnx"))


@pytest.fixture
def unreadable_llm_copy(tiny_model_copy: Path) -> Path:
    """The tiny model with one projection of llm.onnx hidden, requantised to llm_int8.onnx."""
    hide_one_projection(tiny_model_copy / "llm.onnx", tiny_model_copy / "llm.onnx")
    save_model(quantize_int8(onnx.load(str(tiny_model_copy / "llm.onnx"))),
               tiny_model_copy / "llm_int8.onnx", external_data=True)
    return tiny_model_copy


def test_a_hidden_projection_is_a_structure_error(unreadable_llm_copy: Path) -> None:
    with pytest.raises(LlmStructureError, match="14 projections for 2 layers"):
        read_llm_weights(unreadable_llm_copy / "llm_int8.onnx")


def test_engine_falls_back_to_the_published_graph_with_one_warning(
    unreadable_llm_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = EngineOptions(llm_graph="fused", cache_dir=tmp_path,
                            stream_vocoder=False)
    for _ in range(2):  # the second load reads the failure marker: still one warning
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model = CosyVoice3Model.load(unreadable_llm_copy, options)
        assert model.llm.path == unreadable_llm_copy / "llm_int8.onnx"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "fused LLM graph not used" in warnings[0]
        assert "14 projections for 2 layers" in warnings[0]


def test_decoder_runs_the_fused_graph_with_the_same_logits(qwen_dir: Path, tmp_path: Path) -> None:
    """Prefill in two calls (the prefix cache's split) and decode steps: the fused fp32 graph
    gives the published graph's logits; its caches continue in the published graph."""
    fused = CosyVoice3Model.load(
        qwen_dir, EngineOptions(llm_precision="fp32", llm_graph="fused", cache_dir=tmp_path)
    )
    published = CosyVoice3Model.load(qwen_dir, EngineOptions(llm_precision="fp32"))
    assert fused.llm.path.parent == tmp_path and fused.llm.spec.file == "llm.onnx"
    rng = np.random.default_rng(1)
    embeds = rng.standard_normal((1, 30, HIDDEN)).astype(np.float32)
    # the classic hand-over (compact tensors) on both: a cache moves between the graphs
    a, b = LlmDecoder(fused, kv_mode="numpy"), LlmDecoder(published)
    sa, sb = a.new_state(), b.new_state()
    for part in (embeds[:, :12], embeds[:, 12:20]):
        np.testing.assert_allclose(a.prefill(sa, part), b.prefill(sb, part), atol=2e-4)
    for token in (5, 17, 6000):
        np.testing.assert_allclose(a.step(sa, token), b.step(sb, token), atol=2e-4)
    # a cache made by the fused graph continues in the published one (same layout)
    sc = sb.fork()
    sc.kv = list(sa.kv)
    np.testing.assert_allclose(b.step(sc, 42), b.step(sb, 42), atol=2e-4)


def test_fused_b8_packs_the_published_int8_weights_exactly(qwen_dir: Path) -> None:
    """8-bit blocks hold the published per-column int8 weights as they are (stored + 128, the
    column's scale and zero point in every block)."""
    weights = read_llm_weights(qwen_dir / "llm_int8.onnx")
    model = build_fused_llm(weights, kernel="nbits8", block_size=llm_fused.b8_block_size([HIDDEN]))
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 2 * 4 + 1
    assert {a.i for n in nodes for a in n.attribute if a.name == "bits"} == {8}
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    packed = init[nodes[0].input[1]].reshape(-1, HIDDEN)  # the q|k|v projection, [N, K]
    scales = init[nodes[0].input[2]]
    q = weights.layers[0].q
    assert q.qweight is not None and q.scale is not None
    np.testing.assert_array_equal(packed[: q.n].astype(np.int16) - 128, q.qweight.T)
    np.testing.assert_array_equal(scales[: q.n], q.scale)  # one block per column at K = 64


def test_fused_b8_is_refused_when_further_from_float_than_the_published_graph(
    qwen_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tiny model's rows are one 64-wide block each: symmetric int8 per block loses a bit
    against the published graph's asymmetric uint8 per tensor, so 8-bit blocks end further
    from float activations than the published graph and the derivation refuses them; the
    engine then decodes with the fused graph, after one warning."""
    with pytest.raises(ModelLoadError, match=r"fused-b8 graph of llm_int8\.onnx is [\d.]+ from "
                                             r"float activations in log-probs, the published "
                                             r"graph [\d.]+"):
        ensure_fused_llm(qwen_dir / "llm_int8.onnx", tmp_path, "fused-b8")
    with caplog.at_level(logging.WARNING):
        model = CosyVoice3Model.load(qwen_dir, EngineOptions(
            llm_graph="fused-b8", llm_prefill_graph="fused", cache_dir=tmp_path))
    assert ".fused2-" in model.llm.path.name and model.llm_prefill is None  # one graph
    warnings = [r.getMessage() for r in caplog.records if "LLM graph" in r.getMessage()]
    assert len(warnings) == 1 and "using the fused graph" in warnings[0]


def test_fused_b8_needs_int8_weights_and_a_block_that_divides_the_widths(
        qwen_dir: Path) -> None:
    assert llm_fused.b8_block_size([896, 4864]) == 128
    assert llm_fused.b8_block_size([64, 256]) == 64
    assert llm_fused.b8_block_size([48, 96]) == 16
    with pytest.raises(ModelLoadError, match="divisible by 16"):
        llm_fused.b8_block_size([896, 100])
    with pytest.raises(ModelLoadError, match="float weights"):
        llm_fused.derive_fused_llm(qwen_dir / "llm.onnx", Path("/nonexistent/x.onnx"), "fused-b8")


def test_the_prefill_graph_prefills_and_the_decode_graph_decodes(
        qwen_dir: Path, tmp_path: Path) -> None:
    """``llm_prefill_graph``: prompts (several positions) run the prefill graph, single tokens
    the decode graph, continuing its cache: the logits are each graph's own."""
    both = CosyVoice3Model.load(qwen_dir, EngineOptions(
        llm_graph="fused-q4", llm_prefill_graph="fused", cache_dir=tmp_path))
    assert both.llm_prefill is not None
    assert ".fusedq4" in both.llm.path.name and ".fused2-" in both.llm_prefill.path.name
    prefill_only = CosyVoice3Model.load(qwen_dir, EngineOptions(llm_graph="fused",
                                                                cache_dir=tmp_path))
    decode_only = CosyVoice3Model.load(qwen_dir, EngineOptions(llm_graph="fused-q4",
                                                               cache_dir=tmp_path))
    assert prefill_only.llm_prefill is None and decode_only.llm_prefill is None
    embeds = np.random.default_rng(3).standard_normal((1, 20, HIDDEN)).astype(np.float32)
    a, p, d = LlmDecoder(both), LlmDecoder(prefill_only), LlmDecoder(decode_only)
    sa, sp = a.new_state(), p.new_state()
    # the prompt: bit-equal to the prefill graph's
    np.testing.assert_array_equal(a.prefill(sa, embeds), p.prefill(sp, embeds))
    # a step: bit-equal to the decode graph continuing the same cache
    sd = sp.fork()
    np.testing.assert_array_equal(a.step(sa, 42), d.step(sd, 42))


def test_the_kv_cache_extended_in_place_gives_the_same_logits(
    qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kv_mode`` buffer (past and present bound to one buffer, GroupQueryAttention writing
    the new positions in place): the logits of the classic hand-over, bit for bit, through the
    prefix cache, forks (each fork decodes on its own copy) and growths of the buffers."""
    from wyoming_cosyvoice3.engine.llm import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "KV_CAPACITY_STEP", 8)  # grow twice below
    model = CosyVoice3Model.load(qwen_dir, EngineOptions(llm_graph="fused", cache_dir=tmp_path))
    assert model.llm_kv_in_place
    buffered, classic = LlmDecoder(model), LlmDecoder(model, kv_mode="numpy")
    assert buffered.kv_mode == "buffer"
    rng = np.random.default_rng(4)
    embeds = rng.standard_normal((1, 14, HIDDEN)).astype(np.float32)
    sb, sc = buffered.new_state(), classic.new_state()
    for part in (embeds[:, :6], embeds[:, 6:]):  # 14 positions: past the first 8
        np.testing.assert_array_equal(buffered.prefill(sb, part), classic.prefill(sc, part))
    assert sb.in_place and sb.capacity >= 14
    fork_b, fork_c = sb.fork(), sc.fork()
    # the fork and the original take turns at the same positions: each writes its own copy
    for token in (99, 98, 97):
        np.testing.assert_array_equal(buffered.step(fork_b, token), classic.step(fork_c, token))
        np.testing.assert_array_equal(buffered.step(sb, token + 1),
                                      classic.step(sc, token + 1))
    for token in (5, 17, 6000, 3, 9, 11, 2, 8, 40, 41):  # the original grows again (27)
        np.testing.assert_array_equal(buffered.step(sb, token), classic.step(sc, token))
    assert sb.past_len == 27 and fork_b.past_len == 17
    # the published graph has no in-place attention: the classic hand-over
    published = CosyVoice3Model.load(qwen_dir, EngineOptions(llm_graph="published"))
    assert not published.llm_kv_in_place
    assert LlmDecoder(published).kv_mode in ("numpy", "iobinding")
    with pytest.raises(ValueError, match="fused LLM graphs"):
        LlmDecoder(published, kv_mode="buffer")


def test_an_earlier_recipes_files_are_removed_once_the_form_is_derived(
        qwen_dir: Path, tmp_path: Path) -> None:
    """The one-row forms (tags ``*1``) are retired by the forms with a batch axis."""
    old = [tmp_path / f"llm_int8.fusedq4r1-1-2{suffix}"
           for suffix in (".onnx", ".onnx.data", ".onnx.json")]
    other = tmp_path / "llm_int8.fused1-1-2.onnx"  # another variant's: left to its own
    for path in [*old, other]:
        path.write_bytes(b"x")
    path, _ = ensure_fused_llm(qwen_dir / "llm_int8.onnx", tmp_path, "fused-q4")
    assert ".fusedq4r2-" in path.name and path.is_file()
    assert not any(p.exists() for p in old) and other.exists()
