"""ensure_model against a local hub mimic: first download, offline restarts, verification."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_mimic import HubMimic, closed_endpoint, content_of, make_repos

from wyoming_cosyvoice3.download import (
    EXPORT_REPO,
    UPSTREAM_REPO,
    ensure_model,
    find_missing,
    model_files,
)
from wyoming_cosyvoice3.engine.errors import ModelFilesMissing

pytestmark = pytest.mark.timeout(60)

NAMES = [f.filename for f in model_files("int8")]


@pytest.fixture(scope="module")
def repos() -> dict[str, dict[str, bytes]]:
    return make_repos("int8")


@pytest.fixture
def hub(repos: dict[str, dict[str, bytes]]) -> Iterator[HubMimic]:
    with HubMimic(repos) as mimic:
        yield mimic


@pytest.fixture
def seeded(tmp_path: Path, repos: dict[str, dict[str, bytes]]) -> Path:
    """A download directory filled once through its own (then stopped) mimic."""
    target = tmp_path / "seeded"
    with HubMimic(repos) as mimic:
        ensure_model(target, "int8", endpoint=mimic.endpoint, progress=False)
    return target


def assert_complete(model_dir: Path, repos: dict[str, dict[str, bytes]]) -> None:
    for name in NAMES:
        assert (model_dir / name).read_bytes() == content_of(repos, name), name
    partial = model_dir / ".cosyvoice3" / "partial"
    leftovers = [p for p in partial.rglob("*") if p.is_file()] if partial.exists() else []
    assert leftovers == []


def test_first_start_downloads_every_file(tmp_path: Path, hub: HubMimic, repos) -> None:
    target = tmp_path / "models"
    assert find_missing(target, "int8") == NAMES
    assert ensure_model(target, "int8", endpoint=hub.endpoint, progress=False) == target
    assert_complete(target, repos)
    assert find_missing(target, "int8") == []
    # Other precisions' LLM files are not fetched.
    assert not (target / "llm.onnx").exists() and not (target / "llm_q4.onnx.data").exists()
    assert sorted(
        {r.path.rsplit("/resolve/main/", 1)[-1] for r in hub.requests if r.method == "HEAD"}
    ) == sorted(NAMES)
    for name in NAMES:
        assert len(hub.gets_of(name)) == 1, name
    manifest = json.loads((target / ".cosyvoice3" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(NAMES)
    rec = manifest["files"]["campplus.onnx"]
    assert rec["repo_id"] == UPSTREAM_REPO and rec["commit"] == hub.commits[UPSTREAM_REPO]
    assert manifest["files"]["hift.onnx"]["repo_id"] == EXPORT_REPO


def test_second_start_touches_no_network(seeded: Path, repos) -> None:
    # The seeding mimic is stopped; a fresh one would record any request.
    with HubMimic(repos) as hub:
        assert ensure_model(seeded, "int8", endpoint=hub.endpoint, progress=False) == seeded
        assert hub.requests == []
    # And with nothing listening at all.
    assert ensure_model(seeded, "int8", endpoint=closed_endpoint()) == seeded
    assert_complete(seeded, repos)


def test_hf_endpoint_is_read_at_call_time(
    tmp_path: Path, hub: HubMimic, repos, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    ensure_model(tmp_path / "m", "int8", progress=False)
    assert_complete(tmp_path / "m", repos)
    assert len(hub.requests) >= 2 * len(NAMES)


def test_truncated_file_is_fetched_again(seeded: Path, repos) -> None:
    path = seeded / "hift.onnx"
    path.write_bytes(path.read_bytes()[:100])
    with HubMimic(repos) as hub:
        ensure_model(seeded, "int8", endpoint=hub.endpoint, progress=False)
        assert [r.method for r in hub.requests if "hift" in r.path] == ["HEAD"]
        assert len(hub.gets_of("hift.onnx")) == 1
        assert all(not hub.gets_of(n) for n in NAMES if n != "hift.onnx")
    assert_complete(seeded, repos)


def test_same_size_corruption_is_detected_and_fetched(
    seeded: Path, repos, caplog: pytest.LogCaptureFixture
) -> None:
    path = seeded / "voices" / "en-male.wav"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    st = path.stat()
    path.write_bytes(bytes(data))
    # Filesystem timestamps can be coarser than two quick writes; make the change visible.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    with caplog.at_level(logging.WARNING), HubMimic(repos) as hub:
        ensure_model(seeded, "int8", endpoint=hub.endpoint, progress=False)
        assert len(hub.gets_of("voices/en-male.wav")) == 1
        assert sum(len(hub.gets_of(n)) for n in NAMES) == 1
    assert "corrupt" in caplog.text
    assert_complete(seeded, repos)


def test_touched_but_intact_file_is_rehashed_without_network(seeded: Path, repos) -> None:
    path = seeded / "tokenizer.json"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    with HubMimic(repos) as hub:
        ensure_model(seeded, "int8", endpoint=hub.endpoint, progress=False)
        assert hub.requests == []
    manifest = json.loads((seeded / ".cosyvoice3" / "manifest.json").read_text())
    assert manifest["files"]["tokenizer.json"]["mtime_ns"] == path.stat().st_mtime_ns


def test_verify_finds_corruption_that_kept_size_and_mtime(seeded: Path, repos) -> None:
    path = seeded / "speech_embedding.onnx"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: same size and mtime
    with HubMimic(repos) as hub:
        ensure_model(seeded, "int8", endpoint=hub.endpoint, progress=False)
        assert hub.requests == []  # the fast check trusts size + mtime
        ensure_model(seeded, "int8", endpoint=hub.endpoint, progress=False, verify=True)
        assert len(hub.gets_of("speech_embedding.onnx")) == 1
    assert_complete(seeded, repos)


def test_corrupt_file_offline_is_removed_and_reported(seeded: Path) -> None:
    path = seeded / "flow_encoder.onnx"
    path.write_bytes(b"x" * 10)
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(seeded, "int8", endpoint=closed_endpoint())
    assert info.value.missing == ["flow_encoder.onnx"]
    assert "was corrupt" in str(info.value)
    assert not path.exists()


def test_missing_files_without_hub_name_every_file_and_url(tmp_path: Path) -> None:
    endpoint = closed_endpoint()
    target = tmp_path / "empty"
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(target, "int8", endpoint=endpoint)
    err = info.value
    assert err.missing == NAMES
    assert err.code == "model-files-missing"
    text = str(err)
    assert "unreachable" in text
    for file in model_files("int8"):
        repo = UPSTREAM_REPO if file.source == "upstream" else EXPORT_REPO
        assert f"{endpoint}/{repo}/resolve/main/{file.filename}" in text
    assert "python -m wyoming_cosyvoice3.download" in text


def test_only_the_absent_files_are_reported(seeded: Path) -> None:
    (seeded / "llm_int8.onnx.data").unlink()
    (seeded / "campplus.onnx").unlink()
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(seeded, "int8", endpoint=closed_endpoint())
    assert info.value.missing == ["llm_int8.onnx.data", "campplus.onnx"]


def test_local_files_only_works_offline_and_reports_missing(seeded: Path, repos) -> None:
    with HubMimic(repos) as hub:
        assert ensure_model(seeded, "int8", local_files_only=True, endpoint=hub.endpoint) == seeded
        (seeded / "hift.onnx").unlink()
        with pytest.raises(ModelFilesMissing) as info:
            ensure_model(seeded, "int8", local_files_only=True, endpoint=hub.endpoint)
        assert hub.requests == []
    assert info.value.missing == ["hift.onnx"]
    assert "local_files_only" in str(info.value)


def test_hf_hub_offline_env_is_respected(
    tmp_path: Path, hub: HubMimic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint)
    assert hub.requests == []
    assert "HF_HUB_OFFLINE" in str(info.value)


def test_hand_placed_files_are_checked_once_by_head_only(tmp_path: Path, repos) -> None:
    target = tmp_path / "by-hand"
    for name in NAMES:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(content_of(repos, name))
    with HubMimic(repos) as hub:
        ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
        assert {r.method for r in hub.requests} == {"HEAD"}
        assert len(hub.requests) == len(NAMES)
        before = len(hub.requests)
        ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
        assert len(hub.requests) == before


def test_hand_placed_wrong_file_is_replaced_online_kept_offline(tmp_path: Path, repos) -> None:
    target = tmp_path / "by-hand"
    for name in NAMES:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(content_of(repos, name))
    wrong = content_of(repos, "hift.onnx")[::-1]
    (target / "hift.onnx").write_bytes(wrong)
    # Offline nothing can be checked: present files are used as they are.
    assert ensure_model(target, "int8", local_files_only=True) == target
    assert (target / "hift.onnx").read_bytes() == wrong
    with HubMimic(repos) as hub:
        ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
        assert [n for n in NAMES if hub.gets_of(n)] == ["hift.onnx"]
    assert_complete(target, repos)


def test_wrong_bytes_from_the_hub_are_fetched_again(tmp_path: Path, hub: HubMimic, repos) -> None:
    hub.faults.wrong_bytes["flow_encoder.onnx"] = 1
    ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint, progress=False)
    assert len(hub.gets_of("flow_encoder.onnx")) == 2
    assert_complete(tmp_path / "m", repos)


def test_persistently_wrong_bytes_are_never_placed(tmp_path: Path, hub: HubMimic) -> None:
    hub.faults.wrong_bytes["tokenizer.json"] = 5  # regular file: checked by Git blob SHA-1
    target = tmp_path / "m"
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
    assert info.value.missing == ["tokenizer.json"]
    assert "hash check" in str(info.value)
    assert not (target / "tokenizer.json").exists()
    assert find_missing(target, "int8") == ["tokenizer.json"]


def test_unknown_revision_fails_fast_naming_the_files(tmp_path: Path, hub: HubMimic) -> None:
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint, upstream_revision="v9")
    # A configuration error: nothing is downloaded, every file is still missing.
    assert info.value.missing == NAMES
    assert not any(r.method == "GET" for r in hub.requests)
    lines = str(info.value).splitlines()
    flagged = [line.split()[0] for line in lines if "not on the hub" in line]
    assert flagged == [
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
        "flow.decoder.estimator.fp32.onnx",
    ]
    assert f"{hub.endpoint}/{UPSTREAM_REPO}/resolve/v9/campplus.onnx" in str(info.value)


def test_other_repository_and_precision(tmp_path: Path, repos) -> None:
    custom = {"me/export": repos[EXPORT_REPO], "me/upstream": repos[UPSTREAM_REPO]}
    with HubMimic(custom) as hub:
        ensure_model(
            tmp_path / "m",
            "q4",
            endpoint=hub.endpoint,
            export_repo="me/export",
            upstream_repo="me/upstream",
            progress=False,
        )
    assert (tmp_path / "m" / "llm_q4.onnx.data").read_bytes() == content_of(
        repos, "llm_q4.onnx.data"
    )
    assert find_missing(tmp_path / "m", "q4") == []
    assert find_missing(tmp_path / "m", "int8") == ["llm_int8.onnx", "llm_int8.onnx.data"]


def test_not_enough_disk_space_fails_before_downloading(
    tmp_path: Path, hub: HubMimic, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import wyoming_cosyvoice3.download.ensure as ensure_mod

    real = shutil.disk_usage
    monkeypatch.setattr(ensure_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000))
    with pytest.raises(ModelFilesMissing) as info:
        ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint)
    assert "disk space" in str(info.value)
    assert not any(r.method == "GET" for r in hub.requests)


def test_unknown_precision_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fp16"):
        ensure_model(tmp_path, "fp16")
