"""Benchmark-only hooks of the engine: off by default, switched on by environment variables.

The benchmark (``python -m benchmarks.run``, BENCHMARKS.md) drives the real server, so what it
needs from inside the engine is requested through the environment of the server process:

``COSYVOICE3_BENCH_TOKENS_PER_CHAR=R``
    every request decodes exactly ``max(1, round(R x characters))`` speech tokens per text piece
    and ignores the stop token (:attr:`SynthesisOptions.fixed_tokens_per_char`). Models with
    random weights never stop sensibly; a fixed length makes runs comparable. 25 tokens are one
    second of speech, so R = 25 / 15 = 1.667 models a speaking rate of 15 characters per second.
``COSYVOICE3_BENCH_STATS_FILE=PATH``
    append one JSON line per synthesis request (``kind: "request"``: the :class:`StageTimes`,
    result figures, wall-clock start/end) and per voice preparation (``kind: "voice"``), each
    with every graph run since the previous line (file name of the graph the session runs,
    input shapes without the KV cache, wall-clock start/end in ``time.time()`` seconds) and
    ``graph_paths`` (file name -> full path, e.g. of a derived int8 estimator). The benchmark
    counts FLOPs from these shapes and draws timelines from the times.

Neither variable changes anything when unset (one ``is None`` test per graph run). Records are
collected process-wide (not per request): meant for one request at a time, as the benchmark
runs them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import graphs
from .options import SynthesisOptions
from .types import SynthesisResult

logger = logging.getLogger(__name__)

TOKENS_PER_CHAR_ENV = "COSYVOICE3_BENCH_TOKENS_PER_CHAR"
STATS_FILE_ENV = "COSYVOICE3_BENCH_STATS_FILE"
_SKIPPED_INPUT_PREFIX = "past_key_values."
"""KV-cache inputs are not recorded: their length is ``attention_mask`` minus the new tokens."""


class _Recorder:
    """Collects graph runs and appends JSON lines to one file (thread-safe)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._runs: list[list[Any]] = []
        self._paths: dict[str, str] = {}

    def observe(
        self, graph_path: str, feeds: Mapping[str, np.ndarray], start_s: float, end_s: float
    ) -> None:
        graph_file = Path(graph_path).name
        shapes = {
            name: [int(d) for d in np.shape(value)]
            for name, value in feeds.items()
            if not name.startswith(_SKIPPED_INPUT_PREFIX)
        }
        with self._lock:
            self._paths.setdefault(graph_file, graph_path)
            self._runs.append([graph_file, shapes, round(start_s, 6), round(end_s, 6)])

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            record["graph_runs"], self._runs = self._runs, []
            record["graph_paths"] = dict(self._paths)
            line = json.dumps(record, separators=(",", ":"))
            try:
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(line + "\n")
            except OSError as err:
                logger.warning("cannot write benchmark stats to %s: %s", self.path, err)


_recorder: _Recorder | None = None


def configure(stats_file: Path | None) -> None:
    """Start (``stats_file`` set) or stop (None) recording; done from the environment at import."""
    global _recorder
    _recorder = _Recorder(Path(stats_file)) if stats_file is not None else None
    graphs.set_run_observer(_recorder.observe if _recorder is not None else None)


def apply_env(options: SynthesisOptions) -> SynthesisOptions:
    """``options`` with ``fixed_tokens_per_char`` from the environment when it is set there.

    Raises:
        ValueError: the variable is not a positive number (names the variable).
    """
    raw = os.environ.get(TOKENS_PER_CHAR_ENV)
    if not raw or options.fixed_tokens_per_char is not None:
        return options
    try:
        rate = float(raw)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise ValueError(f"{TOKENS_PER_CHAR_ENV} must be a positive number, got {raw!r}")
    return options.replace(fixed_tokens_per_char=rate)


def record_request(text: str, result: SynthesisResult) -> None:
    """Append the figures of one finished (or failed) request when recording."""
    if _recorder is None:
        return
    end = time.time()
    _recorder.write(
        {
            "kind": "request",
            "chars": len(text),
            "wall_start_s": round(end - result.total_s, 6),
            "wall_end_s": round(end, 6),
            "audio_s": result.audio_s,
            "first_chunk_s": result.first_chunk_s,
            "total_s": result.total_s,
            "pieces": result.pieces,
            "times": dataclasses.asdict(result.times),
        }
    )


def record_voice(name: str, seconds: float) -> None:
    """Append the time one voice preparation took (feature extraction) when recording."""
    if _recorder is None:
        return
    end = time.time()
    _recorder.write(
        {"kind": "voice", "name": name, "wall_start_s": round(end - seconds, 6),
         "wall_end_s": round(end, 6), "total_s": seconds}
    )


_env_file = os.environ.get(STATS_FILE_ENV)
if _env_file:
    configure(Path(_env_file))
