"""Work done once before the server listens, so that it never blocks the event loop later.

Python threads share one interpreter lock (GIL). Two steps of loading hold it for their whole
duration: the initialisation of C extension modules on first import (``onnx`` with
``ml_dtypes``, ``onnxruntime``, ``soundfile``...) and the parse of tokenizer.json by the Rust
``tokenizers`` library when done in one call (about 1 s of CPU on an x86 core for the 11 MB
file; no GIL release in ``Tokenizer.from_file``). Done in the loader thread while the server
listened, they held up ``describe`` answers for 1.7 s each on the tiny model, and
for up to 7 s on a loaded 2-core machine; Home Assistant waits 1 s. Done here, before
listening, they only lengthen the start.

What stays in the loader thread releases the GIL while it works (onnxruntime session creation
and runs, numpy, file I/O) or runs in child processes (derived graphs; new voices in the
engine's voice encoder process, ``EngineOptions.voice_process``). On the very first start,
which downloads the model, tokenizer.json does not exist before the download, so it is read
after it, while the server listens: the engine reads it in steps that each give the GIL back
(:mod:`..engine.text.tokenizer_load`; the longest step 0.27-0.34 s against 0.6-1.0 s for the
one-call parse on the 2-core x86 test machine).
"""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

from .settings import Settings

_LOGGER = logging.getLogger(__name__)

HEAVY_MODULES = (
    "numpy",
    "onnxruntime",
    "tokenizers",
    "soundfile",
    "kaldi_native_fbank",
    "onnx",  # optional (derived graphs, embedding table); skipped when not installed
    "wyoming_cosyvoice3.engine.pipeline",
)
"""Modules imported before listening (C extension initialisation holds the GIL)."""

TOKENIZER_FILE = "tokenizer.json"


def model_dir_guess(settings: Settings) -> Path:
    """Where the loader will find the model: ``--model-dir``, else the download directory."""
    if settings.model_dir is not None:
        return settings.model_dir
    return settings.download_dir or settings.data_dirs[0]


def preload(settings: Settings) -> float:
    """Import :data:`HEAVY_MODULES` and parse the model's tokenizer.json when it exists.

    The tokenizer lands in the engine's per-process cache
    (``wyoming_cosyvoice3.engine.model.load_tokenizer``, keyed by path, size and mtime), so the
    loader thread gets it without parsing. Problems are left to the loader, which reports them.

    Returns:
        Seconds spent.
    """
    started = time.monotonic()
    for name in HEAVY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as err:
            _LOGGER.debug("Not preloading %s: %s", name, err)
    tokenizer = model_dir_guess(settings) / TOKENIZER_FILE
    if tokenizer.is_file():
        from ..engine.errors import CosyVoiceError
        from ..engine.model import load_tokenizer

        try:
            load_tokenizer(tokenizer)
        except CosyVoiceError as err:
            _LOGGER.debug("Not preloading %s: %s", tokenizer, err)
    elapsed = time.monotonic() - started
    _LOGGER.debug("Preloaded modules and tokenizer in %.2f s", elapsed)
    return elapsed
