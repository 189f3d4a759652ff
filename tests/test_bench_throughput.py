"""The weight-streaming rate is a memory rate: before each timed one-row run a
buffer twice the last-level cache is read in every thread; the size rule, the order of
eviction and run, and that measure() uses them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import throughput


def _cache_tree(root: Path, caches: list[tuple[int, str, str]]) -> Path:
    for i, (level, kind, size) in enumerate(caches):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_eviction_reads_twice_the_last_level_cache(tmp_path: Path) -> None:
    xeon = _cache_tree(tmp_path / "xeon", [(1, "Data", "48K"), (1, "Instruction", "32K"),
                                           (2, "Unified", "2048K"), (3, "Unified", "307200K")])
    assert throughput.last_level_cache_bytes(xeon) == 300 << 20
    assert throughput.eviction_bytes(300 << 20) == 600 << 20
    # no L3 (e.g. a Raspberry Pi 4): its L2; small caches still read 64 MiB
    pi = _cache_tree(tmp_path / "pi", [(1, "Data", "32K"), (1, "Instruction", "48K"),
                                       (2, "Unified", "1024K")])
    assert throughput.last_level_cache_bytes(pi) == 1 << 20
    assert throughput.eviction_bytes(1 << 20) == 64 << 20
    # unknown (no sysfs, unreadable sizes): a generous default
    broken = _cache_tree(tmp_path / "broken", [(3, "Unified", "lots")])
    assert throughput.last_level_cache_bytes(broken) is None
    assert throughput.last_level_cache_bytes(tmp_path / "none") is None
    assert throughput.eviction_bytes(None) == 512 << 20
    assert throughput.eviction_bytes(None) > throughput.eviction_bytes(200 << 20)


def test_every_timed_one_row_run_follows_an_eviction() -> None:
    events: list[str] = []
    throughput.best_cold_seconds(lambda: events.append("run"), lambda: events.append("evict"),
                                 budget_s=0.0, min_reps=4)
    assert events == ["evict", "run"] * 5  # one untimed, four timed


def test_evictor_reads_a_written_buffer_in_every_thread() -> None:
    evict = throughput.Evictor(10 << 20, threads=3)
    assert evict.buffer.nbytes == 10 << 20 and bool(evict.buffer.all())  # no shared zero page
    assert [p.nbytes for p in evict.parts] == [len(p) for p in np.array_split(evict.buffer, 3)]
    assert sum(p.nbytes for p in evict.parts) == evict.buffer.nbytes
    evict()


def test_measure_evicts_this_machines_cache_before_streaming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """measure() sizes the eviction from the machine's cache, evicts before each timed
    one-row run (never before a compute-bound one), and records what it read."""
    made: list[tuple[int, int]] = []
    calls: list[str] = []

    class Spy(throughput.Evictor):
        def __init__(self, size: int, threads: int) -> None:
            made.append((size, threads))
            super().__init__(size, threads)

        def __call__(self) -> None:
            calls.append("evict")
            super().__call__()

    monkeypatch.setattr(throughput, "Evictor", Spy)
    monkeypatch.setattr(throughput, "last_level_cache_bytes", lambda: 4 << 20)
    monkeypatch.setattr(throughput, "COMPUTE_SHAPE", (8, 64, 32))
    monkeypatch.setattr(throughput, "STREAM_SHAPE", (64, 128))
    monkeypatch.setattr(throughput, "MIN_EVICT_BYTES", 1 << 20)
    rates = throughput.measure(1, seconds_each=0.0)
    assert made == [(8 << 20, 1), (8 << 20, 1)]  # fp32 and int8 streaming
    assert rates.evict_bytes == 8 << 20
    assert calls.count("evict") >= 2 * (1 + 3)  # the untimed first run and 3 timed, each
    assert all(r > 0 for r in (rates.fp32_flops, rates.int8_ops, rates.fp32_bytes,
                               rates.int8_bytes))
    # no eviction asked: the old, cached measurement
    made.clear()
    assert throughput.measure(1, seconds_each=0.0, evict_bytes=0).evict_bytes == 0
    assert made == []


def test_report_only_analyses_at_rates_measured_apart(tmp_path: Path) -> None:
    """``--report-only --rates-file``: a run measured with cached weights is analysed again at
    rates measured with eviction; the run's own samples stay in results.json."""
    import json

    from bench import cli

    cached = {"fp32_flops": 3e11, "int8_ops": 2e12, "fp32_bytes": 4e10, "int8_bytes": 4.3e10,
              "threads": 2}
    out = tmp_path / "out"
    out.mkdir()
    raw = {"command": "python -m bench", "rates": {"samples": [cached]}, "servers": [
        {"preset": "balanced", "stats_file": "server-balanced.jsonl", "traces": []}]}
    (out / "raw.json").write_text(json.dumps(raw), encoding="utf-8")
    evicted = throughput.Throughput(3e11, 2e12, 2e10, 2e10, 2, 600 << 20).to_json()
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps([evicted]), encoding="utf-8")
    assert cli.main(["--model-dir", str(tmp_path), "--out", str(out), "--report-only",
                     "--markdown", "", "--plots-dir", str(tmp_path / "plots"),
                     "--rates-file", str(rates)]) == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert result["rates"]["used"] == evicted
    assert result["rates"]["run_samples"] == [cached]
    assert json.loads((out / "raw.json").read_text(encoding="utf-8")) == raw  # untouched
