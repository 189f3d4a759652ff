"""The engine's observer hooks and the benchmark's recorder and fixed decoding length
(bench/recorder.py), on the tiny model; the benchmark's server flags (bench/serve.py), which
the product does not have."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from server_support import loaded_engine_options

from bench import serve
from bench.recorder import FixedDecoding, StatsRecorder
from wyoming_cosyvoice3.engine import EngineOptions, SynthesisOptions, sessions
from wyoming_cosyvoice3.engine.options import EngineObserver
from wyoming_cosyvoice3.engine.text.frontend import TextFrontend
from wyoming_cosyvoice3.server.hooks import ServerHooks
from wyoming_cosyvoice3.server.runtime import ServerRuntime
from wyoming_cosyvoice3.server.settings import build_parser, resolve_settings


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "stats.jsonl"
    try:
        yield path
    finally:
        sessions.set_run_observer(None)


def test_no_observer_by_default() -> None:
    assert EngineOptions().observer is None
    assert EngineObserver().fixed_speech_tokens("Hello there.") is None
    assert sessions._run_observer is None
    # the decoding length is no option of the product: benchmark knobs stay out of it
    names = {f.name for f in fields(SynthesisOptions)} | {f.name for f in fields(EngineOptions)}
    assert not any("tokens_per_char" in name or name.startswith("fixed") for name in names)


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "nan"])
def test_bad_tokens_per_char_flag_is_refused(raw: str) -> None:
    with pytest.raises(SystemExit):
        serve.parse(["--data-dir", "/d", "--bench-tokens-per-char", raw])


def test_bench_flags_become_hooks_and_the_rest_goes_to_the_server(tmp_path: Path) -> None:
    hooks, server_argv = serve.parse(
        ["--data-dir", str(tmp_path), "--bench-tokens-per-char", "2.5", "--preset", "fast",
         "--bench-stats-file", str(tmp_path / "s.jsonl")])
    assert server_argv == ["--data-dir", str(tmp_path), "--preset", "fast"]
    assert dict(hooks.synthesis_overrides) == {}
    assert isinstance(hooks.observer, StatsRecorder)
    assert hooks.observer.path == tmp_path / "s.jsonl"
    # max(1, round(2.5 x characters)) tokens per piece: 10 characters -> 25, 1 -> 2 (2.5
    # rounds to even), 0 -> at least 1
    assert [hooks.observer.fixed_speech_tokens(t) for t in ("0123456789", "a", "")] == [25, 2, 1]
    settings = resolve_settings(server_argv, environ={})
    runtime = ServerRuntime(settings, hooks=hooks)
    assert runtime.observer is hooks.observer
    # the request options are the preset's, as without the benchmark
    plain = ServerRuntime(settings).loader.synthesis_options(seed=3)
    assert runtime.loader.synthesis_options(seed=3) == plain
    assert serve.parse(["--data-dir", "/d"])[0] == ServerHooks()
    rate_only = serve.parse(["--data-dir", "/d", "--bench-tokens-per-char", "0.5"])[0].observer
    assert isinstance(rate_only, FixedDecoding) and not isinstance(rate_only, StatsRecorder)
    assert [rate_only.fixed_speech_tokens(t) for t in ("abcd", "abc")] == [2, 2]
    stats_only = serve.parse(["--data-dir", "/d", "--bench-stats-file", "s.jsonl"])[0].observer
    assert isinstance(stats_only, StatsRecorder)
    assert stats_only.fixed_speech_tokens("abcd") is None
    with pytest.raises(ValueError):
        FixedDecoding(0.0)


@pytest.mark.parametrize(("preset", "flags", "precision", "chunk_causal"), [
    ("quality", [], "fp32", True),
    ("fast", [], "int8", True),
    ("balanced", ["--bench-synthesis-options", "flow_chunk_causal=false"], "int8", False),
])
def test_the_engine_is_loaded_for_the_preset_with_the_benchmark_observer(
        tmp_path: Path, preset: str, flags: list[str], precision: str,
        chunk_causal: bool) -> None:
    """The server hands the engine the preset record (whose DiT graphs open at start) and the
    benchmark's observer, which carries the fixed decoding length."""
    # an explicit LLM graph: the loader measures nothing (the probe is not this test's subject)
    hooks, server_argv = serve.parse(["--model-dir", str(tmp_path), "--preset", preset,
                                      "--llm-graph", "fused", "--bench-tokens-per-char", "2",
                                      *flags])
    loaded = loaded_engine_options(resolve_settings(server_argv, environ={}), tmp_path, hooks)
    (options,) = loaded
    assert options.observer is hooks.observer
    assert options.observer is not None and options.observer.fixed_speech_tokens("ab") == 4
    assert (options.flow.precision, options.flow.chunk_causal) == (
        precision, chunk_causal)


