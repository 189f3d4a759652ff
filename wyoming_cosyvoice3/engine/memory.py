"""Returning freed heap memory to the operating system.

Dropping a session frees its weights but not the process's resident memory;
:func:`return_freed_memory` gives the freed heap back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

_trim_lock = threading.Lock()
_trim: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_looked_up = False


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _trim, _looked_up
    with _trim_lock:
        if not _looked_up:
            _looked_up = True
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _trim = getattr(libc, "malloc_trim", None)
            except OSError as err:
                log.debug("no C library to trim: %s", err)
        return _trim


def return_freed_memory() -> bool:
    """Ask the C library to unmap freed heap pages; True when it released some.

    Loading an onnxruntime session parses the whole ONNX file on the heap; dropping a session
    (the voice encoders after a voice is prepared, the streaming DiT's time graph) frees its
    weights, but glibc keeps freed heap pages mapped, so the process's resident set (RSS) does
    not shrink. ``malloc_trim(0)`` (glibc, ``man 3 malloc_trim``) releases them. Measured on the
    full-size model: after preparing a voice, RSS 2.14 GB -> 0.80 GB (speech_tokenizer_v3.onnx
    alone holds 0.97 GB of fp32 weights while it is loaded).

    On other C libraries (musl, macOS, Windows) this is a no-op.

    Safe to call at any time from any thread (glibc locks its arenas); takes milliseconds.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))
