"""Waiting for a model download that cannot be done now: the retry schedule and what the
server says meanwhile (in ``describe`` and in the log).

The loader retries ``ensure_model`` after :data:`DOWNLOAD_RETRY_DELAYS_S` (10 s, doubling, then
every 5 minutes): a home server often starts before its network (power cut) and must not need
a restart when the network comes back, nor when a user copies the files in by hand.
"""

from __future__ import annotations

import logging
import time

from ..engine.errors import ModelFilesMissing
from .protocol import first_line

_LOGGER = logging.getLogger(__name__)

DOWNLOAD_RETRY_DELAYS_S: tuple[float, ...] = (10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
"""Seconds between download attempts; the last one repeats for as long as it takes."""


def retry_delay_s(attempt: int) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    delays = DOWNLOAD_RETRY_DELAYS_S
    return delays[min(max(attempt, 1), len(delays)) - 1]


def waiting_phase(err: ModelFilesMissing, delay_s: float) -> str:
    """One line for ``describe``: how many files, why they cannot be fetched, next try."""
    reason = first_line(str(getattr(err, "reason", "") or err))
    next_try = time.strftime("%H:%M:%S", time.localtime(time.time() + delay_s))
    return (f"waiting to download {len(err.missing)} model file(s): {reason}; "
            f"next try at {next_try}")


def log_waiting(err: ModelFilesMissing, attempt: int, delay_s: float) -> None:
    """The full error once (it lists every file and how to get it by hand), then one line
    per attempt."""
    if attempt == 1:
        _LOGGER.warning("Model files cannot be fetched now: %s", err)
    _LOGGER.warning("Waiting to download %d model file(s) (try %d): %s; trying again in %.0f s "
                    "(the server keeps answering; no restart needed)", len(err.missing),
                    attempt, first_line(str(getattr(err, "reason", "") or err)), delay_s)
