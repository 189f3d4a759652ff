"""``python -m bench.dit_calls``: two streaming DiT main graphs timed call by call over a call
mix (BENCHMARKS.md "Streaming DiT graph"), on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import ensure_streaming_estimator


def test_two_graphs_over_a_call_mix_from_records(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path, tmp_path: Path
) -> None:
    from bench.dit_calls import main

    source = tiny_dit_model_dir / "flow.decoder.estimator.fp32.onnx"
    main_graph, _time = ensure_streaming_estimator(source, tiny_dit_cache_dir, "int8")
    # the mix as a server records it: graph file and input shapes per run (batch 2)
    records = tmp_path / "server.jsonl"
    runs = [[main_graph.name, {"x": [2, 80, f], "prompt_key_0": [2, 2, min(m, 200), 64],
                               "hist_key_0": [2, 2, max(0, m - 200), 64]}, 0.0, 0.1]
            for f, m in ((26, 200), (26, 200), (40, 226))]
    records.write_text(json.dumps({"kind": "request", "graph_runs": runs}) + "\n")
    out = tmp_path / "calls.json"
    assert main(["--model-dir", str(tiny_dit_model_dir), "--cache-dir", str(tiny_dit_cache_dir),
                 "--baseline-main", str(main_graph), "--records", str(records),
                 "--repeats", "2", "--threads", "1", "--throughput-seconds", "0.05",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["frames"], r["cached"], r["calls"]) for r in result["shapes"]] == [
        (26, 200, 2), (40, 226, 1)]
    for row in result["shapes"]:
        assert row["max_rel_diff"] == 0.0  # the same graph on the same inputs
        assert row["current_min_ms"] == row["baseline_min_ms"] > 0
        assert row["current_ms"] > 0 and row["current_ratio"] > 0
    total = result["total"]
    assert total["calls"] == 3
    assert total["current_min_s"] == pytest.approx(
        sum(r["calls"] * r["current_min_ms"] for r in result["shapes"]) / 1e3)


def test_profile_per_operator_type(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path, tmp_path: Path
) -> None:
    """``--profile``: kernel time per operator type of this tree's main graph per shape."""
    from bench.dit_calls import main

    out = tmp_path / "profile.json"
    assert main(["--model-dir", str(tiny_dit_model_dir), "--cache-dir", str(tiny_dit_cache_dir),
                 "--profile", "26,40", "--cached", "60", "--repeats", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["frames"] for s in result["shapes"]] == [26, 40]
    for shape in result["shapes"]:
        ops = {row["op"]: row for row in shape["ops"]}
        # the fused attention, one per block, and the int8 products are in every call
        assert ops["MultiHeadAttention"]["nodes"] >= 1
        assert shape["kernel_ms"] == pytest.approx(sum(r["ms"] for r in shape["ops"]))
        assert shape["wall_ms"] > 0
