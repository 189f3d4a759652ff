"""The voice page's HTTP server (aiohttp), running on the Wyoming server's event loop.

Routes (all answers of ``/api`` are JSON except the audio):

=========================================  ==================================================
``GET /``                                   the page (``static/index.html``)
``GET /static/{file}``                      its script and style sheet (a fixed set of names)
``GET /api/voices``                         model state and every voice
``POST /api/voices``                        add a voice (multipart form: name, description,
                                            languages, transcript, instruction, clip)
``PUT /api/voices/{name}``                  edit a voice (the same form; clip optional)
``DELETE /api/voices/{name}``               delete a voice
``GET /api/voices/{name}/preview?text=``    the text spoken in that voice, streamed WAV
``GET /api/voices/{name}/clip``             the voice's reference clip
=========================================  ==================================================

No authentication (like the Wyoming port): the page listens on 127.0.0.1 unless
``--http-host`` says otherwise; ``--http-allow-from`` limits the client addresses (the add-on
answers only Home Assistant's ingress proxy). Two guards keep other web sites out of it:
requests that change something must carry the header ``X-Voice-Page: 1`` (a cross-site page
cannot send it without a CORS preflight, which is never granted), and while bound to a
loopback address only ``localhost``/``127.0.0.1``/``[::1]`` host names are answered (against
DNS rebinding).
No part of a URL or form is ever used as a file path: static files come from a fixed table,
clips are named after the validated voice name.
"""

from __future__ import annotations

import ipaddress
import logging
import mimetypes
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

from aiohttp import web

from ..runtime import ServerRuntime
from .admin import VoiceAdmin
from .errors import Forbidden, PageError
from .preview import preview_text, stream_preview
from .uploads import read_form

_LOGGER = logging.getLogger(__name__)

CHANGE_HEADER = "X-Voice-Page"
"""Header every changing request must carry (value ``1``); see the module docstring."""
STATIC_FILES = {"index.html": "text/html", "app.js": "text/javascript",
                "style.css": "text/css"}
