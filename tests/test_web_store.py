"""The voice page's catalog writer: atomic writes, locking across processes, hand-written
entries kept, clip names that never overwrite; and the page's limits on a fast stand-in engine
(upload size, model not ready)."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from server_support import (
    READ_TIMEOUT_S,
    FaultyEngine,
    fake_model_dir,
    make_settings,
    recording_faulty_factory,
    running_server,
)
from web_support import CHANGE, add_voice, catalog_items, clip_bytes, page_url

from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.server.catalog import MAX_CATALOG_VOICES, load_catalog_file
from wyoming_cosyvoice3.server.cli import RunningServer
from wyoming_cosyvoice3.server.engine_port import Engine
from wyoming_cosyvoice3.server.settings import Limits, resolve_settings
from wyoming_cosyvoice3.server.web import store as store_module
from wyoming_cosyvoice3.server.web.errors import Conflict
from wyoming_cosyvoice3.server.web.store import CatalogStore

HAND_WRITTEN = """\
# my voices
voices:
  - name: grandma
    description: Grandma
    languages: [de]
    clip: recordings/grandma.flac
    attribution: {name: "Recorded by me", url: ""}
    custom_key: kept
"""


def test_update_keeps_hand_written_entries_and_a_backup(tmp_path: Path) -> None:
    (tmp_path / "voices.yaml").write_text(HAND_WRITTEN, encoding="utf-8")
    (tmp_path / "voices.yaml").chmod(0o640)
    store = CatalogStore(tmp_path)
    store.update(lambda items: [*items, {"name": "new", "languages": ["en"],
                                         "clip": "clips/new.wav"}])
    items = catalog_items(tmp_path)
    assert items[0] == {"name": "grandma", "description": "Grandma", "languages": ["de"],
                        "clip": "recordings/grandma.flac",
                        "attribution": {"name": "Recorded by me", "url": ""},
                        "custom_key": "kept"}
    assert items[1]["name"] == "new"
    assert (tmp_path / "voices.yaml.bak").read_text(encoding="utf-8") == HAND_WRITTEN
    assert (tmp_path / "voices.yaml").stat().st_mode & 0o777 == 0o640
    # the server reads what the page wrote
    names = [e.name for e in load_catalog_file(tmp_path / "voices.yaml", [tmp_path])]
    assert names == ["grandma", "new"]


def test_a_failed_write_leaves_the_old_file(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "voices.yaml"
    path.write_text(HAND_WRITTEN, encoding="utf-8")
    store = CatalogStore(tmp_path)

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        store.update(lambda items: [])
    assert path.read_text(encoding="utf-8") == HAND_WRITTEN
    assert not list(tmp_path.glob("*.tmp"))  # no temporary file left behind


@pytest.mark.parametrize("text", ["voices: [unclosed", "- just\n- a list\n", "voices: 3\n"])
def test_a_broken_file_is_never_rewritten(tmp_path: Path, text: str) -> None:
    path = tmp_path / "voices.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(Conflict, match=r"voices\.yaml"):
        CatalogStore(tmp_path).update(lambda items: [*items, {"name": "x"}])
    assert path.read_text(encoding="utf-8") == text


def test_catalog_limits_are_kept(tmp_path: Path) -> None:
    store = CatalogStore(tmp_path)
    many = [{"name": f"v{i}", "languages": ["en"], "clip": f"clips/v{i}.wav"}
            for i in range(MAX_CATALOG_VOICES + 1)]
    with pytest.raises(Conflict, match="256"):
        store.update(lambda items: many)
    assert not (tmp_path / "voices.yaml").exists()


def test_clips_never_overwrite_and_only_managed_clips_are_deleted(tmp_path: Path) -> None:
    store = CatalogStore(tmp_path)
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "anna.wav").write_bytes(b"hand placed")
    assert store.write_clip("anna", "wav", b"one") == "clips/anna-2.wav"
    assert store.write_clip("anna", "wav", b"two") == "clips/anna-3.wav"
    assert (tmp_path / "clips" / "anna.wav").read_bytes() == b"hand placed"
    assert (tmp_path / "clips" / "anna-3.wav").read_bytes() == b"two"
    assert not list((tmp_path / "clips").glob(".upload-*"))
    (tmp_path / "outside.wav").write_bytes(b"x")
    for value in ("../outside.wav", "clips/../outside.wav", str(tmp_path / "outside.wav"),
                  "clips/sub/a.wav", "clips/", "clips/..", 42, None):
        assert store.managed_clip(value) is None, value
    items = [{"name": "b", "clip": "clips/anna-2.wav"}]
    assert not store.remove_clip_if_unused("clips/anna-2.wav", items)  # still used
    assert store.remove_clip_if_unused("clips/anna-2.wav", [])
    assert not (tmp_path / "clips" / "anna-2.wav").exists()


def _add_many(data_dir: str, prefix: str, count: int) -> None:
    store = CatalogStore(Path(data_dir))
    for i in range(count):
        store.update(lambda items, i=i: [*items, {"name": f"{prefix}{i}", "languages": ["en"],
                                                  "clip": "clips/x.wav"}])


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    # fresh interpreters, as two programs would be: a fork of this test worker inherits locks
    # that its other threads may hold at that moment (one forked writer hung in CI)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_add_many, args=(str(tmp_path), p, 25)) for p in "ab"]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    names = sorted(item["name"] for item in catalog_items(tmp_path))
    assert names == sorted([f"a{i}" for i in range(25)] + [f"b{i}" for i in range(25)])
    yaml.safe_load((tmp_path / "voices.yaml").read_text(encoding="utf-8"))


# --- limits through the HTTP API, on the fast stand-in engine ------------------------------


async def test_upload_size_limit(tmp_path: Path, make_clip: Any) -> None:
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings = make_settings(model_dir, tmp_path / "data", http_port=0,
                             limits=Limits(max_clip_bytes=100_000))
    async with running_server(settings, FaultyEngine) as server, aiohttp.ClientSession() as http:
        status, body = await add_voice(http, server, "big", clip_bytes(3.0, 24000))  # 144 kB
        assert status == 413 and "--max-clip-bytes" in body["error"]
        status, body = await add_voice(http, server, "small", clip_bytes(1.5, 24000))  # 72 kB
        assert status == 201, body
    assert [i["name"] for i in catalog_items(tmp_path / "data")] == ["small"]


async def test_changes_wait_for_the_model(tmp_path: Path, make_clip: Any) -> None:
    model_dir = fake_model_dir(tmp_path, make_clip)
    gate = threading.Event()

    def slow_factory(directory: Path, options: EngineOptions) -> Engine:
        gate.wait(60)
        return FaultyEngine(directory, options)

    settings = make_settings(model_dir, tmp_path / "data", http_port=0)
    try:
        async with running_server(settings, slow_factory, wait_ready=False) as server, \
                aiohttp.ClientSession() as http:
            async with http.get(page_url(server, "api/voices")) as response:
                data = await response.json()
                assert data["state"] == "loading"
                assert not any(v["installed"] for v in data["voices"])
            status, body = await add_voice(http, server, "early", clip_bytes())
            assert status == 503 and "model is still loading" in body["error"]
            async with http.get(page_url(server, "api/voices/en-male/preview"),
                                params={"text": "Hi."}) as response:
                assert response.status == 503
            async with http.delete(page_url(server, "api/voices/en-male"),
                                   headers=CHANGE) as response:
                assert response.status == 503
    finally:
        gate.set()
    assert catalog_items(tmp_path / "data") == []


async def test_allow_from_limits_the_clients(tmp_path: Path, make_clip: Any) -> None:
    model_dir = fake_model_dir(tmp_path, make_clip)
    for allow, status in ((("172.30.32.2",), 403), (("10.0.0.0/8", "127.0.0.0/8"), 200)):
        settings = make_settings(model_dir, tmp_path / str(status), http_port=0,
                                 http_allow_from=allow)
        async with running_server(settings, FaultyEngine) as server, \
                aiohttp.ClientSession() as http, \
                http.get(page_url(server, "api/voices")) as response:
            assert response.status == status
            if status == 403:
                assert "--http-allow-from" in (await response.json())["error"]


def test_page_settings_from_flags_environment_and_options_file(tmp_path: Path) -> None:
    options = tmp_path / "options.json"
    options.write_text('{"http_port": 8099, "http_host": "0.0.0.0", '
                       '"http_allow_from": ["172.30.32.2"]}', encoding="utf-8")
    settings = resolve_settings(["--data-dir", str(tmp_path), "--options-file", str(options)],
                                environ={})
    assert (settings.http_port, settings.http_host, settings.http_allow_from) == (
        8099, "0.0.0.0", ("172.30.32.2",))
    settings = resolve_settings(["--data-dir", str(tmp_path), "--http-port", "0"],
                                environ={"COSYVOICE3_HTTP_ALLOW_FROM": "10.1.0.0/16, ::1"})
    assert settings.http_port == 0 and settings.http_allow_from == ("10.1.0.0/16", "::1")
    for bad in (["--http-port", "70000"], ["--http-allow-from", "not-an-address"]):
        with pytest.raises(SystemExit):
            resolve_settings(["--data-dir", str(tmp_path), *bad], environ={})


async def test_a_disk_error_is_reported_and_nothing_half_written(
    tmp_path: Path, make_clip: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = fake_model_dir(tmp_path, make_clip)

    def read_only(self: CatalogStore, items: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(self.path))

    monkeypatch.setattr(CatalogStore, "update", read_only)
    settings = make_settings(model_dir, tmp_path / "data", http_port=0)
    async with running_server(settings, FaultyEngine) as server, aiohttp.ClientSession() as http:
        status, body = await add_voice(http, server, "nowhere", clip_bytes())
        assert status == 500 and "Permission denied" in body["error"], body
        assert "nowhere" not in server.runtime.voices
        async with http.get(page_url(server, "api/voices")) as response:
            assert response.status == 200  # the page goes on
    assert not list((tmp_path / "data" / "clips").glob("nowhere*"))  # the clip was removed


async def test_a_clip_arriving_in_small_pieces_is_read_whole(tmp_path: Path,
                                                              make_clip: Any) -> None:
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings = make_settings(model_dir, tmp_path / "data", http_port=0,
                             limits=Limits(max_clip_bytes=200_000))
    clip = clip_bytes(3.0, 24000)  # 144 kB: 36 pieces of 4 kB
    boundary = "voicepageboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nslow\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"languages\"\r\n\r\nen\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"clip\"; "
            f"filename=\"slow.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    async def body() -> Any:
        yield head
        for offset in range(0, len(clip), 4096):
            yield clip[offset:offset + 4096]
            await asyncio.sleep(0.005)  # separate reads on the server
        yield tail

    headers = {**CHANGE, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with running_server(settings, FaultyEngine) as server, \
            aiohttp.ClientSession() as http, \
            http.post(page_url(server, "api/voices"), data=body(), headers=headers) as response:
        assert response.status == 201, await response.text()
    assert (tmp_path / "data" / "clips" / "slow.wav").read_bytes() == clip


async def test_an_oversized_clip_is_refused_while_it_is_still_being_sent(
    tmp_path: Path, make_clip: Any
) -> None:
    """The clip part is read up to --max-clip-bytes and no further: a client announcing a
    10 MB clip against a 100 kB limit gets its 413 after sending 300 kB, while the rest is
    still to come (a server reading the whole part first would wait for all 10 MB and hold
    them in memory)."""
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings = make_settings(model_dir, tmp_path / "data", http_port=0,
                             limits=Limits(max_clip_bytes=100_000))
    boundary = "voicepageboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nbig\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"languages\"\r\n\r\nen\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"clip\"; "
            f"filename=\"big.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
    declared = len(head) + 10_000_000 + len(f"\r\n--{boundary}--\r\n")
    async with running_server(settings, FaultyEngine) as server:
        assert server.web is not None and server.web.port is not None
        port = server.web.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write((f"POST /api/voices HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                          "X-Voice-Page: 1\r\n"
                          f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                          f"Content-Length: {declared}\r\n\r\n").encode() + head)
            writer.write(bytes(300_000))
            await writer.drain()
            # the body stays open: only an answer that does not wait for it arrives
            status = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        finally:
            writer.close()
    assert status.split()[:2] == [b"HTTP/1.1", b"413"], status
    assert catalog_items(tmp_path / "data") == []


@pytest.mark.parametrize(("padding", "status"), [(1_100_000, 400), (1_200_000, 413)])
async def test_a_form_without_a_file_is_bounded_by_the_clip_limit(
    tmp_path: Path, make_clip: Any, padding: int, status: int
) -> None:
    """A url-encoded form (no file) is read whole, so its size is bounded too: by
    --max-clip-bytes plus 1 MiB for the other fields (100 kB + 1,048,576 B here). 1.1 MB
    are read (and refused for the missing clip), 1.2 MB are refused as too large."""
    model_dir = fake_model_dir(tmp_path, make_clip)
    settings = make_settings(model_dir, tmp_path / "data", http_port=0,
                             limits=Limits(max_clip_bytes=100_000))
    form = {"name": "plain", "languages": "en", "unused": "x" * padding}
    async with running_server(settings, FaultyEngine) as server, \
            aiohttp.ClientSession() as http, \
            http.post(page_url(server, "api/voices"), data=form, headers=CHANGE) as response:
        assert response.status == status, await response.text()
        if status == 400:
            assert "no clip was sent" in (await response.json())["error"]
    assert catalog_items(tmp_path / "data") == []


async def test_stopping_the_server_ends_a_preview_at_once(tmp_path: Path,
                                                          make_clip: Any) -> None:
    holder: list[FaultyEngine] = []
    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path / "data",
                             http_port=0)
    server = RunningServer(settings, engine_factory=recording_faulty_factory(holder))
    await server.start()
    try:
        assert await asyncio.to_thread(server.runtime.loader.ready_event.wait, 60)
        async with aiohttp.ClientSession() as http:
            answer = asyncio.ensure_future(http.get(
                page_url(server, "api/voices/en-male/preview"), params={"text": "HOLD on."}))
            assert await asyncio.to_thread(holder[0].started.acquire, True, 30)
            started = time.monotonic()
            await server.stop(grace_s=5.0)
            stopped_s = time.monotonic() - started
            response = await asyncio.wait_for(answer, 10)
            assert response.status == 503
            assert "stopped" in (await response.json())["error"]
    finally:
        for engine in holder:
            engine.gate.set()
    assert stopped_s < 5.0
    assert holder[0].outcomes == ["cancelled"] and holder[0].stop_flags == [True]
