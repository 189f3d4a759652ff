"""The benchmark harness's comparison mode (``--baseline-src``, ``--variant``) through real
servers on the tiny model: every server of a preset is alive at once and the measured requests
alternate between them, so machine noise falls on every row alike; halfway through the runs
they all start again in the reverse order, so the start position does too."""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import numpy as np
from server_support import link_engine_cache

from bench import cli
from bench.run_helpers import read_records
from bench.server import ServerProcess

REPO = Path(__file__).resolve().parents[1]


def _clip(path: Path, seconds: float = 3.0) -> Path:
    rng = np.random.default_rng(5)
    samples = (0.2 * rng.standard_normal(int(16000 * seconds))).clip(-1, 1)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((samples * 32767).astype("<i2").tobytes())
    return path


def test_baseline_and_variant_alternate_with_this_tree(tiny_model_dir: Path,
                                                       tiny_engine_cache: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the three servers' data dirs (this tree's, the baseline's, the variant's) read their
    # derived graphs from the session's engine cache instead of each trying every derivation
    # of the tiny model (child processes, seconds each) at its first start
    for data in ("data", "data-baseline", "data-hop4"):
        link_engine_cache(out / data, tiny_engine_cache)
    # a baseline tree: this package and benchmark copied, its version marked so that the log
    # shows which tree the server imported (a server started in this repository's directory
    # imports the repository's package first: python -m puts the working directory before
    # PYTHONPATH)
    baseline = tmp_path / "baseline-src"
    for folder in ("wyoming_cosyvoice3", "bench"):
        shutil.copytree(REPO / folder, baseline / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    init = baseline / "wyoming_cosyvoice3" / "__init__.py"
    text = init.read_text(encoding="utf-8")
    assert "__version__ = " in text
    init.write_text(text.replace("__version__ = ", "__version__ = '9.9.9-baseline' or ", 1),
                    encoding="utf-8")
    argv = ["--model-dir", str(tiny_model_dir), "--voice-clip", str(_clip(tmp_path / "v.wav")),
            "--voice-seconds", "2", "--out", str(out), "--presets", "fast",
            "--workloads", "sentence", "--modes", "one-shot,streaming",
            "--skip-cells", "sentence:streaming", "--runs", "2", "--threads", "1",
            "--throughput-seconds", "0.05",
            # the baseline: another source tree run through PYTHONPATH (a checkout of an older
            # commit in real use); the variant changes one preset field through the server
            "--baseline-src", str(baseline),
            "--variant", "hop4:--bench-synthesis-options=first_hop_tokens=4"]
    args = cli.build_parser().parse_args(argv)
    raw = cli._collect(args, argv, ["fast"], ["sentence"], ["one-shot", "streaming"])
    labels = [s["preset"] for s in raw["servers"]]
    assert labels == ["fast", "fast (baseline)", "fast (hop4)"]
    by_label = {s["preset"]: s for s in raw["servers"]}
    for label, server in by_label.items():
        traces = server["traces"]
        assert [(t["workload"], t["mode"]) for t in traces] == [("sentence", "one-shot")] * 2
        for t in traces:
            assert t["error"] is None, label
            assert abs(sum(n for _, n in t["chunks"]) / t["sample_rate_hz"] - 4.0) < 0.05
        # the fixed decoding length and the stats file reached every server (through
        # bench.serve's flags and the server's hooks): stage times and graph runs per request,
        # and one pieces record per response the client received (warm-up + 2)
        records = read_records(out / server["stats_file"])
        requests = [r for r in records if r.get("kind") == "request"]
        # per life (two: a restart halfway) the server's own warm-up and the harness's, then
        # one run
        assert len(requests) >= 6, label
        assert all(r["graph_runs"] and r["times"]["llm_tokens"] > 0 for r in requests), label
        # the vocoder ran (hift.onnx or a form derived from it, e.g. the streamed one)
        assert any(run[0].startswith("hift.") for r in requests for run in r["graph_runs"]), label
        pieces = [r for r in records if r.get("kind") == "pieces"]
        assert len(pieces) == 4, label  # per life the harness's warm-up and one run
        sent = {sum(n for _, n in t["chunks"]) for t in traces}  # what the client received
        assert all(p["starts"][0] == 0 and p["samples"] in sent for p in pieces), label
        assert server["command"].split()[1:3] == ["-m", "bench.serve"], label
        assert "--bench-tokens-per-char 1.66667" in server["command"], label
    assert by_label["fast (baseline)"]["source_dir"] == str(baseline)
    logs = {label: (out / Path(s["stats_file"]).with_suffix(".log").name).read_text()
            for label, s in by_label.items()}
    assert "9.9.9-baseline" in logs["fast (baseline)"]  # the baseline tree answered
    assert "9.9.9-baseline" not in logs["fast"] and "9.9.9-baseline" not in logs["fast (hop4)"]
    assert "first_hop_tokens=4" in by_label["fast (hop4)"]["command"]
    # run 1 starts with this tree's server, run 2 with the baseline: the order rotates
    starts = sorted((t["wall_start_s"], s["preset"]) for s in raw["servers"]
                    for t in s["traces"])
    assert [label for _, label in starts[:3]] == labels
    assert [label for _, label in starts[3:]] == labels[1:] + labels[:1]
    # between the two runs every server started again, in the reverse order: each server's
    # own records show when it prepared the voice (at every start), and the second run of
    # every row came after all three had started again
    first_run_end = max(s["traces"][0]["wall_start_s"] + s["traces"][0]["total_s"]
                        for s in raw["servers"])
    lives: dict[str, list[float]] = {}
    for label, server in by_label.items():
        prepared = sorted(r["wall_start_s"] for r in read_records(out / server["stats_file"])
                          if r.get("kind") == "voice")
        lives[label] = [prepared[0], min(t for t in prepared if t > first_run_end)]
    assert sorted(labels, key=lambda label: lives[label][0]) == labels
    assert sorted(labels, key=lambda label: lives[label][1]) == labels[::-1]
    assert [by_label[label]["start_positions"] for label in labels] == [[0, 2], [1, 1], [2, 0]]
    assert max(life[1] for life in lives.values()) < min(
        s["traces"][1]["wall_start_s"] for s in raw["servers"])
    json.dumps(raw)  # raw.json stays serialisable


def test_a_tree_with_the_benchmark_inside_the_package_runs_its_own_server(
        tmp_path: Path) -> None:
    """A baseline checkout from before bench/ left the package (up to a5fefb8) has no
    bench/serve.py: its server is started as ``python -m wyoming_cosyvoice3`` and reads the
    benchmark settings from COSYVOICE3_BENCH_* (its own flags), in its own directory."""
    old = tmp_path / "old"
    (old / "wyoming_cosyvoice3" / "bench").mkdir(parents=True)
    kwargs = {"model_dir": tmp_path / "m", "data_dir": tmp_path / "d", "preset": "fast",
              "stats_file": tmp_path / "s.jsonl", "log_file": tmp_path / "s.log",
              "tokens_per_char": 1.5, "extra_args": ["--threads", "1"]}
    legacy = ServerProcess(source_dir=old, **kwargs)  # type: ignore[arg-type]
    assert legacy.package_bench and legacy.tree == old.resolve()
    command = legacy.command()
    assert command[1:3] == ["-m", "wyoming_cosyvoice3"] and command[-2:] == ["--threads", "1"]
    assert not any(arg.startswith("--bench") for arg in command)
    current = ServerProcess(**kwargs)  # type: ignore[arg-type]
    assert not current.package_bench and current.tree == REPO
    command = current.command()
    assert command[1:3] == ["-m", "bench.serve"] and command[-2:] == ["--threads", "1"]
    assert command[command.index("--bench-tokens-per-char") + 1] == "1.5"
    assert command[command.index("--bench-stats-file") + 1] == str(tmp_path / "s.jsonl")


def test_runs_split_into_two_lives_only_when_servers_are_compared() -> None:
    assert cli.run_halves(3, 2, restart=True) == [range(0, 2), range(2, 3)]
    assert cli.run_halves(6, 3, restart=True) == [range(0, 3), range(3, 6)]
    # one server has no start position to balance; one run cannot be split
    assert cli.run_halves(3, 1, restart=True) == [range(0, 3)]
    assert cli.run_halves(1, 2, restart=True) == [range(0, 1)]
    assert cli.run_halves(4, 2, restart=False) == [range(0, 4)]
    args = cli.build_parser().parse_args(["--model-dir", "m", "--no-restart"])
    assert args.no_restart is True
