"""The program as a user starts it: ``python -m wyoming_cosyvoice3 --uri ... --model-dir ...``
in its own process, probed by the container health check, spoken to over TCP, stopped with
SIGTERM. (SIGTERM during a synthesis: tests/test_server_faults.py, with a stream in flight and
a request queued, and with a one-shot request inside a long model step.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from server_support import collect, link_engine_cache
from wire_support import free_port, wait_process_ready
from wyoming.client import AsyncTcpClient
from wyoming.event import async_read_event, async_write_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize

STARTUP_LIMIT_S = 120.0
"""Hang guard for the model to load in the child process."""


async def test_started_as_the_readme_says(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE3_")}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "wyoming_cosyvoice3", "--uri", uri,
             "--model-dir", str(tiny_model_dir), "--data-dir", str(tmp_path / "data")],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        try:
            # the listener comes up before the model: describe answers, voices not yet ready
            await wait_process_ready(process, port, STARTUP_LIMIT_S, log=log_path)

            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Describe().event())
                info = Info.from_event(await asyncio.wait_for(client.read_event(), 10))
                assert [v.name for v in info.tts[0].voices if v.installed] == ["zh-female",
                                                                                "en-male"]
                await client.write_event(
                    Synthesize(text="The living room lights are now on.").event()
                )
                response = await collect(client, "audio-stop")
            assert response.types[0] == "audio-start"
            assert len(response.chunks) > 2
            assert {(c.rate, c.width, c.channels) for c in response.chunks} == {(24000, 2, 1)}
            assert len(response.pcm) % 2 == 0 and len(response.pcm) > 24000
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
    output = log_path.read_text()
    assert code == 0, output
    assert "Traceback" not in output
    assert "synthesize done: voice=zh-female chars=34" in output  # the one INFO request line
    # the prepared voices were cached in the first data dir
    assert len(list((tmp_path / "data" / "voice-cache").glob("*"))) >= 2


def test_version_and_help() -> None:
    result = subprocess.run([sys.executable, "-m", "wyoming_cosyvoice3", "--version"],
                            capture_output=True, text=True, timeout=60, check=True)
    from wyoming_cosyvoice3 import __version__

    assert result.stdout.strip() == __version__
    result = subprocess.run([sys.executable, "-m", "wyoming_cosyvoice3", "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    assert "COSYVOICE3_VOICE" in result.stdout and "--max-concurrent" in result.stdout
    result = subprocess.run([sys.executable, "-m", "wyoming_cosyvoice3"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "HOME": "/nonexistent"})
    assert result.returncode == 2 and "--data-dir" in result.stderr


async def test_stdio_uri(tiny_model_dir: Path, tiny_engine_cache: Path,
                         tmp_path: Path) -> None:
    """``--uri stdio://``: events on stdin/stdout, logs on stderr, ends with stdin."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE3_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "wyoming_cosyvoice3", "--uri", "stdio://", "--model-dir",
        str(tiny_model_dir), "--data-dir",
        str(link_engine_cache(tmp_path / "data", tiny_engine_cache)), "--no-warm-up",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=env,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        response: list[str] = []
        for _ in range(int(STARTUP_LIMIT_S / 0.5)):  # until the model is loaded
            await async_write_event(Synthesize(text="Over a pipe.").event(), process.stdin)
            first = await asyncio.wait_for(async_read_event(process.stdout), 30)
            assert first is not None
            if first.type == "audio-start":
                response = [first.type]
                break
            assert first.type == "error" and first.data["code"] == "model-loading"
            stop = await asyncio.wait_for(async_read_event(process.stdout), 30)
            assert stop is not None and stop.type == "audio-stop"
            await asyncio.sleep(0.5)
        for _ in range(10000):
            event = await asyncio.wait_for(async_read_event(process.stdout), 30)
            assert event is not None
            response.append(event.type)
            if event.type == "audio-stop":
                break
        assert response[0] == "audio-start" and response[-1] == "audio-stop"
        assert response.count("audio-chunk") > 2
        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
