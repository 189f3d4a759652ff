"""Each stage's measured seconds against its minimum at the measured rates:
LLM prefill, LLM decoding, flow, vocoder, in the run figures, the medians and the markdown."""

from __future__ import annotations

from typing import Any

import pytest

from bench import report
from bench.costmodel import CostModel, stage_of
from bench.stats import RunTrace, run_metrics, stage_summary
from bench.throughput import Throughput

RATES = Throughput(fp32_flops=100e9, int8_ops=400e9, fp32_bytes=20e9, int8_bytes=10e9,
                   threads=2)
LLM = CostModel("llm", (0.0, 0.0, 0.0), (0.0, 1e9, 0.0), 0, 0, 10**9)  # 1 GB int8 weights
DIT = CostModel("stream_estimator", (0.0, 1e9, 0.0, 0.0), (0.0,) * 4, 0, 0, 0)
VOC = CostModel("hift_stream", (0.0, 1e9, 2e9), (0.0, 0.0, 0.0), 0, 10**8, 0)
COSTS: dict[str, CostModel | str] = {"llm_int8.fused1-1-2.onnx": LLM,
                                     "flow.decoder.estimator.stream2int8main-1-2.onnx": DIT,
                                     "hift.stream3-1-2.onnx": VOC,
                                     "text_embedding_fp16.onnx": "no cost model"}


def _llm(positions: int) -> dict[str, list[int]]:
    return {"inputs_embeds": [1, positions, 896], "attention_mask": [1, positions + 10]}


def _record() -> dict[str, Any]:
    return {
        "kind": "request", "wall_start_s": 100.0,
        "times": {"llm_prefill_s": 0.5, "llm_decode_s": 3.0, "flow_s": 2.0, "vocoder_s": 0.9},
        "graph_runs": [
            ["text_embedding_fp16.onnx", {"input_ids": [1, 30]}, 100.0, 100.01],
            ["llm_int8.fused1-1-2.onnx", _llm(40), 100.0, 100.4],               # prefill
            *[["llm_int8.fused1-1-2.onnx", _llm(1), 100.5, 100.6]] * 20,        # decode
            ["flow.decoder.estimator.stream2int8main-1-2.onnx",
             {"x": [2, 80, 50], "prompt_key_0": [2, 2, 0, 64]}, 101.0, 101.9],
            ["hift.stream3-1-2.onnx", {"speech_feat": [1, 80, 10], "stream_state_in.0": [1, 8, 0]},
             102.0, 102.5],
            ["hift.stream3-1-2.onnx", {"speech_feat": [1, 80, 5], "stream_state_in.0": [1, 8, 2]},
             102.5, 102.9],
        ],
    }


def test_stage_summary_sets_each_stage_against_its_minimum() -> None:
    stages = stage_summary([_record()], COSTS, RATES)
    assert list(stages) == ["llm_prefill", "llm_decode", "flow", "vocoder"]
    # prefill: 40 GOP int8 at 400 GOP/s = 0.1 s against 1 GB at 10 GB/s = 0.1 s
    assert stages["llm_prefill"]["min_s"] == pytest.approx(0.1)
    # decode: per token 1 GB at 10 GB/s (memory-bound), 20 tokens
    assert stages["llm_decode"]["min_s"] == pytest.approx(2.0)
    assert stages["llm_decode"]["ratio"] == pytest.approx(3.0 / 2.0)
    assert stages["llm_decode"]["runs"] == 20
    # flow: 2 x 50 x 1 GFLOP at 100 GFLOP/s
    assert stages["flow"]["min_s"] == pytest.approx(1.0)
    # vocoder: (1 + 2 x 10) + 2 x 5 GFLOP = 31 GFLOP fp32 at 100 GFLOP/s
    assert stages["vocoder"]["fp32_gops"] == pytest.approx(31.0)
    assert stages["vocoder"]["min_s"] == pytest.approx(0.31)
    assert stages["vocoder"]["ratio"] == pytest.approx(0.9 / 0.31)
    assert stages["vocoder"]["measured_s"] == 0.9
    assert stage_of("text_embedding_fp16.onnx", {}) is None
    assert stage_of("flow.decoder.estimator.stream1time-1-2.onnx", {}) is None


def test_run_metrics_and_markdown_carry_the_stages() -> None:
    trace = RunTrace("balanced", "paragraph", "streaming", 100.0, total_s=6.0,
                     chunks=[(1.0, 24000 * 8)])
    metrics = run_metrics(trace, [_record()], COSTS, RATES)
    assert metrics["vocoder_min_s"] == pytest.approx(0.31)
    assert metrics["llm_decode_ratio"] == pytest.approx(1.5)
    assert metrics["stages_min_s"] == pytest.approx(0.1 + 2.0 + 1.0 + 0.31)
    assert metrics["stages"]["flow"]["measured_s"] == 2.0
    cell = {"preset": "balanced", "workload": "paragraph", "mode": "streaming",
            "median": {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}}
    table = report.stages_table([cell])
    row = table.splitlines()[2]
    assert "| 3.00 / 2.00 (1.5) |" in row and "| 0.90 / 0.31 (2.9) |" in row
