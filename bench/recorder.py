"""The benchmark's server observer: one JSON line per request and per voice preparation.

Installed into the server by ``python -m bench.serve --bench-stats-file PATH`` (:mod:`.serve`,
through :class:`wyoming_cosyvoice3.server.hooks.ServerHooks`), together with the fixed
decoding length of ``--bench-tokens-per-char`` (:class:`FixedDecoding`). Each line holds the
request's :class:`~wyoming_cosyvoice3.engine.options.StageTimes` and result figures
(``kind: "request"``) or a voice preparation's time (``kind: "voice"``), wall-clock start and
end, and every graph run since the previous line (file name of the graph the session runs,
input shapes without the KV cache, start and end in ``time.time()`` seconds) plus
``graph_paths`` (file name -> full path, e.g. of a derived int8 estimator). The analysis
(:mod:`.stats`, :mod:`.flops`) counts FLOPs from these shapes and draws timelines from the
times. The server adds one ``kind: "pieces"`` line per response
(:meth:`StatsRecorder.response_pieces`): where each piece starts in the audio it sent, so the
benchmark tells pauses between pieces from pauses inside one. Records are collected
process-wide: meant for one request at a time, as the benchmark runs them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wyoming_cosyvoice3.engine.options import SynthesisResult
from wyoming_cosyvoice3.server.hooks import ServerObserver

logger = logging.getLogger(__name__)

_SKIPPED_INPUT_PREFIX = "past_key_values."
"""KV-cache inputs are not recorded: their length is ``attention_mask`` minus the new tokens."""


class FixedDecoding(ServerObserver):
    """The benchmark's decoding length, installed through the engine's hook
    (:meth:`~wyoming_cosyvoice3.engine.options.EngineObserver.fixed_speech_tokens`): exactly
    ``max(1, round(tokens_per_char x characters))`` speech tokens per text piece, ignoring the
    stop token, because random weights never stop sensibly. ``None``: decode normally.

    Raises:
        ValueError: ``tokens_per_char`` is not > 0 (also for nan).
    """

    def __init__(self, tokens_per_char: float | None = None) -> None:
        if tokens_per_char is not None and not tokens_per_char > 0:
            raise ValueError(f"tokens per character must be > 0, got {tokens_per_char}")
        self.tokens_per_char = tokens_per_char

    def fixed_speech_tokens(self, piece_text: str) -> int | None:
        if self.tokens_per_char is None:
            return None
        return max(1, round(self.tokens_per_char * len(piece_text)))


class StatsRecorder(FixedDecoding):
    """Collects graph runs and appends JSON lines to ``path`` (thread-safe); with
    ``tokens_per_char`` it also fixes the decoding length (:class:`FixedDecoding`)."""

    observes_graph_runs = True

    def __init__(self, path: Path, tokens_per_char: float | None = None) -> None:
        super().__init__(tokens_per_char)
        self.path = Path(path)
        self._lock = threading.Lock()
        self._runs: list[list[Any]] = []
        self._paths: dict[str, str] = {}

    def graph_run(
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

    def request_finished(self, text: str, result: SynthesisResult) -> None:
        end = time.time()
        self._write({
            "kind": "request",
            "chars": len(text),
            "wall_start_s": round(end - result.total_s, 6),
            "wall_end_s": round(end, 6),
            "audio_s": result.audio_s,
            "first_chunk_s": result.first_chunk_s,
            "total_s": result.total_s,
            "pieces": result.pieces,
            "times": dataclasses.asdict(result.times),
        })

    def voice_prepared(self, name: str, seconds: float) -> None:
        end = time.time()
        self._write({"kind": "voice", "name": name, "wall_start_s": round(end - seconds, 6),
                     "wall_end_s": round(end, 6), "total_s": seconds})

    def response_pieces(self, starts_samples: Sequence[int], samples: int) -> None:
        """Called by the server at the end of each response: the sample offset of each piece's
        first sample in the audio sent, and the samples sent (24 kHz). Takes no graph runs
        (they belong to the engine requests' lines)."""
        self._append({"kind": "pieces", "wall_end_s": round(time.time(), 6),
                      "starts": list(starts_samples), "samples": samples})

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            record["graph_runs"], self._runs = self._runs, []
            record["graph_paths"] = dict(self._paths)
        self._append(record)

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            try:
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(line + "\n")
            except OSError as err:
                logger.warning("cannot write benchmark stats to %s: %s", self.path, err)
