"""Derived once from the model: the DiT's int8 recipe, the estimator's forms per precision and
the memory-mapped text table."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from broken_graphs import convolutional_estimator
from onnx import TensorProto, helper, numpy_helper

from synthetic.config import get_config
from synthetic.flow import build_estimator
from wyoming_cosyvoice3.engine.derive.flow import streaming_estimator
from wyoming_cosyvoice3.engine.derive.flow.full_attention import FullAttentionDiT
from wyoming_cosyvoice3.engine.derive.flow.quantize import per_frame_matmuls, quantize_estimator
from wyoming_cosyvoice3.engine.derive.llm.embedding_table import (
    load_table_embedding,
    plain_gather_table,
)
from wyoming_cosyvoice3.engine.embedding import TableEmbedding
from wyoming_cosyvoice3.engine.errors import ModelLoadError, SynthesisFailed
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions, FlowPreset
from wyoming_cosyvoice3.engine.sessions import TEXT_EMBEDDING, Graph

EST = "flow.decoder.estimator.fp32.onnx"


def estimator_feeds(frames: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((2, 80, frames), dtype=np.float32),
        "mask": np.ones((2, 1, frames), dtype=np.float32),
        "mu": rng.standard_normal((2, 80, frames), dtype=np.float32),
        "t": np.array([0.3, 0.3], dtype=np.float32),
        "spks": rng.standard_normal((2, 80), dtype=np.float32),
        "cond": rng.standard_normal((2, 80, frames), dtype=np.float32),
    }


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - test) ** 2))
    return 10.0 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / max(noise, 1e-30))


def small_dit() -> onnx.ModelProto:
    """The tiny model's DiT estimator (upstream's architecture, 2 blocks of width 128)."""
    return build_estimator(get_config("tiny"), 0)


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small DiT estimator and its int8 version by the project's recipe."""
    folder = tmp_path_factory.mktemp("int8")
    onnx.save(small_dit(), str(folder / EST))
    quantize_estimator(folder / EST, folder / "flow.decoder.estimator.int8.onnx")
    return folder


def test_int8_estimator_quantises_per_frame_matmuls_and_stays_close(int8_dir: Path) -> None:
    (target,) = int8_dir.glob("flow.decoder.estimator.int8*.onnx")
    quantised = onnx.load(str(target)).graph
    ops = [node.op_type for node in quantised.node]
    assert ops.count("MatMulInteger") == len(per_frame_matmuls(onnx.load(str(int8_dir / EST))))
    assert ops.count("MatMulInteger") == 13
    # the time-embedding / AdaLN modulation MatMuls (one row per batch item) stay fp32
    fp32_weights = {n.input[1] for n in quantised.node if n.op_type == "MatMul"}
    assert any("attn_norm" in name for name in fp32_weights)
    feeds = estimator_feeds(40)
    ref = ort.InferenceSession(str(int8_dir / EST)).run(None, feeds)[0]
    got = ort.InferenceSession(str(target)).run(None, feeds)[0]
    assert got.shape == ref.shape
    assert not np.array_equal(got, ref)
    # 25 dB: the tiny DiT's weights (std 0.1) spread its activations wider than a Qwen-like
    # init (std 0.02, above 30 dB), and dynamic int8 rounds them coarser
    assert snr_db(ref, got) > 25.0


def test_per_frame_selection_skips_batch_row_matmuls() -> None:
    names = per_frame_matmuls(small_dit())
    assert names and all("attn_norm" not in n and "time" not in n for n in names)
    assert any(".attn.to_q." in n for n in names) and any(".ff." in n for n in names)


def test_model_loads_the_other_precision_as_its_streaming_dit_on_first_use(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path
) -> None:
    """The estimator's one derived form is the streaming DiT of its precision run with full
    attention: one copy of the weights serves chunks and full-attention passes."""
    opts = EngineOptions(threads=1, cache_dir=tiny_dit_cache_dir)
    model = CosyVoice3Model.load(tiny_dit_model_dir, opts)
    assert model.estimator_for("fp32") is model.estimator
    assert isinstance(model.estimator, FullAttentionDiT)
    assert ("estimator", "int8") not in model._graphs  # nothing of int8 loaded yet
    int8 = model.estimator_for("int8")
    assert int8 is model.estimator_for("int8") and int8 is not model.estimator
    assert isinstance(int8, FullAttentionDiT)
    assert int8.streaming is model.streaming_estimator("int8")
    assert int8.path is not None and int8.path.parent == tiny_dit_cache_dir
    assert int8.spec.file == EST


