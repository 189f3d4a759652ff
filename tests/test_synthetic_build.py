"""The synthetic model directory honours the file-level graph contract (spec section 1)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest
import soundfile

from synthetic import build_synthetic_model
from wyoming_cosyvoice3.engine.model import BUILT_IN_VOICE_FILES, required_files
from wyoming_cosyvoice3.engine.sessions import (
    CAMPPLUS,
    ESTIMATOR,
    FLOW_ENCODER,
    HIFT,
    SPEECH_EMBEDDING,
    SPEECH_TOKENIZER,
    TEXT_EMBEDDING,
    GraphSpec,
    llm_spec,
)

# The tiny size's LLM widths (synthetic/config.py, documented there): the engine reads them
# from the graphs; published: hidden 896, 24 layers, KV 2 x 64.
HIDDEN, LAYERS, KV_HEADS, HEAD_DIM = 64, 2, 2, 32
# Static dims of the contract (model card of the ONNX export); None = dynamic axis.
CONTRACT_SHAPES: dict[str, dict[str, list[int | None]]] = {
    "text_embedding_fp16.onnx": {"input_ids": [1, None], "inputs_embeds": [1, None, HIDDEN]},
    "speech_embedding.onnx": {"input_ids": [1, None], "inputs_embeds": [1, None, HIDDEN]},
    "flow_encoder.onnx": {
        "token": [1, None],
        "embedding": [1, 192],
        "mu": [1, 80, None],
        "spks": [1, 80],
    },
    "flow.decoder.estimator.fp32.onnx": {
        "x": [2, 80, None],
        "mask": [2, 1, None],
        "mu": [2, 80, None],
        "t": [2],
        "spks": [2, 80],
        "cond": [2, 80, None],
        "estimator_out": [2, 80, None],
    },
    "hift.onnx": {
        "speech_feat": [1, 80, None],
        "noise": [1, None, 9],
        "magnitude": [1, 9, None],
        "phase": [1, 9, None],
    },
    "campplus.onnx": {"input": [1, None, 80], "output": [1, 192]},
    "speech_tokenizer_v3.onnx": {
        "feats": [1, 128, None],
        "feats_length": [1],
        "indices": [1, None],
    },
}
SPECS: list[GraphSpec] = [
    TEXT_EMBEDDING,
    SPEECH_EMBEDDING,
    FLOW_ENCODER,
    ESTIMATOR,
    HIFT,
    CAMPPLUS,
    SPEECH_TOKENIZER,
]
ORT_TYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(int32)": "int32"}


def _normalised(shape: list[int | str | None]) -> list[int | None]:
    return [d if isinstance(d, int) else None for d in shape]


def test_every_required_file_exists(tiny_model_dir: Path) -> None:
    for precision in ("fp32", "int8", "q4"):
        for name in required_files(precision):
            assert (tiny_model_dir / name).is_file(), name
    for name in BUILT_IN_VOICE_FILES:
        assert (tiny_model_dir / name).is_file(), name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.file)
def test_graph_names_dtypes_shapes_match_contract(tiny_model_dir: Path, spec: GraphSpec) -> None:
    session = ort.InferenceSession(str(tiny_model_dir / spec.file))
    found_in = {a.name: (ORT_TYPES[a.type], _normalised(a.shape)) for a in session.get_inputs()}
    found_out = {a.name: (ORT_TYPES[a.type], _normalised(a.shape)) for a in session.get_outputs()}
    shapes = CONTRACT_SHAPES[spec.file]
    assert list(found_in) == list(spec.inputs)  # same names, same order
    assert list(found_out) == list(spec.outputs)
    for name, dtype in {**spec.inputs, **spec.outputs}.items():
        got_dtype, got_shape = {**found_in, **found_out}[name]
        assert got_dtype in dtype.split("|"), name
        assert got_shape == shapes[name], name


@pytest.mark.parametrize("file", ["llm.onnx", "llm_int8.onnx", "llm_q4.onnx"])
def test_llm_signature_matches_contract(tiny_model_dir: Path, file: str) -> None:
    session = ort.InferenceSession(str(tiny_model_dir / file))
    spec = llm_spec(file, LAYERS)
    inputs = {a.name: a for a in session.get_inputs()}
    outputs = {a.name: a for a in session.get_outputs()}
    assert set(inputs) == set(spec.inputs)
    assert set(outputs) == set(spec.outputs)
    assert _normalised(inputs["inputs_embeds"].shape) == [1, None, HIDDEN]
    assert inputs["attention_mask"].type == "tensor(int64)"
    assert inputs["position_ids"].type == "tensor(int64)"
    assert _normalised(outputs["logits"].shape) == [1, 6761]
    cache = [1, KV_HEADS, None, HEAD_DIM]
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            assert _normalised(inputs[f"past_key_values.{layer}.{kind}"].shape) == cache
            assert _normalised(outputs[f"present.{layer}.{kind}"].shape) == cache
    data = (tiny_model_dir / (file + ".data")).stat().st_size
    assert data > (tiny_model_dir / file).stat().st_size  # weights live in the .data file


def test_quantised_llms_use_quantised_ops(tiny_model_dir: Path) -> None:
    import onnx

    def op_types(name: str) -> set[str]:
        model = onnx.load_model(str(tiny_model_dir / name), load_external_data=False)
        return {node.op_type for node in model.graph.node}

    assert "MatMulInteger" in op_types("llm_int8.onnx")
    assert "DynamicQuantizeLinear" in op_types("llm_int8.onnx")
    assert "MatMulNBits" in op_types("llm_q4.onnx")
    assert not {"MatMulInteger", "MatMulNBits"} & op_types("llm.onnx")


def test_directory_is_small(tiny_model_dir: Path) -> None:
    total = sum(p.stat().st_size for p in tiny_model_dir.rglob("*") if p.is_file())
    assert total < 50_000_000


def test_built_in_voices_are_24k_pcm16_clips(tiny_model_dir: Path) -> None:
    for name in BUILT_IN_VOICE_FILES:
        info = soundfile.info(str(tiny_model_dir / name))
        assert info.samplerate == 24000 and info.channels == 1 and info.subtype == "PCM_16"
        assert 4.0 <= info.duration <= 5.0


def _digests(directory: Path) -> dict[str, str]:
    """sha256 of every file but the manifest (it records the build's timing)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "synthetic_model.json"
    }


def test_same_seed_gives_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_synthetic_model(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny_model_dir)


REPO = Path(__file__).resolve().parents[1]


def test_other_seed_changes_weights_not_interfaces(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Through the command as written in a clone: ``python -m synthetic OUT --seed 1`` run in
    the repository's root (the builder is not in the installed package)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "synthetic", str(tmp_path / "seed1"),
                           "--seed", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{tmp_path / 'seed1'}: ") and " MB" in done.stdout
    ref, other = _digests(tiny_model_dir), _digests(tmp_path / "seed1")
    assert set(ref) == set(other)
    changed = {name for name in ref if ref[name] != other[name]}
    assert {"hift.onnx", "llm.onnx.data", "voices/en-male.wav"} <= changed
    assert "tokenizer.json" not in changed


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny"):
        build_synthetic_model(tmp_path, size="huge")


def test_external_data_files_are_readable_like_their_graphs(tiny_model_dir: Path) -> None:
    """onnx writes *.onnx.data with mode 0600; the builder gives them the graph's mode."""
    for data in sorted(tiny_model_dir.glob("*.onnx.data")):
        graph = data.with_name(data.name.removesuffix(".data"))
        assert data.stat().st_mode & 0o777 == graph.stat().st_mode & 0o777, data.name
