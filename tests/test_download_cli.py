"""File lists, the command line and the progress display of the model download."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hub_mimic import HubMimic, closed_endpoint, content_of, make_repos

from wyoming_cosyvoice3.download import (
    EXPORT_REPO,
    MODEL_FILES,
    PUBLISHED_SIZES_BYTES,
    UPSTREAM_REPO,
    HubSource,
    ensure_model,
    model_files,
    published_size_bytes,
)
from wyoming_cosyvoice3.download.__main__ import main
from wyoming_cosyvoice3.download.progress import LogReporter, format_bytes
from wyoming_cosyvoice3.engine.options import LLM_FILES

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def repos() -> dict[str, dict[str, bytes]]:
    return make_repos("int8", seed=2)


def test_file_lists_follow_the_model_card() -> None:
    assert sorted(MODEL_FILES) == sorted(LLM_FILES)
    for precision, graph in LLM_FILES.items():
        names = [f.filename for f in MODEL_FILES[precision]]
        assert len(names) == len(set(names)) == 12
        assert graph in names and graph + ".data" in names
        others = {g for p, g in LLM_FILES.items() if p != precision}
        assert not others & set(names)
        upstream = {f.filename for f in MODEL_FILES[precision] if f.source == "upstream"}
        assert upstream == {
            "campplus.onnx",
            "speech_tokenizer_v3.onnx",
            "flow.decoder.estimator.fp32.onnx",
        }
        assert {"voices/zh-female.wav", "voices/en-male.wav", "tokenizer.json"} <= set(names)
        assert published_size_bytes(precision) == sum(PUBLISHED_SIZES_BYTES[n] for n in names)
    assert set(PUBLISHED_SIZES_BYTES) == {f.filename for fs in MODEL_FILES.values() for f in fs}


def test_urls_name_repo_revision_and_path() -> None:
    source = HubSource(export_revision="v1.0", endpoint="https://mirror.example/")
    files = {f.filename: f for f in model_files("q4")}
    assert (
        source.url_of(files["voices/en-male.wav"])
        == f"https://mirror.example/{EXPORT_REPO}/resolve/v1.0/voices/en-male.wav"
    )
    assert (
        source.url_of(files["campplus.onnx"])
        == f"https://mirror.example/{UPSTREAM_REPO}/resolve/main/campplus.onnx"
    )


def test_cli_sizes_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes"]) == 0
    out = capsys.readouterr().out
    for precision in LLM_FILES:
        row = next(line for line in out.splitlines() if line.startswith(precision + " "))
        assert str(published_size_bytes(precision)) in row.split()


def test_cli_downloads_then_runs_offline(
    tmp_path: Path, repos, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "seed"
    with HubMimic(repos) as hub:
        argv = ["--download-dir", str(target), "--llm-precision", "q4", "--no-progress"]
        assert main([*argv, "--endpoint", hub.endpoint]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    for file in model_files("q4"):
        assert (target / file.filename).read_bytes() == content_of(repos, file.filename)
    assert main([*argv, "--local-files-only"]) == 0
    assert main([*argv, "--endpoint", closed_endpoint(), "--verify"]) == 0


def test_cli_reports_missing_files_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--download-dir", str(tmp_path / "x"), "--endpoint", closed_endpoint()])
    assert code == 2
    err = capsys.readouterr().err
    for file in model_files("int8"):
        assert file.filename in err


def test_log_lines_report_progress_when_not_a_terminal(
    tmp_path: Path, repos, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="wyoming_cosyvoice3.download"),
        HubMimic(repos) as hub,
    ):
        ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint, progress=False)
    lines = [r.getMessage() for r in caplog.records if "llm_int8.onnx.data:" in r.getMessage()]
    assert lines, "no progress line for the big file"
    assert lines[-1].startswith("Downloading llm_int8.onnx.data: 12.0 MB of 12.0 MB (100%)")


def test_bar_on_request(tmp_path: Path, repos, capsys: pytest.CaptureFixture[str]) -> None:
    with HubMimic(repos) as hub:
        ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint, progress=True)
    err = capsys.readouterr().err
    assert "llm_int8.onnx.data" in err and "100%" in err


def test_log_reporter_steps_and_format(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        reporter = LogReporter("f", total_bytes=1000, initial_bytes=0)
        for _ in range(100):
            reporter.update(10)
        reporter.close()
    percents = [r.getMessage().split("(")[1].split(")")[0] for r in caplog.records]
    assert percents == [f"{p}%" for p in range(10, 101, 10)]
    assert format_bytes(999) == "999 B"
    assert format_bytes(3_087_006_947) == "3.1 GB"
