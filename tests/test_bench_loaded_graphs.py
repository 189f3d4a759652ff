"""Every graph the engine loads has an operation count: a benchmark minimum that
leaves out a graph (as it left out the streamed vocoder) is not a minimum.

Each configuration is a real engine load of the tiny synthetic model with a cache directory
(so every derived form is made and loaded): the three presets, every LLM graph the engine
offers (``LlmGraph``) on the int8 LLM, the published LLM of every precision, the windowed
vocoder, and the DiT of a preset that is not chunk-causal (full attention through the streaming
DiT, fp32 and int8). What is loaded is read off the
onnxruntime sessions alive after the requests (not a hand-written list); what runs, from the
engine's run observer during a voice preparation, a streamed and a one-shot request. Every
loaded graph has a cost model, or is a lookup without any operation the benchmark counts;
every graph run during the requests is counted with more than 0 operations.
"""

from __future__ import annotations

import gc
import logging
import typing
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from decoding_support import FixedDecoding

from bench.costmodel import CostModel, family_of, load_cost_models, stage_of
from bench.flops import ATTENTION_OP, FP32_OPS, INT8_OPS, NBITS_OP
from bench.stats import graph_summary
from bench.throughput import Throughput
from synthetic.audio import write_clip
from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions, SynthesisOptions, sessions
from wyoming_cosyvoice3.engine.options import LLM_FILES, PRESET_LLM_GRAPHS, PRESETS, LlmGraph

TEXT = "The kitchen lights are on. The front door is locked for the night."
COUNTED_OPS = FP32_OPS | INT8_OPS | {NBITS_OP, ATTENTION_OP}
RATES = Throughput(100e9, 400e9, 20e9, 10e9, 1)


def _configs() -> dict[str, dict[str, Any]]:
    """Configuration id -> EngineOptions fields, with ``preset``: the request options (their
    flow record and number reading are what the engine loads for)."""
    out: dict[str, dict[str, Any]] = {
        name: {"preset": options, "llm_graph": PRESET_LLM_GRAPHS[name]}
        for name, options in PRESETS.items()
    }
    for graph in typing.get_args(LlmGraph):
        if graph not in PRESET_LLM_GRAPHS.values():
            out[f"balanced-llm-{graph}"] = {"preset": PRESETS["balanced"], "llm_graph": graph}
    for precision in LLM_FILES:
        out[f"published-llm-{precision}"] = {"preset": PRESETS["fast"], "llm_graph": "published",
                                             "llm_precision": precision}
    out["windowed-vocoder"] = {"preset": PRESETS["balanced"], "llm_graph": "fused",
                               "stream_vocoder": False}
    # full attention in every chunk, through the streaming DiT of each precision
    out["full-attention-dit-fp32"] = {"preset": SynthesisOptions(), "llm_graph": "fused"}
    out["full-attention-dit-int8"] = {"preset": SynthesisOptions().replace(
        flow={"precision": "int8"}), "llm_graph": "fused"}
    return out


CONFIGS = _configs()


class RunLog(FixedDecoding):
    """Fixed decoding length plus every graph run: (path, input shapes)."""

    observes_graph_runs = True

    def __init__(self) -> None:
        super().__init__(tokens_per_char=0.5)
        self.runs: list[tuple[str, dict[str, list[int]]]] = []

    def graph_run(self, graph_path: str, feeds: Mapping[str, np.ndarray], start_s: float,
                  end_s: float) -> None:
        self.runs.append((graph_path, {k: [int(d) for d in np.shape(v)]
                                       for k, v in feeds.items()}))


@pytest.fixture
def opened_sessions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any]]]:
    """Every onnxruntime session made from a file while the test runs: (path, weak ref)."""
    opened: list[tuple[str, Any]] = []

    class Recording(ort.InferenceSession):  # type: ignore[misc]
        def __init__(self, path_or_bytes: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(path_or_bytes, *args, **kwargs)
            if isinstance(path_or_bytes, str | Path):
                opened.append((str(path_or_bytes), weakref.ref(self)))

    monkeypatch.setattr(ort, "InferenceSession", Recording)
    yield opened
    sessions.set_run_observer(None)


def _lookup_only(path: str) -> bool:
    proto = onnx.load(path, load_external_data=False)
    return not {node.op_type for node in proto.graph.node} & COUNTED_OPS


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_loaded_and_run_graph_is_counted(
    config: str, tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
    opened_sessions: list[tuple[str, Any]], caplog: pytest.LogCaptureFixture,
) -> None:
    log = RunLog()
    fields = dict(CONFIGS[config])
    preset: SynthesisOptions = fields.pop("preset")  # the requests' options; loading takes its flow
    with caplog.at_level(logging.WARNING):
        engine = CosyVoice3Engine.load(tiny_model_dir, EngineOptions(
            threads=1, spin_wait=False, cache_dir=tiny_engine_cache, observer=log,
            flow=preset.flow, read_numbers=preset.read_numbers, **fields))
    # every form asked for loaded: a derived form that fell back (one warning) is not tested
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    try:
        log.runs.clear()  # runs at load (the DiT's time conditioning) belong to no request
        clip = write_clip(tmp_path / "ref.wav", seconds=3.0)
        voice = engine.prepare_voice(clip, transcript="This is a reference clip.")
        preparation = list(log.runs)
        engine.warm_up(voice, preset)  # as the server does: no request computes time points
        log.runs[:] = preparation
        for streaming in (True, False):
            chunks = list(engine.synthesize(TEXT, voice, preset.replace(streaming=streaming)))
            assert chunks and chunks[-1].is_last
        gc.collect()
        loaded = {Path(path).name: Path(path) for path, ref in opened_sessions
                  if ref() is not None}
    finally:
        engine.close()
    # what is loaded now, and what ran (the voice encoders may be released by now)
    loaded.update({Path(path).name: Path(path) for path, _ in log.runs})
    costs = load_cost_models(loaded, tmp_path / "flop-cache.json")
    uncounted = {}
    for name, path in loaded.items():
        if family_of(name) is None:
            if not _lookup_only(str(path)):
                uncounted[name] = "no cost model, and it has operations the benchmark counts"
        elif not isinstance(costs[name], CostModel):
            uncounted[name] = costs[name]
    assert not uncounted, f"{config}: loaded graphs without an operation count: {uncounted}"
    # every run during the requests is counted, with operations
    stages = set()
    for path, shapes in log.runs:
        name = Path(path).name
        model = costs[name]
        if family_of(name) is None:
            continue  # a lookup (checked above)
        assert isinstance(model, CostModel)
        ops = model.ops(shapes)
        assert ops.fp32 + ops.int8 > 0, f"{name} counted 0 operations for {shapes}"
        stages.add(stage_of(name, shapes))
    assert {"llm_prefill", "llm_decode", "flow", "vocoder"} <= stages
    summary = graph_summary([{"graph_runs": [[Path(p).name, s, 0.0, 0.0] for p, s in log.runs]}],
                            costs, RATES)
    assert not any(row.get("uncounted_runs") for row in summary.values())
