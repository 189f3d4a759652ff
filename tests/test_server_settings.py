"""Settings: flags, environment variables, the add-on options file, and their precedence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wyoming_cosyvoice3 import __version__
from wyoming_cosyvoice3.engine.machine import MachineRates
from wyoming_cosyvoice3.server.settings import (
    DEFAULT_URI,
    OPTIONS,
    Settings,
    SettingsError,
    build_parser,
    resolve_settings,
)


def test_defaults_need_a_model_location() -> None:
    with pytest.raises(SettingsError, match="--data-dir"):
        resolve_settings([], environ={})


def test_flags(tmp_path: Path) -> None:
    settings = resolve_settings(
        ["--data-dir", str(tmp_path / "a"), "--data-dir", str(tmp_path / "b"),
         "--voice", "en-male", "--llm-precision", "q4", "--threads", "3", "--speed", "1.5",
         "--samples-per-chunk", "512", "--max-concurrent", "2", "--no-streaming",
         "--seed", "7", "--zeroconf", "--local-files-only", "--debug", "--preset", "quality",
         "--max-text-chars", "50"],
        environ={},
    )
    assert settings.uri == DEFAULT_URI
    assert settings.data_dirs == (tmp_path / "a", tmp_path / "b")
    assert (settings.voice, settings.llm_precision, settings.threads) == ("en-male", "q4", 3)
    assert (settings.speed, settings.samples_per_chunk, settings.max_concurrent) == (1.5, 512, 2)
    assert settings.streaming is False and settings.seed == 7
    assert settings.zeroconf == "cosyvoice3" and settings.local_files_only and settings.debug
    assert settings.preset == "quality" and settings.limits.max_text_chars == 50
    assert settings.cache_dir == tmp_path / "a" / "voice-cache"


def test_environment_and_options_file_precedence(tmp_path: Path) -> None:
    options = tmp_path / "options.json"
    options.write_text(json.dumps({
        "voice": "from-file", "speed": 0.75, "data_dir": ["/data"], "debug": True,
        "no_streaming": True, "zeroconf": "living-room", "max_concurrent": 3,
        "unknown_key": 1,
    }))
    env = {"COSYVOICE3_OPTIONS_FILE": str(options), "COSYVOICE3_VOICE": "from-env",
           "COSYVOICE3_MAX_CONCURRENT": "4"}
    settings = resolve_settings(["--max-concurrent", "5"], environ=env)
    assert settings.voice == "from-env"  # environment beats the options file
    assert settings.max_concurrent == 5  # the command line beats both
    assert settings.speed == 0.75 and settings.data_dirs == (Path("/data"),)
    assert settings.debug and settings.streaming is False
    assert settings.zeroconf == "living-room"
    assert settings.options_file == options


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"COSYVOICE3_NO_STREAMING": "true"}, "streaming", False),
        ({"COSYVOICE3_NO_STREAMING": "0"}, "streaming", True),
        ({"COSYVOICE3_DEBUG": "yes"}, "debug", True),
        ({"COSYVOICE3_ZEROCONF": "1"}, "zeroconf", "cosyvoice3"),
        ({"COSYVOICE3_ZEROCONF": "kitchen"}, "zeroconf", "kitchen"),
        ({"COSYVOICE3_ZEROCONF": "off"}, "zeroconf", None),
        ({"COSYVOICE3_URI": "tcp://127.0.0.1:1234"}, "uri", "tcp://127.0.0.1:1234"),
        ({"COSYVOICE3_PROVIDERS": "CUDAExecutionProvider,CPUExecutionProvider"}, "providers",
         ("CUDAExecutionProvider", "CPUExecutionProvider")),
    ],
)
def test_environment_values(env: dict[str, str], field: str, value: object) -> None:
    settings = resolve_settings([], environ={"COSYVOICE3_MODEL_DIR": "/m", **env})
    assert getattr(settings, field) == value
    assert settings.model_dir == Path("/m")


def test_data_dirs_from_environment() -> None:
    settings = resolve_settings([], environ={"COSYVOICE3_DATA_DIR": "/a:/b"})
    assert settings.data_dirs == (Path("/a"), Path("/b"))


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"COSYVOICE3_SPEED": "3"}, "COSYVOICE3_SPEED"),
        ({"COSYVOICE3_LLM_PRECISION": "fp8"}, "COSYVOICE3_LLM_PRECISION"),
        ({"COSYVOICE3_MAX_CONCURRENT": "0"}, "COSYVOICE3_MAX_CONCURRENT"),
        ({"COSYVOICE3_DEBUG": "maybe"}, "COSYVOICE3_DEBUG"),
    ],
)
def test_bad_environment_value_names_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        resolve_settings([], environ={"COSYVOICE3_MODEL_DIR": "/m", **env})


def test_bad_options_file(tmp_path: Path) -> None:
    broken = tmp_path / "options.json"
    broken.write_text("{not json")
    with pytest.raises(SettingsError, match=r"options\.json"):
        resolve_settings(["--options-file", str(broken), "--model-dir", "/m"], environ={})
    broken.write_text(json.dumps({"speed": "fast"}))
    with pytest.raises(SettingsError, match="'speed'"):
        resolve_settings(["--options-file", str(broken), "--model-dir", "/m"], environ={})


def test_bad_flag_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        resolve_settings(["--model-dir", "/m", "--speed", "9"], environ={})
    assert exit_info.value.code == 2
    assert "--speed" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        resolve_settings(["--version"], environ={})
    assert capsys.readouterr().out.strip() == __version__


def test_every_option_is_documented() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    help_text = build_parser().format_help()
    for opt in OPTIONS:
        assert opt.flag in help_text and opt.env in help_text
        row = f"| `{opt.flag}"
        assert row in readme and f"`{opt.env}`" in readme and f"`{opt.key}`" in readme, opt.flag


HELP_GROUPS = {
    "model and files": ["--options-file", "--data-dir", "--download-dir", "--model-dir",
                        "--voices", "--local-files-only", "--llm-precision", "--llm-graph",
                        "--threads", "--no-split-cores", "--providers", "--no-warm-up"],
    "speech": ["--voice", "--preset", "--speed", "--seed", "--keep-digits",
               "--samples-per-chunk", "--max-preroll-ms"],
    "server and limits": ["--uri", "--zeroconf", "--no-streaming", "--max-concurrent",
                          "--max-text-chars", "--max-pending-requests",
                          "--max-queued-requests", "--max-request-seconds",
                          "--max-connections", "--idle-timeout-seconds",
                          "--write-timeout-seconds", "--max-event-header-bytes",
                          "--max-event-data-bytes", "--max-event-payload-bytes",
                          "--max-clip-bytes"],
    "voice page": ["--http-port", "--http-host", "--http-allow-from"],
    "logging": ["--debug", "--log-format"],
}
"""The sections of ``--help`` (model and files, speech, server and limits, voice
page, logging) and the flags each must list, written out here, not read from the code."""


def test_help_is_grouped(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        resolve_settings(["--help"], environ={})
    assert exit_info.value.code == 0
    sections: dict[str, list[str]] = {}
    current = None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            current.append(line.split()[0].rstrip(","))
    assert sections == {"options": ["-h", "--version"], **HELP_GROUPS}
    # the table makes every flag (the README rows and the add-on keys follow it)
    assert [opt.flag for opt in OPTIONS] == [
        flag for flags in HELP_GROUPS.values() for flag in flags if flag != "--options-file"]


@pytest.mark.parametrize(("flags", "advertised"), [([], True), (["--no-streaming"], False)])
def test_streaming_is_advertised_unless_turned_off(tmp_path: Path, flags: list[str],
                                                    advertised: bool) -> None:
    """README "Connecting Home Assistant": ``supports_synthesize_streaming`` is advertised by
    default and not with ``--no-streaming``."""
    from wyoming_cosyvoice3.server.info import build_info
    from wyoming_cosyvoice3.server.runtime import ServerRuntime

    settings = resolve_settings(["--data-dir", str(tmp_path), *flags], environ={})
    runtime = ServerRuntime(settings)
    try:
        program = build_info(runtime).tts[0]
    finally:
        runtime.shutdown()
    assert program.supports_synthesize_streaming is advertised


@pytest.mark.parametrize(("argv", "kind", "graphs"), [
    # the machine probe decides (fixed figures, tests/machine_figures.py): on the AVX-512 kind
    # 8-bit blocks decode fastest and per-tensor int8 prefills 4.4x faster; on the AVX2 kind
    # 8-bit blocks decode (two pieces at once) and prefill (per-tensor int8 only 1.1x faster:
    # one graph); the lossy preset takes 4-bit weights on both
    (["--preset", "balanced"], "avx512", ("fused-b8", "fused")),
    (["--preset", "quality"], "avx512", ("fused-b8", "fused")),
    (["--preset", "fast"], "avx512", ("fused-q4", "fused")),
    # 8-bit blocks decode two pieces at once: cheaper per token than per-tensor int8 there
    (["--preset", "balanced"], "avx2", ("fused-b8", None)),
    (["--preset", "fast"], "avx2", ("fused-q4", "fused")),
    # an explicit graph wins, and nothing is measured
    (["--preset", "fast", "--llm-graph", "fused"], "none", ("fused", None)),
    (["--preset", "balanced", "--llm-graph", "published"], "none", ("published", None)),
    (["--preset", "balanced", "--llm-graph", "fused-b8"], "none", ("fused-b8", None)),
])
def test_the_llm_graphs_loaded_follow_the_preset_and_the_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], kind: str,
        graphs: tuple[str, str | None]) -> None:
    from machine_figures import AVX2, AVX512
    from server_support import loaded_engine_options

    from wyoming_cosyvoice3.server import machine

    calls: list[int] = []

    def probe(threads: int = 0, budget_s: float = 1.0) -> MachineRates:
        calls.append(threads)
        return {"avx512": AVX512, "avx2": AVX2}[kind]

    monkeypatch.setattr(machine, "probe_rates", probe)
    monkeypatch.setattr(machine, "available_memory_bytes", lambda: 64e9)
    settings = resolve_settings(["--model-dir", str(tmp_path), *argv], environ={})
    assert Settings.llm_graph == "preset"
    loaded = loaded_engine_options(settings, tmp_path)
    assert [(o.llm_graph, o.llm_prefill_graph) for o in loaded] == [graphs]
    assert calls == ([] if kind == "none" else [0])
