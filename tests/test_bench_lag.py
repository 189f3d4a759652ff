"""``bench.lag``: the earliest pause-free start of each request, from a server's records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lag import main, read_lags, request_lag


def _request(audio_s: float, calls: list[tuple[float, int]], chars: int = 60) -> dict[str, object]:
    """A server's request record that began at 100.0 s and ran the vocoder calls
    ``(end s, mel frames)`` with a flow call between (not a vocoder call)."""
    runs: list[list[object]] = [["flow.decoder.estimator.x.onnx", {"x": [2, 80, 50]}, 100.1, 100.4]]
    runs += [["/cache/hift.stream4-1-2.onnx", {"speech_feat": [1, 80, frames]}, end - 0.1, end]
             for end, frames in calls]
    return {"kind": "request", "chars": chars, "pieces": 1, "wall_start_s": 100.0,
            "wall_end_s": 103.0, "audio_s": audio_s, "total_s": 3.0, "graph_runs": runs}


def test_the_latest_chunk_against_the_audio_before_it_sets_the_start() -> None:
    # chunks of 10, 20, 20 frames (0.2, 0.4, 0.4 s) made 0.5, 1.0 and 2.5 s in: a listener
    # starting at T hears them on time when 0.5 <= T, 1.0 <= T + 0.2, 2.5 <= T + 0.6
    lag = request_lag(_request(1.0, [(100.5, 10), (101.0, 20), (102.5, 20)]))
    assert lag is not None
    assert lag.start_s == pytest.approx(1.9)
    assert lag.listening_s == pytest.approx(2.9)
    # the frames scaled to the request's audio (a windowed vocoder counts context frames):
    # 2 s over 50 frames is 0.04 s a frame, so 2.5 <= T + 1.2
    wide = request_lag(_request(2.0, [(100.5, 10), (101.0, 20), (102.5, 20)]))
    assert wide is not None and wide.start_s == pytest.approx(1.3)
    # the first chunk binds when the rest follow in time; calls are taken in time order
    early = request_lag(_request(1.0, [(101.1, 20), (100.8, 10), (101.3, 20)]))
    assert early is not None and early.start_s == pytest.approx(0.9)
    assert request_lag(_request(0.0, [])) is None


def test_the_tool_reads_a_runs_server_records(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"kind": "voice", "name": "bench"},
               _request(0.4, [(100.6, 20)], chars=6),
               _request(1.0, [(100.5, 10), (101.0, 20), (102.5, 20)]),
               {"kind": "pieces", "starts": [0], "samples": 24000}]
    (tmp_path / "server-fast.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    assert [lag.chars for lag in read_lags(tmp_path / "server-fast.jsonl")] == [6, 60]
    assert [lag.chars for lag in read_lags(tmp_path / "server-fast.jsonl", 0.5)] == [60]
    assert main([str(tmp_path), "--min-audio-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fast: earliest pause-free start 1.90 s (median 1.90)")
    assert "shortest listening median 2.90 s" in out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
