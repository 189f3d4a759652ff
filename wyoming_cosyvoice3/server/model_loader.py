"""The model loader: the model's state, its download, the preset choice and the warm-up.

The model is located (downloaded if needed) and loaded in a background thread after the server
listens, so ``describe`` is answered at once: state LOADING -> READY, or FAILED with the reason.
A download that cannot be done now (no network, hub down, disk full, offline mode with files
missing) is tried again in the background with backoff (:mod:`.download_wait`)
while the state stays LOADING and ``describe`` says what the server waits for: no restart is
needed when the network comes back or the files are copied in.

Before the engine loads, ``--preset auto`` and ``--llm-graph preset`` are resolved on this
machine (:func:`.machine.choose_for_this_machine`). Once it is loaded, the voice table prepares
the catalog's voices (:meth:`.voice_table.VoiceTable.prepare_all`), the voice encoder process
is released and one short synthesis warms the preset's graphs up. New voices are prepared in
the engine's voice encoder process (``EngineOptions.voice_process``), so nothing of a
preparation holds this interpreter's lock.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..engine.errors import CosyVoiceError, ModelFilesMissing, ModelNotReady
from ..engine.machine import FALLBACK_PRESET, PREDICTION_ERRORS, LlmPlan, PresetChoice
from ..engine.options import EngineOptions, SynthesisOptions
from ..engine.sessions import available_cpus
from . import download_wait
from .engine_port import (
    Engine,
    EngineFactory,
    ModelLocator,
    default_engine_factory,
    default_model_locator,
)
from .hooks import ServerHooks
from .machine import AUTO, choose_for_this_machine
from .preroll import ProductionHistory
from .settings import Settings
from .voice_table import VoiceTable

_LOGGER = logging.getLogger(__name__)


class ModelState(enum.Enum):
    """Life cycle of the model."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelStatus:
    """The model's state, what the loader is doing, and why it failed (one consistent view)."""

    state: ModelState
    phase: str
    error: CosyVoiceError | None


