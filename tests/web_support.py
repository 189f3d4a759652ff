"""Helpers for the voice page tests: a real HTTP client (aiohttp) against a running server."""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import soundfile as sf
import yaml
from aiohttp import web

from synthetic.audio import speech_like
from wyoming_cosyvoice3.server.cli import RunningServer

CHANGE = {"X-Voice-Page": "1"}
"""The header the page sends with every change (required by the server)."""


def page_url(server: RunningServer, path: str = "") -> str:
    assert server.web is not None and server.web.port is not None, "the page is not running"
    return f"http://127.0.0.1:{server.web.port}/{path}"


def clip_bytes(seconds: float = 3.0, rate_hz: int = 24000, fmt: str = "WAV",
               subtype: str | None = None, channels: int = 1, seed: int = 0,
               silent: bool = False) -> bytes:
    """An encoded speech-like clip (soundfile writes it in ``fmt``)."""
    samples = speech_like(seconds, rate_hz, seed=seed)
    if silent:
        samples = np.zeros_like(samples)
    if channels > 1:
        samples = np.stack([samples] * channels, axis=1)
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate_hz, format=fmt, subtype=subtype)
    return buffer.getvalue()


def voice_form(name: str | None, clip: bytes | None, filename: str = "clip.wav",
               languages: str = "de, en", **fields: str) -> aiohttp.FormData:
    """The multipart form the page sends (text fields + the clip as a file part)."""
    form = aiohttp.FormData()
    if name is not None:
        form.add_field("name", name)
    form.add_field("languages", languages)
    for key, value in fields.items():
        form.add_field(key, value)
    if clip is not None:
        form.add_field("clip", clip, filename=filename, content_type="application/octet-stream")
    return form


async def add_voice(session: aiohttp.ClientSession, server: RunningServer, name: str,
                    clip: bytes, **fields: Any) -> tuple[int, dict[str, Any]]:
    async with session.post(page_url(server, "api/voices"), headers=CHANGE,
                            data=voice_form(name, clip, **fields)) as response:
        return response.status, await response.json()


async def delete_voice(session: aiohttp.ClientSession, server: RunningServer,
                       name: str) -> tuple[int, dict[str, Any]]:
    async with session.delete(page_url(server, f"api/voices/{name}"),
                              headers=CHANGE) as response:
        return response.status, await response.json()


async def listing(session: aiohttp.ClientSession, server: RunningServer) -> dict[str, Any]:
    async with session.get(page_url(server, "api/voices")) as response:
        assert response.status == 200
        data: dict[str, Any] = await response.json()
        return data


def catalog_items(data_dir: Path) -> list[dict[str, Any]]:
    """The ``voices`` list of ``<data_dir>/voices.yaml`` ([] when there is no file)."""
    path = data_dir / "voices.yaml"
    if not path.exists():
        return []
    items: list[dict[str, Any]] = yaml.safe_load(path.read_text(encoding="utf-8"))["voices"]
    return items


def pcm_of_wav_stream(body: bytes) -> np.ndarray:
    """The int16 samples after the 44-byte streaming WAV header (checked)."""
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt ", body[:16]
    assert body[36:40] == b"data"
    assert int.from_bytes(body[22:24], "little") == 1  # mono
    assert int.from_bytes(body[24:28], "little") == 24000
    assert int.from_bytes(body[34:36], "little") == 16
    return np.frombuffer(body[44:], dtype="<i2")


INGRESS_PREFIX = "/api/hassio_ingress/test-token"
"""Path under which the stand-in ingress proxy serves the page (as Home Assistant does)."""
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "host",
               "content-length", "te", "trailer", "proxy-authorization", "proxy-authenticate"}


@contextlib.asynccontextmanager
async def ingress_proxy(target: str) -> AsyncIterator[str]:
    """A reverse proxy shaped like Home Assistant's ingress: the page appears under
    ``INGRESS_PREFIX/`` of another origin, the prefix is stripped, requests and answers are
    streamed, ``X-Ingress-Path`` is added. Yields the page's URL through the proxy."""
    session = aiohttp.ClientSession(auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["X-Ingress-Path"] = INGRESS_PREFIX
        async with session.request(
            request.method, f"{target}/{request.match_info['tail']}", params=request.query,
            headers=headers, data=request.content if request.body_exists else None,
            allow_redirects=False,
        ) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 27)
    app.router.add_route("*", INGRESS_PREFIX + "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}{INGRESS_PREFIX}/"
    finally:
        await runner.cleanup()
        await session.close()
