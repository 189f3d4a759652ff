"""First start without a model: the server downloads it (from a local hub mimic), answers
``describe`` during the download, refuses synthesis with ``model-loading``, then serves; a
second start works without any network."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from hub_mimic import HubMimic, closed_endpoint, repos_from_dir
from server_support import (
    check_audio_format,
    client,
    collect,
    describe,
    one_shot_error,
    running_server,
)
from wyoming.tts import Synthesize

from wyoming_cosyvoice3.download import EXPORT_REPO, UPSTREAM_REPO
from wyoming_cosyvoice3.server import download_wait
from wyoming_cosyvoice3.server.model_loader import ModelState
from wyoming_cosyvoice3.server.settings import Settings

pytestmark = pytest.mark.timeout(300)

NOT_ABOUT_THE_PRESET = {"llm_graph": "published", "preset": "balanced"}
"""Settings of the downloading servers that skip two steps a default first start takes after
the download, which other tests cover: measuring the machine for ``--preset auto``
(test_server_auto_preset.py) and deriving and validating the preset's fused LLM graph in a
child process (test_server_default_preset.py; test_server_subprocess.py::
test_started_as_the_readme_says starts with every default). The downloaded files have their
own mtimes, so the session's engine cache cannot serve their derived graphs."""


async def test_first_start_downloads_then_serves(tiny_model_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    settings = Settings(uri="tcp://127.0.0.1:0", data_dirs=(data_dir,), warm_up=False, seed=1,
                        **NOT_ABOUT_THE_PRESET)
    repos = repos_from_dir(tiny_model_dir, EXPORT_REPO, UPSTREAM_REPO)
    with HubMimic(repos) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        hub.faults.stall_after["hift.onnx"] = 1000  # hold the download half-way
        async with running_server(settings, wait_ready=False) as server:
            assert await asyncio.to_thread(hub.faults.stalled.wait, 60)
            info = await describe(server, timeout_s=1.0)
            assert "downloading" in (info.tts[0].description or "")
            assert [v.installed for v in info.tts[0].voices] == [False, False]
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="Hello.").event())
                error = await one_shot_error(cl)
                assert error.code == "model-loading" and "try again" in error.text
                hub.faults.stall_after.clear()
                hub.faults.release.set()
                assert await asyncio.to_thread(server.runtime.loader.ready_event.wait, 120)
                assert server.runtime.loader.state is ModelState.READY, server.runtime.loader.error
                await cl.write_event(Synthesize(text="Downloaded and ready.").event())
                response = await collect(cl, "audio-stop")
            check_audio_format(response)
            assert response.chunks
    assert (data_dir / "hift.onnx").read_bytes() == (tiny_model_dir / "hift.onnx").read_bytes()

    # second start: every file is present, the hub is gone
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    async with running_server(settings) as server:
        assert server.runtime.loader.state is ModelState.READY, server.runtime.loader.error
        info = await describe(server)
        assert [v.installed for v in info.tts[0].voices] == [True, True]


async def test_missing_files_without_network(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """No model and no hub: describe still answers and says what the server waits for;
    synthesis names the missing files; the download is retried in the background."""
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    monkeypatch.setattr(download_wait, "DOWNLOAD_RETRY_DELAYS_S", (0.2,))
    settings = Settings(uri="tcp://127.0.0.1:0", data_dirs=(tmp_path,), warm_up=False)
    async with running_server(settings, wait_ready=False) as server:
        assert await asyncio.to_thread(server.runtime.loader.waiting_event.wait, 60)
        info = await describe(server, timeout_s=1.0)
        description = info.tts[0].description or ""
        assert "waiting to download 12 model file(s)" in description, description
        assert "unreachable" in description and "next try at" in description
        assert not any(v.installed for v in info.tts[0].voices)
        async with client(server) as cl:
            await cl.write_event(Synthesize(text="Hello.").event())
            error = await one_shot_error(cl)
        for _ in range(600):  # retried: more attempts follow without a restart
            if server.runtime.loader.download_attempts >= 3:
                break
            await asyncio.sleep(0.05)
        assert server.runtime.loader.download_attempts >= 3
        assert server.runtime.loader.state is ModelState.LOADING
    assert error.code == "model-files-missing"
    assert "llm_int8.onnx" in error.text and "campplus.onnx" in error.text
    assert str(tmp_path.absolute()) in error.text  # the directory is named absolutely


async def test_download_resumes_when_the_network_comes_back(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """First start while the hub is unreachable; the hub comes back; the server downloads and
    serves without a restart, and said in the log what it waited for."""
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    monkeypatch.setattr(download_wait, "DOWNLOAD_RETRY_DELAYS_S", (0.3, 0.6))
    caplog.set_level(logging.INFO, logger="wyoming_cosyvoice3")
    data_dir = tmp_path / "data"
    settings = Settings(uri="tcp://127.0.0.1:0", data_dirs=(data_dir,), warm_up=False, seed=1,
                        **NOT_ABOUT_THE_PRESET)
    repos = repos_from_dir(tiny_model_dir, EXPORT_REPO, UPSTREAM_REPO)
    with HubMimic(repos) as hub:
        async with running_server(settings, wait_ready=False) as server:
            assert await asyncio.to_thread(server.runtime.loader.waiting_event.wait, 60)
            assert not hub.requests
            monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # the network is back
            assert await asyncio.to_thread(server.runtime.loader.ready_event.wait, 120)
            assert server.runtime.loader.state is ModelState.READY, server.runtime.loader.error
            info = await describe(server, timeout_s=1.0)
            assert [v.installed for v in info.tts[0].voices] == [True, True]
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="Back online.").event())
                response = await collect(cl, "audio-stop")
            check_audio_format(response)
            assert response.chunks
    waits = [r.getMessage() for r in caplog.records if "Waiting to download" in r.getMessage()]
    assert waits and "12 model file(s)" in waits[0] and "trying again in" in waits[0]
