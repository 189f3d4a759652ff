"""``wyoming-cosyvoice3``: start the Wyoming server (also ``python -m wyoming_cosyvoice3``).

The server listens first and loads the model in a background thread, so ``describe`` is
answered from the first second (voices report ``installed: false`` until ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from wyoming.event import async_get_stdin, async_get_stdout
from wyoming.server import AsyncServer, AsyncTcpServer

from .. import __version__
from . import addon
from .handler import CosyVoiceEventHandler, make_handler_factory
from .healthcheck import write_health_uri
from .hooks import ServerHooks
from .preload import preload
from .runtime import EngineFactory, ServerRuntime, default_engine_factory
from .settings import Settings, SettingsError, resolve_settings

if TYPE_CHECKING:
    from .web import WebServer

_LOGGER = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 4.5
"""Seconds the whole stop may take after SIGTERM: syntheses stopping, clients getting their
last events, connections closing. What is still running then is abandoned and the process
exits, so that it ends within 5 s of the signal (DEVELOPMENT.md, "Protocol behaviour";
``tests/test_server_faults.py::test_sigterm_exits_within_5_s_while_a_model_step_runs``)."""


class RunningServer:
    """A started server: the Wyoming listener plus the runtime (also used by tests).

    Args:
        settings: resolved settings (``uri`` may use port 0 for an ephemeral port).
        engine_factory: how the engine is built from the model dir.
        hooks: observer and option overrides of a tool that runs the server (:mod:`.hooks`).
    """

    def __init__(self, settings: Settings,
                 engine_factory: EngineFactory = default_engine_factory,
                 hooks: ServerHooks | None = None) -> None:
        self.settings = settings
        self.runtime = ServerRuntime(settings, engine_factory=engine_factory, hooks=hooks)
        self.server = AsyncServer.from_uri(settings.uri)
        self._zeroconf: object | None = None
        self._discovery: asyncio.Future[bool] | None = None
        self.web: WebServer | None = None
        """The voice page (``--http-port``). Imported and built here, before anything
        listens: importing aiohttp takes seconds on a small board and would hold up
        ``describe`` if done on the running loop."""
        if settings.http_port is not None:
            from .web import WebServer  # aiohttp is imported only when the page is wanted

            self.web = WebServer(self.runtime, settings.http_host, settings.http_port,
                                 settings.http_allow_from)

    @property
    def port(self) -> int | None:
        """The bound TCP port (None for unix/stdio servers or before :meth:`start`)."""
        inner = getattr(self.server, "_server", None)
        if not isinstance(self.server, AsyncTcpServer) or inner is None or not inner.sockets:
            return None
        return int(inner.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Preload (before listening: it holds the GIL), listen, then start loading the model
        in the background."""
        preload(self.settings)
        await self.server.start(make_handler_factory(self.runtime))
        _LOGGER.info("wyoming-cosyvoice3 %s listening on %s", __version__, self.settings.uri)
        self.runtime.start_loading()
        if self.web is not None:
            await self.web.start()
        if self.settings.zeroconf and self.port is not None:
            await self._announce(self.settings.zeroconf, self.port)
        if self.port is not None and os.environ.get(addon.TOKEN_VARIABLE):
            self._discovery = asyncio.ensure_future(addon.announce(self.port))
        write_health_uri(self.settings.uri, self.port)

    async def _announce(self, name: str, port: int) -> None:
        try:
            from wyoming.zeroconf import HomeAssistantZeroconf

            zeroconf = HomeAssistantZeroconf(name=name, port=port)
            await zeroconf.register_server()
            self._zeroconf = zeroconf
            _LOGGER.info("Zeroconf discovery enabled as %r", name)
        except (OSError, ImportError) as err:
            _LOGGER.warning("Zeroconf discovery is unavailable: %s", err)

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> bool:
        """Stop accepting connections, cancel in-flight syntheses (each client gets its
        ``error`` and ``audio-stop``), then close every connection; all of it within
        ``grace_s`` seconds in total.

        Returns:
            True when every synthesis thread has stopped; False when one was still inside a
            model step at the deadline (the caller then exits without waiting for it).
        """
        deadline = time.monotonic() + grace_s

        def left_s() -> float:
            return max(0.0, deadline - time.monotonic())

        self.runtime.stopping.set()
        if self.web is not None:
            await self.web.stop()
        listener = getattr(self.server, "_server", None)
        if listener is not None:
            listener.close()
        connections = list(getattr(self.server, "_handlers", {}).values())
        for connection in connections:
            if isinstance(connection, CosyVoiceEventHandler):
                connection.begin_shutdown()
        runner = self.runtime.runner
        idle = await runner.wait_idle(left_s())
        if not idle:
            _LOGGER.warning("Syntheses still running %.1f s after the stop signal; closing "
                            "anyway", grace_s)
        await _wait_answered(connections, left_s())  # their last events are written
        handlers = list(getattr(self.server, "_handlers", {}).keys())
        await self.server.stop()
        if handlers:
            _done, pending = await asyncio.wait(handlers, timeout=max(0.01, left_s()))
            for task in pending:
                task.cancel()
        self.runtime.shutdown()
        _LOGGER.info("Server stopped")
        return idle or runner.active == 0