def test_bench_engine_options_reach_the_loaded_engine(tmp_path: Path) -> None:
    """``--bench-engine-options`` replaces fields of the options the engine is loaded with
    (here the streamed vocoder, so the windowed one it replaced can be measured through the
    server); without it the server's own options stand."""
    argv = ["--model-dir", str(tmp_path), "--preset", "balanced", "--llm-graph", "fused"]
    hooks, server_argv = serve.parse([*argv, "--bench-engine-options", "stream_vocoder=false"])
    assert dict(hooks.engine_overrides) == {"stream_vocoder": False}
    assert server_argv == argv
    settings = resolve_settings(server_argv, environ={})
    (changed,) = loaded_engine_options(settings, tmp_path, hooks)
    (plain,) = loaded_engine_options(settings, tmp_path)
    assert (changed.stream_vocoder, plain.stream_vocoder) == (False, True)
    # the rest as the server chose it
    assert changed.flow == plain.flow and changed.llm_graph == plain.llm_graph == "fused"
    assert changed.llm_prefill_graph is plain.llm_prefill_graph is None
    assert serve.engine_overrides("mmap_embeddings=false, threads=1") == {
        "mmap_embeddings": False, "threads": 1}


@pytest.mark.parametrize("raw", ["stream_vocoder", "no_such_field=1", "preset=fast",
                                 "observer=none"])
def test_bad_bench_engine_options_are_refused(raw: str) -> None:
    with pytest.raises(SystemExit):
        serve.parse(["--data-dir", "/d", "--bench-engine-options", raw])
    name = raw.partition("=")[0]
    if name != "stream_vocoder":  # a field, only the value is missing
        with pytest.raises(ValueError, match="engine_overrides"):
            ServerHooks(engine_overrides={name: None})


@pytest.mark.parametrize("flag", ["--bench-stats-file", "--bench-tokens-per-char",
                                  "--bench-synthesis-options", "--bench-engine-options"])
