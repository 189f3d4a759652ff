"""Shared server state: the engine, the prepared voices, and the worker threads that run it.

The model is located (downloaded if needed) and loaded in a background thread after the server
listens, so ``describe`` is answered at once: state LOADING -> READY, or FAILED with the reason.
A download that cannot be done now (no network, hub down, disk full, offline mode with files
missing) is tried again in the background with backoff (:mod:`.download_wait`)
while the state stays LOADING and ``describe`` says what the server waits for: no restart is
needed when the network comes back or the files are copied in.
Engine work never runs on the event loop: syntheses run in worker threads
(:mod:`.synthesis_runner`), and new voices are prepared in the engine's voice encoder process
(``EngineOptions.voice_process``), so nothing of a preparation holds this interpreter's lock.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from pathlib import Path

from ..engine.errors import CosyVoiceError, ModelFilesMissing, ModelNotReady
from ..engine.options import PRESET_LLM_GRAPHS, EngineOptions, LlmGraph, SynthesisOptions
from . import download_wait
from .catalog import load_catalogs, with_model_dir
from .engine_port import (
    Engine,
    EngineFactory,
    ModelLocator,
    default_engine_factory,
    default_model_locator,
)
from .hooks import ServerHooks, ServerObserver
from .limits import ConnectionCounter
from .machine import (
    AUTO,
    FALLBACK_PRESET,
    SEED_WORK_S,
    PresetChoice,
    choose_for_this_machine,
)
from .preroll import ProductionHistory
from .settings import Settings
from .synthesis_runner import ServerBusy, SynthesisRunner
from .voice_slots import VoiceSlot, prepare_slot

_LOGGER = logging.getLogger(__name__)


class ModelState(enum.Enum):
    """Life cycle of the model."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class ServerRuntime(SynthesisRunner):
    """State shared by all connections. Create it, then call :meth:`start_loading`.

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
        super().__init__(settings)
        self.hooks = hooks if hooks is not None else ServerHooks()
        self._engine_factory = engine_factory
        self._model_locator = model_locator
        self._lock = threading.Lock()
        self.state = ModelState.LOADING
        self.phase = "starting"
        self.error: CosyVoiceError | None = None
        self.engine: Engine | None = None
        self.model_dir: Path | None = settings.model_dir
        entries = load_catalogs(settings.data_dirs, settings.model_dir, settings.voices_file)
        self.voices: dict[str, VoiceSlot] = {e.name: VoiceSlot(e, None, e.problem)
                                             for e in entries}
        self.connections = ConnectionCounter(settings.limits.max_connections)
        """Open client connections (``max_connections``)."""
        self.refused_connections = 0
        self._loader: threading.Thread | None = None
        self._built_engine: Engine | None = None
        self.ready_event = threading.Event()
        """Set when loading ended (READY or FAILED)."""
        self.download_problem: ModelFilesMissing | None = None
        """Why the model files could not be fetched at the last attempt (None: no problem)."""
        self.download_attempts = 0
        self.waiting_event = threading.Event()
        """Set once a download attempt failed and a retry is scheduled."""
        self.preset = FALLBACK_PRESET if settings.preset == AUTO else settings.preset
        """The preset requests run with: ``--preset``, or what ``auto`` chose at start (until
        then :data:`.machine.FALLBACK_PRESET`)."""
        self.preset_choice: PresetChoice | None = None
        """What ``--preset auto`` chose and predicted (None: a preset was given)."""
        self.production = ProductionHistory()
        """Recent production rate and piece lengths (the piece gate's prior, :mod:`.preroll`)."""
        self.observer: ServerObserver | None = self.hooks.observer
        """Who watches (:attr:`ServerHooks.observer <.hooks.ServerHooks.observer>`), else
        None; the engine gets it as its observer, and the server reports each response's
        piece boundaries to it (``response_pieces``)."""

    # --- loading ------------------------------------------------------------------------

    def start_loading(self) -> threading.Thread:
        """Start the loader thread (once)."""
        if self._loader is None:
            self._loader = threading.Thread(target=self._load, name="cosyvoice3-loader",
                                            daemon=True)
            self._loader.start()
        return self._loader

    def _load(self) -> None:
        started = time.monotonic()
        try:
            located = self._locate_model()
            if located is None:
                return  # stopping
            model_dir = self.model_dir = located
            if self.settings.preset == AUTO:  # before loading: the preset picks the graphs
                self.phase = "measuring this machine"
                self._choose_preset()
            self.phase = "loading the model"
            options = EngineOptions(
                llm_precision=self.settings.llm_precision,  # type: ignore[arg-type]
                llm_graph=self.llm_graph(),
                threads=self.settings.threads,
                providers=self.settings.providers,
                voice_cache_dir=self.settings.cache_dir,
                voice_process=True,  # voice encoders never load in this process
                cache_dir=self.settings.engine_cache_dir,
                preset=self.synthesis_options(),  # its DiT graphs are opened at start
                observer=self.observer,
            )
            engine = self._built_engine = self._engine_factory(model_dir, options)
            self.phase = "preparing voices"
            self._prepare_voices(engine, model_dir)
            release = getattr(engine, "release_voice_encoders", None)
            if callable(release):  # the voice encoder process exits before the warm-up
                release()
            if not any(slot.installed for slot in self.voices.values()):
                _LOGGER.error("No voice could be prepared; synthesis requests will fail")
            if self.settings.warm_up:
                self.phase = "warming up"
                self._warm_up(engine)
        except CosyVoiceError as err:
            self._fail(err)
            return
        except Exception as err:  # the loader must always end in READY or FAILED
            _LOGGER.exception("Loading the model failed")
            self._fail(CosyVoiceError(f"loading the model failed: {err}"))
            return
        with self._lock:
            self.engine = engine
            self.state = ModelState.READY
            self.phase = "ready"
        self.ready_event.set()
        installed = [name for name, slot in self.voices.items() if slot.installed]
        default = self.default_voice_slot()
        _LOGGER.info("Model ready in %.1f s from %s; voices: %s (default %s)",
                     time.monotonic() - started, model_dir, ", ".join(installed) or "(none)",
                     default.entry.name if default else "-")
        if self.settings.voice and (default is None or default.entry.name != self.settings.voice):
            _LOGGER.warning("Default voice %r is not available; using %s", self.settings.voice,
                            default.entry.name if default else "none")

    def _choose_preset(self) -> None:
        """Resolve ``--preset auto`` (:func:`.machine.choose_for_this_machine`, about 1 s of
        onnxruntime work in this loader thread) and log the prediction in one line."""
        choice = choose_for_this_machine(self.settings.threads)
        self.preset_choice, self.preset = choice, choice.preset
        rtf = choice.predicted_rtf.get(choice.preset)
        if rtf:  # the piece gate's prior until responses are measured (no request runs yet)
            self.production.add_response(SEED_WORK_S / rtf, SEED_WORK_S)
        _LOGGER.info("%s", choice.summary())

    def _locate_model(self) -> Path | None:
        """The model dir, downloading it; retried with backoff while files cannot be fetched
        (None when the server stops while waiting). A given ``--model-dir`` is not retried."""
        while True:
            self.phase = "checking or downloading the model files"
            self.download_attempts += 1
            try:
                model_dir = self._model_locator(self.settings, self.stopping.is_set)
            except ModelFilesMissing as err:
                if self.settings.model_dir is not None:
                    raise
                delay_s = download_wait.retry_delay_s(self.download_attempts)
                with self._lock:
                    self.download_problem = err
                    self.phase = download_wait.waiting_phase(err, delay_s)
                download_wait.log_waiting(err, self.download_attempts, delay_s)
                self.waiting_event.set()
                if self.stopping.wait(delay_s):
                    return None
                continue
            with self._lock:
                self.download_problem = None
            return model_dir

    def _fail(self, err: CosyVoiceError) -> None:
        _LOGGER.error("Model unavailable: %s", err)
        with self._lock:
            self.error = err
            self.state = ModelState.FAILED
            self.phase = "failed"
        self.ready_event.set()

    def _prepare_voices(self, engine: Engine, model_dir: Path) -> None:
        entries = with_model_dir([slot.entry for slot in self.voices.values()], model_dir)
        for entry in entries:  # updated in place: the table keeps its slots and order
            done = prepare_slot(engine, entry, self.settings.limits.max_clip_bytes)
            slot = self.voices[entry.name]
            slot.entry, slot.prompt, slot.problem = done.entry, done.prompt, done.problem

    def _warm_up(self, engine: Engine) -> None:
        voice = self.default_voice_slot()
        if voice is None or voice.prompt is None:
            return
        warm_up = getattr(engine, "warm_up", None)
        started = time.monotonic()
        try:
            if callable(warm_up):  # with the preset: its graphs and Euler schedule get warm
                warm_up(voice.prompt, self.synthesis_options())
            else:
                for _ in engine.synthesize("Hello.", voice.prompt, self.synthesis_options()):
                    pass
        except CosyVoiceError as err:
            _LOGGER.warning("Warm-up failed (requests will still be tried): %s", err)
            return
        _LOGGER.debug("Warm-up took %.2f s", time.monotonic() - started)

    def note_refused_connection(self, peer: str) -> None:
        """Count (and log, sparsely) a connection refused for ``max_connections``."""
        self.refused_connections += 1
        count = self.refused_connections
        if count & (count - 1) == 0:  # 1st, 2nd, 4th, 8th...: a flood does not flood the log
            _LOGGER.warning("Refused connection from %s: %d connections are open (refused so "
                            "far: %d; raise --max-connections?)", peer, self.connections.open,
                            count)

    # --- voices ---------------------------------------------------------------------------

    def default_voice_slot(self) -> VoiceSlot | None:
        """``--voice`` when usable, else the first installed voice (or None)."""
        wanted = self.settings.voice
        if wanted and wanted in self.voices and self.voices[wanted].installed:
            return self.voices[wanted]
        return next((slot for slot in self.voices.values() if slot.installed), None)

    def require_ready(self) -> Engine:
        """The engine, or raise a coded error saying why synthesis is not possible yet."""
        with self._lock:
            if self.state is ModelState.READY and self.engine is not None:
                return self.engine
            if self.state is ModelState.FAILED and self.error is not None:
                raise self.error
            if self.download_problem is not None:
                raise self.download_problem  # names the files and how to fix it
        raise ModelNotReady(
            f"the model is still loading ({self.phase}); try again in a moment"
        )

    def llm_graph(self) -> LlmGraph:
        """The LLM graph to load: ``--llm-graph``, or for ``preset`` the one of the preset
        chosen (:data:`~..engine.options.PRESET_LLM_GRAPHS`)."""
        if self.settings.llm_graph == "preset":
            return PRESET_LLM_GRAPHS.get(self.preset, "fused")
        return self.settings.llm_graph  # type: ignore[return-value]

    def synthesis_options(self, seed: int | None = None) -> SynthesisOptions:
        """Per-request options: the preset with ``--speed``, the seed and the time limit."""
        from ..engine.options import PRESETS

        base = PRESETS.get(self.preset, SynthesisOptions()).replace(
            **self.hooks.synthesis_overrides)
        return base.replace(
            speed=self.settings.speed,
            seed=seed if seed is not None else base.seed,
            max_request_s=self.settings.limits.max_request_s,
            output_dtype="float32",
        )

    def shutdown(self) -> None:
        """Stop loading, the worker threads (queued calls are dropped) and the engine's voice
        encoder process (a voice preparation in flight fails)."""
        self.stopping.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
        close = getattr(self._built_engine, "close", None)
        if callable(close):
            close()


__all__ = [
    "Engine",
    "EngineFactory",
    "ModelLocator",
    "ModelState",
    "ServerBusy",
    "ServerRuntime",
    "VoiceSlot",
    "default_engine_factory",
    "default_model_locator",
]
