"""The DiT estimator split into its time-conditioning and per-frame graphs (exact lever)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from synthetic.audio import write_clip
from synthetic.config import get_config
from synthetic.flow import build_estimator
from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions, SynthesisOptions
from wyoming_cosyvoice3.engine.derive.flow.estimator_split import (
    SplitEstimator,
    ensure_split_estimator,
    main_graph_spec,
    split_time_conditioning,
)
from wyoming_cosyvoice3.engine.graphs import Graph, open_session

EST = "flow.decoder.estimator.fp32.onnx"


def feeds(frames: int, t: float = 0.3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(frames)
    return {
        "x": rng.standard_normal((2, 80, frames), dtype=np.float32),
        "mask": np.ones((2, 1, frames), dtype=np.float32),
        "mu": rng.standard_normal((2, 80, frames), dtype=np.float32),
        "t": np.array([t, t], dtype=np.float32),
        "spks": rng.standard_normal((2, 80), dtype=np.float32),
        "cond": rng.standard_normal((2, 80, frames), dtype=np.float32),
    }


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("split")
    onnx.save(build_estimator(get_config("tiny"), 0), str(folder / EST))  # the tiny model's
    return folder


def load_split(main: Path, time_graph: Path) -> SplitEstimator:
    session = open_session(main, 1, ("CPUExecutionProvider",))
    return SplitEstimator(Graph(main, main_graph_spec(session), session=session), time_graph, 1)


def test_split_moves_the_modulation_layers_into_the_time_graph(dit_dir: Path) -> None:
    parts = split_time_conditioning(onnx.load(str(dit_dir / EST)))
    assert parts is not None
    main, time_model = parts
    time_ops = {n.name for n in time_model.graph.node}
    main_ops = {n.name for n in main.graph.node}
    assert any("attn_norm.linear" in n for n in time_ops)
    assert not any("attn_norm.linear" in n for n in main_ops)
    assert [i.name for i in time_model.graph.input] == ["t"]
    assert "t" not in {i.name for i in main.graph.input}
    # the weights moved with their nodes: most parameters of a DiT are modulation weights
    size = {id(m): sum(int(np.prod(i.dims)) for i in m.graph.initializer) for m in parts}
    assert size[id(time_model)] > 0.2 * size[id(main)]


def test_split_fp32_equals_the_whole_graph_and_caches_per_t(dit_dir: Path) -> None:
    main, time_graph = ensure_split_estimator(dit_dir / EST, dit_dir, "fp32", in_process=True)
    split = load_split(main, time_graph)
    whole = ort.InferenceSession(str(dit_dir / EST))
    for frames, t in ((30, 0.3), (55, 0.3), (30, 0.7)):
        f = feeds(frames, t)
        want = whole.run(None, f)[0]
        got = split.run(f)["estimator_out"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert split.time_runs == 2  # two distinct t values
    split.precompute([np.array([0.1, 0.1], np.float32), np.array([0.3, 0.3], np.float32)])
    assert split.time_runs == 3
    assert split.input_shape("x")[0] == 2 and split.input_shape("t") == [2]


def test_split_int8_quantises_only_the_main_graph(dit_dir: Path) -> None:
    main, time_graph = ensure_split_estimator(dit_dir / EST, dit_dir, "int8", in_process=True)
    assert "int8main" in main.name
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(main)).graph.node}
    assert "MatMulInteger" not in {n.op_type for n in onnx.load(str(time_graph)).graph.node}
    f = feeds(40)
    want = ort.InferenceSession(str(dit_dir / EST)).run(None, f)[0]
    got = load_split(main, time_graph).run(f)["estimator_out"]
    err = float(np.sum((want.astype(np.float64) - got) ** 2))
    assert 10 * np.log10(float(np.sum(want.astype(np.float64) ** 2)) / err) > 30.0


def test_engine_with_split_estimator_gives_the_same_audio(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = CosyVoice3Engine.load(tiny_model_dir, EngineOptions(threads=1, llm_precision="fp32"))
    split = CosyVoice3Engine.load(
        tiny_model_dir,
        EngineOptions(threads=1, llm_precision="fp32", cache_dir=tmp_path / "cache"),
    )
    assert isinstance(split.model.estimator, SplitEstimator)
    clip = write_clip(tmp_path / "ref.wav", seconds=3.0)
    voice = plain.prepare_voice(clip, transcript="This is a reference clip.")
    opts = SynthesisOptions(seed=4, max_decode_tokens=40).replace(flow={"first_hop_tokens": 5})
    a = np.concatenate([c.samples for c in plain.synthesize("Lights on now.", voice, opts)])
    b = np.concatenate([c.samples for c in split.synthesize("Lights on now.", voice, opts)])
    assert len(a) > 0
    np.testing.assert_allclose(b, a, atol=1e-5)


def test_warm_up_precomputes_the_time_conditioning_of_every_preset(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from wyoming_cosyvoice3.engine.options import PRESETS

    engine = CosyVoice3Engine.load(
        tiny_model_dir, EngineOptions(threads=1, llm_precision="fp32", cache_dir=tmp_path / "c")
    )
    voice = engine.prepare_voice(write_clip(tmp_path / "ref.wav", seconds=3.0))
    estimator = engine.model.estimator
    assert isinstance(estimator, SplitEstimator)
    engine.warm_up(voice)
    runs = estimator.time_runs
    assert runs >= 1
    for preset in PRESETS.values():
        opts = preset.replace(max_decode_tokens=12, flow={"precision": "fp32"})
        assert list(engine.synthesize("Lights on.", voice, opts))
    assert estimator.time_runs == runs
