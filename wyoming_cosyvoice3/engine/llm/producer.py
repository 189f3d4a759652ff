"""Run an iterator (the LLM's token stream) in a per-request thread with a bounded queue.

Used with ``EngineOptions.split_cores``: the LLM decodes the next tokens while the flow and
the vocoder turn the previous ones into audio, so the memory-bound decode (it reads every
weight per token) runs on its own share of the cores beside the compute-bound DiT. The items
and their order are exactly those of the iterator, and only this thread calls the iterator
(the LLM and the request's sampling generator), so a request gives the same tokens with and
without the thread.

Life cycle: the thread is started by :meth:`TokenProducer.start` and always ends:

* the iterator is exhausted -> an end marker is queued;
* the iterator raises (cancellation, timeout, graph failure) -> the exception is queued and
  re-raised in the consumer;
* the consumer stops early (its own exception, generator closed) -> :meth:`close` sets the stop
  flag, which the iterator's ``should_stop`` sees before its next model step, and joins.

The queue is bounded (``max_items``): a producer far ahead of the consumer blocks instead of
growing memory; its waits poll the stop flag, so nothing blocks forever.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from ..errors import SynthesisFailed
from ..options import ShouldStop

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_S = 0.05
_JOIN_LIMIT_S = 60.0
_ITEM, _END, _ERROR = 0, 1, 2


class TokenProducer(Generic[T]):
    """Iterate ``make_items(should_stop)`` in a thread; iterate this object to consume.

    Args:
        make_items: called in the thread with a ``should_stop`` callable (True once the
            consumer closed the producer); returns the iterator to run.
        max_items: queue bound.
        name: thread name (for logs and debuggers).
    """

    def __init__(
        self,
        make_items: Callable[[ShouldStop], Iterator[T]],
        max_items: int = 1024,
        name: str = "cosyvoice3-llm",
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self._make_items = make_items
        self._queue: queue.Queue[tuple[int, object]] = queue.Queue(max_items)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- producer side ----------------------------------------------------------------------
    def _stopped(self) -> bool:
        return self._stop.is_set()

    def _put(self, kind: int, value: object) -> bool:
        """Queue an item, waiting while full; False if the consumer stopped meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put((kind, value), timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._make_items(self._stopped):
                if not self._put(_ITEM, item):
                    return
            self._put(_END, None)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            if not self._stop.is_set():
                self._put(_ERROR, exc)
            else:
                logger.debug("producer ended after close: %s", exc)

    # -- consumer side ----------------------------------------------------------------------
    def start(self) -> TokenProducer[T]:
        """Start the thread (once); returns self."""
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def __iter__(self) -> Iterator[T]:
        """Items in order; re-raises the producer's exception.

        Raises:
            SynthesisFailed: the thread ended without an end marker (should not happen).
        """
        while True:
            try:
                kind, value = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise SynthesisFailed(
                        "the LLM producer thread ended unexpectedly; retry, or load the "
                        "engine without split_cores"
                    ) from None
                continue
            if kind == _END:
                return
            if kind == _ERROR:
                assert isinstance(value, BaseException)
                raise value
            yield value  # type: ignore[misc]

    def close(self) -> None:
        """Stop the thread and wait for it (it stops before its next model step)."""
        self._stop.set()
        if not self._thread.is_alive():
            return
        waited = 0.0
        while self._thread.is_alive() and waited < _JOIN_LIMIT_S:
            self._drain()
            self._thread.join(_POLL_S)
            waited += _POLL_S
        if self._thread.is_alive():
            logger.warning("LLM producer thread still running %.0f s after close", waited)

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> TokenProducer[T]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
