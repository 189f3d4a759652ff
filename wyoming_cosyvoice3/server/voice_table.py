"""The voice table: every catalog voice and, once prepared, its prompt.

This module is the only writer of the table (``tests/test_server_parts.py`` scans the server
for any other): the model loader has it prepare the catalog's voices at start
(:meth:`VoiceTable.prepare_all`), and the voice page (``web/admin.py``) has it re-read the
catalogs after a change (:meth:`VoiceTable.reload`) or drop a voice. A voice prepared either
way goes through :func:`prepare_slot`, so it behaves the same whichever way it arrived.

Readers (``describe``, requests, the page) see the table as a read-only mapping. A reload
builds a new dict and replaces the old one in one assignment, so a reader never sees half a
change, and a request already running keeps the voice it started with.
"""

from __future__ import annotations

import logging
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from pathlib import Path

from ..engine.errors import CosyVoiceError, VoiceNotFound
from ..engine.options import VoicePrompt
from .catalog import VoiceEntry, check_clip_size, load_catalogs, resolve_clip, with_model_dir
from .engine_port import Engine
from .protocol import VoiceRequest, short_repr
from .settings import Settings

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


def _primary(language: str) -> str:
    return language.replace("_", "-").split("-", 1)[0].lower()


def _valid_names(voices: Mapping[str, VoiceSlot]) -> str:
    names = [name for name, slot in voices.items() if slot.installed]
    if names:
        return ", ".join(names)
    problem = next((f"{name}: {slot.problem}" for name, slot in voices.items() if slot.problem),
                   "check the voice catalog and the log")
    return f"(none; {problem})"


def select_voice(
    request: VoiceRequest, voices: Mapping[str, VoiceSlot], default: VoiceSlot | None
) -> VoiceSlot:
    """Pick the voice: by name, else the first voice listing the language, else the default.

    A language matches exactly first (``en-US``), then by its primary subtag (``en``); voices
    whose first language matches are preferred over voices that merely list it.

    Raises:
        VoiceNotFound: unknown or unusable name, a speaker (no voice has speakers), an
            unsupported language, or no installed voice at all; the message lists the
            installed voices.
    """
    valid = _valid_names(voices)
    if request.name is not None:
        slot = voices.get(request.name)
        if slot is None:
            raise VoiceNotFound(f"unknown voice {short_repr(request.name)}; installed voices: "
                                f"{valid}")
        if not slot.installed:
            reason = slot.problem or "it is not prepared yet"
            raise VoiceNotFound(
                f"voice {request.name!r} is not available ({reason}); installed voices: {valid}"
            )
        if request.speaker is not None:
            raise VoiceNotFound(
                f"voice {request.name!r} has no speakers (got speaker {request.speaker!r}); "
                "leave 'speaker' out"
            )
        return slot
    if request.language is not None:
        wanted = request.language.replace("_", "-").lower()
        installed = [slot for slot in voices.values() if slot.installed]
        for match in (
            lambda s: s.entry.languages[0].lower() == wanted,
            lambda s: _primary(s.entry.languages[0]) == _primary(wanted),
            lambda s: any(lang.lower() == wanted for lang in s.entry.languages),
            lambda s: any(_primary(lang) == _primary(wanted) for lang in s.entry.languages),
        ):
            found = next((slot for slot in installed if match(slot)), None)
            if found is not None:
                return found
        languages = sorted({lang for slot in installed for lang in slot.entry.languages})
        raise VoiceNotFound(
            f"no voice speaks {request.language!r}; languages: {', '.join(languages) or '-'}; "
            f"installed voices: {valid}"
        )
    if default is None:
        raise VoiceNotFound(f"no voice is installed; installed voices: {valid}")
    return default


class VoiceTable(Mapping[str, VoiceSlot]):
    """The server's voices by name, in catalog order (a read-only mapping to everyone else).

    Args:
        settings: the resolved settings (the catalogs: ``data_dirs``, ``model_dir``,
            ``voices_file``; ``--voice``; ``max_clip_bytes``).
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        entries = load_catalogs(settings.data_dirs, settings.model_dir, settings.voices_file)
        self._slots: dict[str, VoiceSlot] = {e.name: VoiceSlot(e, None, e.problem)
                                             for e in entries}
        self._model_dir: Path | None = settings.model_dir
        """Where relative clip paths of the model's own catalog resolve (the located model)."""

    # --- reading: every call reads the current dict once, so a swap never splits it ---------

    def __getitem__(self, name: str) -> VoiceSlot:
        return self._slots[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def keys(self) -> KeysView[str]:
        return self._slots.keys()

    def values(self) -> ValuesView[VoiceSlot]:
        return self._slots.values()

    def items(self) -> ItemsView[str, VoiceSlot]:
        return self._slots.items()

    def default(self) -> VoiceSlot | None:
        """``--voice`` when usable, else the first installed voice (or None)."""
        slots = self._slots
        wanted = self._settings.voice
        if wanted and wanted in slots and slots[wanted].installed:
            return slots[wanted]
        return next((slot for slot in slots.values() if slot.installed), None)

    def select(self, request: VoiceRequest) -> VoiceSlot:
        """The voice that answers ``request`` (:func:`select_voice`).

        Raises:
            VoiceNotFound: see :func:`select_voice`.
        """
        return select_voice(request, self._slots, self.default())

    def installed_names(self) -> list[str]:
        """Names of the voices a request can use, in catalog order."""
        return [name for name, slot in self._slots.items() if slot.installed]

    # --- writing: the only code that changes the table -----------------------------------

    def prepare_all(self, engine: Engine, model_dir: Path) -> None:
        """Prepare every catalog voice with ``engine`` (blocking; the loader thread at start).

        The slots are updated in place, so the table keeps its slots and order and
        ``describe`` shows each voice's problem as soon as it is known.
        """
        self._model_dir = model_dir
        slots = self._slots
        entries = with_model_dir([slot.entry for slot in slots.values()], model_dir)
        for entry in entries:
            done = prepare_slot(engine, entry, self._settings.limits.max_clip_bytes)
            slot = slots[entry.name]
            slot.entry, slot.prompt, slot.problem = done.entry, done.prompt, done.problem

    def reload(self, engine: Engine) -> None:
        """Re-read every catalog as at start and swap the table in one assignment (blocking:
        run it in a worker thread). Voices whose entry did not change keep their prepared
        prompts; new or changed ones are prepared with ``engine``."""
        settings = self._settings
        current = dict(self._slots)
        entries = load_catalogs(settings.data_dirs, settings.model_dir, settings.voices_file)
        if self._model_dir is not None:
            entries = with_model_dir(entries, self._model_dir)
        slots: dict[str, VoiceSlot] = {}
        for entry in entries:
            old = current.get(entry.name)
            slots[entry.name] = (old if old is not None and old.entry == entry
                                 else prepare_slot(engine, entry, settings.limits.max_clip_bytes))
        self._slots = slots

    def drop(self, name: str) -> None:
        """Remove a voice without re-reading the catalogs (when no engine was loaded, nothing
        is prepared: there is nothing to keep or prepare)."""
        self._slots = {n: s for n, s in self._slots.items() if n != name}


__all__ = ["VoiceSlot", "VoiceTable", "prepare_slot", "select_voice"]
