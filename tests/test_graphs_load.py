"""Loading the model directory: dims read from the graphs, typed errors for broken files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.errors import (
    GraphSignatureMismatch,
    ModelFilesMissing,
    ModelLoadError,
    SynthesisFailed,
)
from wyoming_cosyvoice3.engine.model import CosyVoice3Model, ModelDims, required_files
from wyoming_cosyvoice3.engine.options import EngineOptions, LlmPrecision
from wyoming_cosyvoice3.engine.sessions import (
    CAMPPLUS,
    ESTIMATOR,
    HIFT,
    SPEECH_TOKENIZER,
    Graph,
    load_llm,
)


@pytest.mark.parametrize("precision", ["fp32", "int8", "q4"])
def test_load_reads_the_dims_from_the_graphs(
    tiny_model_dir: Path, precision: LlmPrecision
) -> None:
    model = CosyVoice3Model.load(tiny_model_dir, EngineOptions(llm_precision=precision))
    assert model.dims == ModelDims(  # the tiny size's LLM (synthetic/config.py)
        hidden_size=64,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        speech_vocab_rows=6761,
        mel_bins=80,
        speaker_dim=192,
    )
    assert (
        model.llm.path.name
        == {"fp32": "llm.onnx", "int8": "llm_int8.onnx", "q4": "llm_q4.onnx"}[precision]
    )
    assert model.end_of_prompt_id == 151646
    assert not model.voice_encoders_loaded


def test_voice_encoders_are_lazy_and_releasable(tiny_model_dir: Path) -> None:
    model = CosyVoice3Model.load(tiny_model_dir, EngineOptions(llm_precision="q4"))
    campplus, tokenizer = model.voice_encoders()
    assert model.voice_encoders_loaded
    assert model.voice_encoders()[0] is campplus
    model.release_voice_encoders()
    assert not model.voice_encoders_loaded
    eager = CosyVoice3Model.load(
        tiny_model_dir, EngineOptions(llm_precision="q4", load_voice_encoders=True)
    )
    assert eager.voice_encoders_loaded
    assert tokenizer.spec.file == "speech_tokenizer_v3.onnx"


def test_required_files_per_precision() -> None:
    files = required_files("int8")
    assert "llm_int8.onnx" in files and "llm_int8.onnx.data" in files
    assert "llm.onnx" not in files
    assert {"campplus.onnx", "speech_tokenizer_v3.onnx", "hift.onnx"} <= set(files)
    with pytest.raises(ValueError, match="llm_precision"):
        required_files("fp16")


def test_missing_files_are_all_listed(tiny_model_copy: Path) -> None:
    (tiny_model_copy / "hift.onnx").unlink()
    (tiny_model_copy / "llm_int8.onnx.data").unlink()
    with pytest.raises(ModelFilesMissing) as info:
        CosyVoice3Model.load(tiny_model_copy, EngineOptions(llm_precision="int8"))
    assert info.value.missing == ["llm_int8.onnx.data", "hift.onnx"]
    assert "hift.onnx" in str(info.value)


def test_graph_of_absent_file_raises_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesMissing, match=r"hift\.onnx"):
        Graph(tmp_path / "hift.onnx", HIFT)


def test_truncated_graph_raises_load_error(tiny_model_copy: Path) -> None:
    path = tiny_model_copy / "flow.decoder.estimator.fp32.onnx"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"flow\.decoder\.estimator\.fp32\.onnx"):
        Graph(path, ESTIMATOR)
    with pytest.raises(ModelLoadError, match="estimator"):
        CosyVoice3Model.load(tiny_model_copy, EngineOptions(llm_precision="q4"))


def test_truncated_external_data_raises_load_error(tiny_model_copy: Path) -> None:
    data_path = tiny_model_copy / "llm.onnx.data"
    data_path.write_bytes(data_path.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"llm\.onnx"):
        load_llm(tiny_model_copy / "llm.onnx")


def test_corrupt_tokenizer_raises_load_error(tiny_model_copy: Path) -> None:
    (tiny_model_copy / "tokenizer.json").write_text('{"version": "1.0", "model": 5', "utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        CosyVoice3Model.load(tiny_model_copy, EngineOptions(llm_precision="q4"))


def _rename_input(path: Path, old: str, new: str) -> None:
    model = onnx.load_model(str(path))
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
    for value in model.graph.input:
        if value.name == old:
            value.name = new
    onnx.save_model(model, str(path))


def test_renamed_input_raises_signature_mismatch(tiny_model_copy: Path) -> None:
    path = tiny_model_copy / "hift.onnx"
    _rename_input(path, "speech_feat", "mel")
    with pytest.raises(GraphSignatureMismatch) as info:
        Graph(path, HIFT)
    message = str(info.value)
    assert "hift.onnx" in message and "speech_feat" in message and "'mel'" in message
    assert "re-download" in message


def test_wrong_dtype_raises_signature_mismatch(tiny_model_copy: Path) -> None:
    path = tiny_model_copy / "flow_encoder.onnx"
    model = onnx.load_model(str(path))
    graph = model.graph
    cast = onnx.helper.make_node("Cast", ["token_i32"], ["token"], to=onnx.TensorProto.INT64)
    graph.node.insert(0, cast)
    graph.input[0].name = "token_i32"
    graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save_model(model, str(path))
    from wyoming_cosyvoice3.engine.sessions import FLOW_ENCODER

    with pytest.raises(GraphSignatureMismatch, match="token"):
        Graph(path, FLOW_ENCODER)


def test_upstream_encoders_are_matched_by_position(tiny_model_copy: Path) -> None:
    path = tiny_model_copy / "speech_tokenizer_v3.onnx"
    _rename_input(path, "feats", "speech_mel")
    graph = Graph(path, SPEECH_TOKENIZER)
    feats = np.zeros((1, 128, 37), np.float32)
    out = graph.run({"feats": feats, "feats_length": np.array([37], np.int32)})
    assert out["indices"].shape == (1, 10)  # ceil(37 / 4)
    campplus = tiny_model_copy / "campplus.onnx"
    model = onnx.load_model(str(campplus))
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    onnx.save_model(model, str(campplus))
    with pytest.raises((GraphSignatureMismatch, ModelLoadError)):
        Graph(campplus, CAMPPLUS)


def test_run_failure_names_the_graph(tiny_model_dir: Path) -> None:
    graph = Graph(tiny_model_dir / "hift.onnx", HIFT)
    bad_noise = np.zeros((1, 100, C.HARMONIC_CHANNELS), np.float32)
    with pytest.raises(SynthesisFailed, match=r"hift\.onnx"):
        graph.run({"speech_feat": np.zeros((1, 80, 5), np.float32), "noise": bad_noise})


def test_fingerprint_follows_voice_encoder_files(tiny_model_copy: Path) -> None:
    model = CosyVoice3Model.load(tiny_model_copy, EngineOptions(llm_precision="q4"))
    before = model.fingerprint()
    assert before == model.fingerprint()
    (tiny_model_copy / "llm.onnx").unlink()  # unrelated to voice features
    assert model.fingerprint() == before
    path = tiny_model_copy / "campplus.onnx"
    path.write_bytes(path.read_bytes() + b"\0")
    assert model.fingerprint() != before
