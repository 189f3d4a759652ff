"""Interrupted downloads resume with HTTP Range requests; nothing half-written is ever placed."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_mimic import CHUNK_BYTES, HubMimic, content_of, make_repos

from wyoming_cosyvoice3.download import DownloadCancelled, ensure_model, model_files

pytestmark = pytest.mark.timeout(90)

BIG = "llm_int8.onnx.data"
NAMES = [f.filename for f in model_files("int8")]
WAIT_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def repos() -> dict[str, dict[str, bytes]]:
    return make_repos("int8", seed=1)


@pytest.fixture
def hub(repos: dict[str, dict[str, bytes]]) -> Iterator[HubMimic]:
    with HubMimic(repos) as mimic:
        yield mimic


def partials(model_dir: Path, name: str) -> list[Path]:
    folder = model_dir / ".cosyvoice3" / "partial"
    return sorted(folder.glob(f"{name}.*.part")) if folder.is_dir() else []


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_complete(model_dir: Path, repos: dict[str, dict[str, bytes]]) -> None:
    for name in NAMES:
        assert (model_dir / name).read_bytes() == content_of(repos, name), name
    assert partials(model_dir, "*") == []


def cancel_once_the_big_file_started(target: Path, hub: HubMimic) -> None:
    """Download into ``target`` until the big file's partial holds its first chunk, then
    cancel (the download raises :class:`DownloadCancelled`)."""

    def big_partial_started() -> bool:
        return any(p.stat().st_size >= CHUNK_BYTES for p in partials(target, BIG))

    with pytest.raises(DownloadCancelled):
        ensure_model(
            target, "int8", endpoint=hub.endpoint, progress=False, should_stop=big_partial_started
        )


def test_dropped_connection_resumes_with_range(tmp_path: Path, hub: HubMimic, repos) -> None:
    hub.faults.drop_once_after[BIG] = 11_000_000
    ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint, progress=False)
    gets = hub.gets_of(BIG)
    assert [g.range for g in gets] == [None, f"bytes={CHUNK_BYTES}-"]
    assert_complete(tmp_path / "m", repos)


def test_download_killed_mid_file_resumes_in_next_process(
    tmp_path: Path, hub: HubMimic, repos
) -> None:
    target = tmp_path / "m"
    hub.faults.stall_after[BIG] = 11_000_000
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from wyoming_cosyvoice3.download import ensure_model
        ensure_model(Path({str(target)!r}), "int8", endpoint={hub.endpoint!r}, progress=False)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(
            lambda: any(p.stat().st_size >= CHUNK_BYTES for p in partials(target, BIG)),
            "the first 10 MiB of the big file on disk",
        )
        # Atomic placement: the final name does not exist while the transfer runs.
        assert not (target / BIG).exists()
    finally:
        proc.kill()
        proc.wait(timeout=WAIT_LIMIT_S)
    del hub.faults.stall_after[BIG]
    hub.faults.release.set()
    [part] = partials(target, BIG)
    assert part.stat().st_size == CHUNK_BYTES

    ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
    resumed = hub.gets_of(BIG)[-1]
    assert resumed.range == f"bytes={CHUNK_BYTES}-"
    assert_complete(target, repos)


def test_cancel_keeps_the_partial_and_the_next_call_resumes(
    tmp_path: Path, hub: HubMimic, repos
) -> None:
    target = tmp_path / "m"
    cancel_once_the_big_file_started(target, hub)
    assert not (target / BIG).exists()
    assert [p.stat().st_size for p in partials(target, BIG)] == [CHUNK_BYTES]
    ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
    assert hub.gets_of(BIG)[-1].range == f"bytes={CHUNK_BYTES}-"
    assert_complete(target, repos)


def test_server_ignoring_range_restarts_the_file_cleanly(
    tmp_path: Path, hub: HubMimic, repos
) -> None:
    target = tmp_path / "m"
    cancel_once_the_big_file_started(target, hub)
    hub.faults.ignore_range = True
    ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
    assert hub.gets_of(BIG)[-1].range == f"bytes={CHUNK_BYTES}-"  # asked, got 200 + whole file
    assert_complete(target, repos)


def test_stale_partial_of_another_version_is_removed(tmp_path: Path, hub: HubMimic, repos) -> None:
    target = tmp_path / "m"
    stale = target / ".cosyvoice3" / "partial" / f"{BIG}.0123456789abcdef.part"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old version" * 100)
    ensure_model(target, "int8", endpoint=hub.endpoint, progress=False)
    assert not stale.exists()
    assert hub.gets_of(BIG)[0].range is None
    assert_complete(target, repos)


def test_connections_go_only_to_the_configured_endpoint(
    tmp_path: Path, hub: HubMimic, repos, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No telemetry or other side requests: every connection goes to the mimic's ports."""
    seen: list[object] = []
    hosts: list[str] = []
    real_connect = socket.socket.connect
    real_getaddrinfo = socket.getaddrinfo

    def recording_connect(self: socket.socket, address: object) -> None:
        seen.append(address)
        real_connect(self, address)  # type: ignore[arg-type]

    def recording_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        hosts.append(host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    monkeypatch.setattr(socket, "getaddrinfo", recording_getaddrinfo)
    ensure_model(tmp_path / "m", "int8", endpoint=hub.endpoint, progress=False)
    ports = {int(hub.endpoint.rsplit(":", 1)[1]), int(hub.cdn.rsplit(":", 1)[1])}
    assert seen, "the download made no connection at all"
    assert {(a[0], a[1]) for a in seen} <= {("127.0.0.1", p) for p in ports}  # type: ignore[index]
    assert set(hosts) <= {"127.0.0.1"}
    assert_complete(tmp_path / "m", repos)


def test_stale_partial_cleanup_spares_files_with_a_longer_name(tmp_path: Path) -> None:
    from wyoming_cosyvoice3.download.fetch import partial_path, remove_stale_partials

    keep = partial_path(tmp_path, "llm.onnx", "a" * 64)
    other_version = partial_path(tmp_path, "llm.onnx", "b" * 64)
    longer_name = partial_path(tmp_path, "llm.onnx.data", "c" * 64)
    for path in (keep, other_version, longer_name):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    remove_stale_partials(tmp_path, "llm.onnx", keep=keep)
    assert keep.exists() and longer_name.exists() and not other_version.exists()