async def _wait_answered(connections: list[object], timeout_s: float) -> None:
    """Wait (bounded by ``timeout_s``) until every connection has answered what it
    accepted."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.01) + 1):
        if all(not isinstance(c, CosyVoiceEventHandler) or c.answered or c.gone.is_set()
               for c in connections) or time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.01)


async def serve(settings: Settings,
                engine_factory: EngineFactory = default_engine_factory,
                hooks: ServerHooks | None = None) -> bool:
    """Run the server until SIGTERM or SIGINT (``hooks``: see :mod:`.hooks`).

    Returns:
        True when it stopped cleanly; False when a synthesis thread was still inside a model
        step at the end of the grace time (see :data:`SHUTDOWN_GRACE_S`).
    """
    if settings.uri.startswith("stdio://"):
        await serve_stdio(settings, hooks)
        return True
    running = RunningServer(settings, engine_factory=engine_factory, hooks=hooks)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    await running.start()
    try:
        await stop.wait()
        _LOGGER.info("Stopping")
    finally:
        clean = await running.stop()
    return clean


async def serve_stdio(settings: Settings, hooks: ServerHooks | None = None) -> None:
    """One connection over stdin/stdout (logs go to stderr); ends at the end of stdin, after
    every request read so far was answered."""
    runtime = ServerRuntime(settings, hooks=hooks)
    preload(settings)
    runtime.start_loading()
    reader = await async_get_stdin()
    writer = await async_get_stdout()
    try:
        await make_handler_factory(runtime)(reader, writer).run()
    finally:
        runtime.shutdown()


def setup_logging(settings: Settings) -> None:
    """Root logging at INFO (DEBUG with ``--debug``) in ``--log-format``."""
    logging.basicConfig(level=logging.DEBUG if settings.debug else logging.INFO,
                        format=settings.log_format)


def main(argv: Sequence[str] | None = None,
         engine_factory: EngineFactory = default_engine_factory,
         hooks: ServerHooks | None = None) -> int:
    """Console entry point; returns the process exit code. ``hooks`` (:mod:`.hooks`) are
    for a tool that runs the server in its own process; the console script passes none.

    When a synthesis thread is still inside a model step after the grace time, the process
    ends at once with code 0 (``os._exit`` after flushing the log): the interpreter would
    otherwise wait for that worker thread at exit.
    """
    try:
        settings = resolve_settings(argv)
    except SettingsError as err:
        print(f"wyoming-cosyvoice3: error: {err}", file=sys.stderr)
        return 2
    setup_logging(settings)
    try:
        clean = asyncio.run(serve(settings, engine_factory, hooks))
    except KeyboardInterrupt:
        clean = True
    except OSError as err:  # e.g. the port is taken
        _LOGGER.error("Cannot serve on %s: %s", settings.uri, err)
        return 1
    if not clean:
        _LOGGER.warning("Exiting without waiting for the model step still running")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
