"""Observer callbacks of the engine: how a caller (the benchmark, a profiler, a test) watches
what the engine does without the engine knowing who watches, plus the one hook that changes
what it does: a fixed decoding length (:meth:`EngineObserver.fixed_speech_tokens`).

Pass an :class:`EngineObserver` subclass as ``EngineOptions.observer``. Every method defaults
to doing nothing; the engine calls them on its own threads, so implementations must be
thread-safe and quick (they run on the synthesis path).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .types import SynthesisResult


class EngineObserver:
    """Callbacks made by :class:`~.pipeline.CosyVoice3Engine` (override what you need)."""

    observes_graph_runs: bool = False
    """True to receive :meth:`graph_run` for every ONNX run of the process (installed at
    :meth:`CosyVoice3Engine.load <.pipeline.CosyVoice3Engine.load>`; process-wide, as the
    graph wrappers are shared)."""

    def graph_run(
        self, graph_path: str, feeds: Mapping[str, np.ndarray], start_s: float, end_s: float
    ) -> None:
        """One graph run: the file its session runs (can be a derived copy), the feeds, and
        its start and end in ``time.time()`` seconds."""

    def voice_prepared(self, name: str, seconds: float) -> None:
        """A voice's features were computed or loaded from the cache in ``seconds``."""

    def request_finished(self, text: str, result: SynthesisResult) -> None:
        """A synthesis request ended (done, failed or cancelled) with these figures."""

    def fixed_speech_tokens(self, piece_text: str) -> int | None:
        """How many speech tokens to decode for one text piece, ignoring the stop token;
        None (the default) decodes until the stop token or the request's cap.

        For measurements only: a model with random weights (the synthetic ones) never stops
        sensibly, so the benchmark fixes the length from the text (``python -m bench``,
        ``--bench-tokens-per-char``). Called once per piece when the request starts.

        Args:
            piece_text: the normalised text of the piece.

        Returns:
            A token count >= 1, or None.
        """
        return None