class ModelLoader:
    """Loads the model in a thread (:meth:`start`) and gives the engine once it is ready.

    Args:
        settings: the resolved settings.
        voices: the voice table; its catalog voices are prepared once the engine is loaded.
        production: the piece gate's history; ``--preset auto`` seeds it with its prediction.
        stopping: set on shutdown: a download wait ends at once.
        engine_factory: builds the engine from a model dir (tests pass a wrapper).
        model_locator: finds or downloads the model dir (runs in the loader thread).
        hooks: an observer and option overrides installed by a tool that runs the server in
            its own process (:mod:`.hooks`; the benchmark); none by default.
    """

    def __init__(
        self,
        settings: Settings,
        voices: VoiceTable,
        production: ProductionHistory,
        stopping: threading.Event,
        engine_factory: EngineFactory = default_engine_factory,
        model_locator: ModelLocator = default_model_locator,
        hooks: ServerHooks | None = None,
    ) -> None:
        self.settings = settings
        self.hooks = hooks if hooks is not None else ServerHooks()
        self._voices = voices
        self._production = production
        self._stopping = stopping
        self._engine_factory = engine_factory
        self._model_locator = model_locator
        self._lock = threading.Lock()
        self.state = ModelState.LOADING
        self.phase = "starting"
        self.error: CosyVoiceError | None = None
        self.engine: Engine | None = None
        self.model_dir: Path | None = settings.model_dir
        self._thread: threading.Thread | None = None
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
        self.llm_plan: LlmPlan | None = None
        """The LLM graphs the engine loads (None until chosen at start)."""
        self.split_cores = settings.split_cores and available_cpus() >= 2
        """Each request decodes in a thread of its own (``EngineOptions.split_cores``): on
        unless ``--no-split-cores`` or this process may use only one CPU (the two kinds of work
        would take turns on it anyway)."""

    # --- state ----------------------------------------------------------------------------

    def status(self) -> ModelStatus:
        """State, phase and error read together (never blocks for long: the lock guards
        only assignments)."""
        with self._lock:
            return ModelStatus(self.state, self.phase, self.error)

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
            read_numbers=not self.settings.keep_digits,
        )

    def request_options(self) -> SynthesisOptions:
        """The options of one request: :meth:`synthesis_options` with ``--seed``, else a
        fresh random seed."""
        seed = self.settings.seed
        return self.synthesis_options(seed if seed is not None else secrets.randbelow(2**31))

    # --- loading --------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Start the loader thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._load, name="cosyvoice3-loader",
                                            daemon=True)
            self._thread.start()
        return self._thread

    def _load(self) -> None:
        started = time.monotonic()
        try:
            located = self._locate_model()
            if located is None:
                return  # stopping
            model_dir = self.model_dir = located
            # before loading: the preset and the machine pick the graphs
            self.phase = "measuring this machine"
            self.llm_plan = self._choose_for_machine()
            self.phase = "loading the model"
            preset = self.synthesis_options()
            options = EngineOptions(
                llm_precision=self.settings.llm_precision,  # type: ignore[arg-type]
                llm_graph=self.llm_plan.decode,
                llm_prefill_graph=self.llm_plan.prefill,
                llm_decode_candidates=self.llm_plan.candidates,
                threads=self.settings.threads,
                split_cores=self.split_cores,
                providers=self.settings.providers,
                voice_cache_dir=self.settings.cache_dir,
                voice_process=True,  # voice encoders never load in this process
                cache_dir=self.settings.engine_cache_dir,
                flow=preset.flow,  # its DiT graphs are opened at start
                read_numbers=preset.read_numbers,
                observer=self.hooks.observer,
            )
            if self.hooks.engine_overrides:
                options = dataclasses.replace(options, **self.hooks.engine_overrides)
            engine = self._built_engine = self._engine_factory(model_dir, options)
            self.phase = "preparing voices"
            self._voices.prepare_all(engine, model_dir)
            # the voice encoder process exits before the warm-up
            engine.release_voice_encoders()
            if not self._voices.installed_names():
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
        installed = self._voices.installed_names()
        default = self._voices.default()
        _LOGGER.info("Model ready in %.1f s from %s; voices: %s (default %s)",
                     time.monotonic() - started, model_dir, ", ".join(installed) or "(none)",
                     default.entry.name if default else "-")
        if self.settings.voice and (default is None or default.entry.name != self.settings.voice):
            _LOGGER.warning("Default voice %r is not available; using %s", self.settings.voice,
                            default.entry.name if default else "none")

    def _choose_for_machine(self) -> LlmPlan:
        """Resolve ``--preset auto`` and ``--llm-graph preset`` (:func:`.machine.
        choose_for_this_machine`: 3-8 s of onnxruntime work in this loader thread) and log
        each in one line; return the LLM graphs to load. An explicit ``--preset`` and
        ``--llm-graph`` measure nothing."""
        explicit = self.settings.llm_graph != "preset"
        if explicit and self.settings.preset != AUTO:
            return LlmPlan(self.settings.llm_graph, None, "--llm-graph")  # type: ignore[arg-type]
        choice = choose_for_this_machine(self.settings.preset, self.settings.threads,
                                         split_cores=self.split_cores)
        if choice.rates is not None:  # one line a benchmark can read back (machine_table)
            _LOGGER.info("machine probe: %s", json.dumps(choice.rates.to_json()))
        self.preset = choice.preset
        auto = self.preset_choice = choice.preset_choice
        if auto is not None:
            _LOGGER.info("%s", auto.summary())
            rtf = auto.predicted_rtf.get(auto.preset)
            if rtf:  # the piece gate's prior until a piece is measured (no request runs yet)
                self._production.seed_prediction(rtf, PREDICTION_ERRORS[auto.preset])
        if explicit:
            return LlmPlan(self.settings.llm_graph, None, "--llm-graph")  # type: ignore[arg-type]
        plan = choice.plan
        _LOGGER.info("LLM graphs for `%s`: %s%s (%s)", self.preset, plan.decode,
                     f", prefill {plan.prefill}" if plan.prefill else "", plan.reason)
        return plan

    def _locate_model(self) -> Path | None:
        """The model dir, downloading it; retried with backoff while files cannot be fetched
        (None when the server stops while waiting). A given ``--model-dir`` is not retried."""
        while True:
            self.phase = "checking or downloading the model files"
            self.download_attempts += 1
            try:
                model_dir = self._model_locator(self.settings, self._stopping.is_set)
            except ModelFilesMissing as err:
                if self.settings.model_dir is not None:
                    raise
                delay_s = download_wait.retry_delay_s(self.download_attempts)
                with self._lock:
                    self.download_problem = err
                    self.phase = download_wait.waiting_phase(err, delay_s)
                download_wait.log_waiting(err, self.download_attempts, delay_s)
                self.waiting_event.set()
                if self._stopping.wait(delay_s):
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

    def _warm_up(self, engine: Engine) -> None:
        voice = self._voices.default()
        if voice is None or voice.prompt is None:
            return
        started = time.monotonic()
        try:  # with the preset: its graphs and Euler schedule get warm
            engine.warm_up(voice.prompt, self.synthesis_options())
        except CosyVoiceError as err:
            _LOGGER.warning("Warm-up failed (requests will still be tried): %s", err)
            return
        _LOGGER.debug("Warm-up took %.2f s", time.monotonic() - started)

    def close(self) -> None:
        """Stop the engine's voice encoder process (a voice preparation in flight fails)."""
        if self._built_engine is not None:
            self._built_engine.close()


__all__ = ["ModelLoader", "ModelState", "ModelStatus"]
