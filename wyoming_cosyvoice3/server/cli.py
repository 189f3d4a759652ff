"""``wyoming-cosyvoice3``: start the Wyoming server (also ``python -m wyoming_cosyvoice3``).

The server listens first and loads the model in a background thread, so ``describe`` is
answered from the first second (voices report ``installed: false`` until ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from wyoming.event import async_get_stdin, async_get_stdout
from wyoming.server import AsyncServer, AsyncTcpServer

from .. import __version__
from .handler import CosyVoiceEventHandler, make_handler_factory
from .runtime import EngineFactory, ServerRuntime, default_engine_factory
from .settings import Settings, SettingsError, resolve_settings

_LOGGER = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
"""Seconds in-flight requests get to stop after SIGTERM before the process exits."""


class RunningServer:
    """A started server: the Wyoming listener plus the runtime (also used by tests).

    Args:
        settings: resolved settings (``uri`` may use port 0 for an ephemeral port).
        engine_factory: how the engine is built from the model dir.
    """

    def __init__(self, settings: Settings,
                 engine_factory: EngineFactory = default_engine_factory) -> None:
        self.settings = settings
        self.runtime = ServerRuntime(settings, engine_factory=engine_factory)
        self.server = AsyncServer.from_uri(settings.uri)
        self._zeroconf: object | None = None

    @property
    def port(self) -> int | None:
        """The bound TCP port (None for unix/stdio servers or before :meth:`start`)."""
        inner = getattr(self.server, "_server", None)
        if not isinstance(self.server, AsyncTcpServer) or inner is None or not inner.sockets:
            return None
        return int(inner.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Listen, then start loading the model in the background."""
        await self.server.start(make_handler_factory(self.runtime))
        _LOGGER.info("wyoming-cosyvoice3 %s listening on %s", __version__, self.settings.uri)
        self.runtime.start_loading()
        if self.settings.zeroconf and self.port is not None:
            await self._announce(self.settings.zeroconf, self.port)

    async def _announce(self, name: str, port: int) -> None:
        try:
            from wyoming.zeroconf import HomeAssistantZeroconf

            zeroconf = HomeAssistantZeroconf(name=name, port=port)
            await zeroconf.register_server()
            self._zeroconf = zeroconf
            _LOGGER.info("Zeroconf discovery enabled as %r", name)
        except (OSError, ImportError) as err:
            _LOGGER.warning("Zeroconf discovery is unavailable: %s", err)

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop accepting connections, cancel in-flight syntheses (each client gets its
        ``error`` and ``audio-stop``), then close every connection."""
        self.runtime.stopping.set()
        listener = getattr(self.server, "_server", None)
        if listener is not None:
            listener.close()
        connections = list(getattr(self.server, "_handlers", {}).values())
        for connection in connections:
            if isinstance(connection, CosyVoiceEventHandler):
                connection.begin_shutdown()
        if not await self.runtime.wait_idle(grace_s):
            _LOGGER.warning("Syntheses still running after %.0f s; closing anyway", grace_s)
        await _wait_answered(connections, grace_s)  # their last events are written
        handlers = list(getattr(self.server, "_handlers", {}).keys())
        await self.server.stop()
        if handlers:
            _done, pending = await asyncio.wait(handlers, timeout=grace_s)
            for task in pending:
                task.cancel()
        self.runtime.shutdown()
        _LOGGER.info("Server stopped")


async def _wait_answered(connections: list[object], timeout_s: float) -> None:
    """Wait (bounded) until every connection has answered what it accepted."""
    for _ in range(int(timeout_s / 0.01) + 1):
        if all(not isinstance(c, CosyVoiceEventHandler) or c.answered or c.gone.is_set()
               for c in connections):
            return
        await asyncio.sleep(0.01)


async def serve(settings: Settings) -> None:
    """Run the server until SIGTERM or SIGINT."""
    if settings.uri.startswith("stdio://"):
        await serve_stdio(settings)
        return
    running = RunningServer(settings)
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
        await running.stop()


async def serve_stdio(settings: Settings) -> None:
    """One connection over stdin/stdout (logs go to stderr); ends at the end of stdin, after
    every request read so far was answered."""
    runtime = ServerRuntime(settings)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit code."""
    try:
        settings = resolve_settings(argv)
    except SettingsError as err:
        print(f"wyoming-cosyvoice3: error: {err}", file=sys.stderr)
        return 2
    setup_logging(settings)
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        pass
    except OSError as err:  # e.g. the port is taken
        _LOGGER.error("Cannot serve on %s: %s", settings.uri, err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
