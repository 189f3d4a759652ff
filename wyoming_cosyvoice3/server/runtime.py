"""The server's parts, composed: the model loader, the voice table and the synthesis runner.

Each part has its own module and knows nothing of the others' insides:

- :class:`.model_loader.ModelLoader`: the model's state, its download (retried while files
  cannot be fetched), the preset choice (``--preset auto``), the warm-up, the request options;
- :class:`.voice_table.VoiceTable`: every catalog voice and its prompt; the only writer of
  the table (start-up preparation, the voice page's reloads);
- :class:`.runner.SynthesisRunner`: worker threads, admission and cancellation; it asks the
  loader for the engine (``require_ready``) at each synthesis.

:class:`ServerRuntime` wires them together with what the connections share (the connection
count, the piece gate's production history, the observer, the stop flag). Nothing inherits
from anything: a connection, ``describe`` or the voice page use the part they need.
"""

from __future__ import annotations

import logging
import threading

from .engine_port import (
    EngineFactory,
    ModelLocator,
    default_engine_factory,
    default_model_locator,
)
from .hooks import ServerHooks, ServerObserver
from .model_loader import ModelLoader
from .preroll import ProductionHistory
from .protocol import VoiceRequest
from .runner import SynthesisRunner
from .settings import Settings
from .voice_table import VoiceSlot, VoiceTable

_LOGGER = logging.getLogger(__name__)


class ConnectionCounter:
    """Counts open connections against ``max_connections`` (thread-safe, never negative)."""

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        """Connections holding a slot right now."""
        return self._open

    def try_open(self) -> bool:
        """Take a slot; False when ``maximum`` are already open."""
        with self._lock:
            if self._open >= self.maximum:
                return False
            self._open += 1
            return True

    def close(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._open = max(0, self._open - 1)


class ServerRuntime:
    """The three parts and what all connections share. Create it, then call
    :meth:`start_loading`.

    Args:
        settings: the resolved settings.
        engine_factory: builds the engine from a model dir (tests pass a wrapper).
        model_locator: finds or downloads the model dir (runs in the loader thread).
        hooks: an observer and synthesis option overrides installed by a tool that runs the
            server in its own process (:mod:`.hooks`; the benchmark); none by default.
    """

    def __init__(
        self,
        settings: Settings,
        engine_factory: EngineFactory = default_engine_factory,
        model_locator: ModelLocator = default_model_locator,
        hooks: ServerHooks | None = None,
    ) -> None:
        hooks = hooks if hooks is not None else ServerHooks()
        self.settings = settings
        self.stopping = threading.Event()
        """Set on shutdown: stops a running download and every synthesis."""
        self.production = ProductionHistory()
        """Recent production rate and piece lengths (the piece gate's prior, :mod:`.preroll`)."""
        self.observer: ServerObserver | None = hooks.observer
        """Who watches (:attr:`ServerHooks.observer <.hooks.ServerHooks.observer>`), else
        None; the engine gets it as its observer, and the server reports each response's
        piece boundaries to it (``response_pieces``)."""
        self.voices = VoiceTable(settings)
        self.loader = ModelLoader(settings, self.voices, self.production, self.stopping,
                                  engine_factory, model_locator, hooks)
        self.runner = SynthesisRunner(settings, self.loader.require_ready, self.stopping)
        self.connections = ConnectionCounter(settings.limits.max_connections)
        """Open client connections (``max_connections``)."""
        self.refused_connections = 0

    def start_loading(self) -> threading.Thread:
        """Start the loader thread (once)."""
        return self.loader.start()

    def choose_voice(self, request: VoiceRequest) -> VoiceSlot:
        """Check that the model is ready and pick the request's voice.

        Raises:
            CosyVoiceError: coded; the model is not ready or the voice is unknown / disabled.
        """
        self.loader.require_ready()
        return self.voices.select(request)

    def note_refused_connection(self, peer: str) -> None:
        """Count (and log, sparsely) a connection refused for ``max_connections``."""
        self.refused_connections += 1
        count = self.refused_connections
        if count & (count - 1) == 0:  # 1st, 2nd, 4th, 8th...: a flood does not flood the log
            _LOGGER.warning("Refused connection from %s: %d connections are open (refused so "
                            "far: %d; raise --max-connections?)", peer, self.connections.open,
                            count)

    def shutdown(self) -> None:
        """Stop loading, the worker threads (queued calls are dropped) and the engine's voice
        encoder process (a voice preparation in flight fails)."""
        self.stopping.set()
        self.runner.shutdown()
        self.loader.close()


__all__ = ["ConnectionCounter", "ServerRuntime"]
