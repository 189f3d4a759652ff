"""``bench.overlap``: graph runs alone and beside the other kind of work, from server records."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.overlap import Overlap, main, read_overlap, report

STEP = ["/cache/llm_int8.fusedb8r2-1-2.onnx",
        {"inputs_embeds": [1, 1, 896], "attention_mask": [1, 1], "position_ids": [1, 1]}]
PREFILL = ["/cache/llm_int8.fused2-1-2.onnx",
           {"inputs_embeds": [1, 15, 896], "attention_mask": [1, 16], "position_ids": [1, 15]}]
DIT = ["/cache/flow.decoder.estimator.stream3int8main-1-2.onnx",
       {"x": [2, 80, 40], "hist_key_0": [1, 2, 26, 64]}]
ENCODER = ["/cache/flow_encoder.onnx", {"token": [1, 116]}]
VOCODER = ["/cache/hift.stream4-1-2.onnx", {"speech_feat": [1, 80, 40]}]
VOCODER_20 = ["/cache/hift.stream4-1-2.onnx", {"speech_feat": [1, 80, 20]}]


def _runs(graph: Sequence[object], *spans: tuple[float, float]) -> list[list[object]]:
    return [[*graph, 100.0 + a, 100.0 + b] for a, b in spans]


def _answer() -> dict[str, object]:
    """A 4 s answer: decode steps of 20, 20 and 26 ms alone, five 40 ms steps beside a 200 ms DiT
    call, three 100 ms DiT calls alone (a prefill beside the last of them), a 100 ms vocoder
    call alone, then a step and a vocoder call of another size that overlap by 40 % and 20 %
    of their durations (neither alone nor beside). The flow's encoder runs beside the last
    lone step."""
    runs = (_runs(STEP, (0.00, 0.02), (0.02, 0.04), (0.04, 0.066))
            + _runs(ENCODER, (0.05, 0.06))
            + _runs(DIT, (0.10, 0.30))
            + _runs(STEP, (0.10, 0.14), (0.14, 0.18), (0.18, 0.22), (0.22, 0.26), (0.26, 0.30))
            + _runs(DIT, (0.40, 0.50), (0.50, 0.60), (0.60, 0.70))
            + _runs(PREFILL, (0.45, 0.50))
            + _runs(VOCODER, (0.70, 0.80))
            + _runs(STEP, (0.95, 1.00))
            + _runs(VOCODER_20, (0.98, 1.08)))
    return {"kind": "request", "chars": 60, "pieces": 1, "wall_start_s": 100.0,
            "audio_s": 4.0, "total_s": 1.1, "graph_runs": runs}


def _warm_up() -> dict[str, object]:
    """A 0.5 s answer whose three decode steps took 100 ms each, alone."""
    return {"kind": "request", "chars": 6, "pieces": 1, "wall_start_s": 100.0, "audio_s": 0.5,
            "total_s": 0.4, "graph_runs": _runs(STEP, (0.0, 0.1), (0.1, 0.2), (0.2, 0.3))}


def _write(path: Path, *records: dict[str, object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def _durations_ms(overlap: Overlap, label: str, kind: str) -> list[float]:
    keys = [k for k, v in overlap.labels.items() if v == label]
    assert len(keys) == 1, (label, overlap.labels)
    return sorted(round(s * 1000, 6) for s in overlap.runs[keys[0]][kind])


def test_runs_are_sorted_by_how_much_the_other_kind_of_work_covered_them(
        tmp_path: Path) -> None:
    overlap = read_overlap(_write(tmp_path / "server-a.jsonl", _answer()))
    step = "decode step, 1 row(s)"
    # the encoder and the prefill are not counted: the lone steps and DiT calls stay alone
    assert _durations_ms(overlap, step, "alone") == [20.0, 20.0, 26.0]
    assert _durations_ms(overlap, step, "beside") == [40.0] * 5
    assert _durations_ms(overlap, "DiT, 40 frames, 26 history", "alone") == [100.0] * 3
    assert _durations_ms(overlap, "DiT, 40 frames, 26 history", "beside") == [200.0]
    assert _durations_ms(overlap, "vocoder, 40 frames", "alone") == [100.0]
    # 40 % and 20 % covered: neither
    assert _durations_ms(overlap, "vocoder, 20 frames", "alone") == []
    assert _durations_ms(overlap, "vocoder, 20 frames", "beside") == []
    # beside, each kind ran at half its alone speed: 5 steps of 20 ms alone (the median)
    # took 200 ms, and
    # a 100 ms DiT call took 200 ms (the vocoder was not measured both ways)
    assert overlap.share("decoding") == pytest.approx(0.5)
    assert overlap.share("flow and vocoder") == pytest.approx(0.5)
    # alone: the lone steps as they ran (66 ms), the 6 others at the 20 ms median; 4 DiT
    # calls of 100 ms; the 40-frame vocoder call as run and the 20-frame one, never run
    # alone, at the flow and vocoder's share of its 100 ms
    assert overlap.alone_equivalent_s("llm_decode") == (pytest.approx(0.186), 0)
    assert overlap.alone_equivalent_s("flow") == (pytest.approx(0.4), 0)
    assert overlap.alone_equivalent_s("vocoder") == (pytest.approx(0.15), 1)
    assert overlap.alone_equivalent_s("vocoder", min_audio_s=5.0) is None
    # as run: 66 + 5 x 40 + 50 ms of steps; 200 + 3 x 100 ms of DiT calls
    assert overlap.ran_s("llm_decode") == pytest.approx(0.316)
    assert overlap.ran_s("flow") == pytest.approx(0.5)
    assert overlap.ran_s("flow", min_audio_s=5.0) is None


def test_the_tool_reads_a_runs_server_records(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "server-fast.jsonl", {"kind": "voice", "name": "bench"}, _warm_up(),
           _answer())
    # with the warm-up's 100 ms steps the lone steps' median would be 60 ms
    with_warm_up = read_overlap(tmp_path / "server-fast.jsonl")
    assert _durations_ms(with_warm_up, "decode step, 1 row(s)", "alone") == (
        [20.0, 20.0, 26.0, 100.0, 100.0, 100.0])
    assert main([str(tmp_path), "--min-runs", "1", "--stages-min-audio-s", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "fast:"
    assert "  decode step, 1 row(s): alone 20.0 ms (3), beside 40.0 ms (5), 2.00x" in out
    assert "  DiT, 40 frames, 26 history: alone 100.0 ms (3), beside 200.0 ms (1), 2.00x" in out
    assert not any(line.startswith("  vocoder, ") for line in out)
    assert ("  share of the alone speed kept beside: decoding 0.50, flow and vocoder 0.50; "
            "together 1.00 machines") in out
    assert any(line.startswith("  llm_decode: 0.32 s as run, 0.19 s alone") for line in out)
    assert report("x", Overlap())[1] == (
        "  share of the alone speed kept beside: not measured both ways")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