def test_a_bare_engine_runs_the_published_estimator_and_warns_for_int8(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No cache directory: nothing derived; fp32 is the published graph without a word, and
    int8 (which only a derived form has) falls back to it with one warning."""
    with caplog.at_level(logging.WARNING):
        model = CosyVoice3Model.load(tiny_model_dir, EngineOptions(threads=1))
        assert type(model.estimator) is Graph and model.estimator.path == tiny_model_dir / EST
        assert not caplog.records
        assert model.estimator_for("int8").path == tiny_model_dir / EST  # type: ignore[union-attr]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "(int8) not available" in warnings[0]
    assert "published fp32 estimator" in warnings[0]


def test_estimator_without_the_dit_structure_stays_fp32(
    tiny_model_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a convolutional estimator: no DiT to derive from -> one warning, the fp32 graph
    onnx.save(convolutional_estimator(), str(tiny_model_copy / EST))
    opts = EngineOptions(  # the other derived forms are not this test's subject
        threads=1, cache_dir=tmp_path, flow=FlowPreset(precision="int8"),
        stream_vocoder=False,
    )
    for _ in range(2):  # the second load reads the failure marker: again one warning
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model = CosyVoice3Model.load(tiny_model_copy, opts)
        assert model.estimator.path == tiny_model_copy / EST
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "streaming flow (int8) not available" in warnings[0]
    assert not list(tmp_path.glob("*estimator*.onnx"))
    assert list(tmp_path.glob("*estimator*.onnx.failed"))


def test_quantiser_refuses_a_graph_without_per_frame_matmuls(tmp_path: Path) -> None:
    onnx.save(convolutional_estimator(), str(tmp_path / EST))
    with pytest.raises(ValueError, match="no per-frame MatMul"):
        quantize_estimator(tmp_path / EST, tmp_path / "int8.onnx")
    assert not (tmp_path / "int8.onnx").exists()


# -- memory-mapped text embedding -----------------------------------------------------------


def test_table_embedding_equals_the_graph(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    table16 = rng.standard_normal((1000, 8)).astype(np.float16)
    source = tmp_path / TEXT_EMBEDDING.file
    onnx.save(_plain_model(table16), str(source))
    cache = tmp_path / "cache"
    cache.mkdir()
    table = load_table_embedding(source, TEXT_EMBEDDING, cache)
    assert isinstance(table, TableEmbedding)
    assert isinstance(table.table, np.memmap)
    graph = Graph(source, TEXT_EMBEDDING, threads=1)
    ids = np.array([[0, 5, 999, -1, 42, 42]], dtype=np.int64)
    want = graph.run({"input_ids": ids})["inputs_embeds"]
    got = table.run({"input_ids": ids})["inputs_embeds"]
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (1, 6, 8)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(SynthesisFailed):
        table.run({"input_ids": np.array([[1000]], dtype=np.int64)})
    # a second load reuses the extracted file
    (npy,) = cache.glob("*.npy")
    before = npy.stat().st_mtime_ns
    again = load_table_embedding(source, TEXT_EMBEDDING, cache)
    assert again is not None and npy.stat().st_mtime_ns == before


def test_model_serves_the_table_and_falls_back_to_the_graph_when_it_is_not_a_plain_lookup(
    tiny_model_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    off = {"stream_vocoder": False}
    bare = CosyVoice3Model.load(tiny_model_copy, EngineOptions(threads=1))
    assert isinstance(bare.text_embedding, Graph)  # no cache directory: nothing derived
    cached = CosyVoice3Model.load(
        tiny_model_copy, EngineOptions(threads=1, cache_dir=tmp_path / "a", **off))
    assert isinstance(cached.text_embedding, TableEmbedding)  # the published plain lookup
    # ids folded with Mod before the Gather: not a plain lookup -> the graph, no warning
    table = np.random.default_rng(1).standard_normal((151936, 64)).astype(np.float16)
    fold = helper.make_node("Mod", ["input_ids", "rows"], ["row"])
    gather = helper.make_node("Gather", ["w", "row"], ["g"], axis=0)
    cast = helper.make_node("Cast", ["g"], ["inputs_embeds"], to=TensorProto.FLOAT)
    folded = _graph_model([fold, gather, cast], table)
    folded.graph.initializer.append(numpy_helper.from_array(np.array(151936, np.int64), "rows"))
    onnx.save(folded, str(tiny_model_copy / TEXT_EMBEDDING.file))
    with caplog.at_level(logging.WARNING):
        other = CosyVoice3Model.load(
            tiny_model_copy, EngineOptions(threads=1, cache_dir=tmp_path / "b", **off))
    assert isinstance(other.text_embedding, Graph)
    assert not list((tmp_path / "b").glob("*.npy"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _plain_model(table: np.ndarray) -> onnx.ModelProto:
    gather = helper.make_node("Gather", ["w", "input_ids"], ["g"], axis=0)
    cast = helper.make_node("Cast", ["g"], ["inputs_embeds"], to=TensorProto.FLOAT)
    return _graph_model([gather, cast], table)


def _graph_model(nodes: list[onnx.NodeProto], table: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, "s", None])],
        [numpy_helper.from_array(table, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_only_plain_gather_graphs_are_accepted() -> None:
    table16 = np.arange(12, dtype=np.float16).reshape(3, 4)
    gather = helper.make_node("Gather", ["w", "input_ids"], ["g"], axis=0)
    cast = helper.make_node("Cast", ["g"], ["inputs_embeds"], to=TensorProto.FLOAT)
    found = plain_gather_table(_graph_model([gather, cast], table16))
    assert found is not None and found[1] == "float32"
    np.testing.assert_array_equal(found[0], table16)
    scaled = helper.make_node("Mul", ["g", "g"], ["inputs_embeds"])
    assert plain_gather_table(_graph_model([gather, scaled], table16)) is None
    axis1 = helper.make_node("Gather", ["w", "input_ids"], ["inputs_embeds"], axis=1)
    assert plain_gather_table(_graph_model([axis1], table16.astype(np.float32))) is None


def test_int8_failure_falls_back_to_the_fp32_estimator(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fail(*args: object, **kwargs: object) -> Path:
        raise ModelLoadError("quantiser ran out of memory")

    monkeypatch.setattr(streaming_estimator, "ensure_streaming_estimator", fail)
    opts = EngineOptions(  # the other derived forms are not this test's subject
        threads=1, cache_dir=tmp_path, flow=FlowPreset(precision="int8"),
        stream_vocoder=False,
    )
    with caplog.at_level(logging.WARNING):
        model = CosyVoice3Model.load(tiny_model_dir, opts)
    assert model.estimator.path == tiny_model_dir / EST
    assert model.estimator_for("int8") is model.estimator
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "out of memory" in warnings[0]
