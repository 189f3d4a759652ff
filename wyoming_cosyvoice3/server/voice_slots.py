"""A catalog voice as the server holds it, and how one is prepared for synthesis.

The loader prepares every catalog voice this way at start (``runtime.py``) and the voice page
prepares the voices it adds or changes the same way (``web/admin.py``), so a voice behaves the
same whichever way it arrived.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine.errors import CosyVoiceError
from ..engine.options import VoicePrompt
from .catalog import VoiceEntry, check_clip_size, resolve_clip
from .engine_port import Engine

_LOGGER = logging.getLogger(__name__)


@dataclass
class VoiceSlot:
    """A catalog voice and, once prepared, its prompt (``prompt`` None = not installed)."""

    entry: VoiceEntry
    prompt: VoicePrompt | None = None
    problem: str | None = None

    @property
    def installed(self) -> bool:
        return self.prompt is not None


def prepare_slot(engine: Engine, entry: VoiceEntry, max_clip_bytes: int) -> VoiceSlot:
    """Locate the entry's clip, check its size and let the engine prepare it (blocking: run
    it in a worker thread).

    Returns:
        A slot with ``prompt`` set, or with ``problem`` saying why the voice is disabled (an
        entry that already has a problem is returned unprepared and not logged again; any
        other refusal is logged once).
    """
    if entry.problem:
        return VoiceSlot(entry, None, entry.problem)
    try:
        clip = resolve_clip(entry)
        check_clip_size(clip, max_clip_bytes)
        prompt = engine.prepare_voice(clip, entry.transcript, entry.instruction, entry.name)
    except (ValueError, OSError, CosyVoiceError) as err:
        _LOGGER.warning("Voice %r (%s) is disabled: %s", entry.name, entry.source, err)
        return VoiceSlot(entry, None, str(err))
    return VoiceSlot(entry, prompt)