def test_the_product_has_no_benchmark_flag(flag: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Benchmark knobs are not settings: the server refuses them as flags, ignores them in
    the environment, and its --help does not name them."""
    with pytest.raises(SystemExit):
        resolve_settings(["--data-dir", str(tmp_path), flag, "1"], environ={})
    env = {"COSYVOICE3_" + flag.lstrip("-").replace("-", "_").upper(): "1"}
    assert resolve_settings(["--data-dir", str(tmp_path)], environ=env) == resolve_settings(
        ["--data-dir", str(tmp_path)], environ={})
    capsys.readouterr()
    with pytest.raises(SystemExit):
        resolve_settings(["--help"], environ={})
    assert "--preset" in capsys.readouterr().out
    assert "bench" not in build_parser().format_help().lower()


def test_bench_synthesis_options_change_the_preset(tmp_path: Path) -> None:
    from wyoming_cosyvoice3.engine.options import PRESETS

    balanced = PRESETS["balanced"]
    assert (balanced.flow.chunk_causal, balanced.flow.left_context_tokens) == (True, 50)
    hooks, server_argv = serve.parse(
        ["--data-dir", str(tmp_path), "--preset", "balanced", "--bench-synthesis-options",
         "flow_chunk_causal=false, flow_left_context_tokens=25,speed=1.5"])
    assert dict(hooks.synthesis_overrides) == {
        "flow": {"chunk_causal": False, "left_context_tokens": 25}, "speed": 1.5}
    # a flat name of a recorded command line and the record path are the same field
    assert serve.synthesis_overrides("cfg_rate=0.5,language_hint=de") == {
        "flow": {"schedule": {"cfg_rate": 0.5}}, "language_hint": "de"}
    assert serve.synthesis_overrides("flow.schedule.cfg_rate=0.5,language_hint=de") == {
        "flow": {"schedule": {"cfg_rate": 0.5}}, "language_hint": "de"}
    assert hooks.observer is None
    options = ServerRuntime(resolve_settings(server_argv, environ={}),
                            hooks=hooks).loader.synthesis_options(seed=3)
    assert options.flow.chunk_causal is False and options.flow.left_context_tokens == 25
    assert options.flow.schedule == balanced.flow.schedule  # the rest is the preset's
    assert options.speed == 1.0  # --speed still decides the rate
    assert options.seed == 3


@pytest.mark.parametrize("raw", ["no_such_field=1", "euler_steps", "euler_steps=0",
                                 "flow_precision=int4", "flow.schedule=3", "cfg_steps=1"])
def test_bad_bench_synthesis_options_are_refused(raw: str) -> None:
    with pytest.raises(SystemExit):
        serve.parse(["--data-dir", "/d", "--bench-synthesis-options", raw])


@pytest.mark.parametrize("overrides", [{"no_such_field": 1}, {"euler_steps": 3},
                                       {"flow": {"schedule": {"steps": 0}}}])
def test_server_hooks_refuse_bad_overrides(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ServerHooks(synthesis_overrides=overrides)


def test_fixed_length_and_records(tiny_model_dir: Path, make_clip, tmp_path: Path,
                                  recording: Path) -> None:
    from wyoming_cosyvoice3.engine import CosyVoice3Engine

    rate = 1.5
    engine = CosyVoice3Engine.load(
        tiny_model_dir, EngineOptions(observer=StatsRecorder(recording, tokens_per_char=rate)))
    voice = engine.prepare_voice(make_clip(tmp_path / "v.wav", seconds=3.0),
                                 transcript="A short prompt.", name="v")
    text = "First sentence here. And a second, longer one follows it."
    chunks = list(engine.synthesize(text, voice, SynthesisOptions()))
    assert chunks and chunks[-1].is_last
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["voice", "request"]
    voice_record, request = lines
    assert voice_record["name"] == "v" and voice_record["total_s"] > 0
    voice_graphs = {run[0] for run in voice_record["graph_runs"]}
    assert voice_graphs == {"campplus.onnx", "speech_tokenizer_v3.onnx"}
    pieces = TextFrontend(engine.model.tokenizer, engine.model.end_of_prompt_id).split_pieces(text)
    assert request["times"]["llm_tokens"] == sum(max(1, round(rate * len(p))) for p in pieces)
    assert request["chars"] == len(text) and request["pieces"] == len(pieces)
    assert request["wall_end_s"] - request["wall_start_s"] == pytest.approx(request["total_s"],
                                                                            abs=1e-3)
    runs = request["graph_runs"]
    llm_runs = [r for r in runs if r[0].startswith("llm")]
    # per piece: a prefill (maybe in two parts: cached voice prefix, then the request part) and
    # one step per token except the last
    tokens = request["times"]["llm_tokens"]
    assert tokens <= len(llm_runs) <= tokens + len(pieces)
    steps = [shapes for _, shapes, _, _ in llm_runs if shapes["inputs_embeds"][1] == 1]
    assert len(steps) >= tokens - len(pieces)
    assert all("past_key_values.0.key" not in shapes for _, shapes, _, _ in runs)
    assert all(start <= end for _, _, start, end in runs)
    for name, path in request["graph_paths"].items():
        assert Path(path).name == name and Path(path).is_file()
