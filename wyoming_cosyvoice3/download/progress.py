"""Download progress: a bar on a terminal, periodic INFO log lines otherwise.

The transfer (huggingface_hub ``file_download.http_get``) writes every received chunk into a
file object; :class:`ProgressFile` wraps the partial file, counts what is written and
forwards the count to a reporter. This works the same for every hub version and also lets
a caller stop a long download between two chunks (``should_stop``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import BinaryIO, Protocol

from ..engine.errors import CosyVoiceError

_LOGGER = logging.getLogger(__name__)

LOG_INTERVAL_S = 15.0
"""Besides each tenth of the file, a progress line at least this often while data arrives."""
LOG_STEPS = 10
"""A log line each time another tenth of the file has arrived."""


class DownloadCancelled(CosyVoiceError):
    """``should_stop`` returned True during a download; the partial file is kept for resuming."""

    code = "cancelled"


class Reporter(Protocol):
    """Receives the byte count of one file's transfer."""

    def update(self, n_bytes: int) -> None: ...

    def set_position(self, done_bytes: int) -> None: ...

    def close(self) -> None: ...


def format_bytes(n_bytes: float) -> str:
    """Human-readable size with decimal units (``1.5 GB``), as the hub's web pages show them."""
    value = float(n_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000.0 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000.0
    return f"{value:.1f} GB"  # pragma: no cover - loop always returns


class LogReporter:
    """Logs ``name: done / total (pct), rate, ETA`` at every 10 % step or every 15 s."""

    def __init__(self, name: str, total_bytes: int | None, initial_bytes: int = 0) -> None:
        self.name = name
        self.total_bytes = total_bytes
        self.done_bytes = initial_bytes
        self._start_bytes = initial_bytes
        self._start_s = time.monotonic()
        self._last_log_s = self._start_s
        self._last_step = self._step()
        self._logged_bytes = -1

    def _step(self) -> int:
        if not self.total_bytes:
            return 0
        return self.done_bytes * LOG_STEPS // self.total_bytes

    def update(self, n_bytes: int) -> None:
        self.done_bytes += n_bytes
        now = time.monotonic()
        step = self._step()
        if step > self._last_step or now - self._last_log_s >= LOG_INTERVAL_S:
            self._log(now)
            self._last_step = step
            self._last_log_s = now

    def set_position(self, done_bytes: int) -> None:
        self.done_bytes = done_bytes
        self._start_bytes = min(self._start_bytes, done_bytes)
        self._last_step = min(self._last_step, self._step())

    def _log(self, now_s: float) -> None:
        self._logged_bytes = self.done_bytes
        elapsed_s = max(now_s - self._start_s, 1e-6)
        rate = (self.done_bytes - self._start_bytes) / elapsed_s
        if self.total_bytes:
            left_s = (self.total_bytes - self.done_bytes) / rate if rate > 0 else float("inf")
            eta = f"{left_s:.0f} s left" if left_s != float("inf") else "rate unknown"
            _LOGGER.info(
                "Downloading %s: %s of %s (%.0f%%), %s/s, %s",
                self.name,
                format_bytes(self.done_bytes),
                format_bytes(self.total_bytes),
                100.0 * self.done_bytes / self.total_bytes,
                format_bytes(rate),
                eta,
            )
        else:
            _LOGGER.info(
                "Downloading %s: %s, %s/s",
                self.name,
                format_bytes(self.done_bytes),
                format_bytes(rate),
            )

    def close(self) -> None:
        if self._logged_bytes != self.done_bytes:
            self._log(time.monotonic())


class BarReporter:
    """A tqdm bar on stderr (tqdm is a dependency of huggingface_hub)."""

    def __init__(self, name: str, total_bytes: int | None, initial_bytes: int = 0) -> None:
        from tqdm import tqdm  # imported here: only needed on a terminal

        self._bar = tqdm(
            total=total_bytes,
            initial=initial_bytes,
            desc=name,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            file=sys.stderr,
            leave=True,
        )

    def update(self, n_bytes: int) -> None:
        self._bar.update(n_bytes)

    def set_position(self, done_bytes: int) -> None:
        self._bar.n = done_bytes
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def make_reporter(
    progress: bool | None, name: str, total_bytes: int | None, initial_bytes: int = 0
) -> Reporter:
    """A bar when ``progress`` is True (or None and stderr is a terminal), else log lines."""
    use_bar = sys.stderr.isatty() if progress is None else progress
    if use_bar:
        return BarReporter(name, total_bytes, initial_bytes)
    return LogReporter(name, total_bytes, initial_bytes)


class ProgressFile:
    """File-object wrapper handed to the transfer: reports writes and honours ``should_stop``.

    Supports the calls huggingface_hub's ``http_get`` makes on its target: ``write``,
    ``tell``, ``seek`` and ``truncate`` (used when a server ignores a Range request).
    """

    def __init__(
        self,
        stream: BinaryIO,
        reporter: Reporter,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self._stream = stream
        self._reporter = reporter
        self._should_stop = should_stop

    def write(self, data: bytes) -> int:
        if self._should_stop is not None and self._should_stop():
            raise DownloadCancelled(
                "download stopped on request; the partial file is kept and the next "
                "start resumes it"
            )
        written = self._stream.write(data)
        self._reporter.update(len(data))
        return written

    def tell(self) -> int:
        return self._stream.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._stream.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        result = self._stream.truncate(size)
        self._reporter.set_position(self._stream.tell() if size is None else size)
        return result

    def flush(self) -> None:
        self._stream.flush()