"""The only files the page serves, read once from the package at start."""
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # 'self' framing only: Home Assistant's ingress shows the page in a same-origin iframe
    "Content-Security-Policy": "default-src 'self'; media-src 'self' blob:; "
                               "frame-ancestors 'self'; form-action 'self'",
}
FORM_OVERHEAD_BYTES = 1 << 20
"""Bytes allowed on top of ``--max-clip-bytes`` for the text fields and multipart framing."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``)."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _client_allowed(remote: str | None, networks: Sequence[Any]) -> bool:
    try:
        address = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in networks)


def build_app(runtime: ServerRuntime, loopback_only: bool,
              allow_from: Sequence[str] = ()) -> web.Application:
    """The aiohttp application of the voice page.

    Args:
        runtime: the server's parts: the voice table the page shows and changes (through
            its methods), the model loader's state, the runner that speaks previews.
        loopback_only: answer only requests addressed to a loopback host name.
        allow_from: when not empty, answer only clients in these addresses / networks
            (``--http-allow-from``, e.g. the add-on's ingress proxy 172.30.32.2).
    """
    settings = runtime.settings
    admin = VoiceAdmin(settings, runtime.loader, runtime.voices)
    networks = [ipaddress.ip_network(item, strict=False) for item in allow_from]
    package = resources.files(__package__).joinpath("static")
    static = {name: package.joinpath(name).read_bytes() for name in STATIC_FILES}

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if networks and not _client_allowed(request.remote, networks):
                raise Forbidden("this address may not use the voice page (--http-allow-from)")
            if loopback_only and not _is_loopback(_host_name(request.host)):
                raise Forbidden("the voice page answers only to localhost / 127.0.0.1; open "
                                "it at http://127.0.0.1:<port>/ (or start with --http-host)")
            if (request.method not in ("GET", "HEAD", "OPTIONS")
                    and request.headers.get(CHANGE_HEADER) != "1"):
                raise Forbidden(f"changes need the header {CHANGE_HEADER}: 1 (sent by the page)")
            response = await handler(request)
        except PageError as err:
            if err.status == 500:
                _LOGGER.warning("Voice page %s %s: %s", request.method, request.path, err)
            response = web.json_response({"error": str(err)}, status=err.status)
        except web.HTTPException:
            raise  # aiohttp's own answers (404 of an unknown route, 413 of an oversized body)
        except OSError as err:  # e.g. a read-only or full data dir
            _LOGGER.warning("Voice page %s %s: %s", request.method, request.path, err)
            response = web.json_response(
                {"error": f"the server could not read or write a file: {err}"}, status=500)
        except Exception:  # a bug: logged with its traceback; the page and the server go on
            _LOGGER.exception("Voice page %s %s failed", request.method, request.path)
            response = web.json_response(
                {"error": "the server failed unexpectedly; see its log"}, status=500)
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        return response

    def page_file(name: str) -> web.Response:
        return web.Response(body=static[name], content_type=STATIC_FILES[name],
                            headers={"Cache-Control": "no-cache"})

    async def index(request: web.Request) -> web.StreamResponse:
        return page_file("index.html")

    async def static_file(request: web.Request) -> web.StreamResponse:
        name = request.match_info["file"]
        if name not in static or name == "index.html":
            raise web.HTTPNotFound()
        return page_file(name)

    async def list_voices(request: web.Request) -> web.StreamResponse:
        return web.json_response(await admin.listing())

    async def add_voice(request: web.Request) -> web.StreamResponse:
        form = await read_form(request, admin.max_clip_bytes)
        voice = await admin.add(form)
        _LOGGER.info("Voice %r added on the voice page", voice["name"])
        return web.json_response(voice, status=201)

    async def edit_voice(request: web.Request) -> web.StreamResponse:
        form = await read_form(request, admin.max_clip_bytes)
        voice = await admin.edit(request.match_info["name"], form)
        _LOGGER.info("Voice %r changed on the voice page", voice["name"])
        return web.json_response(voice)

    async def delete_voice(request: web.Request) -> web.StreamResponse:
        await admin.delete(request.match_info["name"])
        return web.json_response({"deleted": request.match_info["name"]})

    async def preview(request: web.Request) -> web.StreamResponse:
        text = preview_text(request.query.get("text"), settings.limits.max_text_chars)
        return await stream_preview(request, runtime, request.match_info["name"], text)

    async def clip(request: web.Request) -> web.StreamResponse:
        path = admin.clip_path(request.match_info["name"])
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return web.FileResponse(path, headers={"Content-Type": content_type,
                                               "Cache-Control": "no-store"})

    app = web.Application(middlewares=[guard],
                          client_max_size=admin.max_clip_bytes + FORM_OVERHEAD_BYTES)
    app.add_routes([
        web.get("/", index),
        web.get("/static/{file}", static_file),
        web.get("/api/voices", list_voices),
        web.post("/api/voices", add_voice),
        web.put("/api/voices/{name}", edit_voice),
        web.delete("/api/voices/{name}", delete_voice),
        web.get("/api/voices/{name}/preview", preview),
        web.get("/api/voices/{name}/clip", clip),
    ])
    return app


class WebServer:
    """The voice page's listener (start after the Wyoming server, stop before it).

    Args:
        runtime: the server runtime.
        host: address to bind (``--http-host``, default 127.0.0.1).
        port: TCP port (``--http-port``; 0 picks a free one, see :attr:`port`).
        allow_from: client addresses / networks answered (``--http-allow-from``; empty: all).
    """

    def __init__(self, runtime: ServerRuntime, host: str, port: int,
                 allow_from: Sequence[str] = ()) -> None:
        self.host = host
        self.requested_port = port
        app = build_app(runtime, _is_loopback(host), allow_from)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        self._site: web.TCPSite | None = None

    @property
    def port(self) -> int | None:
        """The bound port once started."""
        server: Any = self._site._server if self._site is not None else None
        if server is None or not server.sockets:
            return None
        return int(server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and serve (raises OSError when the port is taken)."""
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.requested_port)
        await self._site.start()
        shown = f"[{self.host}]" if ":" in self.host else self.host
        _LOGGER.info("Voice page on http://%s:%s/ (no authentication%s)", shown, self.port,
                     "" if _is_loopback(self.host) else "; reachable from the network")

    async def stop(self) -> None:
        """Close the listener and running page requests."""
        await self._runner.cleanup()
