"""Shared server state: the engine, the voice table, the connection count and the worker threads
that run the engine.

The model is located (downloaded if needed) and loaded in a background thread after the server
listens, so ``describe`` is answered at once: state LOADING -> READY, or FAILED with the reason.
A download that cannot be done now (no network, hub down, disk full, offline mode with files
missing) is tried again in the background with backoff (:mod:`.download_wait`)
while the state stays LOADING and ``describe`` says what the server waits for: no restart is
needed when the network comes back or the files are copied in.

Voices (:class:`VoiceSlot`): the loader prepares every catalog voice with :func:`prepare_slot`
at start and the voice page (``web/admin.py``) prepares the voices it adds or changes the same
way, so a voice behaves the same whichever way it arrived; :func:`select_voice` picks the voice
that answers a request.

Engine work never runs on the event loop: every step of a synthesis (each ``next()`` of the
engine's chunk iterator) runs in a worker thread (:class:`SynthesisRunner`, the base of
:class:`ServerRuntime`), at most ``--max-concurrent`` syntheses at a time (an
``asyncio.Semaphore``); the rest wait, up to ``max_queued_requests``. New voices are prepared
in the engine's voice encoder process (``EngineOptions.voice_process``), so nothing of a
preparation holds this interpreter's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.errors import (
    CosyVoiceError,
    ModelFilesMissing,
    ModelNotReady,
    SynthesisCancelled,
    VoiceNotFound,
)
from ..engine.machine import FALLBACK_PRESET, PREDICTION_ERRORS, LlmPlan, PresetChoice
from ..engine.options import (
    AudioChunk,
    EngineOptions,
    ShouldStop,
    SynthesisOptions,
    SynthesisResult,
    VoicePrompt,
)
from . import download_wait
from .catalog import VoiceEntry, check_clip_size, load_catalogs, resolve_clip, with_model_dir
from .engine_port import (
    Engine,
    EngineFactory,
    ModelLocator,
    default_engine_factory,
    default_model_locator,
)
from .hooks import ServerHooks, ServerObserver
from .machine import AUTO, choose_for_this_machine
from .preroll import ProductionHistory
from .protocol import VoiceRequest, short_repr
from .settings import Settings

_LOGGER = logging.getLogger(__name__)


# -- voices ---------------------------------------------------------------------------------


@dataclass
class VoiceSlot:
    """A catalog voice and, once prepared, its prompt (``prompt`` None = not installed)."""

    entry: VoiceEntry
    prompt: VoicePrompt | None = None
    problem: str | None = None

    @property
    def installed(self) -> bool:
        return self.prompt is not None


def prepare_slot(engine: Engine, entry: VoiceEntry, max_clip_bytes: int) -> VoiceSlot:
    """Locate the entry's clip, check its size and let the engine prepare it (blocking: run
    it in a worker thread).

    Returns:
        A slot with ``prompt`` set, or with ``problem`` saying why the voice is disabled (an
        entry that already has a problem is returned unprepared and not logged again; any
        other refusal is logged once).
    """
    if entry.problem:
        return VoiceSlot(entry, None, entry.problem)
    try:
        clip = resolve_clip(entry)
        check_clip_size(clip, max_clip_bytes)
        prompt = engine.prepare_voice(clip, entry.transcript, entry.instruction, entry.name)
    except (ValueError, OSError, CosyVoiceError) as err:
        _LOGGER.warning("Voice %r (%s) is disabled: %s", entry.name, entry.source, err)
        return VoiceSlot(entry, None, str(err))
    return VoiceSlot(entry, prompt)


def _primary(language: str) -> str:
    return language.replace("_", "-").split("-", 1)[0].lower()


def _valid_names(voices: Mapping[str, VoiceSlot]) -> str:
    names = [name for name, slot in voices.items() if slot.installed]
    if names:
        return ", ".join(names)
    problem = next((f"{name}: {slot.problem}" for name, slot in voices.items() if slot.problem),
                   "check the voice catalog and the log")
    return f"(none; {problem})"


def select_voice(
    request: VoiceRequest, voices: Mapping[str, VoiceSlot], default: VoiceSlot | None
) -> VoiceSlot:
    """Pick the voice: by name, else the first voice listing the language, else the default.

    A language matches exactly first (``en-US``), then by its primary subtag (``en``); voices
    whose first language matches are preferred over voices that merely list it.

    Raises:
        VoiceNotFound: unknown or unusable name, a speaker (no voice has speakers), an
            unsupported language, or no installed voice at all; the message lists the
            installed voices.
    """
    valid = _valid_names(voices)
    if request.name is not None:
        slot = voices.get(request.name)
        if slot is None:
            raise VoiceNotFound(f"unknown voice {short_repr(request.name)}; installed voices: "
                                f"{valid}")
        if not slot.installed:
            reason = slot.problem or "it is not prepared yet"
            raise VoiceNotFound(
                f"voice {request.name!r} is not available ({reason}); installed voices: {valid}"
            )
        if request.speaker is not None:
            raise VoiceNotFound(
                f"voice {request.name!r} has no speakers (got speaker {request.speaker!r}); "
                "leave 'speaker' out"
            )
        return slot
    if request.language is not None:
        wanted = request.language.replace("_", "-").lower()
        installed = [slot for slot in voices.values() if slot.installed]
        for match in (
            lambda s: s.entry.languages[0].lower() == wanted,
            lambda s: _primary(s.entry.languages[0]) == _primary(wanted),
            lambda s: any(lang.lower() == wanted for lang in s.entry.languages),
            lambda s: any(_primary(lang) == _primary(wanted) for lang in s.entry.languages),
        ):
            found = next((slot for slot in installed if match(slot)), None)
            if found is not None:
                return found
        languages = sorted({lang for slot in installed for lang in slot.entry.languages})
        raise VoiceNotFound(
            f"no voice speaks {request.language!r}; languages: {', '.join(languages) or '-'}; "
            f"installed voices: {valid}"
        )
    if default is None:
        raise VoiceNotFound(f"no voice is installed; installed voices: {valid}")
    return default


# -- connections ----------------------------------------------------------------------------

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


# -- worker threads -------------------------------------------------------------------------


class ServerBusy(CosyVoiceError):
    """Too many syntheses are already waiting for a worker."""

    code = "server-busy"


class SynthesisRunner:
    """Worker threads and the admission of syntheses (the base of the server runtime).

    Args:
        settings: the resolved settings (``max_concurrent``, ``limits.max_queued_requests``).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.executor = ThreadPoolExecutor(
            max_workers=settings.max_concurrent, thread_name_prefix="cosyvoice3-synth"
        )
        self._semaphore: asyncio.Semaphore | None = None
        self._waiting = 0
        self._cleanups: set[asyncio.Future[None]] = set()
        self.active = 0
        """Syntheses holding a worker right now (for tests and logs)."""
        self.stopping = threading.Event()
        """Set on shutdown: stops a running download and every synthesis."""

    def require_ready(self) -> Engine:
        """The engine, or raise a coded error saying why synthesis is not possible yet."""
        raise NotImplementedError

    def _semaphore_for_loop(self) -> asyncio.Semaphore:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.settings.max_concurrent)
        return self._semaphore

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no synthesis holds or waits for a worker (True), or ``timeout_s``
        passed (False)."""
        deadline = time.monotonic() + timeout_s
        for _ in range(int(timeout_s / 0.01) + 1):
            if self.active == 0 and self._waiting == 0:
                return True
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
        return self.active == 0 and self._waiting == 0

    async def run_synthesis(
        self,
        text: str,
        voice: VoicePrompt,
        options: SynthesisOptions,
        should_stop: ShouldStop,
        on_chunk: Callable[[AudioChunk], Awaitable[None]],
        result: SynthesisResult | None = None,
    ) -> float:
        """Run one engine request in a worker thread, awaiting ``on_chunk`` for each chunk.

        Each ``next()`` of the engine's iterator runs in the executor, so the event loop
        stays free; the worker slot is held until the iterator is finished or closed, so a
        cancelled request keeps its slot until its thread has really stopped.

        Returns:
            Seconds the request held a worker (compute time, for the RTF).

        Raises:
            ServerBusy: the wait queue is full.
            CosyVoiceError: from the engine (SynthesisCancelled when ``should_stop`` fired).
            Whatever ``on_chunk`` raises (after the engine iterator was closed).
        """
        engine = self.require_ready()
        limit = self.settings.limits.max_queued_requests
        semaphore = self._semaphore_for_loop()
        if semaphore.locked() and self._waiting >= limit:
            raise ServerBusy(
                f"{self._waiting} requests are already waiting; try again later "
                "(or raise --max-queued-requests / --max-concurrent)"
            )
        loop = asyncio.get_running_loop()
        self._waiting += 1
        try:
            await self._acquire(semaphore)
        finally:
            self._waiting -= 1
        self.active += 1
        started = time.monotonic()
        work = _Work()
        abandoned = False
        try:
            if should_stop():
                raise SynthesisCancelled("the request was cancelled before synthesis started")
            work.pending = loop.run_in_executor(
                self.executor, _start, engine, text, voice, options, should_stop, result
            )
            await _wait_step(work.pending, should_stop)
            work.iterator = work.pending.result()
            while True:
                work.pending = loop.run_in_executor(self.executor, _next_chunk, work.iterator)
                await _wait_step(work.pending, should_stop)
                chunk = work.pending.result()
                work.pending = None
                if chunk is None:
                    work.iterator = None
                    break
                await on_chunk(chunk)
        except _Abandoned:
            abandoned = True
            raise
        finally:
            # Release the worker only after its thread has really stopped, even when this
            # task is cancelled or the request stops waiting for a step that goes on (the
            # cleanup then finishes in the background).
            cleanup = asyncio.ensure_future(self._finish(loop, work, semaphore))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            if not abandoned:
                await asyncio.shield(cleanup)
        return time.monotonic() - started

    async def _acquire(self, semaphore: asyncio.Semaphore) -> None:
        """Wait for a worker (in arrival order); raise ``SynthesisCancelled`` as soon as the
        server stops, without waiting for the running synthesis to give its worker back."""
        acquire = asyncio.ensure_future(semaphore.acquire())
        try:
            while not acquire.done():
                await asyncio.wait({acquire}, timeout=STOP_POLL_S)
                if not acquire.done() and self.stopping.is_set():
                    raise SynthesisCancelled("the server is shutting down")
        except BaseException:
            if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                semaphore.release()
            acquire.cancel()
            raise

    async def _finish(
        self, loop: asyncio.AbstractEventLoop, work: _Work, semaphore: asyncio.Semaphore
    ) -> None:
        try:
            if work.pending is not None:
                with contextlib.suppress(Exception):
                    await work.pending  # the thread stops at its next should_stop check
            if work.iterator is not None:
                close = getattr(work.iterator, "close", None)
                if callable(close):
                    try:
                        await loop.run_in_executor(self.executor, close)
                    except (CosyVoiceError, RuntimeError, ValueError) as err:
                        _LOGGER.debug("Closing an engine request raised %s", err)
        finally:
            self.active -= 1
            semaphore.release()


STOP_POLL_S = 0.05
"""How often a request waiting for a worker or for a model step looks at its stop flag."""
STEP_STOP_WAIT_S = 0.5
"""How long a stopped request waits for the model step in flight to notice the stop (the engine
checks between steps); after that it stops waiting, so its client gets its answer (``cancelled``,
``timeout``) at once, while the step finishes in the background holding its worker."""


async def _wait_step(pending: asyncio.Future[Any], should_stop: ShouldStop) -> None:
    """Wait for one model step (an executor call).

    Raises:
        SynthesisCancelled: (``_Abandoned``) ``should_stop()`` had held for
            :data:`STEP_STOP_WAIT_S` and the step was still running.
    """
    stopped_at: float | None = None
    while not pending.done():
        await asyncio.wait({pending}, timeout=STOP_POLL_S)
        if pending.done():
            break
        if stopped_at is None:
            if should_stop():
                stopped_at = time.monotonic()
        elif time.monotonic() - stopped_at >= STEP_STOP_WAIT_S:
            raise _Abandoned("a model step was still running when the request stopped")


class _Abandoned(SynthesisCancelled):
    """The request stopped waiting for a model step that went on (see :func:`_wait_step`)."""


def _start(
    engine: Engine, text: str, voice: VoicePrompt, options: SynthesisOptions,
    should_stop: ShouldStop, result: SynthesisResult | None,
) -> Iterator[AudioChunk]:
    return iter(engine.synthesize(text, voice, options, should_stop=should_stop, result=result))


def _next_chunk(iterator: Iterator[AudioChunk]) -> AudioChunk | None:
    return next(iterator, None)


@dataclass
class _Work:
    """The engine iterator of one request and the executor call in flight on it."""

    iterator: Iterator[AudioChunk] | None = None
    pending: asyncio.Future[Any] | None = None


# -- the runtime -----------------------------------------------------------------------------

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
        self.llm_plan: LlmPlan | None = None
        """The LLM graphs the engine loads (None until chosen at start)."""
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
            # before loading: the preset and the machine pick the graphs
            self.phase = "measuring this machine"
            self.llm_plan = self._choose_for_machine()
            self.phase = "loading the model"
            options = EngineOptions(
                llm_precision=self.settings.llm_precision,  # type: ignore[arg-type]
                llm_graph=self.llm_plan.decode,
                llm_prefill_graph=self.llm_plan.prefill,
                threads=self.settings.threads,
                providers=self.settings.providers,
                voice_cache_dir=self.settings.cache_dir,
                voice_process=True,  # voice encoders never load in this process
                cache_dir=self.settings.engine_cache_dir,
                preset=self.synthesis_options(),  # its DiT graphs are opened at start
                observer=self.observer,
            )
            if self.hooks.engine_overrides:
                options = dataclasses.replace(options, **self.hooks.engine_overrides)
            engine = self._built_engine = self._engine_factory(model_dir, options)
            self.phase = "preparing voices"
            self._prepare_voices(engine, model_dir)
            # the voice encoder process exits before the warm-up
            engine.release_voice_encoders()
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

    def _choose_for_machine(self) -> LlmPlan:
        """Resolve ``--preset auto`` and ``--llm-graph preset`` (:func:`.machine.
        choose_for_this_machine`: 2-5 s of onnxruntime work in this loader thread) and log
        each in one line; return the LLM graphs to load. An explicit ``--preset`` and
        ``--llm-graph`` measure nothing."""
        explicit = self.settings.llm_graph != "preset"
        if explicit and self.settings.preset != AUTO:
            return LlmPlan(self.settings.llm_graph, None, "--llm-graph")  # type: ignore[arg-type]
        choice = choose_for_this_machine(self.settings.preset, self.settings.threads)
        if choice.rates is not None:  # one line a benchmark can read back (machine_table)
            _LOGGER.info("machine probe: %s", json.dumps(choice.rates.to_json()))
        self.preset = choice.preset
        auto = self.preset_choice = choice.preset_choice
        if auto is not None:
            _LOGGER.info("%s", auto.summary())
            rtf = auto.predicted_rtf.get(auto.preset)
            if rtf:  # the piece gate's prior until a piece is measured (no request runs yet)
                self.production.seed_prediction(rtf, PREDICTION_ERRORS[auto.preset])
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
        started = time.monotonic()
        try:  # with the preset: its graphs and Euler schedule get warm
            engine.warm_up(voice.prompt, self.synthesis_options())
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

    def shutdown(self) -> None:
        """Stop loading, the worker threads (queued calls are dropped) and the engine's voice
        encoder process (a voice preparation in flight fails)."""
        self.stopping.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self._built_engine is not None:
            self._built_engine.close()


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
