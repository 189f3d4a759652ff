"""Running syntheses: worker threads, admission and cancellation.

Engine work never runs on the event loop: every step of a synthesis (each ``next()`` of the
engine's chunk iterator) runs in a worker thread, at most ``--max-concurrent`` syntheses at a
time (an ``asyncio.Semaphore``); the rest wait, up to ``max_queued_requests``. The runner
gets the engine through a call for each synthesis, so it knows nothing of how the model is
loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..engine.errors import CosyVoiceError, SynthesisCancelled
from ..engine.options import AudioChunk, ShouldStop, SynthesisOptions, SynthesisResult, VoicePrompt
from ..engine.text.pieces import MorePieces, PlannedPiece
from .engine_port import Engine
from .settings import Settings

_LOGGER = logging.getLogger(__name__)


class ServerBusy(CosyVoiceError):
    """Too many syntheses are already waiting for a worker."""

    code = "server-busy"


class SynthesisRunner:
    """Worker threads, the admission of syntheses and their cancellation.

    Args:
        settings: the resolved settings (``max_concurrent``, ``limits.max_queued_requests``).
        engine: gives the engine for a synthesis, or raises the coded error saying why there
            is none yet (the model loader's :meth:`~.model_loader.ModelLoader.require_ready`).
        stopping: set on shutdown: a request waiting for a worker is cancelled at once.
    """

    def __init__(self, settings: Settings, engine: Callable[[], Engine],
                 stopping: threading.Event) -> None:
        self.settings = settings
        self._engine = engine
        self.executor = ThreadPoolExecutor(
            max_workers=settings.max_concurrent, thread_name_prefix="cosyvoice3-synth"
        )
        self._semaphore: asyncio.Semaphore | None = None
        self._waiting = 0
        self._cleanups: set[asyncio.Future[None]] = set()
        self.active = 0
        """Syntheses holding a worker right now (for tests and logs)."""
        self.stopping = stopping

    def shutdown(self) -> None:
        """Stop the worker threads (queued calls are dropped; running steps finish)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

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
        text: str | Sequence[PlannedPiece],
        voice: VoicePrompt,
        options: SynthesisOptions,
        should_stop: ShouldStop,
        on_chunk: Callable[[AudioChunk], Awaitable[None]],
        result: SynthesisResult | None = None,
        more: MorePieces | None = None,
    ) -> float:
        """Run one engine request in a worker thread, awaiting ``on_chunk`` for each chunk
        (``more``: the engine's, called from an engine thread).

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
        engine = self._engine()
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
                self.executor, _start, engine, text, voice, options, should_stop, result, more
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
    engine: Engine, text: str | Sequence[PlannedPiece], voice: VoicePrompt,
    options: SynthesisOptions,
    should_stop: ShouldStop, result: SynthesisResult | None, more: MorePieces | None,
) -> Iterator[AudioChunk]:
    return iter(engine.synthesize(text, voice, options, should_stop=should_stop, result=result,
                                  more=more))


def _next_chunk(iterator: Iterator[AudioChunk]) -> AudioChunk | None:
    return next(iterator, None)


@dataclass
class _Work:
    """The engine iterator of one request and the executor call in flight on it."""

    iterator: Iterator[AudioChunk] | None = None
    pending: asyncio.Future[Any] | None = None


__all__ = ["STEP_STOP_WAIT_S", "STOP_POLL_S", "ServerBusy", "SynthesisRunner"]
