"""Run figures, medians, report tables and Wyoming client helpers of the benchmark."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from bench import report, throughput
from bench.client import text_deltas
from bench.costmodel import CostModel
from bench.stats import (
    RunTrace,
    graph_summary,
    median_run_index,
    medians,
    minimum_seconds,
    piece_starts_of,
    records_in_window,
    run_metrics,
    stage_split,
)
from bench.throughput import Throughput

RATES = Throughput(fp32_flops=100e9, int8_ops=400e9, fp32_bytes=20e9, int8_bytes=20e9,
                   threads=2)
# 1 GFLOP per estimator frame, 1 GB of fp32 weights; LLM int8: 1 GOP per token, 0.4 GB
ESTIMATOR = CostModel("estimator", (0.0, 0.5e9, 0.0), (0.0, 0.0, 0.0), 2, 10**9, 0)
LLM = CostModel("llm", (0.0, 0.0, 0.0), (0.0, 1e9, 0.0), 0, 0, 4 * 10**8)


def _record(start: float, end: float, runs: list) -> dict:
    return {"kind": "request", "wall_start_s": start, "wall_end_s": end,
            "times": {"llm_prefill_s": 0.5, "llm_decode_s": 2.0, "llm_tokens": 100,
                      "flow_s": 3.0, "flow_calls": 3, "vocoder_s": 0.6, "vocoder_calls": 3,
                      "frontend_s": 0.01, "events": [["llm", 0.0, 1.0]]},
            "graph_runs": runs}


def test_graph_minimum_is_the_larger_of_compute_and_weight_streaming() -> None:
    runs = [["flow.decoder.estimator.fp32.onnx", {"x": [2, 80, 1000]}, 100.0, 101.5],
            ["llm_int8.onnx", {"inputs_embeds": [1, 1, 896], "attention_mask": [1, 50]},
             101.5, 101.6],
            ["speech_embedding.onnx", {"input_ids": [1, 1]}, 101.6, 101.61]]
    costs = {"flow.decoder.estimator.fp32.onnx": ESTIMATOR, "llm_int8.onnx": LLM,
             "speech_embedding.onnx": "lookup-only"}
    summary = graph_summary([_record(100.0, 102.0, runs)], costs, RATES)
    est = summary["flow.decoder.estimator.fp32.onnx"]
    # compute 1000 GFLOP / 100 GFLOP/s = 10 s > 1 GB / 20 GB/s = 0.05 s
    assert est["fp32_ops"] == pytest.approx(1000e9) and est["min_s"] == pytest.approx(10.0)
    assert est["seconds"] == pytest.approx(1.5)
    # LLM step: compute 1 GOP / 400 GOP/s = 2.5 ms < 0.4 GB / 20 GB/s = 20 ms (memory-bound)
    llm = summary["llm_int8.onnx"]
    assert llm["min_s"] == pytest.approx(0.02) and llm["compute_s"] == pytest.approx(0.0025)
    assert summary["speech_embedding.onnx"]["min_s"] == 0.0
    # LLM weight streaming may overlap the flow's compute: the bound is all compute
    # (10 s + 2.5 ms), not the sum of per-graph minima (10 s + 20 ms)
    assert minimum_seconds(summary) == pytest.approx(10.0025)
    assert minimum_seconds({"a": {"compute_s": 1.0, "memory_s": 0.5, "min_s": 1.0},
                            "b": {"compute_s": 0.2, "memory_s": 1.0, "min_s": 1.0}}) == 1.5
    assert minimum_seconds({}) == 0.0
    early = graph_summary([_record(100.0, 102.0, runs)], costs, RATES, until_wall_s=101.55)
    assert set(early) == {"flow.decoder.estimator.fp32.onnx"}


def test_run_metrics_join_client_and_server() -> None:
    trace = RunTrace("balanced", "sentence", "streaming", wall_start_s=100.0, total_s=4.0,
                     chunks=[(1.0, 24000), (3.0, 24000), (3.5, 48000)])
    runs = [["flow.decoder.estimator.fp32.onnx", {"x": [2, 80, 100]}, 100.1, 100.9]]
    metrics = run_metrics(trace, [_record(100.0, 104.0, runs)],
                          {"flow.decoder.estimator.fp32.onnx": ESTIMATOR}, RATES)
    assert metrics["first_chunk_s"] == 1.0 and metrics["audio_s"] == 4.0
    assert metrics["rtf"] == pytest.approx(1.0)
    assert metrics["stalls"] == 1 and metrics["stall_s"] == pytest.approx(1.0)
    assert metrics["min_s"] == pytest.approx(1.0)  # 100 GFLOP at 100 GFLOP/s
    assert metrics["physical_ratio"] == pytest.approx(4.0)
    assert metrics["first_chunk_physical_ratio"] == pytest.approx(1.0)
    assert metrics["llm_ms_per_token"] == pytest.approx(20.0)
    assert metrics["flow_s_per_chunk"] == pytest.approx(1.0)


def test_records_in_window_and_stage_split() -> None:
    records = [_record(1.0, 4.0, []), _record(5.0, 6.0, []), {"kind": "voice",
               "wall_start_s": 5.0, "wall_end_s": 5.5}, _record(7.93, 10.0, []),
               _record(3.97, 4.5, [])]
    # the first record still ran when the window opened but belongs to an earlier request;
    # 7.93 starts 30 ms after the client's request ended (the next request); 3.97 started
    # just before the client's clock read 4.0 (clock slack at the start only)
    chosen = records_in_window(records, 4.0, 7.9)
    assert chosen == [records[1], records[4]]
    split = stage_split(records[:2])
    assert split["llm_tokens"] == 200 and split["llm_ms_per_token"] == pytest.approx(20.0)


def test_medians_and_median_run() -> None:
    runs = [{"total_s": 3.0, "first_chunk_s": None, "rtf": 1.0, "error": None},
            {"total_s": 1.0, "first_chunk_s": 0.5, "rtf": 2.0, "error": None},
            {"total_s": 2.0, "first_chunk_s": 0.7, "rtf": 3.0, "error": None}]
    m = medians(runs)
    assert m["total_s"] == 2.0 and m["first_chunk_s"] == pytest.approx(0.6)
    assert m["error"] is None and m["n"] == 3
    assert median_run_index(runs) == 2


def test_markdown_section_is_replaced_in_place() -> None:
    doc = "# Title\n\nintro\n"
    once = report.replace_section(doc, "full", "table 1")
    assert once.startswith(doc.rstrip()) and "table 1" in once
    twice = report.replace_section(once + "\nafter\n", "full", "table 2")
    assert "table 1" not in twice and "table 2" in twice and twice.endswith("after\n")
    assert twice.count("<!-- bench:full:begin -->") == 1
    both = report.replace_section(twice, "tiny", "smoke")
    assert "table 2" in both and "smoke" in both


def test_pauses_are_split_by_the_servers_piece_record(tmp_path) -> None:
    from bench.plot import pause_spans
    from bench.recorder import StatsRecorder
    from bench.run_helpers import read_records

    # pieces start at 0 s and 2 s of audio; dry before the 2 s chunk (between pieces) and
    # before the 3 s chunk (inside the second piece)
    trace = RunTrace("balanced", "paragraph", "streaming", wall_start_s=100.0, total_s=7.0,
                     chunks=[(1.0, 24000), (2.0, 24000), (3.5, 24000), (5.0, 24000)])
    recorder = StatsRecorder(tmp_path / "stats.jsonl")
    recorder.response_pieces([0, 48000], 96000)
    records = [{**r, "wall_end_s": 106.0} for r in read_records(tmp_path / "stats.jsonl")]
    assert records[0]["kind"] == "pieces" and "graph_runs" not in records[0]
    assert piece_starts_of(trace, records) == [0, 48000]
    # a record of another response (other sample count, or outside the window) is not used
    assert piece_starts_of(trace, [{**records[0], "samples": 24000}]) is None
    assert piece_starts_of(trace, [{**records[0], "wall_end_s": 99.0}]) is None
    metrics = run_metrics(trace, [], {}, RATES, piece_starts=[0, 48000])
    assert metrics["between_stalls"] == 1 and metrics["between_stall_s"] == pytest.approx(0.5)
    assert metrics["inside_stalls"] == 1 and metrics["inside_stall_s"] == pytest.approx(0.5)
    assert metrics["listening_s"] == pytest.approx(1.0 + 4.0 + 1.0)
    assert metrics["gap_between"] == [True, False]
    spans = pause_spans(metrics["stall_gaps"], metrics["gap_between"])
    assert spans["between"] == [(3.0, 0.5)] and spans["inside"] == [(4.5, 0.5)]
    unknown = run_metrics(trace, [], {}, RATES)
    assert unknown["inside_stalls"] is None and unknown["stalls"] == 2
    assert pause_spans(unknown["stall_gaps"], unknown["gap_between"])["unknown"]
    table = report.results_table([{"preset": "fast", "workload": "paragraph",
                                   "mode": "streaming", "median": medians([metrics])}])
    assert "| 1.0 / 0.50 | 1.0 / 0.50 | 6.00 |" in table


def test_results_table_renders_missing_values() -> None:
    median = dict.fromkeys(["first_chunk_s", "total_s", "audio_s", "rtf", "stalls", "stall_s",
                            "llm_prefill_s", "llm_ms_per_token", "flow_s_per_chunk",
                            "flow_calls", "vocoder_s", "min_s", "physical_ratio",
                            "first_chunk_physical_ratio"])
    median["n"] = 3.0
    median["rtf"] = 0.123
    table = report.results_table([{"preset": "fast", "workload": "sentence", "mode": "one-shot",
                                   "median": median}])
    row = table.splitlines()[-1]
    assert row.startswith("| fast | sentence | one-shot | 3 | - |") and "0.12" in row


def test_text_deltas_cover_the_text() -> None:
    text = "Hello there, general Kenobi."
    pieces = text_deltas(text, 4)
    assert "".join(pieces) == text and max(map(len, pieces)) == 4
    with pytest.raises(ValueError):
        text_deltas(text, 0)


def test_throughput_graphs_compute_what_they_claim() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 32), dtype=np.float32)
    fp32 = ort.InferenceSession(throughput._fp32_graph(32, 16, np.random.default_rng(1)))
    weight = np.random.default_rng(1).standard_normal((32, 16), dtype=np.float32) * 0.02
    np.testing.assert_allclose(fp32.run(None, {"a": a})[0], a @ weight, rtol=1e-4, atol=1e-5)
    int8 = ort.InferenceSession(throughput._int8_graph(32, 16, np.random.default_rng(1)))
    w8 = np.random.default_rng(1).integers(-63, 64, size=(32, 16), dtype=np.int8)
    expected = a @ (w8.astype(np.float32) * 0.01)
    got = int8.run(None, {"a": a})[0]
    # only the activations are quantised (8 bits): error well below 2 % of the range
    assert np.abs(got - expected).max() < 0.02 * np.abs(expected).max()
    best = Throughput.best(RATES, Throughput(1.0, 1e12, 1.0, 1.0, 2))
    assert best.fp32_flops == RATES.fp32_flops and best.int8_ops == 1e12


def test_graph_lanes_merge_close_runs_per_lane() -> None:
    from bench.plot import graph_lanes, lane_of

    runs = [["llm_int8.onnx", {}, 10.0, 10.1], ["llm_int8.onnx", {}, 10.105, 10.2],
            ["flow.decoder.estimator.int8r2-1-2.onnx", {}, 10.15, 11.0],
            ["llm_int8.onnx", {}, 10.5, 10.6], ["hift.onnx", {}, 11.0, 11.2]]
    lanes = sorted(graph_lanes(10.0, [{"graph_runs": runs}]))
    assert lanes == [("flow", pytest.approx(0.15), pytest.approx(1.0)),
                     ("llm", 0.0, pytest.approx(0.2)),
                     ("llm", pytest.approx(0.5), pytest.approx(0.6)),
                     ("vocoder", pytest.approx(1.0), pytest.approx(1.2))]
    assert lane_of("campplus.onnx") == "other"
