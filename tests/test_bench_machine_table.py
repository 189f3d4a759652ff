"""The benchmark side of ``--preset auto``: graph runs sorted into the predictor's stages, the
work and efficiency counted from recorded runs, predicted against measured RTF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from machine_figures import AVX512

from bench import machine_table
from bench.costmodel import CostModel
from wyoming_cosyvoice3.engine.machine import LlmPlan, MachineRates, predict_rtf, predict_split

# LLM: 1 GOP int8 per new position, 0.5 GB of int8 weights; DiT: 2 GFLOP fp32 per frame
LLM = CostModel("llm", (0.0, 0.0, 0.0), (0.0, 1e9, 0.0), 0, 0, 5 * 10**8)
DIT = CostModel("stream_estimator", (0.0, 2e9, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0), 0, 0, 0)
COSTS = {"llm": LLM, "dit_int8": DIT, "flow_encoder": DIT, "hift": DIT}


def _llm(positions: int) -> dict:
    return {"inputs_embeds": [1, positions, 896], "attention_mask": [1, positions + 10],
            "position_ids": [1, positions]}


def test_runs_fall_into_the_predictors_stages() -> None:
    assert machine_table.stage_of("llm_int8.fused1-1-2.onnx", _llm(150)) == "llm_prefill"
    assert machine_table.stage_of("llm_int8.onnx", _llm(1)) == "llm_decode"
    assert machine_table.stage_of("flow.decoder.estimator.stream2int8main-1-2.onnx",
                                  {}) == "flow"
    assert machine_table.stage_of("flow_encoder.onnx", {}) == "flow"
    assert machine_table.stage_of("hift.stream2-1-2.onnx", {}) == "vocoder"
    assert machine_table.stage_of("speech_embedding.onnx", {}) is None


def test_work_sums_operations_and_streamed_weights_per_stage() -> None:
    stream = {"x": [2, 80, 50], "prompt_key_0": [2, 16, 100, 64]}
    record = {"graph_runs": [
        ["llm_int8.fused1-1-2.onnx", _llm(100), 0.0, 0.1],
        *[["llm_int8.fused1-1-2.onnx", _llm(1), 0.1, 0.2] for _ in range(25)],
        ["flow.decoder.estimator.stream2int8main-1-2.onnx", stream, 0.2, 0.5],
        ["text_embedding_fp16.onnx", {"input_ids": [1, 30]}, 0.0, 0.0],
    ]}
    work = machine_table.stage_work([record], COSTS)
    assert work["llm_prefill"] == [0.0, 100e9, 5e8]
    assert work["llm_decode"] == [0.0, 25e9, 25 * 5e8]
    assert work["flow"] == [2 * 2e9 * 50, 0.0, 0.0]  # batch 2 x 50 frames
    assert work["vocoder"] == [0.0, 0.0, 0.0]


def test_streamed_vocoder_counts_as_the_benchmark_counts_it() -> None:
    """The cost table counts a streamed vocoder run with the streamed graph's own cost model
    (bench.costmodel.fit_streamed_vocoder), as the benchmark's minimum does; without one, its
    calls of an utterance together are one call of hift.onnx over all their frames."""
    hift = CostModel("hift", (3e9, 2e9, 0.0), (0.0, 0.0, 0.0), 0, 8 * 10**7, 0)
    streamed = CostModel("hift_stream", (1e8, 5e9, 2e9), (0.0, 0.0, 0.0), 0, 8 * 10**7, 0)
    record = {"graph_runs": [
        ["hift.stream3-1-2.onnx", {"speech_feat": [1, 80, 10], "stream_state_in.0": [1, 8, 0],
                                   "stream_state_in.1": [1, 0, 9]}, 0.0, 0.1],
        ["hift.stream3-1-2.onnx", {"speech_feat": [1, 80, 20], "stream_state_in.0": [1, 8, 3],
                                   "stream_state_in.1": [1, 2, 9]}, 0.1, 0.2],
    ]}
    own = machine_table.stage_work([record], {**COSTS, "hift": hift, "hift_stream": streamed})
    assert own["vocoder"][0] == pytest.approx(2 * 1e8 + 5e9 + 2e9 * 30)
    approx = {**COSTS, "hift": hift, "hift_stream": machine_table.streamed_as_one_call(hift)}
    work = machine_table.stage_work([record], approx)
    assert work["vocoder"][0] == pytest.approx(hift.ops({"speech_feat": [1, 80, 30]}).fp32)
    # the windowed form: each call is a whole hift.onnx call
    windowed = {"graph_runs": [["hift.onnx", {"speech_feat": [1, 80, 10]}, 0.0, 0.1]]}
    assert machine_table.stage_work([windowed], approx)["vocoder"][0] == pytest.approx(23e9)


def _fake_run(out: Path, rtfs: list[float], probe: MachineRates, split: bool = False,
              timed: str | None = None) -> None:
    """A benchmark output whose one server logged ``probe`` and its LLM graphs at start (and,
    with ``split``, that it decodes beside the flow; with ``timed``, that its timed decode
    steps chose that graph)."""
    out.mkdir()
    server = {"preset": "balanced", "stats_file": "server-balanced.jsonl", "traces": []}
    (out / "raw.json").write_text(json.dumps({"servers": [server]}), "utf-8")
    split_line = ("2026-12-06 03:03:58,001 INFO y: split cores: LLM sessions 2 intra-op threads, "
                  "flow and vocoder sessions the same, none spinning\n") if split else ""
    (out / "server-balanced.log").write_text(
        f"2026-12-06 03:03:48,355 INFO x: machine probe: {json.dumps(probe.to_json())}\n"
        "2026-12-06 03:03:48,355 INFO x: LLM graphs for `balanced`: fused-b8, prefill fused "
        f"(fused-b8 decodes fastest; fused prefills 4.4x faster; fused timed at load)\n"
        + (f"2026-12-06 03:03:50,001 INFO z: LLM decode step timed at load (200 cached "
           f"positions, medians): fused-b8 24.1 ms, fused 22.0 ms; {timed} decodes\n"
           if timed else "") + split_line, "utf-8")
    cells = [{"preset": "balanced", "workload": "paragraph", "mode": "streaming",
              "runs": [{"rtf": r} for r in rtfs]},
             {"preset": "balanced", "workload": "sentence", "mode": "streaming",
              "runs": [{"rtf": 99.0}]}]
    (out / "results.json").write_text(json.dumps({"cells": cells}), "utf-8")


def test_the_decode_graph_is_the_one_the_timed_steps_chose(tmp_path: Path) -> None:
    # the timed steps keep the plan's graph, or take the prefill graph for decoding as well
    _fake_run(tmp_path / "kept", [1.0], AVX512, timed="fused-b8")
    _fake_run(tmp_path / "other", [1.0], AVX512, timed="fused")
    assert machine_table.server_probes(tmp_path / "kept")["balanced"][1] == LlmPlan(
        "fused-b8", "fused")
    assert machine_table.server_probes(tmp_path / "other")["balanced"][1] == LlmPlan(
        "fused", None)


def test_check_predicts_at_the_servers_probe_against_the_median_measured(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = LlmPlan("fused-b8", "fused")
    predicted = predict_rtf(AVX512, "balanced", plan)
    _fake_run(tmp_path / "near", [predicted * 1.2, predicted * 0.9, predicted * 1.1], AVX512)
    _fake_run(tmp_path / "far", [predicted * 2.0], AVX512)
    assert machine_table.server_probes(tmp_path / "near") == {
        "balanced": (AVX512, plan, False)}
    assert machine_table.main(["check", str(tmp_path / "near")]) == 0
    near = capsys.readouterr().out
    row = next(line for line in near.splitlines() if line.startswith("| balanced"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    parts = predict_split(AVX512, "balanced", plan)
    assert cells[2] == "fused-b8 (prefill fused)"
    assert cells[3] == f"{parts.llm_s:.2f} / {parts.stages_s:.2f}"
    assert cells[4] == f"{predicted:.2f}"
    assert cells[5] == f"{predicted * 1.1:.2f} (3)"  # the median of the three, not the sentence
    assert cells[6] == f"{1 / 1.1:.2f}" and cells[7] == "yes" and cells[8] == "-"
    machine_table.main(["check", str(tmp_path / "far")])
    assert "| 0.50 | no | - |" in capsys.readouterr().out


def test_check_predicts_a_split_server_with_the_overlap_and_fits_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = LlmPlan("fused-b8", "fused")
    parts = predict_split(AVX512, "balanced", plan)
    longer, shorter = max(parts.llm_s, parts.stages_s), min(parts.llm_s, parts.stages_s)
    measured = longer + 0.5 * shorter  # as if half the shorter kind added to the longer
    _fake_run(tmp_path / "split", [measured], AVX512, split=True)
    assert machine_table.server_probes(tmp_path / "split")["balanced"][2] is True
    machine_table.main(["check", str(tmp_path / "split")])
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("| balanced"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "fused-b8 (prefill fused), split cores"
    assert cells[4] == f"{predict_rtf(AVX512, 'balanced', plan, split_cores=True):.2f}"
    assert cells[8] == "0.50"


def test_full_costs_take_the_runs_streamed_vocoder_fit(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cost table's full-size models come from the efficiency run's flop cache, the
    streamed vocoder's included; a cache without one falls back to hift.onnx (with a note)."""
    streamed = CostModel("hift_stream", (1e8, 5e9, 2e9), (0.0, 0.0, 0.0), 0, 8 * 10**7, 0)
    cache = {"llm_int8.fused1-1-2.onnx:1:2:v2": LLM.to_json(),
             "flow.decoder.estimator.stream2int8main-1-2.onnx:1:2:v2": DIT.to_json(),
             "flow_encoder.onnx:1:2:v2": DIT.to_json(),
             "hift.stream3-1-2.onnx:1:2:v2": streamed.to_json()}
    run = tmp_path / "run"
    run.mkdir()
    (run / "flop-cache.json").write_text(json.dumps(cache), "utf-8")
    costs = machine_table.full_costs(tiny_model_dir, run)
    assert costs["hift_stream"] == streamed
    del cache["hift.stream3-1-2.onnx:1:2:v2"]
    (run / "flop-cache.json").write_text(json.dumps(cache), "utf-8")
    costs = machine_table.full_costs(tiny_model_dir, run)
    assert costs["hift_stream"] == machine_table.streamed_as_one_call(costs["hift"])
    assert "no streamed vocoder fit" in capsys.readouterr().err
