"""Engines on the tiny synthetic model, loaded once per test session (per pytest-xdist
worker) and shared read-only by the tests that only need a standard engine.

Loading builds every onnxruntime session of the model (and with a cache directory opens
the derived graphs), so a test module that loads its own engine pays that again for the
same files and options. ``conftest.py`` offers these engines as fixtures: ``bare_engine``
(no cache directory: the published graphs only) with its ``bare_model``, and one engine per
preset (``engine_quality``, ``engine_balanced``, ``engine_fast``) on the session's engine
cache. A test that needs other load options, a copied or broken model directory, or that
changes an engine beyond what ``monkeypatch`` or ``decoding_support.fixed_decoding``
restore, loads its own.
"""

from __future__ import annotations

from pathlib import Path

from wyoming_cosyvoice3.engine import CosyVoice3Engine
from wyoming_cosyvoice3.engine.options import PRESETS, EngineOptions

BARE_OPTIONS = EngineOptions(threads=1, llm_precision="fp32")
"""The bare engine: the published graphs as shipped, the LLM in fp32 (the graph the LLM
tests reason about), one thread per session (two test workers share the cores)."""


def preset_options(name: str, cache_dir: Path) -> EngineOptions:
    """What a server on preset ``name`` loads, with the published LLM graph of the default
    precision (the fused graph is the subject of test_llm_fused.py) and one thread: the
    preset's DiT graphs open at start from ``cache_dir``."""
    preset = PRESETS[name]
    return EngineOptions(threads=1, cache_dir=cache_dir, flow=preset.flow,
                         read_numbers=preset.read_numbers)


class TinyEngines:
    """Engines on one model directory, each loaded on first use and kept, keyed by their
    load options (:class:`EngineOptions` is frozen and compares by value)."""

    def __init__(self, model_dir: Path, cache_dir: Path) -> None:
        self.model_dir = model_dir
        self.cache_dir = cache_dir
        self._engines: dict[EngineOptions, CosyVoice3Engine] = {}

    def get(self, options: EngineOptions) -> CosyVoice3Engine:
        """The engine loaded with ``options`` (loaded now the first time)."""
        engine = self._engines.get(options)
        if engine is None:
            engine = self._engines[options] = CosyVoice3Engine.load(self.model_dir, options)
        return engine

    def bare(self) -> CosyVoice3Engine:
        """The engine without a cache directory (:data:`BARE_OPTIONS`)."""
        return self.get(BARE_OPTIONS)

    def preset(self, name: str) -> CosyVoice3Engine:
        """The engine of preset ``name`` on the shared cache (:func:`preset_options`)."""
        return self.get(preset_options(name, self.cache_dir))

    def close(self) -> None:
        """Stop what the engines started (a voice encoder process, if any)."""
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
