"""Helpers for the server tests that work on the wire or with the program in its own process:
events as raw bytes, reading until the server closes, and starting ``python -m
wyoming_cosyvoice3`` on a free port."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from wyoming.event import Event

READ_TIMEOUT_S = 60.0
"""Upper bound for one event to arrive (a hang guard, not a speed assertion)."""


def frame(event: Event) -> bytes:
    """One event as bytes on the wire (header line with ``data_length``, data, payload)."""
    header: dict[str, Any] = {"type": event.type}
    body = json.dumps(event.data).encode() if event.data else b""
    if body:
        header["data_length"] = len(body)
    if event.payload:
        header["payload_length"] = len(event.payload)
    return json.dumps(header).encode() + b"\n" + body + (event.payload or b"")


async def read_until_eof(reader: asyncio.StreamReader, timeout_s: float = READ_TIMEOUT_S,
                         max_events: int = 100000) -> list[Event]:
    """Every event the server sends until it closes the connection."""
    events: list[Event] = []
    for _ in range(max_events):
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        if not line:
            return events
        header = json.loads(line)
        data = header.get("data") or {}
        if header.get("data_length"):
            data.update(json.loads(await reader.readexactly(header["data_length"])))
        payload = (await reader.readexactly(header["payload_length"])
                   if header.get("payload_length") else None)
        events.append(Event(type=header["type"], data=data, payload=payload))
    raise AssertionError("too many events")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_process(port: int, model_dir: Path, data_dir: Path, *args: str,
                   stderr: Any = subprocess.PIPE,
                   program: tuple[str, ...] = ("-m", "wyoming_cosyvoice3"),
                   environment: dict[str, str] | None = None,
                   ) -> subprocess.Popen[bytes]:
    """``python -m wyoming_cosyvoice3`` (or ``python *program``) on 127.0.0.1:``port`` (no
    COSYVOICE3_* from the environment of the test run, plus ``environment``). ``data_dir``
    receives the caches, so that the shared model directory is never written to."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE3_")}
    env.update(environment or {})
    return subprocess.Popen(
        [sys.executable, *program, "--uri", f"tcp://127.0.0.1:{port}",
         "--model-dir", str(model_dir), "--data-dir", str(data_dir), *args],
        stdout=subprocess.DEVNULL, stderr=stderr, env=env,
    )


async def wait_process_ready(process: subprocess.Popen[bytes], port: int,
                             limit_s: float = 120.0, log: Path | None = None) -> None:
    """Poll the health probe until the model is loaded (hang guard ``limit_s``); when it
    does not get ready, the failure carries the program's ``log`` if given."""
    from wyoming_cosyvoice3.server.healthcheck import probe

    uri = f"tcp://127.0.0.1:{port}"
    deadline = time.monotonic() + limit_s
    problem: str | None = "not started"
    while time.monotonic() < deadline and process.poll() is None:
        problem = await probe(uri, 2.0, require_ready=True)
        if problem is None:
            return
        await asyncio.sleep(0.2)
    output = f"\n{log.read_text()}" if log is not None else ""
    raise AssertionError(f"the server did not get ready: {problem}{output}")
