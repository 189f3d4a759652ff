"""bench/vocoder_stream.py on the tiny-dit synthetic model: the product's streamed vocoder
(stream4, loaded by the engine's loaders) runs each mel frame once per flow chunk and matches
one call of the exact rewrite of hift.onnx it is validated against within 1e-4;
the tables carry their rows; the windowed fallback mode still counts its calls and re-run
frames."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import vocoder_stream

MAX_ABS = 1e-4
"""Streamed within 1e-4 max abs of one call over the same frames."""


def test_product_streamed_against_one_call(
    tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "voc.json"
    vocoder_stream.main(["--model-dir", str(tiny_dit_model_dir), "--cache-dir",
                         str(tiny_dit_cache_dir), "--frames", "90", "--rounds", "2",
                         "--json", str(out)])
    (cost,) = json.loads(out.read_text(encoding="utf-8"))
    # flow chunks of 90 frames from a 20-frame first hop: 20, 40, then the 30 left
    assert cost["chunks"] == [20, 40, 30]
    # the streamed form runs each frame once, one call per chunk (the re-running exact path
    # would run 20 + 60 + 90 = 170 frames)
    assert (cost["streamed_calls"], cost["streamed_frames_run"]) == (3, 90)
    assert cost["one_call_frames_run"] == 90
    assert ".exact-" in cost["one_call_graph"] and ".stream4-" in cost["streamed_graph"]
    assert sorted(p.name for p in tiny_dit_cache_dir.glob("hift.*.onnx")) == sorted(
        [cost["one_call_graph"], cost["streamed_graph"]])
    assert cost["max_abs"] <= MAX_ABS
    one, streamed = cost["one_call_cpu_s"], cost["streamed_cpu_s"]
    assert len(one) == len(streamed) == 2 and min(one + streamed) > 0
    ratios = [s / o for s, o in zip(streamed, one, strict=True)]
    assert cost["round_ratios"] == pytest.approx(ratios)
    assert cost["paired_ratio"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert cost["ratio_of_medians"] == pytest.approx(sum(streamed) / sum(one))

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Utterance 90 mel frames (1.80 s), flow chunks [20, 40, 30]")
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert rows["one call"].startswith("| one call | exact | 1 | 90 | ")
    assert rows["streamed per flow chunk"].startswith(
        "| streamed per flow chunk | stream4 | 3 | 90 | ")
    assert rows["CPU ratio, median of per-round ratios"].startswith(
        f"| CPU ratio, median of per-round ratios | {cost['paired_ratio']:.3f} ")
    assert f"| {cost['ratio_of_medians']:.3f} | <= 1.10 |" in rows["CPU ratio of the medians"]
    assert rows["max abs difference of the samples"] == (
        f"| max abs difference of the samples | {cost['max_abs']:.2e} | <= 1e-4 |")


def test_windowed_mode_counts_calls_and_rerun_frames(
    tiny_dit_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vocoder_stream.main(["--model-dir", str(tiny_dit_model_dir), "--windowed", "--frames",
                         "60", "--windows", "0", "8", "--policies", "per-chunk", "--rounds",
                         "1"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| one call") or line.startswith("| window")]
    # chunks 20, 40: the first call runs 20 frames and emits 12 (8 held back); the final call
    # runs all 60 (window 0) or the 8 emitted frames before the new ones, from frame 4 (56)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("| one call", "-", "1", "60"),
        ("| window all (exact)", "per-chunk", "2", "80"),
        ("| window 8", "per-chunk", "2", "76"),
    ]
    assert all(np.isfinite(float(r[4])) for r in rows)


def test_json_is_refused_with_windowed(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        vocoder_stream.main(["--model-dir", str(tmp_path), "--windowed", "--json",
                             str(tmp_path / "x.json")])
